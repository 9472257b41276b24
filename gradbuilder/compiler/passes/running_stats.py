"""Running statistics: state a forward op keeps beside the gradient.

A BatchNormalization in training mode normalizes with the batch's statistics and also returns
new running statistics, ``running_mean = momentum * input_mean + (1 - momentum) * batch_mean``
(likewise the variance), which inference mode uses instead of the batch's. When its
``input_mean`` / ``input_var`` are initializers or graph inputs they are **buffers**: state
that training updates, but that is never trained (no gradient, no optimizer state, no weight
decay).

- ``buffers_of(model)``: the buffer names of a model (ModelProto).
- ``expose_running_statistics(graph, e, opset, unbiased)``: on the IR before differentiation,
  the new value of every buffer, to be returned as the graph output ``<buffer>.updated``.
  onnxruntime's CPU kernel writes its running outputs into the buffers given as inputs 3 and 4
  (the outputs alias the inputs), so the node is given copies: the buffers the caller binds
  keep their values whatever the run does, and a failed run changes nothing. With
  ``unbiased`` the running variance blends in the batch's unbiased variance, as PyTorch does
  (``var * n / (n - 1)``, n values per channel); ONNX and onnxruntime blend the population
  variance.
- ``inference_form(model)``: every BatchNormalization in inference mode (it reads the running
  statistics; its output no longer depends on the rest of the batch) and every Dropout an
  identity, for exports and evaluation.
"""

from __future__ import annotations

import re

import onnx
import onnx_ir as ir
from onnx import helper

from ..modelio import default_opset
from ..values import attr

# torch's dynamo exporter writes a training-mode BatchNorm (aten's functional batch norm with
# training=True) as an inference-mode BatchNormalization; the node's metadata keeps the call.
_TORCH_TRAINING = re.compile(r"aten\._native_batch_norm_legit_functional\.default\]\(args = \((?:[^,]*, ){5}True,")


def _in_training(op_type: str, n_outputs: int, training_mode: int | None, opset: int, metadata=None) -> bool:
    """BatchNormalization-14+ says so by ``training_mode``; -9 to -13 by returning more than Y;
    a dynamo export by the call in its metadata."""
    if op_type != "BatchNormalization":
        return False
    if bool(_TORCH_TRAINING.search((metadata or {}).get("pkg.torch.onnx.fx_node", ""))):
        return True
    return bool(training_mode) if opset >= 14 else n_outputs > 1


def restore_training_mode(model: ir.Model, ctx) -> None:
    """Put back in training mode the BatchNormalizations that torch's dynamo exporter wrote in
    inference form for a module in training mode (their outputs then use the batch's
    statistics, as the module's did)."""
    opset, unique = ctx.opset, ctx.unique
    for node in model.graph:
        if (node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or opset < 14
                or attr(node, "training_mode", 0) or not _in_training(node.op_type, 1, 0, opset, node.metadata_props)):
            continue
        node.attributes["training_mode"] = ir.AttrInt64("training_mode", 1)
        node.resize_outputs(3)
        for i, like in ((1, node.inputs[3]), (2, node.inputs[4])):
            node.outputs[i].name = unique(f"{node.name or 'BatchNormalization'}_running_{i}")
            node.outputs[i].dtype, node.outputs[i].shape = like.dtype, like.shape


def buffers_of(model: onnx.ModelProto) -> list[str]:
    """Names of the running statistics of ``model``: ``input_mean`` and ``input_var`` of each
    training-mode BatchNormalization, where they are initializers or graph inputs."""
    graph, opset = model.graph, default_opset(model, missing=1)
    sources = {t.name for t in graph.initializer} | {i.name for i in graph.input}
    found: list[str] = []
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        mode = next((a.i for a in node.attribute if a.name == "training_mode"), None)
        metadata = {p.key: p.value for p in node.metadata_props}
        if not _in_training(node.op_type, len([o for o in node.output if o]), mode, opset, metadata) or len(node.input) < 5:
            continue
        if all(n in sources for n in node.input[3:5]):
            found += [n for n in node.input[3:5] if n not in found]
    return found


def _buffer(value: ir.Value | None) -> bool:
    return value is not None and value.producer() is None and (value.is_graph_input() or value.is_initializer())


def expose_running_statistics(model: ir.Model, ctx) -> None:
    """With ``ctx.running_statistics``: ``ctx.buffers`` holds (buffer, its new value) for every
    running statistic of the model; see the module's doc. ``ctx.unbiased_variance`` takes
    PyTorch's unbiased batch variance for the running variance."""
    if not ctx.running_statistics:
        return
    graph, e, opset = model.graph, ctx.emitter, ctx.opset
    updates = ctx.buffers
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or len(node.inputs) < 5:
            continue
        mode = attr(node, "training_mode", None)
        if not _in_training(node.op_type, len([o for o in node.outputs if o.name]), mode, opset):
            continue
        x, mean, var = node.inputs[0], node.inputs[3], node.inputs[4]
        if not (_buffer(mean) and _buffer(var)):
            continue
        start = len(e.nodes)
        one = e.scalar(1.0, mean)
        node.replace_input_with(3, e.Mul(mean, one))
        node.replace_input_with(4, e.Mul(var, e.CastLike(one, var)))
        for copy in e.nodes[start:]:
            graph.remove(copy)
            graph.insert_before(node, copy)
        if len(node.outputs) < 3:
            node.resize_outputs(3)
        for i, like in ((1, mean), (2, var)):
            out = node.outputs[i]
            if not out.name:
                out.name = e.unique(f"{node.name or 'BatchNormalization'}_running_{i}")
            out.dtype, out.shape = like.dtype, like.shape
        new_mean, new_var = node.outputs[1], node.outputs[2]
        if ctx.unbiased_variance:
            new_var = _unbiased(e, x, var, new_var, attr(node, "momentum", 0.9))
        updates += [(mean, new_mean), (var, new_var)]


def _unbiased(e, x: ir.Value, var: ir.Value, blended: ir.Value, momentum: float) -> ir.Value:
    """The running variance with the batch's unbiased variance: from blended = m*var + (1-m)*v
    (v the population variance over n values per channel), m*var + (1-m)*v*n/(n-1) =
    blended + (blended - m*var) / (n - 1)."""
    shape = e.Shape(x)
    n = e.Div(e.reduce("ReduceProd", shape, None, keepdims=False), e.Squeeze(e.Shape(x, 1, 2), [0]))
    n = e.CastLike(n, blended)
    batch_part = e.Sub(blended, e.Mul(e.scalar(momentum, var), var))
    return e.Add(blended, e.Div(batch_part, e.Sub(n, e.scalar(1.0, blended))))


def inference_form(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` in inference mode: BatchNormalization reads its running statistics
    (training_mode=0, output Y alone) and Dropout passes its input through. A node reading a
    running output or a dropout mask keeps the training form: the model needs it."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph, opset = out.graph, default_opset(out, missing=1)
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    for i, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx"):
            continue
        extra = [o for o in node.output[1:] if o and o in read]
        if node.op_type == "BatchNormalization" and not extra:
            mode = next((a.i for a in node.attribute if a.name == "training_mode"), None)
            if _in_training(node.op_type, len([o for o in node.output if o]), mode, opset):
                kept = [a for a in node.attribute if a.name != "training_mode"]
                del node.attribute[:]
                node.attribute.extend(kept)
                del node.output[1:]
        elif node.op_type == "Dropout" and not extra:
            graph.node[i].CopyFrom(helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
    return out
