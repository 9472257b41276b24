"""Distributed-training benchmark: the benchmark transformer (tools/bench_train.py: vocab 8000,
d 256, 4 layers, seq 128, batch 8, AdamW) trained by

- ``single``:    one process, onnxruntime with 2 intra-op threads, the whole batch;
- ``pair``:      2 independent processes x 1 thread, 4 rows each, no communication: what the
                 two cores give two processes at all (the ceiling of the next three);
- ``dp``:        2 processes x 1 thread, data parallel, 4 rows each (torch.distributed, gloo);
- ``zero1``:     the same with ZeRO stage 1 (each process holds half the optimizer state);
- ``pipeline``:  2 processes x 1 thread, a 2-stage pipeline (balanced cut), the whole batch in
                 ``--micro`` micro-batches on a 1F1B schedule.

Each contender runs in fresh processes (rank 0 is timed; the ranks step in lockstep), in
rounds that take turns, with /proc/pressure/cpu read around each run. Printed: the median
step, samples/s, the scaling efficiency (samples/s over the single process's: the same two
cores used two ways) and the share of rank 0's step spent in collectives (waiting for the
other rank included: for the pipeline that is its bubble).

    python tools/bench_distributed.py [--steps 20] [--warmup 3] [--rounds 2] [--micro 4] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import benchlib

MODES = {"single": 1, "pair": 2, "dp": 2, "zero1": 2, "pipeline": 2}
BATCH = 8


def child(args) -> None:
    import onnxruntime as ort

    from gradbuilder import TrainingParameters, TrainingSession
    from gradbuilder.runtime.distributed import launched

    rank, world = launched() or (0, 2 if args.child == "pair" else 1)
    rank = int(os.environ.get("BENCH_PAIR_INDEX", rank))
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", enable_grad_norm_clip=False)
    if args.child == "zero1":
        params.deepspeed_zero_stage = 1
    if args.child == "pipeline":
        params.pipeline_parallel_size = 2
        params.num_pipeline_micro_batches = args.micro
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2 if world == 1 else 1
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if args.device == "cuda" else ["CPUExecutionProvider"]
    sess = TrainingSession(args.model, params, so, providers=providers)  # CUDA: each rank its local GPU
    sess.set_learning_rate(1e-4)
    batch = dict(np.load(args.batch))
    feeds = batch if args.child in ("single", "pipeline") else {n: np.array_split(v, world)[rank] for n, v in batch.items()}
    times, comm = [], []
    dist = sess.executor if hasattr(sess.executor, "comm") else None  # a distributed executor: its collectives
    for step in range(args.warmup + args.steps):
        before = 0.0 if dist is None else dist.comm.seconds + (dist.norm_comm.seconds if dist.norm_comm is not dist.comm else 0)
        t0 = time.perf_counter()
        sess.run(["loss"], feeds)
        times.append(time.perf_counter() - t0)
        after = 0.0 if dist is None else dist.comm.seconds + (dist.norm_comm.seconds if dist.norm_comm is not dist.comm else 0)
        comm.append(after - before)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"times": times[args.warmup:], "comm": comm[args.warmup:]}))


def launch(mode: str, model: str, batch: str, args) -> dict:
    world = MODES[mode]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(world):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_RANK": str(rank)}
            if mode == "pair":
                env.update(BENCH_PAIR_INDEX=str(rank))
            elif world > 1:
                env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            cmd = [sys.executable, __file__, "--child", mode, "--model", model, "--batch", batch, "--out", out,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--micro", str(args.micro),
                   "--device", args.device]
            procs.append(subprocess.Popen(cmd, env=env))
        for p in procs:
            if p.wait(timeout=600):
                raise SystemExit(f"{mode}: a rank failed")
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4, help="the pipeline's micro-batches (default 4)")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: one GPU per process (NCCL), by local rank; needs as many GPUs as processes")
    ap.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--batch", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    import torch

    import benchmodels  # torch's models: imported here, the ranks do not need them

    torch.manual_seed(0)
    module = benchmodels.build_transformer().eval()
    batch = benchmodels.make_batch("transformer")
    with tempfile.TemporaryDirectory() as tmp:
        # the exporter fixes the batch size in the graph: one model per rows a graph runs on
        models = {}
        for mode in args.modes:
            rows = BATCH // (args.micro if mode == "pipeline" else MODES[mode])
            models[mode] = os.path.join(tmp, f"transformer{rows}.onnx")
            if not os.path.exists(models[mode]):
                Path(models[mode]).write_bytes(benchmodels.export_onnx(module, {n: v[:rows] for n, v in batch.items()},
                                                                       "eval"))
        data = os.path.join(tmp, "batch.npz")
        np.savez(data, **batch)
        print(f"transformer, batch {BATCH}, {args.steps} measured steps after {args.warmup}, {args.rounds} rounds; "
              f"{benchlib.reading()}")
        got = {m: {"times": [], "comm": []} for m in args.modes}
        for r in range(args.rounds):
            for mode in args.modes:
                def one():
                    return launch(mode, models[mode], data, args)

                result, before, after = benchlib.measured_round(one, f"round {r + 1} {mode}")
                print(benchlib.round_line(f"round {r + 1} {mode:<9}", before, after))
                for k in ("times", "comm"):
                    got[mode][k] += result[k]
    print(f"\n{'mode':<10} {'step ms':>8} {'samples/s':>10} {'efficiency':>11} {'in collectives':>15}")
    base = None
    for mode in args.modes:
        step = statistics.median(got[mode]["times"])
        rate = BATCH / step
        base = base or (rate if mode == "single" else None)
        share = sum(got[mode]["comm"]) / sum(got[mode]["times"])
        eff = f"{rate / base:.2f}" if base else "n/a"
        print(f"{mode:<10} {1e3 * step:>8.1f} {rate:>10.1f} {eff:>11} {share:>14.0%}")
    print(f"{benchlib.reading()}")


if __name__ == "__main__":
    main()
