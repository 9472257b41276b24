"""TrainingSession state: get_state/load_state against torch's AdamW state, session facts and
providers, checkpoints (resume == never stopped; the safetensors layout), and bad input: each
refused with a clear message, the session left exactly as it was, and a later good step still
matching torch."""

from __future__ import annotations

import json
import os
import pickle
import struct

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from gradbuilder import TrainingParameters
from gradbuilder.errors import CheckpointError, InvalidArgumentError, ProviderError
from gradbuilder.runtime.session import TrainingSession

from .test_session import (
    CPU, LR, WEIGHTS, assert_close_state, assert_same_state, assert_weights_match, batches, feeds, model_bytes,
    new_module, params, session, session_and_torch, state_arrays, torch_loss, torch_step, weights_of,
)


def copied(tree):
    """A deep copy of get_state()'s nested dicts of arrays."""
    if isinstance(tree, dict):
        return {k: copied(v) for k, v in tree.items()}
    return np.array(tree, copy=True)


def set_torch_from_session(module, opt, s):
    """torch's weights and AdamW state (exp_avg, exp_avg_sq, step) from the session."""
    st = copied(s.get_state())
    step = int(st["optimizer"]["shared_optimizer_state"]["Step"])
    with torch.no_grad():
        for w, p in module.named_parameters():
            p.copy_(torch.from_numpy(st["model"]["full_precision"][w]))
            p.grad = None
            opt.state.pop(p, None)
            if step:
                opt.state[p] = {"step": torch.tensor(float(step)),
                                "exp_avg": torch.from_numpy(st["optimizer"][w]["exp_avg"]),
                                "exp_avg_sq": torch.from_numpy(st["optimizer"][w]["exp_avg_sq"])}
    for group in opt.param_groups:
        group["lr"] = LR


# ================================================================== state


def test_get_state_layout_matches_torch_adamw_state():
    s, module, opt = session_and_torch()
    for x, y in batches(3, seed=20):
        s.run(["loss"], feeds(x, y))
        torch_step(module, opt, x, y)
    st = s.get_state()
    assert set(st) == {"model", "optimizer", "partition_info"}
    assert st["partition_info"] == {}
    assert list(st["model"]["full_precision"]) == WEIGHTS
    assert_weights_match(copied(st["model"]["full_precision"]), module)
    optimizer = s.get_optimizer_state()
    assert set(optimizer) == set(WEIGHTS) | {"shared_optimizer_state"}
    for w, p in module.named_parameters():
        assert set(optimizer[w]) == {"exp_avg", "exp_avg_sq"}
        for name in ("exp_avg", "exp_avg_sq"):
            got, ref = optimizer[w][name], opt.state[p][name].numpy()
            assert got.shape == tuple(p.shape) and got.dtype == np.float32
            assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref), (w, name)
    step = optimizer["shared_optimizer_state"]["Step"]
    assert step.dtype == np.int64 and step.shape == ()
    assert int(step) == int(opt.state[module.fc1.weight]["step"]) == s.step == 3
    # SGD with momentum: one momentum_buffer per weight, torch's
    sgd = session("sgd", optimizer_attributes_map={w: {"momentum": 0.9} for w in WEIGHTS})
    module = new_module()
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
    for x, y in batches(2, seed=20):
        sgd.run(["loss"], feeds(x, y))
        torch_step(module, opt, x, y)
    optimizer = sgd.get_optimizer_state()
    for w, p in module.named_parameters():
        assert list(optimizer[w]) == ["momentum_buffer"]
        ref = opt.state[p]["momentum_buffer"].numpy()
        assert np.linalg.norm(optimizer[w]["momentum_buffer"] - ref) <= 1e-5 * np.linalg.norm(ref)


def test_load_state_nested_and_flat_into_a_fresh_session_continue_identically():
    data = batches(6, seed=21)
    a = session()
    for x, y in data[:3]:
        a.run(["loss"], feeds(x, y))
    nested, flat = copied(a.get_state()), state_arrays(a)
    assert set(flat) == set(WEIGHTS) | {f"{w}.{s}" for w in WEIGHTS for s in ("exp_avg", "exp_avg_sq")} | {"Step"}
    losses_a = [a.run(["loss"], feeds(x, y))[0] for x, y in data[3:]]

    b = session()
    b.load_state(nested, strict=True)
    assert_same_state(flat, state_arrays(b))
    assert b.step == 3
    losses_b = [b.run(["loss"], feeds(x, y))[0] for x, y in data[3:]]
    np.testing.assert_allclose(losses_b, losses_a, rtol=1e-7, atol=0)
    assert_close_state(state_arrays(a), state_arrays(b))

    b.load_state(flat, strict=True)  # the flat form, back to step 3
    assert_same_state(flat, state_arrays(b))
    losses_b = [b.run(["loss"], feeds(x, y))[0] for x, y in data[3:]]
    np.testing.assert_allclose(losses_b, losses_a, rtol=1e-7, atol=0)
    assert_close_state(state_arrays(a), state_arrays(b))


def test_load_state_partial_strict_and_all_or_nothing():
    s, module, opt = session_and_torch()
    before = state_arrays(s)
    new_bias = np.linspace(-1, 1, 8).astype(np.float32)
    with pytest.raises(InvalidArgumentError, match=r"strict=True.*missing.*fc1\.weight"):
        s.load_state({"fc1.bias": new_bias}, strict=True)
    assert_same_state(before, state_arrays(s))
    # one good entry beside a bad one: nothing changes
    with pytest.raises(InvalidArgumentError, match=r"fc2\.weight.*float32 \[4, 8\].*\[8, 4\]"):
        s.load_state({"fc1.bias": new_bias, "fc2.weight": np.zeros((8, 4), np.float32)})
    assert_same_state(before, state_arrays(s))
    s.load_state({"fc1.bias": new_bias})  # not strict: only that one
    after = state_arrays(s)
    np.testing.assert_array_equal(after.pop("fc1.bias"), new_bias)
    before.pop("fc1.bias")
    assert_same_state(before, after)
    with torch.no_grad():
        module.fc1.bias.copy_(torch.from_numpy(new_bias))
    x, y = batches(1, seed=22)[0]
    np.testing.assert_allclose(s.run(["loss"], feeds(x, y))[0], torch_step(module, opt, x, y), rtol=1e-5)
    assert_weights_match(weights_of(s), module)


def test_arrays_returned_by_get_state_stay_valid_after_later_steps():
    """get_model_state/get_optimizer_state/get_state hand out numpy arrays; a later step (which
    replaces the session's OrtValues) must not change them under the caller's feet."""
    s = session()
    x, y = batches(1, seed=23)[0]
    initial = s.get_model_state()["full_precision"]["fc2.weight"]
    s.load_state({"fc1.weight": np.full((8, 6), 0.25, np.float32)})
    held = {"initial": initial, "weight": s.get_model_state()["full_precision"]["fc1.weight"],
            "exp_avg": s.get_optimizer_state()["fc1.weight"]["exp_avg"],
            "state": s.get_state()["model"]["full_precision"]["fc2.weight"]}
    expected = {k: np.array(v, copy=True) for k, v in held.items()}
    for _ in range(3):
        s.run(["loss"], feeds(x, y))
        junk = [np.full(n, 7.0, np.float32) for n in (48, 32, 8, 4) for _ in range(300)]  # reuse freed memory
        del junk
    for name, value in held.items():
        np.testing.assert_array_equal(value, expected[name], err_msg=f"{name} returned before the steps changed")


# ================================================================== session facts and providers


def test_session_facts_and_profiling(tmp_path):
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "gb_profile")
    s = session(sess_options=so)
    assert s.get_session_options() is so
    model = onnx.load_from_string(model_bytes())
    inputs = s.get_inputs()
    assert [i.name for i in inputs] == [i.name for i in model.graph.input] == ["x", "y"]
    assert [i.type for i in inputs] == ["tensor(float)", "tensor(int64)"]
    assert [i.shape for i in inputs] == [[d.dim_value for d in i.type.tensor_type.shape.dim]
                                         for i in model.graph.input]
    assert [o.name for o in s.get_outputs()] == ["loss"]
    assert isinstance(s.get_modelmeta(), ort.ModelMetadata)
    assert s.get_providers() == ["CPUExecutionProvider"]
    assert list(s.get_provider_options()) == ["CPUExecutionProvider"]
    assert s.get_partition_info_map() == {}
    assert s.is_output_fp32_node("loss") is True
    assert s.is_output_fp32_node("x") is False
    assert s.is_output_fp32_node("no_such_output") is False
    module = new_module()
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    data = batches(3, seed=24)
    s.disable_fallback()
    np.testing.assert_allclose(s.run(["loss"], feeds(*data[0]))[0], torch_step(module, opt, *data[0]), rtol=1e-5)
    s.enable_fallback()
    np.testing.assert_allclose(s.run(["loss"], feeds(*data[1]))[0], torch_step(module, opt, *data[1]), rtol=1e-5)
    assert s.get_providers() == ["CPUExecutionProvider"]
    profile = s.end_profiling()
    assert os.path.isfile(profile)
    assert os.path.dirname(os.path.abspath(profile)) == str(tmp_path)
    with open(profile) as f:
        events = json.load(f)
    assert isinstance(events, list) and events
    default = TrainingSession(model_bytes(), params())  # default options and providers
    assert isinstance(default.get_session_options(), ort.SessionOptions)
    assert default.get_providers()[-1] == "CPUExecutionProvider"


def test_set_providers_keeps_weights_and_optimizer_state():
    data = batches(6, seed=25)
    a, b = session(), session()
    losses_a, losses_b = [], []
    for k, (x, y) in enumerate(data):
        if k == 3:
            before = state_arrays(a)
            a.set_providers(["CPUExecutionProvider"])
            assert a.get_providers() == ["CPUExecutionProvider"]
            assert_same_state(before, state_arrays(a))
            assert a.get_learning_rate() == LR
        losses_a.append(a.run(["loss"], feeds(x, y))[0])
        losses_b.append(b.run(["loss"], feeds(x, y))[0])
    np.testing.assert_allclose(losses_a, losses_b, rtol=1e-7, atol=0)
    assert_close_state(state_arrays(b), state_arrays(a))


# ================================================================== checkpoints


def _halving(step):
    return 0.05 * 0.5 ** step


CHECKPOINT_CASES = {
    "adamw": {},
    "sgd-momentum": {"optimizer": "sgd", "optimizer_attributes_map": {w: {"momentum": 0.9} for w in WEIGHTS}},
    "linear-schedule": {"schedule": ("linear", {"warmup_steps": 3, "total_steps": 10})},
    "callable-schedule": {"schedule": (_halving, {})},
    "accumulation-2": {"gradient_accumulation_steps": 2},
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_checkpoint_resume_equals_uninterrupted(tmp_path, case):
    """Session a runs 10 steps and saves after 5 (an odd number: mid-accumulation with
    accumulation 2); a NEW session loads the file and runs the last 5: same losses, learning
    rates and final state. A named schedule comes back with the checkpoint; a callable one is
    registered again first (functions are not saved)."""
    options = dict(CHECKPOINT_CASES[case])
    schedule = options.pop("schedule", None)
    path = tmp_path / "resume.ckpt"
    data = batches(10, seed=26)

    def make():
        return session(lr=0.05, **options)

    a = make()
    if schedule:
        a.register_scheduler(schedule[0], **schedule[1])
    torch_ref = None
    if case in ("adamw", "sgd-momentum"):  # the uninterrupted run is torch's
        module = new_module()
        opt = (torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9) if case == "sgd-momentum"
               else torch.optim.AdamW(module.parameters(), lr=0.05))
        torch_ref = [torch_step(module, opt, x, y) for x, y in data]
    losses_a, lrs_a = [], []
    for k, (x, y) in enumerate(data):
        if k == 5:
            before = state_arrays(a)
            a.save_checkpoint(path)
            assert_same_state(before, state_arrays(a))  # saving changes nothing
            lr_at_save = a.get_learning_rate()
        losses_a.append(a.run(["loss"], feeds(x, y))[0])
        if schedule:
            a.scheduler_step()
        lrs_a.append(a.get_learning_rate())
    if torch_ref is not None:
        np.testing.assert_allclose(losses_a, torch_ref, rtol=1e-5)

    c = make()
    if schedule and callable(schedule[0]):
        c.register_scheduler(schedule[0])
    c.load_checkpoint(path)
    assert c.get_learning_rate() == lr_at_save
    losses_c, lrs_c = [], []
    for x, y in data[5:]:
        losses_c.append(c.run(["loss"], feeds(x, y))[0])
        if schedule:
            c.scheduler_step()  # the schedule came back with the checkpoint
        lrs_c.append(c.get_learning_rate())
    np.testing.assert_allclose(losses_c, losses_a[5:], rtol=1e-7, atol=0)
    assert lrs_c == lrs_a[5:]
    assert c.step == a.step
    assert_close_state(state_arrays(a), state_arrays(c))


def test_checkpoint_between_train_steps_keeps_the_gradients(tmp_path):
    """Saved after one train_step of two: the new session adds the second micro-batch to the
    first one's gradient, as torch's two backward() calls do."""
    path = tmp_path / "grads.ckpt"
    (x0, y0), (x1, y1), (x2, y2) = batches(3, seed=27)
    module = new_module()
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    torch_loss(module, x0, y0).backward()
    torch_step(module, opt, x1, y1, zero_grad=False)
    torch_step(module, opt, x2, y2)

    def rest(s):
        s.train_step(x1, y1)
        s.optimizer_step()
        s.lazy_reset_grad()
        s.train_step(x2, y2)
        s.optimizer_step()

    a = session()
    a.train_step(x0, y0)
    a.save_checkpoint(path)
    rest(a)
    c = session()
    c.load_checkpoint(path)
    rest(c)
    assert_weights_match(weights_of(a), module)
    assert_close_state(state_arrays(a), state_arrays(c))


def test_checkpoint_file_is_safetensors(tmp_path):
    s = session()
    for x, y in batches(2, seed=28):
        s.run(["loss"], feeds(x, y))
    path = tmp_path / "model.ckpt"
    s.save_checkpoint(path)
    blob = path.read_bytes()
    # neither pickle nor torch's zip (a header length may start with pickle's PROTO byte, but its third byte is 0,
    # never a pickle opcode)
    assert not (blob[:1] == pickle.PROTO and blob[2:3] != b"\x00") and not blob.startswith(b"PK")
    (n,) = struct.unpack("<Q", blob[:8])
    assert n % 8 == 0 and 8 + n <= len(blob)
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    assert blob[8:9] == b"{"
    meta = header.pop("__metadata__")
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    names = set(header)
    assert set(WEIGHTS) <= names
    assert {"fc1.weight.exp_avg", "fc1.weight.exp_avg_sq", "Step"} <= names
    data = blob[8 + n:]
    codes = {"F32": np.float32, "I64": np.int64}
    expected = state_arrays(s)
    end = 0
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        begin, stop = entry["data_offsets"]
        assert begin == end  # contiguous, in order
        end = stop
        array = np.frombuffer(data[begin:stop], dtype=np.dtype(codes[entry["dtype"]]).newbyteorder("<"))
        array = array.reshape(entry["shape"])
        if name in expected:
            np.testing.assert_array_equal(array, expected[name], err_msg=name)
    assert end == len(data)
    assert set(expected) <= names
    try:  # the reference reader, where installed
        from safetensors.numpy import load_file
    except ImportError:
        return
    loaded = load_file(str(path))
    for name, value in expected.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


# ================================================================== bad input
#
# One session and one torch twin per module; each test starts with torch set from the
# session's state, snapshots the state, makes the bad call, checks nothing changed, then makes
# a good step on both sides and compares.


class Twin:
    def __init__(self):
        self.s = session()
        self.module = new_module()
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=LR)
        self.rng = np.random.default_rng(29)

    def batch(self):
        return batches(1, seed=int(self.rng.integers(1 << 30)))[0]

    def sync(self):
        self.s.train()
        self.s.lazy_reset_grad()
        self.s.set_learning_rate(LR)
        set_torch_from_session(self.module, self.opt, self.s)
        return state_arrays(self.s)

    def good_step(self):
        x, y = self.batch()
        np.testing.assert_allclose(self.s.run(["loss"], feeds(x, y))[0],
                                   torch_step(self.module, self.opt, x, y), rtol=1e-5, atol=1e-7)
        assert_weights_match(weights_of(self.s), self.module)


@pytest.fixture(scope="module")
def _twin():
    twin = Twin()
    twin.good_step()  # a non-zero optimizer state from the start
    return twin


@pytest.fixture
def twin(_twin):
    _twin.before = _twin.sync()
    return _twin


def assert_unchanged_then_trains(twin):
    assert_same_state(twin.before, state_arrays(twin.s))
    assert twin.s.get_learning_rate() == LR
    twin.good_step()


BAD_FEEDS = {
    "wrong-name": (lambda x, y: {"x": x, "z": y}, r"no model input named \['z'\]"),
    "missing": (lambda x, y: {"x": x}, r"missing input\(s\) \['y'\]"),
    "int32-labels": (lambda x, y: {"x": x, "y": y.astype(np.int32)},
                     r"'y'.*expected tensor\(int64\), got tensor\(int32\)"),
    "float64": (lambda x, y: {"x": x.astype(np.float64), "y": y},
                r"'x'.*expected tensor\(float\), got tensor\(double\)"),
    "static-shape": (lambda x, y: {"x": x[:4], "y": y}, r"'x'.*shape \[5, 6\], got \[4, 6\]"),
    "weight-as-feed": (lambda x, y: {"x": x, "y": y, "fc1.weight": np.zeros((8, 6), np.float32)},
                       r"no model input named \['fc1\.weight'\]"),
}


@pytest.mark.parametrize("method", ["run", "run_with_ort_values", "train_step", "eval_step"])
@pytest.mark.parametrize("case", list(BAD_FEEDS))
def test_bad_feed_is_refused_and_changes_nothing(twin, case, method):
    make, message = BAD_FEEDS[case]
    s = twin.s
    x0, y0 = twin.batch()
    if method == "train_step":  # gradients pending: the failed call must not touch them
        s.train_step(x0, y0)
        torch_loss(twin.module, x0, y0).backward()
    bad = make(*twin.batch())
    call = {"run": lambda: s.run(None, bad), "run_with_ort_values": lambda: s.run_with_ort_values(None, bad),
            "train_step": lambda: s.train_step(bad), "eval_step": lambda: s.eval_step(bad)}[method]
    with pytest.raises(InvalidArgumentError, match=message):
        call()
    assert_same_state(twin.before, state_arrays(s))
    if method == "train_step":
        x1, y1 = twin.batch()
        s.train_step(x1, y1)
        s.optimizer_step()
        torch_step(twin.module, twin.opt, x1, y1, zero_grad=False)
        assert_weights_match(weights_of(s), twin.module)
        twin.before = twin.sync()
    assert_unchanged_then_trains(twin)


def test_unknown_output_name_is_refused(twin):
    x, y = twin.batch()
    with pytest.raises(InvalidArgumentError, match=r"no output named \['no_such_output'\].*\['loss'\]"):
        twin.s.run(["loss", "no_such_output"], feeds(x, y))
    with pytest.raises(InvalidArgumentError, match="list of names"):
        twin.s.run("loss", feeds(x, y))
    assert_unchanged_then_trains(twin)


def test_failed_run_does_not_keep_the_fed_learning_rate(twin):
    """The learning rate fed with a bad feed (or beside a bad output name) is part of a call
    that failed: the session keeps its learning rate."""
    x, y = twin.batch()
    with pytest.raises(InvalidArgumentError, match="int64"):
        twin.s.run(None, {"x": x, "y": y.astype(np.int32), "Learning_Rate": np.array(0.5, np.float32)})
    assert twin.s.get_learning_rate() == LR
    with pytest.raises(InvalidArgumentError, match="no output named"):
        twin.s.run(["nope"], {"x": x, "y": y, "Learning_Rate": np.array(0.5, np.float32)})
    assert twin.s.get_learning_rate() == LR
    assert_unchanged_then_trains(twin)


def test_malformed_learning_rate_feed_is_refused(twin):
    x, y = twin.batch()
    with pytest.raises(InvalidArgumentError, match="Learning_Rate"):
        twin.s.run(None, {"x": x, "y": y, "Learning_Rate": np.array([0.1, 0.2], np.float32)})
    with pytest.raises(InvalidArgumentError, match="learning rate"):
        twin.s.run(None, {"x": x, "y": y, "Learning_Rate": np.array(-1.0, np.float32)})
    assert_unchanged_then_trains(twin)


def test_mismatched_dynamic_batch_is_refused_as_bad_input():
    """x and y share the symbolic dim 'batch': 4 rows of x with 5 labels is the caller's
    mistake, refused as InvalidArgumentError (not a bare onnxruntime RuntimeError)."""
    s = session(dynamic_batch=True)
    module = new_module()
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    x, y = batches(1, seed=30, batch=5)[0]
    before = state_arrays(s)
    for call in (lambda: s.run(None, {"x": x[:4], "y": y}), lambda: s.train_step(x[:4], y)):
        with pytest.raises(InvalidArgumentError):
            call()
        assert_same_state(before, state_arrays(s))
    assert s.get_providers() == ["CPUExecutionProvider"]
    s.lazy_reset_grad()
    for batch in (5, 3):  # other batch sizes work
        x, y = batches(1, seed=31, batch=batch)[0]
        np.testing.assert_allclose(s.run(["loss"], feeds(x, y))[0], torch_step(module, opt, x, y), rtol=1e-5)
    assert_weights_match(weights_of(s), module)


def test_load_state_bad_shape_dtype_or_name_is_refused(twin):
    s = twin.s
    with pytest.raises(InvalidArgumentError, match=r"'fc1\.weight': expected float32 \[8, 6\], got float32 \[6, 8\]"):
        s.load_state({"fc1.weight": np.zeros((6, 8), np.float32)})
    with pytest.raises(InvalidArgumentError, match=r"'fc1\.weight\.exp_avg': expected float32.*got float64"):
        s.load_state({"optimizer": {"fc1.weight": {"exp_avg": np.zeros((8, 6))}}})
    with pytest.raises(InvalidArgumentError, match=r"'Step': expected int64"):
        s.load_state({"Step": np.array(3, np.int32)})
    with pytest.raises(InvalidArgumentError, match=r"no weight or optimizer state named \['fc3\.weight'\]"):
        s.load_state({"fc3.weight": np.zeros((8, 6), np.float32)})
    with pytest.raises(InvalidArgumentError, match="takes a dict"):
        s.load_state([("fc1.weight", np.zeros((8, 6), np.float32))])
    assert_unchanged_then_trains(twin)


@pytest.mark.parametrize("other", ["hidden-16", "sgd"])
def test_checkpoint_from_another_model_or_optimizer_is_refused(twin, tmp_path, other):
    path = tmp_path / f"{other}.ckpt"
    if other == "hidden-16":
        TrainingSession(model_bytes(16), params(), providers=CPU).save_checkpoint(path)
        message = r"another model.*'fc1\.bias' is \[16\], here \[8\]"
    else:
        session("sgd").save_checkpoint(path)
        message = r"another model or optimizer"
    with pytest.raises(CheckpointError, match=message):
        twin.s.load_checkpoint(path)
    assert_unchanged_then_trains(twin)


def _damaged(path, how: str) -> bytes:
    blob = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", bytes(blob[:8]))
    if how.startswith("truncated"):
        return bytes(blob[: {"truncated-half": len(blob) // 2, "truncated-last-byte": len(blob) - 1,
                             "truncated-header": 4}[how]])
    if how == "flip-data":
        i = 8 + n + (len(blob) - 8 - n) // 2
    elif how == "flip-tensor-name":  # "fc1.weight" -> "gc1.weight"
        i = blob.index(b'"fc1.weight"') + 1
    elif how == "flip-learning-rate":  # "0.01" -> "0.00"
        start = blob.index(b'"learning_rate":"') + len(b'"learning_rate":"')
        i = blob.index(b'"', start) - 1
    else:
        raise AssertionError(how)
    blob[i] ^= 0x01
    return bytes(blob)


@pytest.mark.parametrize("how", ["truncated-half", "truncated-last-byte", "truncated-header", "flip-data",
                                 "flip-tensor-name", "flip-learning-rate"])
def test_damaged_checkpoint_is_refused(twin, tmp_path, how):
    path = tmp_path / "good.ckpt"
    twin.s.save_checkpoint(path)
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(_damaged(path, how))
    with pytest.raises(CheckpointError, match=r"truncated" if how.startswith("truncated") else r"corrupt|checkpoint"):
        twin.s.load_checkpoint(damaged)
    assert_unchanged_then_trains(twin)
    with pytest.raises(CheckpointError, match="not found"):
        twin.s.load_checkpoint(tmp_path / "missing.ckpt")


def test_every_flipped_byte_is_refused(twin, tmp_path):
    """One bit flipped at every 5th byte of the file, header and data alike."""
    path = tmp_path / "good.ckpt"
    twin.s.save_checkpoint(path)
    blob = path.read_bytes()
    damaged = tmp_path / "damaged.ckpt"
    loaded = []
    for i in range(0, len(blob), 5):
        flipped = bytearray(blob)
        flipped[i] ^= 0x01
        damaged.write_bytes(bytes(flipped))
        try:
            twin.s.load_checkpoint(damaged)
        except CheckpointError:
            continue
        loaded.append(i)
    assert loaded == [], f"flips at bytes {loaded[:10]} were not detected"
    assert_unchanged_then_trains(twin)


def test_unknown_provider_is_refused(twin):
    with pytest.raises(ProviderError, match="NoSuchExecutionProvider"):
        TrainingSession(model_bytes(), params(), providers=["NoSuchExecutionProvider"])
    with pytest.raises(ProviderError, match="NoSuchExecutionProvider"):
        twin.s.set_providers(["NoSuchExecutionProvider"])
    assert twin.s.get_providers() == ["CPUExecutionProvider"]
    assert_unchanged_then_trains(twin)


def test_bad_training_parameters_are_refused():
    with pytest.raises(InvalidArgumentError, match="loss_output_name"):
        TrainingSession(model_bytes(), TrainingParameters(training_optimizer_name="adamw"), providers=CPU)
    with pytest.raises(InvalidArgumentError, match="training_optimizer_name"):
        TrainingSession(model_bytes(), params(""), providers=CPU)
    with pytest.raises(InvalidArgumentError, match="TrainingParameters"):
        TrainingSession(model_bytes(), {"loss_output_name": "loss"}, providers=CPU)


def test_optimizer_step_before_any_train_step_is_refused():
    s, module, opt = session_and_torch()
    before = state_arrays(s)
    with pytest.raises(InvalidArgumentError, match="optimizer_step before any train_step"):
        s.optimizer_step()
    assert_same_state(before, state_arrays(s))
    assert s.step == 0
    x, y = batches(1, seed=32)[0]
    s.train_step(x, y)
    s.optimizer_step()
    torch_step(module, opt, x, y)
    assert_weights_match(weights_of(s), module)
