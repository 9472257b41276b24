"""Convolutions: Conv, ConvTranspose and DeformConv.

Conv and ConvTranspose are described on each spatial axis in a *padded frame*: the input occupies frame positions
``[b, b + size)`` (``b`` the head padding) and window ``o`` reads positions ``o*s + k*d``
(``s`` stride, ``d`` dilation, ``k`` kernel tap). Their gradients are again (transposed)
convolutions, followed or preceded by :func:`fit`, which cuts a given range out of a tensor and
fills what lies outside it with zeros. With static shapes ``fit`` folds into the ``pads`` /
``output_padding`` attributes; with dynamic ones it becomes Slice/Pad on Shape arithmetic.

DeformConv reads X bilinearly at offset positions: its gradient is written on the im2col
matrix of those samples (a gather of the four corners), see :func:`deform_conv`.

The spatial helpers here are shared with ``pooling.py``, ``misc_norm.py`` and ``roi.py``.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import attr, dims_of, register, unknown_rank
from gradbuilder.rules.shape import is_static

INT64_MIN = int(np.iinfo(np.int64).min)

# ----------------------------------------------------------------------------- dynamic ints
# A length is a Python int when static, else a 1-element int64 tensor computed at run time.

Len = "int | ir.Value"


def _v(e, a):
    return e.ints([a]) if isinstance(a, int) else a


def add(e, a, b):
    return a + b if isinstance(a, int) and isinstance(b, int) else e.Add(_v(e, a), _v(e, b))


def sub(e, a, b):
    return a - b if isinstance(a, int) and isinstance(b, int) else e.Sub(_v(e, a), _v(e, b))


def mul(e, a, k: int):
    return a * k if isinstance(a, int) else (a if k == 1 else e.Mul(a, e.ints([k])))


def half(e, a):
    """a // 2 for a >= 0."""
    return a // 2 if isinstance(a, int) else e.Div(a, e.ints([2]))


def maximum(e, a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else e.Max(_v(e, a), _v(e, b))


def minimum(e, a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else e.Min(_v(e, a), _v(e, b))


def vec(e, items):
    """A 1-D int64 tensor of ``items`` (a constant when all are static)."""
    if all(isinstance(a, int) for a in items):
        return e.ints(list(items))
    return e.Concat(*[_v(e, a) for a in items], axis=0)


def prod(e, a, b):
    """a * b for lengths (ints or 1-element int64 tensors)."""
    return a * b if isinstance(a, int) and isinstance(b, int) else e.Mul(_v(e, a), _v(e, b))


def arange(e, stop, like=None):
    """0, 1, ..., stop-1 (stop an int or a 1-element tensor): int64, or in like's dtype."""
    if isinstance(stop, int):
        if like is None:
            return e.ints(list(range(stop)))
        return e.const(np.arange(stop), dtype=like.dtype or ir.DataType.FLOAT)
    out = e.Range(e.const(np.array(0, np.int64)), e.Reshape(stop, e.ints([])), e.const(np.array(1, np.int64)))
    return out if like is None else e.CastLike(out, like)


_DIMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # emitter -> {(value, axis): tensor}


def dim(e, v, axis: int):
    """Dimension ``axis`` of ``v``: an int when static, else Gather(Shape(v)) (emitted once)."""
    d = dims_of(v)
    if d is not None and len(d) > axis and isinstance(d[axis], int):
        return d[axis]
    cache = _DIMS.setdefault(e, {})
    if (v, axis) not in cache:
        cache[(v, axis)] = e.Gather(e.Shape(v), e.ints([axis]), axis=0)
    return cache[(v, axis)]


def shape_of(e, v, rank: int, start: int = 0):
    """``Shape(v)[start:]`` as a list of dims (static ints or 1-element tensors)."""
    return [dim(e, v, i) for i in range(start, rank)]


def known(e, v, dims, like):
    """Record ``dims`` (ints; run-time tensors count as unknown) as ``v``'s shape, so that later
    steps fold what is static (e.g. the spatial axes when only the batch axis is dynamic)."""
    if dims is not None:
        e._set(v, like.dtype, tuple(d if isinstance(d, (int, str)) else None for d in dims))
    return v


def reshape(e, v, dims, like=None):
    """Reshape ``v`` to ``dims`` (ints, tensors, or -1/0 placeholders) and record what is known."""
    out = e.Reshape(v, vec(e, dims))
    src = dims_of(v)
    rec = []
    for i, d in enumerate(dims):
        if isinstance(d, int) and d == 0:  # copies v's dim i
            rec.append(src[i] if src is not None and i < len(src) else None)
        elif isinstance(d, int) and d > 0:
            rec.append(d)
        else:
            rec.append(None)
    return known(e, out, rec, like or v)


# ----------------------------------------------------------------------------- geometry


def span_of(e, kernel, dilation: int):
    """Extent of one window: (kernel - 1) * dilation + 1."""
    return add(e, mul(e, sub(e, kernel, 1), dilation), 1)


def frame_of(e, count, stride: int, span):
    """Length covered by ``count`` windows: (count - 1) * stride + span."""
    return add(e, mul(e, sub(e, count, 1), stride), span)


@dataclasses.dataclass
class Axis:
    """One spatial axis of a sliding-window op: input length ``size``, output length ``out``,
    effective head/tail padding ``begin``/``end`` (auto_pad resolved), window extent ``span``
    and the frame length ``frame`` = (out - 1) * stride + span the windows cover."""

    size: Len
    out: Len
    kernel: Len
    stride: int
    dilation: int
    span: Len
    frame: Len
    begin: Len = 0
    end: Len = 0


def spatial_rank(n, *values) -> int:
    for v in values:
        d = dims_of(v) if v is not None else None
        if d is not None:
            return len(d) - 2
    for name in ("kernel_shape", "strides", "dilations"):
        a = attr(n, name)
        if a:
            return len(a)
    pads = attr(n, "pads")
    if pads:
        return len(pads) // 2
    raise unknown_rank(values[0], n.op_type)


def window_axes(e, n, x, y, kernel, pool: bool = False) -> list[Axis]:
    """The spatial axes of a Conv/pooling node ``n`` with input ``x``, output ``y`` and
    ``kernel`` (a list of lengths); auto_pad is resolved to the pads the op uses:
    SAME_* pads ``max(0, (out - 1) * stride + span - size)`` in total, the odd one at the end
    (SAME_UPPER) or at the beginning (SAME_LOWER)."""
    r = len(kernel)
    strides = attr(n, "strides") or [1] * r
    dilations = attr(n, "dilations") or [1] * r
    pads = attr(n, "pads") or [0] * (2 * r)
    auto_pad = attr(n, "auto_pad", "NOTSET")
    if pool and auto_pad in ("SAME_UPPER", "SAME_LOWER") and any(int(d) != 1 for d in dilations):
        raise GradientRuleError(
            f"{n.op_type} with auto_pad={auto_pad} and dilations {list(dilations)}: onnxruntime and onnx's "
            "reference evaluator each compute a different output than the ONNX spec here, so the gradient "
            "would not match the forward; use explicit pads"
        )
    axes = []
    for i in range(r):
        s, d, out = int(strides[i]), int(dilations[i]), dim(e, y, 2 + i)
        span = span_of(e, kernel[i], d)
        ax = Axis(dim(e, x, 2 + i), out, kernel[i], s, d, span, frame_of(e, out, s, span))
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            total = maximum(e, sub(e, ax.frame, ax.size), 0)
            small = half(e, total)
            ax.begin = small if auto_pad == "SAME_UPPER" else sub(e, total, small)
            ax.end = sub(e, total, ax.begin)
        elif auto_pad == "VALID":
            pass
        elif auto_pad in ("NOTSET", "", None):
            ax.begin, ax.end = int(pads[i]), int(pads[r + i])
        else:
            raise GradientRuleError(f"{n.op_type}: unknown auto_pad '{auto_pad}'")
        axes.append(ax)
    return axes


# ----------------------------------------------------------------------------- fit


def fit(e, v, starts, lengths, first: int = 2, value=None, cur=None):
    """``v`` cut to ``[start, start + length)`` on axes ``first, first+1, ...``, positions
    outside ``v`` filled with ``value`` (zeros by default): Slice, then Pad. ``cur``: the
    current lengths, when known better than ``v``'s recorded shape."""
    r = len(starts)
    if cur is None:
        cur = [dim(e, v, first + i) for i in range(r)]
    shape = dims_of(v)
    lo = [maximum(e, s, 0) for s in starts]
    hi = [maximum(e, minimum(e, c, add(e, s, n)), a) for c, s, n, a in zip(cur, starts, lengths, lo)]
    cut = [i for i in range(r) if not (is_static(lo[i], hi[i], cur[i]) and lo[i] == 0 and hi[i] == cur[i])]
    if cut:
        v = e.Slice(v, vec(e, [lo[i] for i in cut]), vec(e, [hi[i] for i in cut]),
                    e.ints([first + i for i in cut]))
    before = [maximum(e, sub(e, 0, s), 0) for s in starts]
    after = [sub(e, sub(e, n, b), sub(e, h, a)) for n, b, h, a in zip(lengths, before, hi, lo)]
    if not (is_static(*before, *after) and not any(before) and not any(after)):
        pads = vec(e, [0] * first + before + [0] * first + after)
        v = e.Pad(v, pads) if value is None else e.Pad(v, pads, value)
    if shape is not None:
        known(e, v, list(shape[:first]) + list(lengths), v)
    return v


def conv_fitted(e, x, w, starts, lengths, strides, dilations, group: int = 1):
    """Conv(fit(x, starts, lengths), w). The fit folds into ``pads`` when it only pads at the
    front, and at the back pads or drops elements no window reaches."""
    r = len(starts)
    size = [dim(e, x, 2 + i) for i in range(r)]
    attrs = dict(strides=list(strides), dilations=list(dilations), group=group)
    wd = dims_of(w)
    kernel = [wd[2 + i] if wd is not None and len(wd) == r + 2 else None for i in range(r)]
    if is_static(*starts, *lengths, *size) and all(st <= 0 for st in starts):
        tails = [st + n - c for st, n, c in zip(starts, lengths, size)]

        def same_count(i):  # dropping -tail trailing elements leaves the output length alone
            if tails[i] >= 0:
                return True
            if not isinstance(kernel[i], int):
                return False
            span = (kernel[i] - 1) * dilations[i] + 1
            return (lengths[i] - span) // strides[i] == (lengths[i] - tails[i] - span) // strides[i]

        if all(same_count(i) for i in range(r)):
            return e.Conv(x, w, pads=[-st for st in starts] + [max(t, 0) for t in tails], **attrs)
    return e.Conv(fit(e, x, starts, lengths, cur=size), w, **attrs)


def conv_transpose_fitted(e, x, w, kernel, starts, lengths, strides, dilations, group: int = 1):
    """fit(ConvTranspose(x, w), starts, lengths) on the unpadded transposed convolution
    (frame length ``(in - 1) * stride + span``): folds into ``pads`` and ``output_padding``
    when the cut starts inside the frame and overhangs its end by less than a stride."""
    r = len(starts)
    attrs = dict(strides=list(strides), dilations=list(dilations), group=group)
    size = [dim(e, x, 2 + i) for i in range(r)]
    frame = [frame_of(e, i, s, span_of(e, k, d)) for i, s, k, d in zip(size, strides, kernel, dilations)]
    if is_static(*starts, *lengths, *frame):
        over = [st + n - f for st, n, f in zip(starts, lengths, frame)]
        if all(st >= 0 for st in starts) and all(o < s for o, s in zip(over, strides)):
            pads = list(starts) + [max(-o, 0) for o in over]
            if any(o > 0 for o in over):
                attrs["output_padding"] = [max(o, 0) for o in over]
            return e.ConvTranspose(x, w, pads=pads, **attrs)
    return fit(e, e.ConvTranspose(x, w, **attrs), starts, lengths, cur=frame)


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
    moved = e.Transpose(reshape(e, v, split + shape[2:]), perm=[2, 1, 0] + list(range(3, rank + 1)))
    return reshape(e, moved, merged + shape[2:], like=v)


def kernel_dims(e, n, w, r):
    """Kernel lengths: W's static dims, else the kernel_shape attribute, else Shape(W)."""
    ks = attr(n, "kernel_shape")
    d = dims_of(w)
    out = []
    for i in range(r):
        if d is not None and isinstance(d[2 + i], int):
            out.append(d[2 + i])
        elif ks:
            out.append(int(ks[i]))
        else:
            out.append(dim(e, w, 2 + i))
    return out


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
        g = conv_fitted(e, xt, swap01(e, dy, r + 2), [sub(e, 0, a.begin) for a in axes],
                        [a.frame for a in axes], dilations, strides, group)
        dw = swap01(e, g, r + 2)
    if len(n.inputs) > 2 and n.inputs[2] is not None and needs[2]:
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
    g = e.Reshape(e.MatMul(dyt, flat), e.ints([m] + kernel + [c]))
    return e.Transpose(g, perm=[0, r + 1] + spatial)


def _conv_dx_grouped(e, dy, w, axes, group, r):
    """dx of a grouped Conv as a plain grouped Conv (onnx's reference ConvTranspose mixes up
    groups unless in = out = group channels): dy with (stride - 1) zeros inserted between its
    elements, correlated with w flipped in space and transposed within each group."""
    # zeros between dy's elements: a stride-s ConvTranspose of every (n, m) plane with a 1x..x1 one
    if any(a.stride > 1 for a in axes):
        shape = shape_of(e, dy, r + 2)
        planes = reshape(e, dy, [shape[0] * shape[1] if is_static(*shape[:2]) else -1, 1] + shape[2:])
        one = e.const(np.ones([1, 1] + [1] * r), dtype=dy.dtype or ir.DataType.FLOAT)
        up = e.ConvTranspose(planes, one, strides=[a.stride for a in axes])
        spread = [frame_of(e, a.out, a.stride, 1) for a in axes]
        dy = reshape(e, up, shape[:2] + spread, like=dy)
    # w (M, C/g, *K) -> (C, M/g, *K), flipped: wt[j*C/g + c, m] = w[j*M/g + m, c, K-1-k]
    wshape = shape_of(e, w, r + 2)
    m, cg = wshape[0], wshape[1]
    split = reshape(e, w, [group, m // group if isinstance(m, int) else -1] + wshape[1:])
    moved = e.Transpose(split, perm=[0, 2, 1] + list(range(3, r + 3)))
    wt = reshape(e, moved, [mul(e, cg, group), m // group if isinstance(m, int) else -1] + wshape[2:], like=w)
    flipped = e.Slice(wt, e.ints([-1] * r), e.ints([INT64_MIN] * r), e.ints(list(range(2, r + 2))),
                      e.ints([-1] * r))
    wt = known(e, flipped, dims_of(wt), w)
    reach = [mul(e, sub(e, a.kernel, 1), a.dilation) for a in axes]
    return conv_fitted(e, dy, wt, [sub(e, a.begin, k) for a, k in zip(axes, reach)],
                       [add(e, a.size, k) for a, k in zip(axes, reach)], [1] * r,
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
            out = int(out_shape[len(out_shape) - r + i]) if out_shape else mul(e, size, strides[i])
            total = sub(e, add(e, frame, out_pad[i]), out)
            if not out_shape and isinstance(total, int) and total < 0:
                raise GradientRuleError(
                    f"ConvTranspose with auto_pad={auto_pad}: the kernel spans less than a stride on spatial "
                    f"axis {i}, so the spec's output (input * stride) is larger than the full transposed "
                    "convolution, and onnxruntime computes a shorter output than shape inference; no "
                    "gradient is defined. Use explicit pads or output_shape instead"
                )
            total = maximum(e, total, 0)
            small = half(e, total)
            begins.append(small if auto_pad == "SAME_UPPER" else sub(e, total, small))
        elif auto_pad == "VALID":
            begins.append(0)
        else:
            begins.append(int(pads[i]))
        frames.append(frame)

    dx = dw = db = None
    if needs[0]:
        dx = conv_fitted(e, dy, w, [sub(e, 0, b) for b in begins], frames, strides, dilations, group)
    if needs[1]:
        dyt = channels_to_batch(e, dy, group, r + 2)
        g = conv_fitted(e, dyt, swap01(e, x, r + 2), [sub(e, 0, b) for b in begins], frames,
                        dilations, strides, group)
        dw = swap01(e, g, r + 2)
    if len(n.inputs) > 2 and n.inputs[2] is not None and needs[2]:
        db = bias_grad(e, dy, r + 2)
    return [dx, dw, db][: len(n.inputs)]


# ----------------------------------------------------------------------------- DeformConv


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
    k = prod(e, kh, kw)
    o = prod(e, oh, ow)
    hw = prod(e, h, wd)
    if dy.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):  # positions and sums in float32
        dy = e.Cast(dy, to=int(ir.DataType.FLOAT))
    like = dy
    f = lambda v: e.scalar(float(v), like)  # noqa: E731
    xx = e.CastLike(x, like)

    # sampling positions, (N, og, L) with L = (kh, kw, oh, ow): kernel tap major
    full = vec(e, [kh, kw, oh, ow])

    def base(kn, on, axis):  # k*dilation + o*stride - pad_begin over (kh, kw, oh, ow), flattened
        tap = e.unsqueeze(e.Mul(arange(e, kn, like), f(dilations[axis])), [1, 2, 3] if axis == 0 else [0, 2, 3])
        out = e.Sub(e.Mul(arange(e, on, like), f(strides[axis])), f(pads[axis]))
        out = e.unsqueeze(out, [0, 1, 3] if axis == 0 else [0, 1, 2])
        return e.Reshape(e.Expand(e.Add(tap, out), full), e.ints([-1]))

    base_y, base_x = base(kh, oh, 0), base(kw, ow, 1)
    off = e.CastLike(e.Reshape(offset, vec(e, [big_n, og, k, 2, o])), like)
    off_y, off_x = e.op("Split", off, outputs=2, axis=3, **({"num_outputs": 2} if e.opset >= 18 else {}))
    py = e.Add(e.Reshape(off_y, vec(e, [big_n, og, -1])), base_y)  # (N, og, L)
    px = e.Add(e.Reshape(off_x, vec(e, [big_n, og, -1])), base_x)

    # four corners (a, b) = (0,0) (0,1) (1,0) (1,1): global row index into X as (N*og*H*W, C/og)
    y0, x0 = e.Floor(py), e.Floor(px)
    ly, lx = e.Sub(py, y0), e.Sub(px, x0)
    wy = [e.Sub(f(1.0), ly), ly]
    wx = [e.Sub(f(1.0), lx), lx]
    hf, wf = (e.CastLike(v, like) if not isinstance(v, int) else f(v) for v in (h, wd))
    i64 = int(ir.DataType.INT64)
    plane = e.Mul(e.unsqueeze(e.Reshape(arange(e, prod(e, big_n, og)), vec(e, [big_n, og])), [2]),
                  e.ints([hw]) if isinstance(hw, int) else hw)  # (N, og, 1): first row of each plane
    zero = e.const(np.array(0, np.int64))
    rows, inside = [], []
    for a in (0, 1):
        for bb in (0, 1):
            yi, xi = e.Add(y0, f(a)), e.Add(x0, f(bb))
            ok = e.And(e.And(e.GreaterOrEqual(yi, f(0)), e.Less(yi, hf)),
                       e.And(e.GreaterOrEqual(xi, f(0)), e.Less(xi, wf)))
            yk = e.Where(ok, e.Cast(yi, to=i64), zero)  # corners outside X read row 0, weighted 0
            xk = e.Where(ok, e.Cast(xi, to=i64), zero)
            rows.append(e.Add(plane, e.Add(e.Mul(yk, e.ints([wd]) if isinstance(wd, int) else wd), xk)))
            inside.append(e.CastLike(ok, like))
    index = e.unsqueeze(e.Concat(*rows, axis=2), [-1])  # (N, og, 4L, 1)
    cg = c // og if isinstance(c, int) else e.Div(c, e.ints([og]))
    xt = e.Transpose(e.Reshape(xx, vec(e, [big_n, og, cg, hw])), perm=[0, 1, 3, 2])
    table = e.Reshape(xt, vec(e, [-1, cg]))  # (N*og*H*W, C/og)
    vals = e.Reshape(e.GatherND(table, index), vec(e, [big_n, og, 4, -1, cg]))  # (N, og, 4, L, C/og)
    v = [e.Mul(e.Gather(vals, e.const(np.array(i, np.int64)), axis=2), e.unsqueeze(inside[i], [-1]))
         for i in range(4)]  # each (N, og, L, C/og), zero outside X
    wgt = [e.unsqueeze(e.Mul(wy[a], wx[bb]), [-1]) for a in (0, 1) for bb in (0, 1)]
    sampled = e.Add(e.Add(e.Mul(wgt[0], v[0]), e.Mul(wgt[1], v[1])), e.Add(e.Mul(wgt[2], v[2]), e.Mul(wgt[3], v[3])))
    mk = None
    if mask is not None:
        mk = e.unsqueeze(e.Reshape(e.CastLike(mask, like), vec(e, [big_n, og, -1])), [-1])  # (N, og, L, 1)
    cols_nl = e.Mul(sampled, mk) if mk is not None else sampled

    def to_groups(v):  # (N, og, L, C/og) -> (N, group, C/group*K, O)
        t = e.Transpose(e.Reshape(v, vec(e, [big_n, og, k, o, cg])), perm=[0, 1, 4, 2, 3])
        return e.Reshape(t, vec(e, [big_n, group, -1, o]))

    def from_groups(v):  # the inverse
        t = e.Reshape(v, vec(e, [big_n, og, cg, k, o]))
        return e.Reshape(e.Transpose(t, perm=[0, 1, 3, 4, 2]), vec(e, [big_n, og, -1, cg]))

    dy_g = e.Reshape(dy, vec(e, [big_n, group, -1, o]))  # (N, group, M/group, O)
    mg = m // group if isinstance(m, int) else e.Div(m, e.ints([group]))
    w_g = e.Reshape(e.CastLike(w, like), vec(e, [group, mg, -1]))  # (group, M/group, C/group*K)
    dx = dw = doff = db = dmask = None
    if needs[1]:
        g = e.reduce("ReduceSum", e.MatMul(dy_g, e.Transpose(to_groups(cols_nl), perm=[0, 1, 3, 2])), [0],
                     keepdims=False)
        dw = e.CastLike(e.Reshape(g, e.Shape(w)), w)
    if len(n.inputs) > 3 and b is not None and needs[3]:
        db = e.CastLike(bias_grad(e, dy, 4), b)
    if needs[0] or needs[2] or (mask is not None and len(n.inputs) > 4 and needs[4]):
        dcols = from_groups(e.MatMul(e.Transpose(w_g, perm=[0, 2, 1]), dy_g))  # (N, og, L, C/og)
        if mask is not None and needs[4]:
            dm = e.reduce("ReduceSum", e.Mul(dcols, sampled), [3], keepdims=False)  # (N, og, L)
            dmask = e.CastLike(e.Reshape(dm, e.Shape(mask)), mask)
        ds = e.Mul(dcols, mk) if mk is not None else dcols
        if needs[0]:
            updates = e.Concat(*[e.Mul(ds, e.Mul(wgt[i], e.unsqueeze(inside[i], [-1]))) for i in range(4)], axis=2)
            zeros = e.Expand(e.scalar(0.0, like), e.Shape(table))
            acc = e.ScatterND(zeros, index, updates, reduction="add")  # (N*og*H*W, C/og)
            g = e.Transpose(e.Reshape(acc, vec(e, [big_n, og, hw, cg])), perm=[0, 1, 3, 2])
            dx = e.CastLike(e.Reshape(g, e.Shape(x)), x)
        if needs[2]:
            # dS/dp_y = sum_b wx_b (v[1b] - v[0b]); dS/dp_x = sum_a wy_a (v[a1] - v[a0])
            wxu = [e.unsqueeze(t, [-1]) for t in wx]
            wyu = [e.unsqueeze(t, [-1]) for t in wy]
            s_y = e.Add(e.Mul(wxu[0], e.Sub(v[2], v[0])), e.Mul(wxu[1], e.Sub(v[3], v[1])))
            s_x = e.Add(e.Mul(wyu[0], e.Sub(v[1], v[0])), e.Mul(wyu[1], e.Sub(v[3], v[2])))
            gy = e.reduce("ReduceSum", e.Mul(ds, s_y), [3], keepdims=False)  # (N, og, L)
            gx = e.reduce("ReduceSum", e.Mul(ds, s_x), [3], keepdims=False)
            both = e.Concat(e.Reshape(gy, vec(e, [big_n, og, k, 1, o])),
                            e.Reshape(gx, vec(e, [big_n, og, k, 1, o])), axis=3)
            doff = e.CastLike(e.Reshape(both, e.Shape(offset)), offset)
    return [dx, dw, doff, db, dmask][: len(n.inputs)]
