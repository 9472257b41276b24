"""The models, batches and measuring helpers the benchmarks that compare with PyTorch share
(bench_train, bench_memory, bench_ortmodule, bench_distributed): the three models and their
batches, the ONNX export, the loss check against PyTorch in float64, timed steps and rounds
taken in turns."""

from __future__ import annotations

import argparse
import copy
import io
import os
import statistics
import time
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn as nn
import torch.nn.functional as F

import benchlib
from gradbuilder.testing import resident_bytes

MODELS = ("mlp", "transformer", "cnn")
LR = 1e-3
# The loss check compares both float32 curves with PyTorch's in float64 (same weights, batch
# and AdamW): the TrainingSession's may stray from it at most LOSS_SLACK times as far as
# PyTorch's own float32 curve does, plus LOSS_TOLERANCE. A fixed bound between the two float32
# curves tripped on the transformer from MKL's and MLAS's rounding alone (1.1-1.7e-3 apart
# after 30 Adam steps, each as far from float64 as the other).
LOSS_SLACK = 2.0
LOSS_TOLERANCE = 1e-4
LOSS_FLOOR = 1e-3  # losses below LOSS_FLOOR x the initial loss count as that (relative diff denominator)


# ---------------------------------------------------------------------------- models
class WithLoss(nn.Module):
    """``net`` with its cross-entropy loss inside, as exported."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


class EncoderClassifier(nn.Module):
    def __init__(self, vocab=8000, d=256, heads=4, ff=1024, layers=4, seq=128, classes=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model=d, nhead=heads, dim_feedforward=ff, dropout=0.0,
                                           batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        return self.head(self.enc(self.emb(tokens) + self.pos).mean(dim=1))


def build_mlp() -> nn.Module:
    return WithLoss(nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                  nn.Linear(1024, 10)))


def build_transformer() -> nn.Module:
    return WithLoss(EncoderClassifier())


def build_cnn() -> nn.Module:
    return WithLoss(nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10)))


BUILDERS = {"mlp": build_mlp, "transformer": build_transformer, "cnn": build_cnn}


def make_batch(name: str) -> dict[str, np.ndarray]:
    """The fixed batch of model ``name``: {"x": input, "y": int64 class labels}."""
    rng = np.random.default_rng(0)
    if name == "mlp":
        x = rng.standard_normal((64, 784), dtype=np.float32)
    elif name == "transformer":
        x = rng.integers(0, 8000, (8, 128), dtype=np.int64)
    else:
        x = rng.standard_normal((32, 3, 32, 32), dtype=np.float32)
    return {"x": x, "y": rng.integers(0, 10, (x.shape[0],), dtype=np.int64)}


def export_onnx(module: nn.Module, batch: dict[str, np.ndarray], mode: str) -> bytes:
    """The module with its loss as ONNX (TorchScript exporter, opset 17); see the module
    docstring for why eval mode keeps the initializers as inputs."""
    args = (torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"]))
    f = io.BytesIO()
    if mode == "training":
        extra = dict(training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    else:
        extra = dict(keep_initializers_as_inputs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, f, input_names=["x", "y"], output_names=["loss"], dynamo=False,
                          opset_version=17, **extra)
    model = onnx.load_from_string(f.getvalue())
    inits = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    return model.SerializeToString()


def trainable_elements(onnx_bytes: bytes) -> int:
    """Elements of the ONNX model's float initializers (what TrainingSession trains)."""
    model = onnx.load_from_string(onnx_bytes)
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.data_type in floats)


# ---------------------------------------------------------------------------- helpers
def check_device(ap: argparse.ArgumentParser, device: str) -> None:
    """Refuse ``--device cuda`` (through ``ap.error``) where torch or onnxruntime lacks CUDA."""
    if device == "cuda":
        if not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers():
            ap.error("--device cuda needs torch with CUDA and onnxruntime's CUDAExecutionProvider")


def session_options(threads: int, profile: bool = False) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    so.enable_profiling = profile
    return so


def ort_providers(device: str) -> list[str]:
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]


def ort_inputs(batch: dict[str, np.ndarray], device: str) -> dict[str, ort.OrtValue]:
    where = ("cuda", 0) if device == "cuda" else ("cpu", 0)
    return {k: ort.OrtValue.ortvalue_from_numpy(v, *where) for k, v in batch.items()}


def torch_inputs(batch: dict[str, np.ndarray], device: str) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v).to(device) for k, v in batch.items()}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(times: list[float], warmup: int) -> float:
    return 1e3 * statistics.median(times[warmup:])


def rss_mib(field: str) -> float:
    """VmRSS / VmHWM of this process in MiB."""
    return resident_bytes(field) / 2**20


def float64_losses(module: nn.Module, batches, loss_of) -> list[float]:
    """The loss curve of AdamW steps of ``module`` in float64 (same weights), one per batch,
    ``loss_of(model, batch)`` the loss: the reference both float32 curves are compared with
    (LOSS_SLACK). Not timed."""
    model = copy.deepcopy(module).double().train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def loss_rel_diff(a, b, floor: float, start: int = 0) -> tuple[float, int, float]:
    """(max relative difference, its step, max absolute difference) of two loss curves from
    step ``start`` on; relative to the larger loss, or ``floor`` where both are below it (a
    memorized batch drives the loss to float32 noise)."""
    x, y = np.array(a[start:]), np.array(b[start:])
    rel = np.abs(x - y) / np.maximum(np.maximum(np.abs(x), np.abs(y)), floor)
    return float(rel.max()), start + int(rel.argmax()), float(np.abs(x - y).max())


def timed_steps(contender, n: int, device: str, times: list, losses: list, cpu: list | None = None) -> None:
    """Runs ``n`` steps of ``contender``, appending seconds and losses (and, given ``cpu``, the
    seconds of CPU time of this thread: with one intra-op thread both PyTorch and onnxruntime
    run the step's kernels on the calling thread, so that time does not count waiting for a
    core another job holds). The loss is read after the clock stops, and at once: a loss
    OrtValue from the TrainingSession keeps every output of its run (the whole updated state)
    alive for as long as it is held."""
    for _ in range(n):
        sync(device)
        c0, t0 = time.thread_time(), time.perf_counter()
        value = contender.step()
        sync(device)  # onnxruntime synchronizes its own device at the end of a run
        times.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.thread_time() - c0)
        losses.append(contender.loss(value))


def run_interleaved(contenders: dict, args) -> tuple[dict, dict, dict]:
    """Warm-up of each contender, then ``args.rounds`` rounds in which each contender runs its
    share of the measured steps in turn, so that all of them see the same background load.
    A round taken under CPU pressure (benchlib.measured_round) is dropped and taken again:
    its steps still train (their losses are kept), their times are not.
    Returns ({name: seconds per step}, {name: loss per step}, {name: thread CPU seconds per
    step}), warm-up steps included."""
    times = {k: [] for k in contenders}
    losses = {k: [] for k in contenders}
    cpu = {k: [] for k in contenders}
    for k, c in contenders.items():
        timed_steps(c, args.warmup, args.device, times[k], losses[k], cpu[k])
    done = 0
    for r in range(args.rounds):
        n = (args.steps - done) // (args.rounds - r)

        def one_round():
            got = {k: ([], []) for k in contenders}
            for k, c in contenders.items():
                time.sleep(0.05)  # the previous contender's worker threads stop spinning
                timed_steps(c, n, args.device, got[k][0], losses[k], got[k][1])
            return got

        got, before, after = benchlib.measured_round(one_round, f"round {r + 1}")
        print(benchlib.round_line(f"round {r + 1}:", before, after) + f", load {os.getloadavg()[0]:.2f}")
        for k in contenders:
            times[k] += got[k][0]
            cpu[k] += got[k][1]
        done += n
    return times, losses, cpu
