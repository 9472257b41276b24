"""Pooling: MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool, MaxUnpool, LpPool,
GlobalLpPool.

Windows are described as in ``conv.py``: on each spatial axis window ``o`` covers frame
positions ``o*s + j*d`` (j < kernel), the input sitting at ``[b, b + size)``. Backward passes
work on the (N*C, 1, *spatial) planes of the input, where scattering values back into their
windows is a ConvTranspose with one input channel (the form onnx's reference evaluator and
onnxruntime agree on).

The Lp pools are norms of windows: ``y = (sum |x|^p)^(1/p)``, so
``dx = sign(x) |x|^(p-1) * (the sum, over the windows holding x, of dy * y^(1-p))``.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, dims_of
from gradbuilder.rules.helpers import HALF_TYPES, dtype_of, rank_of, safe_div
from gradbuilder.rules.sizes import dim, iadd, imul, is_static, isub, known, reshape_to, stack
from gradbuilder.rules.windows import conv_fitted, conv_transpose_fitted, fit, frame_of, window_axes


def _planes(e, v, rank):
    """(N, C, *S) -> (N*C, 1, *S)."""
    d = dims_of(v)
    lead = d[0] * d[1] if d is not None and is_static(*d[:2]) else -1
    return reshape_to(e, v, [lead, 1] + [dim(e, v, i) for i in range(2, rank)])


def _unplanes(e, v, like):
    """(N*C, 1, *S) -> like's shape."""
    d = dims_of(like)
    if d is not None and is_static(*d):
        return reshape_to(e, v, list(d), like=like)
    return e.Reshape(v, e.Shape(like))


def _scatter_windows(e, planes_grad, taps, axes, x):
    """Add each window's values back onto the input positions they were read from:
    ``planes_grad`` (N*C, taps, *out) through a stride-s ConvTranspose whose kernel ``taps``
    maps tap t to its kernel offset, cut to the input's extent; reshaped like ``x``."""
    g = conv_transpose_fitted(e, planes_grad, taps, [a.kernel for a in axes], [a.begin for a in axes],
                              [a.size for a in axes], [a.stride for a in axes], [a.dilation for a in axes])
    return _unplanes(e, g, x)


# ----------------------------------------------------------------------------- AveragePool


def _counts_static(axes, include_pad: bool):
    """Per-window element counts (numpy, shape out): positions inside the input (or inside the
    padded input with count_include_pad), never the ceil_mode overhang past the end padding."""
    per_axis = []
    for a in axes:
        lo, hi = (-a.begin, a.size + a.end) if include_pad else (0, a.size)
        starts = np.arange(a.out) * a.stride - a.begin
        taps = starts[:, None] + np.arange(a.kernel)[None, :] * a.dilation
        per_axis.append(((taps >= lo) & (taps < hi)).sum(axis=1))
    count = per_axis[0]
    for c in per_axis[1:]:
        count = np.multiply.outer(count, c)
    return np.maximum(count, 1)


def _counts_dynamic(e, axes, include_pad: bool, like):
    """The same counts from ops: a ones tensor over the counted positions, summed per window."""
    lengths = [iadd(e, a.size, iadd(e, a.begin, a.end)) if include_pad else a.size for a in axes]
    starts = [0 if include_pad else isub(e, 0, a.begin) for a in axes]
    one = e.scalar(1.0, like)
    ones = e.Expand(one, stack(e, [1, 1] + lengths))
    kernel = e.const(np.ones([1, 1] + [a.kernel for a in axes]), dtype=dtype_of(like))
    return conv_fitted(e, ones, kernel, starts, [a.frame for a in axes],
                       [a.stride for a in axes], [a.dilation for a in axes])


@register("AveragePool")
def average_pool(n, dys, needs, e):
    """y[o] = (1 / count[o]) * sum of x over window o  =>  dx = sum over the windows holding
    each x of dy / count: a ConvTranspose of dy / count with a ones kernel, per channel plane.
    count = window elements inside x (count_include_pad=0) or inside x and its pads (=1);
    positions of a ceil_mode window past the end padding never count."""
    x, y = n.inputs[0], n.outputs[0]
    (dy,) = dys
    kernel = [int(k) for k in attr(n, "kernel_shape")]
    rank = rank_of(x, dy, fallback=len(kernel) + 2)
    axes = window_axes(e, n, x, y, kernel, pool=True)
    include_pad = bool(attr(n, "count_include_pad", 0))

    if all(is_static(a.size, a.out, a.begin, a.end) for a in axes):
        count = _counts_static(axes, include_pad)
        if np.all(count == count.flat[0]):
            scaled = dy / float(count.flat[0])
        else:
            scaled = dy / e.const(count, dtype=dtype_of(dy, x))
    else:
        scaled = dy / _counts_dynamic(e, axes, include_pad, x)
    ones = e.const(np.ones([1, 1] + kernel), dtype=dtype_of(x, dy))
    return (_scatter_windows(e, _planes(e, scaled, rank), ones, axes, x),)


# ----------------------------------------------------------------------------- MaxPool

_POOL_ATTRS = ("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides")


@register("MaxPool")
def max_pool(n, dys, needs, e):
    """dx[i] = sum of dy[o] over the windows o whose maximum is x[i] (the first one in the
    window, in row-major order, as the Indices output picks).

    opset >= 16: scatter-add dy at the Indices of a MaxPool of x (ScatterElements, reduction
    'add'); overlapping windows that share a maximum add up. Windows that do not overlap have
    distinct indices: MaxUnpool writes dy at them (several times faster on onnxruntime).
    opset 13-15: every window's elements side by side, (N*C, taps, *out), from one strided Slice
    per kernel tap of x padded with -inf; a tap receives dy where it equals the window's
    maximum and no earlier tap does (CumSum of the matches == 1); a ConvTranspose whose kernel
    sends tap t to its kernel offset adds the taps back onto x's positions, so overlapping
    windows add up exactly as with Indices."""
    x, y = n.inputs[0], n.outputs[0]
    dy = dys[0]
    if dy is None:
        return (None,)
    kernel = [int(k) for k in attr(n, "kernel_shape")]
    rank = rank_of(x, dy, fallback=len(kernel) + 2)
    axes = window_axes(e, n, x, y, kernel, pool=True)
    if e.opset >= 16:
        return (_max_pool_scatter(n, e, x, dy, axes),)
    return (_max_pool_taps(e, x, y, dy, axes, rank),)


def _max_pool_scatter(n, e, x, dy, axes):
    if len(n.outputs) > 1 and n.outputs[1] is not None and attr(n, "storage_order", 0) == 0:
        indices = n.outputs[1]
    else:
        attrs = {k: attr(n, k) for k in _POOL_ATTRS if attr(n, k) is not None}
        _, indices = e.op("MaxPool", x, outputs=2, **attrs)
        indices.dtype = ir.DataType.INT64  # the emitter gives every output the input's dtype
    if dtype_of(x, dy) == ir.DataType.FLOAT and _tiles_input(axes):
        # every x in at most one window: the indices are distinct, MaxUnpool writes dy at them
        return e.MaxUnpool(dy, indices, e.Shape(x), kernel_shape=[a.kernel for a in axes],
                           strides=[a.stride for a in axes], pads=[a.begin for a in axes] + [a.end for a in axes])
    d = dims_of(x)
    static = d is not None and is_static(*d)
    numel = e.ints([int(np.prod(d, dtype=np.int64))]) if static else e.Reshape(e.Size(x), e.ints([1]))
    dtype = dtype_of(x, dy)
    # onnxruntime's CPU ScatterElements cannot add float16: accumulate 16-bit floats in float32
    acc = ir.DataType.FLOAT if dtype in HALF_TYPES else dtype
    updates = e.Reshape(dy, e.ints([-1]))
    if acc != dtype:
        updates = e.Cast(updates, to=int(acc))
    zeros = e.Expand(e.const(np.zeros(1), dtype=acc), numel)
    summed = e.ScatterElements(zeros, e.Reshape(indices, e.ints([-1])), updates, axis=0, reduction="add")
    if acc != dtype:
        summed = e.Cast(summed, to=int(dtype))
    return e.Reshape(summed, e.ints(list(d)) if static else e.Shape(x))


def _tiles_input(axes) -> bool:
    """Static spatial axes whose windows do not overlap (span <= stride) and whose MaxUnpool
    default length (out - 1) * stride - pads + kernel is x's length (where onnxruntime and onnx's
    reference evaluator agree on MaxUnpool)."""
    return all(is_static(a.size, a.out, a.span, a.begin, a.end) and a.span <= a.stride
               and (a.out - 1) * a.stride - a.begin - a.end + a.kernel == a.size for a in axes)


def _max_pool_taps(e, x, y, dy, axes, rank):
    r = len(axes)
    padded = fit(e, _planes(e, x, rank), [isub(e, 0, a.begin) for a in axes], [a.frame for a in axes],
                 value=e.scalar(-np.inf, x))
    spatial = e.ints(list(range(2, r + 2)))
    steps = e.ints([a.stride for a in axes])
    taps = []
    for offset in itertools.product(*[range(a.kernel) for a in axes]):
        begin = [k * a.dilation for k, a in zip(offset, axes)]
        end = [iadd(e, b, frame_of(e, a.out, a.stride, 1)) for b, a in zip(begin, axes)]
        taps.append(e.Slice(padded, stack(e, begin), stack(e, end), spatial, steps))
    n_taps = len(taps)
    cols = e.Concat(*taps, axis=1) if n_taps > 1 else taps[0]  # (N*C, taps, *out)
    hit = e.Equal(cols, _planes(e, y, rank))
    seen = e.CumSum(e.Cast(hit, to=int(ir.DataType.INT32)), e.const(np.array(1, np.int64)))
    first = e.And(hit, e.Equal(seen, e.const(np.array(1, np.int32))))
    dy_planes = _planes(e, dy, rank)
    routed = e.Where(first, dy_planes, e.scalar(0.0, dy))
    d = dims_of(dy_planes)
    if d is not None:
        known(e, routed, [d[0], n_taps] + [a.out for a in axes], dy)
    onehot = np.eye(n_taps).reshape([n_taps, 1] + [a.kernel for a in axes])
    return _scatter_windows(e, routed, e.const(onehot, dtype=dtype_of(x, dy)), axes, x)


# ----------------------------------------------------------------------------- global pools


@register("GlobalAveragePool")
def global_average_pool(n, dys, needs, e):
    """y = mean of x over the spatial axes  =>  dx = dy / (number of spatial elements), broadcast."""
    x, y = n.inputs[0], n.outputs[0]
    (dy,) = dys
    d = dims_of(x)
    if d is not None and is_static(*d[2:]):
        count = float(np.prod(d[2:], dtype=np.int64))
    else:
        count = e.CastLike(e.Size(x) / e.Size(y), x)
    return (e.expand_like(dy / count, x),)


@register("GlobalMaxPool")
def global_max_pool(n, dys, needs, e):
    """y = max of x over the spatial axes  =>  dy goes to the elements equal to the maximum,
    shared evenly between ties (as for ReduceMax)."""
    x, y = n.inputs[0], n.outputs[0]
    (dy,) = dys
    rank = rank_of(x, dy, op=n.op_type)
    mask = e.CastLike(e.Equal(x, y), x)
    count = e.reduce("ReduceSum", mask, list(range(2, rank)), keepdims=True)
    return (dy / count * mask,)


# ----------------------------------------------------------------------------- MaxUnpool


@register("MaxUnpool")
def max_unpool(n, dys, needs, e):
    """y = zeros(default shape); y.flat[I] = x; then y padded with zeros at the end of each
    axis to ``output_shape`` when given. The default shape is (N, C, *((in - 1) * stride -
    pad_begin - pad_end + kernel)), the one the indices address (as ONNX's reference and its
    backend test data; onnxruntime instead indexes the ``output_shape`` tensor directly, so
    the two disagree where ``output_shape`` differs from the default shape).

    dx[i] = dy_default.flat[I[i]], where dy_default is dy cut to the default shape — and 0 for
    an x whose index a later x (row-major) repeats, since the last write wins. The last writer
    of each position is a ScatterElements of the positions 0..numel(x)-1 (reduction 'max' from
    opset 18; before, the in-order scatter without reduction)."""
    x, ind = n.inputs[0], n.inputs[1]
    (dy,) = dys
    if dy is None or not needs[0]:
        return [None] * len(n.inputs)
    kernel = [int(k) for k in attr(n, "kernel_shape")]
    rank = rank_of(x, dy, fallback=len(kernel) + 2)
    r = rank - 2
    strides = [int(s) for s in (attr(n, "strides") or [1] * r)]
    pads = [int(p) for p in (attr(n, "pads") or [0] * (2 * r))]
    out_shape = n.inputs[2] if len(n.inputs) > 2 else None
    if out_shape is not None:  # cut dy to the default shape the indices address
        default = [iadd(e, isub(e, imul(e, isub(e, dim(e, x, 2 + i), 1), strides[i]), pads[i] + pads[r + i]), kernel[i])
                   for i in range(r)]
        dd = dims_of(dy)
        if not (dd is not None and is_static(*default) and list(dd[2:]) == default):
            dy = e.Slice(dy, e.ints([0] * r), stack(e, default), e.ints(list(range(2, rank))))
    flat_i = e.Reshape(ind, e.ints([-1]))
    picked = e.Gather(e.Reshape(dy, e.ints([-1])), flat_i, axis=0)
    count = e.Size(x)
    pos = e.Range(e.const(np.array(0, np.int64)), count, e.const(np.array(1, np.int64)))
    empty = e.Expand(e.ints([-1]), e.Reshape(e.Size(dy), e.ints([1])))
    if e.opset >= 18:
        last = e.ScatterElements(empty, flat_i, pos, axis=0, reduction="max")
    else:
        last = e.ScatterElements(empty, flat_i, pos, axis=0)
    wins = e.Equal(e.Gather(last, flat_i, axis=0), pos)
    dx = e.Where(wins, picked, e.scalar(0.0, picked if picked.dtype is not None else x))
    d = dims_of(x)
    dx = e.Reshape(dx, e.ints(list(d)) if d is not None and is_static(*d) else e.Shape(x))
    return [dx] + [None] * (len(n.inputs) - 1)


# ----------------------------------------------------------------------------- Lp pools


def _lp_local(e, x, p: int):
    """d|x|^p / dx / p = sign(x) |x|^(p-1)."""
    if p == 1:
        return e.Sign(x)
    if p == 2:
        return x
    return e.Sign(x) * e.Abs(x) ** (p - 1)


def _window_weight(e, dy, y, p: int):
    """dy / y^(p-1) (= dy * y^(1-p)), 0 where the window is all zeros (y = 0)."""
    if p == 1:
        return dy
    if p == 2:
        return safe_div(e, dy, y)
    return safe_div(e, dy, y ** (p - 1))


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
    return (_lp_local(e, x, p) * _window_weight(e, dys[0], y, p),)


@register("LpPool")
def lp_pool(n, dys, needs, e):
    """y[o] = (sum of |x|^p over window o)^(1/p), pads counting as zeros:
    dx = sign(x) |x|^(p-1) * sum over the windows o holding x of dy[o] * y[o]^(1-p).

    The sum over windows is AveragePool's scatter: a stride-s ConvTranspose with a ones kernel
    on the (N*C, 1, *spatial) planes, cut to x's extent (pads, auto_pad, ceil_mode, dilations
    as for AveragePool)."""
    (x,) = n.inputs
    (y,) = n.outputs
    (dy,) = dys
    p = _p(n)
    kernel = [int(k) for k in attr(n, "kernel_shape")]
    rank = rank_of(x, dy, y, fallback=len(kernel) + 2)
    axes = window_axes(e, n, x, y, kernel, pool=True)
    w = _window_weight(e, dy, y, p)
    planes = _planes(e, w, rank)
    ones = e.const(np.ones([1, 1] + kernel), dtype=x.dtype or ir.DataType.FLOAT)
    g = conv_transpose_fitted(e, planes, ones, kernel, [a.begin for a in axes], [a.size for a in axes],
                              [a.stride for a in axes], [a.dilation for a in axes])
    g = _unplanes(e, g, x)
    return (_lp_local(e, x, p) * g,)
