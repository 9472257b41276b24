"""Small normalizations and Lp pools: LpNormalization MeanVarianceNormalization LRN
RMSNormalization GlobalLpPool LpPool.

The normalizations divide x by a statistic s of a group of elements; each gradient is
``dy / s`` minus the part that flows through s, written as a mean or sum over the group.
The Lp pools are norms of windows: ``y = (sum |x|^p)^(1/p)``, so
``dx = sign(x) |x|^(p-1) * (the sum, over the windows holding x, of dy * y^(1-p))``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, dims_of, unknown_rank
from gradbuilder.rules.norm_stats import Moments, compute_type, trailing_axes
from gradbuilder.rules.sizes import cast_to, dim, is_static, reshape_to
from gradbuilder.rules.windows import conv_transpose_fitted, window_axes

# ----------------------------------------------------------------------------- helpers


def _c(e, value, like):
    return e.scalar(value, like=like)


def _rank(n, *values, fallback=None) -> int:
    for v in values:
        d = dims_of(v) if v is not None else None
        if d is not None:
            return len(d)
    if fallback is not None:
        return fallback
    raise unknown_rank(values[0], n.op_type)


def _mean(e, v, axes):
    return e.reduce("ReduceMean", v, axes, keepdims=True)


def _sum(e, v, axes):
    return e.reduce("ReduceSum", v, axes, keepdims=True)


def _safe_div(e, num, den):
    """num / den, and 0 where den == 0 (den broadcasts against num)."""
    zero = e.Equal(den, _c(e, 0.0, den))
    out = e.Div(num, e.Where(zero, _c(e, 1.0, den), den))
    return e.Where(zero, _c(e, 0.0, out), out)


# ----------------------------------------------------------------------------- LpNormalization


@register("LpNormalization")
def lp_normalization(n, dys, needs, e):
    """y = x / N along ``axis``, N = ||x||_p (p = 1 or 2):
    dx = (dy - g * sum(dy * y)) / N with g = dN/dx = sign(x) (p = 1) or y (p = 2).
    Where N = 0 (y = 0 there) dx = 0."""
    (x,) = n.inputs
    (y,) = n.outputs
    (dy,) = dys
    axis, p = attr(n, "axis", -1), attr(n, "p", 2)
    if p not in (1, 2):
        raise GradientRuleError(f"LpNormalization: p must be 1 or 2, got {p}")
    norm = e.reduce("ReduceL1" if p == 1 else "ReduceL2", x, [axis], keepdims=True)
    g = e.Sign(x) if p == 1 else y
    return (_safe_div(e, e.Sub(dy, e.Mul(g, _sum(e, e.Mul(dy, y), [axis]))), norm),)


# ----------------------------------------------------------------------------- MeanVarianceNormalization


@register("MeanVarianceNormalization")
def mean_variance_normalization(n, dys, needs, e):
    """y = d / (std + eps), d = x - mean(x), std = sqrt(mean(d^2)) over ``axes`` (default
    [0, 2, 3]), eps = 1e-9 (the function body's):
    dx = (dy - mean(dy) - (d / std) * mean(dy * y)) / (std + eps), with d / std = 0 where a
    group is constant (std = 0)."""
    (x,) = n.inputs
    (y,) = n.outputs
    (dy,) = dys
    axes = [int(a) for a in attr(n, "axes", [0, 2, 3])]
    d = e.Sub(x, _mean(e, x, axes))
    std = e.Sqrt(_mean(e, e.Mul(d, d), axes))
    s = e.Add(std, _c(e, 1e-9, x))
    centered = e.Sub(dy, _mean(e, dy, axes))
    return (e.Div(e.Sub(centered, e.Mul(_safe_div(e, d, std), _mean(e, e.Mul(dy, y), axes))), s),)


# ----------------------------------------------------------------------------- LRN


def _channel_window_sum(e, v, before: int, after: int, rank: int):
    """w[c] = sum of v[c'] for c - before <= c' <= c + after (within the channels): v zero-padded
    on axis 1, then ``before + after + 1`` shifted slices added up."""
    width = before + after
    if width == 0:
        return v
    pads = [0] * (2 * rank)
    pads[1], pads[rank + 1] = before, after
    padded = e.Pad(v, e.ints(pads))
    parts = []
    for t in range(width + 1):
        end = t - width if t < width else np.iinfo(np.int64).max
        parts.append(e.Slice(padded, e.ints([t]), e.ints([end]), e.ints([1])))
    return e.Sum(*parts)


@register("LRN")
def lrn(n, dys, needs, e):
    """y = x * s^-beta, s = bias + alpha/size * sum of x^2 over the channel window
    [c - floor((size-1)/2), c + ceil((size-1)/2)]:

    dx_k = dy_k s_k^-beta - (2 alpha beta / size) x_k * sum over the windows c holding k of
    dy_c y_c / s_c (that is, the window mirrored: [k - ceil, k + floor])."""
    (x,) = n.inputs
    (y,) = n.outputs
    (dy,) = dys
    size = int(attr(n, "size"))
    alpha, beta, bias = attr(n, "alpha", 1e-4), attr(n, "beta", 0.75), attr(n, "bias", 1.0)
    rank = _rank(n, x, y, dy)
    lo, hi = (size - 1) // 2, size // 2
    s = e.Add(_c(e, bias, x), e.Mul(_c(e, alpha / size, x), _channel_window_sum(e, e.Mul(x, x), lo, hi, rank)))
    back = _channel_window_sum(e, e.Div(e.Mul(dy, y), s), hi, lo, rank)
    direct = e.Mul(dy, e.Pow(s, _c(e, -beta, s)))
    return (e.Sub(direct, e.Mul(e.Mul(_c(e, 2.0 * alpha * beta / size, x), x), back)),)


# ----------------------------------------------------------------------------- RMSNormalization


@register("RMSNormalization", since=23)
def rms_normalization(n, dys, needs, e):
    """y = xhat * scale, xhat = x * r, r = 1 / sqrt(mean(x^2) + eps) over axes [axis, rank),
    computed in stash_type for 16-bit x (in x's own type when that is as wide):
    dx = r * (g - xhat * mean(g * xhat)) with g = dy * scale;  dscale = unbroadcast(dy * xhat)."""
    x, scale = n.inputs
    (dy,) = dys
    xc = cast_to(e, x, compute_type(x, attr(n, "stash_type", 1)))
    st = Moments(e, xc, trailing_axes(e, x, attr(n, "axis", -1)), attr(n, "epsilon", 1e-5), centered=False,
                 form="mean")
    dx = dscale = None
    if needs[1]:
        dscale = e.unbroadcast(e.Mul(dy, e.CastLike(st.xhat, dy)), scale)
    if needs[0]:
        g = e.CastLike(e.Mul(dy, e.CastLike(scale, dy)), xc)
        dx = e.CastLike(st.backward(g), x)
    return dx, dscale


# ----------------------------------------------------------------------------- Lp pools


def _lp_local(e, x, p: int):
    """d|x|^p / dx / p = sign(x) |x|^(p-1)."""
    if p == 1:
        return e.Sign(x)
    if p == 2:
        return x
    return e.Mul(e.Sign(x), e.Pow(e.Abs(x), _c(e, float(p - 1), x)))


def _window_weight(e, dy, y, p: int):
    """dy * y^(1-p), 0 where the window is all zeros (y = 0)."""
    if p == 1:
        return dy
    if p == 2:
        return _safe_div(e, dy, y)
    return _safe_div(e, dy, e.Pow(y, _c(e, float(p - 1), y)))


def _p(n):
    p = attr(n, "p", 2)
    if int(p) != p or p < 1:
        raise GradientRuleError(f"{n.op_type}: p must be a positive integer, got {p}")
    return int(p)


@register("GlobalLpPool")
def global_lp_pool(n, dys, needs, e):
    """y = (sum of |x|^p over the spatial axes)^(1/p):  dx = sign(x) |x|^(p-1) * dy * y^(1-p)."""
    (x,) = n.inputs
    (y,) = n.outputs
    p = _p(n)
    return (e.Mul(_lp_local(e, x, p), _window_weight(e, dys[0], y, p)),)


@register("LpPool")
def lp_pool(n, dys, needs, e):
    """y[o] = (sum of |x|^p over window o)^(1/p), pads counting as zeros:
    dx = sign(x) |x|^(p-1) * sum over the windows o holding x of dy[o] * y[o]^(1-p).

    The sum over windows is AveragePool's scatter: a stride-s ConvTranspose with a ones kernel
    on the (N*C, 1, *spatial) planes, cut to x's extent (pads, auto_pad, ceil_mode, dilations
    as in pooling.py)."""
    (x,) = n.inputs
    (y,) = n.outputs
    (dy,) = dys
    p = _p(n)
    kernel = [int(k) for k in attr(n, "kernel_shape")]
    rank = _rank(n, x, dy, y, fallback=len(kernel) + 2)
    axes = window_axes(e, n, x, y, kernel, pool=True)
    w = _window_weight(e, dy, y, p)
    wd = dims_of(w)
    lead = wd[0] * wd[1] if wd is not None and is_static(*wd[:2]) else -1
    planes = reshape_to(e, w, [lead, 1] + [dim(e, w, i) for i in range(2, rank)])
    ones = e.const(np.ones([1, 1] + kernel), dtype=x.dtype or ir.DataType.FLOAT)
    g = conv_transpose_fitted(e, planes, ones, kernel, [a.begin for a in axes], [a.size for a in axes],
                              [a.stride for a in axes], [a.dilation for a in axes])
    xd = dims_of(x)
    g = reshape_to(e, g, list(xd), like=x) if xd is not None and is_static(*xd) else e.Reshape(g, e.Shape(x))
    return (e.Mul(_lp_local(e, x, p), g),)
