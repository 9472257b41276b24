"""Shape ops: Reshape Flatten Transpose Squeeze Unsqueeze Concat Split Expand Tile Pad
ReverseSequence.

Each gradient moves dy back through the same data movement in reverse. Sizes known to
shape inference become constants; unknown sizes are read with Shape at run time (the size
arithmetic is :mod:`gradbuilder.rules.sizes`).
"""

from __future__ import annotations

import numpy as np

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, constant_of, dims_of, optional_input, unknown_rank
from gradbuilder.rules.helpers import text_attr, wants
from gradbuilder.rules.sizes import (
    INT64_MAX,
    Dims,
    as_int64,
    iadd,
    idiv,
    imax,
    imod,
    imul,
    ineg,
    int_entries,
    is_one,
    is_zero,
    isub,
    iwrap,
    pad_axes,
    reshape_like,
    reverse,
    slice_axes,
    stack,
    zeros,
)


# ----------------------------------------------------------------------------- reshapes


@register(["Reshape", "Flatten"])
def reshape(n, dys, needs, e):
    """dx = reshape(dy, shape(x))"""
    return (reshape_like(e, dys[0], n.inputs[0]),)


@register("Transpose")
def transpose(n, dys, needs, e):
    """dx = transpose(dy, inverse(perm)); the default perm (reversed axes) is its own inverse"""
    perm = attr(n, "perm")
    if perm is None:
        return (e.Transpose(dys[0]),)
    return (e.Transpose(dys[0], perm=[int(p) for p in np.argsort(perm)]),)


@register("Squeeze")
def squeeze(n, dys, needs, e):
    """dx = unsqueeze(dy, axes); without axes (all 1-dims removed): reshape(dy, shape(x))"""
    x = n.inputs[0]
    axes = n.inputs[1] if len(n.inputs) > 1 else None
    if axes is None:
        return (reshape_like(e, dys[0], x),)
    return (e.Unsqueeze(dys[0], axes),)


@register("Unsqueeze")
def unsqueeze(n, dys, needs, e):
    """dx = squeeze(dy, axes)"""
    return (e.Squeeze(dys[0], n.inputs[1]),)


@register("Expand")
def expand(n, dys, needs, e):
    """dx = dy summed over the broadcast axes"""
    return (e.unbroadcast(dys[0], n.inputs[0]),)


# ----------------------------------------------------------------------------- join / split


def _size_along(e, x, axis):
    d = Dims(e, x)
    return d[axis % d.rank] if d.rank is not None else d[axis]


@register("Concat")
def concat(n, dys, needs, e):
    """dx_i = the piece of dy along axis where x_i was placed: Split(dy, [len(x_0), ...])"""
    (dy,) = dys
    xs = n.inputs
    if len(xs) == 1:
        return (dy,)
    axis = attr(n, "axis")
    sizes = stack(e, [_size_along(e, x, axis) for x in xs])
    parts = e.split_into(dy, len(xs), axis=axis, sizes=sizes)
    return [p if need else None for p, need in zip(parts, needs)]


@register("Split")
def split(n, dys, needs, e):
    """dx = Concat(dy_0, dy_1, ...) along axis, zeros for outputs without a gradient"""
    axis = attr(n, "axis", 0)
    parts = [dy if dy is not None else zeros(e, Dims(e, y).vector(), y) for dy, y in zip(dys, n.outputs)]
    return (parts[0] if len(parts) == 1 else e.Concat(*parts, axis=axis),)


# ----------------------------------------------------------------------------- Tile


@register("Tile")
def tile(n, dys, needs, e):
    """y = tile(x, r): y viewed as [r0, d0, r1, d1, ...] holds a copy of x for every index
    of the r axes, so dx = reshape(dy, [r0, d0, r1, d1, ...]) summed over the r axes."""
    x, repeats = n.inputs
    (dy,) = dys
    dims = Dims(e, x)
    rank = dims.rank
    if rank is None and dims_of(repeats) is not None and isinstance(dims_of(repeats)[0], int):
        rank = dims_of(repeats)[0]  # repeats has one entry per axis
    if rank is None:
        dims.need_rank("Tile")
    if rank == 0:
        return (dy,)
    reps = int_entries(e, repeats, rank)
    if all(is_one(r) for r in reps):
        return (dy,)
    interleaved = [s for k in range(rank) for s in (reps[k], dims[k])]
    g = e.Reshape(dy, stack(e, interleaved))
    return (e.reduce("ReduceSum", g, list(range(0, 2 * rank, 2)), keepdims=False),)


# ----------------------------------------------------------------------------- Pad


def _pad_amounts(e, n, rank):
    """{axis: (begin, end)} for the axes Pad may change; sizes may be < 0 (cropping)."""
    pads = n.inputs[1]
    axes_in = n.inputs[3] if len(n.inputs) > 3 else None
    axes = list(range(rank))
    if axes_in is not None:
        given = constant_of(axes_in)
        if given is not None:
            axes = [int(a) % rank for a in given.reshape(-1)]
        else:  # computed axes: scatter the pads into a full-rank pads vector
            ax = iwrap(e, as_int64(e, axes_in), rank)
            where = e.Concat(ax, ax + e.ints([rank]), axis=0)
            pads = e.ScatterElements(e.ints([0] * (2 * rank)), where, pads, axis=0)
    count = len(axes)
    values = int_entries(e, pads, 2 * count)
    amounts = {k: (values[i], values[count + i]) for i, k in enumerate(axes)}
    return {k: ba for k, ba in amounts.items() if not (is_zero(ba[0]) and is_zero(ba[1]))}


def _fold_edge(e, g, k, rank, b, a, length, sizes):
    """Each border element copies x's first/last element: add the border sums there."""
    out = slice_axes(e, g, [b], [iadd(e, b, length)], [k])
    if not is_zero(b):
        left = e.reduce("ReduceSum", slice_axes(e, g, [0], [b], [k]), [k], keepdims=True)
        out = out + pad_axes(e, left, rank, {}, {k: isub(e, length, 1)})
    if not is_zero(a):
        right = e.reduce("ReduceSum", slice_axes(e, g, [iadd(e, b, length)], [INT64_MAX], [k]), [k], keepdims=True)
        out = out + pad_axes(e, right, rank, {k: isub(e, length, 1)}, {})
    return out


def _fold_reflect(e, g, k, rank, b, a, length, sizes):
    """The begin border holds x[b], ..., x[1] and the end border x[n-2], ..., x[n-1-a]
    (b, a <= n-1): add each border, reversed, onto those elements."""
    out = slice_axes(e, g, [b], [iadd(e, b, length)], [k])
    if not is_zero(b):
        left = reverse(e, slice_axes(e, g, [0], [b], [k]), [k])
        out = out + pad_axes(e, left, rank, {k: 1}, {k: isub(e, isub(e, length, 1), b)})
    if not is_zero(a):
        right = reverse(e, slice_axes(e, g, [iadd(e, b, length)], [INT64_MAX], [k]), [k])
        out = out + pad_axes(e, right, rank, {k: isub(e, isub(e, length, 1), a)}, {k: 1})
    return out


def _fold_wrap(e, g, k, rank, b, a, length, sizes):
    """y[j] = x[(j - b) mod n] for any border sizes: shift dy by (-b mod n) zeros so that
    it splits into whole periods of n, and sum the periods."""
    shift = imod(e, ineg(e, b), length)
    total = iadd(e, iadd(e, iadd(e, b, length), a), shift)
    periods = idiv(e, iadd(e, total, isub(e, length, 1)), length)
    g = pad_axes(e, g, rank, {k: shift}, {k: isub(e, imul(e, periods, length), total)})
    g = e.Reshape(g, stack(e, sizes[:k] + [periods, length] + sizes[k + 1:]))
    return e.reduce("ReduceSum", g, [k], keepdims=False)


_FOLDS = {"edge": _fold_edge, "reflect": _fold_reflect, "wrap": _fold_wrap}


def _pad_constant_any_rank(n, dy, needs, e):
    """Constant Pad of an input whose rank is known only at run time: the pads vector holds
    the begin amounts then the end amounts (of ``axes``, else of axes 0, 1, ...), each < 0 to
    crop. dx = zero-pad(slice(dy)): the slice drops the border the padding added, the zero
    padding restores what the cropping removed."""
    pads = as_int64(e, n.inputs[1])
    axes = optional_input(n, 3)
    axes = as_int64(e, axes) if axes is not None else None
    count = e.Shape(pads) / e.ints([2])
    begin, end = e.Slice(pads, e.ints([0]), count), e.Slice(pads, count, e.ints([INT64_MAX]))
    zero = e.ints([0])
    grow_b, grow_a = e.Max(begin, zero), e.Max(end, zero)
    crop_b, crop_a = e.Max(-begin, zero), e.Max(-end, zero)
    # without axes, Slice and Pad take axes 0 .. count-1, as the forward Pad did
    sizes = e.Slice(e.Shape(dy), zero, count) if axes is None else e.Gather(e.Shape(dy), axes, axis=0)
    inner = e.Slice(dy, grow_b, sizes - grow_a, *([] if axes is None else [axes]))
    dx = None
    if needs[0]:
        dx = e.Pad(inner, e.Concat(crop_b, crop_a, axis=0), *([] if axes is None else [None, axes]))
    dvalue = None
    value = optional_input(n, 2)
    if wants(needs, 2):
        outside = e.reduce("ReduceSum", dy, None, keepdims=False) - e.reduce("ReduceSum", inner, None, keepdims=False)
        dvalue = reshape_like(e, outside, value)
    return [dx, None, dvalue][: len(n.inputs)]


@register("Pad")
def pad(n, dys, needs, e):
    """y = fill(crop(x)) axis by axis: negative pads crop x, positive pads add a border
    (the constant value, or copies of x's elements: edge, reflect, wrap).
    dx = zero-pad(fold(dy)): fold keeps dy on x's elements and adds each border element's dy
    onto the element it copies (constant: drops it); zero padding restores cropped elements.
    d constant_value = sum(dy) - sum(dy over x's elements)."""
    x = n.inputs[0]
    (dy,) = dys
    mode = text_attr(n, "mode", "constant")
    dims = Dims(e, x)
    rank = dims.rank
    pads_dims = dims_of(n.inputs[1])
    if rank is None and (len(n.inputs) < 4 or n.inputs[3] is None) and pads_dims and isinstance(pads_dims[0], int):
        rank = pads_dims[0] // 2  # pads has two entries per axis
    if rank is None:
        if mode != "constant":
            raise unknown_rank(x, f"Pad (mode '{mode}')")
        return _pad_constant_any_rank(n, dy, needs, e)
    amounts = _pad_amounts(e, n, rank)
    grow_b, grow_a, crop_b, crop_a, length = {}, {}, {}, {}, {}
    for k, (b, a) in amounts.items():
        grow_b[k], grow_a[k] = imax(e, b, 0), imax(e, a, 0)
        crop_b[k], crop_a[k] = imax(e, ineg(e, b), 0), imax(e, ineg(e, a), 0)
        length[k] = isub(e, isub(e, dims[k], crop_b[k]), crop_a[k])
    grown = [k for k in amounts if not (is_zero(grow_b[k]) and is_zero(grow_a[k]))]

    inner = dy  # dy folded onto the (cropped) x
    if mode == "constant":
        if grown:
            inner = slice_axes(e, dy, [grow_b[k] for k in grown],
                               [iadd(e, grow_b[k], length[k]) for k in grown], grown)
    elif mode in _FOLDS:
        ydims = Dims(e, n.outputs[0])
        sizes = [ydims[k] for k in range(rank)]
        for k in grown:
            inner = _FOLDS[mode](e, inner, k, rank, grow_b[k], grow_a[k], length[k], sizes)
            sizes[k] = length[k]
    else:
        raise GradientRuleError(f"Pad mode '{mode}' has no gradient rule")

    dx = pad_axes(e, inner, rank, crop_b, crop_a) if needs[0] else None
    dvalue = None
    if mode == "constant" and wants(needs, 2):
        outside = e.reduce("ReduceSum", dy, None, keepdims=False) - e.reduce("ReduceSum", inner, None, keepdims=False)
        dvalue = reshape_like(e, outside, n.inputs[2])
    return [dx, None, dvalue][: len(n.inputs)]


@register("ReverseSequence")
def reverse_sequence(n, dys, needs, e):
    """Reversing the first sequence_lens[b] steps is its own inverse (and transpose):
    dx = ReverseSequence(dy) with the same lengths and axes."""
    (dy,) = dys
    return (e.ReverseSequence(dy, n.inputs[1], batch_axis=attr(n, "batch_axis", 1),
                              time_axis=attr(n, "time_axis", 0)), None)
