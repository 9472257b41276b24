"""The graphs a session runs: one table of kinds (:class:`Kind`) and the cache that builds
each on first use and compiles it per provider setting (:class:`GraphCache`).

Every graph has the session's state (weights, running statistics) as plain inputs: the
session feeds them, and no graph holds a copy.
"""

from __future__ import annotations

import enum
from typing import Sequence

import onnx

from ..compiler import modelio
from ..compiler.detached import DetachedModel
from ..interface import updated
from ..training.graph import StepGradientsBuilder, TrainingGraphBuilder, eval_model, optimizer_only_model
from . import providers as _providers
from .recompute_settings import session_settings
from .runner import CompiledGraph, compile_graph, taking_turns


class Kind(str, enum.Enum):
    """The kinds of graph a session runs, and what each needs (a kind is its name: ``Kind.STEP
    == "step"``):

    - ``bound``: its state stays bound across runs (``runner.StepBinding``);
    - ``recomputes``: it holds the forward, so recompute's session settings apply;
    - ``takes_turns``: it runs in turn with another graph of the session on the same cores, so
      its thread pool stops spinning at the end of a run (``runner.taking_turns``);
    - ``mem_pattern``: onnxruntime's memory pattern stays on (off for the step, whose state's
      buffers are bound: the pattern would only hold the first run's allocations beside a
      pattern-sized block).
    """

    def __new__(cls, name: str, doc: str, bound: bool, recomputes: bool, takes_turns: bool, mem_pattern: bool):
        kind = str.__new__(cls, name)
        kind._value_ = name
        kind.doc, kind.bound, kind.recomputes = doc, bound, recomputes
        kind.takes_turns, kind.mem_pattern = takes_turns, mem_pattern
        return kind

    # name, what it is (the session's call): bound, recomputes, takes_turns, mem_pattern
    STEP = "step", "forward, backward, (accumulation, clipping), optimizer: run()", True, True, False, False
    GRADIENTS = "gradients", "forward, backward, the gradients returned: train_step()", True, True, True, True
    ACCUMULATE = "accumulate", "forward, backward, the gradients added to buffers: train_step()", True, True, True, True
    OPTIMIZER = "optimizer", "the update alone from the gradients: optimizer_step()", True, False, True, True
    EVAL = "eval", "the forward in inference form: eval_step()", False, False, False, True

    def __str__(self) -> str:
        return self.value


class GraphCache:
    """The session's graphs, by :class:`Kind`: each built once (``serialized``: independent of
    the providers) and compiled on first use (``cache[kind]``: a ``runner.CompiledGraph``) for the
    current providers; ``set_providers`` compiles again for others, ``clear`` forgets every
    graph (the frozen parameters they hold changed). ``partition`` makes the optimizer graph
    update some of the weights only (ZeRO; a pipeline stage's). ``compile`` compiles another
    graph (a pipeline stage's) with the same options and providers.

    ``facts`` is the session's ``model.ModelFacts``, ``builder`` its TrainingGraphBuilder. The
    providers, their options and the device are read-only: change them with ``set_providers``.
    """

    def __init__(self, facts, builder: TrainingGraphBuilder, sess_options, providers, provider_options, device):
        self._facts, self._builder, self._sess_options = facts, builder, sess_options
        self._providers, self._provider_options, self._device = providers, provider_options, device
        self._built: dict[Kind, bytes] = {}  # kind -> serialized graph (independent of providers)
        self._externals: dict[Kind, dict] = {}  # kind -> the arrays its serialized graph refers to
        self._compiled: dict[Kind, CompiledGraph] = {}  # kind -> its compiled graph
        self._in_place: dict[Kind, frozenset[str]] = {}  # kind -> its state updated in place
        self._owned: list[str] | None = None  # the weights the optimizer graph updates; None: all
        self.captured = False  # the step is compiled for CUDA-graph capture (runtime.capture)
        self.step_shapes: dict[str, list[int]] = {}  # the step is built for these input shapes only

    @property
    def providers(self) -> Sequence[str]:
        return self._providers

    @property
    def provider_options(self) -> Sequence[dict]:
        return self._provider_options

    @property
    def device(self) -> tuple[str, int]:
        return self._device

    def __getitem__(self, kind: str) -> CompiledGraph:
        kind = Kind(kind)
        if kind not in self._compiled:
            options, disabled = self._sess_options, ()
            if self._builder.recompute is not None and kind.recomputes:
                settings, disabled = session_settings(options.enable_cpu_mem_arena)  # keeps the recompute
                options = _providers.options_with(options, **settings)
            if not kind.mem_pattern:
                options = _providers.options_with(options, enable_mem_pattern=False)
            if kind.takes_turns:
                # The step-wise API's graphs take turns: a pool still spinning after its run slows
                # the other graph's (docs/guide/training-session.md).
                options = taking_turns(options)
            provider_options = None
            if self.captured and kind is Kind.STEP:
                provider_options = _providers.with_cuda_graph(self._providers, self._provider_options)
            self._compiled[kind] = self.compile(self.serialized(kind), options, disabled, provider_options,
                                                self.externals(kind))
        return self._compiled[kind]

    def compile(self, model: bytes, sess_options=None, disabled_optimizers: Sequence[str] = (),
                provider_options: Sequence[dict] | None = None, externals: dict | None = None) -> CompiledGraph:
        """``model`` (serialized) compiled for the current providers, with the session's
        options (or ``sess_options``) and provider options (or ``provider_options``);
        ``externals``: the arrays of its tensors held in memory (``DetachedModel.in_memory``)."""
        options = self._sess_options if sess_options is None else sess_options
        provider_options = self._provider_options if provider_options is None else provider_options
        return compile_graph(model, options, self._providers, provider_options, self._device, disabled_optimizers,
                             externals)

    def serialized(self, kind: str) -> bytes:
        """Graph ``kind`` as bytes, built on first use."""
        kind = Kind(kind)
        if kind not in self._built:
            self._built[kind] = self._build(kind)
        return self._built[kind]

    def built(self, kind: str) -> bytes | None:
        """Graph ``kind`` as bytes if it was built, else None (nothing is built)."""
        return self._built.get(Kind(kind))

    def _build(self, kind: Kind) -> bytes:
        """Graph ``kind`` serialized, its large constants (the frozen parameters') left to
        onnxruntime as external initializers (``externals(kind)``)."""
        b, facts = self._builder, self._facts
        if kind is Kind.STEP:
            b.input_shapes = self.step_shapes
            try:
                built = b.build().built_model()
            finally:
                b.input_shapes = {}
        elif kind in (Kind.GRADIENTS, Kind.ACCUMULATE):
            built = StepGradientsBuilder(b, facts.outputs, accumulate=kind is Kind.ACCUMULATE).build().built_model()
        elif kind is Kind.OPTIMIZER:
            specs = facts.specs if self._owned is None else {w: facts.specs[w] for w in self._owned}
            per_weight = {w: o for w, o in b.per_weight_options.items() if w in specs}
            built = DetachedModel(optimizer_only_model(specs, b.optimizer, b.optimizer_options, b.max_grad_norm,
                                                       per_weight=per_weight, partial=self._owned is not None), {})
        elif kind is Kind.EVAL:
            built = facts.detached(eval_model(facts.model))
        else:
            raise AssertionError(kind)
        skeleton = onnx.ModelProto()
        skeleton.CopyFrom(built.skeleton)
        modelio.weights_as_inputs(skeleton, facts.state)
        serialized, self._externals[kind] = DetachedModel(skeleton, built.weights).in_memory()
        return serialized

    def externals(self, kind: str) -> dict:
        """{name: array} of graph ``kind``'s large constants, which its serialized form only
        refers to (``DetachedModel.in_memory``)."""
        self.serialized(kind)
        return self._externals[Kind(kind)]

    def in_place(self, kind: str) -> frozenset[str]:
        """The state inputs ``X`` of graph ``kind`` whose output ``X.updated`` may be written
        into ``X``'s own buffer: it is made by an element-wise node or an If (the optimizer's,
        which waits for every gradient), and every other node that reads ``X`` runs before it
        (is one of its ancestors). The weights of a training step qualify: the forward and the
        backward read them before the update can start."""
        kind = Kind(kind)
        if kind not in self._in_place:
            self._in_place[kind] = _written_after_every_read(onnx.ModelProto.FromString(self.serialized(kind)).graph)
        return self._in_place[kind]

    def partition(self, owned: list[str]) -> None:
        """The optimizer graph updates ``owned`` only (its clipping norm is then given by the
        caller: ``optimizer_only_model``'s ``partial``)."""
        if Kind.OPTIMIZER in self._built:
            raise AssertionError("GraphCache.partition after the optimizer graph was built")
        self._owned = list(owned)

    def set_providers(self, providers, provider_options, device) -> None:
        """Compile again for other providers (the built graphs are kept)."""
        self._providers, self._provider_options, self._device = providers, provider_options, device
        self._compiled.clear()

    def clear(self) -> None:
        """Forget every graph: the model's constants changed."""
        self._built.clear()
        self._externals.clear()
        self._compiled.clear()
        self._in_place.clear()


_ELEMENTWISE_WRITERS = frozenset({"If", "Where", "Add", "Sub", "Mul", "Identity", "Cast"})


def _written_after_every_read(graph: onnx.GraphProto) -> frozenset[str]:
    nodes = list(graph.node)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    reads = [modelio.node_reads(n) for n in nodes]
    readers: dict[str, list[int]] = {}
    for k, names in enumerate(reads):
        for name in names:
            readers.setdefault(name, []).append(k)
    ancestors: dict[int, set[int]] = {}

    def ancestors_of(k: int) -> set[int]:
        if k not in ancestors:
            seen, stack = set(), [k]
            while stack:
                for name in reads[stack.pop()]:
                    p = producer.get(name)
                    if p is not None and p not in seen:
                        seen.add(p)
                        stack.append(p)
            ancestors[k] = seen
        return ancestors[k]

    safe = set()
    for i in graph.input:
        writer = producer.get(updated(i.name))
        if writer is None or nodes[writer].op_type not in _ELEMENTWISE_WRITERS or nodes[writer].domain not in ("", "ai.onnx"):
            continue
        before = ancestors_of(writer)
        if all(r == writer or r in before for r in readers.get(i.name, [])):
            safe.add(i.name)
    return frozenset(safe)
