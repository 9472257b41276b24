"""Scatters whose reduction onnxruntime could compute wrongly or differently each run become
formulations it computes exactly, the same bits every run, at any thread count.

The gradients of Gather, GatherND, Resize, RoiAlign, GridSample, DeformConv and the attention
caches sum dy into the positions it was read from: ``ScatterND(zeros, idx, dy, reduction="add")``.
onnxruntime's CPU ScatterND splits the updates across its intra-op threads, which then add
into the same rows without synchronisation: from 2 threads on, repeated indices lose updates
(4096 updates of width 768 into 64 rows are off by 3-4, a different amount every run).
ScatterElements along one axis runs its updates in order on one thread (exact, deterministic
on the CPU; CUDA adds with atomics, in an order that varies).

With ``data`` viewed as [rows, rest] (the dims the index tuples address, then the rest) and
each index tuple as a row number ``r = GatherND(arange(rows).reshape(data.shape[:k]), idx)``
(negative entries too), a scatter-add of rows NARROW floats wide or less is that
ScatterElements; a wider one is a segment sum, written without a concurrent read-modify-write:

    order = argsort(r)                      (TopK, ascending)
    c = cumsum(float64(updates[order]))     (prefix sums along the sorted rows)
    ends = the last position of each run of equal rows
    out = ScatterND(data, r[ends], data[r[ends]] + (c[ends] - c[previous end]))   unique rows

When data is zeros (every gradient's case) no zeros of data's size are made: onnxruntime
would fold them into a constant held for the session's life, and the ScatterND would copy
them. The rows are gathered instead from the sums behind one zero row, each row reading its
place among the sums (0: none): the gradient is written once. Its tensors' sizes are those of
the table and of the updates, never the number of distinct rows (``_segment_sum_into_zeros``:
each row's count of updates by an integer scatter-add, exact in any order, and its run in the
sorted updates from their cumulative sum), so that nothing in the step waits for a size read
back from the device. A scalar multiple of those rows
(SGD's ``lr * g``) is gathered from the scaled sums, ``Gather(T, p) * s = Gather(T * s, p)``
exactly: the update then reads no weight-sized product of the gradient, and the gradient's
memory is free once the finiteness check has read it.

Each row's sum is a difference of float64 prefix sums (float32 values: exact to 1e-16 of
their magnitude). The other reductions (mul, max, min) become the ScatterElements along
axis 0 of the same view. Every such ScatterND in the finished graph is rewritten, the forward
model's own and those inside control-flow bodies included; with ``deterministic`` (the
``deterministic_compute`` training parameter) so is every ScatterElements with
reduction="add", whose CUDA kernel adds in a varying order. ``tools/bench_kernels.py
--contests scatter scatter-vocab`` measures the cost.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..values import attr, constant_of, dims_of
from ..emitter import Emitter

_INT64_MAX = 2**63 - 1
# Rows this narrow (static width) add faster with a ScatterElements (in order on the CPU) than by
# sorting (3M updates, 2 threads, idle: 1 float 15 against 58 ms; 4 floats 28 against 23, about
# even; 16 floats 34 against 15).
NARROW = 4


def _reduction(node: ir.Node) -> str:
    r = attr(node, "reduction", "none")
    return r.decode() if isinstance(r, bytes) else r


def _rewritten(node: ir.Node, deterministic: bool) -> bool:
    if node.domain not in ("", "ai.onnx") or _reduction(node) == "none":
        return False
    if node.op_type == "ScatterND":
        return True
    return deterministic and node.op_type == "ScatterElements" and _reduction(node) == "add"


def scatter_reductions_race_free(model: ir.Model, ctx) -> None:
    deterministic = bool(getattr(ctx, "deterministic", False))
    targets = [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if _rewritten(n, deterministic)]
    for node in targets:
        graph = node.graph
        # fresh: no constants cached elsewhere
        e = Emitter(graph, ctx.opset, ctx.emitter.used_names, scope=f"{node.name or node.op_type}/")
        data, idx, upd = node.inputs
        if node.op_type == "ScatterElements":
            out = _elements_add(e, node)
        else:
            view = _RowView(e, node)
            if _reduction(node) == "add" and (deterministic or view.width is None or view.width > NARROW):
                if _is_zeros(data):
                    out = view.restore(_segment_sum_into_zeros(e, view))
                else:
                    out = view.restore(_segment_sum(e, view.data, view.rows, view.updates))
            else:
                out = view.restore(e.ScatterElements(view.data, e.Expand(e.Reshape(view.rows, [-1, 1]), view.one_rest),
                                                     view.updates, axis=0, reduction=_reduction(node)))
        e.place_before(node)
        old = node.outputs[0]
        name = old.name
        old.name = ctx.unique(f"{name}_scattered")
        out.name, out.dtype, out.shape = name, old.dtype, old.shape
        out.meta.update(old.meta)
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        gather = out.producer().inputs[0].producer() if out.producer() is not None else None
        if gather is not None and gather.op_type == "Gather" and gather.name.startswith(e.scope):
            _scale_before_gather(ctx, gather.outputs[0], *gather.inputs)


class _RowView:
    """A ScatterND's data as [rows, rest], its updates as [M, rest] and its index tuples as the
    M row numbers they address."""

    def __init__(self, e: Emitter, node: ir.Node):
        data, idx, upd = node.inputs
        self.e = e
        dd, idims = dims_of(data) or dims_of(node.outputs[0]), dims_of(idx)
        k = idims[-1] if idims and isinstance(idims[-1], int) else None
        if dd is not None and k is not None and all(isinstance(d, int) for d in dd):
            lead, rest = list(dd[:k]), int(np.prod(dd[k:], dtype=np.int64))
            rows = int(np.prod(lead, dtype=np.int64))
            numbered = e.Reshape(e.Range(e.const(0), e.const(rows), e.const(1)), lead)
            rows_rest, self.one_rest, per_update = e.ints([rows, rest]), e.ints([1, rest]), e.ints([-1, rest])
            self.count, self.width = e.ints([rows]), rest
            self.shape = e.ints(list(dd))
        else:
            self.shape = e.Shape(data)
            k_v = e.ints([k]) if k is not None else e.Slice(e.Shape(idx), e.ints([-1]), e.ints([_INT64_MAX]))
            lead_v = e.Slice(self.shape, e.ints([0]), k_v)
            rows_v = e.reduce("ReduceProd", lead_v, [0], keepdims=True)
            rest_v = e.reduce("ReduceProd", e.Slice(self.shape, k_v, e.ints([_INT64_MAX])), [0], keepdims=True)
            numbered = e.Reshape(e.Range(e.const(0), e.Reshape(rows_v, []), e.const(1)), lead_v)
            rows_rest = e.Concat(rows_v, rest_v, axis=0)
            self.count, self.width = rows_v, None
            self.one_rest = e.Concat(e.ints([1]), rest_v, axis=0)
            per_update = e.Concat(e.ints([-1]), rest_v, axis=0)
        self.rows = e.Reshape(e.GatherND(numbered, idx), [-1])
        self.data = e.Reshape(data, rows_rest)
        self.updates = e.Reshape(upd, per_update)
        # M, the number of updates, as a 1-element int64 tensor: a constant where idx's dims are known
        known = idims is not None and all(isinstance(d, int) for d in idims[:-1])
        self.updates_count = e.ints([int(np.prod(idims[:-1], dtype=np.int64))]) if known else e.Shape(self.rows)

    def restore(self, flat: ir.Value) -> ir.Value:
        return self.e.Reshape(flat, self.shape)


def _is_zeros(value: ir.Value) -> bool:
    """An Expand or ConstantOfShape of a constant 0 (through Reshapes)."""
    node = value.producer()
    while node is not None and node.op_type == "Reshape":
        node = node.inputs[0].producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Expand":
        fill = constant_of(node.inputs[0])
        return fill is not None and fill.size == 1 and float(fill.reshape(-1)[0]) == 0.0
    if node.op_type == "ConstantOfShape":
        fill = attr(node, "value")
        return fill is None or not np.any(ir.tensor(fill).numpy())
    return False


def _segment_sum_into_zeros(e: Emitter, view: "_RowView") -> ir.Value:
    """Zeros [R, rest] with updates [M, rest] added at rows [M] (ints in [0, R)), by sorting,
    in tensors whose sizes depend on R and M only (no size is read from the data: the step
    stays free of host syncs where R and M are known):

        order = argsort(rows);  s = cumsum(float64(updates[order]))     [M, rest]
        count = per row, how many updates it gets     (an integer scatter-add: exact in any order)
        end = cumsum(count);  start = end - count      (its run in the sorted updates)

    then, with fewer rows than updates, each row at once: out = [0; s][end] - [0; s][start] (0
    where a row has none); else in the updates' size, each row gathered from its run's sum:

        run = s - [0; s][start[sorted rows]]           (each position: its run's sum so far)
        out = [0; run][end where count > 0, else 0]    (each row: its run's sum, or the zero row)
    """
    rows, updates, m, r = view.rows, view.updates, view.updates_count, view.count
    zero_int, one_int = e.const(np.array(0, np.int64)), e.const(np.array(1, np.int64))
    sorted_rows, order = e.op("TopK", rows, m, outputs=2, largest=0, sorted=1)
    sums = e.CumSum(e.Cast(e.Gather(updates, order, axis=0), to=int(ir.DataType.DOUBLE)), e.const(np.array(0, np.int64)))
    zero_row = (e.const(np.zeros((1, view.width), np.float64)) if view.width is not None else
                e.Expand(e.const(np.zeros((1, 1), np.float64)), e.Shape(e.Slice(updates, e.ints([0]), e.ints([1])))))
    padded = e.Concat(zero_row, sums, axis=0)
    count = e.ScatterElements(e.Expand(zero_int, r), rows, e.Expand(one_int, m), axis=0, reduction="add")
    end = e.CumSum(count, e.const(np.array(0, np.int64)))
    start = e.Sub(end, count)
    sizes = [constant_of(v) for v in (r, m)]
    if all(v is not None for v in sizes) and int(sizes[0].reshape(-1)[0]) <= int(sizes[1].reshape(-1)[0]):
        return e.CastLike(e.Sub(e.Gather(padded, end, axis=0), e.Gather(padded, start, axis=0)), view.data)
    run = e.Sub(sums, e.Gather(padded, e.Gather(start, sorted_rows, axis=0), axis=0))
    place = e.Where(e.Greater(count, zero_int), end, zero_int)
    table = e.Concat(zero_row, run, axis=0)
    return e.Gather(e.CastLike(table, view.data), place, axis=0)


def _segment_sum(e: Emitter, data: ir.Value, rows: ir.Value, updates: ir.Value) -> ir.Value:
    """data [R, rest] with updates [M, rest] added at rows [M] (ints in [0, R)), by sorting."""
    sorted_rows, order = e.op("TopK", rows, e.Shape(rows), outputs=2, largest=0, sorted=1)
    wide = e.Cast(e.Gather(updates, order, axis=0), to=int(ir.DataType.DOUBLE))
    sums = e.CumSum(wide, e.const(np.array(0, np.int64)))
    following = e.Concat(e.Slice(sorted_rows, e.ints([1]), e.ints([_INT64_MAX])), e.ints([-1]), axis=0)
    ends = e.Reshape(e.NonZero(e.Not(e.Equal(sorted_rows, following))), [-1])
    at_ends = e.Concat(e.Expand(e.const(np.zeros((1, 1), np.float64)), e.Shape(e.Slice(updates, e.ints([0]), e.ints([1])))),
                       e.Gather(sums, ends, axis=0), axis=0)
    segment = e.Sub(e.Slice(at_ends, e.ints([1]), e.ints([_INT64_MAX])), e.Slice(at_ends, e.ints([0]), e.ints([-1])))
    targets = e.Gather(sorted_rows, ends, axis=0)
    total = e.Add(e.Cast(e.Gather(data, targets, axis=0), to=int(ir.DataType.DOUBLE)), segment)
    return e.ScatterND(data, e.Reshape(targets, [-1, 1]), e.CastLike(total, data))


def _scale_before_gather(ctx, gathered: ir.Value, table: ir.Value, place: ir.Value) -> None:
    """Each reader ``Mul(v, s)`` (or ``Mul(s, v)``) of ``gathered`` or of a Reshape chain from
    it, with ``s`` a scalar, becomes the same Reshapes of ``Gather(table * s, place)``."""
    chain = [(gathered, [])]  # (value, the Reshape shapes from gathered to it)
    while chain:
        value, shapes = chain.pop()
        for reader, _ in list(value.uses()):
            if reader.op_type == "Reshape" and reader.domain in ("", "ai.onnx") and reader.inputs[0] is value:
                chain.append((reader.outputs[0], shapes + [reader.inputs[1]]))
                continue
            if reader.op_type != "Mul" or reader.domain not in ("", "ai.onnx"):
                continue
            scale = reader.inputs[1] if reader.inputs[0] is value else reader.inputs[0]
            if dims_of(scale) != () or scale is value or scale.dtype != table.dtype:
                continue
            e = Emitter(reader.graph, ctx.opset, ctx.emitter.used_names, scope=f"{reader.name or 'Mul'}/")
            scaled = e.Gather(e.Mul(table, scale), place, axis=0)
            for shape in shapes:
                scaled = e.Reshape(scaled, shape)
            e.place_before(reader)
            product = reader.outputs[0]
            scaled.dtype, scaled.shape = product.dtype, product.shape
            product.replace_all_uses_with(scaled, replace_graph_outputs=True)
            if not product.is_graph_output():
                reader.graph.remove(reader, safe=True)


def _elements_add(e: Emitter, node: ir.Node) -> ir.Value:
    """ScatterElements(reduction="add") along its axis as a segment sum over data's elements:
    the flat position of each update is its own coordinates with the index on the axis."""
    data, idx, upd = node.inputs
    rank = len(dims_of(idx)) if dims_of(idx) is not None else None
    if rank is None:
        return e.ScatterElements(data, idx, upd, axis=attr(node, "axis", 0), reduction="add")
    axis = attr(node, "axis", 0) % rank
    shape = e.Shape(data)
    size = e.reduce("ReduceProd", shape, [0], keepdims=True)
    numbered = e.Reshape(e.Range(e.const(0), e.Reshape(size, []), e.const(1)), shape)
    positions = e.GatherElements(numbered, idx, axis=axis)  # negative indices counted from the end
    flat = _segment_sum(e, e.Reshape(data, e.Concat(size, e.ints([1]), axis=0)), e.Reshape(positions, [-1]),
                        e.Reshape(upd, [-1, 1]))
    return e.Reshape(flat, shape)
