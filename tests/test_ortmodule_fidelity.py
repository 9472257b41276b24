"""ORTModule does what the wrapped module does in PyTorch, or refuses with a clear error."""

from __future__ import annotations

import copy
import inspect
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from gradbuilder.compiler.split import build_split
from gradbuilder.errors import InvalidModelError
from gradbuilder.ortmodule import ExportError, ORTModule
from gradbuilder.ortmodule import compiled

from .torch_models import compare_with_torch


def _quiet():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)


def _pair(module: torch.nn.Module, **options):
    """(the module, an ORTModule of a copy of it)."""
    _quiet()
    return module, ORTModule(copy.deepcopy(module), **options)


def _grads(module: torch.nn.Module) -> dict:
    return {n: p.grad for n, p in module.named_parameters()}


class Linear(torch.nn.Module):
    def __init__(self, then=None):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 3)
        self.then = then

    def forward(self, x):
        y = self.lin(x)
        return self.then(y) if self.then is not None else y


# ----------------------------------------------------------------------------- outputs
class Twice(Linear):
    def forward(self, x):
        y = self.lin(x)
        return y, y, y.detach()


def test_a_tensor_returned_twice_takes_both_gradients_and_a_detached_one_none():
    ref, om = _pair(Twice())
    x = torch.randn(4, 3)
    for model in (ref, om):
        a, b, c = model(x)
        assert a is b and not c.requires_grad
        (2 * a.sum() + 4 * b.pow(2).sum() + c.sum()).backward()
    for name, g in _grads(ref).items():
        torch.testing.assert_close(_grads(om.module)[name], g)


class WithNone(Linear):
    def forward(self, x):
        return self.lin(x), None, {"none": None, "y": torch.tanh(x)}


def test_none_among_the_outputs():
    ref, om = _pair(WithNone())
    x = torch.randn(2, 3)
    a, none, d = om(x)
    assert none is None and d["none"] is None
    a_ref, _, d_ref = ref(x)
    torch.testing.assert_close(a, a_ref)
    torch.testing.assert_close(d["y"], d_ref["y"])


class ArgmaxOnly(Linear):
    def forward(self, x):
        return self.lin(x).argmax(dim=-1)


def test_an_integer_output_alone_is_a_tensor_without_grad():
    ref, om = _pair(ArgmaxOnly())
    x = torch.randn(5, 3)
    out = om(x)
    assert out.dtype == torch.int64 and not out.requires_grad
    torch.testing.assert_close(out, ref(x))


# ----------------------------------------------------------------------------- in-place changes
def test_changing_an_output_in_place_before_backward_raises_where_pytorch_does():
    """Tanh's gradient reads its output: changed in place, PyTorch refuses the backward, and so
    do we; a Linear's gradient does not read its output, so both allow it."""
    x = torch.randn(4, 3)
    for model in _pair(Linear(torch.tanh)):
        y = model(x)
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    ref, om = _pair(Linear())
    for model in (ref, om):
        y = model(x)
        y.add_(1)
        y.pow(2).sum().backward()
    for name, g in _grads(ref).items():
        torch.testing.assert_close(_grads(om.module)[name], g)


def test_changing_an_input_the_backward_reads_raises_where_pytorch_does():
    """The weight's gradient reads the Linear's input."""
    for model in _pair(Linear()):
        x = torch.randn(4, 3)
        y = model(x)
        x.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


# ----------------------------------------------------------------------------- autograd Functions
class StraightThrough(torch.autograd.Function):
    """Rounds in the forward, passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class Quantized(Linear):
    def forward(self, x):
        return StraightThrough.apply(self.lin(x)) * 2


def test_a_straight_through_estimator_trains_with_its_own_backward():
    """Quantization-aware training's straight-through estimator: round in the forward, the
    gradient passed through unchanged (round's own derivative is zero almost everywhere)."""
    x = torch.randn(4, 3)
    ref, om = _pair(Quantized())
    torch.testing.assert_close(om(x), ref(x))
    om(x).sum().backward()
    ref(x).sum().backward()
    for name, g in _grads(ref).items():
        torch.testing.assert_close(_grads(om.module)[name], g)
    assert om.module.lin.weight.grad.abs().sum() > 0
    with torch.no_grad():
        torch.testing.assert_close(om(x), ref(x))


# ----------------------------------------------------------------------------- tensor values in Python
class RepeatByValue(Linear):
    def forward(self, x):
        n = int(x.abs().sum().item()) % 3 + 1
        for _ in range(n):
            x = self.lin(x)
        return x


class BranchOnBuffer(Linear):
    def __init__(self):
        super().__init__()
        self.register_buffer("ready", torch.tensor(False))

    def forward(self, x):
        if not self.ready:
            return self.lin(x) * 0.5
        return self.lin(x)


class LayerDrop(Linear):
    def forward(self, x):
        if self.training and torch.rand(()) < 0.5:
            return x
        return self.lin(x)


@pytest.mark.parametrize("module, method", [(RepeatByValue, "item"), (BranchOnBuffer, "__bool__"),
                                            (LayerDrop, "__bool__")])
def test_a_tensor_value_read_into_python_is_refused_with_its_place(module, method):
    torch.manual_seed(0)
    x = torch.randn(2, 3)
    _, om = _pair(module())
    line = next(i for i, text in enumerate(inspect.getsource(module.forward).splitlines())
                if "item()" in text or "if " in text) + module.forward.__code__.co_firstlineno
    with pytest.raises(ExportError, match=rf"test_ortmodule_fidelity.py:{line} \(Tensor.{method}\).*fallback=True"):
        om(x)


def test_a_tensor_value_read_into_python_runs_in_pytorch_with_fallback():
    ref, om = _pair(RepeatByValue(), fallback=True)
    x = torch.randn(2, 3)
    with pytest.warns(RuntimeWarning, match=r"Tensor.item"):
        torch.testing.assert_close(om(x), ref(x))
    for scale in (0.1, 1.0, 3.0):  # the values that set the loop count change
        x = torch.randn(2, 3) * scale
        torch.testing.assert_close(om(x), ref(x))


# ----------------------------------------------------------------------------- detach and grad mode
class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)


class DetachedBranch(TwoLayers):
    """b reads a's output cut from its gradient; the sum reads it whole."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        y = self.a(x)
        if self.how == "detach":
            cut = y.detach()
        elif self.how == "torch.detach":
            cut = torch.detach(y)
        elif self.how == "data":
            cut = y.data
        else:  # detach_, on a copy of y
            cut = y * 1
            cut.detach_()
        return self.b(cut) + y


def _same_gradients(ref, om, *args, batches=((4, 3), (4, 3), (6, 3))):
    """Outputs and parameter gradients of both for a few batches (new values, new sizes)."""
    for shape in batches:
        x = torch.randn(*shape)
        for model in (ref, om):
            model.zero_grad()
            model(x, *args).pow(2).sum().backward()
        torch.testing.assert_close(om(x, *args), ref(x, *args))
        for name, g in _grads(ref).items():
            torch.testing.assert_close(_grads(om.module)[name], g, msg=name)


@pytest.mark.parametrize("how", ["detach", "torch.detach", "data", "detach_"])
def test_a_detached_tensor_takes_no_gradient_as_in_pytorch(how):
    _same_gradients(*_pair(DetachedBranch(how)))


class ParameterData(TwoLayers):
    def forward(self, x):
        return self.a(x) + x @ self.b.weight.data.t()


def test_a_parameters_data_follows_its_value_and_takes_no_gradient():
    ref, om = _pair(ParameterData())
    _same_gradients(ref, om)
    for model in (ref, om):
        with torch.no_grad():
            model.b.weight.mul_(2)  # an optimizer step: .data is read again, not a constant
    _same_gradients(ref, om)
    assert om.exports == 1


class GradModeOff(TwoLayers):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def forward(self, x):
        if self.mode == "set_grad_enabled":
            off = torch.set_grad_enabled(False)
        else:
            off = getattr(torch, self.mode)()
        with off:
            gate = torch.sigmoid(self.b(x)).mean(dim=-1, keepdim=True)
        gate = gate.clone()  # an inference tensor can not be saved for the backward
        return self.a(x) * gate + self.b(x)


@pytest.mark.parametrize("mode", ["no_grad", "set_grad_enabled", "inference_mode"])
def test_a_computation_with_grad_mode_off_inside_forward_takes_no_gradient(mode):
    _same_gradients(*_pair(GradModeOff(mode)))


class BufferFromWeight(TwoLayers):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(3, 3))

    def forward(self, x):
        with torch.no_grad():
            self.seen.copy_(self.a.weight)  # written from a tensor that requires grad
        return self.a(x) + x @ self.seen


def test_a_buffer_written_with_grad_off_from_a_parameter_gives_it_no_gradient():
    _same_gradients(*_pair(BufferFromWeight()))


class DetachedIds(TwoLayers):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)

    def forward(self, x, ids):
        mask = (ids > 0).float().unsqueeze(-1)
        h = self.emb(ids.detach()) * mask.detach()  # neither requires grad: nothing to cut
        return self.a(x + h) + self.b(self.a(x).detach())


def test_detaching_integer_ids_and_a_mask_is_fine_beside_a_detached_activation():
    ref, om = _pair(DetachedIds())
    ids = torch.tensor([[0, 1, 2, 4], [3, 0, 1, 1], [2, 2, 0, 1], [4, 3, 2, 1]])
    _same_gradients(ref, om, ids, batches=((4, 4, 3), (4, 4, 3)))
    compiled = next(iter(om.compiled_graphs.values()))
    assert len(compiled.exported.stop_gradients) == 1  # the activation's detach only


class ChangedInPlaceWithoutGrad(TwoLayers):
    def forward(self, x):
        y = self.a(x)
        with torch.no_grad():
            y.mul_(2)  # PyTorch's gradient does not see this
        return self.b(y)


def test_changing_a_tensor_that_requires_grad_in_place_with_grad_off_is_refused_or_falls_back():
    x = torch.randn(4, 3)
    _, om = _pair(ChangedInPlaceWithoutGrad())
    line = ChangedInPlaceWithoutGrad.forward.__code__.co_firstlineno + 3
    with pytest.raises(ExportError, match=rf"test_ortmodule_fidelity.py:{line} \(Tensor.mul_ .*fallback=True"):
        om(x)
    ref, om = _pair(ChangedInPlaceWithoutGrad(), fallback=True)
    with pytest.warns(RuntimeWarning, match="Tensor.mul_"):
        om(x).sum().backward()
    ref(x).sum().backward()
    for name, g in _grads(ref).items():
        torch.testing.assert_close(_grads(om.module)[name], g)


# ----------------------------------------------------------------------------- max and min
class MaxMin(torch.nn.Module):
    def forward(self, x):
        values, indices = torch.max(x, 1)
        low = x.min(dim=0, keepdim=True).values  # indices unused
        high = x.max(-1)[0]
        return values * (indices + 1), low * 3, high.pow(2)


def test_max_and_min_along_a_dim_send_the_gradient_to_the_returned_index():
    _quiet()
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 1.0, 2.0], [1.0, 4.0, 1.0, 4.0]])
    grads = []
    for model in (MaxMin(), ORTModule(MaxMin())):
        xg = x.clone().requires_grad_()
        outs = model(xg)
        sum(o.sum() for o in outs).backward()
        grads.append(xg.grad)
    torch.testing.assert_close(grads[1], grads[0])


class TiedMax(torch.nn.Module):
    """A loss of ``op(w * x, 1)``'s values and indices, with ties in the rows of ``w``."""

    def __init__(self, op, keepdim):
        super().__init__()
        self.op, self.keepdim = op, keepdim
        self.w = torch.nn.Parameter(torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 1.0, 2.0], [1.0, 4.0, 1.0, 4.0]]))

    def forward(self, x):
        values, indices = self.op(self.w * x, 1, keepdim=self.keepdim)
        return (values * values * (indices + 1)).sum()


@pytest.mark.parametrize("op, keepdim, opset", [(torch.max, False, 17), (torch.max, True, 18),
                                                (torch.min, False, 18), (torch.min, True, 17)])
def test_gradient_graph_of_an_exported_max_with_indices_matches_pytorch(op, keepdim, opset):
    """ReduceMax and ArgMax of the same input and axis (torch.max(x, dim) exported by the
    TorchScript exporter) take PyTorch's gradient: all of it at the returned index."""
    compare_with_torch(TiedMax(op, keepdim), (torch.ones(3, 4),), ["x"], dynamo=False, opset=opset, rtol=1e-6)


MAX, MIN = torch.max, torch.min  # taken before any ORTModule runs, as a module's code may take them


class AlongDim(torch.nn.Module):
    """max or min of ``x * w`` along ``dim``: ``call`` says how the code reaches the operator,
    ``returns`` what the module returns (values and indices, values, values unpacked from the
    pair). The rows of ``w`` hold ties."""

    def __init__(self, op, dim, keepdim, call, returns):
        super().__init__()
        self.op, self.dim, self.keepdim, self.call, self.returns = op, dim, keepdim, call, returns
        self.w = torch.nn.Parameter(torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 1.0, 2.0], [1.0, 4.0, 1.0, 4.0]]))

    def forward(self, x):
        y = x * self.w
        if self.call == "taken":
            result = (MAX if self.op == "max" else MIN)(y, dim=self.dim, keepdim=self.keepdim)
        elif self.call == "torch":
            result = (torch.max if self.op == "max" else torch.min)(y, self.dim, self.keepdim)
        else:
            result = (y.max if self.op == "max" else y.min)(self.dim, keepdim=self.keepdim)
        if self.returns == "both":
            return result
        if self.returns == "values":
            return result[0]
        values, _ = result
        return values * 2


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dim, keepdim", [(0, True), (1, False), (-1, True), (-2, False)])
@pytest.mark.parametrize("call, returns", [("taken", "both"), ("taken", "values"), ("torch", "unpacked"),
                                           ("method", "values")])
def test_max_and_min_along_a_dim_match_pytorch_with_ties(op, dim, keepdim, call, returns):
    """Outputs, indices and the gradients of the input and the weight, all of each value's
    gradient at the returned index (the first of tied values, on CPU)."""
    ref, om = _pair(AlongDim(op, dim, keepdim, call, returns))
    x = torch.tensor([1.0, 1.0, 2.0]).repeat(2, 3, 4)[:, :, :4].contiguous()  # more ties
    runs = []
    for model in (ref, om):
        xg = x.clone().requires_grad_()
        out = model(xg)
        values = out[0] if returns == "both" else out
        (values * torch.arange(values.numel()).reshape(values.shape)).sum().backward()
        runs.append((out, xg.grad, model.w.grad if model is ref else model.module.w.grad))
    (out_ref, x_ref, w_ref), (out_om, x_om, w_om) = runs
    if returns == "both":
        assert type(out_om) is type(out_ref) and torch.equal(out_om.indices, out_ref.indices)
    torch.testing.assert_close(out_om, out_ref)
    torch.testing.assert_close(x_om, x_ref)
    torch.testing.assert_close(w_om, w_ref)


@pytest.mark.parametrize("op", [MAX, MIN])
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("keepdim", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_max_and_min_of_a_16_bit_input_return_values_and_indices_as_pytorch(op, dim, keepdim, dtype):
    """A module without parameters returning ``op(x, dim, keepdim)``; the input takes the
    gradient (onnxruntime's CPU provider has no bfloat16 ArgMax: it reads the input widened)."""

    class Reduce(torch.nn.Module):
        def forward(self, x):
            return op(x, dim=dim, keepdim=keepdim)

    _quiet()
    x = torch.tensor([1.0, 0.5, 1.0]).repeat(4, 5, 2).to(dtype)
    x = x + torch.rand(x.shape).to(dtype) * (torch.rand(x.shape) < 0.5)  # ties and distinct values
    runs = []
    for model in (Reduce(), ORTModule(Reduce())):
        xg = x.clone().requires_grad_()
        values, indices = model(xg)
        values.sum().backward()
        runs.append((values, indices, xg.grad))
    for ours, theirs in zip(runs[1], runs[0]):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_split_graphs_of_a_max_whose_values_and_indices_are_outputs():
    """ReduceMax and ArgMax of one input (what the exporter writes for ``torch.max(x, dim)``)
    become one GatherElements before the split: the forward graph returns it under the
    ReduceMax output's name, and the gradient goes to the index."""
    h = onnx.helper
    nodes = [h.make_node("ReduceMax", ["x"], ["values"], axes=[1], keepdims=0),
             h.make_node("ArgMax", ["x"], ["indices"], axis=1, keepdims=0)]
    graph = h.make_graph(nodes, "max", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4])],
                         [h.make_tensor_value_info("values", onnx.TensorProto.FLOAT, ["n"]),
                          h.make_tensor_value_info("indices", onnx.TensorProto.INT64, ["n"])])
    split = build_split(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), ["x"], outputs=["values"])
    for model in (split.forward, split.backward):
        onnx.checker.check_model(model)
    assert split.outputs == ["values", "indices"]
    x = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 1.0, 2.0]], np.float32)
    forward = ort.InferenceSession(split.forward.SerializeToString(), providers=["CPUExecutionProvider"])
    results = dict(zip([o.name for o in forward.get_outputs()], forward.run(None, {"x": x})))
    np.testing.assert_array_equal(results["values"], [3.0, 2.0])
    np.testing.assert_array_equal(results["indices"], [1, 0])
    backward = ort.InferenceSession(split.backward.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {**{n: results[n] for n in split.saved}, **{"x": x}}
    feeds.update({seed: np.array([1.0, 10.0], np.float32) for seed in split.seeds})
    feeds = {i.name: feeds[i.name] for i in backward.get_inputs()}
    (grad,) = backward.run([split.gradients["x"]], feeds)
    np.testing.assert_array_equal(grad, [[0.0, 1.0, 0.0, 0.0], [10.0, 0.0, 0.0, 0.0]])


def test_a_graph_that_fails_onnx_checker_is_refused_before_onnxruntime(monkeypatch):
    """A graph onnx.checker refuses is never handed to onnxruntime: the error names the graph and
    the checker's finding; with fallback=True the module runs in PyTorch."""
    build = compiled.build_split

    def broken(*args, **kwargs):
        split = build(*args, **kwargs)
        split.forward.graph.output.append(onnx.helper.make_tensor_value_info("dangling", onnx.TensorProto.FLOAT, [1]))
        return split

    monkeypatch.setattr(compiled, "build_split", broken)
    monkeypatch.setattr(compiled, "compile_graph", None)  # not reached
    x = torch.randn(4, 3)
    _, om = _pair(Linear())
    with pytest.raises(InvalidModelError, match=r"ORTModule\(Linear\): the forward graph built for input signature 0 "
                                                r"fails onnx.checker: .*'dangling'.*fallback=True"):
        om(x)
    ref, om = _pair(Linear(), fallback=True)
    with pytest.warns(RuntimeWarning, match="fails onnx.checker"):
        out = om(x)
    torch.testing.assert_close(out, ref(x))


# ----------------------------------------------------------------------------- the wrapper is transparent
class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 3)
        self.scale = 1.0

    def forward(self, input_ids, attention_mask=None, labels=None):
        y = self.lin(input_ids) * self.scale
        if getattr(self, "bias2", None) is not None:
            y = y + self.bias2
        return y

    def predict(self, x):
        return self(x).argmax(-1)


def test_forward_signature_is_the_modules():
    om = ORTModule(Scaled())
    assert inspect.signature(om.forward) == inspect.signature(Scaled().forward)
    assert list(inspect.signature(om.forward).parameters) == ["input_ids", "attention_mask", "labels"]
    om.forward = lambda input_ids: input_ids * 2  # replaced, as on any module
    x = torch.randn(2, 3)
    torch.testing.assert_close(om(x), x * 2)


def test_attributes_parameters_and_buffers_set_on_the_wrapper_are_the_modules():
    ref, om = _pair(Scaled())
    x = torch.randn(2, 3)
    torch.testing.assert_close(om(x), ref(x))
    for model in (ref, om):
        model.scale = 3.0
        model.bias2 = torch.nn.Parameter(torch.ones(3))
    assert om.module.scale == 3.0 and "bias2" in dict(om.named_parameters()) and "bias2" in om.state_dict()
    out = om(x)
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(om.module.bias2.grad, ref.bias2.grad)
    om.register_buffer("steps", torch.zeros(()))
    assert [n for n, _ in om.named_buffers()] == ["steps"] and "steps" in om.state_dict()
    assert om.module.steps is dict(om.named_buffers())["steps"]


def test_a_method_that_calls_self_runs_through_the_ortmodule():
    ref, om = _pair(Scaled())
    x = torch.randn(4, 3)
    assert torch.equal(om.predict(x), ref.predict(x))
    assert om.exports == 1
    assert type(om.module(x).grad_fn).__name__ == "ORTFunctionBackward"


def test_a_parent_module_round_trips_its_state_dict():
    _quiet()
    torch.manual_seed(0)
    plain = torch.nn.Sequential(Scaled(), torch.nn.BatchNorm1d(3))
    parent = torch.nn.Sequential(ORTModule(copy.deepcopy(plain[0])), torch.nn.BatchNorm1d(3))
    state = plain.state_dict()
    assert list(parent.state_dict()) == list(state)
    with torch.no_grad():
        for t in state.values():
            t.add_(1)  # other values, same keys
    parent.load_state_dict(state)
    for key, value in parent.state_dict().items():
        torch.testing.assert_close(value, state[key])
    del state["0.lin.bias"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0.lin.bias"'):
        parent.load_state_dict(state)


def test_a_compiled_ortmodule_can_be_copied():
    ref, om = _pair(Scaled())
    x = torch.randn(2, 3)
    om(x)
    other = copy.deepcopy(om)
    torch.testing.assert_close(other(x), ref(x))
    assert other.module.forward.owner is other


# ----------------------------------------------------------------------------- constants
def test_a_str_argument_is_a_constant_and_says_so():
    class Tagged(Linear):
        def forward(self, x, mode="sum"):
            y = self.lin(x)
            return y.sum(0) if mode == "sum" else y.mean(0)

    ref, om = _pair(Tagged())
    x = torch.randn(3, 3)
    with pytest.warns(UserWarning, match=r"str 'mean' \(kwargs\['mode'\]\).*constant"):
        out = om(x, mode="mean")
    torch.testing.assert_close(out, ref(x, mode="mean"))


class SizedLoss(torch.nn.Module):
    """An operator whose export needs a size as a number: CrossEntropyLoss's ignore_index from
    ``output.size(1)``."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(32, 16, padding_idx=1)

    def forward(self, ids, positions):
        output = torch.transpose(self.embedding(ids), 0, 1)
        return torch.nn.CrossEntropyLoss(ignore_index=output.size(1))(output, positions)


class AdaptivePool(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, kernel_size=3, stride=2, padding=1, bias=False)
        self.pool = torch.nn.AdaptiveAvgPool2d((4, 6))

    def forward(self, x):
        return self.pool(self.conv(x))  # the exporter needs the input's size as numbers


@pytest.mark.parametrize("module, inputs", [
    (SizedLoss, lambda n: (torch.randint(32, (n,)), torch.randint(n, (16,)))),
    (AdaptivePool, lambda n: (torch.randn(2, 3, 8 * n // 3, 4 * n),)),  # sizes the pool's divide
], ids=["ignore-index-from-a-size", "adaptive-pool"])
def test_an_export_needing_sizes_as_numbers_holds_per_input_shape(module, inputs, caplog):
    """The export with symbolic sizes fails; the module is exported for the call's sizes and
    again for each other shape, and trains as in PyTorch over several optimizer steps."""
    torch.manual_seed(0)
    ref, om = _pair(module())
    opt_ref, opt_om = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(om.parameters(), lr=0.5)
    with caplog.at_level("INFO", logger="gradbuilder.ortmodule"):
        for n in (6, 9, 6, 12, 9):
            args = inputs(n)
            for model, opt in ((ref, opt_ref), (om, opt_om)):
                opt.zero_grad()
                out = model(*args)
                loss = out if out.dim() == 0 else out.square().mean()
                loss.backward()
                opt.step()
                if model is ref:
                    expected = loss
            torch.testing.assert_close(loss, expected)
    for p_om, p_ref in zip(om.parameters(), ref.parameters()):
        torch.testing.assert_close(p_om, p_ref)
    assert om.exports == 3  # one per shape
    assert any("symbolic sizes failed" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- writes into slices, grouped-query attention
def _same_outputs_and_summed_gradients(ref, om, calls, loss=lambda out: out):
    """Each of ``calls`` (argument tuples) gives both the same output, and the parameter
    gradients of ``loss`` of the outputs, summed over the calls, are the same."""
    for args in calls:
        want, got = ref(*args), om(*args)
        torch.testing.assert_close(got, want)
        loss(want).backward()
        loss(got).backward()
    for name, g in _grads(ref).items():
        torch.testing.assert_close(_grads(om.module)[name], g, msg=name)


class SliceWrites(torch.nn.Module):
    """Two writes into slices of a new tensor (DeepSeek-V3's key states are built so)."""

    def __init__(self, new):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 8)
        self.new = new

    def forward(self, x):
        y = self.lin(x)
        a, b = y.split([4, 4], -1)
        out = y.new_empty(*y.shape[:-1], 8) if self.new == "new_empty" else torch.zeros(*y.shape[:-1], 8)
        out[..., :4].copy_(a)
        out[..., 4:].copy_(b * 2)
        return (out * out).sum()


@pytest.mark.parametrize("new", ["new_empty", "zeros"])
def test_writes_into_slices_of_a_new_tensor_keep_both(new):
    """Both writes reach the graph (one used to be dropped: a silently wrong loss), and the
    gradient goes through each to its source."""
    _same_outputs_and_summed_gradients(*_pair(SliceWrites(new)), [(torch.randn(rows, 4),) for rows in (3, 5)])


class GroupedQueryAttention(torch.nn.Module):
    def __init__(self, masked, causal):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.kv = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)  # 4 query heads, 2 key/value heads of 2
        self.masked, self.causal = masked, causal

    def forward(self, x, mask):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 2).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 4).transpose(1, 2).split(2, dim=-1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask if self.masked else None, is_causal=self.causal, scale=0.3, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, s, 8)


@pytest.mark.parametrize("masked,causal", [(False, True), (False, False), (True, False)])
def test_grouped_query_scaled_dot_product_attention(masked, causal):
    """``enable_gqa=True`` (which torch's TorchScript exporter refuses) gives PyTorch's values
    and gradients: each key and value head serves its group of query heads."""
    def call(s):
        mask = torch.rand(2, 1, s, s) > 0.3
        mask[..., 0] = True  # every query sees a key
        return torch.randn(2, s, 8), mask

    _same_outputs_and_summed_gradients(*_pair(GroupedQueryAttention(masked, causal)), [call(5), call(3)],
                                       loss=lambda out: out.square().sum())


class IndexAdd(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.dim = dim

    def forward(self, x, index):
        y = self.lin(x)
        if self.dim == 1:
            return torch.zeros(4, 3).index_add(1, index, y.t(), alpha=0.5).square().sum()
        out = torch.zeros(3, 4)
        out.index_add_(0, index, y)
        return out.square().sum()


@pytest.mark.parametrize("dim", [0, 1])
def test_index_add_with_repeated_indices_adds_every_row(dim):
    """torch's exporter writes index_add as a scatter where the last of repeated indices wins
    (a wrong loss, with only a warning); every row is added here, as in PyTorch."""
    indices = (torch.tensor([0, 2, 0, 0, 1]), torch.tensor([1, 1, 1]))
    _same_outputs_and_summed_gradients(*_pair(IndexAdd(dim)), [(torch.randn(len(i), 4), i) for i in indices])


class EveryRowOfAParameter(torch.nn.Module):
    """A stacked parameter read one row at a time (experts' weights): its gradient is the rows'
    gradients side by side (a Concat in place of a Sum of padded rows)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(3, 4, 4))

    def forward(self, x):
        return sum(torch.nn.functional.linear(x, self.w[e]).square().sum() for e in range(3))


def test_a_parameter_read_row_by_row_takes_its_whole_gradient():
    """The backward graph's gradient output is the Concat that replaced the Sum (it used to name
    the removed Sum's output: the backward graph failed onnx.checker)."""
    ref, om = _pair(EveryRowOfAParameter())
    x = torch.randn(5, 4)
    ref(x).backward()
    om(x).backward()
    torch.testing.assert_close(om.module.w.grad, ref.w.grad)
