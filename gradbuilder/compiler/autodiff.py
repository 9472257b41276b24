"""The reverse walk: which nodes need gradients, in which order, and how they add up.

Only nodes that lie on a float path from a weight to the loss are differentiated. Every
such node's rule is called once, in reverse topological order, with the summed gradients
of its outputs; a value with several consumers gets one gradient (a ``Sum`` of the
contributions). Integer and bool values never carry gradients.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from . import registry
from ..errors import GradientRuleError, UnsupportedOpError
from .emitter import Emitter
from .traversal import captures, is_float, node_inputs, reached_from
from .values import dims_of

__all__ = ["differentiate", "walk", "GradientResult", "node_label",
           "captures", "is_float", "node_inputs"]  # the last three are compiler.traversal's, kept here for rules


@dataclasses.dataclass
class GradientResult:
    grads: dict[str, ir.Value]  # weight name -> gradient value
    unreached: list[str]  # weights that do not reach the loss (zero gradient)


def _grad_name(value: ir.Value) -> str:
    return f"{value.name}_grad"


class _Accumulator:
    """Collects gradient contributions per value and sums them on first read. With
    ``eager`` (memory-efficient gradients) each contribution is added to the running sum as
    it arrives, so that it can be freed before the others are computed."""

    def __init__(self, e: Emitter, eager: bool = False):
        self.e = e
        self.eager = eager
        self.parts: dict[ir.Value, list[ir.Value]] = {}

    def add(self, value: ir.Value, grad: ir.Value) -> None:
        parts = self.parts.setdefault(value, [])
        if self.eager and parts:
            grad = self.e.Add(parts.pop(), grad)
            self.e.typed(grad, value.dtype, dims_of(value))
        parts.append(grad)

    def take(self, value: ir.Value) -> ir.Value | None:
        parts = self.parts.get(value)
        if not parts:
            return None
        if len(parts) == 1:
            total = parts[0]
        else:
            total = self.e.op("Sum", *parts, name=_grad_name(value))
        self.e.typed(total, value.dtype, dims_of(value))
        self.parts[value] = [total]
        return total


def differentiate(
    graph: ir.Graph,
    weights: list[ir.Value],
    loss: ir.Value,
    e: Emitter,
    *,
    stop_gradients: frozenset[ir.Value] = frozenset(),
    eager_sums: bool = False,
) -> GradientResult:
    """Append to ``graph``, through ``e`` (which knows the opset), the nodes computing
    d(loss)/d(weight) for every weight. ``eager_sums``: add each gradient contribution to its
    value's running sum at once (``use_memory_efficient_gradient``) instead of one Sum when the
    total is first read."""
    grads = walk(graph, weights, {loss: None}, e, stop_gradients=stop_gradients, eager_sums=eager_sums)
    result: dict[str, ir.Value] = {}
    unreached: list[str] = []
    for w in weights:
        g = grads.get(w)
        if g is None:
            unreached.append(w.name)
            g = e.zeros_like(w)
        result[w.name] = g
    return GradientResult(result, unreached)


def walk(
    graph: ir.Graph,
    wrt: list[ir.Value],
    seeds: dict[ir.Value, ir.Value | None],
    e: Emitter,
    *,
    stop_gradients: frozenset[ir.Value] = frozenset(),
    eager_sums: bool = False,
) -> dict[ir.Value, ir.Value]:
    """Gradients of sum(seed_v * v) over ``seeds`` w.r.t. ``wrt``, emitted through ``e`` (at
    its opset).

    ``graph`` is the graph to walk back through, or any topologically ordered list of nodes
    (a rule walking back through nodes it copied from a subgraph).

    A seed of None means ones (a scalar loss). Values of ``wrt`` that no seed reaches are
    absent from the result.
    """
    opset = e.opset
    nodes = list(graph)
    inputs_of = {id(n): node_inputs(n) for n in nodes}

    # 1. Forward: values that depend (through float values) on one of ``wrt``.
    reached = reached_from(nodes, wrt, inputs_of=lambda node: inputs_of[id(node)], stop_edges=_stop_edges,
                           stop_values=stop_gradients).values

    # 2. Backward: nodes between ``wrt`` and the seeds.
    needed: set[ir.Value] = {v for v in seeds if v in reached}
    active: list[ir.Node] = []
    for node in reversed(nodes):
        if not any(o in needed for o in node.outputs):
            continue
        stops_here = registry.stop_gradient_edges(node.domain, node.op_type)
        ins = [v for i, v in enumerate(inputs_of[id(node)])
               if v is not None and v in reached and i not in stops_here]
        if not ins:
            continue
        active.append(node)
        needed.update(ins)

    # 3. Seed and walk.
    acc = _Accumulator(e, eager_sums)
    for value, seed in seeds.items():
        if value in reached:
            acc.add(value, seed if seed is not None else e.ones_like(value))
    for node in active:
        dys = [acc.take(o) if o in needed else None for o in node.outputs]
        if all(d is None for d in dys):
            continue
        ins = inputs_of[id(node)]
        stops_here = registry.stop_gradient_edges(node.domain, node.op_type)
        needs = [v is not None and v in needed and i not in stops_here for i, v in enumerate(ins)]
        grads = _call_rule(node, dys, needs, opset, e, len(ins))
        for value, grad, need in zip(ins, grads, needs):
            if need and grad is not None:
                e.typed(grad, value.dtype, dims_of(value))
                acc.add(value, grad)
    return {w: g for w in wrt if (g := acc.take(w)) is not None}


def _stop_edges(node: ir.Node):
    return registry.stop_gradient_edges(node.domain, node.op_type)


def _call_rule(node: ir.Node, dys, needs, opset: int, e: Emitter, n_inputs: int) -> list:
    entry = registry.lookup(node.domain, node.op_type, _node_opset(node, opset))
    if entry is None:
        supported = ", ".join(sorted(
            {r.op_type if not r.domain else f"{r.domain}::{r.op_type}" for r in registry.all_rules()}
        ))
        raise UnsupportedOpError(
            f"no gradient rule for node {node_label(node)} (op_type={node.op_type}, "
            f"domain='{node.domain or 'ai.onnx'}', opset={_node_opset(node, opset)}); it lies on the "
            f"path from the weights to the loss. Remove it from that path, mark its inputs as "
            f"stop-gradient, or register a rule. Supported ops: {supported}"
        )
    try:
        with e.scoped(f"{node.name or node.op_type}/grad/"), e.math():
            grads = list(entry.fn(node, dys, needs, e))
    except (GradientRuleError, UnsupportedOpError) as exc:
        raise type(exc)(f"node {node_label(node)} (op_type={node.op_type}, domain='{node.domain or 'ai.onnx'}', "
                        f"opset={opset}): {exc}") from exc
    if len(grads) > n_inputs:
        raise GradientRuleError(
            f"rule for {node.op_type} returned {len(grads)} gradients for {n_inputs} inputs "
            f"(node {node_label(node)})"
        )
    grads += [None] * (n_inputs - len(grads))
    return grads


def node_label(node: ir.Node) -> str:
    if node.name:
        return f"'{node.name}'"
    first = node.outputs[0].name if node.outputs else "?"
    return f"<unnamed, output '{first}'>"


def _node_opset(node: ir.Node, default: int) -> int:
    graph = node.graph
    while graph is not None and not isinstance(graph, ir.Graph):
        graph = getattr(graph, "graph", None)
    if graph is not None:
        version = graph.opset_imports.get(node.domain or "")
        if version is not None:
            return version
    return default
