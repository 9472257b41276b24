"""Remove nodes whose outputs nothing uses (gradients no weight needed, dropped outputs)."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedOpsetsPass

from ..traversal import subgraph_nodes


def remove_unused_nodes(model: ir.Model, ctx=None) -> ir.Model:
    """Mark and sweep from the graph outputs over the main graph (subgraphs are kept whole)."""
    graph = model.graph
    live: set[int] = set()
    stack = [v.producer() for v in graph.outputs if v.producer() is not None]
    while stack:
        node = stack.pop()
        if id(node) in live:
            continue
        live.add(id(node))
        inputs = node.inputs
        if node.op_type in _CONTROL_FLOW or node.domain not in ("", "ai.onnx"):
            inputs = list(_inputs_with_subgraph_captures(node))
        for v in inputs:
            if v is None:
                continue
            p = v.producer()
            if p is not None and id(p) not in live and p.graph is graph:
                stack.append(p)
    dead = [n for n in graph if id(n) not in live]
    if dead:
        graph.remove(dead, safe=False)
    used = {v.name for n in ir.traversal.RecursiveGraphIterator(graph) for v in n.inputs if v is not None}
    used.update(v.name for v in graph.outputs)
    used.update(v.name for v in graph.inputs)
    for name in [n for n in graph.initializers if n not in used]:
        del graph.initializers[name]
    RemoveUnusedOpsetsPass()(model)
    return model


_CONTROL_FLOW = frozenset({"If", "Loop", "Scan", "SequenceMap"})


def _inputs_with_subgraph_captures(node: ir.Node):
    yield from (v for v in node.inputs if v is not None)
    for inner in subgraph_nodes(node):
        yield from (v for v in inner.inputs if v is not None)
