"""The GPU step benchmark: a 6-layer encoder (d 768, 12 heads, feed-forward 3072, sequence 256,
batch 16, AdamW) trained on one device by gradbuilder's TrainingSession, PyTorch eager and
``torch.compile``, in float32 with TF32 off on both sides, then on on both sides, and in float16
and bfloat16 mixed precision (``torch.autocast``, with ``GradScaler`` for float16; the session's
``use_mixed_precision`` with dynamic loss scaling for float16).

    python tools/bench_gpu.py                              # on a CUDA GPU: every precision
    python tools/bench_gpu.py --precisions float32 float16 --steps 50
    python tools/bench_gpu.py --device cpu --d 96 --seq 32 --batch 4 --no-compile   # the script itself, on a CPU

For each precision the contenders take turns in ``--rounds`` rounds after their warm-up
(``benchmodels.run_interleaved``: a round under CPU pressure is taken again) and the medians
are printed with each one's ratio to PyTorch eager. Device memory: a child process per
contender trains the same steps and reports what ``nvidia-smi`` says the process holds after
them, less what it held once CUDA was initialised (both sides measured the same way; PyTorch's
``max_memory_allocated`` beside it); on the CPU, VmHWM over the baseline. The session runs with
``optimizer_state_layout`` "auto" (the flat state on a GPU), and on a GPU a second time with
``enable_cuda_graph`` ("trainingsession captured": the step replayed as one CUDA graph). The
GPU's name and the CPU pressure are printed with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from bench_train import SessionTrainer, TorchTrainer, nvidia_smi_mib  # noqa: E402
from benchmodels import EncoderClassifier, WithLoss, export_onnx, median_ms, ort_inputs, rss_mib, \
    run_interleaved, timed_steps, torch_inputs  # noqa: E402

PRECISIONS = ("float32", "float32-tf32", "float16", "bfloat16")
HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def encoder(args) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    module = WithLoss(EncoderClassifier(vocab=args.vocab, d=args.d, heads=args.heads, ff=4 * args.d,
                                        layers=args.layers, seq=args.seq))
    rng = np.random.default_rng(0)
    batch = {"x": rng.integers(0, args.vocab, (args.batch, args.seq), dtype=np.int64),
             "y": rng.integers(0, 10, (args.batch,), dtype=np.int64)}
    return module, batch


def set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


class Torch(TorchTrainer):
    """PyTorch: zero_grad, forward under autocast (half precisions), backward (scaled for
    float16), AdamW step; ``compiled``: the module through torch.compile."""

    def __init__(self, module, inputs, precision: str, compiled: bool):
        super().__init__(module, inputs)
        self.run = torch.compile(self.model) if compiled else self.model
        self.dtype = HALF.get(precision)
        self.scaler = torch.amp.GradScaler(self.x.device.type) if precision == "float16" else None

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        cast = torch.autocast(self.x.device.type, self.dtype) if self.dtype is not None else contextlib.nullcontext()
        with cast:
            loss = self.run(self.x, self.y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()
        return loss.detach()


def contender(name: str, module, onnx_bytes, batch, precision: str, args):
    if name.startswith("trainingsession"):
        half = precision in HALF
        return SessionTrainer(onnx_bytes, ort_inputs(batch, args.device), args.threads, args.device,
                              use_mixed_precision=half, mixed_precision_dtype=precision if half else "float16",
                              allow_tf32=precision == "float32-tf32", enable_cuda_graph=name.endswith("captured"))
    return Torch(copy.deepcopy(module), torch_inputs(batch, args.device), precision, name == "torch.compile")


def names(args) -> list[str]:
    captured = [] if args.device == "cpu" else ["trainingsession captured"]  # enable_cuda_graph: a GPU only
    return ["pytorch", "trainingsession", *captured] + ([] if args.no_compile else ["torch.compile"])


# ---------------------------------------------------------------------------- memory (child)
def child_main(args) -> None:
    module, batch = encoder(args)
    with open(os.path.join(args.dir, "model.onnx"), "rb") as f:
        onnx_bytes = f.read()
    set_tf32(args.precision == "float32-tf32")
    if args.device == "cuda":
        torch.cuda.init()
        torch.zeros(1, device="cuda")
        base = nvidia_smi_mib(os.getpid())
    else:
        base = rss_mib("VmRSS")
    c = contender(args.child, module, onnx_bytes, batch, args.precision, args)
    timed_steps(c, args.warmup + args.steps, args.device, [], [])
    if args.device == "cuda":
        end = nvidia_smi_mib(os.getpid())
        out = {"mib": None if base is None or end is None else end - base}
        if not args.child.startswith("trainingsession"):
            out["torch_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        out = {"mib": rss_mib("VmHWM") - base}
    print("RESULT " + json.dumps(out))


def memory(precision: str, onnx_bytes: bytes, args) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "model.onnx"), "wb") as f:
            f.write(onnx_bytes)
        for name in names(args):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--precision", precision, "--dir", tmp,
                   *sys.argv[1:]]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            out[name] = json.loads(lines[-1][len("RESULT "):]) if lines else None
            if not lines:
                print(f"  memory child {name} failed (rc {proc.returncode}): {proc.stderr[-1500:]}")
    return out


# ---------------------------------------------------------------------------- main
def bench(precision: str, module, batch, onnx_bytes, args) -> dict:
    print(f"\n== {precision}")
    set_tf32(precision == "float32-tf32")
    contenders = {name: contender(name, module, onnx_bytes, batch, precision, args) for name in names(args)}
    times, losses, _ = run_interleaved(contenders, args)
    res = {name: {"ms": median_ms(times[name], args.warmup), "first_loss": losses[name][0],
                  "last_loss": losses[name][-1]} for name in contenders}
    del contenders
    if not args.no_memory:
        for name, figures in memory(precision, onnx_bytes, args).items():
            res[name]["memory"] = figures
    eager = res["pytorch"]
    for name, r in res.items():
        mem = (r.get("memory") or {}).get("mib")
        ratio = "" if mem is None or not (eager.get("memory") or {}).get("mib") else \
            f", memory {mem:.0f} MiB ({mem / eager['memory']['mib']:.2f}x eager's)"
        print(f"  {name:<16} {r['ms']:9.2f} ms  {r['ms'] / eager['ms']:.2f}x eager{ratio}; "
              f"loss {r['first_loss']:.5f} -> {r['last_loss']:.5f}")
    return res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory children")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--precision", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU and torch's CUDA build; --device cpu checks the script")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        return child_main(args)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "no GPU (CPU run)"
    print(f"{gpu}; torch {torch.__version__}; encoder d {args.d}, {args.heads} heads, {args.layers} layers, "
          f"sequence {args.seq}, batch {args.batch}; {benchlib.reading()}")
    module, batch = encoder(args)
    onnx_bytes = export_onnx(module, batch, "eval")
    results = {p: bench(p, module, batch, onnx_bytes, args) for p in args.precisions}
    print(f"\n{gpu}; {benchlib.reading()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "settings": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
