"""Walking an onnx_ir graph, written once: a node's subgraphs (its GRAPH and GRAPHS
attributes) and the nodes in them, the outer values those subgraphs read (captures), and the
nodes a set of values reaches ("reached from the values differentiated"). The reverse walk,
the passes and the rules walk graphs through these."""

from __future__ import annotations

from typing import Callable, Collection, Iterable, Iterator, NamedTuple

import onnx
import onnx_ir as ir

from .values import FLOAT_TYPES

_GRAPH_ATTRIBUTES = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)


def subgraphs(node: ir.Node) -> list[ir.Graph]:
    """The graphs held by ``node``'s attributes (If's branches, Loop's and Scan's body, ...), in
    attribute order; not the graphs nested inside them."""
    graphs: list[ir.Graph] = []
    for a in node.attributes.values():
        if a.type == ir.AttributeType.GRAPH:
            graphs.append(a.value)
        elif a.type == ir.AttributeType.GRAPHS:
            graphs.extend(a.value)
    return graphs


def proto_subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The protobuf form of ``subgraphs``: the graphs of ``node``'s GRAPH and GRAPHS attributes,
    in attribute order."""
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def has_subgraph(node: ir.Node) -> bool:
    """Whether ``node`` holds a graph (a control-flow node, or another domain's op with a body)."""
    return any(a.type in _GRAPH_ATTRIBUTES for a in node.attributes.values())


def subgraph_nodes(node: ir.Node) -> Iterator[ir.Node]:
    """Every node inside ``node``'s subgraphs, nested ones included, subgraph by subgraph."""
    for g in subgraphs(node):
        yield from ir.traversal.RecursiveGraphIterator(g)


def captures(node: ir.Node) -> list[ir.Value]:
    """The values of enclosing graphs that ``node``'s subgraphs (at any depth) read directly,
    in the order first read."""
    graphs = subgraphs(node)
    if not graphs:
        return []
    inner: set[int] = set()
    for g in graphs:
        inner.add(id(g))
        for n in ir.traversal.RecursiveGraphIterator(g):
            inner.update(id(sub) for sub in subgraphs(n))
    seen: dict[ir.Value, None] = {}
    for g in graphs:
        for n in ir.traversal.RecursiveGraphIterator(g):
            for v in n.inputs:
                if v is not None and id(v.graph) not in inner and v not in seen:
                    seen[v] = None
    return list(seen)


def node_inputs(node: ir.Node) -> list[ir.Value | None]:
    """The node's inputs, then the outer values its subgraphs capture (If/Loop/Scan bodies
    read outer values directly): gradients flow into both."""
    captured = captures(node)
    return list(node.inputs) + captured if captured else list(node.inputs)


def is_float(value: ir.Value) -> bool:
    """Whether ``value`` may carry a gradient. An unknown dtype is treated as float: shape
    inference leaves few of those, and a rule sees the real tensor at run time."""
    return value.dtype is None or value.dtype in FLOAT_TYPES


class Reach(NamedTuple):
    nodes: list[ir.Node]  # the nodes an input of which is reached, in the order given
    values: set[ir.Value]  # the values reached: the start values and the float outputs of those nodes


def reached_from(
    nodes: Iterable[ir.Node],
    start: Iterable[ir.Value],
    *,
    inputs_of: Callable[[ir.Node], list[ir.Value | None]] = node_inputs,
    stop_edges: Callable[[ir.Node], Collection[int]] | None = None,
    stop_values: Collection[ir.Value] = frozenset(),
) -> Reach:
    """What the values ``start`` reach in ``nodes`` (topologically ordered) through float
    values: a node is reached when one of its inputs (``inputs_of``: with its subgraphs'
    captures) is, and its float outputs are reached in turn. ``stop_edges(node)``: input
    indices along which nothing flows (the registry's stop-gradient edges); ``stop_values``:
    values never reached (stop gradients)."""
    reached: set[ir.Value] = set(start)
    found: list[ir.Node] = []
    for node in nodes:
        stops = stop_edges(node) if stop_edges is not None else ()
        if any(v in reached for i, v in enumerate(inputs_of(node)) if v is not None and i not in stops):
            found.append(node)
            for out in node.outputs:
                if is_float(out) and out not in stop_values:
                    reached.add(out)
    return Reach(found, reached)
