"""Training-step benchmark: gradbuilder's TrainingSession against PyTorch eager.

For each model, one process trains the same network from the same weights on the same fixed
batch with

- ``pytorch``:          eager PyTorch, ``torch.optim.AdamW(lr=1e-3)``, ``torch.set_num_threads(N)``;
- ``trainingsession``:  ``gradbuilder.runtime.session.TrainingSession`` (AdamW with torch's defaults,
                        no gradient clipping), onnxruntime ``intra_op_num_threads = N``, inputs
                        as OrtValues, one ``run_with_ort_values`` per step;

and runs the exported model's forward (loss included) with an onnxruntime ``InferenceSession``
(N threads, inputs bound as OrtValues with IOBinding) as the yardstick of what onnxruntime
itself does with the graph.

    python tools/bench_train.py                           # mlp, transformer, cnn on CPU
    python tools/bench_train.py --models transformer --steps 50 --threads 4
    python tools/bench_train.py --device cuda --json out.json
    python tools/bench_train.py --no-memory --profile     # + onnxruntime profile of the step

Models (the loss is inside the exported model: ``forward(x, y) = cross_entropy(net(x), y)``):

- ``mlp``:          Linear 784-1024, ReLU, Linear 1024-1024, ReLU, Linear 1024-10; batch 64.
- ``transformer``:  Embedding(8000, 256) + learned positions [128, 256] + 4 x
                    TransformerEncoderLayer(256, 4 heads, ff 1024, dropout 0, batch_first) +
                    mean over the sequence + Linear(256, 10); int64 tokens [8, 128].
- ``cnn``:          Conv 3-32 3x3, ReLU, MaxPool 2, Conv 32-64 3x3, ReLU, MaxPool 2, Linear
                    4096-128, ReLU, Linear 128-10; images [32, 3, 32, 32].

Export: the TorchScript exporter (``dynamo=False``, opset 17). By default in eval mode with
``keep_initializers_as_inputs=True`` (the initializers are then dropped from the graph inputs
again): without it the exporter *deduplicates initializers by value*, which ties every
parameter to any other with the same initial values -- the 4 encoder layers (which
``nn.TransformerEncoder`` deep-copies, so they start identical) collapse into one and all
zero biases / unit LayerNorm gains into one each, so the ONNX model is a different model
and its loss curve leaves PyTorch's after the first step. ``--export training`` exports in
training mode instead (no dedup by value, no constant folding, Dropout nodes kept). The script
checks that the ONNX model has as many trainable elements as the torch module.

The three contenders live side by side in the parent process: each runs its ``--warmup``
steps, then the ``--steps`` measured steps are run in ``--rounds`` rounds in which the
contenders take turns, so background load on the machine hits all of them alike.

Printed numbers (per model, medians over the measured steps):

- ``pytorch ms``:  one eager step (zero_grad, forward, backward, AdamW step).
- ``trainsess ms``: one ``TrainingSession.run_with_ort_values`` (forward, backward, AdamW in
                   one onnxruntime run). ``ratio`` = trainsess / pytorch (target <= 0.7).
- ``ort fwd ms``:  one onnxruntime forward of the exported model. ``/fwd`` = trainsess / fwd
                   (target <= 3.5).
- ``first step s``: the TrainingSession's first step, which builds and loads the step graph.
- ``loss rel``:     max over the measured steps of |l_ts - l_pt| / max(|l_ts|, |l_pt|, 1e-3 l_0)
                   (l_0: the first loss; the floor because the models memorize the fixed batch
                   and their loss falls to float32 noise, ~1e-8) and the absolute difference.
                   Both runs start from the same weights and batch. (CPU) both curves are also
                   compared with PyTorch's in float64: a WARNING is printed when the
                   TrainingSession strays from it more than twice as far as PyTorch's float32
                   curve (+1e-4): the timings would then compare different computations.
- ``threads 1``:   also the CPU time of the calling thread per step (both run their kernels
                   on it), which other jobs on the machine do not inflate.
- pressure:        ``/proc/pressure/cpu`` (avg10) and the load average are read before and
                   after every round; a round under more than 10% pressure is dropped and
                   taken again (tools/benchlib.py).
- ``peak MiB``:    (CPU) for each contender a child process (``--child``) imports numpy,
                   torch, onnxruntime and gradbuilder, makes the batch, reads VmRSS from
                   /proc/self/status as the baseline, builds the model and optimizer (torch:
                   module + AdamW from the saved state_dict; TrainingSession: from the ONNX
                   file), runs warm-up + measured steps and reports VmHWM - baseline.
                   ``ratio`` = trainsess / pytorch (target <= 1).
                   (CUDA) the process's GPU memory after - before (nvidia-smi, per process)
                   for both when nvidia-smi lists the process, else ``n/a``; PyTorch's
                   ``torch.cuda.max_memory_allocated`` is reported beside it.
- ``--profile``:   a separate TrainingSession with ``enable_profiling``; onnxruntime's
                   ``*_kernel_time`` node events of the measured steps, per step, summed per
                   op type and per phase (forward / backward / optimizer+other, by node name).
                   Profiling adds a little per-node overhead: its run time exceeds the median.

Linux only (reads /proc/self/status). ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

import numpy as np
import onnxruntime as ort
import torch
import torch.nn as nn

from benchmodels import (
    BUILDERS,
    LOSS_FLOOR,
    LOSS_SLACK,
    LOSS_TOLERANCE,
    LR,
    MODELS,
    check_device,
    export_onnx,
    float64_losses,
    loss_rel_diff,
    make_batch,
    median_ms,
    ort_inputs,
    ort_providers,
    rss_mib,
    run_interleaved,
    session_options,
    timed_steps,
    torch_inputs,
    trainable_elements,
)
from gradbuilder import TrainingParameters
from gradbuilder.runtime.runner import SLOWER_FUSIONS
from gradbuilder.runtime.session import TrainingSession


def nvidia_smi_mib(pid: int) -> float | None:
    """GPU memory used by process ``pid`` per nvidia-smi, or None if it cannot say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return float(parts[1])
    return None


# ---------------------------------------------------------------------------- contenders
# Each contender is an object whose step() runs one step and returns the loss (a tensor or
# OrtValue, read after the timing) and whose loss() turns that into a float.
class TorchTrainer:
    """Eager PyTorch: zero_grad, forward, backward, AdamW step."""

    def __init__(self, module: nn.Module, inputs: dict[str, torch.Tensor], fused: bool = False):
        self.model = module.to(inputs["x"].device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, fused=fused or None)
        self.x, self.y = inputs["x"], inputs["y"]

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(self.x, self.y)
        loss.backward()
        self.opt.step()
        return loss.detach()

    @staticmethod
    def loss(value) -> float:
        return float(value)


def make_training_session(onnx_model, threads: int, device: str, profile: bool = False,
                          deterministic: bool = False, **options) -> TrainingSession:
    """AdamW without clipping; ``options``: more TrainingParameters (mixed precision, TF32)."""
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw",
                                enable_grad_norm_clip=False, deterministic_compute=deterministic, **options)
    sess = TrainingSession(onnx_model, params, sess_options=session_options(threads, profile),
                           providers=ort_providers(device))
    sess.set_learning_rate(LR)
    return sess


class SessionTrainer:
    """gradbuilder's TrainingSession: one run_with_ort_values per step."""

    def __init__(self, onnx_model, feeds: dict[str, ort.OrtValue], threads: int, device: str,
                 profile: bool = False, deterministic: bool = False, **options):
        self.sess = make_training_session(onnx_model, threads, device, profile, deterministic, **options)
        self.feeds = feeds

    def step(self):
        (loss,) = self.sess.run_with_ort_values(["loss"], self.feeds)
        return loss

    @staticmethod
    def loss(value) -> float:
        return float(value.numpy())


class StepwiseTrainer(SessionTrainer):
    """The on-device training loop of onnxruntime-training's step-wise API: lazy_reset_grad,
    train_step (forward and backward), optimizer_step, as a user writes it."""

    def step(self):
        self.sess.lazy_reset_grad()
        loss = self.sess.train_step(self.feeds)
        self.sess.optimizer_step()
        return loss

    @staticmethod
    def loss(value) -> float:
        return float(value)


class OrtForward:
    """onnxruntime InferenceSession forward of the exported model (loss output), IOBinding."""

    def __init__(self, onnx_bytes: bytes, feeds: dict[str, ort.OrtValue], threads: int, device: str):
        self.sess = ort.InferenceSession(onnx_bytes, session_options(threads), providers=ort_providers(device),
                                         disabled_optimizers=list(SLOWER_FUSIONS))  # as the sessions we create
        self.binding = self.sess.io_binding()
        for name, value in feeds.items():
            self.binding.bind_ortvalue_input(name, value)
        self.binding.bind_output("loss", device, 0)

    def step(self):
        self.sess.run_with_iobinding(self.binding)
        return self.binding.get_outputs()[0]

    @staticmethod
    def loss(value) -> float:
        return float(value.numpy())


# ---------------------------------------------------------------------------- profile
def profile_step(onnx_bytes: bytes, batch, args) -> dict:
    """onnxruntime profile of the TrainingSession step: kernel time per op type per step over
    the last ``args.steps`` runs (the warm-up runs are left out)."""
    trainer = SessionTrainer(onnx_bytes, ort_inputs(batch, args.device), args.threads, args.device, profile=True)
    timed_steps(trainer, args.warmup + args.steps, args.device, [], [])
    path = trainer.sess.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[-args.steps:]
    total, calls, phases = defaultdict(float), defaultdict(int), defaultdict(float)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if any(a <= e["ts"] <= b for a, b in runs):
            op = e.get("args", {}).get("op_name", "?")
            total[op] += e["dur"]
            calls[op] += 1
            phases[phase_of(e["name"][: -len("_kernel_time")])] += e["dur"]
    n = len(runs)
    run_ms = sum(b - a for a, b in runs) / n / 1e3
    ops = sorted(((op, total[op] / n / 1e3, calls[op] // n) for op in total), key=lambda r: -r[1])
    return {"run_ms": run_ms, "kernel_ms": sum(total.values()) / n / 1e3,
            "phases_ms": {k: v / n / 1e3 for k, v in phases.items()},
            "ops": [{"op": op, "ms": ms, "nodes": k} for op, ms, k in ops]}


def phase_of(node: str) -> str:
    """By node name: the exporter names forward nodes ``/scope/Op``, gradbuilder names their
    gradient nodes ``/scope/Op/grad/...``; the rest is the optimizer (and nodes onnxruntime
    inserts, such as layout reorders)."""
    if "/grad/" in node:
        return "backward"
    return "forward" if node.startswith("/") else "optimizer+other"


def print_profile(name: str, prof: dict, top: int = 15) -> None:
    print(f"  profile of the {name} step: {prof['run_ms']:.2f} ms per run, {prof['kernel_ms']:.2f} ms in kernels ("
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(prof["phases_ms"].items())) + ")")
    for r in prof["ops"][:top]:
        print(f"    {r['op']:<28} {r['ms']:8.3f} ms {100 * r['ms'] / prof['kernel_ms']:5.1f}%  {r['nodes']:4d} nodes")


# ---------------------------------------------------------------------------- memory (child)
def child_main(args) -> None:
    """Peak memory of one contender: prints one JSON line."""
    batch = dict(np.load(os.path.join(args.dir, "batch.npz")))
    device, steps = args.device, args.warmup + args.steps
    torch.set_num_threads(args.threads)
    if args.child == "pytorch":
        inputs = torch_inputs(batch, device)
    else:
        inputs = ort_inputs(batch, device)
    if device == "cuda":
        if args.child == "pytorch":
            torch.cuda.init()
        gpu_base = nvidia_smi_mib(os.getpid())
        torch_base = torch.cuda.memory_allocated() if args.child == "pytorch" else 0
    base = rss_mib("VmRSS")

    if args.child == "pytorch":
        module = BUILDERS[args.model]()
        module.load_state_dict(torch.load(os.path.join(args.dir, "state.pt")))
        contender = TorchTrainer(module, inputs)
    else:
        contender = SessionTrainer(os.path.join(args.dir, "model.onnx"), inputs, args.threads, device,
                                   deterministic=args.deterministic)
    timed_steps(contender, steps, device, [], [])

    out = {"host_peak_mib": rss_mib("VmHWM") - base}
    if device == "cuda":
        gpu_end = nvidia_smi_mib(os.getpid())
        out["gpu_mib"] = None if gpu_base is None or gpu_end is None else gpu_end - gpu_base
        if args.child == "pytorch":
            out["torch_max_allocated_mib"] = (torch.cuda.max_memory_allocated() - torch_base) / 2**20
    print("RESULT " + json.dumps(out))


def measure_memory(name: str, module: nn.Module, onnx_bytes: bytes, batch, args) -> dict:
    """Runs the two memory children of model ``name``; {contender: child's figures}."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "model.onnx"), "wb") as f:
            f.write(onnx_bytes)
        torch.save(module.state_dict(), os.path.join(tmp, "state.pt"))
        np.savez(os.path.join(tmp, "batch.npz"), **batch)
        for contender in ("pytorch", "trainingsession"):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", contender, "--model", name, "--dir", tmp,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--threads", str(args.threads),
                   "--device", args.device] + (["--deterministic"] if args.deterministic else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(f"  memory child {contender} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
                out[contender] = None
            else:
                out[contender] = json.loads(lines[-1][len("RESULT "):])
    return out


def peak_pair(mem: dict | None, device: str) -> tuple[float | None, float | None]:
    """(pytorch, trainingsession) peak MiB as shown in the table."""
    if not mem:
        return None, None
    key = "gpu_mib" if device == "cuda" else "host_peak_mib"
    return tuple((mem.get(c) or {}).get(key) for c in ("pytorch", "trainingsession"))


# ---------------------------------------------------------------------------- one model
def bench_model(name: str, args) -> dict:
    print(f"\n== {name}")
    torch.manual_seed(0)
    module = BUILDERS[name]()
    batch = make_batch(name)
    onnx_bytes = export_onnx(module, batch, args.export)
    n_torch = sum(p.numel() for p in module.parameters())
    n_onnx = trainable_elements(onnx_bytes)
    print(f"  parameters: torch {n_torch:,}, ONNX float initializers {n_onnx:,}")
    if n_onnx != n_torch:
        print(f"  WARNING: the ONNX model does not have the torch module's parameters ({n_onnx:,} vs {n_torch:,}"
              " elements): the exporter tied or folded some; the two runs train different models")
    res = {"model": name, "parameters": n_torch, "onnx_trainable_elements": n_onnx}

    torch.set_num_threads(args.threads)
    contenders = {
        "pytorch": TorchTrainer(copy.deepcopy(module), torch_inputs(batch, args.device), args.fused),
        "trainingsession": SessionTrainer(onnx_bytes, ort_inputs(batch, args.device), args.threads, args.device,
                                          deterministic=args.deterministic),
        "ort_forward": OrtForward(onnx_bytes, ort_inputs(batch, args.device), args.threads, args.device),
    }
    if args.stepwise:
        contenders["stepwise"] = StepwiseTrainer(onnx_bytes, ort_inputs(batch, args.device), args.threads, args.device)
    times, losses, cpu = run_interleaved(contenders, args)
    del contenders
    gc.collect()
    pt_losses, ts_losses, fwd_loss = losses["pytorch"], losses["trainingsession"], losses["ort_forward"][0]
    ts_times = times["trainingsession"]
    res.update(pytorch_ms=median_ms(times["pytorch"], args.warmup), trainingsession_ms=median_ms(ts_times, args.warmup),
               ort_forward_ms=median_ms(times["ort_forward"], args.warmup), ts_first_step_s=ts_times[0],
               pytorch_losses=pt_losses, trainingsession_losses=ts_losses, ort_forward_loss=fwd_loss,
               times_s=times, thread_cpu_s=cpu)
    if "stepwise" in times:
        res["stepwise_ms"] = median_ms(times["stepwise"], args.warmup)
        a, b = np.array(losses["stepwise"]), np.array(ts_losses)
        apart = float((np.abs(a - b) / np.maximum(np.abs(b), LOSS_FLOOR * abs(b[0]))).max())
        print(f"  step-wise API {res['stepwise_ms']:.2f} ms ({res['stepwise_ms'] / res['trainingsession_ms']:.2f}x run(), "
              f"{res['stepwise_ms'] / res['pytorch_ms']:.2f}x PyTorch); its losses are {apart:.1e} from run()'s")
    if args.threads == 1:  # the kernels ran on this thread: its CPU time is the step's work
        res.update(pytorch_cpu_ms=median_ms(cpu["pytorch"], args.warmup),
                   trainingsession_cpu_ms=median_ms(cpu["trainingsession"], args.warmup),
                   ort_forward_cpu_ms=median_ms(cpu["ort_forward"], args.warmup))
        res["cpu_ratio_vs_pytorch"] = res["trainingsession_cpu_ms"] / res["pytorch_cpu_ms"]
    res["ratio_vs_pytorch"] = res["trainingsession_ms"] / res["pytorch_ms"]
    res["ratio_vs_forward"] = res["trainingsession_ms"] / res["ort_forward_ms"]
    reference = None
    if args.device == "cpu":
        x = torch.from_numpy(batch["x"])
        x64 = (x.double() if x.is_floating_point() else x, torch.from_numpy(batch["y"]))
        reference = float64_losses(module, [x64] * len(pt_losses), lambda model, b: model(*b))
    floor = LOSS_FLOOR * abs(pt_losses[0])

    def max_rel(x, y):
        return loss_rel_diff(x, y, floor, args.warmup)

    res["loss_max_rel_diff"], res["loss_max_rel_diff_step"], res["loss_max_abs_diff"] = max_rel(pt_losses, ts_losses)
    print(f"  pytorch {res['pytorch_ms']:.2f} ms | trainingsession {res['trainingsession_ms']:.2f} ms "
          f"(first step {ts_times[0]:.2f} s) | ort forward {res['ort_forward_ms']:.2f} ms")
    if args.threads == 1:
        print(f"  thread CPU time: pytorch {res['pytorch_cpu_ms']:.2f} ms | trainingsession "
              f"{res['trainingsession_cpu_ms']:.2f} ms (ratio {res['cpu_ratio_vs_pytorch']:.2f}) | ort forward "
              f"{res['ort_forward_cpu_ms']:.2f} ms")
    print(f"  loss: step 0 torch {pt_losses[0]:.6f}, ts {ts_losses[0]:.6f}, ort forward {fwd_loss:.6f}; "
          f"last torch {pt_losses[-1]:.6g}, ts {ts_losses[-1]:.6g}")
    print(f"  loss curves over the measured steps: max rel diff {res['loss_max_rel_diff']:.2e} (step "
          f"{res['loss_max_rel_diff_step']}), max abs diff {res['loss_max_abs_diff']:.2e}")
    if reference is not None:
        pt64, ts64 = max_rel(reference, pt_losses)[0], max_rel(reference, ts_losses)[0]
        res.update(pytorch_vs_float64=pt64, trainingsession_vs_float64=ts64)
        print(f"  against PyTorch in float64: pytorch {pt64:.2e}, trainingsession {ts64:.2e}")
        if not ts64 <= LOSS_SLACK * pt64 + LOSS_TOLERANCE:
            print(f"  !!!!! WARNING: {name}: the TrainingSession loss curve strays from float64 more than PyTorch's "
                  f"float32 one ({ts64:.2e} > {LOSS_SLACK:g} x {pt64:.2e} + {LOSS_TOLERANCE:g}) !!!!!")

    if args.profile:
        res["profile"] = profile_step(onnx_bytes, batch, args)
        print_profile(name, res["profile"])
    if not args.no_memory:
        res["memory"] = measure_memory(name, module, onnx_bytes, batch, args)
        pt, ts = peak_pair(res["memory"], args.device)
        print(f"  peak memory: pytorch {fmt(pt)} MiB, trainingsession {fmt(ts)} MiB "
              f"({'GPU, nvidia-smi' if args.device == 'cuda' else 'VmHWM - baseline'})")
        if args.device == "cuda" and res["memory"].get("pytorch"):
            print(f"  pytorch torch.cuda.max_memory_allocated: "
                  f"{fmt(res['memory']['pytorch'].get('torch_max_allocated_mib'))} MiB")
    return res


# ---------------------------------------------------------------------------- report
def fmt(v, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def print_table(results: list[dict], args) -> None:
    print(f"\ndevice {args.device}, {args.threads} threads, {args.steps} measured steps in {args.rounds} rounds after "
          f"{args.warmup} warm-up, export {args.export}; medians in ms; targets: ratio <= 0.7, /fwd <= 3.5, mem ratio <= 1")
    head = (f"{'model':<12}{'pytorch':>9}{'trainsess':>10}{'ratio':>7}{'ort fwd':>9}{'/fwd':>7}"
            f"{'pt MiB':>9}{'ts MiB':>9}{'ratio':>7}{'loss rel':>10}")
    print(head)
    print("-" * len(head))
    for r in results:
        pt, ts = peak_pair(r.get("memory"), args.device)
        mem_ratio = ts / pt if pt and ts is not None else None
        print(f"{r['model']:<12}{r['pytorch_ms']:>9.2f}{r['trainingsession_ms']:>10.2f}{r['ratio_vs_pytorch']:>7.2f}"
              f"{r['ort_forward_ms']:>9.2f}{r['ratio_vs_forward']:>7.2f}{fmt(pt):>9}{fmt(ts):>9}"
              f"{fmt(mem_ratio, '.2f'):>7}{r['loss_max_rel_diff']:>10.1e}")
        r["memory_ratio"] = mem_ratio


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--steps", type=int, default=30, help="measured steps (default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="warm-up steps, not measured (default 5)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="the measured steps are run in this many rounds, the contenders taking turns (default 3)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch and onnxruntime intra-op threads")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--export", choices=("eval", "training"), default="eval",
                    help="torch.onnx.export mode (see the module docstring)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    ap.add_argument("--fused", action="store_true", help="PyTorch with AdamW(fused=True), one kernel per step")
    ap.add_argument("--deterministic", action="store_true",
                    help="TrainingSession with deterministic_compute (the same bits every run on CUDA too)")
    ap.add_argument("--stepwise", action="store_true",
                    help="also time the step-wise API (lazy_reset_grad, train_step, optimizer_step) as a user's loop")
    ap.add_argument("--profile", action="store_true", help="profile the TrainingSession step with onnxruntime")
    ap.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    ap.add_argument("--child", choices=("pytorch", "trainingsession"), help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.rounds < 1 or args.steps < args.rounds:
        ap.error("--warmup and --rounds must be >= 1 and --steps >= --rounds")
    check_device(ap, args.device)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}, device {args.device}, threads {args.threads}")
    results = [bench_model(name, args) for name in args.models]
    print_table(results, args)
    if args.json:
        meta = {k: getattr(args, k) for k in ("steps", "warmup", "rounds", "threads", "device", "export")}
        meta.update(torch=torch.__version__, onnxruntime=ort.__version__)
        with open(args.json, "w") as f:
            json.dump({"settings": meta, "results": results}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
