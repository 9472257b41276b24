"""ORTModule: training through onnxruntime matches plain PyTorch, step for step."""

from __future__ import annotations

import copy
import logging
import os
import warnings

import numpy as np
import onnx
import pytest
import torch
import transformers

from gradbuilder.errors import InvalidArgumentError, UnsupportedOpError
from gradbuilder.ortmodule import DebugOptions, ExportError, LogLevel, ORTModule

from .torch_models import tiny_bert, tiny_gpt2


RTOL = 1e-4


def _quiet():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    transformers.logging.set_verbosity_error()


# ----------------------------------------------------------------------------- models
def mlp():
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 5))


def cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(8 * 4 * 4, 5))


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.enc(x).mean(dim=1))


def bert():
    return tiny_bert(vocab=100, positions=64, labels=5, intermediate=64)


def gpt2():
    return tiny_gpt2(vocab=100, positions=64, use_cache=False)


def _ids(batch, seq, rng):
    return ((torch.randint(0, 100, (batch, seq), generator=rng),),
            {"attention_mask": torch.ones(batch, seq, dtype=torch.long)})


CASES = {
    # name: (factory, batch(step, rng) -> (args, kwargs, target), loss(output, target))
    "mlp": (mlp, lambda s, r: ((torch.randn(13 + s % 3, 10, generator=r),), {}, torch.randint(0, 5, (13 + s % 3,), generator=r)),
            lambda out, y: torch.nn.functional.cross_entropy(out, y)),
    "cnn-batchnorm": (cnn, lambda s, r: ((torch.randn(5 + s % 2, 3, 8, 8, generator=r),), {},
                                         torch.randint(0, 5, (5 + s % 2,), generator=r)),
                      lambda out, y: torch.nn.functional.cross_entropy(out, y)),
    "transformer-encoder": (Encoder, lambda s, r: ((torch.randn(3, 5 + s % 4, 32, generator=r),), {},
                                                   torch.randint(0, 5, (3,), generator=r)),
                            lambda out, y: torch.nn.functional.cross_entropy(out, y)),
    "bert": (bert, lambda s, r: (*_ids(5, 11 + s % 5, r), torch.randint(0, 5, (5,), generator=r)),
             lambda out, y: torch.nn.functional.cross_entropy(out.logits, y)),
    "gpt2": (gpt2, lambda s, r: (*_ids(5 + s % 2, 11 + s % 3, r), None),
             lambda out, y: out.logits.float().pow(2).mean()),
}


def _close(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """Largest difference relative to the tensor's own largest value (or 1% of the model's
    largest gradient, for tensors whose gradient is round-off, e.g. attention key biases)."""
    return float((a - b).abs().max()) / max(float(a.abs().max()), 1e-2 * scale, 1e-30)


SLOW_CASES = {"transformer-encoder", "bert", "gpt2"}  # seconds each; mlp and cnn-batchnorm stay in the fast lane


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES])
def test_twenty_steps_match_pytorch(name):
    """Losses and gradients equal PyTorch's (relative 1e-4) over 20 SGD steps with momentum;
    the sequence and batch sizes change between steps without a new export, except where the
    traced graph fixed a size."""
    _quiet()
    factory, batch, loss_fn = CASES[name]
    torch.manual_seed(0)
    ref = factory().train()
    om = ORTModule(copy.deepcopy(ref))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_om = torch.optim.SGD(om.parameters(), lr=0.05, momentum=0.9)
    rng = torch.Generator().manual_seed(1)
    worst_loss = worst_grad = 0.0
    shapes = set()
    for step in range(20):
        args, kwargs, target = batch(step, rng)
        shapes.add(tuple(args[0].shape))
        l_ref = loss_fn(ref(*args, **kwargs), target)
        l_om = loss_fn(om(*args, **kwargs), target)
        opt_ref.zero_grad()
        opt_om.zero_grad()
        l_ref.backward()
        l_om.backward()
        worst_loss = max(worst_loss, abs(l_ref.item() - l_om.item()) / abs(l_ref.item()))
        grads = [(p.grad, q.grad) for p, q in zip(ref.parameters(), om.parameters())]
        assert all((a is None) == (b is None) for a, b in grads)
        scale = max(float(a.abs().max()) for a, _ in grads if a is not None)
        worst_grad = max([worst_grad] + [_close(a, b, scale) for a, b in grads if a is not None])
        opt_ref.step()
        opt_om.step()
    assert worst_loss < RTOL and worst_grad < RTOL, (worst_loss, worst_grad)
    if name == "transformer-encoder":  # torch's MultiheadAttention traces the sequence length as a number
        assert om.exports == len(shapes) > 1
    else:
        assert om.exports == 1 and len(shapes) > 1  # one export for every batch and sequence size
    for (k, a), (k2, b) in zip(ref.state_dict().items(), om.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=k)  # BatchNorm running statistics too


def test_adamw_and_scheduler_unchanged():
    _quiet()
    torch.manual_seed(0)
    ref = mlp()
    om = ORTModule(copy.deepcopy(ref))
    runs = []
    for model in (ref, om):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        rng = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(8):
            x, y = torch.randn(16, 10, generator=rng), torch.randint(0, 5, (16,), generator=rng)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        runs.append(losses)
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)


def test_module_face_parameters_state_dict_modes():
    _quiet()
    torch.manual_seed(0)
    inner = cnn()
    ref = copy.deepcopy(inner)
    om = ORTModule(inner)
    assert [id(p) for p in om.parameters()] == [id(p) for p in inner.parameters()]
    assert list(om.state_dict()) == list(inner.state_dict())
    assert [n for n, _ in om.named_buffers()] == [n for n, _ in inner.named_buffers()]
    x = torch.randn(2, 3, 8, 8)
    om.eval()
    assert not inner.training
    with torch.no_grad():
        torch.testing.assert_close(om(x), ref.eval()(x), rtol=1e-5, atol=1e-6)
    other = cnn()
    om.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(om(x), other.eval()(x), rtol=1e-5, atol=1e-6)  # no new export needed
    assert om.exports == 1
    om.train()
    assert inner.training
    calls = []
    om.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    om(x)
    assert calls == [torch.Size([2, 5])]
    assert om.exports == 2  # eval, train


def test_float64_module():
    _quiet()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    om = ORTModule(copy.deepcopy(ref))
    x = torch.randn(4, 10, dtype=torch.float64)
    om(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, q in zip(ref.parameters(), om.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12)


def test_attributes_of_the_wrapped_module():
    _quiet()
    model = gpt2()
    om = ORTModule(model)
    assert om.config is model.config
    assert om.module is model


def test_signatures_rank_mode_requires_grad_and_no_grad():
    _quiet()
    torch.manual_seed(0)
    ref = mlp()
    om = ORTModule(copy.deepcopy(ref))
    om(torch.randn(4, 10))
    om(torch.randn(7, 10))
    assert om.exports == 1
    om(torch.randn(2, 4, 10))  # another rank
    assert om.exports == 2
    with torch.no_grad():
        out = om(torch.randn(4, 10))  # forward graph only
    assert om.exports == 3 and not out.requires_grad
    key = [k for k, c in om.compiled_graphs.items() if c.split is None]
    assert len(key) == 1
    x = torch.randn(5, 10, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    om(x).pow(2).sum().backward()
    ref(x_ref).pow(2).sum().backward()
    assert om.exports == 4
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


def test_frozen_parameters_get_no_gradient():
    _quiet()
    torch.manual_seed(0)
    model = mlp()
    model[0].weight.requires_grad_(False)
    om = ORTModule(model)
    om(torch.randn(3, 10)).sum().backward()
    assert model[0].weight.grad is None and model[0].bias.grad is not None


class Structured(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, inputs, scale=2.0, tag="a"):
        h = self.lin(inputs["x"]) * scale
        return {"h": h, "pair": (h.argmax(dim=-1), inputs["y"] + 1), "tag": tag, "other": torch.tanh(h)}


@pytest.fixture
def structured():
    """(reference, ORTModule of a copy, inputs)."""
    _quiet()
    torch.manual_seed(0)
    ref = Structured()
    return ref, ORTModule(copy.deepcopy(ref)), {"x": torch.randn(5, 4), "y": torch.arange(5)}


def test_nested_inputs_and_outputs(structured):
    ref, om, inputs = structured
    with pytest.warns(UserWarning, match="str 'b'"):  # a constant of the graph
        a, b = ref(inputs, scale=3.0, tag="b"), om(inputs, scale=3.0, tag="b")
    assert b["tag"] == "b"
    torch.testing.assert_close(b["h"], a["h"])
    assert b["pair"][0].dtype == torch.int64 and not b["pair"][0].requires_grad
    torch.testing.assert_close(b["pair"][1], a["pair"][1])
    (b["h"].sum() + b["other"].sum()).backward()
    (a["h"].sum() + a["other"].sum()).backward()
    torch.testing.assert_close(om.module.lin.weight.grad, ref.lin.weight.grad)
    om(inputs, scale=2.0)
    assert om.exports == 2  # a non-tensor argument is part of the signature


def test_output_not_in_the_loss(structured):
    """The backward gets zeros for an output the loss does not use."""
    ref, om, inputs = structured
    om(inputs)["other"].pow(2).sum().backward()
    ref(inputs)["other"].pow(2).sum().backward()
    torch.testing.assert_close(om.module.lin.weight.grad, ref.lin.weight.grad)
    assert torch.count_nonzero(om.module.lin.weight.grad) > 0


def test_debug_options_save_onnx_and_log_level(tmp_path, caplog):
    """The files have onnxruntime-training's names: <prefix>_<what>_<training|inference>.onnx."""
    _quiet()
    torch.manual_seed(0)
    opts = DebugOptions(save_onnx=True, log_level=LogLevel.INFO, onnx_prefix="my_model", save_path=str(tmp_path))
    om = ORTModule(mlp(), opts)
    with caplog.at_level(logging.INFO, logger="gradbuilder.ortmodule"):
        om(torch.randn(3, 10)).sum().backward()
    kinds = ["torch_exported", "optimized_pre_grad", "optimized", "execution_model", "execution_model_backward"]
    assert sorted(os.listdir(tmp_path)) == sorted(f"my_model_{k}_training.onnx" for k in kinds)
    for n in os.listdir(tmp_path):
        onnx.checker.check_model(str(tmp_path / n))
    backward = onnx.load(str(tmp_path / "my_model_execution_model_backward_training.onnx"))
    assert any(i.name.endswith("_grad_output") for i in backward.graph.input)
    with torch.no_grad():
        om(torch.randn(3, 10))
    om(torch.randn(2, 3, 10)).sum().backward()  # another training signature
    names = set(os.listdir(tmp_path))
    assert {f"my_model_{k}_inference.onnx" for k in kinds[:4]} <= names
    assert {f"my_model_{k}_training_2.onnx" for k in kinds} <= names and len(names) == 14
    assert any("exporting Sequential" in r.getMessage() for r in caplog.records)
    assert logging.getLogger("gradbuilder.ortmodule").level == logging.INFO
    compiled = next(iter(om.compiled_graphs.values()))
    # onnxruntime's INFO lines are its graph transformers' trace: its sessions stay at WARNING
    assert compiled.forward_graph.session.get_session_options().log_severity_level == 2
    with pytest.raises(InvalidArgumentError, match="onnx_prefix must be provided when save_onnx is set"):
        DebugOptions(save_onnx=True)
    with pytest.raises(InvalidArgumentError, match="Expected name prefix of type str, got <class 'int'>"):
        DebugOptions(save_onnx=True, onnx_prefix=23)
    with pytest.raises(InvalidArgumentError, match="Expected log_level of type LogLevel, got <class 'int'>"):
        DebugOptions(log_level=7)
    with pytest.raises(InvalidArgumentError, match="Expected log_level of type LogLevel, got <class 'str'>"):
        DebugOptions(log_level="INFO")


def test_debug_options_save_path_from_the_environment(tmp_path, monkeypatch):
    """Without save_path, ORTMODULE_SAVE_ONNX_PATH names the directory; one that cannot be
    written is refused before anything runs. The mode in the names is the module's: an
    evaluation-mode call is ``inference`` even with grad enabled."""
    _quiet()
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    om = ORTModule(mlp(), DebugOptions(save_onnx=True, onnx_prefix="env_model"))
    om.eval()
    om(torch.randn(3, 10))
    names = set(os.listdir(tmp_path))
    assert {f"env_model_{k}_inference.onnx" for k in ("torch_exported", "optimized", "execution_model")} <= names
    assert not any("training" in n for n in names)
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path / "missing"))
    with pytest.raises(InvalidArgumentError, match=r"Directory .*missing is not writable\. \(from "
                                                   r"ORTMODULE_SAVE_ONNX_PATH\)"):
        DebugOptions(save_onnx=True, onnx_prefix="env_model")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(InvalidArgumentError, match=r"Directory .*a_file is not writable\."):
        DebugOptions(save_onnx=True, onnx_prefix="env_model", save_path=str(tmp_path / "a_file"))


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # a branch on values
            return self.lin(x)
        return self.lin(-x)


class Unexportable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.diff(self.lin(x), dim=-1)  # aten::diff has no ONNX export


@torch.library.custom_op("gradbuilder_test::square", mutates_args=())
def _square(x: torch.Tensor) -> torch.Tensor:
    """An operator exported as a custom-domain op that has no gradient rule."""
    return x * x


def _square_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _square_backward(ctx, g):
    (x,) = ctx.saved_tensors
    return 2 * x * g


_square.register_fake(torch.empty_like)
_square.register_autograd(_square_backward, setup_context=_square_context)
torch.onnx.register_custom_op_symbolic("gradbuilder_test::square", lambda g, x: g.op("example.custom::Square", x), 17)


class NoRule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.ops.gradbuilder_test.square(self.lin(x))


@pytest.mark.parametrize("module, error, match", [
    (Branchy, ExportError, r"reads a tensor's value into Python at .*test_ortmodule.py:\d+ \(Tensor.__bool__\)"),
    (Unexportable, ExportError, "aten::diff"),
    (NoRule, UnsupportedOpError, r"ORTModule\(NoRule\).*no gradient rule.*op_type=Square, domain='example.custom'"),
], ids=["control-flow", "unsupported-export", "no-gradient-rule"])
def test_clear_errors_and_opt_in_fallback(module, error, match):
    _quiet()
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    with pytest.raises(error, match=match) as info:
        ORTModule(module())(x).sum().backward()
    assert "fallback=True" in str(info.value)
    ref = module()
    om = ORTModule(copy.deepcopy(ref), fallback=True)
    with pytest.warns(RuntimeWarning, match="running .* in PyTorch"):
        out = om(x)
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    assert om.module.lin.weight.grad is not None


def test_value_branch_on_shapes_is_not_an_error():
    """A branch on a shape converts a traced size, not a value, to a Python bool: no error."""
    _quiet()

    class OnShape(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            if x.shape[0] > 1:
                return self.lin(x)
            return self.lin(x) * 2

    torch.manual_seed(0)
    ref = OnShape()
    om = ORTModule(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    torch.testing.assert_close(om(x), ref(x))


class FlagBranch(torch.nn.Module):
    """Python control flow on the values of its own tensor arguments: a flag and a step count."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, flag, x, repeats=None):
        h = self.fc1(x)
        h = torch.relu(h) if flag else torch.tanh(h)
        for _ in range(int(repeats) if repeats is not None else 1):
            h = h * 0.5 + self.fc1.bias
        return self.fc2(h)


def test_reading_an_argument_value_keeps_a_graph_per_value():
    """``if flag:`` on a tensor argument: the graph holds for the value read and each other value
    exports again; training over several optimizer steps with the flag and count changing matches
    the plain module."""
    _quiet()
    torch.manual_seed(0)
    ref = FlagBranch()
    om = ORTModule(copy.deepcopy(ref))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_om = torch.optim.SGD(om.parameters(), lr=0.1)
    calls = [(True, 1), (False, 1), (True, 3), (True, 1), (False, 3), (False, 1), (True, 3)]
    for flag, repeats in calls:
        x = torch.randn(5, 4)
        flag, repeats = torch.tensor(flag), torch.tensor(repeats)
        losses = []
        for model, opt in ((ref, opt_ref), (om, opt_om)):
            opt.zero_grad()
            loss = model(flag, x, repeats).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0])
    for p_om, p_ref in zip(om.parameters(), ref.parameters()):
        torch.testing.assert_close(p_om, p_ref)
    assert om.exports == 4  # the four (flag, repeats) pairs, each once
    om.eval(), ref.eval()
    with torch.no_grad():
        x = torch.randn(2, 4)
        torch.testing.assert_close(om(torch.tensor(False), x), ref(torch.tensor(False), x))


def test_default_and_variadic_arguments_read_by_value():
    """Arguments left at their default, variadic ones and a tensor keyword whose truth the code
    reads, in training and evaluation mode."""
    _quiet()

    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.zeros = torch.nn.Parameter(torch.zeros(1, 1))

        def forward(self, a, b, c, d, *args, kw_0=None, **kwargs):
            result = a + d + self.zeros.sum()
            if args:
                result = result + args[-1]
            if kw_0:
                result = result + kw_0
            if kwargs:
                result = result + kwargs["kwargs_1"]
            return result

    om = ORTModule(Unused())
    one = torch.ones(1)
    for training in (True, False):
        om.train(training)
        for args, kwargs, expected in [
            ((one, 2 * one, 3 * one, 4 * one), {}, 5.0),
            ((one, 2 * one), {"c": 3 * one, "d": 4 * one}, 5.0),
            ((one, 2 * one, 3 * one, 4 * one, *[2 * one] * 5), {}, 7.0),
            ((one, 2 * one, 3 * one, 4 * one, *[2 * one] * 5), {"kw_0": 6 * one}, 13.0),
            ((one, 2 * one, 3 * one, 4 * one, *[2 * one] * 5), {"kw_0": 0 * one}, 7.0),
            ((one, 2 * one, 3 * one, 4 * one, *[2 * one] * 5), {"kwargs_0": 7 * one, "kwargs_1": 8 * one}, 15.0),
        ]:
            out = om(*args, **kwargs)
            assert out.item() == expected
            if training:
                out.sum().backward()
                assert om.module.zeros.grad is not None


def test_reading_a_computed_or_changed_argument_is_refused():
    """Only a value of the call's own tensor, unchanged, is kept per value: one computed from it,
    or read after an in-place change, is refused with the place."""
    _quiet()

    class Computed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, flag, x):
            return self.lin(x) if (flag * 2).item() > 1 else self.lin(-x)

    class Changed(Computed):
        def forward(self, flag, x):
            flag.add_(1)
            return self.lin(x) if flag.item() > 1 else self.lin(-x)

    for module in (Computed, Changed):
        with pytest.raises(ExportError, match=r"reads a tensor's value into Python at .*test_ortmodule.py:\d+ "
                                              r"\(Tensor.item\)"):
            ORTModule(module())(torch.tensor(1.0), torch.randn(2, 4))


def test_wrapping_errors():
    with pytest.raises(InvalidArgumentError, match="torch.nn.Module"):
        ORTModule(lambda x: x)
    with pytest.raises(InvalidArgumentError, match="already"):
        ORTModule(ORTModule(mlp()))


class TiedPadded(torch.nn.Module):
    """An embedding with a padding row whose weight the output layer shares."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, padding_idx=0)
        self.out = torch.nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


def test_embedding_padding_row_gets_no_gradient_through_the_lookup():
    _quiet()
    torch.manual_seed(0)
    ref = TiedPadded()
    with torch.no_grad():
        ref.emb.weight[0] = 0.5  # the padding row starts at zero; make its output-layer gradient show
    om = ORTModule(copy.deepcopy(ref))
    ids = torch.tensor([[0, 3, 0, 5], [2, 0, 7, 7]])
    ref(ids).pow(2).sum().backward()
    om(ids).pow(2).sum().backward()
    assert len(list(om.parameters())) == 1  # tied
    grad = om.module.emb.weight.grad
    torch.testing.assert_close(grad, ref.emb.weight.grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(grad[0]) > 0  # the output layer's share of row 0 stays


def test_tensors_cross_without_copies():
    from gradbuilder.ortmodule.compiled import to_ort, to_torch

    t = torch.randn(3, 4)
    v = to_ort(t)
    assert v.data_ptr() == t.data_ptr() and v.shape() == [3, 4]
    back = to_torch(v)
    assert back.data_ptr() == t.data_ptr()
    mask = to_torch(to_ort(torch.tensor([True, False])))
    assert mask.dtype == torch.bool and mask.tolist() == [True, False]


class SizeAsNumber(torch.nn.Module):
    """Drops the last row, with the row count read as a Python number: traced, it is a constant."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x[: int(x.shape[0]) - 1])


def test_sizes_read_as_numbers_compile_per_shape():
    _quiet()
    torch.manual_seed(0)
    ref = SizeAsNumber()
    om = ORTModule(copy.deepcopy(ref))
    for rows in (3, 5, 3, 6):
        x = torch.randn(rows, 4)
        out = om(x)
        assert out.shape == (rows - 1, 4)
        torch.testing.assert_close(out, ref(x))
    assert om.exports == 3


def test_a_fixed_size_the_checks_miss_recompiles_when_onnxruntime_fails(monkeypatch):
    """torch's MultiheadAttention reshapes with the traced sequence length: with the constant
    check switched off, onnxruntime fails on another length, and the call compiles for it."""
    import gradbuilder.ortmodule.export as export_module

    _quiet()
    monkeypatch.setattr(export_module, "fixed_sizes", lambda model, sizes: None)
    torch.manual_seed(0)
    ref = Encoder()
    om = ORTModule(copy.deepcopy(ref))
    for seq in (5, 7):
        x = torch.randn(3, seq, 32)
        torch.testing.assert_close(om(x), ref(x), rtol=1e-4, atol=1e-5)
    assert om.exports == 2


def test_backward_hook_on_the_ortmodule():
    _quiet()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3))
    om = ORTModule(copy.deepcopy(ref))
    seen = {}
    om.register_full_backward_hook(lambda mod, gin, gout: seen.update(gin=gin[0].clone(), gout=gout[0].clone()))
    x = torch.randn(2, 4, requires_grad=True)
    om(x).pow(2).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    out = ref(x_ref)
    out.pow(2).sum().backward()
    torch.testing.assert_close(seen["gin"], x_ref.grad)
    torch.testing.assert_close(seen["gout"], 2 * out.detach())


def test_dropout_gradient_uses_the_mask_drawn_in_the_forward():
    """onnxruntime draws its own dropout mask; the backward reads that mask."""
    _quiet()
    om = ORTModule(torch.nn.Dropout(0.5)).train()
    x = (torch.rand(64, 32) + 0.5).requires_grad_()
    y = om(x)
    kept = y != 0
    assert 0.3 < kept.float().mean().item() < 0.7
    torch.testing.assert_close(y[kept], x.detach()[kept] * 2)
    (y * 3).sum().backward()
    torch.testing.assert_close(x.grad, kept.float() * 6)
