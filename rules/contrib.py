"""onnxruntime contrib ops that models optimized by onnxruntime's transformer optimizer contain
(domain ``com.microsoft``, opset 1): Gelu FastGelu BiasGelu QuickGelu FusedMatMul
SkipLayerNormalization SkipSimplifiedLayerNormalization SimplifiedLayerNormalization BiasAdd
BiasSoftmax.

Each is a fusion of standard ops, and each backward is written in standard ai.onnx ops:

* the GELU family is ``dx = dy * f'(u)`` with ``u`` the input plus the optional bias, and the
  bias gradient ``dy`` summed over every axis but the last;
* FusedMatMul is ``alpha * op(A) @ op(B)``: MatMul's rule on the transposed operands, its
  gradients transposed back;
* the normalizations standardize ``s = input + skip + bias`` over the last axes; their backward
  is that of LayerNormalization (or of RMS normalization) plus the gradient of the
  ``input_skip_bias_sum`` output;
* BiasSoftmax is Softmax over the flattened axes ``[axis, rank)`` of ``data + bias``, the bias
  rows reused for consecutive (inner) or cyclic (outer) groups of rows.

onnxruntime registers SimplifiedLayerNormalization in the ai.onnx domain (version 1; the
transformer optimizer writes it there), so its rule is registered for both domains. onnx's
shape inference knows none of these ops, so their outputs reach the rules without dtype or
shape: the rules take dtypes from the inputs and fall back to Shape-based subgraphs.
"""

from __future__ import annotations

import types

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, dims_of, optional_input
from gradbuilder.rules.activations import gelu_slope, gelu_tanh_slope
from gradbuilder.rules.linalg import matmul
from gradbuilder.rules.helpers import cast_to, compute_type, first_typed, wants
from gradbuilder.rules.norm_stats import Moments, trailing_axes
from gradbuilder.rules.sizes import static_dims

MS = "com.microsoft"


# ----------------------------------------------------------------------------- helpers


def _padded(dys, count):
    """The output gradients as a list of ``count`` entries (None for absent outputs)."""
    return (list(dys) + [None] * count)[:count]


def _sum_to(e, g, like):
    """``g`` summed to the shape of ``like``. A 1-D ``like`` (a bias over the last axis) is a
    Reshape to (-1, C) and one ReduceSum, whatever the rank of ``g``."""
    d = dims_of(like)
    if d is not None and len(d) == 1 and not static_dims(dims_of(g)):
        last = e.ints([-1, d[0]]) if isinstance(d[0], int) else e.Concat(e.ints([-1]), e.Shape(like), axis=0)
        out = e.reduce("ReduceSum", e.Reshape(g, last), [0], keepdims=False)
        e.typed(out, like.dtype, d)
        return out
    return e.unbroadcast(g, like)


# ----------------------------------------------------------------------------- GELU family


def _biased(n, dys, needs, e, slope):
    """y = f(x + bias) with an optional 1-D bias: dx = dy * f'(x + bias), dbias = sum of dx
    over every axis but the last."""
    x, bias = n.inputs[0], optional_input(n, 1)
    u = x if bias is None else x + bias
    dx = dys[0] * slope(e, u)
    grads = [dx if needs[0] else None, _sum_to(e, dx, bias) if wants(needs, 1) else None]
    return grads[: len(n.inputs)]


@register("Gelu", domain=MS)
def gelu(n, dys, needs, e):
    """y = x Phi(x) (exact, erf form):  dx = dy * (Phi(x) + x phi(x))."""
    return [dys[0] * gelu_slope(e, n.inputs[0])]


@register("BiasGelu", domain=MS)
def bias_gelu(n, dys, needs, e):
    """C = gelu(A + B) (erf form), B a 1-D bias over the last axis:
    dA = dy * gelu'(A + B), dB = dA summed over every axis but the last."""
    return _biased(n, dys, needs, e, gelu_slope)


@register("FastGelu", domain=MS)
def fast_gelu(n, dys, needs, e):
    """Y = u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))/2 with u = X (+ bias):
    dX = dY * (tanh-GELU)'(u), dbias = dX summed over every axis but the last."""
    return _biased(n, dys, needs, e, gelu_tanh_slope)


@register("QuickGelu", domain=MS)
def quick_gelu(n, dys, needs, e):
    """y = x sigmoid(alpha x) (alpha = 1.702 by default):
    dx = dy * (s (1 + alpha x (1 - s))), s = sigmoid(alpha x)."""
    (x,) = n.inputs
    alpha = float(attr(n, "alpha", 1.702))
    s = e.Sigmoid(alpha * x)
    return [dys[0] * (s * (1 + alpha * x * (1 - s)))]


# ----------------------------------------------------------------------------- FusedMatMul


def _operand_perm(rank, trans, trans_batch):
    """The permutation FusedMatMul applies to an operand of ``rank``: transBatch moves axis 0
    behind the other batch axes (to be the rows), trans swaps the two matrix axes; None for
    the identity (and for vectors, which neither attribute changes)."""
    if rank < 2:
        return None
    if trans_batch:
        perm = list(range(1, rank - 1)) + ([rank - 1, 0] if trans else [0, rank - 1])
    else:
        perm = list(range(rank - 2)) + ([rank - 1, rank - 2] if trans else [rank - 2, rank - 1])
    return None if perm == list(range(rank)) else perm


def _unknown_rank(which, v):
    return GradientRuleError(
        f"FusedMatMul gradient needs the rank of input {which} '{v.name}', which shape inference left "
        "unknown (onnx infers no com.microsoft op; give the model's values shapes, e.g. with "
        "onnxruntime's symbolic shape inference)"
    )


def _operand(e, v, trans, trans_batch, which):
    """(the operand as FusedMatMul uses it, the permutation applied or None)."""
    dims = dims_of(v)
    if dims is None:
        raise _unknown_rank(which, v)
    perm = _operand_perm(len(dims), trans, trans_batch)
    return (v, None) if perm is None else (e.Transpose(v, perm=perm), perm)


def _rows_first(e, v, like, axis):
    """``v`` reshaped to (-1, dim ``axis`` of the 2-D ``like``)."""
    d = dims_of(like)[axis]
    if isinstance(d, int):
        return e.Reshape(v, [-1, d])
    return e.Reshape(v, e.Concat(e.ints([-1]), e.Gather(e.Shape(like), e.ints([axis]), axis=0), axis=0))


@register("FusedMatMul", domain=MS)
def fused_matmul(n, dys, needs, e):
    """Y = alpha * A' @ B' (MatMul semantics, batch broadcast), A' = A permuted by transA (swap
    the last two axes) and transBatchA (axis 0 becomes the row axis, [1..r-2, 0, r-1], and the
    column axis with transA, [1..r-2, r-1, 0]); B' likewise.
    dA' = alpha dY @ B'^T, dB' = alpha A'^T @ dY (MatMul's rule), permuted back.
    An A of unknown rank (activations after other contrib ops) times a 2-D B':
    dA = alpha dY @ B'^T, dB' = alpha A2^T @ dY2 with A, dY flattened to (-1, k), (-1, n)."""
    a, b = n.inputs
    alpha = float(attr(n, "alpha", 1.0))
    ta, tba = attr(n, "transA", 0), attr(n, "transBatchA", 0)
    b2, pb = _operand(e, b, attr(n, "transB", 0), attr(n, "transBatchB", 0), "B")
    dy = dys[0] if alpha == 1.0 else dys[0] * e.scalar(alpha, first_typed(dys[0], a, b))
    if dims_of(a) is None:
        if ta or tba or len(dims_of(b2)) != 2:
            raise _unknown_rank("A", a)
        da = dy @ e.Transpose(b2, perm=[1, 0]) if needs[0] else None
        db = e.Gemm(_rows_first(e, a, b2, 0), _rows_first(e, dy, b2, 1), transA=1) if needs[1] else None
        pa = None
    else:
        a2, pa = _operand(e, a, ta, tba, "A")
        # MatMul's rule only reads the node's inputs: hand it the permuted operands.
        da, db = matmul(types.SimpleNamespace(inputs=(a2, b2)), [dy], needs, e)
    if da is not None and pa is not None:
        da = e.Transpose(da, perm=[int(i) for i in np.argsort(pa)])
    if db is not None and pb is not None:
        db = e.Transpose(db, perm=[int(i) for i in np.argsort(pb)])
    return [da, db]


# ----------------------------------------------------------------------------- normalizations


def _skip_norm(n, dys, needs, e, centered):
    """The SkipLayerNormalization family: s = input + skip (+ bias), y = xhat(s) gamma (+ beta)
    over the last axis; outputs y, mean, inv_std_var, input_skip_bias_sum = s."""
    x, skip, gamma = n.inputs[:3]
    beta, bias = (optional_input(n, 3), optional_input(n, 4)) if centered else (None, optional_input(n, 3))
    dy, dmu, dr, dsum = _padded(dys, 4)
    if not centered:
        dmu = None  # SkipSimplifiedLayerNormalization's mean output is not computed (zeros)
    s = x + skip
    if bias is not None:
        s = s + bias
    e.typed(s, x.dtype, dims_of(x))
    ds = xhat = None
    if dy is not None or dmu is not None or dr is not None:
        ct = compute_type(x)
        st = Moments(e, cast_to(e, s, ct), [-1], float(attr(n, "epsilon", 1e-12)), centered, form="mean")
        xhat = st.xhat
        g = cast_to(e, dy * gamma, ct) if dy is not None else None
        ds = cast_to(e, st.backward(g, cast_to(e, dmu, ct), cast_to(e, dr, ct)), x.dtype)
    if dsum is not None:
        ds = dsum if ds is None else ds + dsum
    grads = [None] * len(n.inputs)
    if ds is not None:
        grads[0] = ds if needs[0] else None
        grads[1] = e.unbroadcast(ds, skip) if needs[1] else None
        if bias is not None:
            k = 4 if centered else 3
            grads[k] = _sum_to(e, ds, bias) if needs[k] else None
    if dy is not None:
        if needs[2]:
            grads[2] = _sum_to(e, dy * cast_to(e, xhat, gamma.dtype), gamma)
        if beta is not None and needs[3]:
            grads[3] = _sum_to(e, dy, beta)
    return grads


@register("SkipLayerNormalization", domain=MS)
def skip_layer_norm(n, dys, needs, e):
    """s = input + skip + bias, y = (s - mu) r gamma + beta over the last axis,
    r = 1/sqrt(var + epsilon) (epsilon = 1e-12 by default; statistics in float for 16-bit
    inputs); outputs y, mean = mu, inv_std_var = r, input_skip_bias_sum = s.
    ds = r (g - xhat mean(g xhat) - mean(g)) + (dmean - dinv_std_var r^2 xhat)/M
    + dinput_skip_bias_sum with g = dy gamma; dinput = ds, dskip and dbias = ds summed to their
    shapes; dgamma = sum(dy xhat), dbeta = sum(dy) over every axis but the last."""
    return _skip_norm(n, dys, needs, e, centered=True)


@register("SkipSimplifiedLayerNormalization", domain=MS)
def skip_simplified_layer_norm(n, dys, needs, e):
    """s = input + skip + bias, y = s r gamma over the last axis, r = 1/sqrt(mean(s^2) + eps)
    (epsilon = 1e-12 by default); outputs y, mean (not computed: no gradient), inv_std_var = r,
    input_skip_bias_sum = s.
    ds = r (g - xhat mean(g xhat)) - dinv_std_var r^2 xhat/M + dinput_skip_bias_sum with
    g = dy gamma; dgamma = sum(dy xhat) over every axis but the last."""
    return _skip_norm(n, dys, needs, e, centered=False)


def _simplified_layer_norm(n, dys, needs, e):
    """Y = X r scale, r = 1/sqrt(mean(X^2) + epsilon) over the axes [axis, rank) (axis = -1,
    epsilon = 1e-5 by default), in stash_type (float) for 16-bit X; outputs Y, inv_std_var = r.
    dX = r (g - xhat mean(g xhat)) - dinv_std_var r^2 xhat/M with g = dY scale;
    dscale = dY xhat summed to scale's shape."""
    x, scale = n.inputs[:2]
    dy, dr = _padded(dys, 2)
    ct = compute_type(x, ir.DataType(attr(n, "stash_type", 1)))
    st = Moments(e, cast_to(e, x, ct), trailing_axes(e, x, attr(n, "axis", -1)),
                 float(attr(n, "epsilon", 1e-5)), centered=False, form="mean")
    dx = dscale = None
    if needs[0]:
        g = cast_to(e, dy, ct) * cast_to(e, scale, ct) if dy is not None else None
        dx = cast_to(e, st.backward(g, None, cast_to(e, dr, ct)), x.dtype)
    if needs[1] and dy is not None:
        dscale = _sum_to(e, dy * cast_to(e, st.xhat, scale.dtype), scale)
    return [dx, dscale]


register("SimplifiedLayerNormalization")(_simplified_layer_norm)
register("SimplifiedLayerNormalization", domain=MS)(_simplified_layer_norm)


# ----------------------------------------------------------------------------- BiasAdd, BiasSoftmax


@register("BiasAdd", domain=MS)
def bias_add(n, dys, needs, e):
    """Y = X + bias + skip, X and skip (N, S, C) (the same shape), bias (C):  dX = dskip = dY,
    dbias = dY summed over N and S."""
    (dy,) = dys
    return [dy if needs[0] else None, _sum_to(e, dy, n.inputs[1]) if needs[1] else None,
            dy if needs[2] else None]


def _row_size(e, x, axis):
    """E = the number of elements of x from ``axis`` on (an int, or a 1-D int64 value)."""
    d = dims_of(x)
    if static_dims(d):
        return int(np.prod(d[axis:])) if d else 1
    return e.reduce("ReduceProd", e.Shape(x, axis), None, keepdims=True)


@register("BiasSoftmax", domain=MS)
def bias_softmax(n, dys, needs, e):
    """Y = softmax(data + bias) over the flattened axes [axis, rank) (axis = 1 by default).
    With data as R rows of E elements and bias as Rb rows, row i adds bias row i // (R / Rb)
    (is_inner_broadcast = 1; also the older form, whose broadcast_axis attribute says which axes
    the bias is broadcast along) or i % Rb (is_inner_broadcast = 0).
    dZ = Y (dY - sum(dY Y) over the row), ddata = dZ, dbias = dZ summed over the rows that share
    a bias row."""
    x, b = n.inputs
    (y,) = n.outputs
    (dy,) = dys
    axis = int(attr(n, "axis", 1))
    inner = attr(n, "is_inner_broadcast", None)
    inner = True if inner is None else bool(inner)  # the older form (broadcast_axis) is inner
    axes = trailing_axes(e, x, axis)
    dz = y * (dy - e.reduce("ReduceSum", dy * y, axes, keepdims=True))
    e.typed(dz, x.dtype, dims_of(x))
    db = None
    if needs[1]:
        elems = _row_size(e, x, axis)
        bd = dims_of(b)
        if isinstance(elems, int) and static_dims(bd):
            rows = int(np.prod(bd)) // elems
            grouped = e.Reshape(dz, [rows, -1, elems] if inner else [-1, rows, elems])
            db = e.Reshape(e.reduce("ReduceSum", grouped, [1 if inner else 0], keepdims=False), list(bd))
        else:
            ev = e.ints([elems]) if isinstance(elems, int) else elems
            rows = e.Reshape(e.Size(b), [1]) / ev
            shape3 = e.Concat(rows, e.ints([-1]), ev, axis=0) if inner else e.Concat(e.ints([-1]), rows, ev, axis=0)
            summed = e.reduce("ReduceSum", e.Reshape(dz, shape3), [1 if inner else 0], keepdims=False)
            db = e.Reshape(summed, e.Shape(b))
        e.typed(db, b.dtype, bd)
    return [dz if needs[0] else None, db]
