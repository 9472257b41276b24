"""The training graph: forward, gradients and the optimizer update in one ONNX model.

    >>> b = TrainingGraphBuilder(model, weights=["W", "B"], loss="loss", optimizer="adamw",
    ...                          optimizer_options={"weight_decay": 0.01}).build()
    >>> b.save("training.onnx"); state = b.initial_state()

Graph interface (any runtime can drive it; names are fixed so a loop can bind outputs of one
step to the inputs of the next):

- inputs: the model's inputs; every weight ``W`` (its initializer kept as default value);
  ``Learning_Rate`` (float scalar); ``Step`` (int64 scalar, updates done so far, 0 at the
  start); one input per optimizer state, ``W.<state>`` (see ``training.stages.optimizer``).
- outputs: the requested outputs (the loss first by default), the gradients ``W_grad`` when
  ``gradients_as_outputs``, then ``W.updated`` per weight, ``W.<state>.updated`` per state and
  ``Step.updated``.
- with ``accumulation_steps`` N > 1: inputs ``W.grad_accum`` and ``Accumulation_Step``, outputs
  ``W.grad_accum.updated`` and ``Accumulation_Step.updated`` (last); the weights, states and
  ``Step`` change only on every N-th run, with the sum of the N gradients.
- with ``max_grad_norm``: the gradients the optimizer sees are clipped to that global L2 norm
  (``torch.nn.utils.clip_grad_norm_``); ``W_grad`` outputs stay unclipped.
- running statistics (BatchNormalization in training mode, ``passes.running_stats``): each
  buffer ``B`` is an input (its initializer kept as default value) and ``B.updated`` an output.
- ``All_Finite`` (bool scalar output): this run's loss and gradients are finite. When they are
  not, the run changes nothing: weights, optimizer states, ``Step``, running statistics and
  accumulation buffers come out as they went in. Under dynamic loss scaling an overflow is part
  of the scale search instead: the update is skipped and the scale backs off, as
  ``torch.amp.GradScaler`` does, and running statistics are kept only when the loss is finite.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from ..compiler import modelio
from ..compiler.builder import Appended, GradientGraphBuilder
from ..errors import InvalidArgumentError
from .stages.accumulate import COUNTER, accumulate
from .stages.clip import clip_by_global_norm
from .stages.flat import flatten
from ..compiler.passes import named_output, new_input
from .stages.loss_scale import LossScaling, all_finite, next_scale, scale_loss, unscale
from .stages.optimizer import add_optimizer, initial_state, resolve, state_names
from ..interface import ALL_FINITE, GRADIENT_SQUARES, LEARNING_RATE, STEP, grad_accum, state_of, updated


class TrainingGraphBuilder(GradientGraphBuilder):
    def __init__(
        self,
        model,
        weights: Iterable[str],
        loss: str,
        *,
        outputs: Iterable[str] | None = None,
        optimizer: str = "sgd",
        optimizer_options: dict | None = None,
        per_weight_options: Mapping[str, dict] | None = None,
        lr_name: str = LEARNING_RATE,
        step_name: str = STEP,
        gradients_as_outputs: bool = False,
        max_grad_norm: float | None = None,
        accumulation_steps: int = 1,
        stop_gradients: Iterable[str] = (),
        mixed_precision: str | None = None,
        cast_propagation: tuple[int, Iterable[str]] = (1, ()),
        loss_scaling: LossScaling | None = None,
        fp16_moments: bool = False,
        recompute=None,
        memory_efficient_gradient: bool = False,
        deterministic: bool = False,
        base_dir=None,
        warn_about_model: bool = True,
        allow_inference_export: bool = False,
    ):
        super().__init__(model, weights, outputs, loss, stop_gradients=stop_gradients, mixed_precision=mixed_precision,
                         cast_propagation=cast_propagation, recompute=recompute,
                         memory_efficient_gradient=memory_efficient_gradient, deterministic=deterministic,
                         running_statistics=True,
                         base_dir=base_dir, warn_about_model=warn_about_model,
                         allow_inference_export=allow_inference_export)
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise InvalidArgumentError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InvalidArgumentError(f"max_grad_norm must be > 0 (or None: no clipping), got {max_grad_norm!r}")
        self.optimizer = optimizer
        self.optimizer_options = resolve(optimizer, optimizer_options)
        self.per_weight_options = {w: resolve(optimizer, o) for w, o in (per_weight_options or {}).items()}
        unknown = sorted(set(self.per_weight_options) - set(self.weights))
        if unknown:
            raise InvalidArgumentError(f"per_weight_options names {unknown}, which are not weights being trained "
                                       f"({sorted(self.weights)})")
        self.lr_name, self.step_name = lr_name, step_name
        self.gradients_as_outputs = gradients_as_outputs
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        self.loss_scaling = loss_scaling
        self.state_dtype = ir.DataType.FLOAT16 if fp16_moments else None
        self.dump_paths: dict[str, str] = {}  # "gradient" / "training" / "transformed" -> path
        self.seed_state: dict[str, dict[str, np.ndarray]] = {}  # weight -> state -> initial value
        # The groups of a flat state (stages.flat; a session's step), or none: a weight, its
        # gradient and its states each a tensor of their own, as the written graphs keep them.
        self.flat_layout: list = []
        # Every weight's update applied or skipped by arithmetic, none in an If: a step with
        # no control flow (captured as a CUDA graph), not only the flat groups'.
        self.branch_free_update = False

    def build(self) -> "TrainingGraphBuilder":
        super().build()
        skeleton = self.built_model().skeleton
        skeleton.doc_string = TRAINING_GRAPH_DOC + (f"\n\n{skeleton.doc_string}" if skeleton.doc_string else "")
        skeleton.graph.doc_string = TRAINING_GRAPH_DOC
        if self.dump_paths.get("gradient"):
            gradients = GradientGraphBuilder(self.source, self.weights, [self.loss], self.loss,
                                             stop_gradients=self.stop_gradients, base_dir=self.base_dir,
                                             warn_about_model=False)
            gradients.build().save(self.dump_paths["gradient"])
        for key in ("training", "transformed"):  # no transform runs after the optimizer yet
            if self.dump_paths.get(key):
                self.save(self.dump_paths[key])
        return self

    def _loss_to_differentiate(self, e, loss):
        """The loss, or under loss scaling the scaled loss (and the ScaledLoss, for unscaling)."""
        if self.loss_scaling is None:
            return loss, None
        scaled = scale_loss(e, loss, self.loss_scaling)
        return scaled.loss, scaled

    def _after_gradients(self, e, weights, grads, loss, scaled):
        """unscaling -> finiteness -> accumulation -> overflow check -> clipping -> optimizer,
        each a pass of its own. The running statistics are kept where this run's loss and
        gradients are finite (under loss scaling, its loss: an overflow is part of the scale
        search)."""
        inputs, outputs, apply = [], [], None
        if self.flat_layout:
            weights, grads, inputs = flatten(e, self.flat_layout, weights, grads,
                                             ir.DataType.FLOAT16 if self.mixed_precision == "float16"
                                             else ir.DataType.BFLOAT16 if self.mixed_precision else None)
        if scaled is not None:
            grads = unscale(e, grads, scaled)
            inputs = inputs + list(scaled.inputs)
        finite = all_finite(e, {**grads, self.loss: loss})
        keep = finite if scaled is None else all_finite(e, {self.loss: loss})
        if self.accumulation_steps > 1:
            # a micro-step that is not finite is dropped, except under loss scaling, where
            # the check on the sum below backs the scale off (as GradScaler)
            acc = accumulate(e, weights, grads, self.accumulation_steps, keep=None if scaled else finite)
            grads, apply = acc.grads, acc.apply
            inputs, outputs = inputs + acc.inputs, acc.outputs
        if scaled is not None:
            summed_finite = all_finite(e, grads) if self.accumulation_steps > 1 else finite
            outputs = outputs + next_scale(e, scaled, self.loss_scaling, summed_finite, apply)
            apply = summed_finite if apply is None else e.And(apply, summed_finite)
        elif apply is None:
            apply = finite
        if self.max_grad_norm is not None:
            grads = clip_by_global_norm(e, weights, grads, self.max_grad_norm).grads
        per_weight = dict(self.per_weight_options)
        per_weight.update({g.name: self.options_of(g.members[0].name) for g in self.flat_layout})
        update = add_optimizer(e, weights, grads, self.optimizer, self.optimizer_options,
                               self.lr_name, self.step_name, apply, self.state_dtype, per_weight,
                               gated=frozenset(w.name for w in weights) if self.branch_free_update
                               else frozenset(g.name for g in self.flat_layout))
        flag = named_output(e, finite, ALL_FINITE, finite)
        return Appended(update.inputs + inputs, update.outputs + outputs + [flag], keep)

    def options_of(self, weight: str) -> dict:
        """The optimizer options of ``weight`` (its own, or the shared ones)."""
        return self.per_weight_options.get(weight, self.optimizer_options)

    def _weight_specs(self) -> dict[str, np.ndarray]:
        """Each weight as an array of its dtype and shape (its initializer or Constant node, or
        a zero-strided view standing for a graph input of fixed shape)."""
        proto = modelio.read_proto(self.source, self.base_dir)
        tensors = [*proto.graph.initializer, *modelio.float_constants(proto.graph).values()]
        specs = {t.name: numpy_helper.to_array(t) for t in tensors if t.name in self.weights and not t.external_data}
        for i in proto.graph.input:
            dims = i.type.tensor_type.shape.dim
            if i.name in self.weights and i.name not in specs and all(d.dim_value > 0 for d in dims):
                dtype = onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
                specs[i.name] = np.broadcast_to(np.zeros((), dtype), [d.dim_value for d in dims])
        for t in tensors:  # in external data: shape and type from the metadata
            if t.name in self.weights and t.name not in specs:
                specs[t.name] = np.broadcast_to(np.zeros((), onnx.helper.tensor_dtype_to_np_dtype(t.data_type)), t.dims)
        return specs

    def state_names_of(self, weight: str) -> list[str]:
        """The optimizer states ``weight`` carries (``W.<state>`` inputs)."""
        return state_names(self.optimizer, self.options_of(weight))

    def _gradients_as_outputs(self) -> bool:
        return self.gradients_as_outputs

    def state_interface(self) -> list[tuple[str, str]]:
        """(state input, its ``.updated`` output) pairs of the built graph: see :func:`state_interface`."""
        return state_interface(self.built_model().skeleton)

    def initial_state(self, weights: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Feeds for the first step: every optimizer state (zeros, or Adagrad's initial
        accumulator) and ``Step`` = 0; the learning rate is the caller's. The states take the
        weights' shapes and types from ``weights`` (default: the model's initializers, or its
        graph inputs' declared types)."""
        values = weights if weights is not None else self._weight_specs()
        feeds: dict[str, np.ndarray] = {self.step_name: np.array(0, np.int64)}
        missing = [w for w in self.weights if w not in values]
        if missing:
            raise InvalidArgumentError(f"initial_state needs the weights' shapes; {missing} are graph inputs "
                                       "whose shapes are not all fixed sizes: give them initializers")
        for w in self.weights:
            seeded = self.seed_state.get(w, {})
            dtype = np.float16 if self.state_dtype == ir.DataType.FLOAT16 else None
            for state, value in initial_state(self.optimizer, self.options_of(w), values[w], dtype).items():
                feeds[state_of(w, state)] = np.asarray(seeded.get(state, value), dtype=value.dtype)
            if self.accumulation_steps > 1:
                feeds[grad_accum(w)] = np.zeros_like(values[w])
        if self.accumulation_steps > 1:
            feeds[COUNTER] = np.array(0, np.int64)
        if self.loss_scaling is not None:
            feeds.update(self.loss_scaling.initial_state())
        return feeds


class StepGradientsBuilder(GradientGraphBuilder):
    """The step-wise API's gradient graph (onnxruntime-training's ``train_step``): forward and
    backward with the same forward passes as the training graph (no loss scaling); the
    gradient of ``W`` is the output ``W.grad_accum.updated``: the gradient itself, or with
    ``accumulate`` the input buffer ``W.grad_accum`` plus the gradient. Running statistics
    come out as ``B.updated``, kept only when the loss and gradients are finite."""

    def __init__(self, training: TrainingGraphBuilder, outputs, accumulate: bool):
        super().__init__(training.source, training.weights, outputs, training.loss, running_statistics=True,
                         mixed_precision=training.mixed_precision, cast_propagation=training.cast_propagation,
                         recompute=training.recompute, memory_efficient_gradient=training.memory_efficient_gradient,
                         deterministic=training.deterministic, base_dir=training.base_dir,
                         warn_about_model=False)  # the session said it at construction
        self.accumulate = accumulate

    def _after_gradients(self, e, weights, grads, loss, seeded):
        inputs, outputs = [], []
        finite = all_finite(e, {**grads, self.loss: loss}) if self.buffers else None
        for w in weights:
            g = grads[w.name]
            if self.accumulate:
                buf = new_input(e, grad_accum(w.name), w.dtype, w.shape)
                inputs.append(buf)
                g = e.Add(buf, g)
            outputs.append(named_output(e, g, updated(grad_accum(w.name)), w))
        return Appended(inputs, outputs, finite)

    def _gradients_as_outputs(self) -> bool:
        return False


def eval_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """The evaluation graph of a forward model: its inference form (``passes.running_stats``)
    with no vector product left to onnxruntime's fused transposed kernel, and its class losses
    in operators every provider has a kernel for (``passes.standard_losses``)."""
    from ..compiler.passes.context import Context
    from ..compiler.passes.running_stats import inference_form
    from ..compiler.passes.standard_losses import class_losses_as_standard_ops
    from ..compiler.passes.vector_products import vector_products_without_transpose

    model = inference_form(model)
    try:  # the ranks the rewrite reads; without them the rank test runs at run time
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001
        pass
    ir_model = modelio.to_ir(model)
    ctx = Context.of(ir_model)
    vector_products_without_transpose(ir_model, ctx)
    class_losses_as_standard_ops(ir_model, ctx)
    return ir.to_proto(ir_model)


TRAINING_GRAPH_DOC = (
    "Training graph written by gradbuilder: one run is one training step (forward, backward, optimizer). "
    "State inputs: each trained weight W (its initializer is only a default value, so onnxruntime's "
    "get_inputs() does not list it: feed it anyway), optimizer states W.<state>, Step (int64 scalar, updates "
    "done), BatchNormalization running statistics B, and with accumulation W.grad_accum and Accumulation_Step, "
    "with dynamic loss scaling Loss_Scale. Each state input X has the output X.updated: feed it as X to the "
    "next run, or nothing is trained. Learning_Rate: float scalar input. All_Finite: bool output, false when "
    "the loss or a gradient was not finite (the run then changed nothing). "
    "gradbuilder.state_interface(model) lists the (input, output) pairs."
)


def state_interface(model) -> list[tuple[str, str]]:
    """The state of a training graph (a path, bytes, ModelProto or onnx_graphsurgeon Graph
    written by TrainingGraphBuilder) as (input name, updated output name) pairs, in input
    order: each weight ``W`` with ``W.updated``, its optimizer states, ``Step``, running
    statistics ``B`` with ``B.updated``, accumulation buffers, the loss scale. A loop feeds
    each input (the weights' initial values are the model's initializers) and passes each
    output on as the next run's input; onnxruntime's ``get_inputs()`` leaves out the weights
    and running statistics, since their initializers give them defaults."""
    import os

    if isinstance(model, (str, os.PathLike)):
        proto = _names_only(model)
    elif isinstance(model, (bytes, bytearray, memoryview)):
        proto = onnx.ModelProto.FromString(bytes(model))  # names only: external data stays unread
    elif isinstance(model, onnx.ModelProto):
        proto = model
    else:
        proto = modelio.load_proto(model)
    outputs = {o.name for o in proto.graph.output}
    pairs = [(i.name, updated(i.name)) for i in proto.graph.input if updated(i.name) in outputs]
    if not pairs:
        raise InvalidArgumentError("state_interface: the model has no input X with an output X.updated; "
                                   "pass a training graph written by TrainingGraphBuilder or TrainingSession")
    return pairs


def _names_only(path) -> onnx.ModelProto:
    from ..errors import ModelLoadError

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelLoadError(f"could not read ONNX model '{path}': {exc}") from exc


# onnxruntime-training's optimizer attribute keys -> our option names
_ORT_KEYS = {"lambda": "weight_decay", "epsilon": "eps", "do_bias_correction": "bias_correction"}
_IGNORED = {"weight_decay_mode"}
_ORT_NAMES = ("SGDOptimizer", "AdamOptimizer", "LambOptimizer")  # both of onnxruntime's modes decouple the decay (see params.py)


def from_parameters(model, params, outputs: Iterable[str] | None = None, base_dir=None,
                    weights: list[str] | None = None, *, warn_about_model: bool = True) -> TrainingGraphBuilder:
    """A TrainingGraphBuilder configured by a ``TrainingParameters``: weights_to_train (default:
    every float initializer) less weights_not_to_train, loss_output_name, the optimizer and its
    attributes (onnxruntime's keys alpha/beta/lambda/epsilon/do_bias_correction/max_norm_clip
    or plain ones), gradient_accumulation_steps, enable_grad_norm_clip (max_norm_clip, default
    1.0, as onnxruntime), lr_params_feed_name, set_gradients_as_graph_outputs, the dump paths
    and set_optimizer_initial_state. ``weights``, when given, are the weights to train as
    :func:`weights_of` found them (the model may have them as graph inputs by now).
    ``warn_about_model``: as GradientGraphBuilder's (False where the caller warned already)."""
    name = params.optimizer_name()
    if name is None:
        raise InvalidArgumentError("TrainingParameters.training_optimizer_name is empty; set an optimizer, "
                                   "e.g. 'AdamOptimizer' or 'adamw'")
    if not params.loss_output_name:
        raise InvalidArgumentError("TrainingParameters.loss_output_name is empty; name the model's loss output")
    proto = modelio.read_proto(model, base_dir)
    weights = weights if weights is not None else weights_of(proto, params)
    options, per_weight, max_norm = _optimizer_options(name, params, weights, proto)
    builder = TrainingGraphBuilder(
        model, weights, params.loss_output_name, outputs=outputs, optimizer=name, optimizer_options=options,
        per_weight_options=per_weight,
        lr_name=params.lr_params_feed_name, gradients_as_outputs=params.set_gradients_as_graph_outputs,
        max_grad_norm=max_norm if params.enable_grad_norm_clip else None,
        accumulation_steps=params.gradient_accumulation_steps, warn_about_model=warn_about_model,
        allow_inference_export=params.allow_inference_export, **graph_options(params))
    builder.dump_paths = {"gradient": params.model_with_gradient_graph_path,
                          "training": params.model_with_training_graph_path,
                          "transformed": params.model_after_graph_transforms_path}
    builder.seed_state = params.optimizer_initial_state
    return builder


def weights_of(model, params) -> list[str]:
    """The weights ``params`` trains in ``model``: weights_to_train (default: every float
    initializer that is not a running statistic, ``compiler.builder.default_weights``) less
    weights_not_to_train and the immutable_weights; an error when that leaves none."""
    from ..compiler.builder import default_weights, nothing_to_train
    from ..compiler.passes.running_stats import buffers_of

    proto = modelio.read_proto(model)
    buffers = set(buffers_of(proto))
    if buffers & params.weights_to_train:
        raise InvalidArgumentError(f"TrainingParameters.weights_to_train: {sorted(buffers & params.weights_to_train)} "
                                   "are BatchNormalization running statistics, which the training step updates "
                                   "as buffers; they are not trained")
    weights = sorted(params.weights_to_train) or [w for w in default_weights(proto) if w not in buffers]
    immutable = _immutable(proto, params.immutable_weights)
    both = sorted(set(params.weights_to_train) & immutable)
    if both:
        raise InvalidArgumentError(f"TrainingParameters: {both} are in weights_to_train and are also immutable "
                                   "(immutable_weights); remove them from one of the two")
    weights = [w for w in weights if w not in params.weights_not_to_train and w not in immutable]
    if not weights:
        raise InvalidArgumentError(f"no weights to train: {nothing_to_train(proto.graph)}")
    return weights


def graph_options(params) -> dict:
    """The mixed-precision and memory options of ``params`` as builder keywords:
    use_mixed_precision (mixed_precision_dtype, propagate_cast_ops_level/_allow), loss_scale
    (float16: 0 = dynamic, as onnxruntime-training; bfloat16 has float32's range and is scaled
    only when loss_scale > 0), use_fp16_moments, the recompute options and memory budget,
    use_memory_efficient_gradient."""
    mixed = params.mixed_precision_dtype if params.use_mixed_precision else None
    scaling = None
    if mixed == "float16" or (mixed and params.loss_scale > 0):
        scaling = LossScaling(scale=params.loss_scale)
    return dict(mixed_precision=mixed,
                cast_propagation=(params.propagate_cast_ops_level, params.propagate_cast_ops_allow),
                loss_scaling=scaling, fp16_moments=params.use_fp16_moments, recompute=recompute_options(params),
                memory_efficient_gradient=params.use_memory_efficient_gradient,
                deterministic=params.deterministic_compute)


def recompute_options(params):
    """A ``passes.recompute.RecomputeOptions`` from ``params``, or None when nothing is recomputed."""
    wanted = (params.gelu_recompute or params.attn_dropout_recompute or params.transformer_layer_recompute
              or params.memory_budget_mb > 0 or params.memory_budget_fraction > 0)
    if not wanted:
        return None
    from ..compiler.passes.recompute import RecomputeOptions

    return RecomputeOptions(gelu=params.gelu_recompute, attention_dropout=params.attn_dropout_recompute,
                            transformer_layers=params.transformer_layer_recompute,
                            layers=params.number_recompute_layers,
                            budget_bytes=int(params.memory_budget_mb * 2 ** 20) or None,
                            budget_fraction=params.memory_budget_fraction or None)


def _immutable(model, spec: dict) -> set[str]:
    """Initializers that immutable_weights ({op type: [(input index, value)]}) keeps fixed:
    those holding ``value`` at that input of a node of that op type."""
    if not spec:
        return set()
    proto = modelio.read_proto(model)
    inits = {t.name: t for t in proto.graph.initializer}
    fixed = set()
    for node in proto.graph.node:
        for index, value in spec.get(node.op_type, ()):
            name = node.input[index] if index < len(node.input) else ""
            if name in inits and np.all(numpy_helper.to_array(inits[name]) == value):
                fixed.add(name)
    return fixed


def _optimizer_options(name: str, params, weights: list[str], model) -> tuple[dict, dict[str, dict], float]:
    """The shared options (the optimizer's defaults), each listed weight's own options, and the
    clip norm. optimizer_attributes_map / optimizer_int_attributes_map give a weight its
    attributes (onnxruntime's keys or plain ones); a weight they do not list takes the
    optimizer's defaults. max_norm_clip is one global norm: the weights that give it agree."""
    maps = (params.optimizer_attributes_map, params.optimizer_int_attributes_map)
    known = {t.name for t in modelio.read_proto(model).graph.initializer} | set(weights)
    unknown = sorted({w for m in maps for w in m if w not in known})
    if unknown:
        raise InvalidArgumentError(f"TrainingParameters.optimizer_attributes_map names {unknown}, which the model "
                                   f"has no initializer of; the weights being trained are {sorted(weights)}")
    # onnxruntime's optimizers default to no weight decay (lambda 0), torch's AdamW to 0.01
    defaults = {"lambda": 0.0} if params.training_optimizer_name in _ORT_NAMES else {}
    per_weight, norms = {}, {}
    for w in weights:
        attrs = {**params.optimizer_attributes_map.get(w, {}), **params.optimizer_int_attributes_map.get(w, {})}
        if "max_norm_clip" in attrs:
            norms[w] = float(attrs.pop("max_norm_clip"))
        if attrs:
            per_weight[w] = _plain_options(name, {**defaults, **attrs})
    if len(set(norms.values())) > 1:
        raise InvalidArgumentError("TrainingParameters.optimizer_attributes_map: max_norm_clip is one global "
                                   f"gradient norm, but the weights give different values: {norms}")
    max_norm = next(iter(norms.values()), 1.0)
    return _plain_options(name, defaults), per_weight, max_norm


def _plain_options(name: str, attrs: dict) -> dict:
    """onnxruntime's attribute keys (alpha, beta, lambda, epsilon, do_bias_correction) as our
    option names, over the optimizer's defaults."""
    attrs, options = dict(attrs), {}
    beta1, beta2 = attrs.pop("alpha", attrs.pop("beta1", None)), attrs.pop("beta", attrs.pop("beta2", None))
    if beta1 is not None or beta2 is not None:
        defaults = resolve(name, {}).get("betas", (0.9, 0.999))
        options["betas"] = (beta1 if beta1 is not None else defaults[0], beta2 if beta2 is not None else defaults[1])
    for key, value in attrs.items():
        if key in _IGNORED:
            continue
        key = _ORT_KEYS.get(key, key)
        options[key] = bool(value) if key in ("bias_correction", "nesterov", "amsgrad") else value
    return resolve(name, options)


def optimizer_only_model(weights: Mapping[str, np.ndarray], name: str, options: dict,
                         max_grad_norm: float | None = None, opset: int = 17,
                         per_weight: Mapping[str, dict] | None = None, partial: bool = False) -> onnx.ModelProto:
    """A graph of the optimizer update alone (clipping first with ``max_grad_norm``): inputs
    ``Learning_Rate``, ``Step``, every weight ``W`` (``weights`` gives dtypes and shapes), its
    gradient ``W_grad`` and its states ``W.<state>``; outputs ``W.updated``,
    ``W.<state>.updated``, ``Step.updated`` and ``All_Finite``: when a gradient holds an inf
    or NaN, nothing changes. ``partial``: ``weights`` are some of the model's (the others are
    updated elsewhere), and clipping reads the squared global norm from the float input
    ``Gradient_Squares``."""
    from ..compiler.emitter import Emitter

    ws = [ir.Value(name=w, type=ir.TensorType(ir.DataType(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(v.dtype)))),
                   shape=ir.Shape(list(v.shape))) for w, v in weights.items()]
    grads = [ir.Value(name=f"{w.name}_grad", type=ir.TensorType(w.dtype), shape=w.shape) for w in ws]
    graph = ir.Graph(ws + grads, [], nodes=[], name="optimizer", opset_imports={"": opset})
    e = Emitter(graph, opset)
    e.reserve(*(v.name for v in ws + grads), GRADIENT_SQUARES)
    clipped = {w.name: g for w, g in zip(ws, grads)}
    finite = all_finite(e, clipped)
    squares = None
    if max_grad_norm is not None and partial:
        squares = ir.Value(name=GRADIENT_SQUARES, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
        graph.inputs.append(squares)
    if max_grad_norm is not None:
        clipped = clip_by_global_norm(e, ws, clipped, max_grad_norm, squares).grads
    update = add_optimizer(e, ws, clipped, name, options, LEARNING_RATE, STEP, finite, per_weight=per_weight)
    for v in reversed(update.inputs[:2]):  # Learning_Rate, Step first
        graph.inputs.insert(0, v)
    graph.inputs.extend(update.inputs[2:])
    graph.outputs.extend(update.outputs + [named_output(e, finite, ALL_FINITE, finite)])
    proto = ir.to_proto(ir.Model(graph, ir_version=8))
    onnx.checker.check_model(proto, full_check=True)
    return proto
