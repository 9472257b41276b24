"""Size arithmetic shared by the rules.

A *size* is a Python int when shape inference knows it statically, else a 1-element int64
tensor computed at run time. The helpers fold static arithmetic in Python and emit nodes only
for the dynamic part:

* ``vec(e, a)``: one size as a 1-element int64 tensor; ``stack(e, items)``: a list of sizes
  as a 1-D int64 tensor (a constant when all are static); ``scalar_of``: a rank-0 one;
* ``iadd isub ineg imul idiv imod imax imin iclamp iwrap iprod``: arithmetic on sizes
  (adding 0 or multiplying by 1 emits nothing); the run-time part is written as math
  (``vec(e, a) + vec(e, b)``), so they are called where ``e.math()`` is on, as in every rule;
* ``Dims(e, x)`` / ``dim(e, x, axis)``: the sizes of a value's axes; ``is_static``,
  ``static_dims``; ``arange``, ``ordinals``; ``reshape_like``, ``reshape_to``, ``known`` (record a shape);
* pieces built on them: ``zeros``, ``pad_axes``, ``pad_axis``, ``slice_axes``, ``reverse``,
  ``as_int64``, ``int_entries``.

A helper module: it registers no rule. Dtypes (``cast_to``, ``compute_type``, ...) and the
other value helpers are in :mod:`gradbuilder.rules.helpers`.
"""

from __future__ import annotations

import functools
import weakref

import numpy as np
import onnx_ir as ir

from gradbuilder.compiler.values import constant_of, dims_of, unknown_rank

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


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
    return e.Reshape(a, e.const(np.zeros((0,), dtype=np.int64)))


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
    return vec(e, a) + vec(e, b)


def isub(e, a, b):
    if is_static(a, b):
        return a - b
    if is_zero(b):
        return a
    return vec(e, a) - vec(e, b)


def ineg(e, a):
    return -a


def imul(e, a, b):
    if is_static(a, b):
        return a * b
    if is_one(a) or is_one(b):
        return b if is_one(a) else a
    return vec(e, a) * vec(e, b)


def idiv(e, a, b):
    """Floor division of sizes (both >= 0)."""
    return a // b if is_static(a, b) else vec(e, a) / vec(e, b)


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
    return e.Where(e.Less(a, e.ints([0])), a + vec(e, size), a)


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
        return self.e.Reshape(self.e.Size(self.shape()), [1])

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


def with_unit_axes(e, v, rank: int, trailing):
    """``v`` (of rank ``rank``) followed by ``trailing`` unit axes, so that it broadcasts along
    the axes before them; ``trailing`` is an int or a 1-element int64 tensor (an axis chosen at
    run time)."""
    if isinstance(trailing, int):
        return e.Unsqueeze(v, list(range(rank, rank + trailing))) if trailing else v
    ones = e.ConstantOfShape(trailing, value=ir.tensor(np.array([1], dtype=np.int64)))
    return e.Reshape(v, e.Concat(e.Shape(v), ones, axis=0))


def reshape_like(e, v, like):
    """``v`` reshaped to the shape of ``like`` (a constant shape when static). Shape(like)
    may hold zeros (empty tensors), so it is applied with allowzero=1 where the opset has it."""
    d = Dims(e, like)
    static = d.static is not None and None not in d.static
    zero_dims = not static or 0 in d.static
    return e.Reshape(v, d.vector(), allowzero=zero_dims)


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
    rank = rank if rank is not None else e.Reshape(e.Size(e.Shape(v)), [1])
    where = e.Concat(vec(e, axis), vec(e, iadd(e, axis, rank)), axis=0)
    pads = e.ScatterElements(zeros(e, vec(e, imul(e, rank, 2)), None, ir.DataType.INT64), where, amounts, axis=0)
    return e.Pad(v, pads)


def slice_axes(e, v, starts, ends, axes, steps=None):
    return e.Slice(v, stack(e, starts), stack(e, ends), e.ints(axes), None if steps is None else stack(e, steps))


def reverse(e, v, axes):
    """``v`` reversed along ``axes``."""
    return slice_axes(e, v, [-1] * len(axes), [INT64_MIN] * len(axes), axes, [-1] * len(axes))


# ----------------------------------------------------------------------------- axes of a value


def arange(e, stop, like=None):
    """0, 1, ..., stop-1 (``stop`` a size): int64, or in like's dtype."""
    if isinstance(stop, int):
        if like is None:
            return e.ints(list(range(stop)))
        return e.const(np.arange(stop), dtype=like.dtype or ir.DataType.FLOAT)
    out = e.Range(e.const(np.array(0, np.int64)), e.Reshape(stop, e.ints([])), e.const(np.array(1, np.int64)))
    return out if like is None else e.CastLike(out, like)


def ordinals(e, like):
    """0, 1, 2, ... (int64) in the shape of ``like``: the row-major number of each element."""
    count = e.Size(like)
    return reshape_like(e, e.Range(scalar_of(e, 0), e.Reshape(count, []), scalar_of(e, 1)), like)


_DIMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # emitter -> {(value, axis): tensor}


def dim(e, v, axis: int):
    """The size of axis ``axis`` (>= 0) of ``v``: an int when static, else Gather(Shape(v))
    (emitted once per emitter). :class:`Dims` does the same for all axes of one value."""
    d = dims_of(v)
    if d is not None and len(d) > axis and isinstance(d[axis], int):
        return d[axis]
    cache = _DIMS.setdefault(e, {})
    if (v, axis) not in cache:
        cache[(v, axis)] = e.Gather(e.Shape(v), e.ints([axis]), axis=0)
    return cache[(v, axis)]


def shape_of(e, v, rank: int, start: int = 0):
    """The sizes of axes ``start .. rank-1`` of ``v`` (see :func:`dim`)."""
    return [dim(e, v, i) for i in range(start, rank)]


def known(e, v, dims, like):
    """Record ``dims`` (sizes; run-time ones count as unknown) as ``v``'s shape and like's dtype
    as its dtype, so that later steps fold what is static (e.g. the spatial axes when only the
    batch axis is dynamic)."""
    if dims is not None:
        e.typed(v, like.dtype, tuple(d if isinstance(d, (int, str)) else None for d in dims))
    return v


def reshape_to(e, v, dims, like=None):
    """Reshape ``v`` to ``dims`` (sizes, or -1/0 placeholders) and record what is known of the
    result's shape (dtype: like's, default v's)."""
    out = e.Reshape(v, stack(e, dims))
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
