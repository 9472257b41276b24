"""The graphs a session runs, each built on first use and compiled per provider setting:

- ``step``: forward, backward, (accumulation, clipping) and optimizer in one graph (``run``);
- ``gradients`` / ``accumulate``: forward and backward only, the gradients returned or added
  to buffers (``train_step``, onnxruntime-training's on-device API);
- ``optimizer``: the update alone from those buffers (``optimizer_step``);
- ``eval``: the forward in inference form (``eval_step``).

Every graph has the session's state (weights, running statistics) as plain inputs: the
session feeds them, and no graph holds a copy.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import onnx

from ..compiler import modelio
from ..interface import updated
from ..training.graph import StepGradientsBuilder, TrainingGraphBuilder, eval_model, optimizer_only_model
from . import providers as _providers
from .recompute import session_settings
from .runner import Graph, compile_graph

KINDS = ("step", "gradients", "accumulate", "optimizer", "eval")
SPINNING = "session.intra_op.allow_spinning"
STOP_SPINNING = "session.force_spinning_stop"  # spin within a run, not after it


def _user_set(options, key: str) -> bool:
    try:
        return bool(options.get_session_config_entry(key))
    except Exception:  # noqa: BLE001 - onnxruntime raises when the key was never set
        return False


class GraphCache:
    def __init__(self, builder: TrainingGraphBuilder, model: onnx.ModelProto, outputs: list[str],
                 state: list[str], sess_options, providers, provider_options, device):
        self.builder, self.model, self.outputs, self.state = builder, model, outputs, state
        self.sess_options = sess_options
        self.providers, self.provider_options, self.device = providers, provider_options, device
        self.built: dict[str, bytes] = {}  # kind -> serialized graph (independent of providers)
        self.compiled: dict[str, Graph] = {}  # kind -> its compiled graph
        self.weight_specs: Mapping[str, np.ndarray] = {}  # weight -> an array of its dtype and shape
        self._in_place: dict[str, frozenset[str]] = {}  # kind -> its state updated in place
        self.owned: list[str] | None = None  # the weights this process updates (ZeRO), None: all

    def __getitem__(self, kind: str) -> Graph:
        if kind not in self.compiled:
            options, disabled = self.sess_options, ()
            if self.builder.recompute is not None and kind in ("step", "gradients", "accumulate"):
                settings, disabled = session_settings(options.enable_cpu_mem_arena)  # keeps the recompute
                options = _providers.options_with(options, **settings)
            if kind == "step":
                # The state's buffers are bound (runner.StepBinding): the memory pattern would
                # only hold the first run's allocations beside a pattern-sized block.
                options = _providers.options_with(options, enable_mem_pattern=False)
            elif kind in ("gradients", "accumulate", "optimizer") and not _user_set(options, SPINNING):
                # The step-wise API's graphs take turns: a pool still spinning after its run
                # holds a core the next graph needs. Their pools spin within a run and stop at
                # its end (MLP train_step + optimizer_step: 8.1 ms spinning on, 5.9 with no
                # spinning at all, which costs the transformer's ~800 ops a wake-up each).
                options = _providers.options_with(options)
                options.add_session_config_entry(STOP_SPINNING, "1")
            self.compiled[kind] = compile_graph(self.serialized(kind), options, self.providers,
                                                self.provider_options, self.device, disabled)
        return self.compiled[kind]

    def serialized(self, kind: str) -> bytes:
        if kind not in self.built:
            self.built[kind] = self._build(kind)
        return self.built[kind]

    def _build(self, kind: str) -> bytes:
        b = self.builder
        if kind == "step":
            proto = b.build().model_proto
        elif kind in ("gradients", "accumulate"):
            proto = StepGradientsBuilder(b, self.outputs, accumulate=kind == "accumulate").build().model_proto
        elif kind == "optimizer":
            specs = self.weight_specs if self.owned is None else {w: self.weight_specs[w] for w in self.owned}
            per_weight = {w: o for w, o in b.per_weight_options.items() if w in specs}
            proto = optimizer_only_model(specs, b.optimizer, b.optimizer_options, b.max_grad_norm,
                                         per_weight=per_weight, partial=self.owned is not None)
        elif kind == "eval":
            proto = eval_model(self.model)
        else:
            raise AssertionError(kind)
        modelio.weights_as_inputs(proto, self.state)
        return proto.SerializeToString()

    def in_place(self, kind: str) -> frozenset[str]:
        """The state inputs ``X`` of graph ``kind`` whose output ``X.updated`` may be written
        into ``X``'s own buffer: it is made by an element-wise node or an If (the optimizer's,
        which waits for every gradient), and every other node that reads ``X`` runs before it
        (is one of its ancestors). The weights of a training step qualify: the forward and the
        backward read them before the update can start."""
        if kind not in self._in_place:
            self._in_place[kind] = _written_after_every_read(onnx.ModelProto.FromString(self.serialized(kind)).graph)
        return self._in_place[kind]

    def set_providers(self, providers, provider_options, device) -> None:
        """Compile again for other providers (the built graphs are kept)."""
        self.providers, self.provider_options, self.device = providers, provider_options, device
        self.compiled.clear()

    def clear(self) -> None:
        """Forget every graph: the model's constants changed."""
        self.built.clear()
        self.compiled.clear()
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
