"""Scatter ops: ScatterElements ScatterND TensorScatter.

Each moves elements of its float inputs to other positions, so each gradient moves dy back:
a position written by a scatter passes its dy to the update that wrote it, the others to
data.

Scatter reductions (``out[p] = f(data[p], updates landing on p)``):

* ``none``: the update that wins a position (for repeated indices: the one the runtime
  wrote last, which is the last in row-major order on onnx's reference and onnxruntime's
  CPU kernels; ONNX leaves it undefined) gets that position's dy, the other updates get
  zero, and data gets dy with the written positions zeroed. The winner is found by
  scattering the updates' own ordinals with the same op, so the gradient follows whatever
  order the runtime uses (given that it is deterministic). Constant indices without
  repeats skip that step.
* ``add``: d data = dy, d updates = dy read at the indices.
* ``mul``: d data = dy * (product of the updates on p); d update_k = dy[p] * data[p] *
  (product of the other updates on p), computed exactly (no division by a zero update):
  the product of the non-zero updates divided by update_k when no other update on p is
  zero, else 0.
* ``max`` / ``min``: dy goes to the candidates (data and updates) equal to the result;
  ties split it evenly among them (as torch's scatter_reduce amax/amin do).

Reductions run in float32 for float16/bfloat16 (onnxruntime's CPU kernels lack them).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, constant_of, dims_of, optional_input
from gradbuilder.rules.helpers import accumulation_type, cast_to
from gradbuilder.rules.sizes import Dims, as_int64, ordinals, scalar_of, vec, zeros


# ----------------------------------------------------------------------------- ScatterElements / ScatterND


class _Scatter:
    """The positions of one ScatterElements / ScatterND node: ``put`` writes values there
    (the node's own op, any reduction), ``take`` reads them back (GatherElements / GatherND)."""

    def __init__(self, n, e):
        self.e = e
        self.nd = n.op_type == "ScatterND"
        self.idx = n.inputs[1]
        self.axis = attr(n, "axis", 0)
        rank = Dims(e, self.idx).rank
        if rank is not None:  # onnx's reference GatherElements mishandles a negative axis
            self.axis %= rank

    def put(self, base, values, reduction=None):
        if self.nd:
            return self.e.ScatterND(base, self.idx, values, reduction=reduction)
        return self.e.ScatterElements(base, self.idx, values, axis=self.axis, reduction=reduction)

    def take(self, v):
        if self.nd:
            return self.e.GatherND(v, self.idx)
        return self.e.GatherElements(self._crop(v), self.idx, axis=self.axis)

    def _crop(self, v):
        """``v`` cut to the indices' extent on the other axes (the indices may be shorter
        there; onnx's reference GatherElements wants them equal)."""
        vd, idims = dims_of(v), dims_of(self.idx)
        rank = len(idims) if idims is not None else (len(vd) if vd is not None else None)
        if rank is None:
            return v
        axis = self.axis % rank
        others = [k for k in range(rank) if k != axis]
        if vd is not None and idims is not None and all(
                isinstance(vd[k], int) and vd[k] == idims[k] for k in others):
            return v
        if not others:
            return v
        ends = self.e.Gather(self.e.Shape(self.idx), self.e.ints(others))
        return self.e.Slice(v, self.e.ints([0] * len(others)), ends, self.e.ints(others))


def _unique_writes(n) -> bool:
    """Whether the node's indices are constant and name every position at most once."""
    data, idx = n.inputs[0], n.inputs[1]
    c = constant_of(idx)
    dims = dims_of(data)
    if c is None:
        return False
    c = c.astype(np.int64)
    if n.op_type == "ScatterND":
        k = c.shape[-1]
        if (c < 0).any():
            if dims is None or not all(isinstance(d, int) for d in dims[:k]):
                return False
            c = np.where(c < 0, c + np.asarray(dims[:k], dtype=np.int64), c)
        keys = c.reshape(-1, k)
    else:
        axis = attr(n, "axis", 0) % c.ndim
        if (c < 0).any():
            if dims is None or not isinstance(dims[axis], int):
                return False
            c = np.where(c < 0, c + dims[axis], c)
        coords = list(np.indices(c.shape))
        coords[axis] = c
        keys = np.stack([a.reshape(-1) for a in coords], axis=1)
    return np.unique(keys, axis=0).shape[0] == keys.shape[0]


def _scatter_none(s, e, data, upd, dy, needs, unique):
    """The winning update takes dy at its position; data keeps dy elsewhere."""
    dd = s.put(dy, e.zeros_like(upd)) if needs[0] else None
    du = None
    if needs[2]:
        du = s.take(dy)
        if not unique:
            ids = ordinals(e, upd)
            owner = s.put(zeros(e, Dims(e, data).vector(), None, ir.DataType.INT64), ids)
            du = e.Where(e.Equal(s.take(owner), ids), du, e.scalar(0.0, like=dy))
    return dd, du


def _scatter_mul(s, e, data, upd, dy, needs, unique):
    """out[p] = data[p] * prod(u on p): exact products of the others (zeros counted)."""
    acc = accumulation_type(data, False)
    dy_a, data_a, upd_a = (cast_to(e, v, acc) for v in (dy, data, upd))
    one = e.const(np.ones((), dtype=acc.numpy()), dtype=acc)
    zero = e.const(np.zeros((), dtype=acc.numpy()), dtype=acc)
    if unique:
        dd = dy_a * s.put(e.expand_like(one, data_a), upd_a, "mul") if needs[0] else None
        du = s.take(dy_a * data_a) if needs[2] else None
    else:
        is_zero = e.Equal(upd_a, zero)
        nonzero = e.Where(is_zero, one, upd_a)
        prod_nz = s.put(e.expand_like(one, data_a), nonzero, "mul")  # product of the non-zero updates
        zeros_on = s.put(e.expand_like(zero, data_a), e.Cast(is_zero, to=int(acc)), "add")  # how many are 0
        dd = dy_a * e.Where(e.Equal(zeros_on, zero), prod_nz, zero) if needs[0] else None
        du = None
        if needs[2]:
            others_zero = s.take(zeros_on) - e.Cast(is_zero, to=int(acc))
            others = e.Where(e.Equal(others_zero, zero), s.take(prod_nz) / nonzero, zero)
            du = s.take(dy_a * data_a) * others
    return (cast_to(e, dd, data.dtype) if dd is not None else None,
            cast_to(e, du, upd.dtype) if du is not None else None)


def _scatter_extreme(s, e, data, upd, out, dy, needs):
    """out[p] = max/min(data[p], u on p): dy / (number of candidates equal to out[p]) to each."""
    acc = accumulation_type(data, False)
    hit_d = e.Cast(e.Equal(data, out), to=int(acc))
    hit_u = e.Cast(e.Equal(upd, s.take(out)), to=int(acc))
    count = s.put(hit_d, hit_u, "add")
    share = cast_to(e, dy, acc) / count
    dd = cast_to(e, hit_d * share, data.dtype) if needs[0] else None
    du = cast_to(e, hit_u * s.take(share), upd.dtype) if needs[2] else None
    return dd, du


@register(["ScatterElements", "ScatterND"])
def scatter(n, dys, needs, e):
    """out = data with updates written (or reduced) at the indices; see the module doc for
    each reduction. none: d data = scatter(dy, 0), d updates = gather(dy) for the winning
    writes; add: dy, gather(dy); mul: dy * prod(u), gather(dy * data) * prod(other u);
    max/min: dy split evenly among the candidates equal to out."""
    data, _, upd = n.inputs
    (out,) = n.outputs
    (dy,) = dys
    reduction = attr(n, "reduction", "none")
    s = _Scatter(n, e)
    if reduction == "none":
        dd, du = _scatter_none(s, e, data, upd, dy, needs, _unique_writes(n))
    elif reduction == "add":
        dd, du = dy, s.take(dy) if needs[2] else None
    elif reduction == "mul":
        dd, du = _scatter_mul(s, e, data, upd, dy, needs, _unique_writes(n))
    elif reduction in ("max", "min"):
        dd, du = _scatter_extreme(s, e, data, upd, out, dy, needs)
    else:
        raise GradientRuleError(f"unknown {n.op_type} reduction '{reduction}'")
    return (dd if needs[0] else None, None, du)


# ----------------------------------------------------------------------------- TensorScatter


@register("TensorScatter", since=24)
def tensor_scatter(n, dys, needs, e):
    """present = past with update[.., s, ..] written at [.., w[b] + s, ..] along axis (mod the
    cache length in circular mode). d past = dy with the written positions zeroed (the same
    TensorScatter writing zeros into dy); d update = dy read at those positions: a Slice
    without write_indices, else GatherElements at w[b] + s."""
    past, update = n.inputs[0], n.inputs[1]
    write = optional_input(n, 2)
    (dy,) = dys
    mode = attr(n, "mode", "linear")
    dpast = dupd = None
    if needs[0]:
        dpast = e.op("TensorScatter", dy, e.zeros_like(update), write, mode=mode, axis=attr(n, "axis", -2))
    if needs[1]:
        dims = Dims(e, past)
        rank = dims.need_rank("TensorScatter")
        axis = attr(n, "axis", -2) % rank
        length = Dims(e, update)[axis]
        if write is None:
            dupd = e.Slice(dy, e.ints([0]), vec(e, length), e.ints([axis]))
        else:
            steps = e.Range(scalar_of(e, 0), scalar_of(e, length), scalar_of(e, 1))
            pos = (e.Reshape(steps, [-1] + [1] * (rank - 1 - axis))
                   + e.Reshape(as_int64(e, write), [-1] + [1] * (rank - 1)))
            if mode == "circular":
                pos = e.Mod(pos, vec(e, dims[axis]))
            dupd = e.GatherElements(dy, e.Expand(pos, Dims(e, update).vector()), axis=axis)
    return (dpast, dupd, None)[:len(n.inputs)]
