"""TrainingSession (gradbuilder/session.py): the full step (run and its variants), the step-wise
API, learning-rate schedules and parameter buffers, compared with torch.optim on the same
exported module. State, providers, checkpoints and bad input are in test_session_state.py.

The model: a small MLP with cross_entropy inside, exported from torch (dynamo=False, opset 17,
inputs x and y, output loss). Every reference is torch's: the same module, the same data,
torch.optim.AdamW/SGD, autograd, clip_grad_norm_ and LambdaLR.
"""

from __future__ import annotations

import functools
import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from gradbuilder import TrainingParameters
from gradbuilder.errors import InvalidArgumentError
from gradbuilder.runtime.session import TrainingSession

CPU = ["CPUExecutionProvider"]
BATCH, FEATURES, CLASSES = 5, 6, 4
LR = 0.01


class MLP(torch.nn.Module):
    def __init__(self, hidden: int = 8, with_logits: bool = False):
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, hidden)
        self.fc2 = torch.nn.Linear(hidden, CLASSES)
        self.with_logits = with_logits

    def forward(self, x, y):
        logits = self.fc2(torch.tanh(self.fc1(x)))
        loss = torch.nn.functional.cross_entropy(logits, y)
        return (loss, logits) if self.with_logits else loss


WEIGHTS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def new_module(hidden: int = 8, with_logits: bool = False) -> MLP:
    """The module the model was exported from, freshly initialised (seed 0)."""
    torch.manual_seed(0)
    return MLP(hidden, with_logits)


def batches(n: int, seed: int = 0, batch: int = BATCH):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, FEATURES)).astype(np.float32),
             rng.integers(0, CLASSES, batch).astype(np.int64)) for _ in range(n)]


@functools.lru_cache(maxsize=None)
def model_bytes(hidden: int = 8, with_logits: bool = False, dynamic_batch: bool = False) -> bytes:
    module = new_module(hidden, with_logits)
    x, y = batches(1, seed=123)[0]
    names = ["loss", "logits"] if with_logits else ["loss"]
    axes = {"x": {0: "batch"}, "y": {0: "batch"}} if dynamic_batch else None
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.from_numpy(x), torch.from_numpy(y)), f, dynamo=False, opset_version=17,
                          input_names=["x", "y"], output_names=names, training=torch.onnx.TrainingMode.PRESERVE,
                          do_constant_folding=False, dynamic_axes=axes)
    return f.getvalue()


def params(optimizer: str = "adamw", **options) -> TrainingParameters:
    options.setdefault("enable_grad_norm_clip", False)
    return TrainingParameters(loss_output_name="loss", training_optimizer_name=optimizer, **options)


def session_and_torch():
    """A fresh AdamW session and the same module with torch.optim.AdamW, from the same weights."""
    module = new_module()
    return session(), module, torch.optim.AdamW(module.parameters(), lr=LR)


def session(optimizer: str = "adamw", *, hidden: int = 8, with_logits: bool = False, dynamic_batch: bool = False,
            lr: float = LR, sess_options=None, **options) -> TrainingSession:
    s = TrainingSession(model_bytes(hidden, with_logits, dynamic_batch), params(optimizer, **options),
                        sess_options=sess_options, providers=CPU)
    s.set_learning_rate(lr)
    return s


def torch_loss(module, x, y):
    out = module(torch.from_numpy(x), torch.from_numpy(y))
    return out[0] if isinstance(out, tuple) else out


def torch_step(module, opt, x, y, zero_grad=True):
    """zero_grad, forward, backward, step: the loss."""
    if zero_grad:
        opt.zero_grad()
    loss = torch_loss(module, x, y)
    loss.backward()
    opt.step()
    return loss.item()


def assert_weights_match(weights: dict, module, rtol=1e-5):
    """Norm-wise per weight: float32 round-off in the gradients (onnxruntime's kernels vs
    torch's) moves single elements whose gradient is ~0, which Adam's normalisation amplifies."""
    named = dict(module.named_parameters())
    assert set(weights) == set(named)
    for w, p in named.items():
        ref = p.detach().numpy()
        assert weights[w].shape == ref.shape and weights[w].dtype == np.float32, w
        assert np.linalg.norm(weights[w] - ref) <= rtol * np.linalg.norm(ref), (w, np.abs(weights[w] - ref).max())


def weights_of(s) -> dict:
    """The trained weights, copied (see test_session_state.py on why arrays are copied)."""
    return {w: np.array(v, copy=True) for w, v in s.get_model_state()["full_precision"].items()}


def state_arrays(s) -> dict:
    """get_state() flattened to {name: array copy}: W, W.<state>, Step."""
    st = s.get_state()
    out = {w: np.array(v, copy=True) for w, v in st["model"]["full_precision"].items()}
    for w, states in st["optimizer"].items():
        for k, v in states.items():
            out[k if w == "shared_optimizer_state" else f"{w}.{k}"] = np.array(v, copy=True)
    return out


def assert_same_state(before: dict, after: dict):
    """Bitwise equal: nothing ran in between."""
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype, name
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def assert_close_state(a: dict, b: dict):
    """The same computation in two sessions: equal to float32 round-off at most."""
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        np.testing.assert_allclose(b[name], a[name], rtol=1e-7, atol=0, err_msg=name)


def feeds(x, y) -> dict:
    return {"x": x, "y": y}


# ================================================================== run(): one full step


def test_run_ten_steps_matches_torch_adamw():
    s, module, opt = session_and_torch()
    for k, (x, y) in enumerate(batches(10, seed=1)):
        out = s.run(["loss"], feeds(x, y))
        assert isinstance(out, list) and len(out) == 1
        assert out[0].dtype == np.float32 and out[0].shape == ()
        np.testing.assert_allclose(out[0], torch_step(module, opt, x, y), rtol=1e-5, atol=1e-7)
        assert s.step == k + 1
    assert s.weights == WEIGHTS
    assert_weights_match(weights_of(s), module)


def test_run_none_returns_every_output_in_model_order():
    """A model with two outputs (loss, logits): run(None) gives both, computed with the
    weights before the update; a list of names picks and orders them."""
    s = session(with_logits=True)
    module = new_module(with_logits=True)
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    data = batches(3, seed=2)
    for k, (x, y) in enumerate(data):
        with torch.no_grad():
            ref_loss, ref_logits = module(torch.from_numpy(x), torch.from_numpy(y))
        if k == 0:
            got = s.run(None, feeds(x, y))
            assert len(got) == 2
            loss, logits = got
        elif k == 1:
            logits, loss = s.run(["logits", "loss"], feeds(x, y))
        else:
            (logits,) = s.run(["logits"], feeds(x, y))
            loss = ref_loss.numpy()
        assert logits.shape == (BATCH, CLASSES) and logits.dtype == np.float32
        np.testing.assert_allclose(logits, ref_logits.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(loss, ref_loss.item(), rtol=1e-5)
        torch_step(module, opt, x, y)
    assert s.step == 3  # asking for fewer outputs still trains
    assert_weights_match(weights_of(s), module)


def test_learning_rate_fed_under_lr_params_feed_name_sets_it():
    s, module, opt = session_and_torch()
    data = batches(5, seed=3)
    fed = [0.05, np.float32(0.002), np.array(0.03, np.float32), None, ort.OrtValue.ortvalue_from_numpy(
        np.array(0.2, np.float32))]
    current = LR
    for (x, y), lr in zip(data, fed):
        feed = feeds(x, y)
        if lr is not None:
            feed["Learning_Rate"] = lr
            current = float(lr.numpy()) if isinstance(lr, ort.OrtValue) else float(lr)
        loss = (s.run_with_ort_values(["loss"], feed)[0].numpy() if isinstance(lr, ort.OrtValue)
                else s.run(["loss"], feed)[0])
        assert s.get_learning_rate() == pytest.approx(current, rel=1e-7)  # kept for the next steps too
        for group in opt.param_groups:
            group["lr"] = current
        np.testing.assert_allclose(loss, torch_step(module, opt, x, y), rtol=1e-5, atol=1e-7)
    assert_weights_match(weights_of(s), module)


def test_run_with_ort_values_and_io_binding_match_torch():
    s, module, opt = session_and_torch()
    data = batches(4, seed=4)
    for k, (x, y) in enumerate(data):
        ref = torch_step(module, opt, x, y)
        if k % 2 == 0:
            ov = {"x": ort.OrtValue.ortvalue_from_numpy(x), "y": ort.OrtValue.ortvalue_from_numpy(y)}
            out = s.run_with_ort_values(["loss"] if k == 0 else None, ov)
            assert len(out) == 1 and isinstance(out[0], ort.OrtValue)
            loss = out[0].numpy()
        else:
            binding = s.io_binding()
            binding.bind_cpu_input("x", x)
            binding.bind_ortvalue_input("y", ort.OrtValue.ortvalue_from_numpy(y))
            binding.bind_output("loss")
            s.run_with_iobinding(binding)
            outputs = binding.get_outputs()
            assert len(outputs) == 1 and isinstance(outputs[0], ort.OrtValue)
            loss = outputs[0].numpy()
            np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], loss)
        np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-7)
        assert s.step == k + 1
    assert_weights_match(weights_of(s), module)
    with pytest.raises(InvalidArgumentError, match="io_binding"):
        s.run_with_iobinding(session().io_binding())  # another session's binding


def test_run_gradient_accumulation_and_clipping_match_torch():
    """gradient_accumulation_steps=2, enable_grad_norm_clip with max_norm_clip 0.05: torch sums
    two backward() calls, clips with clip_grad_norm_ and steps AdamW; the weights do not move
    on the first micro-batch of each pair."""
    max_norm = 0.05
    s = session(gradient_accumulation_steps=2, enable_grad_norm_clip=True,
                optimizer_attributes_map={w: {"max_norm_clip": max_norm} for w in WEIGHTS})
    module = new_module()
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    norms = []
    for k, (x, y) in enumerate(batches(8, seed=5)):
        before = weights_of(s)
        (loss,) = s.run(["loss"], feeds(x, y))
        ref = torch_loss(module, x, y)
        ref.backward()
        np.testing.assert_allclose(loss, ref.item(), rtol=1e-5, atol=1e-7)
        if k % 2 == 1:
            norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)))
            opt.step()
            opt.zero_grad()
        else:
            for w, v in weights_of(s).items():
                np.testing.assert_array_equal(v, before[w], err_msg=f"{w} changed mid-accumulation")
        assert s.step == (k + 1) // 2
    assert max(norms) > 2 * max_norm  # the clipping did something
    assert_weights_match(weights_of(s), module)


# ================================================================== the step-wise API


@pytest.mark.parametrize("max_norm", [None, 0.05], ids=["no-clip", "clip"])
def test_train_step_accumulates_then_optimizer_step_matches_torch(max_norm):
    """train_step twice then optimizer_step == backward() twice then (clip_grad_norm_) step()."""
    options = ({"enable_grad_norm_clip": True, "optimizer_attributes_map": {w: {"max_norm_clip": max_norm}
                                                                             for w in WEIGHTS}}
               if max_norm else {})
    s = session(**options)
    module = new_module()
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    data = batches(6, seed=6)
    for update in range(3):
        s.lazy_reset_grad()
        opt.zero_grad()
        for x, y in data[2 * update: 2 * update + 2]:
            loss = s.train_step(x, y)
            assert isinstance(loss, np.ndarray) and loss.shape == ()
            ref = torch_loss(module, x, y)
            ref.backward()
            np.testing.assert_allclose(loss, ref.item(), rtol=1e-5, atol=1e-7)
        assert s.step == update  # train_step alone never updates
        if max_norm:
            assert float(torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)) > max_norm
        s.optimizer_step()
        opt.step()
        assert s.step == update + 1
        assert_weights_match(weights_of(s), module)


def test_lazy_reset_grad_replaces_gradients_otherwise_they_add_up():
    """As onnxruntime-training's Module: gradients add up across train_steps (and across
    optimizer_steps) until lazy_reset_grad; torch's .grad without and with zero_grad."""
    s, module, opt = session_and_torch()
    (x0, y0), (x1, y1), (x2, y2) = batches(3, seed=7)
    s.train_step(x0, y0)
    s.optimizer_step()
    torch_step(module, opt, x0, y0)
    assert_weights_match(weights_of(s), module)
    # no reset: the gradient of x1 is added to the one of x0 (torch: no zero_grad)
    s.train_step(x1, y1)
    s.optimizer_step()
    torch_step(module, opt, x1, y1, zero_grad=False)
    assert_weights_match(weights_of(s), module)
    # reset: the next train_step replaces them
    s.lazy_reset_grad()
    s.train_step(x2, y2)
    s.optimizer_step()
    torch_step(module, opt, x2, y2, zero_grad=True)
    assert_weights_match(weights_of(s), module)
    assert s.step == 3


def test_eval_step_uses_current_weights_and_changes_nothing():
    s, module, opt = session_and_torch()
    (x0, y0), (x1, y1) = batches(2, seed=8)
    s.train_step(x0, y0)
    torch_loss(module, x0, y0).backward()  # gradients pending on both sides
    before = state_arrays(s)
    for _ in range(2):
        got = s.eval_step(x1, y1)
        with torch.no_grad():
            np.testing.assert_allclose(got, torch_loss(module, x1, y1).item(), rtol=1e-6)
    assert_same_state(before, state_arrays(s))
    # the pending gradients are those of x0 alone: eval_step neither added nor reset any
    s.optimizer_step()
    opt.step()
    assert_weights_match(weights_of(s), module)
    with torch.no_grad():
        np.testing.assert_allclose(s.eval_step({"x": x1, "y": y1}), torch_loss(module, x1, y1).item(), rtol=1e-6)


def test_train_eval_modes_and_call():
    s, module, opt = session_and_torch()
    (x0, y0), (x1, y1) = batches(2, seed=9)
    assert s.training
    assert s.eval() is s and not s.training
    before = state_arrays(s)
    with torch.no_grad():
        np.testing.assert_allclose(s(x0, y0), torch_loss(module, x0, y0).item(), rtol=1e-6)  # eval_step
    with pytest.raises(InvalidArgumentError, match="eval mode"):
        s.train_step(x0, y0)
    with pytest.raises(InvalidArgumentError, match="optimizer_step before any train_step"):
        s.optimizer_step()  # __call__ in eval mode made no gradients
    assert_same_state(before, state_arrays(s))
    assert s.train() is s and s.training
    assert s.train(False) is s and not s.training
    s.train(True)
    loss = s({"x": x1, "y": y1})  # train_step, dict form
    s.optimizer_step()
    np.testing.assert_allclose(loss, torch_step(module, opt, x1, y1), rtol=1e-5)
    assert_weights_match(weights_of(s), module)
    with pytest.raises(InvalidArgumentError, match=r"expected 2 input\(s\)"):
        s(x1)


def test_set_and_get_learning_rate():
    s = session()
    assert s.get_learning_rate() == LR
    s.set_learning_rate(0.05)
    assert s.get_learning_rate() == 0.05
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(InvalidArgumentError, match="learning rate"):
            s.set_learning_rate(bad)
        assert s.get_learning_rate() == 0.05
    module = new_module()
    opt = torch.optim.AdamW(module.parameters(), lr=0.05)
    for x, y in batches(3, seed=10):
        np.testing.assert_allclose(s.run(["loss"], feeds(x, y))[0], torch_step(module, opt, x, y), rtol=1e-5)
    s.train_step(x, y)  # the step-wise update uses it too
    s.optimizer_step()
    torch_step(module, opt, x, y)
    assert_weights_match(weights_of(s), module)


def test_linear_scheduler_matches_torch_lambdalr():
    lr0, warmup, total = 0.05, 2, 6
    s = session(lr=lr0)
    schedule = s.register_scheduler("linear", warmup_steps=warmup, total_steps=total)
    assert schedule is not None
    module = new_module()
    opt = torch.optim.AdamW(module.parameters(), lr=lr0)
    ref_schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: k / warmup if k < warmup else max(0.0, (total - k) / (total - warmup)))
    for x, y in batches(total + 1, seed=11):
        assert s.get_learning_rate() == pytest.approx(ref_schedule.get_last_lr()[0], rel=1e-12, abs=1e-15)
        np.testing.assert_allclose(s.run(["loss"], feeds(x, y))[0], torch_step(module, opt, x, y), rtol=1e-5)
        new_lr = s.scheduler_step()
        ref_schedule.step()
        assert new_lr == s.get_learning_rate()
        assert new_lr == pytest.approx(ref_schedule.get_last_lr()[0], rel=1e-12, abs=1e-15)
    assert s.get_learning_rate() == 0.0  # decayed to 0 at total_steps
    assert_weights_match(weights_of(s), module)


def test_callable_scheduler_matches_torch_lambdalr():
    s = session(lr=0.02)
    s.register_scheduler(lambda k: 0.02 * 0.6 ** k)
    module = new_module()
    opt = torch.optim.AdamW(module.parameters(), lr=0.02)
    ref_schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.6 ** k)
    for x, y in batches(4, seed=12):
        assert s.get_learning_rate() == pytest.approx(ref_schedule.get_last_lr()[0], rel=1e-12)
        np.testing.assert_allclose(s.run(["loss"], feeds(x, y))[0], torch_step(module, opt, x, y), rtol=1e-5)
        s.scheduler_step()
        ref_schedule.step()
    assert_weights_match(weights_of(s), module)


def test_scheduler_step_without_scheduler_and_unknown_schedule():
    s = session()
    with pytest.raises(InvalidArgumentError, match="register_scheduler"):
        s.scheduler_step()
    with pytest.raises(InvalidArgumentError, match="unknown learning-rate schedule"):
        s.register_scheduler("no_such_schedule")
    assert s.get_learning_rate() == LR


def test_get_parameters_size_with_weights_not_to_train():
    """fc2.bias not trained: it stays fixed (torch: requires_grad False) and counts only with
    trainable_only=False."""
    s = session(weights_not_to_train={"fc2.bias"})
    module = new_module()
    module.fc2.bias.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=LR)
    total = sum(p.numel() for p in module.parameters())
    assert s.weights == ["fc1.weight", "fc1.bias", "fc2.weight"]
    assert s.get_parameters_size() == total - module.fc2.bias.numel()
    assert s.get_parameters_size(trainable_only=True) == total - module.fc2.bias.numel()
    assert s.get_parameters_size(trainable_only=False) == total
    for x, y in batches(2, seed=13):
        np.testing.assert_allclose(s.run(["loss"], feeds(x, y))[0], torch_step(module, opt, x, y), rtol=1e-5)
    got = weights_of(s)
    assert "fc2.bias" not in got
    for w, p in module.named_parameters():
        if w in got:
            assert np.linalg.norm(got[w] - p.detach().numpy()) <= 1e-5 * np.linalg.norm(p.detach().numpy())

    # the whole layout, frozen parameter last; writing it changes the frozen one too
    buf = np.zeros(total, np.float32)
    s.copy_parameters_to_buffer(buf, trainable_only=False)
    trained = np.concatenate([weights_of(s)[w].ravel() for w in s.weights])
    np.testing.assert_array_equal(buf, np.concatenate([trained, module.fc2.bias.detach().numpy()]))
    buf[-CLASSES:] = [0.5, -0.5, 0.25, 0.0]
    s.copy_buffer_to_parameters(buf, trainable_only=False)
    with torch.no_grad():
        module.fc2.bias.copy_(torch.tensor([0.5, -0.5, 0.25, 0.0]))
    x, y = batches(1, seed=14)[0]
    with torch.no_grad():
        np.testing.assert_allclose(s.eval_step(x, y), torch_loss(module, x, y).item(), rtol=1e-6)
    np.testing.assert_allclose(s.run(["loss"], feeds(x, y))[0], torch_step(module, opt, x, y), rtol=1e-5)


def _set_torch_weights(module, s, flat):
    named = dict(module.named_parameters())
    offset = 0
    with torch.no_grad():
        for w in s.weights:
            n = named[w].numel()
            named[w].copy_(torch.from_numpy(flat[offset: offset + n].reshape(named[w].shape)))
            offset += n


def test_copy_parameters_to_buffer_and_back_numpy_and_ortvalue():
    s, module, opt = session_and_torch()
    data = batches(3, seed=15)
    torch_step(module, opt, *data[0])
    s.run(["loss"], feeds(*data[0]))
    size = s.get_parameters_size()
    assert size == sum(p.numel() for p in module.parameters())
    expected = np.concatenate([weights_of(s)[w].ravel() for w in s.weights])

    buf = np.full(size, np.nan, np.float32)
    s.copy_parameters_to_buffer(buf)
    np.testing.assert_array_equal(buf, expected)
    ov = ort.OrtValue.ortvalue_from_numpy(np.full(size, np.nan, np.float32))
    s.copy_parameters_to_buffer(ov)
    np.testing.assert_array_equal(ov.numpy(), expected)
    np.testing.assert_array_equal(s.get_contiguous_parameters().numpy(), expected)

    # numpy buffer -> parameters: the next step starts from them (optimizer state kept)
    new = (buf * 0.5 + 0.01).astype(np.float32)
    s.copy_buffer_to_parameters(new)
    out = np.zeros(size, np.float32)
    s.copy_parameters_to_buffer(out)
    np.testing.assert_array_equal(out, new)
    _set_torch_weights(module, s, new)
    np.testing.assert_allclose(s.run(["loss"], feeds(*data[1]))[0], torch_step(module, opt, *data[1]), rtol=1e-5)
    assert_weights_match(weights_of(s), module)

    # OrtValue buffer -> parameters
    new = (expected * -0.75).astype(np.float32)
    s.copy_buffer_to_parameters(ort.OrtValue.ortvalue_from_numpy(new))
    np.testing.assert_array_equal(np.concatenate([weights_of(s)[w].ravel() for w in s.weights]), new)
    _set_torch_weights(module, s, new)
    np.testing.assert_allclose(s.run(["loss"], feeds(*data[2]))[0], torch_step(module, opt, *data[2]), rtol=1e-5)
    assert_weights_match(weights_of(s), module)

    before = state_arrays(s)
    with pytest.raises(InvalidArgumentError, match="elements"):
        s.copy_buffer_to_parameters(np.zeros(size - 1, np.float32))
    with pytest.raises(InvalidArgumentError, match="elements"):
        s.copy_parameters_to_buffer(np.zeros(size + 1, np.float32))
    assert_same_state(before, state_arrays(s))


def test_export_model_for_inferencing_matches_eval_step(tmp_path):
    s, module, opt = session_and_torch()
    for x, y in batches(3, seed=16):
        s.run(["loss"], feeds(x, y))
        torch_step(module, opt, x, y)
    path = s.export_model_for_inferencing(tmp_path / "inference.onnx", ["loss"])
    exported = onnx.load(str(path))
    assert [o.name for o in exported.graph.output] == ["loss"]
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in exported.graph.initializer}
    for w, v in weights_of(s).items():
        np.testing.assert_array_equal(inits[w], v)
    inference = ort.InferenceSession(str(path), providers=CPU)
    for x, y in batches(2, seed=17):
        (got,) = inference.run(["loss"], feeds(x, y))
        np.testing.assert_allclose(got, s.eval_step(x, y), rtol=1e-6)
        with torch.no_grad():
            np.testing.assert_allclose(got, torch_loss(module, x, y).item(), rtol=1e-5)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.slow  # 45 training steps of a 4 MiB weight, measuring memory
def test_held_outputs_do_not_keep_earlier_states_alive():
    """A loop that keeps every returned loss must not keep every step's weights and moments:
    with a 4 MiB weight, 40 held steps would otherwise hold ~480 MiB (3 copies per step)."""
    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(1024, 1024)

        def forward(self, x):
            return (self.fc(x) ** 2).mean()

    x = torch.randn(4, 1024)
    f = io.BytesIO()
    torch.onnx.export(Wide(), (x,), f, input_names=["x"], output_names=["loss"], dynamo=False)
    p = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", enable_grad_norm_clip=False)
    sess = TrainingSession(f.getvalue(), p, providers=CPU)
    kept = [sess.run_with_ort_values(["loss"], {"x": x.numpy()})[0] for _ in range(5)]
    before = _rss_mib()
    kept += [sess.run_with_ort_values(["loss"], {"x": x.numpy()})[0] for _ in range(40)]
    assert _rss_mib() - before < 100
    assert np.isfinite(kept[0].numpy()) and kept[-1].numpy() < kept[0].numpy()


# ================================================================== TrainingParameters as onnxruntime-training's


def test_per_weight_optimizer_attributes_and_defaults_for_weights_not_listed():
    """The training-graphs guide's snippet: AdamOptimizer attributes for fc1 only; fc2 takes the optimizer's
    defaults (onnxruntime's: no weight decay). torch: the same as two parameter groups."""
    p = TrainingParameters(loss_output_name="loss", training_optimizer_name="AdamOptimizer",
                           enable_grad_norm_clip=False)
    p.optimizer_attributes_map = {w: {"alpha": 0.8, "beta": 0.99, "lambda": 0.05} for w in ["fc1.weight", "fc1.bias"]}
    s = TrainingSession(model_bytes(), p, providers=CPU)
    s.set_learning_rate(LR)
    module = new_module()
    opt = torch.optim.AdamW([
        {"params": [module.fc1.weight, module.fc1.bias], "betas": (0.8, 0.99), "weight_decay": 0.05},
        {"params": [module.fc2.weight, module.fc2.bias], "betas": (0.9, 0.999), "weight_decay": 0.0},
    ], lr=LR)
    for x, y in batches(10, seed=11):
        (loss,) = s.run(["loss"], feeds(x, y))
        np.testing.assert_allclose(loss, torch_step(module, opt, x, y), rtol=1e-5)
    assert_weights_match(weights_of(s), module)
    p.optimizer_attributes_map = {"fc3.weight": {"alpha": 0.8}}
    with pytest.raises(InvalidArgumentError, match="fc3.weight"):
        TrainingSession(model_bytes(), p, providers=CPU)


def test_missing_loss_output_is_refused_at_construction():
    with pytest.raises(InvalidArgumentError, match="loss_output_name 'los' is not a value"):
        TrainingSession(model_bytes(), TrainingParameters(loss_output_name="los", training_optimizer_name="sgd"),
                        providers=CPU)


def test_label_out_of_range_is_refused_before_the_run():
    s = session()
    x, y = batches(1, seed=12)[0]
    before = state_arrays(s)
    for label in (CLASSES, -3):
        bad = y.copy()
        bad[1] = label
        with pytest.raises(InvalidArgumentError, match=f"class index {label} is out of range.*0..{CLASSES - 1}"):
            s.run(["loss"], feeds(x, bad))
    assert_same_state(before, state_arrays(s))
