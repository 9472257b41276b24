"""Shape ops: Reshape Flatten Transpose Squeeze Unsqueeze Concat Split Expand Tile Pad.

Each gradient moves dy back through the same data movement in reverse. Sizes known to
shape inference become constants; unknown sizes are read with Shape at run time.

The helpers at the top compute with *sizes*: a Python int when it is known statically,
else a 1-element int64 tensor. They fold static arithmetic in Python and emit nodes only
for the dynamic part; :mod:`gradbuilder.rules.indexing` uses them too.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import attr, constant_of, dims_of, optional_input, register, unknown_rank

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
HALF_TYPES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


# ----------------------------------------------------------------------------- sizes


def is_static(*items) -> bool:
    """Every item a plain int (not a symbolic name or a run-time value)."""
    return all(isinstance(a, int) for a in items)


def static_dims(dims) -> bool:
    """A known rank with every dim a plain int."""
    return dims is not None and is_static(*dims)


def vec(e, a):
    """Size ``a`` as a 1-element int64 tensor."""
    return e.ints([a]) if isinstance(a, int) else a


def scalar_of(e, a):
    """Size ``a`` as a rank-0 int64 tensor (for Range)."""
    if isinstance(a, int):
        return e.const(np.array(a, dtype=np.int64))
    return e.reshape(a, e.const(np.zeros((0,), dtype=np.int64)))


def stack(e, items):
    """A 1-D int64 tensor of sizes: a constant when all are static, else a Concat."""
    if is_static(*items):
        return e.ints(list(items))
    return e.Concat(*[vec(e, a) for a in items], axis=0)


def iadd(e, a, b):
    if is_static(a, b):
        return a + b
    if is_zero(a) or is_zero(b):
        return b if is_zero(a) else a
    return e.Add(vec(e, a), vec(e, b))


def isub(e, a, b):
    if is_static(a, b):
        return a - b
    if is_zero(b):
        return a
    return e.Sub(vec(e, a), vec(e, b))


def ineg(e, a):
    return -a if isinstance(a, int) else e.Neg(a)


def imul(e, a, b):
    if is_static(a, b):
        return a * b
    if is_one(a) or is_one(b):
        return b if is_one(a) else a
    return e.Mul(vec(e, a), vec(e, b))


def idiv(e, a, b):
    """Floor division of sizes (both >= 0)."""
    return a // b if is_static(a, b) else e.Div(vec(e, a), vec(e, b))


def imod(e, a, b):
    """``a`` mod ``b`` for ``b`` > 0, in [0, b) (Python's %, ONNX Mod with fmod=0)."""
    return a % b if is_static(a, b) else e.Mod(vec(e, a), vec(e, b))


def imax(e, a, b):
    return max(a, b) if is_static(a, b) else e.Max(vec(e, a), vec(e, b))


def imin(e, a, b):
    return min(a, b) if is_static(a, b) else e.Min(vec(e, a), vec(e, b))


def iclamp(e, a, lo, hi):
    return imin(e, imax(e, a, lo), hi)


def iwrap(e, a, size):
    """An index that may count from the end (< 0) made absolute: a + size where a < 0."""
    if isinstance(a, int):
        return iadd(e, a, size) if a < 0 else a
    return e.Where(e.Less(a, e.ints([0])), e.Add(a, vec(e, size)), a)


def iprod(e, items):
    return functools.reduce(lambda p, q: imul(e, p, q), items, 1)


def is_zero(a) -> bool:
    return isinstance(a, int) and a == 0


def is_one(a) -> bool:
    return isinstance(a, int) and a == 1


def as_int64(e, v):
    return v if v.dtype == ir.DataType.INT64 else e.Cast(v, to=int(ir.DataType.INT64))


def int_entries(e, v, count):
    """The ``count`` entries of 1-D int tensor ``v``: ints when constant, else Gathers."""
    c = constant_of(v)
    if c is not None:
        return [int(a) for a in c.reshape(-1)]
    v = as_int64(e, v)
    return [e.Gather(v, e.ints([i])) for i in range(count)]


class Dims:
    """The sizes of ``x``: static ints where shape inference knows them, else read from one
    Shape(x) node (emitted on first use)."""

    def __init__(self, e, x: ir.Value):
        self.e, self.x = e, x
        d = dims_of(x)
        self.static = None if d is None else [a if isinstance(a, int) else None for a in d]
        self._shape = None

    @property
    def rank(self):
        return None if self.static is None else len(self.static)

    def shape(self) -> ir.Value:
        if self._shape is None:
            self._shape = self.e.Shape(self.x)
        return self._shape

    def __getitem__(self, k):
        """The size of axis ``k`` (an int, or a 1-element tensor for an axis chosen at run time)."""
        if isinstance(k, int) and self.static is not None and self.static[k] is not None:
            return self.static[k]
        return self.e.Gather(self.shape(), vec(self.e, k))

    def rank_value(self):
        """The rank as a size: an int when known, else Size(Shape(x))."""
        if self.rank is not None:
            return self.rank
        return self.e.reshape(self.e.Size(self.shape()), [1])

    def axis(self, a: int):
        """Axis ``a`` (negative counts from the end) as a size >= 0."""
        if self.rank is not None:
            return a % self.rank
        return a if a >= 0 else iadd(self.e, a, self.rank_value())

    def prod(self, lo, hi=None):
        """The product of the sizes of axes lo .. hi-1 (hi None: to the last axis)."""
        if self.rank is not None and is_static(lo) and (hi is None or is_static(hi)):
            return iprod(self.e, [self[k] for k in range(lo, self.rank if hi is None else hi)])
        if hi is not None and is_static(lo, hi) and hi <= lo:
            return 1
        span = self.e.Slice(self.shape(), vec(self.e, lo), vec(self.e, INT64_MAX if hi is None else hi))
        return self.e.reduce("ReduceProd", span, None, keepdims=True)

    def vector(self) -> ir.Value:
        if self.static is not None and all(a is not None for a in self.static):
            return self.e.ints(self.static)
        return self.shape()

    def need_rank(self, op: str) -> int:
        if self.rank is None:
            raise unknown_rank(self.x, op)
        return self.rank


# ----------------------------------------------------------------------------- shared pieces


def reshape_like(e, v, like):
    """``v`` reshaped to the shape of ``like`` (a constant shape when static). Shape(like)
    may hold zeros (empty tensors), so it is applied with allowzero=1 where the opset has it."""
    d = Dims(e, like)
    static = d.static is not None and None not in d.static
    zero_dims = not static or 0 in d.static
    return e.op("Reshape", v, d.vector(), allowzero=1 if zero_dims and e.opset >= 14 else None)


def zeros(e, shape, like, dtype=None):
    """Zeros of ``shape`` (an int64 1-D tensor or list) in ``dtype`` (default: like's), as an
    Expand of one zero, so no full-size constant lands in the model."""
    dt = dtype or (like.dtype if like is not None else None) or ir.DataType.FLOAT
    zero = e.const(np.zeros((), dtype=dt.numpy()), dtype=dt)
    return e.Expand(zero, shape if isinstance(shape, ir.Value) else e.ints(shape))


def pad_axes(e, v, rank, before, after):
    """``v`` zero-padded by ``before[k]`` / ``after[k]`` (sizes >= 0) elements on axis k."""
    b = [before.get(k, 0) for k in range(rank)]
    a = [after.get(k, 0) for k in range(rank)]
    if all(is_zero(p) for p in b + a):
        return v
    return e.Pad(v, stack(e, b + a))


def pad_axis(e, v, rank, axis, before, after):
    """``v`` zero-padded on one axis; ``rank`` may be None (unknown) and ``axis`` a size."""
    if rank is not None and isinstance(axis, int):
        return pad_axes(e, v, rank, {axis: before}, {axis: after})
    amounts = stack(e, [before, after])
    if e.opset >= 18:
        return e.Pad(v, amounts, None, vec(e, axis))
    rank = rank if rank is not None else e.reshape(e.Size(e.Shape(v)), [1])
    where = e.Concat(vec(e, axis), vec(e, iadd(e, axis, rank)), axis=0)
    pads = e.ScatterElements(zeros(e, vec(e, imul(e, rank, 2)), None, ir.DataType.INT64), where, amounts, axis=0)
    return e.Pad(v, pads)


def slice_axes(e, v, starts, ends, axes, steps=None):
    return e.Slice(v, stack(e, starts), stack(e, ends), e.ints(axes), None if steps is None else stack(e, steps))


def reverse(e, v, axes):
    """``v`` reversed along ``axes``."""
    return slice_axes(e, v, [-1] * len(axes), [INT64_MIN] * len(axes), axes, [-1] * len(axes))


def accumulation_type(like, unique):
    """Scatter with reduction="add" runs in float32 for float16/bfloat16: onnxruntime's CPU
    kernels lack those types, and float32 sums are more accurate."""
    if not unique and like.dtype in HALF_TYPES:
        return ir.DataType.FLOAT
    return like.dtype


def cast_to(e, v, dtype):
    """``v`` as ``dtype`` (unchanged when it already is, when dtype is unknown, or when v is None)."""
    return v if v is None or dtype is None or v.dtype == dtype else e.Cast(v, to=int(dtype))


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
    return (e.unsqueeze(dys[0], axes),)


@register("Unsqueeze")
def unsqueeze(n, dys, needs, e):
    """dx = squeeze(dy, axes)"""
    return (e.squeeze(dys[0], n.inputs[1]),)


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
    parts = e.op("Split", dy, sizes, outputs=len(xs), axis=axis)
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
    g = e.reshape(dy, stack(e, interleaved))
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
            where = e.Concat(ax, e.Add(ax, e.ints([rank])), axis=0)
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
        out = e.Add(out, pad_axes(e, left, rank, {}, {k: isub(e, length, 1)}))
    if not is_zero(a):
        right = e.reduce("ReduceSum", slice_axes(e, g, [iadd(e, b, length)], [INT64_MAX], [k]), [k], keepdims=True)
        out = e.Add(out, pad_axes(e, right, rank, {k: isub(e, length, 1)}, {}))
    return out


def _fold_reflect(e, g, k, rank, b, a, length, sizes):
    """The begin border holds x[b], ..., x[1] and the end border x[n-2], ..., x[n-1-a]
    (b, a <= n-1): add each border, reversed, onto those elements."""
    out = slice_axes(e, g, [b], [iadd(e, b, length)], [k])
    if not is_zero(b):
        left = reverse(e, slice_axes(e, g, [0], [b], [k]), [k])
        out = e.Add(out, pad_axes(e, left, rank, {k: 1}, {k: isub(e, isub(e, length, 1), b)}))
    if not is_zero(a):
        right = reverse(e, slice_axes(e, g, [iadd(e, b, length)], [INT64_MAX], [k]), [k])
        out = e.Add(out, pad_axes(e, right, rank, {k: isub(e, isub(e, length, 1), a)}, {k: 1}))
    return out


def _fold_wrap(e, g, k, rank, b, a, length, sizes):
    """y[j] = x[(j - b) mod n] for any border sizes: shift dy by (-b mod n) zeros so that
    it splits into whole periods of n, and sum the periods."""
    shift = imod(e, ineg(e, b), length)
    total = iadd(e, iadd(e, iadd(e, b, length), a), shift)
    periods = idiv(e, iadd(e, total, isub(e, length, 1)), length)
    g = pad_axes(e, g, rank, {k: shift}, {k: isub(e, imul(e, periods, length), total)})
    g = e.reshape(g, stack(e, sizes[:k] + [periods, length] + sizes[k + 1:]))
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
    count = e.Div(e.Shape(pads), e.ints([2]))
    begin, end = e.Slice(pads, e.ints([0]), count), e.Slice(pads, count, e.ints([INT64_MAX]))
    zero = e.ints([0])
    grow_b, grow_a = e.Max(begin, zero), e.Max(end, zero)
    crop_b, crop_a = e.Max(e.Neg(begin), zero), e.Max(e.Neg(end), zero)
    # without axes, Slice and Pad take axes 0 .. count-1, as the forward Pad did
    sizes = e.Slice(e.Shape(dy), zero, count) if axes is None else e.Gather(e.Shape(dy), axes, axis=0)
    inner = e.Slice(dy, grow_b, e.Sub(sizes, grow_a), *([] if axes is None else [axes]))
    dx = None
    if needs[0]:
        dx = e.Pad(inner, e.Concat(crop_b, crop_a, axis=0), *([] if axes is None else [None, axes]))
    dvalue = None
    value = optional_input(n, 2)
    if value is not None and len(needs) > 2 and needs[2]:
        outside = e.Sub(e.reduce("ReduceSum", dy, None, keepdims=False),
                        e.reduce("ReduceSum", inner, None, keepdims=False))
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
    mode = attr(n, "mode", "constant")
    if isinstance(mode, bytes):
        mode = mode.decode()
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
    if mode == "constant" and len(n.inputs) > 2 and n.inputs[2] is not None and needs[2]:
        outside = e.Sub(e.reduce("ReduceSum", dy, None, keepdims=False),
                        e.reduce("ReduceSum", inner, None, keepdims=False))
        dvalue = reshape_like(e, outside, n.inputs[2])
    return [dx, None, dvalue][: len(n.inputs)]
