"""MaxRoiPool, and the ops whose float inputs have no (or a zero) derivative: MelWeightMatrix,
EyeLike, and the random draws.

The random draws are stop-gradient points: RandomNormalLike and RandomUniformLike read only
their input's shape (and dtype), and Bernoulli's and Multinomial's draws are piecewise
constant in their probabilities, so no gradient flows into their inputs. A draw is a
constant of the step that made it: in a reparameterisation z = mu + exp(logvar / 2) * eps
with eps = RandomNormalLike(mu), mu and logvar get their gradients through the Add and the
Mul, with eps held fixed.

MaxRoiPool (ai.onnx 1+): roi r = [batch, x1, y1, x2, y2] covers rows round(y1 * s) ..
round(y2 * s) (at least one row; round half away from zero), split into pooled_h bins:
bin p spans [floor(p * b), ceil((p + 1) * b)) + start, b = rows / pooled_h (float32, as
onnxruntime computes it), clipped to the image; likewise the columns. Y[r, c, p, q] = the
largest X[batch, c, h, w] over the bin (an empty bin gives 0). Its gradient routes dY to the
first position (row-major) of the bin where X equals Y:

    dX[batch, c, h, w] = sum over (r, p, q) whose bin picks (h, w) of dY[r, c, p, q]

Matching Y (rather than recomputing the maximum) keeps the rule true to the runtime that ran
the forward: onnxruntime starts each bin's maximum at FLT_MIN (the smallest positive float),
so a bin of negative values gives ~0 there, a constant with zero derivative, and no position
matches it. The bins are gathered into windows of the largest bin size (rois x channels x
roi area), and the sums over overlapping bins and rois are a ScatterND with reduction="add"
(before opset 16 a one-hot matrix product, which costs memory |X| x |Y| x window). The rois
are piecewise constant (rounded to whole pixels): their gradient is zero.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradbuilder.compiler.registry import register, register_stop_gradient_edges
from gradbuilder.compiler.values import attr
from gradbuilder.rules.indexing import _segment_sum
from gradbuilder.rules.sizes import Dims, imul, iprod, reshape_like, scalar_of

F32 = ir.DataType.FLOAT
I64 = ir.DataType.INT64


def _f(e, v):
    return e.const(np.array(v, np.float32))


def _round_away(e, v):
    """C's round(): halves away from zero (ONNX Round rounds halves to even)."""
    return e.Mul(e.Sign(v), e.Floor(e.Add(e.Abs(v), _f(e, 0.5))))


def _bins(e, rois, lo_col, hi_col, pooled: int, scale: float, size):
    """(start, end) of every roi's bins on one axis, int64 (R, pooled), in float32 exactly as
    onnxruntime's kernel computes them."""
    col = lambda k: e.Gather(rois, e.const(np.array(k, np.int64)), axis=1)  # noqa: E731
    lo = _round_away(e, e.Mul(col(lo_col), _f(e, scale)))
    hi = _round_away(e, e.Mul(col(hi_col), _f(e, scale)))
    length = e.Max(e.Add(e.Sub(hi, lo), _f(e, 1.0)), _f(e, 1.0))
    bin_ = e.Unsqueeze(e.Div(length, _f(e, float(pooled))), [1])  # (R, 1)
    p = e.const(np.arange(pooled, dtype=np.float32))
    lo = e.Unsqueeze(lo, [1])
    sizef = _f(e, float(size)) if isinstance(size, int) else e.Cast(size, to=int(F32))

    def clip(v):
        return e.Cast(e.Min(e.Max(e.Add(v, lo), _f(e, 0.0)), sizef), to=int(I64))

    return clip(e.Floor(e.Mul(p, bin_))), clip(e.Ceil(e.Mul(e.Add(p, _f(e, 1.0)), bin_)))


def _window(e, start, end, size):
    """Positions start + k (k < the largest bin size), clamped into the axis, and whether each
    lies inside its bin: (R, pooled, K) int64 and bool."""
    longest = e.Max(e.reduce("ReduceMax", e.Sub(end, start), None, keepdims=False),
                    e.const(np.array(1, np.int64)))
    k = e.Range(e.const(np.array(0, np.int64)), longest, e.const(np.array(1, np.int64)))
    pos = e.Add(e.Unsqueeze(start, [2]), k)
    inside = e.Less(pos, e.Unsqueeze(end, [2]))
    last = size - 1 if isinstance(size, int) else e.Sub(size, e.ints([1]))
    return e.Min(pos, last if not isinstance(last, int) else e.ints([last])), inside


def _pairs(e, v_h, v_w, op):
    """(R, P, KH) x (R, Q, KW) -> (R, P, Q, KH*KW), row-major over (kh, kw)."""
    both = op(e.Unsqueeze(v_h, [3, 4]), e.Unsqueeze(v_w, [1, 2]))  # (R, P, KH, Q, KW)
    return e.Reshape(e.Transpose(both, perm=[0, 1, 3, 2, 4]), e.ints([0, 0, 0, -1]))


@register("MaxRoiPool")
def max_roi_pool(n, dys, needs, e):
    """Y[r, c, p, q] = max of X[batch_r, c] over bin (p, q) of roi r  =>  dY goes to the
    first position of the bin (row-major) where X equals Y; d rois = 0 (piecewise constant)."""
    x, rois = n.inputs[0], n.inputs[1]
    y = n.outputs[0]
    (dy,) = dys
    drois = e.zeros_like(rois) if needs[1] else None
    if dy is None or not needs[0]:
        return (None, drois)
    ph, pw = (int(v) for v in attr(n, "pooled_shape"))
    scale = float(attr(n, "spatial_scale", 1.0))
    dims = Dims(e, x)
    chans, height, width = dims[1], dims[2], dims[3]
    area = imul(e, height, width)
    r32 = rois if rois.dtype == F32 else e.Cast(rois, to=int(F32))
    batch = e.Cast(e.Gather(r32, e.const(np.array(0, np.int64)), axis=1), to=int(I64))  # (R,)

    hpos, hin = _window(e, *_bins(e, r32, 2, 4, ph, scale, height), height)
    wpos, win = _window(e, *_bins(e, r32, 1, 3, pw, scale, width), width)
    area_v = area if not isinstance(area, int) else e.ints([area])
    chans_v = chans if not isinstance(chans, int) else e.ints([chans])
    width_v = width if not isinstance(width, int) else e.ints([width])
    spot = _pairs(e, e.Mul(hpos, width_v), wpos, e.Add)  # (R, P, Q, K): h * W + w
    inside = e.Unsqueeze(_pairs(e, hin, win, e.And), [1])  # (R, 1, P, Q, K)

    # candidates X[batch, c, h, w] for every window position: rows of X as (N*H*W, C)
    rows = e.Add(e.Mul(e.Reshape(batch, [-1, 1, 1, 1]), area_v), spot)
    table = e.Reshape(e.Transpose(x, perm=[0, 2, 3, 1]), e.Concat(e.ints([-1]), chans_v, axis=0))
    cand = e.Transpose(e.Gather(table, rows, axis=0), perm=[0, 4, 1, 2, 3])  # (R, C, P, Q, K)
    hit = e.Cast(e.And(e.Equal(cand, e.Unsqueeze(y, [4])), inside), to=int(F32))
    first = e.ArgMax(hit, axis=4, keepdims=1)  # (R, C, P, Q, 1): the first match
    picked = e.GatherElements(hit, first, axis=4)  # 1 where the bin has a match
    where = e.GatherElements(e.Expand(e.Unsqueeze(spot, [1]), e.Shape(hit)), first, axis=4)

    # flat position in X: (batch * C + c) * H * W + h * W + w
    channel = e.Range(scalar_of(e, 0), scalar_of(e, chans), scalar_of(e, 1))
    base = e.Mul(e.Add(e.Mul(e.Reshape(batch, [-1, 1]), chans_v), e.Unsqueeze(channel, [0])), area_v)  # (R, C)
    flat = e.Add(e.Reshape(base, [0, 0, 1, 1, 1]), where)  # (R, C, P, Q, 1)
    g = e.Mul(e.Unsqueeze(dy, [4]), e.CastLike(picked, dy))
    total = iprod(e, [dims[0], chans, area])
    depth = total if isinstance(total, int) else e.Reshape(total, [1])
    out = _segment_sum(e, e.Reshape(g, [1, -1, 1]), e.Reshape(flat, [1, -1]), 1, depth, 1, False, x)
    return (reshape_like(e, out, x), drois)


@register("MelWeightMatrix")
def mel_weight_matrix(n, dys, needs, e):
    """The matrix entries are ratios of whole bin indices, floor((dft_length + 1) * f /
    sample_rate) of mel-spaced frequencies f between lower_edge_hertz and upper_edge_hertz:
    piecewise constant in the edges, so d lower_edge_hertz = d upper_edge_hertz = 0 (also
    used at the jumps)."""
    return [e.zeros_like(v) if need else None for v, need in zip(n.inputs, needs)]


@register("EyeLike")
def eye_like(n, dys, needs, e):
    """y = ones on the k-th diagonal, shaped like x: y does not depend on x's values, so x
    gets no gradient (None: zero)."""
    return (None,)


for _op in ("RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"):
    register_stop_gradient_edges({0}, _op)
