"""TrainingSession: train an ONNX model on stock onnxruntime.

    >>> params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw")
    >>> sess = TrainingSession("model.onnx", params)
    >>> sess.set_learning_rate(1e-3)
    >>> loss, = sess.run(["loss"], {"x": x, "y": y})        # one full step

The forward model and the ``TrainingParameters`` are turned into ONNX graphs in standard
operators (``gradbuilder.training``); the session is a facade over three parts:

- ``graphs.GraphCache``: each kind of graph (the full ``step`` for ``run``, ``gradients`` /
  ``accumulate`` for ``train_step``, ``optimizer`` for ``optimizer_step``, ``eval`` for
  ``eval_step``), built and compiled on first use;
- ``state.StateStore``: the training state between steps;
- ``runner.Graph``: one compiled graph, bound and run with IOBinding (ORTModule runs its
  graphs through it too).
 Weights, gradients and optimizer state live
as ``OrtValue``s on the execution device; every run binds them with IOBinding and takes the
updated values (``W.updated``, ``W.<state>.updated``, ...) as the next inputs, so no tensor of
the state passes through numpy between steps. Every call validates its input before running
and changes the state only after a run succeeded: a failed call leaves the session as it was.
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from .. import compat, files
from ..compiler import modelio
from ..compiler.passes.running_stats import buffers_of
from ..dtypes import FLOAT_TENSOR_TYPES
from ..errors import CheckpointError, InvalidArgumentError, NonFiniteError, ProviderError
from ..interface import (ACCUMULATION_STEP, ALL_FINITE, GRAD_ACCUM, GRADIENT, LEARNING_RATE, LOSS_SCALE,
                         LOSS_SCALE_GOOD_STEPS, STEP, grad_accum, state_of, updated)
from ..training.graph import from_parameters, weights_of
from . import checkpoint, distributed, providers as _providers, schedulers
from .graphs import GraphCache
from .runner import StepBinding
from .state import StateStore, fingerprint

_SHARED = (STEP, LOSS_SCALE, LOSS_SCALE_GOOD_STEPS)  # state shared by every weight


class TrainingSession:
    """Trains ``path_or_bytes`` (a forward ONNX model whose loss is ``parameters.loss_output_name``)
    on onnxruntime. The model and ``parameters`` are never modified."""

    def __init__(self, path_or_bytes, parameters, sess_options: ort.SessionOptions | None = None,
                 providers: Sequence | None = None, provider_options: Sequence[dict] | None = None,
                 base_dir: str | os.PathLike | None = None):
        from ..compiler.tied_exports import warn_merged_parameters
        from ..compiler.torch_exports import warn_inference_export
        from ..training.params import TrainingParameters

        if not isinstance(parameters, TrainingParameters):
            raise InvalidArgumentError(f"parameters must be a gradbuilder.TrainingParameters, got "
                                       f"{type(parameters).__name__}")
        self._params = TrainingParameters.from_dict(parameters.to_dict())
        # The session's own copy of the model, read once (external data from base_dir), its large
        # tensors apart. Its weights and running statistics move into the state, read straight
        # from their files where they are external data; the model keeps their types.
        self._model, large = modelio.load_detached(path_or_bytes, base_dir)
        compat.check_for_runtime(self._model, strict=True)  # the graphs must load in onnxruntime
        warn_inference_export(self._model)
        warn_merged_parameters(self._model)
        self.weights = weights_of(self._model, self._params)
        modelio.lift_constants(self._model, self.weights)  # weights held in Constant nodes (paddle2onnx, spox)
        self.buffers = buffers_of(self._model)  # running statistics: updated by training, not trained
        inits = {t.name: t for t in self._model.graph.initializer}
        no_value = [b for b in self.buffers if b not in inits]
        if no_value:
            raise InvalidArgumentError(f"the running statistics {no_value} are graph inputs without an initializer; "
                                       "give them initial values as initializers")
        values = {w: large.pop(w) if w in large else numpy_helper.to_array(inits[w])
                  for w in self.weights + self.buffers if w in inits}
        if large:  # frozen parameters: constants of the session's graphs
            self._model = modelio.DetachedModel(self._model, large).to_proto()
        del large
        self._frozen = [t.name for t in self._model.graph.initializer if t.name not in values
                        and t.data_type in FLOAT_TENSOR_TYPES]
        modelio.weights_as_inputs(self._model, self.weights + self.buffers)  # their values live in the state only
        self._builder = from_parameters(self._model, self._params, outputs=self._output_names(), weights=self.weights)
        self._builder._warn_about_model = False  # said above
        self.loss_name = self._builder.loss
        self._check_names()
        missing = [w for w in self.weights if w not in values]
        if missing:
            raise InvalidArgumentError(f"the weights {missing} are graph inputs without an initializer; give them "
                                       "initial values as initializers")
        initial = {**self._builder.initial_state(values), **values}
        self._sess_options = sess_options or _default_session_options()
        if self._params.deterministic_compute:  # onnxruntime's own choices too (CUDA's convolution algorithms)
            self._sess_options = _providers.options_with(self._sess_options, use_deterministic_compute=True)
        names, options = _resolve_providers(providers, provider_options, self._params.allow_tf32)
        topo = distributed.topology(self._params)  # checked before anything is placed on a device
        if topo is not None:
            options = distributed.one_device_per_process(names, options)
        device = _providers.device_of(names, options)
        self._check_precision(device)
        self._state = StateStore(initial, device)
        self._fingerprint = fingerprint(self.weights, initial, self._builder.optimizer)
        # the same less the accumulation state: a checkpoint saved between accumulations
        # resumes with another number of accumulation steps (or a pipeline's micro-batches)
        self._between = fingerprint(self.weights, _without_accumulation(initial), self._builder.optimizer)
        self._graphs = GraphCache(self._builder, self._model, self._output_names(), self.weights + self.buffers,
                                  self._sess_options, names, options, device)
        self._graphs.weight_specs = {w: np.broadcast_to(np.zeros((), values[w].dtype), values[w].shape)
                                     for w in self.weights}  # dtype and shape only: no memory
        self._fallback = True
        self._bindings: dict[str, StepBinding] = {}  # kind -> its bound state, made on its first run
        self._training = True
        self._lr = 1e-3
        self._lr_value = None
        self._scheduler = None
        self._reset_grads = True
        self.skipped_steps = 0  # updates skipped because the loss or gradients were not finite
        # the caller's values saved with each checkpoint (as onnxruntime's CheckpointState.properties)
        self.properties: dict[str, int | float | str] = {}
        self._on_nonfinite = self._params.on_nonfinite_step
        self._dist = None  # a DataParallel (or PipelineParallel) when launched as one of several processes
        if topo is not None:
            distributed.init_process_group(device)
            if topo.stages == 1:
                from .distributed.data_parallel import DataParallel

                self._dist = DataParallel(self, topo, self._params)
            else:
                from .distributed.pipeline_parallel import PipelineParallel

                whole = onnx.ModelProto()
                whole.CopyFrom(self._model)
                # the weights as initializers the cuts place (their values stay in the state)
                whole.graph.initializer.extend(onnx.TensorProto(name=w, dims=values[w].shape, data_type=onnx.helper.
                                                                np_dtype_to_tensor_dtype(values[w].dtype))
                                               for w in self.weights)
                self._dist = PipelineParallel(self, topo, self._params, whole)

    # ------------------------------------------------------------------ graphs and values
    def _check_precision(self, device) -> None:
        """bfloat16 mixed precision runs only where onnxruntime has bfloat16 kernels (CUDA)."""
        if self._params.use_mixed_precision and self._params.mixed_precision_dtype == "bfloat16" and device[0] == "cpu":
            raise InvalidArgumentError(
                "TrainingParameters.mixed_precision_dtype='bfloat16' needs CUDAExecutionProvider: onnxruntime has no "
                "bfloat16 Gemm/MatMul/Conv on CPU, and this session runs on CPUExecutionProvider. Use "
                "mixed_precision_dtype='float16' on CPU, or providers=['CUDAExecutionProvider'] on a GPU")

    def _check_names(self) -> None:
        """The loss is a value of the model; class-index inputs of the model's losses are
        recorded, so that a label out of range is refused before a run (``_check_labels``)."""
        graph = self._model.graph
        values = {i.name for i in graph.input} | {t.name for t in graph.initializer}
        values |= {o for n in graph.node for o in n.output if o}
        if self.loss_name not in values:
            raise InvalidArgumentError(f"TrainingParameters.loss_output_name '{self.loss_name}' is not a value of the "
                                       f"model; its outputs are {[o.name for o in graph.output]}")
        self._labels: dict[str, tuple[int | None, int | None, str]] = {}
        inputs = {i.name for i in graph.input}
        losses = [n for n in graph.node if n.op_type in _CLASS_LOSSES and n.domain in ("", "ai.onnx")
                  and len(n.input) > 1 and n.input[1] in inputs]
        if not losses:
            return
        try:
            inferred = onnx.shape_inference.infer_shapes(self._model)
        except Exception:  # noqa: BLE001 - no class count known: onnxruntime checks at run time
            inferred = self._model
        types = {v.name: v.type for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
        for n in losses:
            dims = types[n.input[0]].tensor_type.shape.dim if n.input[0] in types else []
            classes = dims[1].dim_value if len(dims) > 1 and dims[1].HasField("dim_value") else None
            ignore = next((a.i for a in n.attribute if a.name == "ignore_index"), None)
            self._labels[n.input[1]] = (classes, ignore, f"node '{n.name}' ({n.op_type})")

    def _check_labels(self, name: str, value) -> None:
        if name not in self._labels:
            return
        classes, ignore, node = self._labels[name]
        labels = np.asarray(_numpy(value))
        if labels.dtype.kind not in "iu":
            return  # onnxruntime refuses the type
        bad = (labels < 0) if classes is None else ((labels < 0) | (labels >= classes))
        if ignore is not None:
            bad &= labels != ignore
        if bad.any():
            first = labels[bad].flat[0]
            allowed = f"0..{classes - 1}" if classes is not None else ">= 0"
            raise InvalidArgumentError(f"input '{name}': class index {first} is out of range for {node}, which takes "
                                       f"{allowed}" + (f" or ignore_index {ignore}" if ignore is not None else ""))

    def _output_names(self) -> list[str]:
        names = [o.name for o in self._model.graph.output]
        loss = self._params.loss_output_name
        return names if loss in names else [loss] + names

    def _user_inputs(self) -> list[str]:
        fed = {t.name for t in self._model.graph.initializer} | set(self.weights) | set(self.buffers)
        return [i.name for i in self._model.graph.input if i.name not in fed]

    def _lr_ortvalue(self) -> ort.OrtValue:
        if self._lr_value is None:
            self._lr_value = self._state.ortvalue(np.array(self._lr, np.float32))
        return self._lr_value

    def _run(self, kind: str, feeds: Mapping[str, object], state: Mapping[str, ort.OrtValue],
             per_run: Mapping[str, ort.OrtValue] = {}, run_options=None,
             into: Mapping[str, ort.OrtValue] = {}) -> dict[str, ort.OrtValue]:
        """Run graph ``kind`` with the user's ``feeds`` (validated), the ``state`` it updates
        (each ``X`` with its output ``X.updated``; bound once across runs, see ``_bound``) and
        the values it only reads this run (``per_run``); returns every output as an
        OrtValue, those named in ``into`` written there. Falls back to CPU once on a provider
        failure."""
        graph = self._graphs[kind]
        given = {**state, **per_run}
        checked = graph.check_feeds(feeds, given, self._check_labels if self._labels else None)
        user = {n: self._state.ortvalue(v) for n, v in checked.items()}
        try:
            if kind in _BOUND:
                return self._bound(kind, graph, state, {**user, **per_run}, run_options, into)
            return graph.run({**user, **given}, None, run_options)
        except _OrtErrors.InvalidArgument as exc:
            raise InvalidArgumentError(f"onnxruntime refused the inputs of the {kind} graph: {exc}") from exc
        except (_OrtErrors.Fail, _OrtErrors.RuntimeException, _OrtErrors.EPFail, RuntimeError) as exc:
            bound = {**user, **given}
            fixed = self._fixed_size_failure(kind, exc, bound, given)
            if fixed:
                raise InvalidArgumentError(fixed) from exc
            providers = self._graphs.providers
            if not self._fallback or self._state.device[0] == "cpu":
                raise ProviderError(f"onnxruntime failed running the {kind} graph on {providers[0]}: "
                                    f"{exc}") from exc
            compat.warn(f"{providers[0]} failed ({exc}); falling back to CPUExecutionProvider", RuntimeWarning)
            self.set_providers(["CPUExecutionProvider"])
            bound = {n: self._state.ortvalue(_numpy(v)) for n, v in bound.items()}
            return self._graphs[kind].run(bound, None, run_options)

    def _bound(self, kind: str, graph, state, per_run, run_options, into={}) -> dict[str, ort.OrtValue]:
        """A run through the graph's StepBinding (made again when the state was replaced since:
        a load, a device move, the other API): the state written after every read of it
        (``GraphCache.in_place``: the weights and the optimizer's states of a step) is updated
        in place, the rest alternates between two buffer sets. Returns the outputs, the new
        state as ``X.updated``."""
        read = {n: v for n, v in state.items() if n in graph.inputs and updated(n) not in graph.outputs}
        state = {n: v for n, v in state.items() if n in graph.inputs and updated(n) in graph.outputs}
        per_run = {**per_run, **read}
        binding = self._bindings.get(kind)
        if binding is None or binding.graph is not graph or not binding.holds(state):
            binding = self._bindings[kind] = StepBinding(graph, state, self._graphs.in_place(kind) & set(state))
        results, new_state = binding.run(per_run, run_options, into)
        results.update({updated(n): v for n, v in new_state.items()})
        return results

    def _fixed_size_failure(self, kind: str, exc: Exception, bound, state) -> str | None:
        """A run failed in a node whose target shape holds a size the export fixed: say which."""
        from ..compiler.torch_exports import fixed_size_failure

        graphs = [self._model.graph]
        if kind in self._graphs.built:
            graphs.append(onnx.ModelProto.FromString(self._graphs.built[kind]).graph)
        shapes = {n: v.shape() for n, v in bound.items() if n not in state}
        return fixed_size_failure(str(exc), graphs, shapes)

    def _lr_feed(self, feeds: Mapping[str, object]) -> tuple[dict[str, object], float | None]:
        """``feeds`` less the learning rate (onnxruntime-training's loops feed it with every
        step under ``lr_params_feed_name``), and that rate, checked; None when not fed."""
        lr_name = self._builder.lr_name
        if not isinstance(feeds, Mapping) or lr_name not in feeds:
            return feeds, None
        feeds = dict(feeds)
        value = np.asarray(_numpy(feeds.pop(lr_name)))
        if value.size != 1 or value.dtype.kind not in "fiu":
            raise InvalidArgumentError(f"'{lr_name}' (the learning rate) must be a number, got {value.dtype} "
                                       f"{list(value.shape)}")
        lr = float(value.reshape(()))
        if not np.isfinite(lr) or lr < 0:
            raise InvalidArgumentError(f"'{lr_name}' (the learning rate) must be finite and >= 0, got {lr}")
        return feeds, lr

    # ------------------------------------------------------------------ one full step
    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, object], run_options=None) -> list:
        """One training step (forward, backward, optimizer); returns ``output_names`` (None:
        every output of the model) as numpy arrays."""
        return [_numpy(v) for v in self.run_with_ort_values(output_names, input_feed, run_options)]

    def run_with_ort_values(self, output_names, input_feed, run_options=None) -> list[ort.OrtValue]:
        """``run`` taking and returning OrtValues (numpy arrays are accepted as feeds too)."""
        feeds, lr = self._lr_feed(input_feed)
        names = self._check_outputs(output_names)
        rate = self._lr_ortvalue() if lr is None or lr == self._lr else self._state.ortvalue(np.array(lr, np.float32))
        if self._dist is not None:
            results = self._dist.run(feeds, rate)
            missing = [n for n in names if n not in results]
            if missing:
                raise InvalidArgumentError(f"output_names: a pipeline-parallel step returns the loss "
                                           f"'{self.loss_name}' only, not {missing}")
        else:
            results = self._run("step", feeds, dict(self._state.values), {self._builder.lr_name: rate}, run_options)
            self._check_finite(results)
            self._state.commit(results)
        if lr is not None:
            self.set_learning_rate(lr)
        return [results[n] for n in names]

    def _check_outputs(self, output_names) -> list[str]:
        available = self._output_names() + ([w + GRADIENT for w in self.weights]
                                            if self._builder.gradients_as_outputs else [])
        if output_names is None:
            return self._output_names()
        if isinstance(output_names, str):
            raise InvalidArgumentError(f"output_names is a list of names, got the string {output_names!r}")
        unknown = [n for n in output_names if n not in available]
        if unknown:
            raise InvalidArgumentError(f"output_names: no output named {unknown}; the outputs are {available}")
        return list(output_names)

    def _check_finite(self, results: Mapping[str, ort.OrtValue]) -> None:
        """Count a step the graph skipped (its loss or gradients held an inf or NaN: it left
        the state as it was) and warn, or raise with ``on_nonfinite_step="raise"``. Under dynamic
        loss scaling such steps are the scale search's, counted without a warning."""
        if ALL_FINITE not in results or bool(results[ALL_FINITE].numpy()):
            return
        if LOSS_SCALE in self._state:
            self.skipped_steps += 1
            return
        message = (f"step {self.step + 1}: the loss or a gradient is inf or NaN; the update was skipped (weights, "
                   "optimizer state and running statistics unchanged)")
        if self._on_nonfinite == "raise":
            raise NonFiniteError(message)
        self.skipped_steps += 1
        compat.warn(f"{message}; {self.skipped_steps} skipped so far (TrainingSession.skipped_steps)", RuntimeWarning)

    def io_binding(self) -> "TrainingIOBinding":
        return TrainingIOBinding(self)

    def run_with_iobinding(self, iobinding: "TrainingIOBinding", run_options=None) -> None:
        """One training step with the inputs bound in ``iobinding``; its outputs then hold
        the bound outputs."""
        if not isinstance(iobinding, TrainingIOBinding) or iobinding._session is not self:
            raise InvalidArgumentError("run_with_iobinding takes the binding made by this session's io_binding()")
        names = list(iobinding._outputs)
        results = self.run_with_ort_values(names, iobinding._inputs, run_options)
        iobinding._results = results

    # ------------------------------------------------------------------ the step-wise API
    def train(self, mode: bool = True) -> "TrainingSession":
        self._training = bool(mode)
        return self

    def eval(self) -> "TrainingSession":
        return self.train(False)

    @property
    def training(self) -> bool:
        return self._training

    def __call__(self, *inputs):
        return self.train_step(*inputs) if self._training else self.eval_step(*inputs)

    def _positional(self, inputs) -> dict[str, object]:
        names = self._user_inputs()
        if len(inputs) == 1 and isinstance(inputs[0], Mapping):
            return dict(inputs[0])
        if len(inputs) != len(names):
            raise InvalidArgumentError(f"expected {len(names)} input(s) {names}, got {len(inputs)}")
        return dict(zip(names, inputs))

    def train_step(self, *inputs):
        """Forward and backward: returns the model's outputs; the gradients are added to the
        gradient buffers (or replace them after ``lazy_reset_grad``)."""
        if not self._training:
            raise InvalidArgumentError("train_step in eval mode; call train() first")
        if self._dist is not None:
            results = self._dist.train_step(self._positional(inputs), self._reset_grads)
            self._reset_grads = False
            return _user_result([_numpy(results[n]) for n in self._output_names()])
        kind = "gradients" if self._reset_grads else "accumulate"
        state = self._state.take(self.buffers)
        if kind == "accumulate":
            state.update({grad_accum(w): self._state.grads[w] for w in self.weights})
        results = self._run(kind, self._positional(inputs), state, self._state.take(self.weights))
        self._state.grads = {w: results[updated(grad_accum(w))] for w in self.weights}
        self._state.commit({updated(b): results[updated(b)] for b in self.buffers})
        self._reset_grads = False
        return _user_result([_numpy(results[n]) for n in self._output_names()])

    def eval_step(self, *inputs):
        """The forward with the current weights: returns the model's outputs."""
        if self._dist is not None and self._dist.topo.stages > 1:
            raise InvalidArgumentError("eval_step with pipeline_parallel_size > 1 is not supported: save a checkpoint "
                                       "and evaluate it in one process")
        results = self._run("eval", self._positional(inputs), self._state.take(self.weights + self.buffers))
        return _user_result([_numpy(results[n]) for n in self._output_names() if n in results])

    def lazy_reset_grad(self) -> None:
        """The next ``train_step`` replaces the gradient buffers instead of adding to them."""
        self._reset_grads = True

    def optimizer_step(self) -> None:
        """Update the weights with the accumulated gradients (clipped when the parameters ask)."""
        if not self._state.grads and (self._dist is None or self._dist.owned):  # (a ZeRO rank may own none)
            raise InvalidArgumentError("optimizer_step before any train_step: there are no gradients yet")
        if self._dist is not None:
            self._dist.optimizer_step(self._lr_ortvalue())
            return
        state = {n: v for n, v in self._state.values.items() if n not in (ACCUMULATION_STEP, *self.buffers)
                 and not n.endswith(GRAD_ACCUM)}
        per_run = {w + GRADIENT: self._state.grads[w] for w in self.weights}
        results = self._run("optimizer", {}, state, {**per_run, LEARNING_RATE: self._lr_ortvalue()})
        self._check_finite(results)
        self._state.commit(results)

    def get_learning_rate(self) -> float:
        return self._lr

    def set_learning_rate(self, learning_rate: float) -> None:
        lr = float(learning_rate)
        if not np.isfinite(lr) or lr < 0:
            raise InvalidArgumentError(f"learning rate must be finite and >= 0, got {learning_rate!r}")
        if lr != self._lr:
            self._lr, self._lr_value = lr, None

    def register_scheduler(self, scheduler, **kwargs):
        """Drive the learning rate by ``scheduler``: "linear" (warm-up then decay),
        "cosine", "constant_with_warmup", "step", a callable ``step -> lr``, or a schedule
        object from ``gradbuilder.runtime.schedulers``. The schedule starts from the current learning
        rate; ``scheduler_step()`` advances it."""
        if isinstance(scheduler, schedulers.Schedule):
            self._scheduler = scheduler
        else:
            self._scheduler = schedulers.make(scheduler, self._lr, **kwargs)
        self.set_learning_rate(self._scheduler.lr(self._scheduler.step_count))
        return self._scheduler

    def scheduler_step(self) -> float:
        if self._scheduler is None:
            raise InvalidArgumentError("scheduler_step without a scheduler; call register_scheduler first")
        self.set_learning_rate(self._scheduler.step())
        return self._lr

    def _parameter_values(self, trainable_only: bool) -> dict[str, np.ndarray]:
        values = {w: self._state.array(w) for w in self.weights}
        if not trainable_only:
            inits = {t.name: t for t in self._model.graph.initializer}
            values.update({n: numpy_helper.to_array(inits[n]) for n in self._frozen})
        return values

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        shapes = [self._state[w].shape() for w in self.weights]
        if not trainable_only:
            shapes += [t.dims for t in self._model.graph.initializer if t.name in self._frozen]
        return int(sum(np.prod(shape, dtype=np.int64) for shape in shapes))

    def get_contiguous_parameters(self, trainable_only: bool = True) -> ort.OrtValue:
        """Every parameter flattened into one float32 OrtValue, in ``get_state`` order."""
        flat = [v.astype(np.float32).ravel() for v in self._parameter_values(trainable_only).values()]
        return ort.OrtValue.ortvalue_from_numpy(np.concatenate(flat) if flat else np.zeros(0, np.float32))

    def copy_parameters_to_buffer(self, buffer, trainable_only: bool = True) -> None:
        """Copy the parameters into ``buffer`` (a float32 numpy array or CPU OrtValue of
        ``get_parameters_size`` elements)."""
        target = _writable_view(buffer, self.get_parameters_size(trainable_only))
        target[:] = _numpy(self.get_contiguous_parameters(trainable_only))

    def copy_buffer_to_parameters(self, buffer, trainable_only: bool = True) -> None:
        """Set the parameters from ``buffer`` (the layout of ``copy_parameters_to_buffer``)."""
        flat = np.asarray(_numpy(buffer) if isinstance(buffer, ort.OrtValue) else buffer).ravel()
        values = self._parameter_values(trainable_only)
        size = sum(v.size for v in values.values())
        if flat.size != size:
            raise InvalidArgumentError(f"buffer has {flat.size} elements; the parameters have {size}")
        offset, new = 0, {}
        for name, old in values.items():
            new[name] = flat[offset: offset + old.size].reshape(old.shape).astype(old.dtype)
            offset += old.size
        self._assign(new)

    def export_model_for_inferencing(self, inference_model_uri: str | os.PathLike,
                                     graph_output_names: Sequence[str]) -> str:
        """Write the forward model with the trained weights, keeping ``graph_output_names``."""
        if self._dist is not None and self._dist.topo.stages > 1:
            raise InvalidArgumentError("export_model_for_inferencing with pipeline_parallel_size > 1: each stage holds "
                                       "its own weights; save a checkpoint and export it from one process")
        from ..training.artifacts import export_model_for_inferencing

        proto = onnx.ModelProto()
        proto.CopyFrom(self._model)
        state = self.weights + self.buffers
        keep = [i for i in proto.graph.input if i.name not in state]
        del proto.graph.input[:]
        proto.graph.input.extend(keep)
        values = {n: self._state[n].numpy() for n in state}  # on the CPU a view of the state, no copy
        for n, v in values.items():  # the initializers' types; their values stay apart
            proto.graph.initializer.append(onnx.TensorProto(name=n, dims=v.shape,
                                                            data_type=onnx.helper.np_dtype_to_tensor_dtype(v.dtype)))
        return export_model_for_inferencing(modelio.DetachedModel(proto, values), inference_model_uri,
                                            graph_output_names)

    # ------------------------------------------------------------------ state
    def get_model_state(self, include_mixed_precision_weights: bool = False) -> dict:
        """{"full_precision": {weight: array}} (onnxruntime-training's layout); with mixed
        precision and ``include_mixed_precision_weights`` also {"mixed_precision": {weight:
        array}}: the float16 / bfloat16 copies the graph computes with (the float32 master
        weights cast, as the graph casts them)."""
        held = [w for w in self.weights + self.buffers if w in self._state]  # a pipeline stage: its own
        out = {"full_precision": {w: self._state.array(w) for w in held}}
        low = self._builder.mixed_precision
        if include_mixed_precision_weights and low is not None:
            dtype = np.float16 if low == "float16" else ml_dtypes.bfloat16
            out["mixed_precision"] = {w: out["full_precision"][w].astype(dtype) for w in self.weights}
        return out

    def get_optimizer_state(self) -> dict:
        """{weight: {state: array}, "shared_optimizer_state": {"Step": array}} (plus the
        dynamic loss scale and its counter, ``Loss_Scale`` and ``Loss_Scale_Good_Steps``).
        Under ZeRO, only the weights this rank owns (``get_partition_info_map``); a checkpoint
        holds all of them."""
        held = self.weights if self._dist is None else self._dist.owned
        out = {w: {s: self._state.array(state_of(w, s)) for s in self._builder.state_names_of(w)}
               for w in held}
        out["shared_optimizer_state"] = {n: self._state.array(n) for n in _SHARED if n in self._state}
        return out

    @property
    def recompute_report(self):
        """The recompute pass's report on the step graph (``passes.recompute.RecomputeReport``:
        what is recomputed, the activation-memory estimate before and after), or None."""
        return self._builder.recompute_report

    @property
    def loss_scale_input_name(self) -> str:
        """The graph input holding the dynamic loss scale ("" without dynamic loss scaling)."""
        return LOSS_SCALE if LOSS_SCALE in self._state else ""

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale: the dynamic one, the static ``loss_scale``, or None."""
        if LOSS_SCALE in self._state:
            return float(_numpy(self._state[LOSS_SCALE]))
        scaling = self._builder.loss_scaling
        return None if scaling is None else scaling.scale

    def get_state(self) -> dict:
        return {"model": self.get_model_state(), "optimizer": self.get_optimizer_state(), "partition_info": {}}

    def load_state(self, state_dict: Mapping, strict: bool = False) -> None:
        """Set weights and optimizer state from ``get_state()``'s layout (or a flat
        {name: array} dict with ``W``, ``W.<state>`` and ``Step`` names). Unknown names, and
        with ``strict`` missing ones, are errors; nothing changes unless everything fits."""
        if not isinstance(state_dict, Mapping):
            raise InvalidArgumentError(f"load_state takes a dict, got {type(state_dict).__name__}")
        flat = _flatten_state(state_dict)
        if strict:
            missing = [n for n in self._state_names() if n not in flat]
            if missing:
                raise InvalidArgumentError(f"load_state(strict=True): missing {missing}")
        self._assign(flat)

    def _state_names(self) -> list[str]:
        names = list(self.weights) + [n for n in _SHARED if n in self._state]
        names += list(self.buffers) + [state_of(w, s) for w in self.weights for s in self._builder.state_names_of(w)]
        return [n for n in names if n in self._state]  # under ZeRO, the state of the weights this rank owns

    def _assign(self, values: Mapping[str, np.ndarray], owned: bool = False) -> None:
        """Replace state values (and frozen parameters) after checking every name, shape and dtype;
        ``owned``: the arrays are the session's to keep (``StateStore.set``)."""
        frozen = {t.name: t for t in self._model.graph.initializer if t.name in self._frozen}
        if self._dist is not None:  # under ZeRO, other ranks hold the state of the weights they own
            values = {n: v for n, v in values.items() if n not in self._dist.elsewhere}
        unknown = [n for n in values if n not in self._state and n not in frozen]
        if unknown:
            raise InvalidArgumentError(f"no weight or optimizer state named {unknown} in this session "
                                       f"(it has {sorted(self._state_names())})")
        specs = {n: (tuple(t.dims), np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)))
                 for n, t in frozen.items() if n in values}
        specs.update({n: self._state.spec(n) for n in values if n not in frozen})
        checked = self._state.checked(values, specs)
        for name in [n for n in checked if n in frozen]:
            frozen[name].CopyFrom(numpy_helper.from_array(checked.pop(name), name))
            self._graphs.clear()  # the graphs hold the frozen values
        self._state.set(checked, owned=owned)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write weights, optimizer state, step, learning rate and scheduler state to ``path``
        (safetensors, written atomically; see ``gradbuilder.runtime.checkpoint``)."""
        path = files.check_output_path(path, CheckpointError, "checkpoint")  # before the state is read
        tensors = {n: self._state[n] for n in self._state}  # OrtValues, written from their own memory
        tensors.update({f"{w}.grad": v for w, v in self._state.grads.items()})
        if self._dist is not None:  # one checkpoint, written by the first rank from copies (gathered averages in place)
            tensors = self._dist.gathered({n: np.array(v.numpy(), copy=True) for n, v in tensors.items()},
                                          f"gathering the state for checkpoint {os.fspath(path)}")
            if tensors is None:
                return
        metadata = {
            "model": self._fingerprint,
            "optimizer": json.dumps({"name": self._builder.optimizer, "options": _jsonable(self._builder.optimizer_options),
                                     "per_weight": {w: _jsonable(o) for w, o in self._builder.per_weight_options.items()}}),
            "learning_rate": repr(self._lr),
            "scheduler": json.dumps(self._scheduler.state_dict()) if self._scheduler is not None else "",
            "reset_grads": str(self._reset_grads),
            "properties": _properties_json(self.properties),
            "skipped_steps": str(self.skipped_steps),
        }
        checkpoint.save(path, tensors, metadata)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Resume from ``save_checkpoint``'s file: verified first (integrity, the same model
        and optimizer); the session changes only when all of it fits. On the CPU the tensors are
        read straight into the state's own memory once the whole file has been checked."""
        reader = checkpoint.open_checkpoint(path)
        specs, metadata = reader.specs, reader.metadata
        between = metadata.get("model") != self._fingerprint and self._between == fingerprint(
            self.weights, _without_accumulation({n: v for n, v in specs.items() if not n.endswith(".grad")}),
            self._builder.optimizer)
        if between:
            step = int(reader.value(ACCUMULATION_STEP)) if ACCUMULATION_STEP in specs else 0
            if step:
                raise CheckpointError(f"checkpoint {os.fspath(path)} was saved in the middle of a gradient accumulation"
                                      f" (Accumulation_Step {step}); resume it with the gradient_accumulation_steps it "
                                      "was saved with")
        elif metadata.get("model") != self._fingerprint:
            ours, theirs = set(self._state), {n for n in specs if not n.endswith(".grad")}
            detail = []
            if theirs - ours:
                detail.append(f"it has {sorted(theirs - ours)[:5]} which this session does not")
            if ours - theirs:
                detail.append(f"it lacks {sorted(ours - theirs)[:5]}")
            for n in sorted(ours & theirs):
                if tuple(specs[n].shape) != tuple(self._state[n].shape()):
                    detail.append(f"'{n}' is {list(specs[n].shape)}, here {list(self._state[n].shape())}")
                    break
            raise CheckpointError(f"checkpoint {os.fspath(path)} was saved from another model or optimizer"
                                  + (": " + "; ".join(detail) if detail else ""))
        into = {}  # the state's own memory, written once the whole file is checked
        if self._dist is None and self._state.device[0] == "cpu":
            into = {n: self._state[n].numpy() for n, v in specs.items() if n in self._state
                    and not (between and n not in _without_accumulation({n: v}))
                    and self._state.spec(n) == (v.shape, v.dtype)}
        tensors = reader.read(into)
        if between:
            tensors = _without_accumulation(tensors)
            tensors.update({n: np.zeros(*self._state.spec(n)) for n in self._state
                            if n == ACCUMULATION_STEP or n.endswith(GRAD_ACCUM)})
        grads = {n[: -len(".grad")]: v for n, v in tensors.items() if n.endswith(".grad")}
        state = {n: v for n, v in tensors.items() if not n.endswith(".grad") and n not in into}
        if self._dist is not None:  # the state this rank holds (ZeRO: its weights' share)
            grads = {w: v for w, v in grads.items() if w in self._dist.owned}
        scheduler = None
        if metadata.get("scheduler"):
            scheduler = schedulers.from_state_dict(json.loads(metadata["scheduler"]),
                                                   fn=getattr(self._scheduler, "fn", None))
        lr = float(metadata.get("learning_rate", self._lr))
        properties = json.loads(metadata.get("properties") or "{}")
        skipped_steps = int(metadata.get("skipped_steps", 0))
        self._assign(state, owned=True)  # checkpoint.load's arrays are new: the state takes them as they are
        self.properties = properties
        self.skipped_steps = skipped_steps
        self._state.grads = {w: self._state.ortvalue(v) for w, v in grads.items()}
        self._reset_grads = metadata.get("reset_grads", "True") == "True" or not self._state.grads
        self._scheduler = scheduler if scheduler is not None else self._scheduler
        self.set_learning_rate(lr)

    # ------------------------------------------------------------------ session facts
    def get_inputs(self):
        """The inputs a step feeds: the model's inputs (onnxruntime NodeArgs)."""
        graph = self._graphs["step"]
        return [graph.inputs[n] for n in self._user_inputs()]

    def get_outputs(self):
        graph = self._graphs["step"]
        args = {a.name: a for a in graph.session.get_outputs()}
        return [args[n] for n in self._output_names()]

    def get_overridable_initializers(self):
        return self._graphs["step"].session.get_overridable_initializers()

    def get_modelmeta(self):
        return self._graphs["step"].session.get_modelmeta()

    def get_providers(self) -> list[str]:
        return list(self._graphs.providers)

    def get_provider_options(self) -> dict:
        return {p: dict(o) for p, o in zip(self._graphs.providers, self._graphs.provider_options)}

    def get_session_options(self) -> ort.SessionOptions:
        return self._sess_options

    def set_providers(self, providers: Sequence | None = None, provider_options: Sequence[dict] | None = None) -> None:
        """Run on other providers: the graphs are loaded again; weights and optimizer state
        move to the new device and are kept."""
        names, options = _resolve_providers(providers, provider_options, self._params.allow_tf32)
        device = _providers.device_of(names, options)
        self._check_precision(device)
        self._graphs.set_providers(names, options, device)
        if device != self._state.device:
            self._state.move_to(device)
            self._lr_value = None

    def enable_fallback(self) -> None:
        """On an execution-provider failure, carry on with CPUExecutionProvider (the default)."""
        self._fallback = True

    def disable_fallback(self) -> None:
        self._fallback = False

    def end_profiling(self) -> str:
        """End profiling of the step graph (``sess_options.enable_profiling``); returns the file."""
        return self._graphs["step"].session.end_profiling()

    def get_profiling_start_time_ns(self) -> int:
        return self._graphs["step"].session.get_profiling_start_time_ns()

    def get_partition_info_map(self) -> dict:
        """Which weights' optimizer state this process holds under ZeRO: {weight: {"owner":
        rank}} for every weight; {} when nothing is partitioned."""
        if self._dist is None or not self._dist.zero:
            return {}
        return {w: {"owner": r} for w, r in self._dist.owner.items()}

    def is_output_fp32_node(self, output_name: str) -> bool:
        """Whether ``output_name`` is a float32 output (always its own type: no mixed precision)."""
        types = {o.name: o.type.tensor_type.elem_type for o in self._model.graph.output}
        return types.get(output_name) == onnx.TensorProto.FLOAT

    @property
    def scheduler(self):
        """The registered learning-rate schedule, or None."""
        return self._scheduler

    @property
    def data_shard(self) -> tuple[int, int]:
        """(this process's replica, the number of replicas): in data-parallel training each
        replica trains on its share of every batch; (0, 1) in one process."""
        if self._dist is None:
            return 0, 1
        return self._dist.topo.replica, self._dist.topo.replicas

    @property
    def step(self) -> int:
        """Optimizer updates done so far."""
        return int(_numpy(self._state[STEP]))


class TrainingIOBinding:
    """onnxruntime's IOBinding for a training step: bind the model's inputs and outputs; the
    session binds its own state. Outputs are left on the execution device."""

    def __init__(self, session: TrainingSession):
        self._session = session
        self._inputs: dict[str, object] = {}
        self._outputs: dict[str, None] = {}
        self._results: list[ort.OrtValue] = []

    def bind_cpu_input(self, name: str, arr: np.ndarray) -> None:
        self._inputs[name] = np.asarray(arr)

    def bind_ortvalue_input(self, name: str, ortvalue: ort.OrtValue) -> None:
        self._inputs[name] = ortvalue

    def bind_input(self, name, device_type, device_id, element_type, shape, buffer_ptr) -> None:
        raise InvalidArgumentError("bind_input with a raw pointer is not supported for training; "
                                   "use bind_ortvalue_input or bind_cpu_input")

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0, element_type=None,
                    shape=None, buffer_ptr=None) -> None:
        self._outputs[name] = None

    def bind_ortvalue_output(self, name: str, ortvalue=None) -> None:
        self._outputs[name] = None

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()

    def get_outputs(self) -> list[ort.OrtValue]:
        return list(self._results)

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        return [_numpy(v) for v in self._results]

    def synchronize_inputs(self) -> None:
        pass

    def synchronize_outputs(self) -> None:
        pass


# ---------------------------------------------------------------------------- helpers
_OrtErrors = ort.capi.onnxruntime_pybind11_state
_BOUND = ("step", "gradients", "accumulate", "optimizer")  # the kinds whose state stays bound
_CLASS_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")


def _resolve_providers(providers, provider_options, allow_tf32: bool = False):
    """``providers.resolve_providers``, its warnings (a provider not usable here) pointing at
    the user's call."""
    with compat.warnings_at_caller():
        return _providers.resolve_providers(providers, provider_options, allow_tf32)


def _default_session_options() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 2  # onnxruntime's warnings reach the user; the graphs give it none of its own
    return so


def _numpy(value):
    return value.numpy() if isinstance(value, ort.OrtValue) else value


def _user_result(values: list):
    return values[0] if len(values) == 1 else values


def _writable_view(buffer, size: int) -> np.ndarray:
    if isinstance(buffer, ort.OrtValue):
        if buffer.device_name().lower() != "cpu":
            raise InvalidArgumentError("copy_parameters_to_buffer: the buffer must be a CPU OrtValue")
        view = buffer.numpy()  # shares the OrtValue's memory on CPU
    elif isinstance(buffer, np.ndarray):
        view = buffer
    else:
        raise InvalidArgumentError(f"buffer must be a numpy array or OrtValue, got {type(buffer).__name__}")
    if view.size != size or view.dtype != np.float32:
        raise InvalidArgumentError(f"buffer must be float32 with {size} elements, got {view.dtype} {view.size}")
    return view.reshape(-1)


def _flatten_state(state: Mapping) -> dict[str, np.ndarray]:
    """get_state()'s nested layout (or a flat dict) as {name: array}."""
    if "model" not in state and "optimizer" not in state:
        return dict(state)
    flat = dict(state.get("model", {}).get("full_precision", {}))
    for weight, states in state.get("optimizer", {}).items():
        for s, value in states.items():
            flat[s if weight == "shared_optimizer_state" else f"{weight}.{s}"] = value
    return flat


def _without_accumulation(state: Mapping) -> dict:
    return {n: v for n, v in state.items() if n != ACCUMULATION_STEP and not n.endswith(GRAD_ACCUM)}


def _properties_json(properties) -> str:
    bad = {k: type(v).__name__ for k, v in properties.items()
           if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float, str))}
    if bad:
        raise InvalidArgumentError(f"TrainingSession.properties holds int, float or str values under str keys; got {bad}")
    return json.dumps(properties, sort_keys=True)


def _jsonable(options: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}


