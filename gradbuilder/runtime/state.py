"""The training state a session carries from one run to the next: weights, optimizer states,
``Step``, running statistics, accumulation buffers, the loss scale, and the step-wise API's
gradients, as OrtValues on the session's device.

A graph's outputs ``X.updated`` become the state ``X`` only after the run that made them
succeeded (:meth:`StateStore.commit`); values set by the user are checked whole (names,
shapes, types) before any of them is taken (:meth:`StateStore.checked`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import onnxruntime as ort

from ..dtypes import NP_OF_ORT
from ..errors import InvalidArgumentError
from ..interface import ACCUMULATION_STEP, GRAD_ACCUM, state_input


class StateStore:
    """The state by name (``values``: every weight, optimizer state, ``Step``, ...). With
    ``groups`` (a flat state, ``training.stages.flat``), the members of each group are held in
    one buffer per group and per ``suffixes`` entry (``""``: the weights themselves,
    ``".exp_avg"``, ``".grad_accum"``, ...; ``flat``: buffer name -> OrtValue), and each
    member's value is a view of its buffer (``runtime.views``): whatever reads or writes a
    weight by name reads or writes the buffer the step updates."""

    def __init__(self, values: Mapping[str, object], device: tuple[str, int], groups=(), suffixes=("",)):
        self.device = device
        self.flat: dict[str, ort.OrtValue] = {}  # group buffer -> its value
        self._members: dict[str, list[tuple[str, int, tuple[int, ...]]]] = {}  # buffer -> (member, offset, shape)
        values = dict(values)
        for group in groups:
            for suffix in suffixes:
                names = [m.name + suffix for m in group.members]
                if all(n in values for n in names):
                    self._members[group.name + suffix] = [(n, m.offset, m.shape) for n, m in zip(names, group.members)]
                    self.flat[group.name + suffix] = self.ortvalue(np.concatenate(
                        [np.asarray(values.pop(n)).reshape(-1) for n in names]))
        # the names held in a group's buffer
        self.packed = frozenset(n for members in self._members.values() for n, _, _ in members)
        self.values: dict[str, ort.OrtValue] = {n: self.ortvalue(v) for n, v in values.items()}
        for name in self.flat:
            self._make_views(name)
        self.grads: dict[str, ort.OrtValue] = {}  # the step-wise API's gradient buffers, by weight
        self._scalar: tuple[float, ort.OrtValue] | None = None  # the last float32 scalar, on the device

    def _make_views(self, buffer: str) -> None:
        from .views import view

        for name, offset, shape in self._members[buffer]:
            self.values[name] = view(self.flat[buffer], offset, shape)

    def bound(self) -> dict[str, ort.OrtValue]:
        """Every value a graph may take: by name, and the group buffers."""
        return {**self.values, **self.flat}

    def scalar(self, value: float) -> ort.OrtValue:
        """``value`` as a float32 scalar OrtValue on the device (the learning rate), kept for
        as long as it is asked for again (until another value, or a move)."""
        if self._scalar is None or self._scalar[0] != value:
            self._scalar = value, self.ortvalue(np.array(value, np.float32))
        return self._scalar[1]

    def ortvalue(self, value) -> ort.OrtValue:
        """``value`` as an OrtValue on the device (an OrtValue is taken as it is)."""
        if isinstance(value, ort.OrtValue):
            return value
        kind, index = self.device
        return ort.OrtValue.ortvalue_from_numpy(np.asarray(value, order="C"), kind, index)

    def __getitem__(self, name: str) -> ort.OrtValue:
        return self.values[name]

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def __iter__(self):
        return iter(self.values)

    def take(self, names: Iterable[str]) -> dict[str, ort.OrtValue]:
        return {n: self.values[n] for n in names}

    def commit(self, results: Mapping[str, ort.OrtValue]) -> None:
        """Take every ``X.updated`` output of a successful run as the new ``X`` (a group buffer
        updated elsewhere than in its own memory: its members are views of the new one; a
        member updated elsewhere than in its view: copied into it)."""
        for name, value in results.items():
            target = state_input(name)
            if target is None:
                continue
            if target in self.flat:
                if value.data_ptr() != self.flat[target].data_ptr():
                    self.flat[target] = value
                    self._make_views(target)
            elif target in self.packed:
                if value.data_ptr() != self.values[target].data_ptr():
                    self.values[target].update_inplace(np.ascontiguousarray(value.numpy()))
            else:
                self.values[target] = value

    def array(self, name: str) -> np.ndarray:
        """A numpy copy of ``name``: valid after later steps replace the value."""
        return np.array(self.values[name].numpy(), copy=True)

    def spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        value = self.values[name]
        return tuple(value.shape()), np.dtype(NP_OF_ORT[value.data_type()])

    def checked(self, values: Mapping[str, object], specs: Mapping[str, tuple]) -> dict[str, np.ndarray]:
        """``values`` as arrays, each checked against ``specs`` (name -> (shape, dtype)); the
        first name or value that does not fit raises, before anything changes."""
        out = {}
        for name, value in values.items():
            value = np.asarray(value.numpy() if isinstance(value, ort.OrtValue) else value)
            shape, dtype = specs[name]
            if value.shape != shape or value.dtype != dtype:
                raise InvalidArgumentError(f"'{name}': expected {dtype.name} {list(shape)}, got "
                                           f"{value.dtype.name} {list(value.shape)}")
            out[name] = value
        return out

    def set(self, values: Mapping[str, np.ndarray], owned: bool = False) -> None:
        """Replace values (already checked) with copies on the device; with ``owned``, C-order
        arrays that nothing else refers to (``checkpoint.load``'s) are taken as they are (on the
        CPU the state then lies in their memory)."""
        for name, value in values.items():
            if name in self.packed:  # into its group's buffer
                self.values[name].update_inplace(np.ascontiguousarray(value))
            else:
                self.values[name] = self.ortvalue(value if owned else np.array(value, copy=True))

    def drop(self, names: Iterable[str]) -> None:
        """Forget ``names``: other processes hold them (ZeRO, other pipeline stages)."""
        for name in names:
            del self.values[name]

    def move_to(self, device: tuple[str, int]) -> None:
        """Move every value (and gradient) to ``device``."""
        if device == self.device:
            return
        self.device = device
        self._scalar = None
        self.values = {n: self.ortvalue(v.numpy()) for n, v in self.values.items() if n not in self.packed}
        self.flat = {n: self.ortvalue(v.numpy()) for n, v in self.flat.items()}
        for name in self.flat:
            self._make_views(name)
        self.grads = {n: self.ortvalue(v.numpy()) for n, v in self.grads.items()}


def fingerprint(weights: Iterable[str], state: Mapping[str, np.ndarray], optimizer: str) -> str:
    """Identifies the model and optimizer a checkpoint belongs to: names, dtypes and shapes."""
    items = sorted((n, np.asarray(v).dtype.str, list(np.shape(v))) for n, v in state.items())
    return hashlib.sha256(json.dumps([optimizer, sorted(weights), items]).encode()).hexdigest()


def without_accumulation(state: Mapping) -> dict:
    """``state`` less the gradient accumulation's (``Accumulation_Step``, ``W.grad_accum``)."""
    return {n: v for n, v in state.items() if n != ACCUMULATION_STEP and not n.endswith(GRAD_ACCUM)}


@dataclass(frozen=True)
class Identity:
    """What a checkpoint must match: the fingerprint of the whole state (``model``), and the
    same less the accumulation state (``between``: a checkpoint saved between accumulations
    resumes with another number of accumulation steps, or a pipeline's micro-batches)."""

    weights: tuple[str, ...]
    optimizer: str
    model: str
    between: str

    @classmethod
    def of(cls, weights: Iterable[str], state: Mapping[str, np.ndarray], optimizer: str) -> "Identity":
        weights = tuple(weights)
        return cls(weights, optimizer, fingerprint(weights, state, optimizer),
                   fingerprint(weights, without_accumulation(state), optimizer))

    def between_of(self, state: Mapping[str, np.ndarray]) -> str:
        """The ``between`` fingerprint of another ``state`` (a checkpoint's, by specs)."""
        return fingerprint(self.weights, without_accumulation(state), self.optimizer)
