"""Training artifacts for JavaScript: what ``gradbuilder-train.mjs`` (shipped in
``gradbuilder/web``) needs to train a model with stock onnxruntime-web or onnxruntime-node.

``export_web(model, directory, ...)`` writes:

- ``training_model.onnx``: one step (forward, backward, optimizer) of the graph interface of
  ``training.graph`` (state inputs ``X`` with outputs ``X.updated``, ``Learning_Rate``), the
  weights and running statistics as inputs without initializers (the state file holds them);
- ``eval_model.onnx``: the forward in inference form, reading the same state inputs;
- ``inference_model.onnx`` and ``inference_model.onnx.data``: the model for inference, its
  initializers in the data file (ONNX external data; those under 1 KiB that are not trained stay
  in the model) at offsets the manifest lists, so that a program writes the trained weights
  into a copy of the data file without an ONNX writer;
- ``state.safetensors``: the initial state (weights, optimizer states, ``Step``, running
  statistics): safetensors, a JSON header and raw little-endian tensors, read in a few lines;
- ``manifest.json``: what each graph reads and returns, the state pairs, the loss, the
  learning-rate input and the inference model's weights.

The models are stamped with the lowest IR version that holds them, so that older runtimes
(onnxruntime-web in a browser) load them too.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from .. import compat, files, tensorfiles
from ..compiler import modelio
from ..errors import InvalidArgumentError
from ..interface import ALL_FINITE, LEARNING_RATE, STEP, updated
from .stages.optimizer import jsonable
from ..compiler.detached import DetachedModel

FORMAT = "gradbuilder-web/1"
NAMES = ("training_model.onnx", "eval_model.onnx", "inference_model.onnx", "inference_model.onnx.data",
         "state.safetensors", "manifest.json")
# the element types gradbuilder-train.mjs reads from safetensors and gives onnxruntime's Tensor
JS_DTYPES = ("float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool")


def export_web(model, directory: str | os.PathLike, *, loss: str | None = None, loss_output: str | None = None,
               target_name: str = "target", optimizer: str = "adamw", optimizer_options: dict | None = None,
               lr: float = 1e-3, requires_grad: Sequence[str] | None = None, frozen_params: Sequence[str] = (),
               max_grad_norm: float | None = None, base_dir=None,
               allow_inference_export: bool = False) -> dict[str, str]:
    """Write the JavaScript training artifacts of ``model`` (bytes, path or ModelProto, never
    modified) into ``directory`` (see the module docstring); returns {name: path}. ``loss``
    appends a loss block (crossentropy, nll, mse, l1, bcewithlogits, causal_lm) to
    ``loss_output`` reading the new input ``target_name``; without it the model's first output
    is the loss. Graph inputs with initializer defaults that are trained (``add_lora``'s
    adapter) become state like the other weights; a decoder's int64 and zero-length
    past-key/value inputs are fed as they are.
    ``lr`` is the learning rate the manifest starts with. Nothing is written unless every
    artifact builds. A PyTorch export optimized for inference is refused unless
    ``allow_inference_export``."""
    from .artifacts import check_artifact_paths, plain_optimizer
    from .graph import eval_model, from_parameters, state_interface
    from .loaded import LossBlock, load
    from .params import TrainingParameters

    if not (isinstance(lr, (int, float)) and np.isfinite(lr) and lr >= 0):
        raise InvalidArgumentError(f"lr must be a finite number >= 0, got {lr!r}")
    plain = plain_optimizer(optimizer)
    directory = check_artifact_paths(directory, {n: n for n in NAMES}, model)
    params = TrainingParameters(training_optimizer_name=plain, enable_grad_norm_clip=max_grad_norm is not None,
                                allow_inference_export=allow_inference_export)
    if requires_grad is not None:
        if isinstance(requires_grad, str):
            raise InvalidArgumentError(f"requires_grad is a list of names, not the string {requires_grad!r}")
        params.weights_to_train = list(requires_grad)
    if frozen_params:
        params.weights_not_to_train = list(frozen_params)
    loaded = load(model, params, base_dir, loss=LossBlock(loss, loss_output, target_name) if loss is not None else None)
    proto, large, weights, buffers, loss_name = loaded.proto, loaded.large, loaded.weights, loaded.buffers, loaded.loss
    params.loss_output_name = loss_name
    attributes = dict(optimizer_options or {})
    if max_grad_norm is not None:
        attributes["max_norm_clip"] = max_grad_norm
    if attributes:
        params.optimizer_attributes_map = {w: attributes for w in weights}
    builder = from_parameters(loaded.detached(), params, weights=weights, warn_about_model=False)
    state = {**builder.initial_state({w: loaded.values[w] for w in weights}), **loaded.values}

    graphs = []
    for m in (builder.build().built_model().skeleton, eval_model(proto)):
        modelio.weights_as_inputs(m, weights + buffers)  # fed from the state
        graphs.append(DetachedModel(m, large).to_proto())  # with the frozen parameters' values
    training, evaluation = graphs
    pairs = state_interface(training)
    keep = [o.name for o in proto.graph.output if o.name != loss_name] or [loss_name]
    for m in (training, evaluation):
        compat.stamp_lowest_ir_version(m)

    manifest = {
        "format": FORMAT,
        "loss": loss_name,
        "learning_rate": {"input": LEARNING_RATE, "value": float(lr)},
        "step": STEP,
        "all_finite": ALL_FINITE,
        "optimizer": {"name": builder.optimizer, "options": jsonable(builder.optimizer_options),
                      "max_grad_norm": max_grad_norm},
        "state": [{"input": i, "output": o, **_spec(state[i])} for i, o in pairs],
        "training": _signature(training, {i for i, _ in pairs} | {LEARNING_RATE}),
        "eval": _signature(evaluation, set(weights) | set(buffers)),
        "weights": list(weights),
        "buffers": list(buffers),
    }
    with files.output_directory(directory, what="artifact directory"), \
            files.atomic_write(*(directory / n for n in NAMES), what="web artifacts") as temps:
        tmp = dict(zip(NAMES, temps))
        onnx.save(training, tmp["training_model.onnx"])
        onnx.save(evaluation, tmp["eval_model.onnx"])
        manifest["inference"] = _inference(DetachedModel(proto, large), keep, tmp["inference_model.onnx"],
                                           tmp["inference_model.onnx.data"], set(weights) | set(buffers))
        with open(tmp["state.safetensors"], "wb") as f:
            tensorfiles.write(f, {n: state[n] for n, _ in pairs})
        with open(tmp["manifest.json"], "w") as f:
            json.dump(manifest, f, indent=1)
    return {n: str(directory / n) for n in NAMES}


def _spec(value) -> dict:
    a = np.asarray(value)
    if a.dtype.name not in JS_DTYPES:
        raise InvalidArgumentError(f"a {a.dtype.name} state tensor: gradbuilder-train.mjs reads {', '.join(JS_DTYPES)}; "
                                   "train the model in one of those")
    return {"dtype": a.dtype.name, "shape": list(a.shape)}


def _signature(proto: onnx.ModelProto, given: set[str]) -> dict:
    """The graph's data inputs (what a program feeds: not ``given``) and outputs."""
    def info(v):
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
        return {"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, "shape": dims}

    return {"inputs": [info(i) for i in proto.graph.input if i.name not in given],
            "outputs": [o.name for o in proto.graph.output if not o.name.endswith(updated(""))]}


def _inference(source: DetachedModel, keep: list[str], model_path, data_path, trained: set[str]) -> dict:
    """The inference model with its initializers in one external data file (but the small
    untrained ones, as onnx's external-data writer keeps them); the manifest's entry: the data
    file's name and where each trained tensor lies in it."""
    from .artifacts import inference_model

    detached = inference_model(source, keep)
    model = detached.skeleton
    detached.check()
    compat.stamp_lowest_ir_version(model)
    data_name = "inference_model.onnx.data"
    tensors, offset = [], 0
    with open(data_path, "wb") as data:
        for t in model.graph.initializer:
            value = detached.weights[t.name] if t.name in detached.weights else numpy_helper.to_array(t)
            raw = value.astype(value.dtype.newbyteorder("<")).tobytes()
            if t.name not in trained and t.name not in detached.weights and len(raw) < modelio.DETACH_BYTES:
                continue  # in the model: onnxruntime reads shape operands (a Pad's pads) while it loads
            pad = (-offset) % 64  # aligned, as onnx's external-data writer aligns large tensors
            data.write(b"\0" * pad)
            offset += pad
            data.write(raw)
            if t.name in trained:
                tensors.append({"name": t.name, "offset": offset, "length": len(raw), **_spec(value)})
            t.ClearField("raw_data")
            del t.external_data[:]
            for key, entry in (("location", data_name), ("offset", offset), ("length", len(raw))):
                t.external_data.add(key=key, value=str(entry))
            t.data_location = onnx.TensorProto.EXTERNAL
            for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
                t.ClearField(field)
            offset += len(raw)
    onnx.save(model, model_path)
    # what a program feeds: not the inputs with initializer defaults (add_lora's, their trained values in the data file)
    inputs = _signature(model, {t.name for t in model.graph.initializer})["inputs"]
    return {"model": "inference_model.onnx", "data": data_name, "outputs": keep, "tensors": tensors, "inputs": inputs}


def safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    """``tensors`` in the safetensors format (what ``safetensors.numpy.save`` writes; 0-d
    tensors included), in the given order."""
    from safetensors.numpy import save

    return save({n: np.array(v, order="C") for n, v in tensors.items()})  # (ascontiguousarray makes 0-d 1-d)

