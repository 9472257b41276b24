"""ORTModule and torch.autograd.Function: every Function the traced call applies is refused
(or, with fallback=True, the module runs in PyTorch), however the module's code reaches its
``apply``."""

from __future__ import annotations

import copy
import functools
import inspect
import re
import warnings

import pytest
import torch

from gradbuilder.ortmodule import ExportError, ORTModule


class Triple(torch.autograd.Function):
    """Doubles in the forward; its backward triples the gradient (not the forward's derivative)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 3


class Outer(torch.autograd.Function):
    """Applies Triple inside its forward; its own backward halves the gradient."""

    @staticmethod
    def forward(ctx, x):
        return TRIPLE(x) + 1

    @staticmethod
    def backward(ctx, g):
        return g / 2


TRIPLE = Triple.apply  # taken before any ORTModule runs


class Activation:
    """An object whose method applies a Function stored on it."""

    def __init__(self):
        self.fn = Triple.apply

    def run(self, y):
        return self.fn(y)


class Net(torch.nn.Module):
    """A Linear, then ``act`` (a callable made in ``__init__``), plus a scaled residual: the
    Linear's gradient flows only through the Function."""

    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 3)
        self.scale = torch.nn.Parameter(torch.full((3,), 0.5))
        if how == "attribute":
            self.act = Triple.apply
        elif how == "partial":
            self.act = functools.partial(Triple.apply)
        elif how == "lambda":
            apply = Triple.apply
            self.act = lambda y: apply(y) - 1
        elif how == "method":
            self.act = Activation().run
        elif how == "nested":
            self.act = Outer.apply

    def forward(self, x):
        return self.act(self.lin(x)) + x * self.scale


def _line(function, text: str) -> int:
    """The line of ``function``'s source holding ``text``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


# how the Function is reached -> (the Function named, the line that applies it)
WAYS = {
    "attribute": ("Triple", _line(Net.forward, "self.act(")),
    "partial": ("Triple", _line(Net.forward, "self.act(")),
    "lambda": ("Triple", _line(Net.__init__, "lambda y")),
    "method": ("Triple", _line(Activation.run, "self.fn(")),
    "nested": ("Outer", _line(Net.forward, "self.act(")),
}


def _quiet():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)


@pytest.mark.parametrize("how", list(WAYS))
def test_a_function_is_refused_naming_its_class_and_place(how):
    _quiet()
    name, line = WAYS[how]
    om = ORTModule(Net(how))
    x = torch.randn(4, 3)
    where = re.escape(f"{__file__}:{line}")
    with pytest.raises(ExportError, match=rf"torch.autograd.Function {__name__}.{name} \(applied at {where}\)"
                                          r".*fallback=True"):
        om(x)


@pytest.mark.parametrize("how", list(WAYS))
def test_a_function_runs_in_pytorch_with_fallback(how):
    _quiet()
    ref = Net(how)
    om = ORTModule(copy.deepcopy(ref), fallback=True)
    x = torch.randn(4, 3)
    with pytest.warns(RuntimeWarning, match=rf"torch.autograd.Function {__name__}.{WAYS[how][0]} "):
        out = om(x)
    torch.testing.assert_close(out, ref(x))
    out.pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for (name, p), q in zip(ref.named_parameters(), om.module.parameters()):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad)


@pytest.mark.parametrize("how", list(WAYS))
def test_without_grad_the_exported_forward_runs(how):
    _quiet()
    ref = Net(how)
    om = ORTModule(copy.deepcopy(ref))
    x = torch.randn(4, 3)
    with torch.no_grad():
        torch.testing.assert_close(om(x), ref(x))
    assert om.exports == 1


class Detached(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x)
        return y * y.detach()


def test_the_marks_of_cut_gradients_are_not_counted_as_functions():
    _quiet()
    ref = Detached()
    om = ORTModule(copy.deepcopy(ref))
    x = torch.randn(4, 3)
    om(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(om.module.lin.weight.grad, ref.lin.weight.grad)
