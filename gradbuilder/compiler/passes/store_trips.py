"""Make Loop and Scan nodes also return the values their body started each iteration with.

The backward of a loop runs its iterations in reverse; iteration t needs the loop-carried
values (and, for Loop, the iteration number and condition) that forward iteration t
started from. This pass appends them to the body's scan outputs, so the forward node stacks
them along a new leading axis ("trips"); the node's other outputs are unchanged. Only nodes
whose outputs depend on a weight are rewritten, together with the loops nested in them.

``node.meta[TRIPS]`` lists, per trip output, the index of the body input it stores.
"""

from __future__ import annotations

import onnx_ir as ir

from ..registry import TRIPS
from ..traversal import reached_from, subgraph_nodes
from ..values import attr
from . import copy_type

LOOPS = ("Loop", "Scan")


def store_loop_trips(model: ir.Model, ctx) -> None:
    for node in reached_from(list(model.graph), ctx.wrt).nodes:
        for inner in [*subgraph_nodes(node), node]:
            if inner.op_type in LOOPS and inner.domain in ("", "ai.onnx") and TRIPS not in inner.meta:
                _store(inner, ctx.unique)


def _store(node: ir.Node, unique) -> None:
    body = node.attributes["body"].value
    if node.op_type == "Loop":
        # the iteration number always (the backward loop counts its trips from it), then
        # the condition and the carried values the body reads
        stored = [0] + [i for i in range(1, len(body.inputs)) if body.inputs[i].uses()]
    else:
        n_states = len(body.inputs) - attr(node, "num_scan_inputs", 0)
        stored = [i for i in range(n_states) if body.inputs[i].uses()]
    if not stored:
        node.meta[TRIPS] = []
        return
    first = len(node.outputs)
    for i in stored:
        value = body.inputs[i]
        copy = ir.Node("", "Identity", [value], num_outputs=1, name=unique(f"{value.name}_trip_node"))
        out = copy.outputs[0]
        out.name = unique(f"{value.name}_trip")
        copy_type(out, value)
        if out.shape is None:  # onnxruntime's Scan needs the rank of every body output
            rank = _carried_rank(node, i)
            out.shape = ir.Shape([None] * rank) if rank is not None else None
        body.append(copy)
        body.outputs.append(out)
    node.resize_outputs(first + len(stored))
    label = node.name or node.outputs[0].name
    for k, i in enumerate(stored):
        value, out = body.inputs[i], node.outputs[first + k]
        out.name = unique(f"{label}_trips_{k}")
        copy_type(out, value, stacked=True)
    if node.op_type == "Scan":
        for name in ("scan_output_axes", "scan_output_directions"):
            if name in node.attributes:
                values = list(node.attributes[name].value) + [0] * len(stored)
                node.attributes[name] = ir.AttrInt64s(name, values)
    node.meta[TRIPS] = stored


def _carried_rank(node: ir.Node, i: int) -> int | None:
    """The rank of body input ``i`` of a Loop or Scan, from the body output that carries it on
    or from the node input it starts from (a carried value keeps its rank)."""
    body = node.attributes["body"].value
    if node.op_type == "Loop":
        if i < 2:
            return 0  # the iteration number and the condition
        sources = [body.outputs[i - 1], node.inputs[i] if i < len(node.inputs) else None]
    else:
        sources = [body.outputs[i], node.inputs[i]]
    return next((len(v.shape) for v in sources if v is not None and v.shape is not None), None)
