"""A forward graph and a backward graph for a model whose loss is computed elsewhere.

ORTModule runs a PyTorch module's forward in onnxruntime and lets PyTorch compute the loss,
so the backward starts from the gradients of the model's outputs, given at run time:

- the **forward** graph computes the outputs and also returns the values its backward reads
  (the *saved* values: activations, dropout masks);
- the **backward** graph takes one gradient per differentiable output (``<output>_grad_output``
  inputs), the saved values and the forward inputs it reads, and returns ``<name>_grad`` for
  every requested input that the outputs depend on.

Both come from one differentiated graph: the nodes of the forward model go to the forward
graph, the nodes the gradient rules added go to the backward graph, and every value crossing
from the first to the second becomes an output of one and an input of the other.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import onnx
import onnx_ir as ir

from ..errors import InvalidArgumentError
from ..interface import GRADIENT_OUTPUT
from . import modelio, pipeline
from .autodiff import walk
from .traversal import node_inputs
from .values import FLOAT_TYPES

SEED_SUFFIX = GRADIENT_OUTPUT


@dataclasses.dataclass
class SplitGraphs:
    forward: onnx.ModelProto
    backward: onnx.ModelProto
    outputs: list[str]  # the model's outputs: the first outputs of the forward graph
    saved: list[str]  # the forward graph's further outputs, read by the backward
    seeds: dict[str, str]  # backward input -> the output whose gradient it takes
    gradients: dict[str, str]  # the input or weight -> its gradient, a backward output
    forward_inputs: list[str]  # the forward graph's inputs
    backward_inputs: list[str]  # the backward graph's inputs, all kinds
    gradient_graph: onnx.ModelProto | None = None  # forward and backward in one graph, when kept

    @property
    def no_gradient(self) -> list[str]:
        """Inputs asked for whose gradient is zero: the outputs do not depend on them."""
        return [n for n, g in self.gradients.items() if g is None]


def build_split(model, wrt: Iterable[str], outputs: Iterable[str] | None = None,
                stop_gradients: Iterable[str] = (), keep_gradient_graph: bool = False) -> SplitGraphs:
    """Split graphs of ``model`` (bytes, path or ModelProto; not modified) differentiating its
    float ``outputs`` (default: all float graph outputs) with respect to the graph inputs
    ``wrt``; no gradient flows through the values named in ``stop_gradients``.
    ``keep_gradient_graph`` also returns the graph before the split."""
    with pipeline.cyclic_collection_paused():
        return _build_split(model, list(wrt), outputs, list(stop_gradients), keep_gradient_graph)


def _build_split(model, wrt: list[str], outputs, stop_gradients: list[str], keep_gradient_graph: bool) -> SplitGraphs:
    full, is_forward, boundary = _differentiated(model, wrt, outputs, stop_gradients)
    pipeline.release()
    seed_names, gradients, forward_inputs_read, out_infos, saved_infos, grad_infos, output_names, saved_names = boundary
    fw_nodes = [n for n, f in zip(full.graph.node, is_forward) if f]
    bw_nodes = [n for n, f in zip(full.graph.node, is_forward) if not f]
    seed_inputs = [i for i in full.graph.input if i.name in seed_names]
    forward_graph_inputs = [i for i in full.graph.input if i.name not in seed_names]
    fw = _part(full, fw_nodes, forward_graph_inputs, out_infos + saved_infos, "forward")
    read_inputs = [i for i in forward_graph_inputs if i.name in forward_inputs_read]
    bw_reads = set().union(*(modelio.node_reads(n) for n in bw_nodes)) | {g.name for g in grad_infos}
    outputs_read = [i for i in out_infos if i.name in bw_reads]
    # an output that is also a graph input (a value passed on unchanged) is read once
    bw_inputs = list({i.name: i for i in reversed(seed_inputs + outputs_read + saved_infos + read_inputs)}.values())[::-1]
    bw = _part(full, bw_nodes, bw_inputs, grad_infos, "backward")
    return SplitGraphs(
        forward=fw, backward=bw, outputs=output_names, saved=saved_names,
        seeds=seed_names, gradients=gradients, forward_inputs=[i.name for i in fw.graph.input],
        backward_inputs=[i.name for i in bw.graph.input], gradient_graph=full if keep_gradient_graph else None,
    )


def _differentiated(model, wrt: list[str], outputs, stop_gradients: list[str]):
    """The differentiated graph as a proto, which of its nodes are forward nodes, and what the
    split needs to know of the boundary."""
    m = pipeline.load(modelio.load_proto(model), wrt, quiet=True)
    graph = m.graph
    values = pipeline.values_by_name(graph)
    inputs = {v.name: v for v in graph.inputs}
    for name in wrt:
        if name not in inputs:
            raise InvalidArgumentError(f"split graphs: '{name}' is not an input of the model "
                                       f"(inputs: {sorted(inputs)})")
        if inputs[name].dtype not in FLOAT_TYPES:
            raise InvalidArgumentError(f"split graphs: input '{name}' has type {inputs[name].dtype}; only "
                                       "float tensors take gradients")
    model_outputs = list(graph.outputs)
    if outputs is None:
        diff_outputs = [v for v in model_outputs if v.dtype in FLOAT_TYPES]
    else:
        diff_outputs = [values[n] for n in outputs]
    names = [v.name for v in model_outputs], [v.name for v in diff_outputs]

    wrt_values = [inputs[n] for n in wrt]
    ctx = pipeline.Context.of(m, wrt=wrt_values)
    pipeline.run(pipeline.PREPARE, m, ctx)
    # A pass that replaces a value (a graph output's producer, for one) gives the new value its
    # name: the outputs and the stop-gradient values are looked up again by name.
    values = pipeline.values_by_name(graph)
    model_outputs, diff_outputs = ([values[n] for n in group] for group in names)
    e = ctx.emitter
    forward_ids = {id(n) for n in graph}

    seeds: dict[ir.Value, ir.Value] = {}
    seed_names: dict[str, str] = {}
    for out in diff_outputs:
        if out in seeds:
            continue
        seed = ir.Value(name=e.unique(out.name + SEED_SUFFIX), type=out.type,
                        shape=ir.Shape(list(out.shape)) if out.shape is not None else None)
        seeds[out] = seed
        seed_names[seed.name] = out.name
    graph.inputs.extend(seeds.values())
    missing = [n for n in stop_gradients if n not in values]
    if missing:
        raise InvalidArgumentError(f"split graphs: stop_gradients names values the model does not have: {missing}")
    grads = walk(graph, wrt_values, dict(seeds), e, stop_gradients=frozenset(values[n] for n in stop_gradients))
    reached = [w for w in wrt_values if w in grads]
    named = pipeline.name_gradients(e, reached, {w.name: grads[w] for w in reached})
    gradients = {w.name: None for w in wrt_values}
    gradients.update({w.name: g.name for w, g in zip(reached, named)})
    graph.outputs.clear()
    graph.outputs.extend(model_outputs + named)
    pipeline.run(pipeline.FINISH, m, ctx)
    # a pass may replace an output's value (padded_sums: a gradient's Sum by a Concat that takes
    # its name): the outputs are the graph's again
    model_outputs, named = list(graph.outputs[:len(model_outputs)]), list(graph.outputs[len(model_outputs):])
    forward_ids |= {id(n) for n in ctx.forward}  # what the passes added to the forward

    # The boundary: what backward nodes read from the forward side. Constants and views
    # (Reshape, Squeeze, ...) are copied into the backward rather than saved: saving a view
    # makes onnxruntime copy it, and the backward can make it again from its source for free.
    outputs_set = {v.name for v in model_outputs}
    seed_set = set(seeds.values())
    while True:
        saved, forward_inputs_read = _boundary(graph, forward_ids, outputs_set, seed_set)
        if not _copy_views_into_backward(graph, forward_ids, saved, e.unique):
            break
    nodes = list(graph)
    is_forward = [id(n) in forward_ids for n in nodes]
    for g in named:  # a gradient that is a forward value (Identity of an input, ...)
        producer = g.producer()
        if producer is not None and id(producer) in forward_ids:
            saved[g.name] = g
    saved_values = list(saved.values())
    saved_infos = [ir.serde.serialize_value(v) for v in saved_values]
    out_infos = [ir.serde.serialize_value(v) for v in model_outputs]
    grad_infos = [ir.serde.serialize_value(v) for v in named]
    output_names, saved_names = [v.name for v in model_outputs], [v.name for v in saved_values]
    return ir.to_proto(m), is_forward, (seed_names, gradients, forward_inputs_read, out_infos, saved_infos, grad_infos,
                                        output_names, saved_names)


def _boundary(graph: ir.Graph, forward_ids: set[int], outputs: set[str], seeds: set[ir.Value]):
    """The forward values backward nodes read (saved, by name) and the graph inputs they read."""
    saved: dict[str, ir.Value] = {}
    inputs_read: dict[str, None] = {}
    for node in graph:
        if id(node) in forward_ids:
            continue
        for v in node_inputs(node):
            if v is None or v in seeds or v.is_initializer():
                continue
            producer = v.producer()
            if producer is None:
                if v.is_graph_input():
                    inputs_read[v.name] = None
            elif id(producer) in forward_ids and v.name not in outputs:
                saved[v.name] = v
    return saved, inputs_read


_VIEWS = frozenset({"Constant", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


def _copy_views_into_backward(graph: ir.Graph, forward_ids: set[int], saved: dict[str, ir.Value], unique) -> bool:
    """For each saved value made by a Constant or a view node, a copy of that node placed
    before its first backward reader, which the backward readers read instead. True if any."""
    changed = False
    position = {id(n): i for i, n in enumerate(graph)}
    for v in saved.values():
        node = v.producer()
        if node.op_type not in _VIEWS or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
            continue
        readers = [(user, i) for user, i in v.uses() if id(user) not in forward_ids]
        if not readers or any(id(user) not in position for user, _ in readers):
            continue  # none, or one inside a subgraph (If, Loop, Scan): the value stays saved
        first = min((user for user, _ in readers), key=lambda user: position[id(user)])
        copy = ir.Node(node.domain, node.op_type, list(node.inputs), attributes=list(node.attributes.values()),
                       name=unique(f"{node.name or node.op_type}_in_backward"), version=node.version)
        copy.outputs[0].name = unique(f"{v.name}_in_backward")
        copy.outputs[0].type, copy.outputs[0].shape = v.type, v.shape
        graph.insert_before(first, copy)
        position[id(copy)] = position[id(first)] - 0.5  # it may read a view copied next
        for user, i in readers:
            user.replace_input_with(i, copy.outputs[0])
        changed = True
    return changed


def _part(full: onnx.ModelProto, nodes, inputs, outputs, name: str) -> onnx.ModelProto:
    """A model of ``nodes`` from ``full`` with the given inputs and outputs and the
    initializers the nodes read; nodes whose outputs nothing reads are left out (a view now
    made again in the backward)."""
    needed = {o.name for o in outputs}  # then also every name a kept node reads
    kept = []
    for n in reversed(list(nodes)):
        if any(o in needed for o in n.output):
            kept.append(n)
            needed |= modelio.node_reads(n)
    graph = onnx.helper.make_graph(kept[::-1], f"{full.graph.name}_{name}", list(inputs), list(outputs),
                                   [t for t in full.graph.initializer if t.name in needed])
    return onnx.helper.make_model(graph, opset_imports=list(full.opset_import), ir_version=full.ir_version,
                                  producer_name="gradbuilder", functions=list(full.functions))
