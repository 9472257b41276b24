"""The CUDA paths. On a machine with a usable CUDA GPU they train on it and compare with the
CPU; elsewhere they check that asking for CUDA says clearly that it is not there and what
happens instead. tools/gpu_check.sh runs this file and the benchmarks on a GPU machine."""

import copy
import warnings

import numpy as np
import pytest
import torch

from gradbuilder import InvalidArgumentError, TrainingParameters, TrainingSession, get_available_providers

from .test_layers import regression_model

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
GPU = CUDA in get_available_providers()  # usable here, not only built in


def _batches(n=8):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((4, 3)).astype(np.float32), "t": rng.standard_normal((4, 2)).astype(np.float32)}
            for _ in range(n)]


def _train(providers, **options):
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = TrainingSession(regression_model(), params, providers=providers)
    losses = [float(sess.run(["loss"], b)[0]) for b in _batches()]
    return sess, losses, caught


def test_training_session_on_cuda_matches_the_cpu():
    """float32 products are float32 on CUDA unless TF32 is allowed (onnxruntime's CUDA default
    is TF32): without it the losses equal the CPU's to 1e-5; with allow_tf32 they stay within
    TF32's 10-bit mantissa."""
    cpu, cpu_losses, _ = _train([CPU])
    sess, losses, caught = _train([CUDA, CPU])
    if GPU:
        assert sess.get_providers()[0] == CUDA
        assert sess.get_provider_options()[CUDA]["use_tf32"] == "0"
        assert sess.state["W"].device_name().lower() == "cuda"  # the state lives on the device
        np.testing.assert_allclose(losses, cpu_losses, rtol=1e-5)
        np.testing.assert_allclose(sess.get_state()["model"]["full_precision"]["W"],
                                   cpu.get_state()["model"]["full_precision"]["W"], rtol=1e-5, atol=1e-6)
        tf32, tf32_losses, _ = _train([CUDA, CPU], allow_tf32=True)
        assert tf32.get_provider_options()[CUDA]["use_tf32"] == "1"
        np.testing.assert_allclose(tf32_losses, cpu_losses, rtol=1e-2)
    else:
        assert any("CUDAExecutionProvider is not usable" in str(w.message) for w in caught)
        assert sess.get_providers() == [CPU] and losses == cpu_losses


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mixed_precision_on_cuda(dtype):
    if not GPU and dtype == "bfloat16":
        with pytest.raises(InvalidArgumentError, match="'bfloat16' needs CUDAExecutionProvider"):
            _train([CPU], use_mixed_precision=True, mixed_precision_dtype=dtype)
        return
    _, full, _ = _train([CPU])
    sess, losses, _ = _train([CUDA, CPU], use_mixed_precision=True, mixed_precision_dtype=dtype)
    assert sess.get_providers()[0] == (CUDA if GPU else CPU)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    np.testing.assert_allclose(losses, full, rtol=5e-2 if dtype == "bfloat16" else 1e-2)


@pytest.mark.skipif(not (GPU and torch.cuda.is_available()), reason="needs a CUDA GPU with torch's CUDA build")
def test_ortmodule_with_cuda_tensors_matches_the_module():
    from gradbuilder.ortmodule import ORTModule

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).cuda()
    wrapped = ORTModule(copy.deepcopy(plain))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, wrapped)]
    x, y = torch.randn(32, 8, device="cuda"), torch.randint(0, 4, (32,), device="cuda")
    for _ in range(5):
        for m, opt in zip((plain, wrapped), opts):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_deterministic_compute_gives_the_same_bits_every_run():
    """deterministic_compute: an embedding model (its gradient a scatter-add, which CUDA adds
    with atomics) trains to the same bits in two sessions, on the GPU where there is one."""
    from .test_threads import BATCH, SEQ, VOCAB, embedding_model

    rng = np.random.default_rng(0)
    model = embedding_model(rng).SerializeToString()
    batches = [{"ids": rng.integers(0, VOCAB, (BATCH, SEQ)), "labels": rng.integers(0, 8, BATCH)} for _ in range(4)]
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", deterministic_compute=True)
    states = []
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # CUDA not usable here: the CPU runs it
            sess = TrainingSession(model, params, providers=[CUDA, CPU])
        assert sess.get_session_options().use_deterministic_compute
        losses = [float(sess.run(["loss"], b)[0]) for b in batches]
        states.append((losses, sess.get_state()["model"]["full_precision"]))
    assert states[0][0] == states[1][0]
    for name, value in states[0][1].items():
        assert np.array_equal(value, states[1][1][name]), name


def test_the_flat_state_trains_as_a_tensor_per_weight_on_the_device():
    """On a GPU, "auto" is the flat state: each weight a view of a buffer in device memory
    (runtime.views), trained bit for bit as a tensor per weight, and read back by name. Without
    a GPU the same comparison runs on the CPU, where the flat state is asked for."""
    providers = [CUDA, CPU] if GPU else [CPU]
    flat, flat_losses, _ = _train(providers, optimizer_state_layout="auto" if GPU else "flat")
    per_tensor, losses, _ = _train(providers, optimizer_state_layout="per_tensor")
    assert sorted(flat.state.flat) == ["Weights.float32", "Weights.float32.exp_avg", "Weights.float32.exp_avg_sq"]
    assert not per_tensor.state.flat
    if GPU:
        assert flat.state["W"].device_name().lower() == "cuda"
        assert flat.state.flat["Weights.float32"].device_name().lower() == "cuda"
    assert flat_losses == losses
    a, b = flat.get_state(), per_tensor.get_state()
    for w in ("W", "B"):
        assert np.array_equal(a["model"]["full_precision"][w], b["model"]["full_precision"][w])
        for s in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(a["optimizer"][w][s], b["optimizer"][w][s])
    flat.load_state({"W": np.full((3, 2), 0.25, np.float32)})
    assert np.array_equal(flat.get_state()["model"]["full_precision"]["W"], np.full((3, 2), 0.25, np.float32))


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_captured_steps_train_as_uncaptured_ones(precision):
    """enable_cuda_graph: on a GPU the step replays one captured CUDA graph per turn of its
    state, and gives the uncaptured session's losses, weights, optimizer states and running
    statistics (test_capture.py's model: BatchNorm's statistics take turns, the rest is updated
    in place), with the loss left on the device until it is read. Elsewhere it is refused."""
    from .test_capture import capture_batches, capture_model

    options = dict(use_mixed_precision=precision == "float16")
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", enable_cuda_graph=True,
                                **options)
    if not GPU:
        with pytest.raises(InvalidArgumentError, match="needs CUDAExecutionProvider"):
            TrainingSession(capture_model(), params, providers=[CUDA])
        return
    captured = TrainingSession(capture_model(), params, providers=[CUDA])
    plain = TrainingSession(capture_model(), TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw",
                                                                **options), providers=[CUDA])
    for step, batch in enumerate(capture_batches(8) * 2, 1):
        expected = float(plain.run(["loss"], batch)[0])
        (loss,) = captured.run_with_ort_values(["loss"], batch)
        assert loss.device_name().lower() == "cuda"
        np.testing.assert_allclose(float(loss.numpy()), expected, rtol=1e-6, err_msg=f"step {step}")
    assert captured.step == plain.step == 16
    for name in plain.state:
        np.testing.assert_allclose(captured.state.array(name), plain.state.array(name), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
