"""Window geometry of the sliding-window ops (Conv, ConvTranspose, the pools, LpPool, RoiAlign).
A helper module: it registers no rule.

Each spatial axis is described in a *padded frame*: the input occupies frame positions
``[b, b + size)`` (``b`` the head padding) and window ``o`` reads positions ``o*s + k*d``
(``s`` stride, ``d`` dilation, ``k`` kernel tap). :func:`window_axes` reads a node's kernel,
strides, dilations and pads (auto_pad resolved) into one :class:`Axis` per spatial axis.

:func:`fit` cuts a given range out of a tensor and fills what lies outside it with zeros;
:func:`conv_fitted` and :func:`conv_transpose_fitted` fold it into the ``pads`` /
``output_padding`` attributes of a convolution when the shapes are static, and otherwise
emit Slice/Pad on size arithmetic (:mod:`gradbuilder.rules.sizes`).
"""

from __future__ import annotations

import dataclasses

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.values import attr, dims_of, unknown_rank
from gradbuilder.rules.sizes import dim, iadd, idiv, imax, imin, imul, is_static, isub, known, stack

Len = "int | ir.Value"  # a size: see gradbuilder.rules.sizes


def span_of(e, kernel, dilation: int):
    """Extent of one window: (kernel - 1) * dilation + 1."""
    return iadd(e, imul(e, isub(e, kernel, 1), dilation), 1)


def frame_of(e, count, stride: int, span):
    """Length covered by ``count`` windows: (count - 1) * stride + span."""
    return iadd(e, imul(e, isub(e, count, 1), stride), span)


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


def spatial_rank(n, *values, required: bool = True) -> int | None:
    """The number of spatial axes of node ``n`` (Conv, pooling, a grid op): rank - 2 of the
    first of ``values`` whose rank is known, else the length of its kernel_shape, strides or
    dilations, or half its pads; else None, or with ``required`` the unknown-rank error."""
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
    if not required:
        return None
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
            total = imax(e, isub(e, ax.frame, ax.size), 0)
            small = idiv(e, total, 2)
            ax.begin = small if auto_pad == "SAME_UPPER" else isub(e, total, small)
            ax.end = isub(e, total, ax.begin)
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
    lo = [imax(e, s, 0) for s in starts]
    hi = [imax(e, imin(e, c, iadd(e, s, n)), a) for c, s, n, a in zip(cur, starts, lengths, lo)]
    cut = [i for i in range(r) if not (is_static(lo[i], hi[i], cur[i]) and lo[i] == 0 and hi[i] == cur[i])]
    if cut:
        v = e.Slice(v, stack(e, [lo[i] for i in cut]), stack(e, [hi[i] for i in cut]),
                    e.ints([first + i for i in cut]))
    before = [imax(e, isub(e, 0, s), 0) for s in starts]
    after = [isub(e, isub(e, n, b), isub(e, h, a)) for n, b, h, a in zip(lengths, before, hi, lo)]
    if not (is_static(*before, *after) and not any(before) and not any(after)):
        pads = stack(e, [0] * first + before + [0] * first + after)
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
