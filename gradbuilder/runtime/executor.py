"""How a session's steps run: one interface (:class:`Executor`), run in this process by
:class:`LocalExecutor` or across processes by the distributed executors
(``distributed.data_parallel.DataParallel``, ``distributed.pipeline_parallel.PipelineParallel``).

A ``TrainingSession`` holds one executor (:func:`executor_for` picks it) and never asks which
one: ``run`` (a full step), ``train_step`` / ``optimizer_step`` (the step-wise API), ``eval``,
the state each process holds (``owned``, ``elsewhere``, ``owned_grads``), checkpoint gathering
(``checkpoint_tensors``) and providers (``place``). The executors share one small record,
:class:`Parts` (the model's facts, the graph builder, the state, the graph cache, the
parameters, the fallback switch and the count of skipped steps); the distributed ones run
their graphs through the local executor's ``run_graph``. Another way of running a step (a
captured CUDA graph) is one more executor of the same surface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import onnx
import onnxruntime as ort

from .. import compat
from ..errors import InvalidArgumentError, NonFiniteError, ProviderError
from ..interface import (ACCUMULATION_STEP, ALL_FINITE, GRAD_ACCUM, GRADIENT, LEARNING_RATE, LOSS_SCALE, STEP,
                         grad_accum, updated)
from . import providers as _providers
from .graphs import GraphCache, Kind
from .model import ModelFacts, check_labels
from .runner import StepBinding
from .state import StateStore

_OrtErrors = ort.capi.onnxruntime_pybind11_state
# What onnxruntime raises when a run fails on its provider (a refused input aside): the errors
# a run falls back to CPU on, or reports as a ProviderError.
RUN_FAILURES = (_OrtErrors.Fail, _OrtErrors.RuntimeException, _OrtErrors.EPFail, RuntimeError)


@dataclass
class Parts:
    """What a session and its executors share: the model's ``facts``, the graph ``builder``,
    the ``state``, the ``graphs``, the session's ``params`` (a private copy), whether a provider
    failure falls back to CPU (``fallback``) and the updates skipped because the loss or the
    gradients were not finite (``skipped_steps``)."""

    facts: ModelFacts
    builder: object  # training.graph.TrainingGraphBuilder
    state: StateStore
    graphs: GraphCache
    params: object  # training.params.TrainingParameters
    fallback: bool = True
    skipped_steps: int = 0


class Executor:
    """The surface every executor has (see the module's docstring); ``parts`` is the shared record."""

    parts: Parts
    owned: list[str]  # the weights whose optimizer state this process holds and updates
    elsewhere: frozenset[str] | set[str] = frozenset()  # state names other processes hold
    shard: tuple[int, int] = (0, 1)  # (this process's replica, the number of replicas)

    def run(self, feeds: Mapping[str, object], rate: ort.OrtValue, outputs: Sequence[str],
            run_options=None) -> dict[str, ort.OrtValue]:
        """One full step (forward, backward, optimizer) at learning rate ``rate``; returns the
        step's outputs (at least ``outputs``), the state committed."""
        raise NotImplementedError

    def train_step(self, feeds: Mapping[str, object], reset: bool) -> dict[str, ort.OrtValue]:
        """Forward and backward: the gradients replace (``reset``) or add to ``state.grads``."""
        raise NotImplementedError

    def optimizer_step(self, rate: ort.OrtValue) -> None:
        """The update with ``state.grads``."""
        raise NotImplementedError

    def eval(self, feeds: Mapping[str, object]) -> dict[str, ort.OrtValue]:
        """The forward in inference form with the current weights."""
        raise NotImplementedError

    def check(self, call: str) -> None:
        """Refuse the session's ``call`` (``"eval_step"``, ``"export_model_for_inferencing"``)
        when this executor cannot serve it."""

    def place(self, providers, provider_options=None) -> None:
        """Run on other providers: the graphs are compiled again, the state moves."""
        raise NotImplementedError

    @property
    def step(self) -> int:
        """Optimizer updates done so far."""
        return int(_numpy(self.parts.state[STEP]))

    def owned_grads(self, grads: dict) -> dict:
        """Of a checkpoint's gradients (by weight), those this process holds."""
        return grads

    @property
    def reads_into_state(self) -> bool:
        """Whether a checkpoint may be read straight into the state's own memory."""
        return False

    def checkpoint_tensors(self, tensors: dict[str, ort.OrtValue], what: str) -> dict | None:
        """The tensors of one checkpoint from this process's ``tensors``; None where another
        process writes it."""
        return tensors

    @property
    def holds_whole_state(self) -> bool:
        """Whether this process alone holds the whole state of a checkpoint (so that it can
        write one without the others: after another process died)."""
        return True

    def partition_info(self) -> dict:
        """{weight: {"owner": rank}} when the optimizer state is partitioned, else {}."""
        return {}


class LocalExecutor(Executor):
    """Runs the session's graphs in this process: each run validates its feeds, binds the state
    (kinds whose state stays bound run through a ``runner.StepBinding``), falls back to CPU once
    on a provider failure, and commits the state only after the run succeeded."""

    def __init__(self, parts: Parts):
        self.parts = parts
        self.owned = list(parts.facts.weights)
        self._bindings: dict[Kind, StepBinding] = {}  # kind -> its bound state, made on its first run
        # Whether the kinds whose state stays bound run through a StepBinding; False runs each
        # with a fresh binding every time (the same inputs: what the bound runs are checked against).
        self.bind_state = True

    # ------------------------------------------------------------------ the surface
    def run(self, feeds, rate, outputs, run_options=None):
        p = self.parts
        results = self.run_graph(Kind.STEP, feeds, p.state.bound(), {p.builder.lr_name: rate}, run_options)
        self.check_finite(results)
        p.state.commit(results)
        return results

    def train_step(self, feeds, reset):
        p, weights, buffers = self.parts, self.parts.facts.weights, self.parts.facts.buffers
        kind = Kind.GRADIENTS if reset else Kind.ACCUMULATE
        state = p.state.take(buffers)
        if kind is Kind.ACCUMULATE:
            state.update({grad_accum(w): p.state.grads[w] for w in weights})
        results = self.run_graph(kind, feeds, state, p.state.take(weights))
        p.state.grads = {w: results[updated(grad_accum(w))] for w in weights}
        p.state.commit({updated(b): results[updated(b)] for b in buffers})
        return results

    def optimizer_step(self, rate):
        p = self.parts
        state = {n: v for n, v in p.state.values.items() if n not in (ACCUMULATION_STEP, *p.facts.buffers)
                 and not n.endswith(GRAD_ACCUM)}
        per_run = {w + GRADIENT: p.state.grads[w] for w in p.facts.weights}
        results = self.run_graph(Kind.OPTIMIZER, {}, state, {**per_run, LEARNING_RATE: rate})
        self.check_finite(results)
        p.state.commit(results)

    def eval(self, feeds):
        return self.run_graph(Kind.EVAL, feeds, self.parts.state.take(self.parts.facts.state))

    def place(self, providers, provider_options=None):
        p = self.parts
        names, options = resolve_providers(providers, provider_options, p.params.allow_tf32)
        device = _providers.device_of(names, options)
        check_device(p.params, device)
        p.graphs.set_providers(names, options, device)
        p.state.move_to(device)

    @property
    def reads_into_state(self) -> bool:
        return self.parts.state.device[0] == "cpu"

    # ------------------------------------------------------------------ for every executor
    def check_feeds(self, kind: str, feeds: Mapping[str, object], given: Mapping[str, object]) -> dict:
        """The caller's ``feeds`` of graph ``kind`` checked (``runner.CompiledGraph.check_feeds``, class
        indices in range)."""
        labels = self.parts.facts.labels
        check = (lambda name, value: check_labels(labels, name, value)) if labels else None
        return self.parts.graphs[kind].check_feeds(feeds, given, check)

    def run_graph(self, kind: str, feeds: Mapping[str, object], state: Mapping[str, ort.OrtValue],
                  per_run: Mapping[str, ort.OrtValue] = {}, run_options=None,
                  into: Mapping[str, ort.OrtValue] = {}) -> dict[str, ort.OrtValue]:
        """Run graph ``kind`` with the user's ``feeds`` (validated), the ``state`` it updates
        (each ``X`` with its output ``X.updated``; bound once across runs, see ``_bound``) and
        the values it only reads this run (``per_run``); returns every output as an
        OrtValue, those named in ``into`` written there. Falls back to CPU once on a provider
        failure. Nothing is committed: the caller takes the outputs it keeps."""
        kind = Kind(kind)
        p = self.parts
        graph = p.graphs[kind]
        given = {**state, **per_run}
        checked = self.check_feeds(kind, feeds, given)
        user = {n: p.state.ortvalue(v) for n, v in checked.items()}
        try:
            if kind.bound and self.bind_state:
                return self._bound(kind, graph, state, {**user, **per_run}, run_options, into)
            if kind.bound:  # the bound state switched off: the state the graph takes, bound afresh
                return graph.run({n: v for n, v in {**user, **given}.items() if n in graph.inputs}, None, run_options)
            return graph.run({**user, **given}, None, run_options)
        except _OrtErrors.InvalidArgument as exc:
            raise InvalidArgumentError(f"onnxruntime refused the inputs of the {kind} graph: {exc}") from exc
        except RUN_FAILURES as exc:
            bound = {**user, **given}
            fixed = self._fixed_size_failure(kind, exc, bound, given)
            if fixed:
                raise InvalidArgumentError(fixed) from exc
            providers = p.graphs.providers
            if not p.fallback or p.state.device[0] == "cpu":
                raise ProviderError(f"onnxruntime failed running the {kind} graph on {providers[0]}: "
                                    f"{exc}") from exc
            compat.warn(f"{providers[0]} failed ({exc}); falling back to CPUExecutionProvider", RuntimeWarning)
            self.place(["CPUExecutionProvider"])
            graph = p.graphs[kind]
            bound = {n: p.state.ortvalue(_numpy(v)) for n, v in bound.items() if n in graph.inputs}
            return graph.run(bound, None, run_options)

    def _bound(self, kind: Kind, graph, state, per_run, run_options, into={}) -> dict[str, ort.OrtValue]:
        """A run through the graph's StepBinding (made again when the state was replaced since:
        a load, a device move, the other API): the state written after every read of it
        (``GraphCache.in_place``: the weights and the optimizer's states of a step) is updated
        in place, the rest alternates between two buffer sets. Returns the outputs, the new
        state as ``X.updated``."""
        state, read = updated_and_read(graph, state)
        per_run = {**per_run, **read}
        binding = self._bindings.get(kind)
        if binding is None or binding.graph is not graph or not binding.holds(state):
            binding = self._bindings[kind] = StepBinding(graph, state, self.parts.graphs.in_place(kind) & set(state))
        results, new_state = binding.run(per_run, run_options, into)
        results.update({updated(n): v for n, v in new_state.items()})
        return results

    def _fixed_size_failure(self, kind: Kind, exc: Exception, bound, state) -> str | None:
        """A run failed in a node whose target shape holds a size the export fixed: say which."""
        from ..compiler.torch_exports import fixed_size_failure

        graphs = [self.parts.facts.model.graph]
        built = self.parts.graphs.built(kind)
        if built is not None:
            graphs.append(onnx.ModelProto.FromString(built).graph)
        shapes = {n: v.shape() for n, v in bound.items() if n not in state}
        return fixed_size_failure(str(exc), graphs, shapes)

    def check_finite(self, results: Mapping[str, ort.OrtValue]) -> None:
        """Count a step the graph skipped (its loss or gradients held an inf or NaN: it left
        the state as it was) and warn, or raise with ``on_nonfinite_step="raise"``. Under dynamic
        loss scaling such steps are the scale search's, counted without a warning."""
        p = self.parts
        if ALL_FINITE not in results or bool(results[ALL_FINITE].numpy()):
            return
        if LOSS_SCALE in p.state:
            p.skipped_steps += 1
            return
        message = (f"step {self.step + 1}: the loss or a gradient is inf or NaN; the update was skipped (weights, "
                   "optimizer state and running statistics unchanged)")
        if p.params.on_nonfinite_step == "raise":
            raise NonFiniteError(message)
        p.skipped_steps += 1
        compat.warn(f"{message}; {p.skipped_steps} skipped so far (TrainingSession.skipped_steps)", RuntimeWarning)


def updated_and_read(graph, state: Mapping[str, ort.OrtValue]) -> tuple[dict, dict]:
    """Of the ``state`` values ``graph`` takes: (those it updates, ``X`` with an output
    ``X.updated``; those it only reads)."""
    taken = {n: v for n, v in state.items() if n in graph.inputs}
    updates = {n: v for n, v in taken.items() if updated(n) in graph.outputs}
    return updates, {n: v for n, v in taken.items() if n not in updates}


def resolve_providers(providers, provider_options, allow_tf32: bool = False):
    """``providers.resolve_providers``, its warnings (a provider not usable here) pointing at
    the user's call. The CUDA provider's own ``enable_cuda_graph`` is refused: it would capture
    the step with its state bound for one turn only; ``TrainingParameters.enable_cuda_graph``
    binds it for capture."""
    with compat.warnings_at_caller():
        names, options = _providers.resolve_providers(providers, provider_options, allow_tf32)
    for name, opts in zip(names, options):
        if name == _providers.CUDA and str(opts.get(_providers.CUDA_GRAPH, "0")).lower() in ("1", "true"):
            raise InvalidArgumentError(
                f"provider option {_providers.CUDA_GRAPH} of {name}: set TrainingParameters.{_providers.CUDA_GRAPH}=True "
                "instead; a captured training step needs its state and inputs bound at fixed addresses, which the "
                "session then does")
    return names, options


def check_device(params, device, distributed: bool = False) -> None:
    """Refuse ``params`` options that cannot apply on ``device`` (in one process of several, if
    ``distributed``): bfloat16 mixed precision needs onnxruntime's bfloat16 kernels (CUDA), and a
    step captured as a CUDA graph (``enable_cuda_graph``, runtime.capture) CUDA and one process."""
    option = f"TrainingParameters.{_providers.CUDA_GRAPH}=True"
    if params.enable_cuda_graph and device[0] != "cuda":
        raise InvalidArgumentError(
            f"{option} captures the step as a CUDA graph and needs CUDAExecutionProvider; this session runs on "
            f"{'CPUExecutionProvider' if device[0] == 'cpu' else device[0]}. Pass providers=['CUDAExecutionProvider'] "
            f"on a machine with a GPU, or leave {_providers.CUDA_GRAPH} off")
    if params.enable_cuda_graph and distributed:
        raise InvalidArgumentError(
            f"{option} captures a step run in one process; data and pipeline parallel steps exchange gradients "
            f"between graphs. Leave {_providers.CUDA_GRAPH} off with data_parallel_size or pipeline_parallel_size")
    if params.use_mixed_precision and params.mixed_precision_dtype == "bfloat16" and device[0] == "cpu":
        raise InvalidArgumentError(
            "TrainingParameters.mixed_precision_dtype='bfloat16' needs CUDAExecutionProvider: onnxruntime has no "
            "bfloat16 Gemm/MatMul/Conv on CPU, and this session runs on CPUExecutionProvider. Use "
            "mixed_precision_dtype='float16' on CPU, or providers=['CUDAExecutionProvider'] on a GPU")


def _numpy(value):
    return value.numpy() if isinstance(value, ort.OrtValue) else value
