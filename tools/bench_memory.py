"""Recompute benchmark: peak memory and step time of a TrainingSession with and without the
recompute options, on the transformer of ``bench_train.py`` at sequence length 512.

    python tools/bench_memory.py                 # all configurations, CPU, 2 threads
    python tools/bench_memory.py --configs none layers --seq 256 --steps 3

Each configuration runs in a child process of its own (so peaks do not mix): the session is
built and its state loaded, the resident memory noted (the baseline: weights, optimizer
state, compiled graphs), then ``--warmup`` + ``--steps`` training steps are timed. Activation
memory = VmHWM after the steps - the baseline: what the steps added at their peak (the
activations the backward holds, plus the step's transient buffers). onnxruntime's CPU arena
is on, as in a default SessionOptions (it grows to the step's peak and keeps it); ``--arena
off`` measures without it, where freed buffers go back to the system. Ratios are against the
``none`` configuration of the same run; the planner's own estimate is printed beside them.
Losses are compared with ``none`` to show the gradients are unchanged. The CPU pressure and
load average are printed around each child (tools/benchlib.py); each waits for a calm machine.

Configurations (TrainingParameters):
    none        no recompute
    layers      transformer_layer_recompute (every layer)
    layers2     transformer_layer_recompute, number_recompute_layers=2
    budget50    memory_budget_fraction=0.5 (the min-cut planner)
    budget25    memory_budget_fraction=0.25
    efficient   use_memory_efficient_gradient
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import benchlib
import benchmodels as bt  # the models and helpers bench_train uses too
from gradbuilder import TrainingParameters, TrainingSession

CONFIGS = {
    "none": {},
    "layers": {"transformer_layer_recompute": True},
    "layers2": {"transformer_layer_recompute": True, "number_recompute_layers": 2},
    "budget50": {"memory_budget_fraction": 0.5},
    "budget25": {"memory_budget_fraction": 0.25},
    "efficient": {"use_memory_efficient_gradient": True},
}


def build(seq: int, batch: int):
    torch.manual_seed(0)
    module = bt.WithLoss(bt.EncoderClassifier(seq=seq))
    rng = np.random.default_rng(0)
    data = {"x": rng.integers(0, 8000, (batch, seq), dtype=np.int64),
            "y": rng.integers(0, 10, (batch,), dtype=np.int64)}
    return bt.export_onnx(module, data, "eval"), data


def child(args) -> None:
    """One configuration: prints one RESULT line of JSON."""
    with open(os.path.join(args.dir, "model.onnx"), "rb") as f:
        model = f.read()
    data = dict(np.load(os.path.join(args.dir, "batch.npz")))
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw",
                                enable_grad_norm_clip=False, **CONFIGS[args.child])
    so = bt.session_options(args.threads)
    so.enable_cpu_mem_arena = args.arena == "on"
    sess = TrainingSession(model, params, sess_options=so, providers=["CPUExecutionProvider"])
    sess.set_learning_rate(bt.LR)
    feeds = bt.ort_inputs(data, "cpu")
    sess.graphs["step"]  # build and load the step graph before the baseline
    report = sess.recompute_report
    base = bt.rss_mib("VmRSS")
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        (loss,) = sess.run_with_ort_values(["loss"], feeds)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.numpy()))
    out = {"activation_mib": bt.rss_mib("VmHWM") - base, "base_mib": base,
           "step_ms": bt.median_ms(times, args.warmup), "losses": losses,
           "estimate": None if report is None else {"before_mib": report.bytes_before / 2 ** 20,
                                                    "after_mib": report.bytes_after / 2 ** 20,
                                                    "recomputed": len(report.recomputed)}}
    print("RESULT " + json.dumps(out))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--arena", choices=["on", "off"], default="on", help="onnxruntime's CPU memory arena")
    p.add_argument("--json", help="write every figure to this path")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    configs = ["none"] + [c for c in args.configs if c != "none"]
    print(f"transformer (vocab 8000, d 256, 4 layers, 4 heads) seq {args.seq}, batch {args.batch}; "
          f"{args.threads} threads, arena {args.arena}, median of {args.steps} steps after {args.warmup} warm-up")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, data = build(args.seq, args.batch)
        with open(os.path.join(tmp, "model.onnx"), "wb") as f:
            f.write(model)
        np.savez(os.path.join(tmp, "batch.npz"), **data)
        for name in configs:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--dir", tmp, "--steps",
                   str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads), "--arena", args.arena]
            benchlib.calm()
            before = benchlib.reading()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            print(f"  {name}: {before} before, {benchlib.reading()} after")
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(f"{name}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}")
                continue
            results[name] = json.loads(lines[-1][len("RESULT "):])
    ref = results.get("none")
    print(f"{'config':<10} {'act MiB':>9} {'ratio':>6} {'step ms':>9} {'ratio':>6} {'estimate MiB':>14} "
          f"{'loss max rel diff':>18}")
    for name, r in results.items():
        mem = r["activation_mib"] / ref["activation_mib"] if ref else float("nan")
        time_ratio = r["step_ms"] / ref["step_ms"] if ref else float("nan")
        est = r["estimate"]
        est_s = f"{est['before_mib']:.0f} -> {est['after_mib']:.0f}" if est else "-"
        diff = (max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref["losses"]))
                if ref else float("nan"))
        print(f"{name:<10} {r['activation_mib']:>9.1f} {mem:>6.2f} {r['step_ms']:>9.1f} {time_ratio:>6.2f} "
              f"{est_s:>14} {diff:>18.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
