"""What a periodic checkpoint costs: the time of one ``fit(save_every=...)`` save against the
training step, for a model of about 100 MB (AdamW: its checkpoint holds the weights and two
moments) and one over 2 GB (SGD).

    python tools/bench_periodic.py                     # both models, 3 saves each
    python tools/bench_periodic.py --models 100mb --saves 5

Each model is an MLP of ``--layers`` square Gemm layers (width chosen for the size) trained
on batches of 8 rows, in a child process of its own. Printed per model: the step (median of
5 after 3 warm-up steps), one save (``CheckpointSeries.save``: the whole state read from the
session's own memory, written to a temporary file beside the checkpoint, fsynced and renamed;
median of ``--saves``), the checkpoint's size, the save as steps, and the share of training
time a save every 100 and every 1000 updates takes. The files go to ``--dir`` (default a
temporary folder on the disk of /tmp). /proc/pressure/cpu is printed before and after.
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


def child(name: str, folder: str, saves: int) -> dict:
    import numpy as np
    from onnx import TensorProto, helper

    from gradbuilder import TrainingParameters, TrainingSession
    from gradbuilder.compiler.modelio import DetachedModel
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
    steps = []
    for i in range(8):
        start = time.perf_counter()
        session.run(["loss"], feed)
        if i >= 3:
            steps.append(time.perf_counter() - start)
    series = CheckpointSeries(os.path.join(folder, f"{name}.safetensors"), keep_last=1)
    times = []
    for _ in range(saves):
        start = time.perf_counter()
        path = series.save(session)
        times.append(time.perf_counter() - start)
        session.run(["loss"], feed)
    size = os.path.getsize(path)
    for p in series.numbered():
        p.unlink()
    return {"step_s": statistics.median(steps), "save_s": statistics.median(times), "bytes": size,
            "parameters": sum(w.size for w in weights.values()), "optimizer": optimizer}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", help="where the checkpoints are written (default: a temporary folder)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.saves)))
        return
    print(f"CPU pressure before: {pressure_line()}")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        print(f"{'model':>7} {'params':>12} {'opt':>6} {'checkpoint':>11} {'step ms':>9} {'save ms':>9} "
              f"{'save/step':>9} {'every 100':>10} {'every 1000':>10}")
        for name in args.models:
            done = subprocess.run([sys.executable, __file__, "--child", name, "--dir", folder, "--saves",
                                   str(args.saves)], capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            ratio = r["save_s"] / r["step_s"]
            print(f"{name:>7} {r['parameters']:>12,} {r['optimizer']:>6} {r['bytes'] / 2**20:>8.0f} MB "
                  f"{r['step_s'] * 1e3:>9.1f} {r['save_s'] * 1e3:>9.1f} {ratio:>9.1f} "
                  f"{ratio / (100 + ratio):>10.1%} {ratio / (1000 + ratio):>10.1%}", flush=True)
    print(f"CPU pressure after: {pressure_line()}")


if __name__ == "__main__":
    main()
