"""A Sum of zero-padded slices that tile an axis becomes their Concat.

The gradients of slices taken from one tensor (Gather of one index, Slice, Split: a packed
QKV projection's three parts) are each the slice's gradient zero-padded back to the whole
tensor, and the walk sums them. Where the pads are constants, all along one axis, and the
slices tile that axis exactly, the sum is the slices side by side: one Concat, without the
padded copies and the additions over zeros (2% of the benchmark transformer's step).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..values import attr, constant_of, dims_of


def padded_sums_as_concat(model: ir.Model, ctx) -> None:
    graph = model.graph
    for node in list(graph):
        if node.op_type != "Sum" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        parts = [_padded_slice(v, node) for v in node.inputs]
        if any(p is None for p in parts):
            continue
        axes = {p[1] for p in parts}
        totals = {p[2] + p[3] + p[4] for p in parts}
        if len(axes) != 1 or len(totals) != 1:
            continue
        parts.sort(key=lambda p: p[2])
        position = 0
        for _, _, begin, length, _ in parts:
            if begin != position:
                break
            position += length
        else:
            if position != totals.pop():
                continue
            concat = ir.Node("", "Concat", [p[0] for p in parts], [ir.AttrInt64("axis", axes.pop())],
                             name=ctx.unique(f"{node.name or 'Sum'}_as_concat"))
            summed, out = node.outputs[0], concat.outputs[0]
            name = summed.name  # the Concat's output takes the name (a gradient output's, W_grad)
            summed.name = ctx.unique(f"{name}_summed")
            out.name, out.dtype, out.shape = name, summed.dtype, summed.shape
            out.meta.update(summed.meta)
            graph.insert_before(node, concat)
            summed.replace_all_uses_with(out, replace_graph_outputs=True)
            # the Sum and its Pads, now unread, go with the pipeline's cleanup


def _padded_slice(value: ir.Value | None, reader: ir.Node):
    """(the unpadded value, axis, begin, length, end) when ``value`` is a constant-0 Pad of a
    value of static size along exactly one axis, read by ``reader`` alone; else None."""
    pad = value.producer() if value is not None else None
    if (pad is None or pad.op_type != "Pad" or pad.domain not in ("", "ai.onnx") or value.is_graph_output()
            or len(value.uses()) != 1 or attr(pad, "mode", "constant") not in ("constant", b"constant")):
        return None
    if len(pad.inputs) > 2 and pad.inputs[2] is not None:
        fill = constant_of(pad.inputs[2])
        if fill is None or np.any(fill != 0):
            return None
    if len(pad.inputs) > 3 and pad.inputs[3] is not None:
        return None  # axes given: not worth the bookkeeping
    pads = constant_of(pad.inputs[1]) if len(pad.inputs) > 1 else attr(pad, "pads")
    dims = dims_of(pad.inputs[0])
    if pads is None or dims is None:
        return None
    pads = [int(p) for p in np.ravel(pads)]
    rank = len(dims)
    if len(pads) != 2 * rank or any(p < 0 for p in pads):
        return None
    axes = [a for a in range(rank) if pads[a] or pads[a + rank]]
    if len(axes) != 1 or not isinstance(dims[axes[0]], int):
        return None
    a = axes[0]
    return pad.inputs[0], a, pads[a], dims[a], pads[a + rank]
