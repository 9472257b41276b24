"""One compiled graph and how it runs: an onnxruntime session (from the provider cache), its
inputs and outputs, and a run that binds OrtValues with IOBinding and leaves the outputs on
the device. ``TrainingSession`` and ORTModule both run their graphs through it."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import onnxruntime as ort

from ..dtypes import NP_OF_ORT, ORT_OF_NP
from ..errors import InvalidArgumentError
from . import providers as _providers


class CompiledGraph:
    """A compiled graph: ``session``, ``inputs`` (name -> NodeArg), ``outputs`` (names) and
    ``device`` (``(kind, index)``, where outputs are bound)."""

    def __init__(self, session: ort.InferenceSession, device: tuple[str, int]):
        self.session = session
        self.device = device
        self.inputs = {a.name: a for a in session.get_inputs()}
        self.outputs = [a.name for a in session.get_outputs()]

    def run(self, feeds: Mapping[str, ort.OrtValue], outputs: Sequence[str] | None = None,
            run_options=None) -> dict[str, ort.OrtValue]:
        """Run with ``feeds`` bound as inputs; returns ``outputs`` (default: all) as OrtValues
        on the graph's device."""
        binding = self.session.io_binding()
        for name, value in feeds.items():
            binding.bind_ortvalue_input(name, value)
        kind, index = self.device
        names = self.outputs if outputs is None else list(outputs)
        for name in names:
            binding.bind_output(name, kind, index)
        self.session.run_with_iobinding(binding, run_options)
        results = dict(zip(names, binding.get_outputs()))
        # The binding would keep this run's inputs alive for as long as any output is held
        # (a training step's previous state): release them.
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        return results

    def check_feeds(self, feeds: Mapping[str, object], given: Mapping[str, object] = {}, check=None) -> dict[str, object]:
        """The caller's ``feeds`` checked against the graph's inputs other than ``given``:
        names, element types, static sizes, and the same size wherever a symbolic dimension
        appears; ``check(name, value)`` sees each value. Returns {name: value} in input order."""
        if not isinstance(feeds, Mapping):
            raise InvalidArgumentError(f"input_feed must be a dict of input name -> array, got {type(feeds).__name__}")
        expected = [n for n in self.inputs if n not in given]
        unknown = [n for n in feeds if n not in self.inputs or n in given]
        if unknown:
            raise InvalidArgumentError(f"input_feed: no model input named {unknown}; the inputs are {expected}")
        missing = [n for n in expected if n not in feeds]
        if missing:
            raise InvalidArgumentError(f"input_feed: missing input(s) {missing}; the inputs are {expected}")
        out, sizes = {}, {}
        for name in expected:
            value, arg = feeds[name], self.inputs[name]
            if isinstance(value, ort.OrtValue):
                dtype, shape = value.data_type(), value.shape()
            else:
                value = np.asarray(value)
                dtype, shape = f"tensor({ORT_OF_NP.get(value.dtype.type, value.dtype.name)})", list(value.shape)
            if dtype != arg.type:
                raise InvalidArgumentError(f"input '{name}': expected {arg.type}, got {dtype}; convert it, "
                                           f"e.g. x.astype(numpy.{np.dtype(NP_OF_ORT.get(arg.type, np.float32)).name})")
            dims = arg.shape
            if len(shape) != len(dims) or any(isinstance(d, int) and d != s for d, s in zip(dims, shape)):
                raise InvalidArgumentError(f"input '{name}': expected shape {dims}, got {list(shape)}")
            for d, size in zip(dims, shape):
                if isinstance(d, str):
                    seen = sizes.setdefault(d, (size, name))
                    if seen[0] != size:
                        raise InvalidArgumentError(f"dimension '{d}' is {seen[0]} in input '{seen[1]}' but {size} in "
                                                   f"input '{name}'; the inputs must agree on it")
            if check is not None:
                check(name, value)
            out[name] = value
        return out


class StepBinding:
    """A graph run step after step with its state (every input ``X`` of ``state`` has the
    output ``X.updated``) bound once, so that no step allocates the state again:

    - ``in_place`` state (``GraphCache.in_place``: written after every read of it, as the
      weights and moments the optimizer's If updates once every gradient is there): the
      output ``X.updated`` is bound to the buffer of its input ``X``. A run that fails, fails
      before that write.
    - the other state alternates between two buffer sets, two bindings taking turns.

    ``run`` binds the inputs given for this run (the caller's, the learning rate, state read
    but not updated) and returns the graph's other outputs, fresh each run, and the new state
    values (the other set's buffers, and the in-place ones).
    """

    def __init__(self, graph: CompiledGraph, state: Mapping[str, ort.OrtValue], in_place: set[str]):
        from ..interface import updated

        self.graph = graph
        kind, index = graph.device
        alternating = {n: v for n, v in state.items() if n not in in_place}
        other = {n: ort.OrtValue.ortvalue_from_shape_and_type(v.shape(), NP_OF_ORT[v.data_type()], kind, index)
                 for n, v in alternating.items()}
        self.sets = [dict(alternating), other]
        self.in_place = {n: state[n] for n in in_place}
        self.outputs = [n for n in graph.outputs if n not in {updated(s) for s in state}]
        self.bindings = []
        for k in (0, 1):
            b = graph.session.io_binding()
            for n, v in {**self.sets[k], **self.in_place}.items():
                b.bind_ortvalue_input(n, v)
            for n in self.outputs:
                b.bind_output(n, kind, index)
            for n, v in self.sets[1 - k].items():
                b.bind_ortvalue_output(updated(n), v)
            for n, v in self.in_place.items():
                b.bind_ortvalue_output(updated(n), v)
            self.bindings.append(b)
        self.turn = 0

    def holds(self, state: Mapping[str, ort.OrtValue]) -> bool:
        """Whether ``state`` is what this binding's current turn reads (nothing replaced it)."""
        current = {**self.sets[self.turn], **self.in_place}
        return len(state) == len(current) and all(state.get(n) is v for n, v in current.items())

    def run(self, feeds: Mapping[str, ort.OrtValue], run_options=None,
            into: Mapping[str, ort.OrtValue] = {}) -> tuple[dict, dict]:
        """(the other outputs, the new state values) of one run with ``feeds``; the outputs
        named in ``into`` are written into those buffers (data parallel's flat buckets)."""
        b = self.bindings[self.turn]
        for name, value in feeds.items():
            b.bind_ortvalue_input(name, value)
        for name, value in into.items():
            b.bind_ortvalue_output(name, value)
        self.graph.session.run_with_iobinding(b, run_options)
        results = dict(zip(self.outputs, b.get_outputs()[: len(self.outputs)]))
        kind, index = self.graph.device
        for n in self.outputs:  # the next run allocates new ones: the caller may hold these
            b.bind_output(n, kind, index)
        self.turn = 1 - self.turn
        return results, {**self.sets[self.turn], **self.in_place}


SPINNING = "session.intra_op.allow_spinning"
STOP_SPINNING = "session.force_spinning_stop"  # spin within a run, not after it


def taking_turns(sess_options) -> "ort.SessionOptions":
    """The options of a graph that takes turns with others on the same cores (the step-wise
    API's graphs; ORTModule's forward, backward and PyTorch between them): its thread pool
    spins within a run and stops at its end, since a pool still spinning after its run holds a
    core the next graph needs. ``sess_options`` (None: defaults) is left as it was; a user who
    set ``session.intra_op.allow_spinning`` keeps their choice."""
    options = _providers.options_with(sess_options)
    if not _user_set(options, SPINNING):
        options.add_session_config_entry(STOP_SPINNING, "1")
    return options


def _user_set(options, key: str) -> bool:
    try:
        return bool(options.get_session_config_entry(key))
    except Exception:  # noqa: BLE001 - onnxruntime raises when the key was never set
        return False


# onnxruntime graph optimizers left out of every session we create. SkipLayerNormFusion fuses
# Add + LayerNormalization into SkipLayerNormalization, whose CPU kernel in onnxruntime 1.31
# is several times slower than the two ops it replaces (tools/bench_kernels.py re-measures
# it for the installed onnxruntime).
SLOWER_FUSIONS = ("SkipLayerNormFusion",)


def compile_graph(model: bytes, sess_options, providers, provider_options, device: tuple[str, int],
                  disabled_optimizers: Sequence[str] = (), externals: dict | None = None) -> CompiledGraph:
    """``model`` (serialized) loaded by onnxruntime, one session per model and configuration
    (``providers.cached_session``), without the SLOWER_FUSIONS; ``externals``: the arrays of
    the tensors it refers to in memory."""
    disabled = sorted(set(disabled_optimizers) | set(SLOWER_FUSIONS))
    session = _providers.cached_session(model, sess_options, providers, provider_options, disabled, externals)
    return CompiledGraph(session, device)
