"""Re-measures, for the installed onnxruntime, the graph optimizers gradbuilder leaves out of
its sessions (``gradbuilder.runtime.runner.SLOWER_FUSIONS``).

SkipLayerNormFusion: the transformer benchmark's residual Add + LayerNormalization on
[8, 128, 256] float32, one session with the fusion (onnxruntime's default) and one without,
interleaved in rounds (tools/benchlib.py drops rounds taken under CPU pressure); prints the
medians and whether the fusion still loses.

    python tools/bench_kernels.py [--threads 2] [--runs 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import benchlib


def add_layer_norm(shape=(8, 128, 256)) -> bytes:
    d = shape[-1]
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Add", ["x", "skip"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    graph = helper.make_graph(nodes, "add_ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
                                                helper.make_tensor_value_info("skip", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                              [numpy_helper.from_array(rng.standard_normal(d).astype(np.float32), "gamma"),
                               numpy_helper.from_array(rng.standard_normal(d).astype(np.float32), "beta")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = add_layer_norm()
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    sessions = {"fused (onnxruntime's default)": ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]),
                "Add + LayerNormalization": ort.InferenceSession(model, so, providers=["CPUExecutionProvider"],
                                                                 disabled_optimizers=["SkipLayerNormFusion"])}
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((8, 128, 256)).astype(np.float32) for n in ("x", "skip")}
    outs = {k: s.run(None, feeds)[0] for k, s in sessions.items()}
    a, b = outs.values()
    times = {k: [] for k in sessions}
    print(f"onnxruntime {ort.__version__}, {args.threads} threads; {benchlib.reading()}")
    for r in range(args.rounds):
        def one_round():
            got = {k: [] for k in sessions}
            for k, s in sessions.items():
                for _ in range(args.runs // args.rounds):
                    t0 = time.perf_counter()
                    s.run(None, feeds)
                    got[k].append(time.perf_counter() - t0)
            return got

        got, before, after = benchlib.measured_round(one_round, f"round {r + 1}")
        print(f"  round {r + 1}: cpu pressure {before:.2f}% -> {after:.2f}%")
        for k in sessions:
            times[k] += got[k]
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"  {k:<32} {v:.3f} ms")
    fused, plain = med.values()
    print(f"  outputs agree to {np.abs(a - b).max():.1e}; the fusion is {fused / plain:.2f}x the plain ops: "
          + ("keep it disabled" if fused > plain else "it no longer loses: remove it from SLOWER_FUSIONS"))
    print(f"  {benchlib.reading()}")


if __name__ == "__main__":
    main()
