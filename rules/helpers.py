"""Value helpers shared by the rules (a helper module: it registers no rule).

Each idea is written once here and imported by the rules that need it:

* reading the node: ``text_attr`` (a string attribute, bytes decoded), ``optional_output``
  (an output the node may not produce), ``wants`` (whether an optional input needs a
  gradient), ``rank_of`` (the first rank shape inference knows);
* constants: ``first_typed`` (the value whose dtype a constant takes), ``const_like`` (an
  array in another value's dtype; ``e.scalar(x, like)`` is the rank-0 form);
* dtypes: ``HALF_TYPES``, ``cast_to``, ``compute_type`` (float32 for 16-bit floats: where
  statistics and sums are computed), ``float_type`` (float64 for double, else float32: where
  positions and interpolation weights are computed), ``accumulation_type`` (scatter-add);
* small pieces of math: ``keep`` (v where cond, else 0), ``safe_div`` (0 where the divisor
  is), ``sum_over`` / ``mean_over`` (keepdims reductions over given axes), ``zero_gradients``
  (the gradient of a piecewise constant op).

Size arithmetic lives in :mod:`gradbuilder.rules.sizes`, window geometry in
:mod:`gradbuilder.rules.windows`, normalization statistics in :mod:`gradbuilder.rules.norm_stats`.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradbuilder.compiler.values import attr, dims_of, unknown_rank

HALF_TYPES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


# ----------------------------------------------------------------------------- reading the node


def text_attr(n, name: str, default=None):
    """String attribute ``name`` of ``n`` as a str (bytes decoded), ``default`` when absent."""
    v = attr(n, name, default)
    return v.decode() if isinstance(v, bytes) else v


def optional_output(n, i: int):
    """Output ``i`` of ``n``, or None when the node does not produce it (absent or unnamed)."""
    return n.outputs[i] if len(n.outputs) > i and n.outputs[i].name else None


def wants(needs, i: int) -> bool:
    """Whether input ``i`` needs a gradient. ``needs[i]`` is false for an input the node omits
    (empty name), and ``needs`` may be shorter than ``i`` + 1 where trailing optional inputs are
    omitted: this is the one test for an optional input (``needs[i]`` for a required one)."""
    return len(needs) > i and bool(needs[i])


def rank_of(*values, op: str | None = None, fallback: int | None = None):
    """The rank of the first of ``values`` (None entries skipped) whose rank shape inference
    knows; else ``fallback``; else None, or, when ``op`` is given, the error of the ``op``
    gradient that needs the rank of ``values[0]``."""
    for v in values:
        d = dims_of(v) if v is not None else None
        if d is not None:
            return len(d)
    if fallback is not None:
        return fallback
    if op is not None:
        raise unknown_rank(values[0], op)
    return None


# ----------------------------------------------------------------------------- constants


def first_typed(*values):
    """The first of ``values`` whose dtype is known, else the first value that is not None."""
    known = [v for v in values if v is not None and v.dtype is not None]
    return known[0] if known else next(v for v in values if v is not None)


def dtype_of(*values) -> ir.DataType:
    """The dtype of ``first_typed(*values)``; float32 where none is known."""
    return first_typed(*values).dtype or ir.DataType.FLOAT


def const_like(e, values, like):
    """The float array ``values`` as a constant in ``like``'s dtype (a float64 constant and a
    CastLike when that dtype is unknown)."""
    arr = np.asarray(values, dtype=np.float64)
    if like.dtype is not None:
        return e.const(arr, dtype=like.dtype)
    return e.CastLike(e.const(arr, dtype=ir.DataType.DOUBLE), like)


# ----------------------------------------------------------------------------- dtypes


def cast_to(e, v, dtype):
    """``v`` as ``dtype`` (unchanged when it already is, when dtype is unknown, or when v is None)."""
    return v if v is None or dtype is None or v.dtype == dtype else e.Cast(v, to=int(dtype))


def compute_type(x, stash=ir.DataType.FLOAT):
    """The dtype statistics and sums over ``x`` are computed in: ``stash`` (a DataType or its
    int; float32 by default) for 16-bit x when it is wider, else x's own dtype (None when
    unknown)."""
    stash = ir.DataType(stash)
    if x.dtype in HALF_TYPES and stash.itemsize > x.dtype.itemsize:
        return stash
    return x.dtype


def float_type(v) -> ir.DataType:
    """The dtype positions and interpolation weights derived from ``v`` are computed in:
    float64 for double, float32 for everything else (16-bit floats, integers, unknown)."""
    return v.dtype if v.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE) else ir.DataType.FLOAT


def accumulation_type(like, unique):
    """Scatter with reduction="add" runs in float32 for float16/bfloat16: onnxruntime's CPU
    kernels lack those types, and float32 sums are more accurate."""
    if not unique and like.dtype in HALF_TYPES:
        return ir.DataType.FLOAT
    return like.dtype


# ----------------------------------------------------------------------------- small pieces of math


def keep(e, cond, v):
    """``v`` where ``cond``, else 0."""
    return e.Where(cond, v, e.scalar(0.0, v))


def safe_div(e, num, den):
    """num / den, and 0 where den == 0 (den broadcasts against num)."""
    zero = e.Equal(den, e.scalar(0.0, den))
    out = num / e.Where(zero, e.scalar(1.0, den), den)
    return e.Where(zero, e.scalar(0.0, out), out)


def sum_over(e, v, axes):
    """``v`` summed over ``axes``, keepdims."""
    return e.reduce("ReduceSum", v, axes, keepdims=True)


def mean_over(e, v, axes):
    """The mean of ``v`` over ``axes``, keepdims."""
    return e.reduce("ReduceMean", v, axes, keepdims=True)


def zero_gradients(n, needs, e):
    """The gradient of an op that is piecewise constant in its inputs: zero almost everywhere
    (and zero is used at the jumps, where it is undefined), for every input that needs one."""
    return [e.zeros_like(x) if need else None for x, need in zip(n.inputs, needs)]
