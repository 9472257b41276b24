"""What periodic checkpoints cost: training with ``save_every`` against the same training
without, for a model of about 100 MB (AdamW: its checkpoint holds the weights and two moments)
and one over 2 GB (SGD).

    python tools/bench_periodic.py                     # both models, a save every 50 updates
    python tools/bench_periodic.py --models 100mb --every 100 --rounds 3

Each model is an MLP of 4 square MatMul layers (width chosen for the size) trained on batches
of 8 rows, in a child process of its own. After 3 warm-up steps, ``--rounds`` rounds each time
``2 x --every`` steps without saving, with a save after every ``--every`` updates written in
the foreground (``CheckpointSeries.save``: the whole state read from the session's own memory,
hashed, written to a temporary file beside the checkpoint, fsynced and renamed; the newest
kept), and the same written in the background (a copy of the state, then the write from a
thread while the steps go on: ``fit(save_in_background=True)``), taking turns. Printed: the step, one save in
the foreground, the checkpoint's size, and each overhead: (time with saves - time without) /
time without, the median over the rounds. The files go to
``--dir`` (default a temporary folder on the disk of /tmp). /proc/pressure/cpu is printed
before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import pressure_line

MODELS = {"100mb": (2500, 4, "adamw"), "2.3gb": (12000, 4, "sgd")}  # width, layers, optimizer


def child(name: str, folder: str, every: int, rounds: int) -> dict:
    import numpy as np
    from onnx import TensorProto, helper

    from gradbuilder import TrainingParameters, TrainingSession
    from gradbuilder.compiler.detached import DetachedModel
    from gradbuilder.runtime.periodic import CheckpointSeries

    width, layers, optimizer = MODELS[name]
    rng = np.random.default_rng(0)
    weights, nodes, x = {}, [], "x"
    for i in range(layers):
        weights[f"W{i}"] = (rng.standard_normal((width, width), dtype=np.float32) * (1 / width) ** 0.5)
        nodes.append(helper.make_node("MatMul", [x, f"W{i}"], [f"h{i}"]))
        x = f"h{i}"
    nodes.append(helper.make_node("ReduceSumSquare", [x], ["loss"], keepdims=0))
    # the weights apart from the proto (which cannot hold 2 GB): initializers without data
    detached = [TensorProto(name=n, data_type=TensorProto.FLOAT, dims=w.shape) for n, w in weights.items()]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, width])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], detached)
    skeleton = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = TrainingSession(DetachedModel(skeleton, weights), TrainingParameters(
        loss_output_name="loss", training_optimizer_name=optimizer), providers=["CPUExecutionProvider"])
    session.set_learning_rate(1e-6)
    feed = {"x": rng.standard_normal((8, width), dtype=np.float32)}
    for _ in range(3):
        session.run(["loss"], feed)
    modes = {"none": None, "foreground": CheckpointSeries(os.path.join(folder, f"{name}.safetensors"), keep_last=1),
             "background": CheckpointSeries(os.path.join(folder, f"{name}.safetensors"), keep_last=1,
                                            background=True)}
    totals = {mode: [] for mode in modes}
    saves, steps = [], []
    for _ in range(rounds):
        for mode, series in modes.items():
            start = time.perf_counter()
            for i in range(2 * every):
                t0 = time.perf_counter()
                session.run(["loss"], feed)
                steps.append(time.perf_counter() - t0)
                if series is not None and (i + 1) % every == 0:
                    t0 = time.perf_counter()
                    path = series.save(session)
                    if mode == "foreground":
                        saves.append(time.perf_counter() - t0)
            if series is not None:
                series.wait()
            totals[mode].append(time.perf_counter() - start)
    size = os.path.getsize(path)
    for p in modes["foreground"].numbered():
        p.unlink()
    return {"step_s": statistics.median(steps), "save_s": statistics.median(saves), "bytes": size,
            **{f"overhead_{mode}": statistics.median((t - p) / p for t, p in zip(totals[mode], totals["none"]))
               for mode in ("foreground", "background")},
            "parameters": sum(w.size for w in weights.values()), "optimizer": optimizer}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--every", type=int, default=50, help="updates between saves (default 50)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds with and without saves, taking turns (default 2)")
    ap.add_argument("--dir", help="where the checkpoints are written (default: a temporary folder)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.every, args.rounds)))
        return
    print(f"CPU pressure before: {pressure_line()}")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        print(f"overhead: the time of {2 * args.every} steps with a save every {args.every} updates over the time "
              "without, written in the foreground (fit's default) and in the background")
        print(f"{'model':>7} {'params':>12} {'opt':>6} {'checkpoint':>11} {'step ms':>9} {'save ms':>9} "
              f"{'save/step':>9} {'foreground':>11} {'background':>11}")
        for name in args.models:
            done = subprocess.run([sys.executable, __file__, "--child", name, "--dir", folder, "--every",
                                   str(args.every), "--rounds", str(args.rounds)], capture_output=True, text=True,
                                  check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            ratio = r["save_s"] / r["step_s"]
            print(f"{name:>7} {r['parameters']:>12,} {r['optimizer']:>6} {r['bytes'] / 2**20:>8.0f} MB "
                  f"{r['step_s'] * 1e3:>9.1f} {r['save_s'] * 1e3:>9.1f} {ratio:>9.1f} "
                  f"{r['overhead_foreground']:>11.1%} {r['overhead_background']:>11.1%}", flush=True)
    print(f"CPU pressure after: {pressure_line()}")


if __name__ == "__main__":
    main()
