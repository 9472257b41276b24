"""Spatial and resampling ops: GridSample AffineGrid DepthToSpace SpaceToDepth Col2Im
CenterCropPad (Resize: :mod:`gradbuilder.rules.resize`).

All of them are linear in their data input, so each data gradient is the transpose of the
op's own linear map:

* DepthToSpace / SpaceToDepth / CenterCropPad move elements: dx moves dy back (the inverse
  rearrangement, or the same crop/pad back to x's size).
* Col2Im adds columns into an image: dx reads the image back into columns (Im2Col), a
  convolution of dy with one-hot kernels.
* AffineGrid is grid = theta @ (base, 1): dtheta = dy^T @ (base, 1), base being the
  runtime's AffineGrid of the identity transform.
* GridSample reads X at a few taps around each sampling point with weights that depend on
  the grid: dX scatter-adds dy times the weights at the taps, dgrid sums dy times X at the
  taps times the weights' derivatives.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, constant_of, dims_of, unknown_rank
from gradbuilder.rules.helpers import accumulation_type, cast_to, float_type, text_attr
from gradbuilder.rules.sizes import Dims, as_int64, iprod, isub, reshape_like, scalar_of, stack, vec, zeros
from gradbuilder.rules.windows import spatial_rank


# ----------------------------------------------------------------------------- rearrangements


@register("DepthToSpace")
def depth_to_space(n, dys, needs, e):
    """DCR mode is undone by SpaceToDepth: dx = SpaceToDepth(dy).
    CRD mode: y[n, c, h*b + i, w*b + j] = x[n, c*b*b + i*b + j, h, w], so dx is dy viewed
    as [N, C, H, b, W, b], transposed to [N, C, b, b, H, W] and viewed as x."""
    (dy,) = dys
    b = attr(n, "blocksize")
    if text_attr(n, "mode", "DCR") != "CRD":
        return (e.SpaceToDepth(dy, blocksize=b),)
    d = Dims(e, n.inputs[0])
    blocks = e.Reshape(dy, stack(e, [d[0], -1, d[2], b, d[3], b]))
    return (reshape_like(e, e.Transpose(blocks, perm=[0, 1, 3, 5, 2, 4]), n.inputs[0]),)


@register("SpaceToDepth")
def space_to_depth(n, dys, needs, e):
    """SpaceToDepth is undone by DepthToSpace in the same mode (``mode``, DCR or CRD, since
    opset 28; DCR before): dx = DepthToSpace(dy, mode). Both move x[n, c, h*b + i, w*b + j]
    to channel (i*b + j)*C + c (DCR) or c*b*b + i*b + j (CRD), DepthToSpace back."""
    mode = text_attr(n, "mode", "DCR")
    if mode not in ("DCR", "CRD"):
        raise GradientRuleError(f"SpaceToDepth '{n.name}': mode {mode} has no gradient rule")
    return (e.DepthToSpace(dys[0], blocksize=attr(n, "blocksize"), mode=mode),)


@register("CenterCropPad")
def center_crop_pad(n, dys, needs, e):
    """y = x centre-cropped / zero-padded to ``shape`` on ``axes``. Cropping a length L to l
    keeps x[(L-l)//2 :][:l]; padding l to L puts x at offset (L-l)//2: the same offset, so
    crop and pad are each other's transpose and dx = CenterCropPad(dy, shape(x)[axes])."""
    x = n.inputs[0]
    axes = attr(n, "axes")
    d = Dims(e, x)
    target = d.vector() if axes is None else stack(e, [d[int(a)] for a in axes])
    return (e.CenterCropPad(dys[0], target, axes=axes), None)


# ----------------------------------------------------------------------------- Col2Im


@register("Col2Im")
def col2im(n, dys, needs, e):
    """y = Col2Im(x): entry (c*K + k, l) of x is added into channel c of the image at
    position l*strides + k*dilations - pads (k a kernel offset of the K = prod(block_shape),
    l a block). Linear in x, so dx is the Im2Col of dy: dx[c*K + k, l] = dy at that
    position (zero in the padding), i.e. each channel of dy convolved with the K one-hot
    kernels e_k (same strides, dilations, pads): Conv(dy as [N*C, 1, ...], eye(K) as
    [K, 1, *block_shape]) is [N*C, K, blocks...], which is x's layout."""
    x, _, block_shape = n.inputs[:3]
    (dy,) = dys
    ct = float_type(dy)
    block = constant_of(block_shape)
    if block is not None:
        k = int(np.prod(block))
        kernel = e.const(np.eye(k).reshape(k, 1, *[int(b) for b in block]), dtype=ct)
    else:
        blocks = as_int64(e, block_shape)
        k = e.reduce("ReduceProd", blocks, None, keepdims=True)
        square = e.ConstantOfShape(e.Concat(k, k, axis=0), value=ir.tensor(np.zeros(1, ct.numpy())))
        kernel = e.Reshape(e.EyeLike(square), e.Concat(k, e.ints([1]), blocks, axis=0))
    image = dims_of(dy)
    if image is not None and all(isinstance(a, int) for a in image[2:]):
        planes = e.Reshape(dy, [-1, 1, *image[2:]])
    else:
        planes = e.Reshape(dy, e.Concat(e.ints([-1, 1]), e.Shape(dy, 2), axis=0))
    cols = e.Conv(cast_to(e, planes, ct), kernel, strides=attr(n, "strides"), dilations=attr(n, "dilations"),
                  pads=attr(n, "pads"))
    return (cast_to(e, reshape_like(e, cols, x), dy.dtype), None, None)


# ----------------------------------------------------------------------------- AffineGrid


@register("AffineGrid")
def affine_grid(n, dys, needs, e):
    """grid[n, p] = theta[n] @ (base[p], 1) with base[p] the normalized coordinates
    (x, y[, z]) of output position p (align_corners as the node). Linear in theta:
    dtheta[n] = sum_p dy[n, p] (base[p], 1)^T = [dy[n]^T @ base | dy[n]^T @ 1].
    base is the node's AffineGrid of the identity transform, the runtime's own grid."""
    theta, size = n.inputs
    (dy,) = dys
    td = dims_of(theta)
    r = td[1] if td is not None and isinstance(td[1], int) else None
    if r is None:
        sd = dims_of(size)
        r = sd[0] - 2 if sd is not None and isinstance(sd[0], int) else spatial_rank(n, dy, required=False)
    if r is None:
        raise GradientRuleError("AffineGrid gradient: cannot tell whether the grid is 2-D or 3-D")
    # batch 2: onnxruntime's float16 AffineGrid (a function) fails for a batch of one
    identity = e.const(np.stack([np.eye(r, r + 1)] * 2), dtype=theta.dtype or ir.DataType.FLOAT)
    size_c = constant_of(size)
    if size_c is not None:
        two_size = e.ints([2, *[int(s) for s in size_c[1:]]])
    else:
        two_size = e.Concat(e.ints([2]), e.Slice(as_int64(e, size), e.ints([1]), e.ints([r + 2])), axis=0)
    grids = e.AffineGrid(e.CastLike(identity, dy), two_size, align_corners=attr(n, "align_corners", 0))
    base = e.Reshape(e.Gather(grids, e.ints([0]), axis=0), [-1, r])  # [P, r]
    dyt = e.Transpose(e.Reshape(dy, [0, -1, r]), perm=[0, 2, 1])  # [N, r, P]
    linear = dyt @ base  # [N, r, r]
    offset = e.reduce("ReduceSum", dyt, [2], keepdims=True)  # [N, r, 1]
    return (e.Concat(linear, offset, axis=2), None)


# ----------------------------------------------------------------------------- GridSample

_CUBIC_A = -0.75  # GridSample's cubic kernel (Keys, a = -0.75)


def _poly(e, t, coeffs):
    """coeffs[0] t^n + coeffs[1] t^(n-1) + ... + coeffs[n] (Horner)."""
    out = e.scalar(coeffs[0], like=t)
    for c in coeffs[1:]:
        out = out * t + c
    return out


def keys_kernel(e, dist, a=_CUBIC_A, support=False):
    """The cubic convolution kernel at distance ``dist`` >= 0 and its derivative:
    (a+2)d^3 - (a+3)d^2 + 1 for d <= 1, a d^3 - 5a d^2 + 8a d - 4a for 1 < d < 2 (and 0
    from d = 2 on with ``support``; without it every dist must be < 2). GridSample's cubic
    mode and Resize's (:mod:`gradbuilder.rules.resize`)."""
    near = e.LessOrEqual(dist, e.scalar(1.0, like=dist))
    w = e.Where(near, _poly(e, dist, [a + 2, -(a + 3), 0.0, 1.0]), _poly(e, dist, [a, -5 * a, 8 * a, -4 * a]))
    dw = e.Where(near, _poly(e, dist, [3 * (a + 2), -2 * (a + 3), 0.0]), _poly(e, dist, [3 * a, -10 * a, 8 * a]))
    if support:
        far = e.GreaterOrEqual(dist, e.scalar(2.0, like=dist))
        zero = e.scalar(0.0, like=dist)
        w, dw = e.Where(far, zero, w), e.Where(far, zero, dw)
    return w, dw


_OFFSETS = {"nearest": [0], "linear": [0, 1], "cubic": [-1, 0, 1, 2]}


def _reflect(e, idx, length, align):
    """Integer tap positions reflected into [0, length): about -0.5 and length - 0.5 (period
    2 length) without align_corners, about 0 and length - 1 (period 2 length - 2) with it."""
    if isinstance(length, int):
        period = e.ints([max(2 * length - 2 * align, 1)])
    else:
        period = e.Max(length * e.ints([2]) - e.ints([2 * align]), e.ints([1]))
    m = e.Mod(idx, period)
    back = period - e.ints([1 - align]) - m
    return e.Where(e.Less(m, vec(e, length)), m, back)


def _axis_taps(e, coord, length, mode, padding, align, ct):
    """One spatial axis: ``coord`` [N, 1, P] normalized sampling coordinates. Returns
    (tap positions [N, T, P] int64 in range, weights [N, T, P] or None for all ones,
    d weights / d coord [N, T, P] or None, d position / d coord) with zero padding folded
    into the weights."""
    pos, scale = _denormalized(e, coord, length, align, ct)
    if mode == "nearest":
        pos = e.Round(pos)  # half to even
    start = e.Floor(pos)
    frac = pos - start
    offsets = _OFFSETS[mode]
    idx = e.Cast(start, to=int(ir.DataType.INT64)) + e.const(np.array(offsets, np.int64).reshape(1, -1, 1))
    w, dw = _tap_weights(e, frac, mode, offsets, ct)
    last = vec(e, isub(e, length, 1))
    if padding == "zeros":
        inside = e.And(e.GreaterOrEqual(idx, e.ints([0])), e.LessOrEqual(idx, last))
        mask = e.Cast(inside, to=int(ct))
        w = mask if w is None else w * mask
        dw = None if dw is None else dw * mask
    if padding == "reflection":
        idx = _reflect(e, idx, length, align)
    else:  # border, and zeros (whose outside taps weigh 0)
        idx = e.Min(e.Max(idx, e.ints([0])), last)
    return idx, w, dw, scale


def _denormalized(e, coord, length, align, ct):
    """(the sampling position on an axis of ``length`` for the normalized ``coord``, its slope
    d position / d coord): [-1, 1] -> [0, length - 1] with align_corners, else
    [-0.5, length - 0.5]."""
    lf = e.scalar(float(length), like=coord) if isinstance(length, int) else e.Cast(length, to=int(ct))
    shifted = coord + 1.0
    if align:
        lm1 = lf - 1.0
        return shifted / 2.0 * lm1, lm1 / 2.0
    return (shifted * lf - 1.0) / 2.0, lf / 2.0


def _tap_weights(e, frac, mode, offsets, ct):
    """(weights of the taps at ``offsets`` from floor(position), d weights / d position) for
    the fraction ``frac`` past the floor: (1 - f, f) for linear, Keys' cubic at the taps'
    distances for cubic, (None, None) for nearest (one tap of weight 1)."""
    if mode == "linear":
        return e.Concat(1.0 - frac, frac, axis=1), e.const(np.array([-1.0, 1.0]).reshape(1, 2, 1), dtype=ct)
    if mode == "cubic":
        u = frac - e.const(np.array(offsets, dtype=float).reshape(1, -1, 1), dtype=ct)
        w, dk = keys_kernel(e, e.Abs(u))
        return w, dk * e.Sign(u)
    return None, None


def _place(e, v, a, r):
    """[N, T_a, P] -> [N, 1, .., T_a, .., 1, P] with T_a on axis 1 + a of r tap axes."""
    others = [1 + b for b in range(r) if b != a]
    return e.Unsqueeze(v, others) if others else v


def _product(e, factors):
    factors = [f for f in factors if f is not None]
    if not factors:
        return None
    out = factors[0]
    for f in factors[1:]:
        out = out * f
    return out


class _GridTaps(NamedTuple):
    """The taps of every sampling point of a GridSample, per spatial axis a (tap axis 1 + a
    of [N, T_0, .., T_r-1, P], see _place), and their rows in X."""

    w: list  # weights, None for all ones
    dw: list  # d weights / d position, None for nearest
    slope: list  # d position / d normalized coordinate
    flat: ir.Value  # [N, T, P]: each tap's row in X viewed as [N * plane, C]
    count: int  # T, the taps per sampling point

    def per_tap(self, e, v):
        """[N, T_0, .., T_r-1, P] -> [N, T, P]."""
        return e.Reshape(v, [0, self.count, -1])


def _grid_taps(e, grid, lengths, batch, plane, mode, padding, align, ct) -> _GridTaps:
    """The taps of the sampling points ``grid`` [N, *out, r] into X of spatial ``lengths``
    (``plane`` their product), every axis's (_axis_taps) placed on its own tap axis."""
    r = len(lengths)
    coords = e.Transpose(e.Reshape(cast_to(e, grid, ct), [0, -1, r]), perm=[0, 2, 1])  # [N, r, P]
    idx, w, dw, slope = [], [], [], []
    for a in range(r):  # grid[..., 0] is the last spatial axis
        taps = _axis_taps(e, e.Gather(coords, e.ints([r - 1 - a]), axis=1), lengths[a], mode, padding, align, ct)
        idx.append(_place(e, taps[0], a, r))
        w.append(None if taps[1] is None else _place(e, taps[1], a, r))
        dw.append(None if taps[2] is None else _place(e, taps[2], a, r))
        slope.append(taps[3])
    count = int(np.prod([len(_OFFSETS[mode])] * r))  # taps per sampling point
    return _GridTaps(w, dw, slope, _tap_rows(e, idx, lengths, batch, plane, count), count)


def _tap_rows(e, idx, lengths, batch, plane, count):
    """The flat row of each tap in X viewed as [N * plane, C]: n * plane + sum_a i_a * stride_a,
    as [N, T, P]."""
    r = len(lengths)
    flat, stride = None, 1
    for a in reversed(range(r)):
        term = idx[a] if stride == 1 else idx[a] * vec(e, stride)
        flat = term if flat is None else flat + term
        stride = iprod(e, [stride, lengths[a]])
    rows = e.Range(scalar_of(e, 0), scalar_of(e, batch), scalar_of(e, 1))
    first = e.Reshape(rows * vec(e, plane), [-1] + [1] * (r + 1))
    return e.Reshape(flat + first, [0, count, -1])  # [N, T, P]


def _grid_sample_modes(n):
    """(mode, padding_mode, align_corners) of a GridSample node, opset 16's mode names read as
    opset 20's; an error for those without a rule."""
    mode = text_attr(n, "mode", "linear")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)  # opset 16 names
    padding = text_attr(n, "padding_mode", "zeros")
    align = int(attr(n, "align_corners", 0))
    if mode not in _OFFSETS or padding not in ("zeros", "border", "reflection"):
        raise GradientRuleError(f"GridSample '{n.name}': mode {mode} / padding_mode {padding} has no gradient rule")
    return mode, padding, align


def _grid_rank(n, x, grid, dy):
    """The number of spatial axes a GridSample samples: the grid's last dim where known."""
    r = spatial_rank(n, x, grid, dy, required=False)
    gd = dims_of(grid)
    if gd is not None and isinstance(gd[-1], int):
        r = gd[-1]
    if r is None:
        raise unknown_rank(x, "GridSample")
    return r


def _scattered_to_taps(e, x, dyt, taps, batch, plane, width):
    """dX: dy [N, P, C] times each tap's weight, added into X's rows at the taps (ScatterND,
    add; float32 for 16-bit X)."""
    weight = _product(e, taps.w)  # None: every weight is 1 (nearest without zero padding)
    acc = accumulation_type(x, unique=False) or ir.DataType.FLOAT
    upd = e.Unsqueeze(cast_to(e, dyt, acc), [1])  # [N, 1, P, C]
    if weight is not None:
        upd = upd * e.Unsqueeze(cast_to(e, taps.per_tap(e, weight), acc), [3])  # [N, T, P, C]
    upd = e.Reshape(upd, e.Concat(e.ints([-1]), width, axis=0))
    base = zeros(e, e.Concat(vec(e, iprod(e, [batch, plane])), width, axis=0), x, acc)
    summed = e.ScatterND(base, e.Reshape(taps.flat, [-1, 1]), upd, reduction="add")  # [N * plane, C]
    per_batch = e.Reshape(summed, e.Concat(vec(e, batch), vec(e, plane), width, axis=0))
    return cast_to(e, reshape_like(e, e.Transpose(per_batch, perm=[0, 2, 1]), x), x.dtype)


def _grid_gradient(e, x, grid, dyt, taps, width, ct):
    """dgrid [N, *out, r]: per axis a, sum_c dy X at each tap times the weights' derivative on
    a and the other axes' weights, summed over the taps, times a's slope."""
    table = e.Reshape(e.Transpose(e.Reshape(cast_to(e, x, ct), [0, 0, -1]), perm=[0, 2, 1]),
                      e.Concat(e.ints([-1]), width, axis=0))  # [N * plane, C]
    picked = e.Gather(table, taps.flat, axis=0)  # [N, T, P, C]
    dot = e.reduce("ReduceSum", picked * e.Unsqueeze(cast_to(e, dyt, ct), [1]), [3],
                   keepdims=False)  # [N, T, P]: sum_c dy X at each tap
    r = len(taps.w)
    parts = [None] * r
    for a in range(r):
        da = taps.per_tap(e, _product(e, [taps.dw[a]] + [taps.w[b] for b in range(r) if b != a]))
        da = e.reduce("ReduceSum", dot * da, [1], keepdims=True)  # [N, 1, P]
        parts[r - 1 - a] = da * taps.slope[a]
    dgrid = e.Transpose(e.Concat(*parts, axis=1) if r > 1 else parts[0], perm=[0, 2, 1])  # [N, P, r]
    return cast_to(e, reshape_like(e, dgrid, grid), grid.dtype)


@register("GridSample")
def grid_sample(n, dys, needs, e):
    """Y[n, c, p] = sum over taps t of w_t(grid[n, p]) X[n, c, i_t(grid[n, p])]: the
    sampling point x_a = denormalize(grid[..., a]) on every spatial axis (align_corners),
    rounded half to even for nearest; taps floor(x_a) + {0} / {0, 1} / {-1, 0, 1, 2}
    (nearest / linear / cubic), weights the products over axes of 1, (1 - f, f) or the
    cubic kernel (a = -0.75) at the taps' distances; padding maps each tap index: zeros
    drops taps outside, border clamps them, reflection reflects them (as onnxruntime and
    torch do).

    dX[n, c, i] = sum of dy[n, c, p] w_t(p) over the taps landing on i (ScatterND, add).
    dgrid[n, p, a] = sum_c dy[n, c, p] sum_t X[n, c, i_t] dw_t / dx_a * dx_a / dgrid:
    (w_t)' on axis a times the other axes' weights, times the denormalization slope
    (length - 1) / 2 or length / 2; zero for nearest."""
    x, grid = n.inputs
    (dy,) = dys
    mode, padding, align = _grid_sample_modes(n)
    r = _grid_rank(n, x, grid, dy)
    ct = float_type(grid)
    xd = Dims(e, x)
    lengths = [xd[2 + a] for a in range(r)]
    batch, width = xd[0], vec(e, xd[1])
    plane = iprod(e, lengths)  # H*W(*D)
    taps = _grid_taps(e, grid, lengths, batch, plane, mode, padding, align, ct)
    dyt = e.Transpose(e.Reshape(dy, [0, 0, -1]), perm=[0, 2, 1])  # [N, P, C]
    dx = _scattered_to_taps(e, x, dyt, taps, batch, plane, width) if needs[0] else None
    dgrid = None
    if needs[1]:
        dgrid = e.zeros_like(grid) if mode == "nearest" else _grid_gradient(e, x, grid, dyt, taps, width, ct)
    return (dx, dgrid)
