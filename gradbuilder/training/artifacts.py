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

from .. import compat, files, tensorfiles
from ..compiler import modelio
from ..errors import InvalidArgumentError
from ..compiler.passes.cleanup import remove_unused_nodes
from .stages.optimizer import initial_states
from ..compiler.passes.running_stats import inference_form
from .graph import optimizer_only_model
from ..interface import STEP, state_of
from ..compiler.detached import DetachedModel


def export_model_for_inferencing(model, output_path: str | os.PathLike, output_names: Sequence[str],
                                 weights: Mapping[str, np.ndarray] | None = None, base_dir=None) -> str:
    """Write ``model`` (forward graph: bytes, path or ModelProto, never modified) to
    ``output_path`` with the initializers (or float Constant nodes) in ``weights`` replaced by
    the given (trained) values and only ``output_names`` as outputs; nodes those outputs do not
    need are removed. The model is written in inference mode (``passes.running_stats.inference_form``:
    BatchNormalization reads its running statistics, Dropout passes through), so each output
    depends on its own sample only. The write is atomic. ``base_dir``: where the model's
    external data files are (default: the folder of the model's path)."""
    files.check_output_path(output_path, what="inference model")  # before any work
    files.check_not_the_input(output_path, model, InvalidArgumentError, "inference model")
    out = inference_model(model, output_names, weights, base_dir)
    out.check()
    out.save(output_path)
    return str(output_path)


def inference_model(model, output_names: Sequence[str], weights: Mapping[str, np.ndarray] | None = None,
                    base_dir=None) -> DetachedModel:
    """What :func:`export_model_for_inferencing` writes, its large tensors kept apart (never
    in one protobuf: a model over 2 GB is written with external data)."""
    proto, large = modelio.load_detached(model, base_dir, list(weights or {}))
    compat.check_for_runtime(proto)
    proto = inference_form(proto)
    inits = {t.name: t for t in proto.graph.initializer}
    for name, value in (weights or {}).items():
        if name not in inits:
            raise InvalidArgumentError(f"weights: the model has no initializer named '{name}' (nor a float Constant "
                                       "output of that name)")
        old = inits[name]
        value = np.asarray(value)
        if list(value.shape) != list(old.dims):
            raise InvalidArgumentError(
                f"weights: '{name}' has shape {list(value.shape)}, the model's initializer {list(old.dims)}")
        large[name] = value.astype(onnx.helper.tensor_dtype_to_np_dtype(old.data_type), copy=False)
        old.CopyFrom(onnx.TensorProto(name=name, data_type=old.data_type, dims=old.dims))  # its value: in large
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
    return DetachedModel(ir.to_proto(ir_model), large)


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


def plain_optimizer(name) -> str:
    """``name`` as TrainingParameters reads it (case-insensitive; onnxruntime-training's
    SGDOptimizer, AdamOptimizer and LambOptimizer too) as our plain optimizer name."""
    from .params import TrainingParameters

    plain = TrainingParameters(training_optimizer_name=name).optimizer_name()
    if plain is None:
        raise InvalidArgumentError("optimizer is empty; name one, e.g. 'adamw' or 'AdamOptimizer'")
    return plain


def generate_artifacts(model, requires_grad: Sequence[str] | None = None, frozen_params: Sequence[str] = (),
                       loss: str | None = None, optimizer: str = "adamw", artifact_directory: str | os.PathLike = ".",
                       prefix: str = "", *, loss_output: str | None = None, target_name: str = "target",
                       optimizer_options: dict | None = None, base_dir=None,
                       allow_inference_export: bool = False) -> dict[str, str]:
    """Write the training artifacts of ``model`` into ``artifact_directory``, as onnxruntime's
    ``generate_artifacts`` does, every one loadable by stock onnxruntime:

    - ``training_model.onnx``: forward + loss + gradients; outputs ``loss`` then ``W_grad``,
      then ``B.updated`` for each running statistic ``B`` (BatchNormalization buffers: inputs
      of the model, in the checkpoint, updated by each training run, never trained).
    - ``eval_model.onnx``: forward + loss, in inference mode (running statistics, no dropout).
    - ``optimizer_model.onnx``: inputs ``Learning_Rate``, ``Step``, every ``W``, ``W_grad`` and
      optimizer state ``W.<state>``; outputs ``W.updated``, ``W.<state>.updated``, ``Step.updated``.
    - ``checkpoint.safetensors``: the weights, the running statistics, the initial optimizer
      states and ``Step`` (safetensors: ``safetensors.numpy.load_file`` in Python, a JSON header
      and raw little-endian tensors anywhere else).

    ``loss`` appends a loss block (crossentropy, nll, mse, l1, bcewithlogits) to the output
    ``loss_output`` (default: the model's first output), reading a new input ``target_name``;
    without it the model's first output is the loss. ``requires_grad`` defaults to every float
    initializer not in ``frozen_params`` (a model without any: its float Constant tensors, which
    requires_grad may name too). Nothing is written unless every artifact builds.
    ``base_dir``: where the model's external data files are (default: the folder of its path).
    A PyTorch export optimized for inference is refused unless ``allow_inference_export``.
    """
    from ..compiler.builder import GradientGraphBuilder
    from .loaded import LossBlock, load
    from .stages.optimizer import resolve

    optimizer = plain_optimizer(optimizer)
    names = {k: f"{prefix}{k}" for k in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx",
                                          "checkpoint.safetensors")}
    directory = check_artifact_paths(artifact_directory, names, model)
    loaded = load(model, _parameters(requires_grad, frozen_params, allow_inference_export), base_dir,
                  loss=LossBlock(loss, loss_output, target_name) if loss is not None else None,
                  weights=_requires_grad(requires_grad, frozen_params), option="requires_grad")
    proto, large, weights, buffers, values = loaded.proto, loaded.large, loaded.weights, loaded.buffers, loaded.values
    options = resolve(optimizer, optimizer_options)
    training = GradientGraphBuilder(loaded.detached(), weights, [loaded.loss], loaded.loss,
                                    running_statistics=True, warn_about_model=False)  # load said it
    training.build()
    optimizer_model = optimizer_only_model({w: values[w] for w in weights}, optimizer, options)

    checkpoint = {STEP: np.array(0, np.int64), **{b: values[b] for b in buffers}}
    for w in weights:  # an optimizer state is a broadcast fill, made whole only as it is written
        checkpoint[w] = values[w]
        checkpoint.update((state_of(w, s), np.broadcast_to(fill, np.shape(values[w])))
                          for s, fill in initial_states(optimizer, options, np.zeros((), values[w].dtype)))

    parameters = [*weights, *buffers]
    models = {"training_model.onnx": _fed(training.built_model(), parameters),
              "eval_model.onnx": _fed(DetachedModel(inference_form(proto), large), parameters),
              "optimizer_model.onnx": DetachedModel(optimizer_model, {})}
    for m in models.values():  # loadable by older runtimes too (onnxruntime-node, -web, mobile)
        compat.stamp_lowest_ir_version(m.skeleton)
    data = {key: names[key] + ".data" for key, m in models.items() if m.uses_external_data()}  # over 2 GB
    keys = list(data.values()) + list(names)
    with files.output_directory(directory, what="artifact directory"), \
            files.atomic_write(*(directory / names.get(k, k) for k in keys), what="artifacts") as temps:
        tmp = dict(zip(keys, temps))
        for key, m in models.items():
            m.write(tmp[key], tmp.get(data.get(key)), data.get(key))
        with open(tmp["checkpoint.safetensors"], "wb") as f:
            tensorfiles.write(f, checkpoint)
    return {key: str(directory / name) for key, name in names.items()}


def _fed(model: DetachedModel, parameters: Sequence[str]) -> DetachedModel:
    """``model`` with ``parameters`` as graph inputs without initializers: a loop feeds them
    from the checkpoint (as onnxruntime-training's models read them from its checkpoint state),
    the eval model takes the trained ones, and onnxruntime has no initializer-and-input to warn
    about on load."""
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(model.skeleton)
    modelio.weights_as_inputs(skeleton, parameters)
    return DetachedModel(skeleton, model.weights)


def check_artifact_paths(artifact_directory, names: dict[str, str], model=None):
    """The artifact directory as a Path, once it is known the artifacts can be written there,
    none of them over the input ``model`` (before anything is built)."""
    directory = files.check_output_directory(artifact_directory, what="artifact directory")
    if directory.is_dir():
        for name in names.values():
            files.check_output_path(directory / name, what="artifact", probe=False)
            files.check_not_the_input(directory / name, model, InvalidArgumentError, "artifact")
    return directory


def _parameters(requires_grad, frozen_params, allow_inference_export: bool):
    """The TrainingParameters that choose generate_artifacts' weights by default: every float
    initializer that is not a running statistic, less ``frozen_params``."""
    from .params import TrainingParameters

    if isinstance(requires_grad, str):
        raise InvalidArgumentError(f"requires_grad is a list of names, not the string {requires_grad!r}")
    params = TrainingParameters(allow_inference_export=allow_inference_export)
    if frozen_params:
        params.weights_not_to_train = list(frozen_params)
    return params


def _requires_grad(requires_grad, frozen_params) -> list[str] | None:
    """The weights named, in their order, less the frozen ones (None: the default choice)."""
    if requires_grad is None:
        return None
    return [w for w in requires_grad if w not in set(frozen_params)]
