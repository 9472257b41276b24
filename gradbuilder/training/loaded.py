"""A model read once for training. :func:`load` reads it (its large tensors apart, never in one
protobuf), checks it, appends the loss block asked for, picks the weights, lifts the Constant
nodes holding weights into initializers, and reads the values of the weights and running
statistics; :class:`LoadedModel` carries all of it. TrainingSession, generate_artifacts,
export_web and the command line each take this one value, so a model is read, and its
weights chosen, by one rule in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from .. import compat
from ..compiler import modelio
from ..compiler.detached import DetachedModel
from ..compiler.passes.running_stats import buffers_of
from ..dtypes import FLOAT_TENSOR_TYPES
from ..errors import InvalidArgumentError


@dataclass(frozen=True)
class LossBlock:
    """A loss appended to the model: ``kind`` (crossentropy, nll, mse, l1, bcewithlogits) of the
    output ``output`` (default: the model's first) against the new input ``target``, as the
    value ``name``."""

    kind: str
    output: str | None = None
    target: str = "target"
    name: str = "loss"


@dataclass
class LoadedModel:
    """A model read once (:func:`load`).

    ``proto``: a private skeleton (the caller's model is never touched), with the loss block
    appended and the Constant nodes that hold weights lifted to initializers; ``large``: its
    tensors kept apart as arrays (over 2 GB, external data; shared with ``values``, not copied); ``loss``: the loss value;
    ``weights``: the weights trained, in order; ``buffers``: the running statistics (updated by
    training, not trained); ``values``: the arrays of the weights and running statistics."""

    proto: onnx.ModelProto
    large: dict[str, np.ndarray]
    loss: str
    weights: list[str]
    buffers: list[str]
    values: dict[str, np.ndarray]

    @property
    def frozen(self) -> list[str]:
        """The float initializers neither trained nor running statistics."""
        return [t.name for t in self.proto.graph.initializer
                if t.name not in self.values and t.data_type in FLOAT_TENSOR_TYPES]

    def detached(self) -> DetachedModel:
        """The model with its large tensors, ready to build or write (no copy of them)."""
        return DetachedModel(self.proto, self.large)


def load(model, params, base_dir=None, *, loss: LossBlock | None = None, weights: Sequence[str] | None = None,
         strict: bool = False, option: str = "TrainingParameters.weights_to_train",
         check: Callable[[onnx.ModelProto], None] | None = None) -> LoadedModel:
    """``model`` (bytes, path, ModelProto, DetachedModel, ...; external data from ``base_dir``,
    default the folder of its path) read once for training with the TrainingParameters
    ``params``: checked (runnable by the installed onnxruntime; ``strict``: its IR and opsets
    too; a PyTorch export optimized for inference refused unless
    ``params.allow_inference_export``), ``loss`` appended (else the loss is
    ``params.loss_output_name``, or the model's first output), and its weights: ``weights`` in
    the order given (named in errors as ``option``), else :func:`graph.weights_of`'s choice.
    Every weight and running statistic must have an initial value. ``check``, when given, is
    called with the model (its loss appended) before its weights are chosen: a caller's own
    checks of the names it was given."""
    from ..compiler.tied_exports import warn_merged_parameters
    from ..compiler.torch_exports import check_inference_export
    from .graph import weights_of
    from .loss import append_loss

    proto, large = modelio.load_detached(model, base_dir)
    compat.check_for_runtime(proto, strict=strict)
    check_inference_export(proto, params.allow_inference_export)
    warn_merged_parameters(proto)
    if loss is not None:
        proto = append_loss(proto, loss.kind, loss.output or proto.graph.output[0].name, target_name=loss.target,
                            loss_name=loss.name)
        name = loss.name
    else:
        name = params.loss_output_name or proto.graph.output[0].name
    if check is not None:
        check(proto)
    buffers = buffers_of(proto)
    chosen = list(weights) if weights is not None else weights_of(proto, params)
    modelio.lift_constants(proto, chosen)  # weights held in Constant nodes (paddle2onnx, spox)
    _check_weights(proto, chosen, buffers, option)
    inits = {t.name: t for t in proto.graph.initializer}
    no_value = [b for b in buffers if b not in inits]
    if no_value:
        raise InvalidArgumentError(f"the running statistics {no_value} are graph inputs without an initializer; "
                                   "give them initial values as initializers")
    values = {n: large[n] if n in large else numpy_helper.to_array(inits[n]) for n in [*chosen, *buffers]}
    return LoadedModel(proto, large, name, chosen, buffers, values)


def _check_weights(proto: onnx.ModelProto, weights: Sequence[str], buffers: Sequence[str], option: str) -> None:
    """Every weight is an initializer: its value starts the training."""
    inits = {t.name for t in proto.graph.initializer}
    inputs = {i.name for i in proto.graph.input}
    values = inits | inputs | {o for n in proto.graph.node for o in n.output}
    for w in weights:
        if w in buffers:
            raise InvalidArgumentError(f"{option}: '{w}' is a BatchNormalization running statistic, which the "
                                       "training step updates as a buffer; it is not trained: leave it out")
        if w in inits:
            continue
        if w in inputs:
            raise InvalidArgumentError(f"{option}: '{w}' is a graph input without an initializer; a weight starts from "
                                       "its initial value, so give it one as an initializer, or leave it out")
        if w in values:
            raise InvalidArgumentError(f"{option}: '{w}' is computed by a node of the model; weights must be "
                                       "initializers or float Constant outputs")
        raise InvalidArgumentError(f"{option}: the model has no initializer named '{w}' (its initializers: "
                                   f"{sorted(inits)[:8]}{' ...' if len(inits) > 8 else ''})")
