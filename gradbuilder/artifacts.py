"""Training artifacts and inference export, shaped like onnxruntime's training artifacts API.

``export_model_for_inferencing`` writes the forward model with trained weights and only the
outputs asked for.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from . import modelio
from .errors import InvalidArgumentError
from .passes.cleanup import remove_unused_nodes
from .passes.optimizer import initial_state
from .passes.running_stats import buffers_of, inference_form
from .training import optimizer_only_model


def export_model_for_inferencing(model, output_path: str | os.PathLike, output_names: Sequence[str],
                                 weights: Mapping[str, np.ndarray] | None = None) -> str:
    """Write ``model`` (forward graph: bytes, path or ModelProto, never modified) to
    ``output_path`` with the initializers in ``weights`` replaced by the given (trained)
    values and only ``output_names`` as outputs; nodes those outputs do not need are removed.
    The model is written in inference mode (``passes.running_stats.inference_form``:
    BatchNormalization reads its running statistics, Dropout passes through), so each output
    depends on its own sample only. The write is atomic."""
    proto = inference_form(modelio.load_proto(model))
    inits = {t.name: t for t in proto.graph.initializer}
    for name, value in (weights or {}).items():
        if name not in inits:
            raise InvalidArgumentError(f"weights: the model has no initializer named '{name}'")
        old = inits[name]
        value = np.asarray(value)
        if list(value.shape) != list(old.dims):
            raise InvalidArgumentError(
                f"weights: '{name}' has shape {list(value.shape)}, the model's initializer {list(old.dims)}")
        new = numpy_helper.from_array(value.astype(onnx.helper.tensor_dtype_to_np_dtype(old.data_type)), name)
        old.CopyFrom(new)
    names = list(output_names)
    if not names:
        raise InvalidArgumentError("output_names is empty: name at least one output to keep")
    ir_model = modelio.to_ir(onnx.shape_inference.infer_shapes(proto))  # typed outputs
    values = {v.name: v for v in ir_model.graph.inputs}
    values.update(ir_model.graph.initializers)
    for node in ir_model.graph:
        values.update({o.name: o for o in node.outputs})
    missing = [n for n in names if n not in values]
    if missing:
        raise InvalidArgumentError(f"output_names: the model has no values named {missing}")
    ir_model.graph.outputs.clear()
    ir_model.graph.outputs.extend(_output_values(ir_model.graph, [values[n] for n in names]))
    remove_unused_nodes(ir_model)
    read = {v.name for n in ir.traversal.RecursiveGraphIterator(ir_model.graph) for v in n.inputs if v is not None}
    for v in [v for v in ir_model.graph.inputs if v.name not in read and not v.is_graph_output()]:
        ir_model.graph.inputs.remove(v)  # read only by what was dropped (e.g. the loss's labels)
    out = modelio.DetachedModel(ir.to_proto(ir_model), {})
    out.check()
    out.save(output_path)
    return str(output_path)


def _output_values(graph: ir.Graph, values: list[ir.Value]) -> list[ir.Value]:
    """Graph outputs for ``values``: a graph input or initializer asked for as an output, or a
    value asked for twice, goes through an Identity (an output must be produced by a node and
    appear once)."""
    outs = []
    for v in values:
        if v.is_graph_input() or v.is_initializer() or v in outs:
            node = ir.Node("", "Identity", [v], num_outputs=1)
            graph.append(node)
            node.outputs[0].name, node.outputs[0].dtype, node.outputs[0].shape = f"{v.name}_out", v.dtype, v.shape
            v = node.outputs[0]
        outs.append(v)
    return outs


def generate_artifacts(model, requires_grad: Sequence[str] | None = None, frozen_params: Sequence[str] = (),
                       loss: str | None = None, optimizer: str = "adamw", artifact_directory: str | os.PathLike = ".",
                       prefix: str = "", *, loss_output: str | None = None, target_name: str = "target",
                       optimizer_options: dict | None = None) -> dict[str, str]:
    """Write the training artifacts of ``model`` into ``artifact_directory``, as onnxruntime's
    ``generate_artifacts`` does, every one loadable by stock onnxruntime:

    - ``training_model.onnx``: forward + loss + gradients; outputs ``loss`` then ``W_grad``,
      then ``B.updated`` for each running statistic ``B`` (BatchNormalization buffers: inputs
      of the model, in the checkpoint, updated by each training run, never trained).
    - ``eval_model.onnx``: forward + loss, in inference mode (running statistics, no dropout).
    - ``optimizer_model.onnx``: inputs ``Learning_Rate``, ``Step``, every ``W``, ``W_grad`` and
      optimizer state ``W.<state>``; outputs ``W.updated``, ``W.<state>.updated``, ``Step.updated``.
    - ``checkpoint.npz``: the weights, the running statistics, the initial optimizer states and
      ``Step`` (numpy's npz,
      read with ``numpy.load(path, allow_pickle=False)``: no pickled objects).

    ``loss`` appends a loss block (crossentropy, nll, mse, l1, bcewithlogits) to the output
    ``loss_output`` (default: the model's first output), reading a new input ``target_name``;
    without it the model's first output is the loss. ``requires_grad`` defaults to every float
    initializer not in ``frozen_params``. Nothing is written unless every artifact builds.
    """
    import tempfile
    from pathlib import Path

    from .builder import GradientGraphBuilder, float_initializers
    from .passes.loss import append_loss
    from .passes.optimizer import resolve

    proto = modelio.load_proto(model)
    if loss is not None:
        output = loss_output or proto.graph.output[0].name
        proto = append_loss(proto, loss, output, target_name=target_name, loss_name="loss")
        loss_name = "loss"
    else:
        loss_name = proto.graph.output[0].name
    buffers = buffers_of(proto)
    weights = list(requires_grad) if requires_grad is not None else [w for w in float_initializers(proto)
                                                                       if w not in buffers]
    weights = [w for w in weights if w not in set(frozen_params)]
    options = resolve(optimizer, optimizer_options)
    training = GradientGraphBuilder(proto, weights, [loss_name], loss_name, running_statistics=True).build()
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    optimizer_model = optimizer_only_model({w: inits[w] for w in weights}, optimizer, options)
    state = {"Step": np.array(0, np.int64), **{b: inits[b] for b in buffers}}
    for w in weights:
        state[w] = inits[w]
        for s, value in initial_state(optimizer, options, inits[w]).items():
            state[f"{w}.{s}"] = value

    directory = Path(artifact_directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = {k: f"{prefix}{k}" for k in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx",
                                          "checkpoint.npz")}
    tmp = Path(tempfile.mkdtemp(prefix=".gradbuilder-", dir=directory))
    try:
        training.save(tmp / names["training_model.onnx"])
        onnx.save(inference_form(proto), tmp / names["eval_model.onnx"])
        onnx.save(optimizer_model, tmp / names["optimizer_model.onnx"])
        np.savez(tmp / names["checkpoint.npz"], **state)
        written = {}
        for key, name in names.items():
            os.replace(tmp / name, directory / name)
            written[key] = str(directory / name)
        return written
    finally:
        for leftover in tmp.glob("*"):
            leftover.unlink()
        tmp.rmdir()
