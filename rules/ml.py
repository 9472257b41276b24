"""ai.onnx.ml ops with a float path: ArrayFeatureExtractor Scaler Normalizer Imputer
FeatureVectorizer LinearRegressor LinearClassifier, and the piecewise constant Binarizer
TreeEnsemble TreeEnsembleRegressor TreeEnsembleClassifier OneHotEncoder LabelEncoder.

Several of these ops output float whatever the input type (double included): every rule
casts the output gradient to the input's dtype first and works in that dtype. Where the
specification leaves the behaviour open, the rules follow onnxruntime's CPU kernels (the
runtime the gradient graph is meant for); each docstring says where onnx's reference
evaluator computes something else.
"""

from __future__ import annotations

import math

import numpy as np

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, constant_of, dims_of
from gradbuilder.rules.helpers import const_like, text_attr, zero_gradients

ML = "ai.onnx.ml"


# ----------------------------------------------------------------------------- helpers


def _as_input(e, g, x):
    """``g`` reshaped to the shape of ``x`` when their ranks may differ."""
    gd, xd = dims_of(g), dims_of(x)
    if gd is not None and xd is not None and len(gd) == len(xd):
        return g
    if xd is not None and all(isinstance(d, int) for d in xd):
        return e.Reshape(g, list(xd))
    return e.Reshape(g, e.Shape(x))


# ----------------------------------------------------------------------------- piecewise constant


@register(["Binarizer", "TreeEnsemble", "TreeEnsembleRegressor", "TreeEnsembleClassifier", "OneHotEncoder",
           "LabelEncoder"], domain=ML)
def piecewise_constant(n, dys, needs, e):
    """Piecewise constant in X (a threshold, tree splits, a category lookup): the derivative
    is zero wherever it exists, so float inputs get a zero gradient."""
    return zero_gradients(n, needs, e)


# ----------------------------------------------------------------------------- selection


def _last_dim(e, x):
    """The size of ``x``'s last axis as an int64 scalar (a constant when known)."""
    dims = dims_of(x)
    if dims and isinstance(dims[-1], int):
        return e.const(np.array(dims[-1], dtype=np.int64))
    return e.Squeeze(e.Shape(x, -1), [0])


@register("ArrayFeatureExtractor", domain=ML)
def array_feature_extractor(n, dys, needs, e):
    """Z[..., k] = X[..., idx[k]] over the flattened indices (a 1-D X gives Z of shape
    (1, K)). With M[k, c] = (idx[k] == c) (negative indices count from the end)::

        dX = dZ @ M        (repeated indices add up)
    """
    x, idx = n.inputs
    dz = e.CastLike(dys[0], x)
    dims = dims_of(x)
    known = constant_of(idx)
    if known is not None and dims and isinstance(dims[-1], int):
        c = dims[-1]
        flat = np.asarray(known, dtype=np.int64).reshape(-1)
        onehot = const_like(e, (flat[:, None] % c) == np.arange(c)[None, :], x)
    else:
        c = _last_dim(e, x)
        zero = e.const(np.array(0, dtype=np.int64))
        flat = e.Reshape(idx, [-1])
        flat = e.Where(e.Less(flat, zero), flat + c, flat)
        cols = e.Range(zero, c, e.const(np.array(1, dtype=np.int64)))
        onehot = e.CastLike(e.Equal(e.Unsqueeze(flat, [1]), cols), x)
    dx = dz @ onehot
    return _as_input(e, dx, x) if dims is None or len(dims) < 2 else dx, None


@register("FeatureVectorizer", domain=ML)
def feature_vectorizer(n, dys, needs, e):
    """Y = the inputs side by side, each X_i seen as (N, C_i) (a 1-D X_i as (1, C_i), a
    higher rank one flattened after axis 0) and cut or zero-padded to inputdimensions[i]
    columns. dX_i = its columns of dY, cut back or zero-padded to C_i, in X_i's shape."""
    widths = attr(n, "inputdimensions", [])
    dy = dys[0]
    grads, offset = [], 0
    for x, need, width in zip(n.inputs, needs, widths):
        if need:
            part = e.Slice(dy, e.ints([offset]), e.ints([offset + width]), e.ints([1]))
            grads.append(_as_input(e, e.CastLike(_fit_columns(e, part, width, x, dy), x), x))
        else:
            grads.append(None)
        offset += width
    return grads


def _fit_columns(e, part, width, x, dy):
    """``part`` (N, width) cut or zero-padded to the C columns of ``x``."""
    dims = dims_of(x)
    c = None
    if dims is not None and dims and all(isinstance(d, int) for d in (dims if len(dims) == 1 else dims[1:])):
        c = int(np.prod(dims if len(dims) == 1 else dims[1:]))
    if c is not None:
        if c < width:
            return e.Slice(part, e.ints([0]), e.ints([c]), e.ints([1]))
        if c > width:
            return e.Pad(part, e.ints([0, 0, 0, c - width]))
        return part
    # C = size(X) / N, N the rows of dY (every input has the batch size of the first one).
    rows = e.Slice(e.Shape(dy), e.ints([0]), e.ints([1]), e.ints([0]))
    c = e.Reshape(e.Size(x), [1]) / rows
    extra = e.Max(c - e.ints([width]), e.ints([0]))
    padded = e.Pad(part, e.Concat(e.ints([0, 0, 0]), extra, axis=0))
    return e.Slice(padded, e.ints([0]), c, e.ints([1]))


# ----------------------------------------------------------------------------- element-wise


@register("Scaler", domain=ML)
def scaler(n, dys, needs, e):
    """Y = (X - offset) * scale along the last axis (one value, or one per feature):
    dX = dY * scale."""
    x = n.inputs[0]
    dy = e.CastLike(dys[0], x)
    scale = attr(n, "scale", [])
    if not scale:
        return (dy,)
    return (dy * const_like(e, scale if len(scale) > 1 else scale[0], x),)


@register("Imputer", domain=ML)
def imputer(n, dys, needs, e):
    """Y = X, except that elements equal to replaced_value_float (NaN: the NaN elements) are
    replaced by constants: dX = dY where kept, 0 where replaced."""
    x = n.inputs[0]
    dy = e.CastLike(dys[0], x)
    value = attr(n, "replaced_value_float", 0.0)
    replaced = e.IsNaN(x) if math.isnan(value) else e.Equal(x, e.scalar(value, x))
    return (e.Where(replaced, e.scalar(0.0, x), dy),)


@register("Normalizer", domain=ML)
def normalizer(n, dys, needs, e):
    """Each row (last axis) divided by its norm d: MAX the largest value, L1 sum|x|, L2
    sqrt(sum x^2); a row whose d is 0 is copied unchanged. With y = x/d and w = dd/dx (the
    maximum's one-hot, shared on ties; sign(x); y)::

        dx = (dy - w * sum(dy*y)) / d        (dx = dy on the copied rows)

    MAX divides by the largest value as the specification and onnxruntime do; onnx's
    reference evaluator divides by the largest magnitude instead.
    """
    x = n.inputs[0]
    dy = e.CastLike(dys[0], x)
    norm = attr(n, "norm", "MAX")
    if norm == "MAX":
        d = e.reduce("ReduceMax", x, [-1])
    elif norm == "L1":
        d = e.reduce("ReduceSum", e.Abs(x), [-1])
    else:
        d = e.Sqrt(e.reduce("ReduceSum", x * x, [-1]))
    y = x / d
    if norm == "MAX":
        hit = e.CastLike(e.Equal(x, d), x)
        w = hit / e.reduce("ReduceSum", hit, [-1])
    else:
        w = e.Sign(x) if norm == "L1" else y
    dx = (dy - w * e.reduce("ReduceSum", dy * y, [-1])) / d
    return (e.Where(e.Equal(d, e.scalar(0.0, x)), dy, dx),)


# ----------------------------------------------------------------------------- linear models


def _weights(n, x, n_targets: int):
    """(W (targets, C), b (targets,) or None) of a linear model from its attributes."""
    coef = np.asarray(attr(n, "coefficients", []), dtype=np.float64)
    dims = dims_of(x)
    c = dims[-1] if dims and isinstance(dims[-1], int) else len(coef) // max(n_targets, 1)
    w = coef[: n_targets * c].reshape(n_targets, c)
    b = attr(n, "intercepts", [])
    return w, (np.asarray(b, dtype=np.float64) if len(b) == n_targets else None)


def _scores(e, x, w, b):
    """S = X W^T + b, X seen as (N, C)."""
    dims = dims_of(x)
    xm = x if dims is not None and len(dims) == 2 else e.Reshape(x, [-1, w.shape[1]])
    s = xm @ const_like(e, w.T, x)
    return s if b is None else s + const_like(e, b, x)


def _from_scores(e, ds, w, x):
    """dX = dS @ W, in X's shape."""
    return _as_input(e, ds @ const_like(e, w, x), x)


_A = 0.147  # the constant of the erf^-1 approximation onnxruntime and onnx's reference use


def _probit_grad(e, dz, z, s):
    """Z = sqrt(2) * erfinv(2S - 1), erfinv as the runtimes compute it (Winitzki's
    approximation: with w = 2S-1, L = log(1-w^2), v = 2/(pi a) + 0.5 L, R = sqrt(v^2 - L/a),
    erfinv(w) = sign(w) sqrt(R - v)). Its exact derivative::

        dZ/dS = -4 w K / ((1 - w^2) Z),   K = (v - 1/a) / (2R) - 0.5

    (sqrt(2 pi) at w = 0, where Z = 0 too)."""
    w = 2 * s - 1
    q = 1 - w * w
    ln = e.Log(q)
    v = 2.0 / (math.pi * _A) + 0.5 * ln
    r = e.Sqrt(v * v - ln / _A)
    k = (v - 1.0 / _A) / (2 * r) - 0.5
    at_zero = e.Equal(z, e.scalar(0.0, z))
    safe_z = e.Where(at_zero, e.scalar(1.0, z), z)
    slope = -4 * w * k / (q * safe_z)
    slope = e.Where(at_zero, e.scalar(math.sqrt(2.0 * math.pi), z), slope)
    return dz * slope


def _transform_grad(e, mode, dz, z, scores, n_targets: int):
    """dS for Z = post_transform(S) along the last axis, as onnxruntime applies it: with one
    target only PROBIT changes the score. ``scores()`` recomputes S (PROBIT, SOFTMAX_ZERO)::

        LOGISTIC      dS = dZ z (1 - z)
        SOFTMAX       dS = z (dZ - sum(dZ z))
        SOFTMAX_ZERO  the softmax of the scores with |s| > 1e-7 (m), the others give s/T
                      with T = sum(m exp(s)):  dS = dZ (m ? z : 1/T) - m z sum(dZ z)
                      (onnx's reference evaluator also adds the s of the others into T)
        PROBIT        see _probit_grad
    """
    if mode == "PROBIT":
        return _probit_grad(e, dz, z, scores())
    if n_targets < 2 or mode == "NONE":
        return dz
    if mode == "LOGISTIC":
        return dz * (z * (1 - z))
    dot = e.reduce("ReduceSum", dz * z, [-1])
    if mode == "SOFTMAX":
        return z * (dz - dot)
    if mode == "SOFTMAX_ZERO":
        s = scores()
        kept = e.Greater(e.Abs(s), e.scalar(1e-7, z))
        top = e.reduce("ReduceMax", s, [-1])
        total = e.reduce("ReduceSum", e.CastLike(kept, z) * e.Exp(s - top), [-1])
        inv_t = e.Exp(-top) / total
        return dz * e.Where(kept, z, inv_t) - e.CastLike(kept, z) * z * dot
    raise GradientRuleError(f"unknown post_transform '{mode}'")


@register("LinearRegressor", domain=ML)
def linear_regressor(n, dys, needs, e):
    """S = X W^T + b (W: coefficients as (targets, C); b: intercepts, used when there is one
    per target), Y = post_transform(S) as onnxruntime applies it (see _transform_grad; onnx's
    reference evaluator implements NONE only). dX = dS @ W."""
    x = n.inputs[0]
    targets = attr(n, "targets", 1)
    w, b = _weights(n, x, targets)
    dz = e.CastLike(dys[0], x)
    mode = text_attr(n, "post_transform", "NONE")
    ds = _transform_grad(e, mode, dz, e.CastLike(n.outputs[0], x), lambda: _scores(e, x, w, b), targets)
    return (_from_scores(e, ds, w, x),)


@register("LinearClassifier", domain=ML)
def linear_classifier(n, dys, needs, e):
    """Scores S = X W^T + b, one column per intercept; Z = post_transform(S) (the labels Y
    carry no gradient). dX = dS @ W, with dS from _transform_grad when there are several
    classes. With a single score column and two class labels onnxruntime writes two columns,
    Z = [1 - s, s], or [sigmoid(-s), sigmoid(s)] for LOGISTIC::

        dS = dZ1 - dZ0    (LOGISTIC: times z0 z1)

    (onnx's reference evaluator writes [-s, s] and transforms both instead; PROBIT leaves
    half of onnxruntime's Z unwritten, so it has no gradient.) A single column without
    labels: only PROBIT transforms it."""
    x = n.inputs[0]
    dz = dys[1] if len(dys) > 1 else None
    if dz is None:
        return (None,)
    intercepts = attr(n, "intercepts", [])
    labels = attr(n, "classlabels_ints", None) or attr(n, "classlabels_strings", None) or []
    if intercepts:
        targets = len(intercepts)
    else:
        dims = dims_of(x)
        if not dims or not isinstance(dims[-1], int):
            raise GradientRuleError("LinearClassifier without intercepts needs a static feature count")
        targets = len(attr(n, "coefficients", [])) // dims[-1]
    w, b = _weights(n, x, targets)
    mode = text_attr(n, "post_transform", "NONE")
    dz = e.CastLike(dz, x)
    z = e.CastLike(n.outputs[1], x)
    if targets == 1 and len(labels) == 2:
        if mode == "PROBIT":
            raise GradientRuleError("binary LinearClassifier with post_transform PROBIT: onnxruntime leaves "
                                    "half of the scores unwritten, so they have no gradient")
        ds = dz @ const_like(e, [[-1.0], [1.0]], x)
        if mode == "LOGISTIC":
            ds = ds * e.reduce("ReduceProd", z, [-1])
    else:
        ds = _transform_grad(e, mode, dz, z, lambda: _scores(e, x, w, b), targets)
    return (_from_scores(e, ds, w, x),)
