"""What the module's code does while it is traced: the values it hands to Python (``watching``),
the guards on the call's own small tensors, and the place in the module's code that did it
(``where``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import torch


@dataclasses.dataclass
class Guard:
    """The traced code read the value of one of the call's tensors into Python (``if flag:``,
    ``n = steps.item()``): the graph holds for calls whose tensor ``index`` reads the same."""

    index: int  # among the call's tensor leaves
    method: str  # the Tensor method that read it
    value: object  # what it read
    where: str

    def holds(self, tensors: list) -> bool:
        value = getattr(tensors[self.index], self.method)()
        return value == self.value or repr(value) == repr(self.value)  # NaN reads as NaN


# the traced forward's code (export's wrapper of the module): a search for the module's code stops there
FORWARD_CODES: set = set()
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


# Tensor methods that hand a tensor's value to Python.
_TO_PYTHON = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__")


# Those that may read a (small) tensor of the call itself: the graph is kept for that value only.
_GUARDED = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__"})


_GUARDED_SIZE = 4096


# Traced operators whose result depends on their input's shape only.
_SHAPE_OPS = frozenset({"aten::size", "aten::sym_size", "aten::numel", "aten::dim", "aten::_shape_as_tensor",
                        "aten::len", "prim::shape"})


@dataclasses.dataclass
class Watch:
    """What the module's code did while it was traced (each entry says what and where)."""

    value_reads: list[str] = dataclasses.field(default_factory=list)
    guards: list[Guard] = dataclasses.field(default_factory=list)  # values of the call's tensors read
    inputs: list = dataclasses.field(default_factory=list)  # (tensor, version) of the call's tensors
    stops: list[str] = dataclasses.field(default_factory=list)  # where a gradient was cut
    in_place: list[str] = dataclasses.field(default_factory=list)  # changes autograd does not see
    calls: list = dataclasses.field(default_factory=list)  # the Functions applied, as FunctionBreak nodes
    applied: list = dataclasses.field(default_factory=list)  # (Function, tensor arguments it changed), in order
    unmarked: list[str] = dataclasses.field(default_factory=list)  # Functions changing an argument unmarked
    inside: int = 0  # > 0 while a Function's own forward runs: PyTorch runs it, nothing to watch


@contextlib.contextmanager
def watching(watch: Watch):
    """Record, into ``watch``, the places where the traced code hands a tensor's value to
    Python.

    The tensor methods that turn a value into a Python object (``_TO_PYTHON``) are replaced on
    ``torch.Tensor`` for the duration of the trace; the replacements record only on the tracing
    thread (the tracer's state is per thread) and then call the originals. A conversion counts
    when the traced value depends on the values of the graph inputs (the call's tensors,
    parameters, buffers) or on random numbers; one computed from sizes only (``int(x.shape[0])``)
    does not: other sizes are checked by tracing again (see ``export``)."""
    def conversion(name, original):
        def method(self, *args, **kwargs):
            if torch._C._get_tracing_state() is None or watch.inside:
                return original(self, *args, **kwargs)
            index = next((i for i, (t, version) in enumerate(watch.inputs)
                          if t is self and t._version == version), None)
            if index is not None and name in _GUARDED and not args and not kwargs \
                    and self.numel() <= _GUARDED_SIZE:
                value = original(self)
                watch.guards.append(Guard(index, name, value, code_place(sys._getframe(1))))
                return value
            if _reads_values(self):
                watch.value_reads.append(f"{code_place(sys._getframe(1))} (Tensor.{name})")
            return original(self, *args, **kwargs)
        return method

    replaced = [(torch.Tensor, name, conversion(name, getattr(torch.Tensor, name))) for name in _TO_PYTHON]
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in replaced]
    try:
        for owner, name, value in replaced:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _reads_values(t: torch.Tensor) -> bool:
    """Whether the traced value of ``t`` depends on the values of the graph inputs or on random
    numbers, rather than only on shapes and constants."""
    try:
        pending = [torch._C._get_value_trace(t)]
    except RuntimeError:
        return False  # not traced: a constant
    seen = set()
    while pending:
        value = pending.pop()
        if value.unique() in seen:
            continue
        seen.add(value.unique())
        node = value.node()
        kind = node.kind()
        if kind in ("prim::Param", "prim::GetAttr") or kind.startswith("aten::") and node.isNondeterministic():
            return True
        if kind not in _SHAPE_OPS:
            pending.extend(node.inputs())
    return False


def code_place(frame) -> str:
    """file:line of the module's code that made the call: the innermost frame outside torch and
    this package (whose wrappers it passes through, up to the traced forward), else the
    innermost one in torch (torch's own code)."""
    first = None
    while frame is not None and frame.f_code not in FORWARD_CODES:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(PACKAGE_DIR):
            first = first or frame
            if not path.startswith(TORCH_DIR):
                return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return f"{first.f_code.co_filename}:{first.f_lineno}" if first is not None else "an unknown place"
