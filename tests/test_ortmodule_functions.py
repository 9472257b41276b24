"""ORTModule and torch.autograd.Function: every Function the traced call applies runs in
PyTorch between onnxruntime graphs (a graph break), with the gradient its own backward defines,
however the module's code reaches its ``apply`` and whatever form the Function takes. Each
module is checked against the plain module over several optimizer steps: losses, gradients,
parameters and buffers."""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import re
import warnings

import pytest
import torch

from gradbuilder.ortmodule import DebugOptions, ExportError, LogLevel, ORTModule


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


def train_alike(make, batches, steps: int = 3, loss=lambda out: out.pow(2).sum(), lr: float = 0.05, **options):
    """ORTModule(make()) and make() trained side by side with SGD on ``batches(step)``: the
    same losses, gradients, parameters and buffers at every step. Returns the ORTModule."""
    torch.manual_seed(0)
    ref = make()
    om = ORTModule(copy.deepcopy(ref), **options)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr)
    opt_om = torch.optim.SGD(om.parameters(), lr=lr)
    for step in range(steps):
        args = batches(step)
        want, got = loss(ref(*args)), loss(om(*copy.deepcopy(args)))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        opt_ref.zero_grad()
        opt_om.zero_grad()
        want.backward()
        got.backward()
        for (name, p), q in zip(ref.named_parameters(), om.module.parameters()):
            assert (p.grad is None) == (q.grad is None), (step, name)
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=f"step {step}: {name}")
        opt_ref.step()
        opt_om.step()
    for (name, p), q in zip(ref.state_dict().items(), om.module.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5, msg=name)
    return om


@pytest.mark.parametrize("how", list(WAYS))
def test_a_function_trains_with_its_own_backward(how, caplog):
    """The Linear's gradient flows only through the Function, whose backward triples (or
    halves) it: the ORTModule's gradients are those, not the forward's derivative."""
    _quiet()
    name, line = WAYS[how]
    with caplog.at_level(logging.INFO, logger="gradbuilder.ortmodule"):
        om = train_alike(lambda: Net(how), lambda step: (torch.randn(4, 3),),
                         debug_options=DebugOptions(log_level=LogLevel.INFO))
    assert om.exports == 1
    where = f"{__file__}:{line}"
    assert any(f"graph break at {__name__}.{name} (applied at {where})" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("how", list(WAYS))
def test_without_grad_the_function_runs_forward_only(how):
    _quiet()
    ref = Net(how)
    om = ORTModule(copy.deepcopy(ref))
    x = torch.randn(4, 3)
    with torch.no_grad():
        got = om(x)
    torch.testing.assert_close(got, ref(x).detach())
    assert not got.requires_grad and om.exports == 1
    om.eval()
    ref.eval()
    torch.testing.assert_close(om(x), ref(x))


# ---------------------------------------------------------------------------- the forms a Function takes
class Affine(torch.autograd.Function):
    """Non-tensor arguments: a float, a tuple and None; a scale applied in the backward too."""

    @staticmethod
    def forward(ctx, x, k, shift, nothing):
        assert nothing is None and isinstance(shift, tuple)
        ctx.k = k
        return x * k + shift[0]

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k * 2, None, None, None


class SplitSigns(torch.autograd.Function):
    """Two outputs, the second without gradient (mark_non_differentiable); gradients not
    materialized (an output nothing differentiates gives None)."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        return x.clamp(min=0), (x > 0).to(x.dtype)

    @staticmethod
    def backward(ctx, g, g_mask):
        (x,) = ctx.saved_tensors
        return None if g is None else g * (x > 0) * 1.5


class DoubleInPlace(torch.autograd.Function):
    """Changes its input in place (mark_dirty)."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 4


class ScaledBy(torch.autograd.Function):
    """Two tensor inputs, one of them a parameter; a gradient for each."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0) * 0.5


class Product(torch.autograd.Function):
    """x * y with a backward scaled by 0.75: applied to one tensor twice, its two gradients add up."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y * 0.75, g * x * 0.75


class AddsInPlace(torch.autograd.Function):
    """Changes its input in place without mark_dirty, and returns another tensor."""

    @staticmethod
    def forward(ctx, bias, x):
        x.add_(3 * bias)
        return x * 5

    @staticmethod
    def backward(ctx, g):
        return g.sum(0) * 3, g * 5


class ReturnsItChangedUnmarked(torch.autograd.Function):
    """Changes its input in place and returns it, without mark_dirty (PyTorch then returns
    another tensor object)."""

    @staticmethod
    def forward(ctx, bias, x):
        return x.add_(3 * bias)

    @staticmethod
    def backward(ctx, g):
        return g.sum(0), g


class ChangedInPlace(torch.nn.Module):
    """Reads of the changed tensor before the Function see its old values, reads after it the
    new ones, as the program runs in PyTorch (``how``: "dirty", DoubleInPlace, marked dirty;
    "returned", ReturnsItChangedUnmarked; else AddsInPlace, not marked)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = torch.nn.Linear(3, 4)
        self.bias = torch.nn.Parameter(torch.linspace(-0.5, 0.5, 4))
        self.shift = torch.nn.Parameter(torch.full((4,), 0.25))

    def forward(self, inp):
        x = self.lin(inp) * 1
        before = (x + self.shift).tanh()
        if self.how == "dirty":
            y = DoubleInPlace.apply(x)
        elif self.how == "returned":
            y = ReturnsItChangedUnmarked.apply(self.bias, x)
        else:
            y = AddsInPlace.apply(self.bias, x)
        after = x * self.shift
        return before + y + after


def test_a_function_that_changes_its_input_in_place_keeps_the_program_order():
    _quiet()
    train_alike(lambda: ChangedInPlace("dirty"), lambda step: (torch.randn(5, 3),), steps=3)


@pytest.mark.parametrize("how,function", [("not returned", "AddsInPlace"), ("returned", "ReturnsItChangedUnmarked")])
def test_a_change_in_place_without_mark_dirty_is_refused_naming_the_function(how, function):
    """PyTorch's autograd does not see such a change, and torch's tracer repeats it in the graph
    after the Function: the values after it would be changed twice."""
    _quiet()
    line = _line(ChangedInPlace.forward, f"{function}.apply")
    with pytest.raises(ExportError, match=rf"without ctx.mark_dirty at {re.escape(__file__)}:{line} "
                                          rf"\({__name__}.{function}.apply\).*fallback=True"):
        ORTModule(ChangedInPlace(how))(torch.randn(5, 3))


class Forms(torch.nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.lin = torch.nn.Linear(3, 4)
        self.out = torch.nn.Linear(4, 2)
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        h = self.lin(x)
        if self.form == "constants":
            h = Affine.apply(h, 0.5, (1.0, "x"), None)
        elif self.form == "two outputs":
            pos, mask = SplitSigns.apply(h)
            h = pos + mask
        elif self.form == "in place":
            h = DoubleInPlace.apply(h * 1)
        elif self.form == "twice":
            h = Triple.apply(Triple.apply(h).tanh())
        elif self.form == "parameter":
            h = ScaledBy.apply(h, self.w)
        elif self.form == "shared input":
            t = h.tanh()
            h = Product.apply(t, t)
        elif self.form == "parameter alone":
            h = h + ScaledBy.apply(self.w.unsqueeze(0), self.w).sum()
        elif self.form == "no grad inside":
            with torch.no_grad():
                gate = Triple.apply(h)
            h = h * gate
        elif self.form == "buffer":
            h = Triple.apply(h) + self.seen
            if self.training:
                with torch.no_grad():
                    self.seen.add_(0.1)
        return self.out(h.relu() if self.form != "two outputs" else h)


FORMS = ["constants", "two outputs", "in place", "twice", "shared input", "parameter", "parameter alone",
         "no grad inside"]


@pytest.mark.parametrize("form", FORMS)
def test_every_form_of_function_trains_as_in_pytorch(form):
    _quiet()
    train_alike(lambda: Forms(form), lambda step: (torch.randn(5, 3) + step,), steps=4)


def test_the_forward_twice_before_one_backward():
    _quiet()
    torch.manual_seed(0)
    ref = Forms("parameter")
    om = ORTModule(copy.deepcopy(ref))
    a, b = torch.randn(5, 3), torch.randn(2, 3)
    (om(a).sum() + om(b).pow(2).sum()).backward()
    (ref(a).sum() + ref(b).pow(2).sum()).backward()
    for (name, p), q in zip(ref.named_parameters(), om.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert om.exports == 1  # the batch size is not part of the signature


def test_functions_on_input_tensors_that_require_grad():
    _quiet()
    torch.manual_seed(0)
    ref = Forms("twice")
    om = ORTModule(copy.deepcopy(ref))
    x1 = torch.randn(5, 3, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    om(x1).sum().backward()
    ref(x2).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)


class WrongCount(torch.autograd.Function):
    """Returns one tensor, or two once ``split`` is set."""

    split = False

    @staticmethod
    def forward(ctx, x):
        return (x * 2, x + 1) if WrongCount.split else x * 2

    @staticmethod
    def backward(ctx, *g):
        return g[0] * 2


class Changing(torch.nn.Module):
    def forward(self, x):
        out = WrongCount.apply(x * 1)
        return out[0] if isinstance(out, tuple) else out


def test_a_function_that_returns_another_number_of_tensors_than_traced_is_named():
    _quiet()
    om = ORTModule(Changing())
    om(torch.randn(2, 3, requires_grad=True))
    WrongCount.split = True
    try:
        with pytest.raises(ExportError, match=rf"{__name__}.WrongCount \(applied at .*\) returned 2 tensors where "
                                              "it returned 1 when traced"):
            om(torch.randn(2, 3, requires_grad=True))
    finally:
        WrongCount.split = False


class Detached(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x)
        return y * y.detach()


def test_the_marks_of_cut_gradients_are_not_graph_breaks():
    from gradbuilder.ortmodule.compiled import Compiled

    _quiet()
    ref = Detached()
    om = ORTModule(copy.deepcopy(ref))
    x = torch.randn(4, 3)
    om(x).sum().backward()
    assert all(isinstance(c, Compiled) for c in om.compiled_graphs.values())  # one graph pair, no break
    ref(x).sum().backward()
    torch.testing.assert_close(om.module.lin.weight.grad, ref.lin.weight.grad)


# ---------------------------------------------------------------------------- operations torch cannot export
class Differences(torch.nn.Module):
    """``torch.diff``, which torch's exporter cannot export at opset 17, between two Linears; its
    arguments are a constant, a negative dimension and a tensor computed in the graph."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 5)
        self.out = torch.nn.Linear(5, 2)

    def forward(self, x):
        h = self.lin(x).tanh()
        return self.out(torch.diff(h, n=1, dim=-1, prepend=h[:, :1] * 0.5))


def test_an_operation_the_exporter_cannot_export_is_refused_by_default():
    _quiet()
    with pytest.raises(ExportError, match=r"aten::diff.*graph_breaks=True.*fallback=True"):
        ORTModule(Differences())(torch.randn(3, 4))


def test_with_graph_breaks_the_operation_runs_in_pytorch(caplog):
    _quiet()
    with caplog.at_level(logging.INFO, logger="gradbuilder.ortmodule"):
        om = train_alike(Differences, lambda step: (torch.randn(3 + step, 4),), steps=3, graph_breaks=True,
                         debug_options=DebugOptions(log_level=LogLevel.INFO))
    assert om.exports == 1
    line = _line(Differences.forward, "torch.diff(")
    assert any(f"graph break at the PyTorch operation aten::diff (applied at {__file__}:{line})" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    with torch.no_grad():
        x = torch.randn(2, 4)
        ref = copy.deepcopy(om.module)
        torch.testing.assert_close(om(x), Differences.forward(ref, x))


def test_torch_exports_outside_ortmodule_are_left_as_they_were():
    """After ORTModule's traces, torch's own exporter still inlines a Function's forward and still
    refuses torch.diff with its own error."""
    import io

    _quiet()
    ORTModule(Differences(), graph_breaks=True)(torch.randn(3, 4))
    ORTModule(Net("attribute"))(torch.randn(3, 3)).sum().backward()
    with pytest.raises(torch.onnx.errors.UnsupportedOperatorError, match="aten::diff"):
        torch.onnx.export(Differences(), (torch.randn(3, 4),), io.BytesIO(), dynamo=False, opset_version=17)
    f = io.BytesIO()
    torch.onnx.export(Net("attribute"), (torch.randn(3, 3),), f, dynamo=False, opset_version=17)
    import onnx

    assert "FunctionBreak" not in {n.op_type for n in onnx.load_from_string(f.getvalue()).graph.node}


class ReturnsAConstantToo(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return Triple.apply(self.lin(x)), torch.ones(2)


class NormalizedFunction(torch.nn.Module):
    """BatchNorm in training mode (running statistics) on both sides of a Function."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)
        self.before = torch.nn.BatchNorm1d(4)
        self.after = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.after(Triple.apply(self.before(self.lin(x))))


def test_running_statistics_on_both_sides_of_a_function():
    _quiet()
    om = train_alike(NormalizedFunction, lambda step: (torch.randn(6, 3) * (1 + step),), steps=3)
    assert int(om.module.after.num_batches_tracked) == 3


def test_a_module_with_a_function_that_also_returns_a_constant():
    _quiet()
    train_alike(ReturnsAConstantToo, lambda step: (torch.randn(4, 3),), loss=lambda out: out[0].pow(2).sum() +
                out[1].sum())


class PassesItsFirstArgument(torch.autograd.Function):
    """Returns its first argument as it is, with the product of the other two."""

    @staticmethod
    def forward(ctx, passed, x, y):
        ctx.save_for_backward(x, y)
        return passed, x * y

    @staticmethod
    def backward(ctx, d_passed, d_product):
        x, y = ctx.saved_tensors
        return d_passed, d_product * y, d_product * x


class TakesAConstant(torch.nn.Module):
    """A Function whose first argument is a constant of the traced graph (a tensor attribute,
    not a buffer): its value is computed in a segment and crosses into PyTorch."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.ids = torch.tensor([1, 4, 6, 7])

    def forward(self, x):
        ids, product = PassesItsFirstArgument.apply(self.ids, self.lin(x), self.lin.bias)
        assert ids.grad_fn is None and ids.dtype == torch.int64
        return product * ids[:3].float()


def test_a_function_taking_a_constant_of_the_graph():
    _quiet()
    train_alike(TakesAConstant, lambda step: (torch.randn(4, 3),))


class HalvesGradient(torch.autograd.Function):
    """A copy forward; half the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 0.5


class EncoderWithBreaks(torch.nn.Module):
    """Transformer encoder layers with a Function between them (applied by a forward hook): the
    exporter leaves the Function's outputs untyped there, and each layer's weight transposes
    belong beside the layer."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0,
                                                 batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
        for inner in list(self.enc.layers)[:2]:
            inner.register_forward_hook(lambda mod, args, out: HalvesGradient.apply(out))

    def forward(self, x):
        return self.enc(x)


def test_an_encoder_with_functions_between_its_layers(caplog):
    _quiet()
    with caplog.at_level(logging.INFO, logger="gradbuilder.ortmodule"):
        train_alike(EncoderWithBreaks, lambda step: (torch.randn(2, 5 + step, 8),), steps=3,
                    debug_options=DebugOptions(log_level=LogLevel.INFO))
    plan = next(r.getMessage() for r in caplog.records if "graph break at" in r.getMessage())
    assert plan.count("graph break at") == 2 and plan.count("onnxruntime segment") == 3, plan


class NoiseOnBothSides(torch.nn.Module):
    """Noise drawn from a constant's shape, read before and after a Function: drawn once, not
    once in each graph around the break."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)

    def forward(self, x):
        other = torch.rand_like(torch.ones(4))  # drawn before it, read before the break only
        noise = torch.rand_like(torch.ones(4))
        before = self.lin(x) + noise
        return before - self.lin(x), Triple.apply(before + other) * 0 + noise


def test_a_random_value_read_on_both_sides_of_a_break_is_drawn_once():
    _quiet()
    om = ORTModule(NoiseOnBothSides())
    for _ in range(3):
        first, second = om(torch.randn(2, 3))
        torch.testing.assert_close(first, second.expand_as(first))
        assert float(second.min()) != float(second.max())  # really drawn


@pytest.mark.parametrize("threads", [1, 2, 16])
def test_graph_breaks_at_every_thread_count(threads):
    """onnxruntime's kernels differ by thread count: the segments around the Functions give the
    plain module's training at 1, 2 and 16 intra-op threads (16 oversubscribes this machine)."""
    import onnxruntime as ort

    _quiet()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    train_alike(EncoderWithBreaks, lambda step: (torch.randn(3, 6, 8),), steps=3, session_options=options,
                loss=lambda out: out.pow(2).mean())
