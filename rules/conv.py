"""Convolutions: Conv, ConvTranspose, DeformConv and CausalConvWithState.

Conv and ConvTranspose are described on each spatial axis in a *padded frame*: the input occupies frame positions
``[b, b + size)`` (``b`` the head padding) and window ``o`` reads positions ``o*s + k*d``
(``s`` stride, ``d`` dilation, ``k`` kernel tap). Their gradients are again (transposed)
convolutions, followed or preceded by ``fit``, which cuts a given range out of a tensor and
fills what lies outside it with zeros. With static shapes ``fit`` folds into the ``pads`` /
``output_padding`` attributes; with dynamic ones it becomes Slice/Pad on Shape arithmetic.
The window geometry (``window_axes``, ``fit``, ``conv_fitted``, ...) is
:mod:`gradbuilder.rules.windows`, shared with ``pooling.py`` (the Lp pools too) and ``roi.py``;
the size arithmetic :mod:`gradbuilder.rules.sizes`.

DeformConv reads X bilinearly at offset positions: its gradient is written on the im2col
matrix of those samples (a gather of the four corners), see :func:`deform_conv`.

CausalConvWithState (opset 27), a depthwise causal 1-D convolution with a carried state, is
written with its taps (shifted slices or gathered windows), see :func:`causal_conv_with_state`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, dims_of, optional_input
from gradbuilder.rules.helpers import HALF_TYPES, cast_to, compute_type, wants
from gradbuilder.rules.sizes import (
    INT64_MAX,
    Dims,
    arange,
    dim,
    idiv,
    iadd,
    imax,
    imul,
    is_static,
    isub,
    known,
    reshape_to,
    reverse,
    scalar_of,
    shape_of,
    stack,
)
from gradbuilder.rules.windows import (
    conv_fitted,
    conv_transpose_fitted,
    fit,
    frame_of,
    kernel_dims,
    span_of,
    spatial_rank,
    window_axes,
)

INT64_MIN = int(np.iinfo(np.int64).min)


# ----------------------------------------------------------------------------- layout


def swap01(e, v, rank):
    """``v`` with axes 0 and 1 swapped."""
    return e.Transpose(v, perm=[1, 0] + list(range(2, rank)))


def channels_to_batch(e, v, group: int, rank: int):
    """(N, C, *S) -> (C/g, g*N, *S): channel c = j*C/g + i goes to batch i, channel j*N + n.
    A convolution with ``group`` then correlates each group of channels separately."""
    if group == 1:
        return swap01(e, v, rank)
    shape = shape_of(e, v, rank)
    n, c = shape[0], shape[1]
    if is_static(n, c):
        split, merged = [n, group, c // group], [c // group, group * n]
    else:
        split, merged = [n, group, -1], [0, -1]
    moved = e.Transpose(reshape_to(e, v, split + shape[2:]), perm=[2, 1, 0] + list(range(3, rank + 1)))
    return reshape_to(e, moved, merged + shape[2:], like=v)


def bias_grad(e, dy, rank):
    """dB = dy summed over every axis but the channel axis."""
    return e.reduce("ReduceSum", dy, [0] + list(range(2, rank)), keepdims=False)


# ----------------------------------------------------------------------------- Conv


@register("Conv")
def conv(n, dys, needs, e):
    """y[n, m, o] = sum_{c in group(m), k} x[n, c, o*s + k*d - b] * w[m, c, k] + B[m]

    dx = ConvTranspose(dy, w) (same strides, dilations, group), cut to x's extent;
    dw[m, c, k] = sum_{n, o} dy[n, m, o] * x[n, c, k*d + o*s - b]: one matrix product over
    x's im2col columns when they are static and small (see _conv_dw_im2col), else a Conv of x
    (batch and channel axes swapped) with dy as the kernel, stride d and dilation s;
    dB = sum of dy over all axes but 1."""
    x, w = n.inputs[0], n.inputs[1]
    (dy,) = dys
    r = spatial_rank(n, x, w, dy)
    group = int(attr(n, "group", 1))
    axes = window_axes(e, n, x, n.outputs[0], kernel_dims(e, n, w, r))
    strides = [a.stride for a in axes]
    dilations = [a.dilation for a in axes]
    dx = dw = db = None

    if needs[0]:
        wd = dims_of(w)
        depthwise = wd is not None and wd[0] == group and wd[1] == 1
        if group == 1 or depthwise:
            dx = conv_transpose_fitted(e, dy, w, [a.kernel for a in axes], [a.begin for a in axes],
                                       [a.size for a in axes], strides, dilations, group)
        else:
            dx = _conv_dx_grouped(e, dy, w, axes, group, r)
    if needs[1] and group == 1 and _im2col_fits(x, w, axes):
        dw = _conv_dw_im2col(e, x, dy, axes, r)
    elif needs[1]:
        xt = channels_to_batch(e, x, group, r + 2)
        g = conv_fitted(e, xt, swap01(e, dy, r + 2), [isub(e, 0, a.begin) for a in axes],
                        [a.frame for a in axes], dilations, strides, group)
        dw = swap01(e, g, r + 2)
    if wants(needs, 2):
        db = bias_grad(e, dy, r + 2)
    return [dx, dw, db][: len(n.inputs)]


IM2COL_GROWTH = 9  # the im2col weight gradient may hold at most this many copies of x


def _im2col_fits(x, w, axes) -> bool:
    """True when the column matrix of x is static and at most IM2COL_GROWTH times x's size:
    kernel volume / (product of strides) <= IM2COL_GROWTH."""
    xd, wd = dims_of(x), dims_of(w)
    if xd is None or wd is None or not is_static(*xd[1:], *wd):
        return False
    if not all(is_static(a.size, a.out, a.kernel, a.frame, a.begin) for a in axes):
        return False
    return np.prod([a.kernel for a in axes]) <= IM2COL_GROWTH * np.prod([a.stride for a in axes])


def _conv_dw_im2col(e, x, dy, axes, r):
    """dw of a Conv with one group as one matrix product (faster than a Conv with the batch as
    channels): with x channels-last and cut to the frame, the columns
    cols[(n, o), (k, c)] = x[n, o*s + k*d - b, c] are one strided Slice per kernel tap k,
    concatenated; dw[m, (k, c)] = sum_{(n, o)} dy[n, m, o] * cols[(n, o), (k, c)]."""
    c, m = dims_of(x)[1], dims_of(dy)[1]
    kernel = [a.kernel for a in axes]
    spatial = list(range(1, r + 1))
    framed = fit(e, x, [-a.begin for a in axes], [a.frame for a in axes])
    framed = e.Transpose(framed, perm=[0] + list(range(2, r + 2)) + [1])  # (N, *frame, C)
    cols = [e.Slice(framed, e.ints([k * a.dilation for k, a in zip(tap, axes)]),
                    e.ints([k * a.dilation + (a.out - 1) * a.stride + 1 for k, a in zip(tap, axes)]),
                    e.ints(spatial), e.ints([a.stride for a in axes]))
            for tap in np.ndindex(*kernel)]
    col = e.Concat(*cols, axis=r + 1) if len(cols) > 1 else cols[0]  # (N, *O, K*C)
    flat = e.Reshape(col, e.ints([-1, len(cols) * c]))
    dyt = e.Reshape(swap01(e, dy, r + 2), e.ints([m, -1]))  # (M, N*O)
    g = e.Reshape(dyt @ flat, e.ints([m] + kernel + [c]))
    return e.Transpose(g, perm=[0, r + 1] + spatial)


def _conv_dx_grouped(e, dy, w, axes, group, r):
    """dx of a grouped Conv as a plain grouped Conv (onnx's reference ConvTranspose mixes up
    groups unless in = out = group channels): dy with (stride - 1) zeros inserted between its
    elements, correlated with w flipped in space and transposed within each group."""
    # zeros between dy's elements: a stride-s ConvTranspose of every (n, m) plane with a 1x..x1 one
    if any(a.stride > 1 for a in axes):
        shape = shape_of(e, dy, r + 2)
        planes = reshape_to(e, dy, [shape[0] * shape[1] if is_static(*shape[:2]) else -1, 1] + shape[2:])
        one = e.const(np.ones([1, 1] + [1] * r), dtype=dy.dtype or ir.DataType.FLOAT)
        up = e.ConvTranspose(planes, one, strides=[a.stride for a in axes])
        spread = [frame_of(e, a.out, a.stride, 1) for a in axes]
        dy = reshape_to(e, up, shape[:2] + spread, like=dy)
    # w (M, C/g, *K) -> (C, M/g, *K), flipped: wt[j*C/g + c, m] = w[j*M/g + m, c, K-1-k]
    wshape = shape_of(e, w, r + 2)
    m, cg = wshape[0], wshape[1]
    split = reshape_to(e, w, [group, m // group if isinstance(m, int) else -1] + wshape[1:])
    moved = e.Transpose(split, perm=[0, 2, 1] + list(range(3, r + 3)))
    wt = reshape_to(e, moved, [imul(e, cg, group), m // group if isinstance(m, int) else -1] + wshape[2:], like=w)
    flipped = e.Slice(wt, e.ints([-1] * r), e.ints([INT64_MIN] * r), e.ints(list(range(2, r + 2))),
                      e.ints([-1] * r))
    wt = known(e, flipped, dims_of(wt), w)
    reach = [imul(e, isub(e, a.kernel, 1), a.dilation) for a in axes]
    return conv_fitted(e, dy, wt, [isub(e, a.begin, k) for a, k in zip(axes, reach)],
                       [iadd(e, a.size, k) for a, k in zip(axes, reach)], [1] * r,
                       [a.dilation for a in axes], group)


# ----------------------------------------------------------------------------- ConvTranspose


@register("ConvTranspose")
def conv_transpose(n, dys, needs, e):
    """y[n, m, t - b] = sum_{c in group(m), i, k: i*s + k*d = t} x[n, c, i] * w[c, m, k] + B[m]
    for frame positions t in [0, (in - 1)*s + span) (output_padding extends y with zeros).

    dx = Conv(dy placed in the frame, w) (stride s, dilation d, group);
    dw[c, m, k] = sum_{n, i} x[n, c, i] * dy[n, m, i*s + k*d - b]: a Conv of dy (batch and
    channel axes swapped) with x as the kernel, stride d and dilation s; dB as for Conv.

    The head padding b follows the ONNX spec (and onnxruntime): explicit pads; or, with
    output_shape or SAME_*, total = frame + output_padding - out, b = total // 2 for SAME_UPPER
    and total - total // 2 otherwise. An output_shape larger than the frame (total < 0) is
    padded at the end: b = 0 and positions past the frame get only B (onnxruntime clamps the
    total padding at 0; onnx's reference agrees without auto_pad, and with SAME_* starts such
    an output before the frame instead)."""
    x, w = n.inputs[0], n.inputs[1]
    (dy,) = dys
    r = spatial_rank(n, x, w, dy)
    group = int(attr(n, "group", 1))
    kernel = kernel_dims(e, n, w, r)
    strides = [int(s) for s in (attr(n, "strides") or [1] * r)]
    dilations = [int(d) for d in (attr(n, "dilations") or [1] * r)]
    out_pad = [int(p) for p in (attr(n, "output_padding") or [0] * r)]
    out_shape = attr(n, "output_shape")
    auto_pad = attr(n, "auto_pad", "NOTSET")
    pads = attr(n, "pads") or [0] * (2 * r)

    frames, begins = [], []
    for i in range(r):
        size = dim(e, x, 2 + i)
        frame = frame_of(e, size, strides[i], span_of(e, kernel[i], dilations[i]))
        if out_shape or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out = int(out_shape[len(out_shape) - r + i]) if out_shape else imul(e, size, strides[i])
            total = isub(e, iadd(e, frame, out_pad[i]), out)
            if not out_shape and isinstance(total, int) and total < 0:
                raise GradientRuleError(
                    f"ConvTranspose with auto_pad={auto_pad}: the kernel spans less than a stride on spatial "
                    f"axis {i}, so the spec's output (input * stride) is larger than the full transposed "
                    "convolution, and onnxruntime computes a shorter output than shape inference; no "
                    "gradient is defined. Use explicit pads or output_shape instead"
                )
            total = imax(e, total, 0)
            small = idiv(e, total, 2)
            begins.append(small if auto_pad == "SAME_UPPER" else isub(e, total, small))
        elif auto_pad == "VALID":
            begins.append(0)
        else:
            begins.append(int(pads[i]))
        frames.append(frame)

    dx = dw = db = None
    if needs[0]:
        dx = conv_fitted(e, dy, w, [isub(e, 0, b) for b in begins], frames, strides, dilations, group)
    if needs[1]:
        dyt = channels_to_batch(e, dy, group, r + 2)
        g = conv_fitted(e, dyt, swap01(e, x, r + 2), [isub(e, 0, b) for b in begins], frames,
                        dilations, strides, group)
        dw = swap01(e, g, r + 2)
    if wants(needs, 2):
        db = bias_grad(e, dy, r + 2)
    return [dx, dw, db][: len(n.inputs)]


# ----------------------------------------------------------------------------- DeformConv


class _DeformSizes(NamedTuple):
    """DeformConv's sizes (ints or 1-element int64 tensors): X (batch, c, h, w), W's m,
    the kernel (kh, kw), the output (oh, ow), k = kh kw, o = oh ow and hw = h w."""

    batch: object
    c: object
    h: object
    w: object
    m: object
    kh: object
    kw: object
    oh: object
    ow: object
    k: object
    o: object
    hw: object


class _Samples(NamedTuple):
    """X read bilinearly at the sampling positions, L = (kh, kw, oh, ow) per offset group."""

    table: ir.Value  # X as rows (N*og*H*W, C/og)
    index: ir.Value  # (N, og, 4L, 1): the four corners' rows in ``table``
    cg: object  # C/og, the channels of an offset group
    wy: list  # the bilinear weights along y, (1 - ly, ly), each (N, og, L)
    wx: list  # and along x
    inside: list  # per corner (0,0) (0,1) (1,0) (1,1): 1 where it lies in X, (N, og, L)
    values: list  # per corner: X there, (N, og, L, C/og), zero outside X
    weights: list  # per corner: its bilinear weight wy_a wx_b, (N, og, L, 1)
    sampled: ir.Value  # S: the weighted sum of the corners, (N, og, L, C/og)


def _deform_positions(e, offset, sz, og, strides, dilations, pads, like):
    """The sampling positions (p_y, p_x), each (N, og, L) with L = (kh, kw, oh, ow) kernel
    tap major: k*dilation + o*stride - pad_begin + the offset."""
    full = stack(e, [sz.kh, sz.kw, sz.oh, sz.ow])

    def base(kn, on, axis):  # k*dilation + o*stride - pad_begin over (kh, kw, oh, ow), flattened
        tap = e.Unsqueeze(arange(e, kn, like) * dilations[axis], [1, 2, 3] if axis == 0 else [0, 2, 3])
        out = arange(e, on, like) * strides[axis] - pads[axis]
        out = e.Unsqueeze(out, [0, 1, 3] if axis == 0 else [0, 1, 2])
        return e.Reshape(e.Expand(tap + out, full), e.ints([-1]))

    base_y, base_x = base(sz.kh, sz.oh, 0), base(sz.kw, sz.ow, 1)
    off = e.CastLike(e.Reshape(offset, stack(e, [sz.batch, og, sz.k, 2, sz.o])), like)
    off_y, off_x = e.split_into(off, 2, axis=3)
    py = e.Reshape(off_y, stack(e, [sz.batch, og, -1])) + base_y  # (N, og, L)
    px = e.Reshape(off_x, stack(e, [sz.batch, og, -1])) + base_x
    return py, px


def _bilinear_samples(e, xx, py, px, sz, og, like) -> _Samples:
    """X (``xx``, in the compute type) at (py, px): its four corners (a, b) = (0,0) (0,1)
    (1,0) (1,1) gathered as rows of X viewed as (N*og*H*W, C/og) (corners outside X read
    row 0, weighted 0) and their bilinear sum."""
    f = lambda v: e.scalar(float(v), like)  # noqa: E731
    h, wd, hw = sz.h, sz.w, sz.hw
    y0, x0 = e.Floor(py), e.Floor(px)
    ly, lx = py - y0, px - x0
    wy = [1 - ly, ly]
    wx = [1 - lx, lx]
    hf, wf = (e.CastLike(v, like) if not isinstance(v, int) else f(v) for v in (h, wd))
    i64 = int(ir.DataType.INT64)
    plane = (e.Unsqueeze(e.Reshape(arange(e, imul(e, sz.batch, og)), stack(e, [sz.batch, og])), [2])
             * (e.ints([hw]) if isinstance(hw, int) else hw))  # (N, og, 1): first row of each plane
    zero = e.const(np.array(0, np.int64))
    rows, inside = [], []
    for a in (0, 1):
        for bb in (0, 1):
            yi, xi = y0 + a, x0 + bb
            ok = e.And(e.And(e.GreaterOrEqual(yi, f(0)), e.Less(yi, hf)),
                       e.And(e.GreaterOrEqual(xi, f(0)), e.Less(xi, wf)))
            yk = e.Where(ok, e.Cast(yi, to=i64), zero)  # corners outside X read row 0, weighted 0
            xk = e.Where(ok, e.Cast(xi, to=i64), zero)
            rows.append(plane + (yk * (e.ints([wd]) if isinstance(wd, int) else wd) + xk))
            inside.append(e.CastLike(ok, like))
    index = e.Unsqueeze(e.Concat(*rows, axis=2), [-1])  # (N, og, 4L, 1)
    c = sz.c
    cg = c // og if isinstance(c, int) else c / e.ints([og])
    xt = e.Transpose(e.Reshape(xx, stack(e, [sz.batch, og, cg, hw])), perm=[0, 1, 3, 2])
    table = e.Reshape(xt, stack(e, [-1, cg]))  # (N*og*H*W, C/og)
    vals = e.Reshape(e.GatherND(table, index), stack(e, [sz.batch, og, 4, -1, cg]))  # (N, og, 4, L, C/og)
    v = [e.Gather(vals, e.const(np.array(i, np.int64)), axis=2) * e.Unsqueeze(inside[i], [-1])
         for i in range(4)]  # each (N, og, L, C/og), zero outside X
    wgt = [e.Unsqueeze(wy[a] * wx[bb], [-1]) for a in (0, 1) for bb in (0, 1)]
    sampled = (wgt[0] * v[0] + wgt[1] * v[1]) + (wgt[2] * v[2] + wgt[3] * v[3])
    return _Samples(table, index, cg, wy, wx, inside, v, wgt, sampled)


def _to_groups(e, v, sz, og, cg, group):
    """(N, og, L, C/og) -> (N, group, C/group*K, O): the im2col layout of the grouped MatMul."""
    t = e.Transpose(e.Reshape(v, stack(e, [sz.batch, og, sz.k, sz.o, cg])), perm=[0, 1, 4, 2, 3])
    return e.Reshape(t, stack(e, [sz.batch, group, -1, sz.o]))


def _from_groups(e, v, sz, og, cg):
    """The inverse of _to_groups."""
    t = e.Reshape(v, stack(e, [sz.batch, og, cg, sz.k, sz.o]))
    return e.Reshape(e.Transpose(t, perm=[0, 1, 3, 4, 2]), stack(e, [sz.batch, og, -1, cg]))


def _deform_dw(e, dy_g, cols, sz, og, cg, group, w):
    """dW = sum_n dY cols^T per group, cols (N, og, L, C/og) the (masked) samples."""
    g = e.reduce("ReduceSum", dy_g @ e.Transpose(_to_groups(e, cols, sz, og, cg, group), perm=[0, 1, 3, 2]),
                 [0], keepdims=False)
    return e.CastLike(e.Reshape(g, e.Shape(w)), w)


def _deform_dmask(e, dcols, samples, mask):
    """dmask = sum over the offset group's channels of dcols * S."""
    dm = e.reduce("ReduceSum", dcols * samples.sampled, [3], keepdims=False)  # (N, og, L)
    return e.CastLike(e.Reshape(dm, e.Shape(mask)), mask)


def _deform_dx(e, ds, samples, sz, og, x, like):
    """dX: ds (dcols * mask) times each corner's bilinear weight, scatter-added onto the four
    corners (corners outside X weigh 0)."""
    updates = e.Concat(*[ds * (samples.weights[i] * e.Unsqueeze(samples.inside[i], [-1])) for i in range(4)], axis=2)
    zeros = e.Expand(e.scalar(0.0, like), e.Shape(samples.table))
    acc = e.ScatterND(zeros, samples.index, updates, reduction="add")  # (N*og*H*W, C/og)
    g = e.Transpose(e.Reshape(acc, stack(e, [sz.batch, og, sz.hw, samples.cg])), perm=[0, 1, 3, 2])
    return e.CastLike(e.Reshape(g, e.Shape(x)), x)


def _deform_doffset(e, ds, samples, sz, og, offset):
    """doffset (per axis) = sum over channels of ds * dS/dp:
    dS/dp_y = sum_b wx_b (v[1b] - v[0b]); dS/dp_x = sum_a wy_a (v[a1] - v[a0])."""
    v = samples.values
    wxu = [e.Unsqueeze(t, [-1]) for t in samples.wx]
    wyu = [e.Unsqueeze(t, [-1]) for t in samples.wy]
    s_y = wxu[0] * (v[2] - v[0]) + wxu[1] * (v[3] - v[1])
    s_x = wyu[0] * (v[1] - v[0]) + wyu[1] * (v[3] - v[2])
    gy = e.reduce("ReduceSum", ds * s_y, [3], keepdims=False)  # (N, og, L)
    gx = e.reduce("ReduceSum", ds * s_x, [3], keepdims=False)
    both = e.Concat(e.Reshape(gy, stack(e, [sz.batch, og, sz.k, 1, sz.o])),
                    e.Reshape(gx, stack(e, [sz.batch, og, sz.k, 1, sz.o])), axis=3)
    return e.CastLike(e.Reshape(both, e.Shape(offset)), offset)


@register("DeformConv", since=19)
def deform_conv(n, dys, needs, e):
    """Y[n, m, o] = B[m] + sum_{c in group(m), k} W[m, c, k] * mask[n, g(c), k, o] * S[n, c, k, o],
    S = X[n, c] read bilinearly (zeros outside X) at p = o*stride - pad_begin + k*dilation +
    offset[n, g(c), k, :, o]; g(c) the offset group of channel c. With the im2col
    cols = mask * S (N, C*K, O), Y is a grouped MatMul of W and cols, so

    dW = sum_n dY cols^T; dB = sum of dY; dcols = W^T dY;
    dmask = sum over the offset group's channels of dcols * S;
    dX: dcols * mask * (each corner's bilinear weight) scatter-added (ScatterND, reduction
    'add') onto the four corners; doffset (per axis) = sum over channels of dcols * mask *
    dS/dp, dS/dp_y = sum_b wx_b (x[y1, x_b] - x[y0, x_b]) (and likewise for p_x).
    Two spatial axes (the form onnx's reference and onnxruntime implement)."""
    x, w, offset = n.inputs[:3]
    b = n.inputs[3] if len(n.inputs) > 3 else None
    mask = n.inputs[4] if len(n.inputs) > 4 else None
    (dy,) = dys
    if dy is None:
        return [None] * len(n.inputs)
    r = spatial_rank(n, x, w, offset, dy)
    if r != 2:
        raise GradientRuleError(f"DeformConv: {r} spatial axes; the gradient supports 2 (as onnxruntime)")
    group = int(attr(n, "group", 1))
    og = int(attr(n, "offset_group", 1))
    strides = [int(s) for s in (attr(n, "strides") or [1, 1])]
    dilations = [int(d) for d in (attr(n, "dilations") or [1, 1])]
    pads = [int(p) for p in (attr(n, "pads") or [0, 0, 0, 0])]
    kh, kw = kernel_dims(e, n, w, 2)
    big_n, c, h, wd = (dim(e, x, i) for i in range(4))
    m = dim(e, w, 0)
    oh, ow = dim(e, dy, 2), dim(e, dy, 3)
    k = imul(e, kh, kw)
    o = imul(e, oh, ow)
    hw = imul(e, h, wd)
    sz = _DeformSizes(big_n, c, h, wd, m, kh, kw, oh, ow, k, o, hw)
    dy = cast_to(e, dy, compute_type(dy))  # positions and sums in float32 for 16-bit floats
    like = dy
    xx = e.CastLike(x, like)

    py, px = _deform_positions(e, offset, sz, og, strides, dilations, pads, like)
    samples = _bilinear_samples(e, xx, py, px, sz, og, like)
    cg = samples.cg
    mk = None
    if mask is not None:
        mk = e.Unsqueeze(e.Reshape(e.CastLike(mask, like), stack(e, [big_n, og, -1])), [-1])  # (N, og, L, 1)
    cols_nl = samples.sampled * mk if mk is not None else samples.sampled

    dy_g = e.Reshape(dy, stack(e, [big_n, group, -1, o]))  # (N, group, M/group, O)
    mg = m // group if isinstance(m, int) else m / e.ints([group])
    w_g = e.Reshape(e.CastLike(w, like), stack(e, [group, mg, -1]))  # (group, M/group, C/group*K)
    dx = dw = doff = db = dmask = None
    if needs[1]:
        dw = _deform_dw(e, dy_g, cols_nl, sz, og, cg, group, w)
    if wants(needs, 3):
        db = e.CastLike(bias_grad(e, dy, 4), b)
    if needs[0] or needs[2] or wants(needs, 4):
        dcols = _from_groups(e, e.Transpose(w_g, perm=[0, 2, 1]) @ dy_g, sz, og, cg)  # (N, og, L, C/og)
        if wants(needs, 4):
            dmask = _deform_dmask(e, dcols, samples, mask)
        ds = dcols * mk if mk is not None else dcols
        if needs[0]:
            dx = _deform_dx(e, ds, samples, sz, og, x, like)
        if needs[2]:
            doff = _deform_doffset(e, ds, samples, sz, og, offset)
    return [dx, dw, doff, db, dmask][: len(n.inputs)]


# ----------------------------------------------------------------------------- CausalConvWithState


def _taps(e, x, length, k):
    """U[b, c, t, j] = x[b, c, t + j] for t < length, j < k: (B, C, length, k)."""
    rows = e.Reshape(e.Range(scalar_of(e, 0), scalar_of(e, length), scalar_of(e, 1)), [-1, 1])
    cols = e.Reshape(e.Range(scalar_of(e, 0), scalar_of(e, k), scalar_of(e, 1)), [1, -1])
    return e.Gather(x, rows + cols, axis=2)


def _dot_taps(e, u, w):
    """sum_j u[b, c, t, j] w[c, 0, j]: (B, C, T)."""
    return e.reduce("ReduceSum", u * w, [3], keepdims=False)


def _pad_time(e, v, before, after):
    """``v`` (B, C, T) zero-padded on the time axis."""
    return e.Pad(v, stack(e, [0, 0, before, 0, 0, after]))


class _Shifted:
    """The correlations as k shifted slices of P (the kernel size is known statically)."""

    def __init__(self, e, padded, w, k, length):
        self.e, self.padded, self.k = e, padded, k
        self.w = e.Reshape(w, [0, -1])  # (C, k)

    def tap(self, v, j, tail):
        """v[:, :, j : len(v) - tail]"""
        return self.e.Slice(v, self.e.ints([j]), self.e.ints([-tail if tail else INT64_MAX]), self.e.ints([2]))

    def weight(self, j):
        return self.e.Slice(self.w, self.e.ints([j]), self.e.ints([j + 1]), self.e.ints([1]))  # (C, 1)

    def total(self, parts):
        return parts[0] if len(parts) == 1 else self.e.Sum(*parts)

    def conv(self):
        """sum_j P[:, :, j : j + L] w[:, j]"""
        k = self.k
        return self.total([self.tap(self.padded, j, k - 1 - j) * self.weight(j) for j in range(k)])

    def input_grad(self, dconv):
        """d P = sum_j w[:, j] (d conv shifted right by j), as a slice of d conv padded on both sides"""
        e, k = self.e, self.k
        padded = _pad_time(e, dconv, k - 1, k - 1)
        return self.total([self.weight(j) * self.tap(padded, k - 1 - j, j) for j in range(k)])

    def weight_grad(self, dconv):
        """d w[:, 0, j] = sum over b, t of P[:, :, j : j + L] d conv"""
        e, k = self.e, self.k
        cols = [e.reduce("ReduceSum", self.tap(self.padded, j, k - 1 - j) * dconv, [0, 2], keepdims=True)
                for j in range(k)]  # (1, C, 1) each
        return e.Transpose(e.Concat(*cols, axis=2) if k > 1 else cols[0], perm=[1, 0, 2])


class _Unfolded:
    """The same correlations on the gathered taps U (the kernel size known at run time only)."""

    def __init__(self, e, padded, w, k, length):
        self.e, self.padded, self.w, self.k, self.length = e, padded, w, k, length
        self._u = None

    def taps(self):
        if self._u is None:
            self._u = _taps(self.e, self.padded, self.length, self.k)  # (B, C, L, k)
        return self._u

    def conv(self):
        return _dot_taps(self.e, self.taps(), self.w)

    def input_grad(self, dconv):
        """d P[s] = sum_j w[k-1-j] d conv[s - (k-1) + j]"""
        e, km1 = self.e, isub(self.e, self.k, 1)
        back = _taps(e, _pad_time(e, dconv, km1, km1), iadd(e, self.length, km1), self.k)
        return _dot_taps(e, back, reverse(e, self.w, [2]))

    def weight_grad(self, dconv):
        """(C, 1, B * L) @ (C, B * L, k) -> (C, 1, k)"""
        e = self.e
        lhs = e.Reshape(e.Transpose(dconv, perm=[1, 0, 2]), [0, 1, -1])
        rhs = e.Reshape(e.Transpose(self.taps(), perm=[1, 0, 2, 3]), stack(e, [0, -1, self.k]))
        return lhs @ rhs


def _silu_slope(e, conv, like):
    """d silu(c) / dc = s (1 + c (1 - s)), in float32 for float16 / bfloat16."""
    wide = ir.DataType.FLOAT if like.dtype in HALF_TYPES else None
    c = cast_to(e, conv, wide)
    s = e.Sigmoid(c)
    return s * (1 + c * (1 - s)), wide


@register("CausalConvWithState")
def causal_conv_with_state(n, dys, needs, e):
    """CausalConvWithState is a depthwise causal 1-D convolution over ``(B, C, L)`` with a carried
    state of the last ``k - 1`` positions. With ``P = concat(past_state or zeros, input)``
    (length ``L + k - 1``) and ``U[b, c, t, j] = P[b, c, t + j]`` (the ``k`` taps of output
    ``t``)::

        conv[b, c, t] = sum_j U[b, c, t, j] w[c, 0, j] + bias[c]
        output        = conv, or silu(conv) = conv * sigmoid(conv)   (activation silu / swish)
        present_state = P[:, :, L:]

    The gradient is written with the same taps::

        d conv = d output (activation none), or d output * s (1 + conv (1 - s)), s = sigmoid(conv)
        d P[s] = sum_j w[j] d conv[s - j]   (zero outside 0..L-1)   + d present_state at L..
        d past_state, d input = d P split after k - 1 positions
        d w[c, 0, j] = sum_{b, t} U[b, c, t, j] d conv[b, c, t]      d bias = sum_{b, t} d conv

    The activation is evaluated in float32 for float16 / bfloat16 inputs, as the operator does.
    With a static kernel size (depthwise causal kernels are short: 2..4) each tap is a slice of
    P and each correlation k element-wise products, which onnxruntime runs faster than grouped
    Conv / ConvTranspose nodes (and the function body's gradient); otherwise U is gathered at
    run time, which needs neither the channel count nor the kernel size.

    With a static kernel size the correlations are k shifted slices (``_Shifted``); otherwise
    they run on the unfolded taps (``_Unfolded``)."""
    x, w = n.inputs[:2]
    bias, past = optional_input(n, 2), optional_input(n, 3)
    dy, d_present = (list(dys) + [None])[:2]
    need_x, need_w, need_b = needs[0], needs[1], wants(needs, 2)
    need_past = wants(needs, 3)
    k, length = Dims(e, w)[2], Dims(e, x)[2]
    km1 = isub(e, k, 1)
    padded = e.Concat(past, x, axis=2) if past is not None else _pad_time(e, x, km1, 0)
    ops = (_Shifted if isinstance(k, int) else _Unfolded)(e, padded, w, k, length)

    dconv = dy
    if dy is not None and attr(n, "activation", "none") in ("silu", "swish"):
        conv = ops.conv()
        if bias is not None:
            conv = conv + e.Unsqueeze(bias, [1])
        slope, wide = _silu_slope(e, conv, x)
        dconv = cast_to(e, cast_to(e, dy, wide) * slope, x.dtype if wide else None)

    dx = dpast = dw = db = None
    if need_x or need_past:
        parts = [ops.input_grad(dconv)] if dconv is not None else []
        if d_present is not None:  # present_state = P[:, :, L:]
            parts.append(_pad_time(e, d_present, length, 0))
        if parts:
            dpad = parts[0] if len(parts) == 1 else parts[0] + parts[1]
            cut = e.ints([km1]) if isinstance(km1, int) else km1
            dx = e.Slice(dpad, cut, e.ints([INT64_MAX]), e.ints([2])) if need_x else None
            dpast = e.Slice(dpad, e.ints([0]), cut, e.ints([2])) if need_past else None
    if need_w and dconv is not None:
        dw = ops.weight_grad(dconv)
    if need_b and dconv is not None:
        db = e.reduce("ReduceSum", dconv, [0, 2], keepdims=False)
    grads = [dx, dw, db, dpast]
    return [(g if g is not None else e.zeros_like(v)) if need else None
            for v, need, g in zip(n.inputs, needs, grads)]
