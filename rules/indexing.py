"""Indexing ops: Slice Gather GatherElements GatherND.

Each reads elements of x at some positions; its gradient writes dy back to those positions
in zeros. A position read more than once (repeated indices) gets the sum of its dys:
ScatterND / ScatterElements with reduction="add" from opset 16; before opset 16 a one-hot
matrix product, which costs memory depth x (number of indices). Constant indices without
repeats (and scalar indices) need no reduction at any opset.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, constant_of, dims_of, optional_input
from gradbuilder.rules.helpers import accumulation_type, cast_to
from gradbuilder.rules.sizes import (
    Dims,
    as_int64,
    iadd,
    iclamp,
    imax,
    imul,
    int_entries,
    is_one,
    isub,
    iwrap,
    pad_axes,
    pad_axis,
    reshape_like,
    reverse,
    scalar_of,
    stack,
    vec,
    zeros,
)


# ----------------------------------------------------------------------------- Slice


def _slice_pads(e, n, dims):
    """For Slice with constant steps of +-1 and constant axes: (before, after, reversed axes)
    so that dx = zero-pad(reverse(dy)); None when that does not apply.

    Start and end follow the ONNX rules: negative values count from the end, then they are
    clamped to [0, dim] (step 1) or start to [0, dim-1], end to [-1, dim-1] (step -1)."""
    x, starts, ends, axes_in, steps_in = (optional_input(n, i) for i in range(5))
    rank = dims.rank
    if rank is None:
        return None
    count = None
    for v in (axes_in, steps_in, starts, ends):
        c = constant_of(v)
        if c is not None:
            count = c.size
            break
    if count is None:
        sd = dims_of(starts)
        if sd is None or len(sd) != 1 or not isinstance(sd[0], int):
            return None
        count = sd[0]
    axes = list(range(count)) if axes_in is None else constant_of(axes_in)
    steps = [1] * count if steps_in is None else constant_of(steps_in)
    if axes is None or steps is None or any(abs(int(s)) != 1 for s in np.reshape(steps, -1)):
        return None
    axes = [int(a) % rank for a in np.reshape(axes, -1)]
    steps = [int(s) for s in np.reshape(steps, -1)]
    before, after, flipped = {}, {}, []
    for k, s, t, step in zip(axes, int_entries(e, starts, count), int_entries(e, ends, count), steps):
        dim = dims[k]
        if step == 1:
            s = iclamp(e, iwrap(e, s, dim), 0, dim)
            t = iclamp(e, iwrap(e, t, dim), 0, dim)
            taken = imax(e, isub(e, t, s), 0)
            before[k], after[k] = s, isub(e, isub(e, dim, s), taken)
        else:
            last = isub(e, dim, 1)
            s = iclamp(e, iwrap(e, s, dim), 0, last)
            t = iclamp(e, iwrap(e, t, dim), -1, last)
            taken = imax(e, isub(e, s, t), 0)
            before[k], after[k] = iadd(e, isub(e, s, taken), 1), isub(e, last, s)
            flipped.append(k)
    return before, after, flipped


def _scatter_back(e, n, dy):
    """General Slice gradient: the same Slice applied to the flat positions of x says where
    each element of dy came from; ScatterElements writes dy there into zeros."""
    x = n.inputs[0]
    size = e.Size(x)
    positions = e.Range(scalar_of(e, 0), size, scalar_of(e, 1))
    picked = e.Slice(reshape_like(e, positions, x), *n.inputs[1:])
    flat = e.ScatterElements(zeros(e, e.Reshape(size, [1]), x), e.Reshape(picked, [-1]),
                             e.Reshape(dy, [-1]), axis=0)
    return reshape_like(e, flat, x)


@register("Slice")
def slice_(n, dys, needs, e):
    """y = x[starts:ends:steps] on axes; a Slice reads each element at most once, so dx is
    dy written back into zeros where it was read: for steps of +-1 dy (reversed where the
    step is -1) zero-padded by the clamped starts/ends; otherwise a ScatterElements at the
    positions that the same Slice picks from an index tensor of x."""
    (dy,) = dys
    dims = Dims(e, n.inputs[0])
    plan = _slice_pads(e, n, dims)
    if plan is None:
        return (_scatter_back(e, n, dy),)
    before, after, flipped = plan
    g = reverse(e, dy, flipped) if flipped else dy
    return (pad_axes(e, g, dims.rank, before, after),)


# ----------------------------------------------------------------------------- segment sums


def _wrapped_indices(e, idx, depth):
    """(int64 index tensor with negative entries counted from the end, its numpy value when
    constant). ``depth`` is a size, or a list of sizes along the indices' last axis."""
    c = constant_of(idx)
    static = all(isinstance(d, int) for d in (depth if isinstance(depth, list) else [depth]))
    if c is not None and (static or (c >= 0).all()):
        c = c.astype(np.int64)
        if (c < 0).any():
            c = np.where(c < 0, c + np.asarray(depth, dtype=np.int64), c)
            return e.const(c), c
        return as_int64(e, idx), c
    v = as_int64(e, idx)
    size = stack(e, depth) if isinstance(depth, list) else vec(e, depth)
    return e.Where(e.Less(v, e.ints([0])), v + size, v), None


def segment_sum(e, g, pos, batch, depth, rest, unique, like):
    """out[b, d, r] = sum of g[b, k, r] over the k with pos[b, k] = d.

    g is [batch, K, rest]; pos is [1 or batch, K] with entries in [0, depth). ScatterND
    writes g into zeros (reduction="add" unless the positions are known to be unique);
    before opset 16 a one-hot [depth, K] matrix times g sums instead."""
    acc = accumulation_type(like, unique)
    g = cast_to(e, g, acc)
    if unique or e.opset >= 16:
        reduction = None if unique else "add"
        if is_one(batch):
            data = zeros(e, stack(e, [depth, rest]), like, acc)
            out = e.ScatterND(data, e.Reshape(pos, [-1, 1]), e.Reshape(g, stack(e, [-1, rest])),
                              reduction=reduction)
        else:
            bk = e.Slice(e.Shape(g), e.ints([0]), e.ints([2]), e.ints([0]))
            rows = e.Reshape(e.Range(scalar_of(e, 0), scalar_of(e, batch), scalar_of(e, 1)), [-1, 1])
            where = e.Concat(e.Unsqueeze(e.Expand(rows, bk), [2]), e.Unsqueeze(e.Expand(pos, bk), [2]), axis=2)
            e.typed(where, ir.DataType.INT64, (None, None, 2))  # (batch, position) pairs
            data = zeros(e, stack(e, [batch, depth, rest]), like, acc)
            out = e.ScatterND(data, where, g, reduction=reduction)
    else:
        column = e.Reshape(e.Range(scalar_of(e, 0), scalar_of(e, depth), scalar_of(e, 1)), [1, -1, 1])
        hot = e.Cast(e.Equal(column, e.Unsqueeze(pos, [1])), to=int(acc))
        out = hot @ g
    return cast_to(e, out, like.dtype)


# ----------------------------------------------------------------------------- Gather


@register("Gather")
def gather(n, dys, needs, e):
    """y = take(x, i, axis): dx[.., j, ..] = sum of dy[.., k, ..] over the k with i[k] = j.
    With x viewed as [P, D, Q] around the axis and dy as [P, K, Q] this is a segment sum
    over the flat indices. A scalar index picks one slice: dx is dy zero-padded around it."""
    x, idx = n.inputs
    (dy,) = dys
    dims = Dims(e, x)
    axis = dims.axis(attr(n, "axis", 0))
    depth = dims[axis]
    if dims_of(idx) == ():
        c = constant_of(idx)
        i = int(c) if c is not None else e.Reshape(as_int64(e, idx), [1])
        i = iwrap(e, i, depth)
        g = e.Unsqueeze(dy, vec(e, axis))
        return (pad_axis(e, g, dims.rank, axis, i, isub(e, isub(e, depth, i), 1)),)
    pos, known = _wrapped_indices(e, idx, depth)
    unique = known is not None and np.unique(known).size == known.size
    outer, inner = dims.prod(0, axis), dims.prod(iadd(e, axis, 1))
    g = e.Reshape(dy, stack(e, [outer, -1, inner]))
    out = segment_sum(e, g, e.Reshape(pos, [1, -1]), outer, depth, inner, unique, x)
    return (reshape_like(e, out, x),)


@register("GatherND")
def gather_nd(n, dys, needs, e):
    """y[b.., k..] = x[b.., i[b.., k.., :]]: each index tuple (m entries) picks a slice.
    With x viewed as [B, D, R] (batch dims, the m indexed dims flattened, the rest) and the
    tuples as flat positions pos[B, K]: dx[b, pos[b, k]] += dy[b, k]."""
    x, idx = n.inputs
    (dy,) = dys
    dims = Dims(e, x)
    batch_dims = attr(n, "batch_dims", 0)
    idims = dims_of(idx)
    if not idims or not isinstance(idims[-1], int):
        raise GradientRuleError("the GatherND gradient needs the static size of the indices' last axis")
    m = idims[-1]
    depths = [dims[k] for k in range(batch_dims, batch_dims + m)]
    strides = [1] * m
    for j in range(m - 2, -1, -1):
        strides[j] = imul(e, strides[j + 1], depths[j + 1])
    pos, known = _wrapped_indices(e, idx, depths)
    if known is not None and all(isinstance(s, int) for s in strides):
        known = (known * np.asarray(strides, dtype=np.int64)).sum(-1)
        pos = e.const(known)
        rows = known.reshape(int(np.prod(known.shape[:batch_dims])), -1)
        unique = all(np.unique(r).size == r.size for r in rows)
    else:
        pos = e.Squeeze(pos, [-1]) if m == 1 else e.reduce("ReduceSum", pos * stack(e, strides), [-1], keepdims=False)
        unique = False
    batch, depth, rest = dims.prod(0, batch_dims), dims.prod(batch_dims, batch_dims + m), dims.prod(batch_dims + m)
    g = e.Reshape(dy, stack(e, [batch, -1, rest]))
    out = segment_sum(e, g, e.Reshape(pos, stack(e, [batch, -1])), batch, depth, rest, unique, x)
    return (reshape_like(e, out, x),)


# ----------------------------------------------------------------------------- GatherElements


def _unique_positions(c, axis, depth) -> bool:
    """Whether constant GatherElements indices ``c`` name every element at most once."""
    c = c.astype(np.int64)
    if (c < 0).any():
        if not isinstance(depth, int):
            return False
        c = np.where(c < 0, c + depth, c)
    coords = list(np.indices(c.shape))
    coords[axis] = c
    keys = np.stack([a.reshape(-1) for a in coords], axis=1)
    return np.unique(keys, axis=0).shape[0] == c.size


@register("GatherElements")
def gather_elements(n, dys, needs, e):
    """y[.., k, ..] = x[.., i[.., k, ..], ..] along axis: dx = zeros with dy added at the
    positions named by i (ScatterElements, reduction="add" for repeats; before opset 16
    a one-hot comparison along the axis, summed over the index axis)."""
    x, idx = n.inputs
    (dy,) = dys
    dims = Dims(e, x)
    c = constant_of(idx)
    rank = dims.rank if dims.rank is not None else Dims(e, idx).rank  # x and the indices share it
    axis = attr(n, "axis", 0) if rank is None else attr(n, "axis", 0) % rank
    depth = dims[axis]
    unique = c is not None and _unique_positions(c, axis % c.ndim, depth)
    if unique or e.opset >= 16:
        acc = accumulation_type(x, unique)
        out = e.ScatterElements(zeros(e, dims.vector(), x, acc), idx, cast_to(e, dy, acc), axis=axis,
                                reduction=None if unique else "add")
        return (cast_to(e, out, x.dtype),)
    if rank is None:
        dims.need_rank("GatherElements (before opset 16)")
    pos, _ = _wrapped_indices(e, idx, depth)
    column = e.Reshape(e.Range(scalar_of(e, 0), scalar_of(e, depth), scalar_of(e, 1)),
                       [-1] + [1] * (rank - 1 - axis))
    hot = e.Cast(e.Equal(e.Unsqueeze(pos, [axis + 1]), column), to=int(x.dtype))
    out = e.reduce("ReduceSum", hot * e.Unsqueeze(dy, [axis + 1]), [axis], keepdims=False)
    # the indices may be shorter than x on the other axes: zero-fill the rest
    idims = Dims(e, idx)
    short = {k: isub(e, dims[k], idims[k]) for k in range(rank) if k != axis}
    return (pad_axes(e, out, rank, {}, short),)
