"""RoiAlign and MaxRoiPool.

RoiAlign: each output bin averages (mode 'avg') or maximizes (mode 'max') bilinear samples of
X inside a region of interest. Sampling is separable: on each axis sample i of bin p of roi r sits at

    y = start + p*bin + (i + 0.5)*bin/grid,   start = lo*spatial_scale - offset,
    bin = length/P,  length = (hi - lo)*spatial_scale  (at least 1 for output_half_pixel)

(offset 0.5 for half_pixel, 0 for output_half_pixel; grid = sampling_ratio, or
ceil(length/P) per roi when it is 0) and reads rows low and high = low + 1 with weights 1 - l and
l, l = y - low, after the runtime's clamping (y < 0 reads row 0; y at or past the last row reads
only the last row; samples with y < -1 or y > size read nothing). So every sample of a roi is a
row of a matrix My[r, k, h] (k = (p, i, corner), one weight per row), and likewise Mx[r, k, w];
the candidates are V[r, c] = My[r] @ X[batch[r], c] @ Mx[r]^T:

* avg: Y = Ay X Ax^T / count with Ay = My summed over the bin's samples and corners, count =
  max(grid_h * grid_w, 1); dX = sum over rois of Ay^T (dY / count) Ax.
* max: Y = the largest candidate of the bin (onnx's and onnxruntime's definition: the largest
  weighted corner value w * x over the bin's samples, a skipped sample counting as 0);
  dY goes to the first largest candidate: dX = sum over rois of My^T D Mx.

The rois get the derivative of the weights: for a loss L(M), dL/dl = dL/dw_high - dL/dw_low
on the unclamped stretch of each axis, then dy/dstart = 1 and dy/dbin = p + (i + 0.5)/grid.
grid, count and the skipping of samples are piecewise constant and contribute nothing.

The sum over rois of the batch element they read is a MatMul with the (N, R) one-hot matrix of
batch_indices, so no (R, C, H, W) tensor is ever formed.

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

import operator

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, dims_of
from gradbuilder.rules.helpers import cast_to, compute_type, text_attr
from gradbuilder.rules.indexing import segment_sum
from gradbuilder.rules.sizes import Dims, arange, dim, imul, iprod, is_static, reshape_like, scalar_of, stack


class _Axis:
    """The samples of one spatial axis: positions ``pos`` (R, P, G, 2) int64 and weights ``w``
    (R, P, G, 2) of the low and high rows; ``exists`` (R, G): sample i < grid; and what the rois'
    derivative needs."""

    def __init__(self, e, rois, cols, size, pooled, n, like):
        half_pixel = text_attr(n, "coordinate_transformation_mode",
                               "half_pixel" if e.opset >= 16 else "output_half_pixel") == "half_pixel"
        scale = float(attr(n, "spatial_scale", 1.0))
        ratio = int(attr(n, "sampling_ratio", 0))
        self.e, self.pooled, self.scale = e, pooled, scale
        start, bin_ = self._roi_bins(e, rois, cols, pooled, scale, half_pixel, like)
        exist_grid = self._samples_per_bin(e, bin_, ratio, like)
        i = arange(e, self.count, like)  # (G,): G = self.count samples per bin on this axis
        f = lambda v: e.scalar(float(v), like)  # noqa: E731
        gridc = e.Unsqueeze(e.Unsqueeze(e.Max(self.grid, f(1.0)), [-1]), [-1]) if ratio <= 0 else f(ratio)
        p = e.const(np.arange(pooled).reshape(pooled, 1), dtype=like.dtype or ir.DataType.FLOAT)  # (P, 1)
        self.coef = p + (i + 0.5) / gridc  # (R|1, P, G)
        y = e.Unsqueeze(start, [1, 2]) + self.coef * e.Unsqueeze(bin_, [1, 2])  # (R, P, G)
        self._corners(e, y, size, like)
        self.exists = None
        if exist_grid is not None:
            self.exists = e.Less(e.Unsqueeze(i, [0]), e.Unsqueeze(exist_grid, [1]))  # (R, G)
        self.size = size

    def _roi_bins(self, e, rois, cols, pooled, scale, half_pixel, like):
        """(start, bin) of every roi (R,): start = lo*spatial_scale - offset, bin = length/P; sets
        ``stretch``, where output_half_pixel forces the length up to 1 (None for half_pixel)."""
        f = lambda v: e.scalar(float(v), like)  # noqa: E731
        lo = e.Gather(rois, e.const(np.array(cols[0], np.int64)), axis=1)  # (R,)
        hi = e.Gather(rois, e.const(np.array(cols[1], np.int64)), axis=1)
        offset = 0.5 if half_pixel else 0.0
        start = lo * scale - offset
        length = hi * scale - offset - start
        self.stretch = None  # where the length is forced up to 1, it no longer depends on the roi
        if not half_pixel:
            self.stretch = e.CastLike(e.Greater(length, f(1.0)), like)
            length = e.Max(length, f(1.0))
        return start, length / pooled

    def _samples_per_bin(self, e, bin_, ratio, like):
        """Sets ``grid`` (sampling_ratio, or ceil(bin) per roi when it is 0) and ``count`` (the
        samples per bin: an int, or the largest grid as a 1-element tensor); returns the grid
        that decides which samples exist (None for sampling_ratio > 0: all of them)."""
        if ratio > 0:
            self.grid = e.scalar(float(ratio), like)
            self.count = ratio
            return None
        self.grid = e.Ceil(bin_)  # (R,)
        top = e.Cast(e.reduce("ReduceMax", self.grid, None, keepdims=False), to=int(ir.DataType.INT64))
        self.count = e.Reshape(e.Max(top, e.const(np.array(1, np.int64))), e.ints([1]))
        return self.grid

    def _corners(self, e, y, size, like):
        """Sets ``w`` and ``pos``, the weights and rows of the two rows each sample position y
        (R, P, G) reads after the runtime's clamping, and ``slope``, dl/dy."""
        f = lambda v: e.scalar(float(v), like)  # noqa: E731
        sizef = e.CastLike(size, like) if not isinstance(size, int) else f(size)
        last = sizef - 1.0
        valid = e.And(e.GreaterOrEqual(y, f(-1.0)), e.LessOrEqual(y, sizef))
        yc = e.Max(y, f(0.0))
        low = e.Floor(yc)
        top_row = e.GreaterOrEqual(low, last)
        low = e.Where(top_row, last, low)
        high = e.Where(top_row, last, low + 1.0)
        frac = e.Where(top_row, f(0.0), yc - low)
        validf = e.CastLike(valid, like)
        self.w = e.Concat(e.Unsqueeze((1.0 - frac) * validf, [-1]),
                          e.Unsqueeze(frac * validf, [-1]), axis=-1)  # (R, P, G, 2)
        self.pos = e.Cast(e.Concat(e.Unsqueeze(low, [-1]), e.Unsqueeze(high, [-1]), axis=-1),
                          to=int(ir.DataType.INT64))
        # dl/dy: 1 where y moves the sample between two rows, 0 where it is clamped or skipped
        self.slope = e.CastLike(e.And(valid, e.And(e.Greater(y, f(0.0)), e.Not(top_row))), like)

    def matrix(self, e, like, collapse):
        """(R, K, size) rows: K = P (collapse: the sum of the bin's existing samples, for avg)
        or K = P*G*2 (every sample corner, for max)."""
        onehot = e.CastLike(e.Equal(e.Unsqueeze(self.pos, [-1]), arange(e, self.size)), like)  # (R,P,G,2,S)
        w = self.w
        if collapse and self.exists is not None:
            w = w * e.Unsqueeze(e.CastLike(self.exists, like), [1, 3])
        m = onehot * e.Unsqueeze(w, [-1])
        if collapse:
            return e.reduce("ReduceSum", m, [2, 3], keepdims=False)
        return e.Reshape(m, stack(e, [0, -1, self.size]))

    def roi_grads(self, e, gm, collapse, like):
        """(dL/dlo, dL/dhi), each (R,), from dL/dM (gm: (R, K, size))."""
        p, g = self.pooled, self.count
        if collapse:  # gw[r, p, i, a] = gA[r, p, pos[r, p, i, a]] for existing samples
            idx = e.Reshape(self.pos, stack(e, [0, p, -1]))
            gw = e.Reshape(e.GatherElements(gm, idx, axis=2), stack(e, [0, p, g, 2]))
            if self.exists is not None:
                gw = gw * e.Unsqueeze(e.CastLike(self.exists, like), [1, 3])
        else:
            idx = e.Reshape(self.pos, e.ints([0, -1, 1]))
            gw = e.Reshape(e.GatherElements(gm, idx, axis=2), stack(e, [0, p, g, 2]))
        lowg, highg = e.split_into(gw, 2, axis=3)
        dy = self.slope * e.Squeeze(highg - lowg, [3])  # (R, P, G)
        dstart = e.reduce("ReduceSum", dy, [1, 2], keepdims=False)
        dlength = e.reduce("ReduceSum", dy * self.coef, [1, 2], keepdims=False) / float(p)
        if self.stretch is not None:
            dlength = dlength * self.stretch
        return (dstart - dlength) * self.scale, dlength * self.scale


class _RoiSamples:
    """What both of RoiAlign's gradients read: X and the rois in the compute dtype of ``like``,
    X's sizes, the sample matrices My (R, Ky, H) and Mx (R, Kx, W) of the two axes, the (N, R)
    one-hot ``onehot_b`` of the batch element each roi reads, X as ``xc`` (C, N*H, W) and My
    spread over the batch, ``myb`` (R, Ky, N*H)."""

    def __init__(self, e, n, like, collapse):
        x, rois, batch = n.inputs[:3]
        self.like, self.collapse = like, collapse
        self.ph, self.pw = int(attr(n, "output_height", 1)), int(attr(n, "output_width", 1))
        self.xx = e.CastLike(x, like)
        rr = e.CastLike(rois, like)
        self.big_n, self.c, self.h, self.w = (dim(e, x, i) for i in range(4))
        self.ay = _Axis(e, rr, (1, 3), self.h, self.ph, n, like)
        self.ax = _Axis(e, rr, (0, 2), self.w, self.pw, n, like)
        self.my = self.ay.matrix(e, like, collapse)  # (R, Ky, H)
        self.mx = self.ax.matrix(e, like, collapse)  # (R, Kx, W)
        self.onehot_b = e.CastLike(e.Equal(e.Unsqueeze(arange(e, self.big_n), [1]), e.Unsqueeze(batch, [0])), like)
        # Myb[r, k, (n, h)] = onehot_b[n, r] * My[r, k, h]
        self.xc = e.Reshape(e.Transpose(self.xx, perm=[1, 0, 2, 3]), stack(e, [self.c, -1, self.w]))
        spread = e.Unsqueeze(self.my, [2]) * e.Unsqueeze(e.Transpose(self.onehot_b, perm=[1, 0]), [1, 3])
        self.myb = e.Reshape(spread, stack(e, [0, 0, -1]))  # (R, Ky, N*H)

    def sampled(self, e):
        """u = My X_b: (R, C, Ky, W), each roi's sample rows of its batch element."""
        return e.Unsqueeze(self.myb, [1]) @ self.xc


def _roi_align_mode(n, x):
    """RoiAlign's mode (avg or max); an error for another mode or an X not of rank 4."""
    mode = text_attr(n, "mode", "avg")
    if mode not in ("avg", "max"):
        raise GradientRuleError(f"RoiAlign: unknown mode '{mode}'")
    xd = dims_of(x)
    if xd is not None and len(xd) != 4:
        raise GradientRuleError("RoiAlign: X must have rank 4")
    return mode


def _averaged(e, dy, s):
    """avg: dL/d(Ay X Ax^T) = dY / count, count = max(grid_h * grid_w, 1) per roi."""
    ay, ax = s.ay, s.ax
    if is_static(ay.count, ax.count):  # sampling_ratio > 0
        return dy / float(max(ay.count * ax.count, 1))
    count = e.Max(ay.grid * ax.grid, e.scalar(1.0, s.like))
    return dy / e.Unsqueeze(count, [1, 2, 3])


def _bin_candidates(e, u, s):
    """max: (the candidates w * x of every bin (R, C, P, Q, S), -inf where the sample does not
    exist; which exist (None: all)), from u = My X_b."""
    v = u @ e.Unsqueeze(e.Transpose(s.mx, perm=[0, 2, 1]), [1])  # (R, C, Ky, Kx)
    gy, gx = s.ay.count, s.ax.count
    split = stack(e, [0, 0, s.ph, gy, 2, s.pw, gx, 2])
    v8 = e.Transpose(e.Reshape(v, split), perm=[0, 1, 2, 5, 3, 4, 6, 7])  # (R, C, P, Q, G, 2, G', 2)
    cand = e.Reshape(v8, stack(e, [0, 0, s.ph, s.pw, -1]))
    if s.ay.exists is None:
        return cand, None
    # sampling_ratio 0: (R, 1, 1, 1, S), whether sample (i, j) exists
    pair = e.And(e.Unsqueeze(s.ay.exists, [2, 3, 4]), e.Unsqueeze(s.ax.exists, [1, 2, 4]))  # (R, G, 1, G', 1)
    pair = e.Expand(pair, stack(e, [1, gy, 2, gx, 2]))
    exists = e.Unsqueeze(e.Reshape(pair, e.ints([0, -1])), [1, 2, 3])
    return e.Where(exists, cand, e.scalar(-np.inf, s.like)), exists


def _to_largest(e, dy, u, s):
    """max: dL/d(My X Mx^T) (R, C, Ky, Kx): dY at each bin's first largest candidate."""
    cand, exists = _bin_candidates(e, u, s)
    best = e.ArgMax(cand, axis=-1, keepdims=1)
    hit = e.Equal(arange(e, e.Shape(cand, 4)), best)
    if exists is not None:
        hit = e.And(hit, exists)
    dcand = e.CastLike(hit, s.like) * e.Unsqueeze(dy, [-1])  # (R, C, P, Q, S)
    gy, gx = s.ay.count, s.ax.count
    d8 = e.Reshape(dcand, stack(e, [0, 0, s.ph, s.pw, gy, 2, gx, 2]))
    return e.Reshape(e.Transpose(d8, perm=[0, 1, 2, 4, 5, 3, 6, 7]),
                     stack(e, [0, 0, imul(e, gy, 2 * s.ph), imul(e, gx, 2 * s.pw)]))  # (R, C, Ky, Kx)


def _image_grad(e, s, t, x):
    """dX[n, c, h, w] = sum_{r, k} Myb[r, k, (n, h)] t[r, c, k, w], t = d Mx (R, C, Ky, W)."""
    lb = e.Reshape(e.Transpose(s.myb, perm=[2, 0, 1]), e.ints([0, -1]))  # (N*H, R*Ky)
    tc = e.Reshape(e.Transpose(t, perm=[1, 0, 2, 3]), stack(e, [s.c, -1, s.w]))  # (C, R*Ky, W)
    g = e.Reshape(lb @ tc, stack(e, [s.c, s.big_n, s.h, s.w]))
    return e.CastLike(e.Transpose(g, perm=[1, 0, 2, 3]), x)


def _rois_grad(e, s, d, t, u, rois):
    """drois (R, 4): dL/dMy and dL/dMx through each axis' sample positions (_Axis.roi_grads)."""
    # dL/dMy[r, k, h] = sum_n onehot_b[n, r] sum_{c, w} t[r, c, k, w] X[n, c, h, w]
    tk = e.Reshape(e.Transpose(t, perm=[0, 2, 1, 3]), e.ints([0, 0, -1]))  # (R, Ky, C*W)
    xw = e.Reshape(e.Transpose(s.xx, perm=[1, 3, 0, 2]), stack(e, [-1, imul(e, s.big_n, s.h)]))  # (C*W, N*H)
    gmy = _batch_pick(e, tk @ xw, s.onehot_b, s.big_n, s.h)  # (R, Ky, H)
    # dL/dMx[r, k', w] = sum_{c, k} d[r, c, k, k'] u[r, c, k, w], u = My X_b
    dk = e.Reshape(e.Transpose(d, perm=[0, 3, 1, 2]), e.ints([0, 0, -1]))  # (R, Kx, C*Ky)
    uk = e.Reshape(u, stack(e, [0, -1, s.w]))  # (R, C*Ky, W)
    gmx = dk @ uk  # (R, Kx, W)
    dy_lo, dy_hi = s.ay.roi_grads(e, gmy, s.collapse, s.like)
    dx_lo, dx_hi = s.ax.roi_grads(e, gmx, s.collapse, s.like)
    cols = [e.Unsqueeze(v, [1]) for v in (dx_lo, dy_lo, dx_hi, dy_hi)]
    return e.CastLike(e.Concat(*cols, axis=1), rois)


@register("RoiAlign")
def roi_align(n, dys, needs, e):
    """Y[r, c, p, q] = pooled bilinear samples of X[batch_indices[r], c] in roi r (see the
    module docstring). dX: the samples' weights send dY back to X's rows and columns (avg: the
    averaged weights / count; max: the weights of each bin's largest candidate). drois: through
    the weights' dependence on the sample positions. batch_indices: none."""
    x, rois = n.inputs[:2]
    (dy,) = dys
    if dy is None:
        return [None] * len(n.inputs)
    collapse = _roi_align_mode(n, x) == "avg"
    dy = cast_to(e, dy, compute_type(dy))  # positions and sums in float32 for 16-bit floats
    s = _RoiSamples(e, n, dy, collapse)
    u = None if collapse else s.sampled(e)  # (R, C, Ky, W)
    d = _averaged(e, dy, s) if collapse else _to_largest(e, dy, u, s)  # dL/d(My X Mx^T)
    t = d @ e.Unsqueeze(s.mx, [1])  # (R, C, Ky, W)
    dx = _image_grad(e, s, t, x) if needs[0] else None
    drois = _rois_grad(e, s, d, t, s.sampled(e) if u is None else u, rois) if needs[1] else None
    return [dx, drois] + [None] * (len(n.inputs) - 2)


def _batch_pick(e, q, onehot_b, big_n, h):
    """q[r, k, (n, h)] -> sum_n onehot_b[n, r] q[r, k, n, h]: (R, K, H)."""
    q4 = e.Reshape(q, stack(e, [0, 0, big_n, h]))
    sel = e.Unsqueeze(e.Transpose(onehot_b, perm=[1, 0]), [1, 3])  # (R, 1, N, 1)
    return e.reduce("ReduceSum", q4 * sel, [2], keepdims=False)


# ----------------------------------------------------------------------------- MaxRoiPool


F32 = ir.DataType.FLOAT
I64 = ir.DataType.INT64


def _f(e, v):
    return e.const(np.array(v, np.float32))


def _round_away(e, v):
    """C's round(): halves away from zero (ONNX Round rounds halves to even)."""
    return e.Sign(v) * e.Floor(e.Abs(v) + 0.5)


def _bins(e, rois, lo_col, hi_col, pooled: int, scale: float, size):
    """(start, end) of every roi's bins on one axis, int64 (R, pooled), in float32 exactly as
    onnxruntime's kernel computes them."""
    col = lambda k: e.Gather(rois, e.const(np.array(k, np.int64)), axis=1)  # noqa: E731
    lo = _round_away(e, col(lo_col) * scale)
    hi = _round_away(e, col(hi_col) * scale)
    length = e.Max(hi - lo + 1.0, _f(e, 1.0))
    bin_ = e.Unsqueeze(length / float(pooled), [1])  # (R, 1)
    p = e.const(np.arange(pooled, dtype=np.float32))
    lo = e.Unsqueeze(lo, [1])
    sizef = _f(e, float(size)) if isinstance(size, int) else e.Cast(size, to=int(F32))

    def clip(v):
        return e.Cast(e.Min(e.Max(v + lo, _f(e, 0.0)), sizef), to=int(I64))

    return clip(e.Floor(p * bin_)), clip(e.Ceil((p + 1.0) * bin_))


def _window(e, start, end, size):
    """Positions start + k (k < the largest bin size), clamped into the axis, and whether each
    lies inside its bin: (R, pooled, K) int64 and bool."""
    longest = e.Max(e.reduce("ReduceMax", end - start, None, keepdims=False),
                    e.const(np.array(1, np.int64)))
    k = e.Range(e.const(np.array(0, np.int64)), longest, e.const(np.array(1, np.int64)))
    pos = e.Unsqueeze(start, [2]) + k
    inside = e.Less(pos, e.Unsqueeze(end, [2]))
    last = size - 1 if isinstance(size, int) else size - e.ints([1])
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
    spot = _pairs(e, hpos * width_v, wpos, operator.add)  # (R, P, Q, K): h * W + w
    inside = e.Unsqueeze(_pairs(e, hin, win, e.And), [1])  # (R, 1, P, Q, K)

    # candidates X[batch, c, h, w] for every window position: rows of X as (N*H*W, C)
    rows = e.Reshape(batch, [-1, 1, 1, 1]) * area_v + spot
    table = e.Reshape(e.Transpose(x, perm=[0, 2, 3, 1]), e.Concat(e.ints([-1]), chans_v, axis=0))
    cand = e.Transpose(e.Gather(table, rows, axis=0), perm=[0, 4, 1, 2, 3])  # (R, C, P, Q, K)
    hit = e.Cast(e.And(e.Equal(cand, e.Unsqueeze(y, [4])), inside), to=int(F32))
    first = e.ArgMax(hit, axis=4, keepdims=1)  # (R, C, P, Q, 1): the first match
    picked = e.GatherElements(hit, first, axis=4)  # 1 where the bin has a match
    where = e.GatherElements(e.Expand(e.Unsqueeze(spot, [1]), e.Shape(hit)), first, axis=4)

    # flat position in X: (batch * C + c) * H * W + h * W + w
    channel = e.Range(scalar_of(e, 0), scalar_of(e, chans), scalar_of(e, 1))
    base = (e.Reshape(batch, [-1, 1]) * chans_v + e.Unsqueeze(channel, [0])) * area_v  # (R, C)
    flat = e.Reshape(base, [0, 0, 1, 1, 1]) + where  # (R, C, P, Q, 1)
    g = e.Unsqueeze(dy, [4]) * e.CastLike(picked, dy)
    total = iprod(e, [dims[0], chans, area])
    depth = total if isinstance(total, int) else e.Reshape(total, [1])
    out = segment_sum(e, e.Reshape(g, [1, -1, 1]), e.Reshape(flat, [1, -1]), 1, depth, 1, False, x)
    return (reshape_like(e, out, x), drois)
