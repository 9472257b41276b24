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
from ..training.graph import StepGradientsBuilder, TrainingGraphBuilder, eval_model, optimizer_only_model
from . import providers as _providers
from .recompute import session_settings
from .runner import Graph, compile_graph

KINDS = ("step", "gradients", "accumulate", "optimizer", "eval")
SPINNING = "session.intra_op.allow_spinning"


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
                # holds a core the next graph needs (MLP: train_step + optimizer_step 8.1 ms
                # spinning, against 5.1 ms for run(), which keeps spinning: one graph per step).
                options = _providers.options_with(options)
                options.add_session_config_entry(SPINNING, "0")
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
            proto = optimizer_only_model(self.weight_specs, b.optimizer, b.optimizer_options, b.max_grad_norm,
                                         per_weight=b.per_weight_options)
        elif kind == "eval":
            proto = eval_model(self.model)
        else:
            raise AssertionError(kind)
        modelio.weights_as_inputs(proto, self.state)
        return proto.SerializeToString()

    def set_providers(self, providers, provider_options, device) -> None:
        """Compile again for other providers (the built graphs are kept)."""
        self.providers, self.provider_options, self.device = providers, provider_options, device
        self.compiled.clear()

    def clear(self) -> None:
        """Forget every graph: the model's constants changed."""
        self.built.clear()
        self.compiled.clear()
