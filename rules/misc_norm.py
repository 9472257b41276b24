"""Small normalizations: LpNormalization MeanVarianceNormalization LRN RMSNormalization.

The normalizations divide x by a statistic s of a group of elements; each gradient is
``dy / s`` minus the part that flows through s, written as a mean or sum over the group.
"""

from __future__ import annotations

import numpy as np

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr
from gradbuilder.rules.helpers import cast_to, compute_type, mean_over, rank_of, safe_div, sum_over
from gradbuilder.rules.norm_stats import Moments, trailing_axes


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
    return (safe_div(e, dy - g * sum_over(e, dy * y, [axis]), norm),)


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
    d = x - mean_over(e, x, axes)
    std = e.Sqrt(mean_over(e, d * d, axes))
    s = std + 1e-9
    centered = dy - mean_over(e, dy, axes)
    return ((centered - safe_div(e, d, std) * mean_over(e, dy * y, axes)) / s,)


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
    rank = rank_of(x, y, dy, op=n.op_type)
    lo, hi = (size - 1) // 2, size // 2
    s = bias + alpha / size * _channel_window_sum(e, x * x, lo, hi, rank)
    back = _channel_window_sum(e, dy * y / s, hi, lo, rank)
    return (dy * s ** -beta - 2.0 * alpha * beta / size * x * back,)


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
        dscale = e.unbroadcast(dy * e.CastLike(st.xhat, dy), scale)
    if needs[0]:
        g = e.CastLike(dy * e.CastLike(scale, dy), xc)
        dx = e.CastLike(st.backward(g), x)
    return dx, dscale
