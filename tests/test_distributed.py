"""Distributed training on torch.distributed (gloo, localhost): each test starts its ranks as
processes with torchrun's (or mpirun's) environment (tests/distributed_worker.py, forked from a
server that imported torch, onnxruntime and gradbuilder once), bounded in time, and compares what
they trained with one process trained on the whole batch. The command line's own launcher
(``gradbuilder train --nproc-per-node``) starts fresh interpreters, as a user's run does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import TrainingParameters, TrainingSession
from gradbuilder.errors import InvalidArgumentError

torch = pytest.importorskip("torch")

WORKER = Path(__file__).with_name("distributed_worker.py")
TIMEOUT_S = 180  # a whole multi-process run; a hung collective fails the test, not the suite
RTOL = 1e-5


# ---------------------------------------------------------------------------- models and data
def mlp_model(widths=(32, 16), scale: float = 0.3) -> onnx.ModelProto:
    """x [batch, 8] through Gemm + Relu layers of ``widths`` to 4 logits, cross-entropy against
    y; weights and biases drawn from seed 0 times ``scale``."""
    rng = np.random.default_rng(0)
    sizes = [8, *widths, 4]
    inits, nodes, x = [], [], "x"
    for i, (m, n) in enumerate(zip(sizes, sizes[1:]), 1):
        inits += [numpy_helper.from_array((rng.standard_normal(s) * scale).astype(np.float32), name)
                  for name, s in [(f"W{i}", (m, n)), (f"B{i}", (n,))]]
        out = "logits" if i == len(sizes) - 1 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [x, f"W{i}", f"B{i}"], [out]))
        if out != "logits":
            nodes.append(helper.make_node("Relu", [out], [f"a{i}"]))
            x = f"a{i}"
    nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"], reduction="mean"))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8]),
                                             helper.make_tensor_value_info("y", TensorProto.INT64, ["batch"])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def mlp_data(steps: int, batch: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((steps, batch, 8)).astype(np.float32),
            "y": rng.integers(0, 4, (steps, batch)).astype(np.int64)}


def transformer_model() -> onnx.ModelProto:
    from .torch_models import TinyEncoder, export

    tokens, labels = torch.randint(0, 32, (4, 6)), torch.randint(0, 4, (4,))
    # in training mode (its dropout is off): an eval-mode export would merge the cloned layers' equal weights
    return export(TinyEncoder(32, classes=4).train(), (tokens, labels), ["tokens", "labels"], dynamo=False, opset=17,
                  dynamic_batch=True)


def transformer_data(steps: int, batch: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    return {"tokens": rng.integers(0, 32, (steps, batch, 6)).astype(np.int64),
            "labels": rng.integers(0, 4, (steps, batch)).astype(np.int64)}


def params_dict(**options) -> dict:
    p = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", enable_grad_norm_clip=False)
    for k, v in options.items():
        setattr(p, k, v)
    return p.to_dict()


# ---------------------------------------------------------------------------- running
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fork_rank(config: Path, env: dict, stderr: Path):
    """A started rank process (tests/distributed_worker.py's ``run_rank``), forked from a server
    that imported torch, onnxruntime and gradbuilder once for the whole test session: a rank is
    still a process of its own with torchrun's (or mpirun's) environment, without seconds of
    imports each."""
    import multiprocessing

    from . import distributed_worker

    global _RANKS
    if _RANKS is None:
        _RANKS = multiprocessing.get_context("forkserver")
        _RANKS.set_forkserver_preload(["torch", "torch.distributed", "onnxruntime", distributed_worker.__name__])
    proc = _RANKS.Process(target=distributed_worker.run_rank, args=(str(config), env, str(stderr)))
    proc.start()
    return proc


_RANKS = None  # the fork server's context, made at the first launch


def launch(tmp: Path, model: onnx.ModelProto, params: dict, data: dict, world: int, *, mode: str = "run",
           launcher: str = "torchrun", expect_failure: bool = False, **extra) -> list[dict]:
    """Run ``world`` ranks; returns each rank's results (or, with ``expect_failure``, each
    rank's exit code and stderr)."""
    tmp.mkdir(parents=True, exist_ok=True)
    onnx.save(model, tmp / "model.onnx")
    np.savez(tmp / "data.npz", **data)
    cfg = {"model": str(tmp / "model.onnx"), "params": params, "lr": 0.01, "data": str(tmp / "data.npz"),
           "mode": mode, "out": str(tmp), **extra}
    (tmp / "config.json").write_text(json.dumps(cfg))
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if launcher == "torchrun":
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        else:
            env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(world))
        procs.append(_fork_rank(tmp / "config.json", env, tmp / f"rank{rank}.stderr"))
    deadline = time.monotonic() + TIMEOUT_S
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    if any(p.exitcode is None for p in procs):
        for p in procs:
            p.kill()
        pytest.fail(f"the {world} ranks did not finish within {TIMEOUT_S} s")
    outputs = [(p.exitcode, (tmp / f"rank{rank}.stderr").read_text()) for rank, p in enumerate(procs)]
    if expect_failure:
        return [{"code": code, "stderr": err} for code, err in outputs]
    for rank, (code, err) in enumerate(outputs):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    results = []
    for rank in range(world):
        arrays = dict(np.load(tmp / f"rank{rank}.npz"))
        results.append({"losses": arrays.pop("losses"), "arrays": arrays,
                        **json.loads((tmp / f"rank{rank}.json").read_text())})
    return results


def one_process(model, params: dict, data: dict, mode: str = "run", resume: str | None = None,
                micro: int = 1) -> dict:
    """The reference: one process trains on each whole batch (``micro`` > 1: in that many
    accumulation steps, the loss their mean)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    p = TrainingParameters.from_dict(params)
    sess = TrainingSession(model.SerializeToString(), p, so, providers=["CPUExecutionProvider"])
    sess.set_learning_rate(0.01)
    if resume:
        sess.load_checkpoint(resume)
    losses = []
    for step in range(next(iter(data.values())).shape[0]):
        feeds = {n: v[step] for n, v in data.items()}
        if micro > 1:
            losses.append(np.mean([float(np.asarray(sess.run(None, {n: np.split(v, micro)[i] for n, v in feeds.items()})[0]))
                                   for i in range(micro)]))
        elif mode == "run":
            losses.append(float(np.asarray(sess.run(None, feeds)[0])))
        else:
            sess.lazy_reset_grad()
            for micro in range(p.gradient_accumulation_steps):
                sess.train_step({n: np.array_split(v, p.gradient_accumulation_steps)[micro] for n, v in feeds.items()})
            sess.optimizer_step()
    arrays = {f"w/{n}": v for n, v in sess.get_model_state()["full_precision"].items()}
    arrays.update({f"o/{w}/{s}": v for w, st in sess.get_optimizer_state().items() for s, v in st.items()})
    return {"losses": np.array(losses), "arrays": arrays, "step": sess.step}


def assert_close(a, b, what):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7, err_msg=what)


def check_against(ranks: list[dict], ref: dict, losses: bool = True) -> None:
    """Every rank's weights and optimizer state (a pipeline stage's: its own) equal the
    reference's, the replicas' bit for bit, and each weight is held by some rank."""
    held = set()
    for r in ranks:
        for k in [k for k in r["arrays"] if k.startswith(("w/", "o/"))]:
            assert_close(r["arrays"][k], ref["arrays"][k], k)
            held.add(k)
        assert r["step"] == ref["step"]
        for other in ranks:
            for k in set(r["arrays"]) & set(other["arrays"]) - {"losses"}:
                np.testing.assert_array_equal(r["arrays"][k], other["arrays"][k], err_msg=k)
    assert {k for k in ref["arrays"] if k.startswith("w/")} <= held
    if losses:  # each rank's loss is its shard's mean: their mean is the whole batch's
        assert_close(np.mean([r["losses"] for r in ranks], axis=0), ref["losses"], "losses")


# ---------------------------------------------------------------------------- data parallel
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_data_parallel_equals_one_process_on_the_whole_batch(tmp_path, world):
    model, data, params = mlp_model(), mlp_data(10), params_dict()
    check_against(launch(tmp_path, model, params, data, world), one_process(model, params, data))


@pytest.mark.parametrize("post", [False, True])
def test_accumulation_reduces_each_micro_step_or_once(tmp_path, post):
    model, data = mlp_model(), mlp_data(10)
    params = params_dict(gradient_accumulation_steps=2, allreduce_post_accumulation=post)
    check_against(launch(tmp_path, model, params, data, 2), one_process(model, params, data))


def test_step_wise_api_with_accumulation(tmp_path):
    model, data = mlp_model(), mlp_data(5)
    params = params_dict(gradient_accumulation_steps=2, enable_grad_norm_clip=True)
    ref = one_process(model, params, data, mode="stepwise")
    check_against(launch(tmp_path, model, params, data, 2, mode="stepwise"), ref, losses=False)


@pytest.mark.slow
def test_transformer_data_parallel_launched_by_mpirun(tmp_path):
    # SGD: the attention's key bias has a zero gradient (softmax ignores a constant added to a
    # row), so its computed gradient is rounding noise, which Adam's normalization turns into
    # full-size steps that differ between any two summation orders
    model, data = transformer_model(), transformer_data(10)
    params = params_dict(training_optimizer_name="sgd")
    check_against(launch(tmp_path, model, params, data, 2, launcher="mpirun"), one_process(model, params, data))


def test_batchnorm_running_statistics_follow_distributed_data_parallel(tmp_path):
    """Against torch's DistributedDataParallel (broadcast_buffers=True) in the same two
    processes: each rank's losses, the weights, and each rank's running statistics (rank 0's
    broadcast before every forward, then updated from the rank's own shard)."""
    from .test_running_stats import BUFFERS, batch_at, cnn_bytes, new_cnn

    torch.save(new_cnn().state_dict(), tmp_path / "cnn.pt")
    batches = [batch_at(i, 8) for i in range(6)]
    data = {"x": np.stack([b[0] for b in batches]), "y": np.stack([b[1] for b in batches])}
    ranks = launch(tmp_path, onnx.load_from_string(cnn_bytes()), params_dict(training_optimizer_name="sgd"), data, 2,
                   torch_ddp=str(tmp_path / "cnn.pt"))
    for r in ranks:
        a = r["arrays"]
        assert_close(r["losses"], a["t/losses"], "losses")
        for name in [k[2:] for k in a if k.startswith("w/")]:
            assert_close(a[f"w/{name}"], a[f"t/{name}"], name)
    for b in BUFFERS:  # the ranks' statistics differ: each saw its own shard last
        assert not np.array_equal(ranks[0]["arrays"][f"w/{b}"], ranks[1]["arrays"][f"w/{b}"])


# ---------------------------------------------------------------------------- ZeRO
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_equals_data_parallel_with_its_state_partitioned(tmp_path, stage):
    model, data = mlp_model(), mlp_data(10)
    params = params_dict(deepspeed_zero_stage=stage, enable_grad_norm_clip=True, gradient_accumulation_steps=2)
    ranks = launch(tmp_path, model, params, data, 2)
    ref = one_process(model, params, data)
    check_against(ranks, ref)
    owners = ranks[0]["partition"]
    assert owners == ranks[1]["partition"] and {o["owner"] for o in owners.values()} == {0, 1}
    state_bytes = []
    for rank, r in enumerate(ranks):
        held = {k.split("/")[1] for k in r["arrays"] if k.startswith("o/")} - {"shared_optimizer_state"}
        assert held == {w for w, o in owners.items() if o["owner"] == rank}
        state_bytes.append(sum(v.nbytes for k, v in r["arrays"].items() if k.startswith("o/") and "/Step" not in k))
    total = sum(v.nbytes for k, v in ref["arrays"].items() if k.startswith("o/") and "/Step" not in k)
    assert sum(state_bytes) == total
    largest = max(v.nbytes for k, v in ref["arrays"].items() if k.startswith("o/")) * 2  # a weight's two moments
    assert max(state_bytes) <= total / 2 + largest


@pytest.mark.slow
def test_checkpoints_move_between_world_sizes_and_zero_stages(tmp_path):
    model, data = mlp_model(), mlp_data(8)
    params = params_dict(deepspeed_zero_stage=2)
    first, rest = {n: v[:4] for n, v in data.items()}, {n: v[4:] for n, v in data.items()}
    ckpt = tmp_path / "zero2.ckpt"
    launch(tmp_path / "a", model, params, first, 2, checkpoint_at=4, checkpoint=str(ckpt))
    assert ckpt.exists() and not list(tmp_path.glob("*.tmp*"))
    whole = one_process(model, params_dict(), data)
    # a ZeRO-2 checkpoint of 2 ranks resumes in one process ...
    resumed = one_process(model, params_dict(), rest, resume=str(ckpt))
    for k in whole["arrays"]:
        assert_close(resumed["arrays"][k], whole["arrays"][k], k)
    # ... and on 2 ranks under ZeRO 1
    ranks = launch(tmp_path / "b", model, params_dict(deepspeed_zero_stage=1), rest, 2, resume=str(ckpt))
    for k in [k for k in whole["arrays"] if k.startswith("w/")]:
        assert_close(ranks[0]["arrays"][k], whole["arrays"][k], k)


# ---------------------------------------------------------------------------- pipeline
# a1 (the first ReLU's output) read by the node making h2, in onnxruntime-training's syntax
@pytest.mark.parametrize("cuts", ["a1", "a1-h2", ""], ids=["by-name", "ort-syntax", "balanced"])
def test_two_stage_pipeline_equals_four_accumulation_steps(tmp_path, cuts):
    model, data = mlp_model(), mlp_data(6)
    params = params_dict(pipeline_parallel_size=2, num_pipeline_micro_batches=4, pipeline_cut_info_string=cuts,
                         enable_grad_norm_clip=True)
    ranks = launch(tmp_path, model, params, data, 2)
    ref = one_process(model, params_dict(gradient_accumulation_steps=4, enable_grad_norm_clip=True), data, micro=4)
    check_against(ranks, ref)
    assert {k for k in ranks[0]["arrays"] if k.startswith("w/")} == {"w/W1", "w/B1"}


def test_a_pipeline_checkpoint_resumes_in_one_process(tmp_path):
    model, data = mlp_model(), mlp_data(6)
    accumulated = params_dict(gradient_accumulation_steps=4)
    params = params_dict(pipeline_parallel_size=2, num_pipeline_micro_batches=4, pipeline_cut_info_string="h2")
    ckpt = tmp_path / "pipeline.ckpt"
    launch(tmp_path / "a", model, params, {n: v[:3] for n, v in data.items()}, 2, checkpoint_at=3,
           checkpoint=str(ckpt))
    resumed = one_process(model, accumulated, {n: v[3:] for n, v in data.items()}, resume=str(ckpt), micro=4)
    whole = one_process(model, accumulated, data, micro=4)
    for k in whole["arrays"]:
        assert_close(resumed["arrays"][k], whole["arrays"][k], k)


@pytest.mark.slow
def test_pipeline_times_data_parallel(tmp_path):
    model, data = transformer_model(), transformer_data(4, batch=16)
    params = params_dict(training_optimizer_name="sgd", pipeline_parallel_size=2, data_parallel_size=2,
                         num_pipeline_micro_batches=4)
    ranks = launch(tmp_path, model, params, data, 4)
    check_against(ranks, one_process(model, params_dict(training_optimizer_name="sgd", gradient_accumulation_steps=4),
                                     data, micro=4))


@pytest.mark.parametrize("cuts, message", [
    ("nothing_here", "not a value of the graph"),
    ("a1,h2,a2", "3 cuts; pipeline_parallel_size=2 needs 1"),
])
def test_bad_cuts_are_refused_before_any_step(tmp_path, cuts, message):
    params = params_dict(pipeline_parallel_size=2, pipeline_cut_info_string=cuts)
    out = launch(tmp_path, mlp_model(), params, mlp_data(2), 2, expect_failure=True, checkpoint_at=1,
                 checkpoint=str(tmp_path / "never.ckpt"))
    for r in out:
        assert r["code"] != 0 and "InvalidArgumentError" in r["stderr"] and message in r["stderr"]
    assert not (tmp_path / "never.ckpt").exists()


@pytest.mark.parametrize("options", [dict(allreduce_post_accumulation=True), dict(deepspeed_zero_stage=2),
                                     dict(deepspeed_zero_stage=1, allreduce_post_accumulation=True)],
                         ids=["post-accumulation", "zero2", "zero1-post"])
def test_a_checkpoint_in_the_middle_of_an_accumulation_resumes_in_one_process(tmp_path, options):
    """Mid-accumulation, each rank holds its share of the accumulated gradients (or its owned
    part of them): the checkpoint holds what one process on the whole batches would."""
    model, data = mlp_model(), mlp_data(7)
    ckpt = tmp_path / "mid.ckpt"
    launch(tmp_path / "a", model, params_dict(gradient_accumulation_steps=2, **options),
           {n: v[:3] for n, v in data.items()}, 2, checkpoint_at=3, checkpoint=str(ckpt))
    accumulated = params_dict(gradient_accumulation_steps=2)
    resumed = one_process(model, accumulated, {n: v[3:] for n, v in data.items()}, resume=str(ckpt))
    whole = one_process(model, accumulated, data)
    for k in whole["arrays"]:
        assert_close(resumed["arrays"][k], whole["arrays"][k], k)


# ---------------------------------------------------------------------------- failures
def test_a_killed_rank_fails_the_others_naming_it(tmp_path):
    model, data = mlp_model(), mlp_data(6)
    start = time.monotonic()
    out = launch(tmp_path, model, params_dict(), data, 2, expect_failure=True, die_at=3, die_rank=1)
    assert time.monotonic() - start < 90
    assert out[1]["code"] == -9
    assert out[0]["code"] != 0 and "DistributedError" in out[0]["stderr"] and "rank 1 died" in out[0]["stderr"]


def test_a_rank_whose_program_raises_fails_the_others_naming_it(tmp_path):
    start = time.monotonic()
    out = launch(tmp_path, mlp_model(), params_dict(), mlp_data(6), 2, expect_failure=True, raise_at=2, raise_rank=1)
    assert time.monotonic() - start < 90
    assert "the user's program failed" in out[1]["stderr"]
    assert out[0]["code"] != 0 and "DistributedError" in out[0]["stderr"]
    assert "rank 1 raised RuntimeError: the user's program failed on this rank" in out[0]["stderr"]


def test_a_rank_with_another_batch_shape_is_refused_on_every_rank(tmp_path):
    model, data = mlp_model(), mlp_data(4)
    out = launch(tmp_path, model, params_dict(), data, 2, expect_failure=True, bad_feed_at=2, bad_rank=1)
    for r in out:
        assert r["code"] != 0
        assert "InvalidArgumentError" in r["stderr"] and "inputs differ" in r["stderr"] and "rank 1" in r["stderr"]


def test_world_size_must_match_the_launched_group(monkeypatch):
    model = mlp_model().SerializeToString()
    p = TrainingParameters.from_dict(params_dict())
    p.world_size = 3
    with pytest.raises(InvalidArgumentError, match="not launched as one of 3.*torchrun --nproc-per-node 3"):
        TrainingSession(model, p, providers=["CPUExecutionProvider"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InvalidArgumentError, match="world_size=3 but the launched group has 2"):
        TrainingSession(model, p, providers=["CPUExecutionProvider"])
    p = TrainingParameters.from_dict(params_dict(data_parallel_size=4))
    with pytest.raises(InvalidArgumentError, match="must equal the 2 launched processes"):
        TrainingSession(model, p, providers=["CPUExecutionProvider"])


def test_horizontal_parallel_refusal_says_what_is_supported():
    p = TrainingParameters()
    with pytest.raises(InvalidArgumentError, match="data parallel.*ZeRO.*pipeline.*torchrun"):
        p.horizontal_parallel_size = 2


# ---------------------------------------------------------------------------- command line
@pytest.mark.slow
def test_cli_trains_data_parallel_in_n_processes(tmp_path):
    from gradbuilder.runtime import checkpoint

    onnx.save(mlp_model(), tmp_path / "mlp.onnx")
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((64, 8)).astype(np.float32),
             y=rng.integers(0, 4, 64).astype(np.int64))
    common = [sys.executable, "-m", "gradbuilder.cli", "train", str(tmp_path / "mlp.onnx"), "--data",
              str(tmp_path / "data.npz"), "--steps", "6", "--batch-size", "8", "--lr", "0.01", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run(common + ["--nproc-per-node", "2", "--zero-stage", "1", "--checkpoint",
                                   str(tmp_path / "two.ckpt"), "-o", str(tmp_path / "two.onnx")],
                         capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("loss ") == 1 and "rank 0's share" in two.stdout
    one = subprocess.run(common + ["--checkpoint", str(tmp_path / "one.ckpt")], capture_output=True, text=True,
                         timeout=TIMEOUT_S, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    (a, _), (b, _) = checkpoint.load(tmp_path / "two.ckpt"), checkpoint.load(tmp_path / "one.ckpt")
    assert set(a) == set(b)
    for name in a:
        assert_close(a[name], b[name], name)
    ort.InferenceSession(str(tmp_path / "two.onnx"), providers=["CPUExecutionProvider"])
    bad = subprocess.run(common + ["--batch-size", "7", "--nproc-per-node", "2"], capture_output=True, text=True,
                         timeout=TIMEOUT_S, env=env)
    assert bad.returncode != 0 and "must be divisible by the 2 processes" in bad.stderr


def test_each_process_takes_its_own_gpu_unless_told(monkeypatch):
    from gradbuilder.runtime.distributed import one_device_per_process

    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cuda, cpu = "CUDAExecutionProvider", "CPUExecutionProvider"
    assert one_device_per_process([cuda, cpu], [{}, {}]) == [{"device_id": "1"}, {}]
    assert one_device_per_process([cuda, cpu], [{"device_id": "3"}, {}]) == [{"device_id": "3"}, {}]
    assert one_device_per_process([cpu], [{}]) == [{}]
