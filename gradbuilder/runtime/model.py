"""What a session knows about its model, derived once: :func:`read_model` makes the session's
own model from the loaded one (``training.loaded``); :class:`ModelFacts` is the record
the session, its graph cache, its executors and its exports share (the model with its state as
inputs, the names of each kind of value, the weights' dtypes and shapes, the outputs and inputs
a step has, the class-index inputs of its losses, and the identity a checkpoint must match)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from ..compiler import modelio
from ..errors import InvalidArgumentError
from ..training.loaded import LoadedModel
from .state import Identity
from ..compiler.detached import DetachedModel

_CLASS_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")


@dataclass(frozen=True)
class ModelFacts:
    """The session's model and what it holds, derived once (:meth:`derive`).

    ``model``: the session's own copy; its weights and running statistics are graph inputs
    (their values live in the state only), its frozen parameters initializers, the values of
    the large ones in ``constants`` (their initializers in ``model`` hold no data). ``weights``
    (trained), ``buffers`` (running statistics: updated by training, not trained), ``frozen``
    (float initializers not trained), ``loss``, ``outputs`` (a step's: the model's, the loss
    first), ``inputs`` (the ones the caller feeds), ``specs`` (weight -> a zero-strided array of
    its dtype and shape: no memory), ``labels`` (class-index input -> (class count or None,
    ignore_index or None, the node that reads it)) and ``identity`` (what a checkpoint must
    match)."""

    model: onnx.ModelProto
    weights: list[str]
    buffers: list[str]
    frozen: list[str]
    loss: str
    outputs: list[str]
    inputs: list[str]
    specs: Mapping[str, np.ndarray]
    labels: Mapping[str, tuple[int | None, int | None, str]]
    identity: Identity
    constants: dict[str, np.ndarray]

    @classmethod
    def derive(cls, model: onnx.ModelProto, builder, buffers: list[str], frozen: list[str],
               values: Mapping[str, np.ndarray], constants: dict[str, np.ndarray]
               ) -> tuple["ModelFacts", dict[str, np.ndarray]]:
        """The facts of ``model`` (:func:`read_model`'s) trained by ``builder``, checked (the
        loss is a value of the model, every weight has a value), and the initial state: the
        optimizer's and ``values``."""
        weights, loss = list(builder.weights), builder.loss
        type_of = _types(model)
        _check_loss(model, loss, type_of)
        labels = _class_indices(model, type_of)
        initial = {**builder.initial_state(values), **values}
        fed = {t.name for t in model.graph.initializer} | set(weights) | set(buffers)
        facts = cls(model=model, weights=weights, buffers=buffers, frozen=frozen, loss=loss,
                    outputs=output_names(model, loss), inputs=[i.name for i in model.graph.input if i.name not in fed],
                    specs={w: np.broadcast_to(np.zeros((), values[w].dtype), values[w].shape) for w in weights},
                    labels=labels, identity=Identity.of(weights, initial, builder.optimizer), constants=constants)
        return facts, initial

    @property
    def state(self) -> list[str]:
        """The values that are graph inputs fed from the state: weights, then running statistics."""
        return self.weights + self.buffers

    def frozen_initializers(self) -> dict[str, onnx.TensorProto]:
        """{name: its initializer} of the frozen parameters (the graphs hold their values;
        those in ``constants`` hold dtype and shape only)."""
        return {t.name: t for t in self.model.graph.initializer if t.name in self.frozen}

    def frozen_value(self, name: str) -> np.ndarray:
        """The value of frozen parameter ``name``."""
        if name in self.constants:
            return self.constants[name]
        return numpy_helper.to_array(self.frozen_initializers()[name])

    def detached(self, model: onnx.ModelProto | None = None) -> DetachedModel:
        """``model`` (default: the session's) with the constants' values."""
        return DetachedModel(self.model if model is None else model, self.constants)


def read_model(loaded: LoadedModel):
    """The session's own model from ``loaded`` (:func:`training.loaded.load`'s): (model,
    frozen, constants). The weights' and running statistics' values stay in ``loaded.values``
    and leave the model, which keeps them as graph inputs of their types; frozen parameters
    stay its initializers, the large ones' values apart in ``constants`` (onnxruntime gets
    them as external initializers: no graph's bytes ever hold them)."""
    state = set(loaded.values)
    model = onnx.ModelProto()
    model.CopyFrom(loaded.proto)
    constants = {k: v for k, v in loaded.large.items() if k not in state}
    frozen = loaded.frozen
    modelio.weights_as_inputs(model, list(loaded.values))  # their values live in the state only
    return model, frozen, constants


def output_names(model: onnx.ModelProto, loss: str) -> list[str]:
    """A step's outputs: the model's, the loss first when it is not one of them."""
    names = [o.name for o in model.graph.output]
    return names if loss in names else [loss] + names


def _types(model: onnx.ModelProto):
    """``type_of(name)``: the type with a shape that ``model`` declares for a value, else the one
    onnx infers (inferred once, for the first value the model does not declare); None where
    neither knows its rank."""
    graph = model.graph
    known = {v.name: v.type for v in [*graph.input, *graph.value_info, *graph.output] if _shaped(v.type)}
    inferred = []

    def type_of(name: str) -> onnx.TypeProto | None:
        if name not in known and not inferred:
            inferred.append(True)
            try:
                g = onnx.shape_inference.infer_shapes(model).graph
            except Exception:  # noqa: BLE001 - a model onnx cannot infer: the build and onnxruntime say what they find
                return None
            known.update({v.name: v.type for v in [*g.value_info, *g.output] if v.name not in known and _shaped(v.type)})
        return known.get(name)

    return type_of


def _shaped(t: onnx.TypeProto) -> bool:
    return t.HasField("tensor_type") and t.tensor_type.HasField("shape")


def _check_loss(model: onnx.ModelProto, loss: str, type_of) -> None:
    graph = model.graph
    values = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    values |= {o for n in graph.node for o in n.output if o}
    if loss not in values:
        raise InvalidArgumentError(f"TrainingParameters.loss_output_name '{loss}' is not a value of the "
                                   f"model; its outputs are {[o.name for o in graph.output]}")
    t = type_of(loss)
    dims = None if t is None else [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                                   for d in t.tensor_type.shape.dim]
    if dims is not None and any(d != 1 for d in dims):
        raise InvalidArgumentError(f"loss '{loss}' has shape {dims}; the loss must be a scalar (shape [] or all ones). "
                                   "Reduce it first, e.g. with ReduceMean")


def _class_indices(model: onnx.ModelProto, type_of) -> dict[str, tuple[int | None, int | None, str]]:
    """The class-index inputs of the model's losses, so that a label out of range is refused
    before a run: {input: (class count or None, ignore_index or None, the node)}; ``type_of``
    is :func:`_types`'."""
    graph = model.graph
    labels: dict[str, tuple[int | None, int | None, str]] = {}
    inputs = {i.name for i in graph.input}
    losses = [n for n in graph.node if n.op_type in _CLASS_LOSSES and n.domain in ("", "ai.onnx")
              and len(n.input) > 1 and n.input[1] in inputs]
    for n in losses:
        t = type_of(n.input[0])  # none known: no class count, onnxruntime checks at run time
        dims = t.tensor_type.shape.dim if t is not None else []
        classes = dims[1].dim_value if len(dims) > 1 and dims[1].HasField("dim_value") else None
        ignore = next((a.i for a in n.attribute if a.name == "ignore_index"), None)
        labels[n.input[1]] = (classes, ignore, f"node '{n.name}' ({n.op_type})")
    return labels


def check_labels(labels: Mapping[str, tuple], name: str, value) -> None:
    """Refuse class indices out of range for the loss that reads input ``name`` (``labels``:
    :attr:`ModelFacts.labels`)."""
    if name not in labels:
        return
    classes, ignore, node = labels[name]
    indices = np.asarray(value.numpy() if isinstance(value, ort.OrtValue) else value)
    if indices.dtype.kind not in "iu":
        return  # onnxruntime refuses the type
    bad = (indices < 0) if classes is None else ((indices < 0) | (indices >= classes))
    if ignore is not None:
        bad &= indices != ignore
    if bad.any():
        first = indices[bad].flat[0]
        allowed = f"0..{classes - 1}" if classes is not None else ">= 0"
        raise InvalidArgumentError(f"input '{name}': class index {first} is out of range for {node}, which takes "
                                   f"{allowed}" + (f" or ignore_index {ignore}" if ignore is not None else ""))
