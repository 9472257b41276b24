"""GradientGraphBuilder: load -> differentiate -> passes -> serialize."""

from __future__ import annotations

import os
import time
from typing import Iterable, NamedTuple, Sequence

import onnx
import onnx_ir as ir

from .. import compat
from ..dtypes import FLOAT_TENSOR_TYPES
from ..errors import InvalidArgumentError, InvalidModelError, OutputError
from ..interface import GRADIENT, updated
from . import modelio, pipeline
from .autodiff import differentiate
from .passes import guarded, named_output
from .values import FLOAT_TYPES, dims_of
from .emitter import Emitter
from .detached import DetachedModel

KEYWORD_FORM = "GradientGraphBuilder(model, weights=[...], outputs=[...], loss='...')"


class Appended(NamedTuple):
    """What a graph built on the gradients (the training graph) appends after them: graph
    inputs, graph outputs, and ``keep``, a bool scalar under which the running statistics take
    their new values (None: always)."""

    inputs: Sequence[ir.Value] = ()
    outputs: Sequence[ir.Value] = ()
    keep: ir.Value | None = None


class GradientGraphBuilder:
    """Builds the gradient graph of ``loss`` with respect to ``weights``.

    >>> b = GradientGraphBuilder(model, weights=["W", "B"], outputs=["loss"], loss="loss").build()
    >>> b.save("model_with_grads.onnx")

    ``model`` is bytes, a path, an ``onnx.ModelProto`` or an ``onnx_graphsurgeon.Graph`` (never
    modified); tensors in external data files are read from ``base_dir`` (default: the folder
    of the model's path). The written graph
    has the requested ``outputs`` first, then one output ``<weight>_grad`` per weight, same
    shape and dtype as the weight (``gradient_suffix`` changes ``_grad``, e.g. to
    differentiate a gradient graph again). Trainable initializers also become graph inputs, the
    initializer kept as their default value.

    ``warn_about_model`` (default True): ``build()`` checks the model (an inference-optimized
    PyTorch export, which would train another model, is refused unless
    ``allow_inference_export``; merged parameters, an opset or IR version onnxruntime cannot
    run are warned about); False for a graph built for a caller that already did (a session).
    """

    def __init__(
        self,
        model,
        weights: Iterable[str] | None = None,
        outputs: Iterable[str] | None = None,
        loss: str | None = None,
        *,
        stop_gradients: Iterable[str] = (),
        gradient_suffix: str = GRADIENT,
        mixed_precision: str | None = None,
        cast_propagation: tuple[int, Iterable[str]] = (1, ()),
        recompute=None,
        memory_efficient_gradient: bool = False,
        deterministic: bool = False,
        running_statistics: bool = False,
        base_dir: str | os.PathLike | None = None,
        warn_about_model: bool = True,
        allow_inference_export: bool = False,
    ):
        if weights is None or loss is None:
            raise InvalidArgumentError(f"weights and loss are required: {KEYWORD_FORM}")
        if isinstance(weights, str) or isinstance(outputs, str):
            raise InvalidArgumentError(
                f"weights and outputs are lists of names, not a single string: {KEYWORD_FORM}"
            )
        if not isinstance(loss, str):
            raise InvalidArgumentError(f"loss is the name of one value, got {loss!r}: {KEYWORD_FORM}")
        self._source = model
        self.base_dir = base_dir
        self.weights = list(weights)
        self.outputs = list(outputs) if outputs is not None else [loss]
        self.loss = loss
        self.stop_gradients = list(stop_gradients)
        self.gradient_suffix = gradient_suffix
        if mixed_precision not in (None, "float16", "bfloat16"):
            raise InvalidArgumentError(f"mixed_precision is None, 'float16' or 'bfloat16', got {mixed_precision!r}")
        self.mixed_precision = mixed_precision
        self.cast_propagation = (int(cast_propagation[0]), list(cast_propagation[1]))
        self.recompute = recompute  # a passes.recompute.RecomputeOptions, or None
        self.recompute_report = None
        self.memory_efficient_gradient = bool(memory_efficient_gradient)
        self.deterministic = bool(deterministic)  # no scatter whose sums vary between runs (CUDA's atomics)
        self.running_statistics = bool(running_statistics)
        self.warn_about_model = bool(warn_about_model)
        self.allow_inference_export = bool(allow_inference_export)
        self.buffers: list[str] = []
        self.unreached_weights: list[str] = []
        self.timings: dict[str, float] = {}
        # Sizes for the graph inputs' unknown dims ({input: shape}): a graph built for those
        # shapes only, every shape computation folded away.
        self.input_shapes: dict[str, list[int]] = {}
        self._result: DetachedModel | None = None

    # ----------------------------------------------------------------------------- build
    def build(self) -> "GradientGraphBuilder":
        with pipeline.cyclic_collection_paused():
            return self._build()

    def _build(self) -> "GradientGraphBuilder":
        t0 = time.perf_counter()
        proto, weights_bytes = modelio.load_detached(self._source, self.base_dir, self.weights)
        if self.input_shapes:
            modelio.fix_input_shapes(proto.graph, self.input_shapes)
        if not self.weights:
            raise InvalidArgumentError(f"weights is empty: {nothing_to_train(proto.graph)}")
        if self.warn_about_model:
            from .tied_exports import warn_merged_parameters
            from .torch_exports import check_inference_export

            check_inference_export(proto, self.allow_inference_export)
            warn_merged_parameters(proto)
        model = pipeline.load(proto, self.weights + self.stop_gradients, quiet=not self.warn_about_model)
        del proto
        t1 = time.perf_counter()
        self._differentiate(model)
        t2 = time.perf_counter()
        _drop_inner_types(model.graph)
        out = DetachedModel(ir.to_proto(model), weights_bytes)
        del model
        pipeline.release()
        out.check()
        self._result = out
        t3 = time.perf_counter()
        self.timings = {"load": t1 - t0, "differentiate": t2 - t1, "serialize": t3 - t2}
        return self

    def _differentiate(self, model: ir.Model) -> None:
        """Append the backward graph to ``model`` and set its inputs and outputs."""
        graph = model.graph
        values = pipeline.values_by_name(graph)
        weights, outputs, loss = self._resolve(graph, values)
        _require_ranks(graph.inputs, outputs)
        stops = frozenset(values[n] for n in self._names_exist(self.stop_gradients, values, "stop_gradients"))
        ctx = pipeline.Context.of(
            model, wrt=weights, running_statistics=self.running_statistics,
            unbiased_variance=model.producer_name == "pytorch", mixed_precision=self.mixed_precision,
            cast_propagation=self.cast_propagation, recompute=self.recompute, deterministic=self.deterministic)
        names = [v.name for v in outputs], loss.name, [v.name for v in stops]
        pipeline.run(pipeline.PREPARE, model, ctx)
        # A pass that replaces a value (a max's output, gathered at its indices) gives the new
        # value its name: the outputs and the loss are looked up again by name.
        values = pipeline.values_by_name(graph)
        outputs, loss, stops = [values[n] for n in names[0]], values[names[1]], frozenset(values[n] for n in names[2])
        buffers = self._take_buffers(graph, weights, ctx.buffers)
        e = ctx.emitter
        ctx.forward = list(graph)
        seed, seeded = self._loss_to_differentiate(e, loss)
        result = differentiate(graph, weights, seed, e, stop_gradients=stops, eager_sums=self.memory_efficient_gradient)
        if result.unreached:
            self.unreached_weights = result.unreached
            compat.warn("these weights do not reach the loss and get a zero gradient: " + ", ".join(result.unreached))
        grad_outputs = pipeline.name_gradients(e, weights, result.grads, self.gradient_suffix)
        for w in weights:
            if w.is_initializer() and not w.is_graph_input():
                graph.inputs.append(w)
        appended = self._after_gradients(e, weights, dict(zip([w.name for w in weights], grad_outputs)), loss, seeded)
        buffer_outputs = [named_output(e, guarded(e, appended.keep, new, old), updated(old.name), old)
                          for old, new in buffers]
        graph.inputs.extend(appended.inputs)
        graph.outputs.clear()
        graph.outputs.extend(outputs + (grad_outputs if self._gradients_as_outputs() else []) + list(appended.outputs)
                             + buffer_outputs)
        with compat.warnings_at_caller():
            pipeline.run(pipeline.FINISH, model, ctx)
        self.recompute_report = ctx.reports.get("recompute")

    def _take_buffers(self, graph: ir.Graph, weights, updates) -> list[tuple[ir.Value, ir.Value]]:
        """The running statistics the pipeline exposed (``passes.running_stats``), as (buffer,
        new value); each buffer becomes a graph input (its initializer kept as the default),
        as the weights do."""
        self.buffers = [old.name for old, _ in updates]
        trained = sorted({w.name for w in weights} & set(self.buffers))
        if trained:
            raise InvalidArgumentError(
                f"{trained} are BatchNormalization running statistics: buffers the training step updates, "
                "not weights to train; remove them from the weights")
        for old, _ in updates:
            if not old.is_graph_input():
                graph.inputs.append(old)
        return updates

    # Hooks for graphs built on the gradients (the training graph), called in this order with
    # what the one before returned: the value the backward starts from, then what is appended
    # after the gradients; and whether the gradients stay outputs.
    def _loss_to_differentiate(self, e: Emitter, loss: ir.Value) -> tuple[ir.Value, object]:
        """The value whose gradient seeds the backward, and what ``_after_gradients`` is given
        about it (the training graph scales the loss: the scaled loss and its scale)."""
        return loss, None

    def _after_gradients(self, e: Emitter, weights: list[ir.Value], grads: dict[str, ir.Value],
                         loss: ir.Value, seeded: object) -> Appended:
        """What to append after the gradients ``grads`` (weight name -> gradient) of ``loss``;
        ``seeded``: the second value ``_loss_to_differentiate`` returned."""
        return Appended()

    def _gradients_as_outputs(self) -> bool:
        return True

    def _names_exist(self, names, values, what):
        for n in names:
            if n not in values:
                raise InvalidArgumentError(f"{what}: no value named '{n}' in the model")
        return names

    def _resolve(self, graph: ir.Graph, values: dict[str, ir.Value]):
        produced = {n: v for n, v in values.items() if v.producer() is not None}
        initializers = set(graph.initializers)
        looks_swapped = (
            any(n in produced or n == self.loss for n in self.weights)
            and any(n in initializers for n in self.outputs)
        )
        if looks_swapped:
            raise InvalidArgumentError(
                "the weights and outputs look swapped: weights "
                f"{self.weights} holds values computed by the model and outputs {self.outputs} holds "
                "initializers. gradbuilder takes (model, weights, outputs, loss), onnxruntime-training "
                f"(model, outputs, weights, loss); use the keyword form: {KEYWORD_FORM}"
            )
        if len(set(self.weights)) != len(self.weights):
            raise InvalidArgumentError(f"weights lists a name twice: {self.weights}")
        self._names_exist(self.weights, values, "weights")
        self._names_exist(self.outputs, values, "outputs")
        self._names_exist([self.loss], values, "loss")
        weights = []
        for name in self.weights:
            v = values[name]
            if name in produced:
                raise InvalidArgumentError(
                    f"weight '{name}' is computed by node '{v.producer().name}' "
                    f"({v.producer().op_type}); weights must be initializers, graph inputs or float Constant outputs"
                )
            quantized = next((u for u, i in v.uses() if u.op_type == "MatMulNBits" and i in (1, 2, 3)), None)
            if quantized is not None:  # its packed weight, scales or zero points (its bias trains)
                node = f"MatMulNBits node '{quantized.name}'" if quantized.name else "a MatMulNBits node"
                raise InvalidArgumentError(
                    f"weight '{name}' is part of the quantized weight of {node}, which cannot be trained: freeze it "
                    "and train a LoRA adapter on it instead (gradbuilder lora, or gradbuilder.add_lora in Python)")
            if v.dtype not in FLOAT_TYPES:
                raise InvalidArgumentError(
                    f"weight '{name}' has type {v.dtype.name if v.dtype else 'unknown'}; only float16, "
                    "bfloat16, float32 and float64 tensors can be differentiated"
                )
            weights.append(v)
        loss = values[self.loss]
        if loss.dtype not in FLOAT_TYPES:
            raise InvalidArgumentError(
                f"loss '{self.loss}' has type {loss.dtype.name if loss.dtype else 'unknown'}; the loss "
                "must be a float scalar"
            )
        dims = dims_of(loss)
        if dims is None or any(d != 1 for d in dims):
            raise InvalidArgumentError(
                f"loss '{self.loss}' has shape {list(dims) if dims is not None else 'unknown'}; the loss "
                "must be a scalar (shape [] or all ones). Reduce it first, e.g. with ReduceMean"
            )
        outputs = [values[n] for n in self.outputs]
        return weights, outputs, loss

    @property
    def source(self):
        """The model the builder was given (bytes, a path, a ModelProto or a Graph), as given."""
        return self._source

    # ----------------------------------------------------------------------------- results
    def built_model(self) -> DetachedModel:
        """The built gradient graph as a ``DetachedModel`` (the skeleton and its large arrays,
        not copied); ``build()`` first."""
        if self._result is None:
            raise OutputError("call build() first")
        return self._result

    @property
    def model_proto(self) -> onnx.ModelProto:
        """The built model as a ModelProto (a fresh copy each time)."""
        return self.built_model().to_proto()

    def get_model(self) -> bytes:
        """The built model, serialized."""
        return self.built_model().to_bytes()

    def get_graph(self):
        """The built model as an ``onnx_graphsurgeon.Graph`` (``gs.import_onnx``), for editing
        with onnx-graphsurgeon (``pip install gradbuilder[graphsurgeon]``)."""
        try:
            import onnx_graphsurgeon as gs
        except ImportError as exc:
            raise compat.MissingDependencyError(
                "get_graph() needs onnx-graphsurgeon, which is not installed: pip install "
                "'gradbuilder[graphsurgeon]' (or pip install onnx-graphsurgeon)") from exc
        return gs.import_onnx(self.model_proto)

    def save(self, path: str | os.PathLike, external_data: bool | None = None) -> str:
        """Write the built model atomically; tensors go to ``<path>.data`` over 2 GB. The input
        model's own path is refused."""
        from .. import files

        files.check_not_the_input(path, self._source, InvalidArgumentError, "output model")
        self.built_model().save(path, external_data)
        return str(path)


def _require_ranks(inputs, outputs) -> None:
    """onnx.checker requires a shape (at least a rank) on every graph input and output, and the
    written model must pass it: name the first tensor that has none and say what to declare."""
    for v in inputs:
        if isinstance(v.type, ir.TensorType) and v.shape is None:
            raise InvalidModelError(
                f"graph input '{v.name}' declares no shape, not even a rank; onnx.checker requires one on every "
                "graph input and the written model must pass it. Declare its shape, with symbolic names "
                "(e.g. 'batch') or unnamed dims for sizes that vary"
            )
    for v in outputs:
        if isinstance(v.type, ir.TensorType) and v.shape is None:
            producer = v.producer()
            origin = ""
            if producer is not None and producer.name:
                origin = f" (computed by {producer.op_type} node '{producer.name}')"
            elif producer is not None:
                origin = f" (computed by an unnamed {producer.op_type} node)"
            raise InvalidModelError(
                f"output '{v.name}'{origin} has a rank onnx shape inference could not find; onnx.checker "
                "requires a shape on every graph output and the written model must pass it. Declare its shape "
                "(at least its rank) with a value_info entry, or leave it out of outputs"
            )


def _drop_inner_types(graph: ir.Graph) -> None:
    """Forget the types and shapes of intermediate values so no value_info is written: the
    runtime infers them again, and the model is smaller and faster to serialize."""
    for node in graph:
        for v in node.outputs:
            if not v.is_graph_output():
                v.type = None
                v.shape = None


def float_values(model, base_dir=None) -> list[str]:
    """What ``weights`` may name besides graph inputs: the float initializers of ``model`` and
    the outputs of its float Constant nodes."""
    proto = modelio.read_proto(model, base_dir)
    return _float_initializers(proto.graph) + list(modelio.float_constants(proto.graph))


def default_weights(model, base_dir=None) -> list[str]:
    """The weights trained when none are named: the float initializers of ``model``. A model
    with none (paddle2onnx and spox keep every weight in a Constant node) trains its float
    Constant tensors of rank 1 and more instead; a scalar Constant is trained only when named."""
    proto = modelio.read_proto(model, base_dir)
    return _float_initializers(proto.graph) or [n for n, t in modelio.float_constants(proto.graph).items() if t.dims]


def _float_initializers(graph: onnx.GraphProto) -> list[str]:
    return [t.name for t in graph.initializer if t.data_type in FLOAT_TENSOR_TYPES]


# attribute types that hold numbers an ai.onnx.ml operator was fitted to
_FITTED = (onnx.AttributeProto.FLOAT, onnx.AttributeProto.FLOATS, onnx.AttributeProto.TENSOR)


def nothing_to_train(graph: onnx.GraphProto) -> str:
    """What to name when no weight was named, or where a model with nothing to name keeps its
    parameters and what to do about it (the rest of a one-line error)."""
    floats = _float_initializers(graph) + list(modelio.float_constants(graph))
    if floats:
        return f"name at least one of the model's float initializers and Constant outputs: {_listed(floats)}"
    fitted = [f"{n.op_type} '{n.name}'" if n.name else n.op_type for n in graph.node
              if n.domain == "ai.onnx.ml" and any(a.type in _FITTED for a in n.attribute)]
    if fitted:
        return (f"the model has no float initializer or Constant node: its parameters are attributes of ai.onnx.ml "
                f"operators ({_listed(fitted)}), constants of the operator that no gradient reaches, so nothing can "
                "train them. Rebuild the model with its parameters as float initializers read by standard ONNX "
                "operators (a linear model as MatMul + Add, for instance), or fit it again in the library it came "
                "from and convert it again")
    inputs = [i.name for i in graph.input if i.type.tensor_type.elem_type in FLOAT_TENSOR_TYPES]
    if inputs:
        return ("the model has no float initializer or Constant node to train; to differentiate with respect to a "
                f"graph input, name it (float inputs: {_listed(inputs)})")
    return "the model has no float initializer, Constant node or graph input: nothing in it can be trained"


def _listed(names, most: int = 8) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")
