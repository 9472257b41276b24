"""Re-measures, for the installed onnxruntime, the kernel choices gradbuilder's graphs and
sessions rest on: each contest runs two graphs that compute the same thing, interleaved in
rounds (tools/benchlib.py drops rounds taken under CPU pressure), checks that their outputs
agree, and prints the medians and the second's time over the first's.

- ``skiplayernorm``: the transformer benchmark's residual Add + LayerNormalization on
  [8, 128, 256], with onnxruntime's SkipLayerNormFusion (its default) and without; gradbuilder
  leaves the fusion out of its sessions (``gradbuilder.runtime.runner.SLOWER_FUSIONS``).
- ``maxpool``: the CNN benchmark's first 2x2 MaxPool and its gradient, [32, 32, 32, 32]: the
  pooling with Indices + MaxUnpool (the rule's form), against a plain MaxPool and a gradient
  through the windows' ArgMax (first maximum, as the indices pick it) that needs no indices.
- ``scatter`` / ``scatter-vocab``: an embedding's gradient (4096 rows of width 768 summed into
  64 / 32000 rows at repeated indices) as ``ScatterND(reduction="add")``, which races on
  onnxruntime's CPU threads (its outputs then disagree), against the sorted float64 segment sum
  gradbuilder writes (``compiler/passes/race_free_scatter.py``), exact at any thread count.
- ``scaled-add``: ``b m + a g`` on 1M floats (the Adam moments' update) as Mul, Mul, Add,
  against one Gemm ``alpha [[a]] @ g + beta m`` -- whether fewer nodes make the update faster.

    python tools/bench_kernels.py [--threads 2] [--runs 200] [--contests maxpool ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import benchlib

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs: dict, outputs: list, inits: dict | None = None) -> bytes:
    graph = helper.make_graph(nodes, "contest", [helper.make_tensor_value_info(n, FLOAT, s) for n, s in inputs.items()],
                              [helper.make_tensor_value_info(n, FLOAT, None) for n in outputs],
                              [numpy_helper.from_array(v, n) for n, v in (inits or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def skiplayernorm(rng):
    shape, d = (8, 128, 256), 256
    inits = {"gamma": rng.standard_normal(d).astype(np.float32), "beta": rng.standard_normal(d).astype(np.float32)}
    model = _model([helper.make_node("Add", ["x", "skip"], ["s"]),
                    helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)],
                   {"x": shape, "skip": shape}, ["y"], inits)
    feeds = {n: rng.standard_normal(shape).astype(np.float32) for n in ("x", "skip")}
    contenders = {"Add + LayerNormalization": (model, ["SkipLayerNormFusion"]), "fused (onnxruntime's default)": (model, [])}

    def verdict(ratio):
        return f"the fusion is {ratio:.2f}x the plain ops: " + (
            "keep it disabled" if ratio > 1 else "it no longer loses: remove it from SLOWER_FUSIONS")
    return contenders, feeds, verdict


def maxpool(rng):
    n, c, hw, k = 32, 32, 32, 2
    o = hw // k
    pool = {"kernel_shape": [k, k], "strides": [k, k]}
    shapes = {"s4": [n, c, hw, hw], "s6": [n, c, o, k, o, k], "s5": [n, c, o, o, k * k], "s6b": [n, c, o, o, k, k]}
    inits = {**{name: np.array(s, np.int64) for name, s in shapes.items()},
             "positions": np.arange(k * k, dtype=np.int64), "last": np.array([-1], np.int64),
             "zero": np.array(0.0, np.float32)}
    node = helper.make_node
    with_indices = _model([node("MaxPool", ["x"], ["y", "i"], **pool), node("MaxUnpool", ["dy", "i", "s4"], ["dx"], **pool)],
                          {"x": shapes["s4"], "dy": [n, c, o, o]}, ["y", "dx"], inits)
    argmax = _model([node("MaxPool", ["x"], ["y"], **pool),
                     node("Reshape", ["x", "s6"], ["x6"]), node("Transpose", ["x6"], ["xt"], perm=[0, 1, 2, 4, 3, 5]),
                     node("Reshape", ["xt", "s5"], ["windows"]),
                     node("ArgMax", ["windows"], ["first"], axis=-1, keepdims=1),
                     node("Equal", ["first", "positions"], ["hot"]), node("Unsqueeze", ["dy", "last"], ["dyw"]),
                     node("Where", ["hot", "dyw", "zero"], ["dw"]), node("Reshape", ["dw", "s6b"], ["d6"]),
                     node("Transpose", ["d6"], ["dt"], perm=[0, 1, 2, 4, 3, 5]), node("Reshape", ["dt", "s4"], ["dx"])],
                    {"x": shapes["s4"], "dy": [n, c, o, o]}, ["y", "dx"], inits)
    feeds = {"x": np.maximum(rng.standard_normal(shapes["s4"]), 0).astype(np.float32),  # after a ReLU: ties at 0
             "dy": rng.standard_normal([n, c, o, o]).astype(np.float32)}
    return ({"MaxPool with Indices + MaxUnpool": (with_indices, []), "MaxPool + ArgMax gradient": (argmax, [])}, feeds,
            lambda ratio: f"the ArgMax gradient is {ratio:.2f}x MaxPool with Indices + MaxUnpool")


def scaled_add(rng):
    size = 1 << 20
    inits = {"a": np.array(0.1, np.float32), "b": np.array(0.9, np.float32), "A": np.array([[0.1]], np.float32)}
    node = helper.make_node
    ops = _model([node("Mul", ["m", "b"], ["bm"]), node("Mul", ["g", "a"], ["ag"]), node("Add", ["bm", "ag"], ["y"])],
                 {"g": [1, size], "m": [1, size]}, ["y"], inits)
    gemm = _model([node("Gemm", ["A", "g", "m"], ["y"], beta=0.9)], {"g": [1, size], "m": [1, size]}, ["y"],
                  {"A": inits["A"]})
    feeds = {n: rng.standard_normal((1, size)).astype(np.float32) for n in ("g", "m")}
    return {"Mul + Mul + Add": (ops, []), "Gemm": (gemm, [])}, feeds, lambda ratio: f"one Gemm is {ratio:.2f}x Mul + Mul + Add"


def _scatter(rows):
    def contest(rng):
        import onnx
        import onnx_ir as ir

        from gradbuilder.compiler import pipeline
        from gradbuilder.compiler.passes.race_free_scatter import scatter_reductions_race_free

        n, width = 4096, 768
        ids = rng.integers(0, rows, (n, 1))
        nd = _model([helper.make_node("Expand", ["zero", "shape"], ["data"]),  # as in a gradient: zeros made inside
                     helper.make_node("ScatterND", ["data", "ids", "updates"], ["y"], reduction="add")],
                    {"updates": [n, width]}, ["y"],
                    {"ids": ids, "zero": np.array(0, np.float32), "shape": np.array([rows, width], np.int64)})
        # with its shapes, as in a built graph (the pass sizes its tensors from them)
        model = ir.from_proto(onnx.shape_inference.infer_shapes(onnx.load_from_string(nd), data_prop=True))
        scatter_reductions_race_free(model, pipeline.Context.of(model))
        sorted_sum = ir.to_proto(model).SerializeToString()
        feeds = {"updates": rng.standard_normal((n, width)).astype(np.float32)}
        return ({"ScatterND add (races)": (nd, []), "sorted segment sum": (sorted_sum, [])}, feeds,
                lambda ratio: f"the race-free segment sum is {ratio:.2f}x ScatterND")
    return contest


CONTESTS = {"skiplayernorm": skiplayernorm, "maxpool": maxpool, "scaled-add": scaled_add,
            "scatter": _scatter(64), "scatter-vocab": _scatter(32000)}


def contest(name: str, args) -> None:
    contenders, feeds, verdict = CONTESTS[name](np.random.default_rng(1))
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.log_severity_level = 3
    sessions = {k: ort.InferenceSession(model, so, providers=["CPUExecutionProvider"], disabled_optimizers=off)
                for k, (model, off) in contenders.items()}
    outs = [s.run(None, feeds) for s in sessions.values()]
    agree = max(float(np.abs(a - b).max()) for a, b in zip(*outs))
    times = {k: [] for k in sessions}
    print(f"== {name}")
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
        print(benchlib.round_line(f"round {r + 1}:", before, after))
        for k in sessions:
            times[k] += got[k]
    med = [1e3 * statistics.median(v) for v in times.values()]
    for k, v in zip(sessions, med):
        print(f"  {k:<36} {v:.3f} ms")
    print(f"  outputs agree to {agree:.1e}; {verdict(med[1] / med[0])}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contests", nargs="+", choices=sorted(CONTESTS), default=list(CONTESTS))
    args = ap.parse_args()
    print(f"onnxruntime {ort.__version__}, {args.threads} threads; {benchlib.reading()}")
    for name in args.contests:
        contest(name, args)
    print(f"  {benchlib.reading()}")


if __name__ == "__main__":
    main()
