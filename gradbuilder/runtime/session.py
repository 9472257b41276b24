"""TrainingSession: train an ONNX model on stock onnxruntime.

    >>> params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw")
    >>> sess = TrainingSession("model.onnx", params)
    >>> sess.set_learning_rate(1e-3)
    >>> loss, = sess.run(["loss"], {"x": x, "y": y})        # one full step

The forward model and the ``TrainingParameters`` are turned into ONNX graphs in standard
operators (``gradbuilder.training``); the session is a facade over:

- ``model.ModelFacts``: what the model holds (weights, running statistics, frozen
  parameters, their specs, the step's inputs and outputs), derived once;
- ``graphs.GraphCache``: each kind of graph (``graphs.Kind``: the full ``step`` for ``run``,
  ``gradients`` / ``accumulate`` for ``train_step``, ``optimizer`` for ``optimizer_step``,
  ``eval`` for ``eval_step``), built and compiled on first use;
- ``state.StateStore``: the training state between steps;
- ``executor``: how the steps run, in this process (``LocalExecutor``, each graph bound and
  run with IOBinding through ``runner``) or across processes (``distributed``): one interface,
  so the session never asks which.

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

from .. import files
from ..errors import CheckpointError, InvalidArgumentError
from ..interface import ACCUMULATION_STEP, GRAD_ACCUM, GRADIENT, LOSS_SCALE, LOSS_SCALE_GOOD_STEPS, STEP, state_of
from ..training.graph import from_parameters
from ..training.stages import flat
from ..training.stages.optimizer import jsonable
from . import capture, checkpoint, distributed, providers as _providers, schedulers
from .executor import Executor, LocalExecutor, Parts, check_device, resolve_providers
from .graphs import GraphCache, Kind
from .model import ModelFacts, output_names, read_model
from ..training.loaded import LoadedModel, load
from .state import StateStore, without_accumulation
from ..compiler.detached import DetachedModel

_SHARED = (STEP, LOSS_SCALE, LOSS_SCALE_GOOD_STEPS)  # state shared by every weight


class TrainingSession:
    """Trains ``path_or_bytes`` (a forward ONNX model whose loss is ``parameters.loss_output_name``,
    or a ``training.loaded.LoadedModel`` loaded with the same parameters)
    on onnxruntime. The model and ``parameters`` are never modified."""

    def __init__(self, path_or_bytes, parameters, sess_options: ort.SessionOptions | None = None,
                 providers: Sequence | None = None, provider_options: Sequence[dict] | None = None,
                 base_dir: str | os.PathLike | None = None):
        from ..training.params import TrainingParameters

        if not isinstance(parameters, TrainingParameters):
            raise InvalidArgumentError(f"parameters must be a gradbuilder.TrainingParameters, got "
                                       f"{type(parameters).__name__}")
        params = TrainingParameters.from_dict(parameters.to_dict())
        loaded = path_or_bytes if isinstance(path_or_bytes, LoadedModel) else load(path_or_bytes, params, base_dir,
                                                                                    strict=True)
        if params.loss_output_name and loaded.loss != params.loss_output_name:
            raise InvalidArgumentError(f"the loaded model's loss is '{loaded.loss}' but TrainingParameters."
                                       f"loss_output_name is '{params.loss_output_name}'; load it with these parameters")
        model, frozen, constants = read_model(loaded)
        source = DetachedModel(model, constants)  # its dict of constants is the facts': one place to change them
        self._builder = from_parameters(source, params, outputs=output_names(model, params.loss_output_name),
                                        weights=loaded.weights, warn_about_model=False)  # load said it
        self._facts, initial = ModelFacts.derive(model, self._builder, loaded.buffers, frozen, loaded.values,
                                                 source.weights)
        del loaded
        self._sess_options = sess_options or _default_session_options()
        if params.deterministic_compute:  # onnxruntime's own choices too (CUDA's convolution algorithms)
            self._sess_options = _providers.options_with(self._sess_options, use_deterministic_compute=True)
        names, options = resolve_providers(providers, provider_options, params.allow_tf32)
        topo = distributed.topology(params)  # checked before anything is placed on a device
        if topo is not None:
            options = distributed.one_device_per_process(names, options)
        device = _providers.device_of(names, options)
        check_device(params, device, topo is not None)
        # One flat buffer per dtype and options for the weights and each of their states, the
        # step updating each in a few nodes (training.stages.flat), where the parameters or the
        # device ask for it (optimizer_state_layout); a distributed step keeps a tensor per
        # weight (its buckets, shards and stages are by weight).
        layout = params.optimizer_state_layout
        grouped = layout == "flat" or (layout == "auto" and device[0] != "cpu")
        groups = (flat.layout(self._facts.specs, self._builder.options_of, self._builder.optimizer)
                  if topo is None and grouped else [])
        self._builder.flat_layout = groups
        suffixes = ["", GRAD_ACCUM] + [f".{s}" for w in self.weights for s in self._builder.state_names_of(w)]
        self._state = StateStore(initial, device, groups, dict.fromkeys(suffixes))
        del initial
        self._graphs = GraphCache(self._facts, self._builder, self._sess_options, names, options, device)
        self._parts = Parts(self._facts, self._builder, self._state, self._graphs, params)
        self._executor = executor_for(self._parts, topo)  # one of several launched processes: a distributed one
        self._training = True
        self._lr = 1e-3
        self._scheduler = None
        self._reset_grads = True
        # the caller's values saved with each checkpoint (as onnxruntime's CheckpointState.properties)
        self.properties: dict[str, int | float | str] = {}

    # ------------------------------------------------------------------ the model's facts
    @property
    def weights(self) -> list[str]:
        """The weights being trained."""
        return self._facts.weights

    @property
    def buffers(self) -> list[str]:
        """The running statistics: updated by training, not trained."""
        return self._facts.buffers

    @property
    def loss_name(self) -> str:
        return self._facts.loss

    @property
    def skipped_steps(self) -> int:
        """Updates skipped because the loss or gradients were not finite."""
        return self._parts.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._parts.skipped_steps = value

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
        rate = self._state.scalar(self._lr) if lr is None or lr == self._lr else self._state.ortvalue(
            np.array(lr, np.float32))
        results = self._executor.run(feeds, rate, names, run_options)
        if lr is not None:
            self.set_learning_rate(lr)
        return [results[n] for n in names]

    def _check_outputs(self, output_names) -> list[str]:
        available = self._facts.outputs + ([w + GRADIENT for w in self.weights]
                                           if self._builder.gradients_as_outputs else [])
        if output_names is None:
            return list(self._facts.outputs)
        if isinstance(output_names, str):
            raise InvalidArgumentError(f"output_names is a list of names, got the string {output_names!r}")
        unknown = [n for n in output_names if n not in available]
        if unknown:
            raise InvalidArgumentError(f"output_names: no output named {unknown}; the outputs are {available}")
        return list(output_names)

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
        names = self._facts.inputs
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
        results = self._executor.train_step(self._positional(inputs), self._reset_grads)
        self._reset_grads = False
        return _user_result([_numpy(results[n]) for n in self._facts.outputs])

    def eval_step(self, *inputs):
        """The forward with the current weights: returns the model's outputs."""
        self._executor.check("eval_step")
        results = self._executor.eval(self._positional(inputs))
        return _user_result([_numpy(results[n]) for n in self._facts.outputs if n in results])

    def lazy_reset_grad(self) -> None:
        """The next ``train_step`` replaces the gradient buffers instead of adding to them."""
        self._reset_grads = True

    def optimizer_step(self) -> None:
        """Update the weights with the accumulated gradients (clipped when the parameters ask)."""
        if not self._state.grads and self._executor.owned:  # (a ZeRO rank may own none)
            raise InvalidArgumentError("optimizer_step before any train_step: there are no gradients yet")
        self._executor.optimizer_step(self._state.scalar(self._lr))

    def get_learning_rate(self) -> float:
        return self._lr

    def set_learning_rate(self, learning_rate: float) -> None:
        lr = float(learning_rate)
        if not np.isfinite(lr) or lr < 0:
            raise InvalidArgumentError(f"learning rate must be finite and >= 0, got {learning_rate!r}")
        self._lr = lr

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
            values.update({n: self._facts.frozen_value(n) for n in self._facts.frozen_initializers()})
        return values

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        shapes = [self._state[w].shape() for w in self.weights]
        if not trainable_only:
            shapes += [t.dims for t in self._facts.frozen_initializers().values()]
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
        self._executor.check("export_model_for_inferencing")
        from ..training.artifacts import export_model_for_inferencing

        proto = onnx.ModelProto()
        proto.CopyFrom(self._facts.model)
        state = self._facts.state
        keep = [i for i in proto.graph.input if i.name not in state]
        del proto.graph.input[:]
        proto.graph.input.extend(keep)
        values = {n: self._state[n].numpy() for n in state}  # on the CPU a view of the state, no copy
        for n, v in values.items():  # the initializers' types; their values stay apart
            proto.graph.initializer.append(onnx.TensorProto(name=n, dims=v.shape,
                                                            data_type=onnx.helper.np_dtype_to_tensor_dtype(v.dtype)))
        return export_model_for_inferencing(DetachedModel(proto, {**self._facts.constants, **values}),
                                            inference_model_uri, graph_output_names)

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
        held = self._executor.owned
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
        frozen = self._facts.frozen_initializers()
        elsewhere = self._executor.elsewhere  # under ZeRO, other ranks hold the state of the weights they own
        values = {n: v for n, v in values.items() if n not in elsewhere}
        unknown = [n for n in values if n not in self._state and n not in frozen]
        if unknown:
            raise InvalidArgumentError(f"no weight or optimizer state named {unknown} in this session "
                                       f"(it has {sorted(self._state_names())})")
        specs = {n: (tuple(t.dims), np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)))
                 for n, t in frozen.items() if n in values}
        specs.update({n: self._state.spec(n) for n in values if n not in frozen})
        checked = self._state.checked(values, specs)
        for name in [n for n in checked if n in frozen]:
            value = checked.pop(name)
            if name in self._facts.constants:  # the builder's model shares the dict
                self._facts.constants[name] = value
            else:
                frozen[name].CopyFrom(numpy_helper.from_array(value, name))
            self._graphs.clear()  # the graphs hold the frozen values
        self._state.set(checked, owned=owned)

    # ------------------------------------------------------------------ checkpoints
    def holds_whole_state(self) -> bool:
        """Whether this process alone holds the whole training state (always, but in a
        distributed session with ZeRO, pipeline stages or per-process accumulated gradients)."""
        return self._executor.holds_whole_state

    def save_checkpoint(self, path: str | os.PathLike, this_process_only: bool = False) -> None:
        """Write weights, optimizer state, step, learning rate and scheduler state to ``path``
        (safetensors, written atomically; see ``gradbuilder.runtime.checkpoint``). In a
        distributed session every process calls it and the first writes; with
        ``this_process_only`` (where ``holds_whole_state()``: after another process died) this
        one writes it alone."""
        path = files.check_output_path(path, CheckpointError, "checkpoint")  # before the state is read
        contents = self.checkpoint_contents(path, this_process_only)
        if contents is not None:
            checkpoint.save(path, *contents)

    def checkpoint_contents(self, path: str | os.PathLike, this_process_only: bool = False,
                            copy: bool = False) -> tuple[dict, dict] | None:
        """(tensors, metadata) of the checkpoint ``save_checkpoint(path)`` writes, None on the
        processes of a distributed session that do not write it (every process calls it). The
        tensors are the state's own memory (OrtValues), or with ``copy`` numpy copies that
        training may go on beside (a checkpoint written in the background)."""
        if this_process_only and not self.holds_whole_state():
            raise InvalidArgumentError("save_checkpoint(this_process_only=True): this process holds only part of the "
                                       "state (ZeRO, a pipeline stage or its own accumulated gradients)")
        tensors = {n: self._state[n] for n in self._state}  # OrtValues, written from their own memory
        tensors.update({f"{w}.grad": v for w, v in self._state.grads.items()})
        # one checkpoint: the distributed executors gather it on the first rank (None on the others)
        if not this_process_only:
            tensors = self._executor.checkpoint_tensors(tensors, f"gathering the state for checkpoint "
                                                                 f"{os.fspath(path)}")
        if tensors is None:
            return None
        if copy:  # the state's own memory copied; a distributed gather's arrays are copies already
            tensors = {n: np.array(v.numpy(), copy=True) if isinstance(v, ort.OrtValue) else v
                       for n, v in tensors.items()}
        metadata = {
            "model": self._facts.identity.model,
            "optimizer": json.dumps({"name": self._builder.optimizer, "options": jsonable(self._builder.optimizer_options),
                                     "per_weight": {w: jsonable(o) for w, o in self._builder.per_weight_options.items()}}),
            "learning_rate": repr(self._lr),
            "scheduler": json.dumps(self._scheduler.state_dict()) if self._scheduler is not None else "",
            "reset_grads": str(self._reset_grads),
            "properties": _properties_json(self.properties),
            "skipped_steps": str(self.skipped_steps),
        }
        return tensors, metadata

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Resume from ``save_checkpoint``'s file: verified first (integrity, the same model
        and optimizer); the session changes only when all of it fits. On the CPU the tensors are
        read straight into the state's own memory once the whole file has been checked."""
        reader = checkpoint.open_checkpoint(path)
        specs, metadata = reader.specs, reader.metadata
        between = checkpoint.resumes(path, reader, self._facts.identity,
                                     {n: tuple(self._state[n].shape()) for n in self._state})
        into = {}  # the state's own memory, written once the whole file is checked
        if self._executor.reads_into_state:
            into = {n: self._state[n].numpy() for n, v in specs.items() if n in self._state
                    and not (between and n not in without_accumulation({n: v}))
                    and self._state.spec(n) == (v.shape, v.dtype)}
        tensors = reader.read(into)
        if between:
            tensors = without_accumulation(tensors)
            tensors.update({n: np.zeros(*self._state.spec(n)) for n in self._state
                            if n == ACCUMULATION_STEP or n.endswith(GRAD_ACCUM)})
        grads = {n[: -len(".grad")]: v for n, v in tensors.items() if n.endswith(".grad")}
        state = {n: v for n, v in tensors.items() if not n.endswith(".grad") and n not in into}
        grads = self._executor.owned_grads(grads)  # the state this rank holds (ZeRO: its weights' share)
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
        graph = self._graphs[Kind.STEP]
        return [graph.inputs[n] for n in self._facts.inputs]

    def get_outputs(self):
        graph = self._graphs[Kind.STEP]
        args = {a.name: a for a in graph.session.get_outputs()}
        return [args[n] for n in self._facts.outputs]

    def get_overridable_initializers(self):
        return self._graphs[Kind.STEP].session.get_overridable_initializers()

    def get_modelmeta(self):
        return self._graphs[Kind.STEP].session.get_modelmeta()

    def get_providers(self) -> list[str]:
        return list(self._graphs.providers)

    def get_provider_options(self) -> dict:
        return {p: dict(o) for p, o in zip(self._graphs.providers, self._graphs.provider_options)}

    def get_session_options(self) -> ort.SessionOptions:
        return self._sess_options

    def set_providers(self, providers: Sequence | None = None, provider_options: Sequence[dict] | None = None) -> None:
        """Run on other providers: the graphs are loaded again; weights and optimizer state
        move to the new device and are kept."""
        self._executor.place(providers, provider_options)

    def enable_fallback(self) -> None:
        """On an execution-provider failure, carry on with CPUExecutionProvider (the default)."""
        self._parts.fallback = True

    def disable_fallback(self) -> None:
        self._parts.fallback = False

    def end_profiling(self) -> str:
        """End profiling of the step graph (``sess_options.enable_profiling``); returns the file."""
        return self._graphs[Kind.STEP].session.end_profiling()

    def get_profiling_start_time_ns(self) -> int:
        return self._graphs[Kind.STEP].session.get_profiling_start_time_ns()

    def get_partition_info_map(self) -> dict:
        """Which weights' optimizer state this process holds under ZeRO: {weight: {"owner":
        rank}} for every weight; {} when nothing is partitioned."""
        return self._executor.partition_info()

    def is_output_fp32_node(self, output_name: str) -> bool:
        """Whether ``output_name`` is a float32 output (always its own type: no mixed precision)."""
        types = {o.name: o.type.tensor_type.elem_type for o in self._facts.model.graph.output}
        return types.get(output_name) == onnx.TensorProto.FLOAT

    @property
    def scheduler(self):
        """The registered learning-rate schedule, or None."""
        return self._scheduler

    @property
    def data_shard(self) -> tuple[int, int]:
        """(this process's replica, the number of replicas): in data-parallel training each
        replica trains on its share of every batch; (0, 1) in one process."""
        return self._executor.shard

    @property
    def step(self) -> int:
        """Optimizer updates done so far."""
        return self._executor.step

    # ------------------------------------------------------------------ what the session is a facade over
    @property
    def state(self) -> StateStore:
        """The training state as the steps read and write it, on the execution device
        (``state.StateStore``, onnxruntime-training's CheckpointState in this session's layout):
        ``state[name]`` the OrtValue of a weight, running statistic, optimizer state or shared
        scalar (``Step``, the loss scale), ``array(name)`` a numpy copy of it, ``grads`` the
        step-wise API's gradients, ``flat`` the buffers of a flat layout. Change it with
        ``load_state`` or ``load_checkpoint``, which check what they are given."""
        return self._state

    @property
    def graphs(self) -> GraphCache:
        """The session's graphs (``graphs.GraphCache``), each built and compiled on first use:
        ``graphs[kind]`` (``graphs.Kind``: "step", "gradients", "accumulate", "optimizer",
        "eval") the compiled graph with its onnxruntime session, ``serialized(kind)`` its ONNX
        model, ``in_place(kind)`` the state it updates in its own buffers."""
        return self._graphs

    @property
    def executor(self) -> Executor:
        """How the steps run (``executor.Executor``): a ``LocalExecutor`` in this process, a
        ``capture.CapturedExecutor`` with ``enable_cuda_graph``, or a distributed one
        (``DataParallel``, ``PipelineParallel``) over a local one."""
        return self._executor

    def set_executor(self, executor: Executor) -> None:
        """Run the steps with ``executor`` from now on, one made over this session's ``parts``:
        ``capture.CapturedExecutor(session.parts)`` runs the captured step's bindings on the CPU,
        where ``enable_cuda_graph`` is refused."""
        if not isinstance(executor, Executor) or executor.parts is not self._parts:
            raise InvalidArgumentError("set_executor takes an executor made over this session's parts "
                                       "(session.parts)")
        self._executor = executor

    @property
    def parts(self) -> Parts:
        """What the session and its executor share (``executor.Parts``): the model's ``facts``
        (``model.ModelFacts``: weights, specs, identity), the graph ``builder``
        (``training.graph.TrainingGraphBuilder``), the ``state``, the ``graphs`` and the
        session's copy of the parameters (``params``)."""
        return self._parts


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


def _properties_json(properties) -> str:
    bad = {k: type(v).__name__ for k, v in properties.items()
           if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float, str))}
    if bad:
        raise InvalidArgumentError(f"TrainingSession.properties holds int, float or str values under str keys; got {bad}")
    return json.dumps(properties, sort_keys=True)



def executor_for(parts: Parts, topo) -> Executor:
    """The executor of a session: a LocalExecutor, or with ``topo`` (``distributed.topology``:
    one of several launched processes) a DataParallel or PipelineParallel over one."""
    if topo is None:
        return capture.CapturedExecutor(parts) if parts.params.enable_cuda_graph else LocalExecutor(parts)
    local = LocalExecutor(parts)
    distributed.init_process_group(parts.state.device)
    if topo.stages == 1:
        from .distributed.data_parallel import DataParallel

        return DataParallel(local, topo, parts.params)
    from .distributed.pipeline_parallel import PipelineParallel

    return PipelineParallel(local, topo, parts.params)
