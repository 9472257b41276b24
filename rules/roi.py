"""RoiAlign.

Each output bin averages (mode 'avg') or maximizes (mode 'max') bilinear samples of X inside a
region of interest. Sampling is separable: on each axis sample i of bin p of roi r sits at

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
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, dims_of
from gradbuilder.rules.sizes import arange, dim, imul, is_static, stack


def _text(n, name, default):
    v = attr(n, name, default)
    return v.decode() if isinstance(v, bytes) else v


class _Axis:
    """The samples of one spatial axis: positions ``pos`` (R, P, G, 2) int64 and weights ``w``
    (R, P, G, 2) of the low and high rows; ``exists`` (R, G): sample i < grid; and what the rois'
    derivative needs."""

    def __init__(self, e, rois, cols, size, pooled, n, like):
        half_pixel = _text(n, "coordinate_transformation_mode",
                           "half_pixel" if e.opset >= 16 else "output_half_pixel") == "half_pixel"
        scale = float(attr(n, "spatial_scale", 1.0))
        ratio = int(attr(n, "sampling_ratio", 0))
        f = lambda v: e.scalar(float(v), like)  # noqa: E731
        self.e, self.pooled, self.scale = e, pooled, scale
        lo = e.Gather(rois, e.const(np.array(cols[0], np.int64)), axis=1)  # (R,)
        hi = e.Gather(rois, e.const(np.array(cols[1], np.int64)), axis=1)
        offset = 0.5 if half_pixel else 0.0
        start = e.Sub(e.Mul(lo, f(scale)), f(offset))
        length = e.Sub(e.Sub(e.Mul(hi, f(scale)), f(offset)), start)
        self.stretch = None  # where the length is forced up to 1, it no longer depends on the roi
        if not half_pixel:
            self.stretch = e.CastLike(e.Greater(length, f(1.0)), like)
            length = e.Max(length, f(1.0))
        bin_ = e.Div(length, f(pooled))
        if ratio > 0:
            self.grid = f(ratio)
            self.count = ratio
            exist_grid = None
        else:
            self.grid = e.Ceil(bin_)  # (R,)
            top = e.Cast(e.reduce("ReduceMax", self.grid, None, keepdims=False), to=int(ir.DataType.INT64))
            self.count = e.Reshape(e.Max(top, e.const(np.array(1, np.int64))), e.ints([1]))
            exist_grid = self.grid
        g = self.count  # G: samples per bin on this axis (an int, or a 1-element tensor)
        i = arange(e, g, like)  # (G,)
        gridc = e.Unsqueeze(e.Unsqueeze(e.Max(self.grid, f(1.0)), [-1]), [-1]) if ratio <= 0 else f(ratio)
        p = e.const(np.arange(pooled).reshape(pooled, 1), dtype=like.dtype or ir.DataType.FLOAT)  # (P, 1)
        self.coef = e.Add(p, e.Div(e.Add(i, f(0.5)), gridc))  # (R|1, P, G)
        y = e.Add(e.Unsqueeze(start, [1, 2]), e.Mul(self.coef, e.Unsqueeze(bin_, [1, 2])))  # (R, P, G)
        sizef = e.CastLike(size, like) if not isinstance(size, int) else f(size)
        last = e.Sub(sizef, f(1.0))
        valid = e.And(e.GreaterOrEqual(y, f(-1.0)), e.LessOrEqual(y, sizef))
        yc = e.Max(y, f(0.0))
        low = e.Floor(yc)
        top_row = e.GreaterOrEqual(low, last)
        low = e.Where(top_row, last, low)
        high = e.Where(top_row, last, e.Add(low, f(1.0)))
        frac = e.Where(top_row, f(0.0), e.Sub(yc, low))
        validf = e.CastLike(valid, like)
        self.w = e.Concat(e.Unsqueeze(e.Mul(e.Sub(f(1.0), frac), validf), [-1]),
                          e.Unsqueeze(e.Mul(frac, validf), [-1]), axis=-1)  # (R, P, G, 2)
        self.pos = e.Cast(e.Concat(e.Unsqueeze(low, [-1]), e.Unsqueeze(high, [-1]), axis=-1),
                          to=int(ir.DataType.INT64))
        # dl/dy: 1 where y moves the sample between two rows, 0 where it is clamped or skipped
        self.slope = e.CastLike(e.And(valid, e.And(e.Greater(y, f(0.0)), e.Not(top_row))), like)
        self.exists = None
        if exist_grid is not None:
            self.exists = e.Less(e.Unsqueeze(i, [0]), e.Unsqueeze(exist_grid, [1]))  # (R, G)
        self.size = size

    def matrix(self, e, like, collapse):
        """(R, K, size) rows: K = P (collapse: the sum of the bin's existing samples, for avg)
        or K = P*G*2 (every sample corner, for max)."""
        onehot = e.CastLike(e.Equal(e.Unsqueeze(self.pos, [-1]), arange(e, self.size)), like)  # (R,P,G,2,S)
        w = self.w
        if collapse and self.exists is not None:
            w = e.Mul(w, e.Unsqueeze(e.CastLike(self.exists, like), [1, 3]))
        m = e.Mul(onehot, e.Unsqueeze(w, [-1]))
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
                gw = e.Mul(gw, e.Unsqueeze(e.CastLike(self.exists, like), [1, 3]))
        else:
            idx = e.Reshape(self.pos, e.ints([0, -1, 1]))
            gw = e.Reshape(e.GatherElements(gm, idx, axis=2), stack(e, [0, p, g, 2]))
        lowg, highg = e.split_into(gw, 2, axis=3)
        dy = e.Mul(self.slope, e.Squeeze(e.Sub(highg, lowg), [3]))  # (R, P, G)
        dstart = e.reduce("ReduceSum", dy, [1, 2], keepdims=False)
        dlength = e.Div(e.reduce("ReduceSum", e.Mul(dy, self.coef), [1, 2], keepdims=False),
                        e.scalar(float(p), like))
        if self.stretch is not None:
            dlength = e.Mul(dlength, self.stretch)
        s = e.scalar(self.scale, like)
        return e.Mul(e.Sub(dstart, dlength), s), e.Mul(dlength, s)


@register("RoiAlign")
def roi_align(n, dys, needs, e):
    """Y[r, c, p, q] = pooled bilinear samples of X[batch_indices[r], c] in roi r (see the
    module docstring). dX: the samples' weights send dY back to X's rows and columns (avg: the
    averaged weights / count; max: the weights of each bin's largest candidate). drois: through
    the weights' dependence on the sample positions. batch_indices: none."""
    x, rois, batch = n.inputs[:3]
    (dy,) = dys
    if dy is None:
        return [None] * len(n.inputs)
    mode = _text(n, "mode", "avg")
    if mode not in ("avg", "max"):
        raise GradientRuleError(f"RoiAlign: unknown mode '{mode}'")
    ph, pw = int(attr(n, "output_height", 1)), int(attr(n, "output_width", 1))
    xd = dims_of(x)
    if xd is not None and len(xd) != 4:
        raise GradientRuleError("RoiAlign: X must have rank 4")
    if dy.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):  # positions and sums in float32
        dy = e.Cast(dy, to=int(ir.DataType.FLOAT))
    like = dy
    xx = e.CastLike(x, like)
    rr = e.CastLike(rois, like)
    big_n, c, h, w = (dim(e, x, i) for i in range(4))
    ay = _Axis(e, rr, (1, 3), h, ph, n, like)
    ax = _Axis(e, rr, (0, 2), w, pw, n, like)
    collapse = mode == "avg"
    my = ay.matrix(e, like, collapse)  # (R, Ky, H)
    mx = ax.matrix(e, like, collapse)  # (R, Kx, W)
    # (N, R) one-hot of the batch element each roi reads
    onehot_b = e.CastLike(e.Equal(e.Unsqueeze(arange(e, big_n), [1]), e.Unsqueeze(batch, [0])), like)
    # X as (C, N*H, W), and My spread over the batch: Myb[r, k, (n, h)] = onehot_b[n, r] * My[r, k, h]
    xc = e.Reshape(e.Transpose(xx, perm=[1, 0, 2, 3]), stack(e, [c, -1, w]))
    myb = e.Reshape(e.Mul(e.Unsqueeze(my, [2]), e.Unsqueeze(e.Transpose(onehot_b, perm=[1, 0]), [1, 3])),
                    stack(e, [0, 0, -1]))  # (R, Ky, N*H)

    if collapse:  # count = max(grid_h * grid_w, 1) per roi
        if is_static(ay.count, ax.count):  # sampling_ratio > 0
            d = e.Div(dy, e.scalar(float(max(ay.count * ax.count, 1)), like))
        else:
            count = e.Max(e.Mul(ay.grid, ax.grid), e.scalar(1.0, like))
            d = e.Div(dy, e.Unsqueeze(count, [1, 2, 3]))
    else:
        u = e.MatMul(e.Unsqueeze(myb, [1]), xc)  # (R, C, Ky, W)
        v = e.MatMul(u, e.Unsqueeze(e.Transpose(mx, perm=[0, 2, 1]), [1]))  # (R, C, Ky, Kx)
        gy, gx = ay.count, ax.count
        split = stack(e, [0, 0, ph, gy, 2, pw, gx, 2])
        v8 = e.Transpose(e.Reshape(v, split), perm=[0, 1, 2, 5, 3, 4, 6, 7])  # (R, C, P, Q, G, 2, G', 2)
        flat = stack(e, [0, 0, ph, pw, -1])
        cand = e.Reshape(v8, flat)
        exists = None
        if ay.exists is not None:  # sampling_ratio 0: (R, 1, 1, 1, S), whether sample (i, j) exists
            pair = e.And(e.Unsqueeze(ay.exists, [2, 3, 4]), e.Unsqueeze(ax.exists, [1, 2, 4]))  # (R, G, 1, G', 1)
            pair = e.Expand(pair, stack(e, [1, gy, 2, gx, 2]))
            exists = e.Unsqueeze(e.Reshape(pair, e.ints([0, -1])), [1, 2, 3])
            cand = e.Where(exists, cand, e.scalar(-np.inf, like))
        best = e.ArgMax(cand, axis=-1, keepdims=1)
        hit = e.Equal(arange(e, e.Shape(cand, 4)), best)
        if exists is not None:
            hit = e.And(hit, exists)
        dcand = e.Mul(e.CastLike(hit, like), e.Unsqueeze(dy, [-1]))  # (R, C, P, Q, S)
        d8 = e.Reshape(dcand, stack(e, [0, 0, ph, pw, gy, 2, gx, 2]))
        d = e.Reshape(e.Transpose(d8, perm=[0, 1, 2, 4, 5, 3, 6, 7]),
                      stack(e, [0, 0, imul(e, gy, 2 * ph), imul(e, gx, 2 * pw)]))  # (R, C, Ky, Kx)

    t = e.MatMul(d, e.Unsqueeze(mx, [1]))  # (R, C, Ky, W)
    dx = None
    if needs[0]:
        # dX[n, c, h, w] = sum_{r, k} Myb[r, k, (n, h)] t[r, c, k, w]
        lb = e.Reshape(e.Transpose(myb, perm=[2, 0, 1]), e.ints([0, -1]))  # (N*H, R*Ky)
        tc = e.Reshape(e.Transpose(t, perm=[1, 0, 2, 3]), stack(e, [c, -1, w]))  # (C, R*Ky, W)
        g = e.Reshape(e.MatMul(lb, tc), stack(e, [c, big_n, h, w]))
        dx = e.CastLike(e.Transpose(g, perm=[1, 0, 2, 3]), x)
    drois = None
    if needs[1]:
        # dL/dMy[r, k, h] = sum_n onehot_b[n, r] sum_{c, w} t[r, c, k, w] X[n, c, h, w]
        tk = e.Reshape(e.Transpose(t, perm=[0, 2, 1, 3]), e.ints([0, 0, -1]))  # (R, Ky, C*W)
        xw = e.Reshape(e.Transpose(xx, perm=[1, 3, 0, 2]), stack(e, [-1, imul(e, big_n, h)]))  # (C*W, N*H)
        gmy = _batch_pick(e, e.MatMul(tk, xw), onehot_b, big_n, h)  # (R, Ky, H)
        # dL/dMx[r, k', w] = sum_{c, k} d[r, c, k, k'] u[r, c, k, w], u = My X_b
        if collapse:
            u = e.MatMul(e.Unsqueeze(myb, [1]), xc)  # (R, C, Ky, W)
        dk = e.Reshape(e.Transpose(d, perm=[0, 3, 1, 2]), e.ints([0, 0, -1]))  # (R, Kx, C*Ky)
        uk = e.Reshape(u, stack(e, [0, -1, w]))  # (R, C*Ky, W)
        gmx = e.MatMul(dk, uk)  # (R, Kx, W)
        dy_lo, dy_hi = ay.roi_grads(e, gmy, collapse, like)
        dx_lo, dx_hi = ax.roi_grads(e, gmx, collapse, like)
        cols = [e.Unsqueeze(v, [1]) for v in (dx_lo, dy_lo, dx_hi, dy_hi)]
        drois = e.CastLike(e.Concat(*cols, axis=1), rois)
    return [dx, drois] + [None] * (len(n.inputs) - 2)


def _batch_pick(e, q, onehot_b, big_n, h):
    """q[r, k, (n, h)] -> sum_n onehot_b[n, r] q[r, k, n, h]: (R, K, H)."""
    q4 = e.Reshape(q, stack(e, [0, 0, big_n, h]))
    sel = e.Unsqueeze(e.Transpose(onehot_b, perm=[1, 0]), [1, 3])  # (R, 1, N, 1)
    return e.reduce("ReduceSum", e.Mul(q4, sel), [2], keepdims=False)
