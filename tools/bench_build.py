"""Build-time benchmark: gradient graphs of transformer models of ~5k/10k/20k nodes.

Two kinds of generated model:
- ``exported`` (default): a torch ``nn.TransformerEncoder`` classifier (vocab 8000, d 256,
  4 heads, feed-forward 1024, dropout 0.1, cross-entropy loss inside) exported by torch's
  TorchScript exporter at opset 17 in training mode with dynamic batch and sequence axes —
  the graph users hand us, shape computations included. Needs torch.
- ``synthetic``: the same architecture written directly with onnx.helper at d 64, with
  static reshapes, so nearly every node is differentiable: a stress test of the walk.

Each size runs in a fresh subprocess so peak memory (VmHWM) is that build's alone.
Reports load / differentiate / serialize times, total, peak RSS against the target
(3 x model file size + 200 MB), and the growth of time per node between sizes.

``--session`` measures a ``TrainingSession`` instead: its construction, then its first step
(the step graph built and loaded, one AdamW step), and the peak RSS of the whole.

    python tools/bench_build.py                      # exported, 5k, 10k, 20k nodes
    python tools/bench_build.py --kind synthetic
    python tools/bench_build.py --nodes 20000
    python tools/bench_build.py --nodes 5000 --session
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
import onnx
from onnx import TensorProto, helper, numpy_helper

from gradbuilder.testing import resident_bytes


def make_transformer(layers: int, d: int = 64, heads: int = 4, ff: int = 128, seq: int = 16,
                     vocab: int = 1000, opset: int = 17) -> onnx.ModelProto:
    """A decoder-free transformer encoder classifier in the form torch's exporter writes."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def w(name, *shape, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[0])
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def c(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op, ins, outs=None, **attrs):
        outs = outs or [f"{op.lower()}_{len(nodes)}"]
        nodes.append(helper.make_node(op, ins, outs, name=f"n{len(nodes)}_{op}", **attrs))
        return outs[0]

    hd = d // heads
    c("shape_bshd", np.array([0, 0, heads, hd], np.int64))
    c("shape_bsd", np.array([0, 0, d], np.int64))
    c("scale", np.array(np.sqrt(hd), np.float32))
    c("half", np.array(0.5, np.float32))
    c("one", np.array(1.0, np.float32))
    c("sqrt2", np.array(np.sqrt(2.0), np.float32))
    c("axes1", np.array([1], np.int64))
    emb = w("embed.weight", vocab, d, scale=0.02)
    x = node("Gather", [emb, "tokens"])
    for i in range(layers):
        p = f"layer{i}."
        h = node("LayerNormalization", [x, w(p + "ln1.weight", d, scale=1.0), w(p + "ln1.bias", d, scale=0.0)],
                 axis=-1, epsilon=1e-5)
        q = node("Add", [node("MatMul", [h, w(p + "q.weight", d, d)]), w(p + "q.bias", d, scale=0.0)])
        k = node("Add", [node("MatMul", [h, w(p + "k.weight", d, d)]), w(p + "k.bias", d, scale=0.0)])
        v = node("Add", [node("MatMul", [h, w(p + "v.weight", d, d)]), w(p + "v.bias", d, scale=0.0)])
        q = node("Transpose", [node("Reshape", [q, "shape_bshd"])], perm=[0, 2, 1, 3])
        k = node("Transpose", [node("Reshape", [k, "shape_bshd"])], perm=[0, 2, 3, 1])
        v = node("Transpose", [node("Reshape", [v, "shape_bshd"])], perm=[0, 2, 1, 3])
        s = node("Div", [node("MatMul", [q, k]), "scale"])
        a = node("Softmax", [s], axis=-1)
        o = node("Transpose", [node("MatMul", [a, v])], perm=[0, 2, 1, 3])
        o = node("Reshape", [o, "shape_bsd"])
        o = node("Add", [node("MatMul", [o, w(p + "o.weight", d, d)]), w(p + "o.bias", d, scale=0.0)])
        x = node("Add", [x, o])
        h = node("LayerNormalization", [x, w(p + "ln2.weight", d, scale=1.0), w(p + "ln2.bias", d, scale=0.0)],
                 axis=-1, epsilon=1e-5)
        h = node("Add", [node("MatMul", [h, w(p + "ff1.weight", d, ff)]), w(p + "ff1.bias", ff, scale=0.0)])
        g = node("Mul", [node("Mul", [h, node("Add", [node("Erf", [node("Div", [h, "sqrt2"])]), "one"])]), "half"])
        g = node("Add", [node("MatMul", [g, w(p + "ff2.weight", ff, d)]), w(p + "ff2.bias", d, scale=0.0)])
        x = node("Add", [x, g])
    x = node("ReduceMean", [x, "axes1"], keepdims=0) if opset >= 18 else node("ReduceMean", [x], axes=[1], keepdims=0)
    logits = node("Add", [node("MatMul", [x, w("head.weight", d, 10)]), w("head.bias", 10, scale=0.0)])
    node("SoftmaxCrossEntropyLoss", [logits, "labels"], ["loss"], reduction="mean")
    graph = helper.make_graph(
        nodes, "transformer",
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", seq]),
         helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def export_transformer(layers: int) -> onnx.ModelProto:
    """torch's TorchScript export of an nn.TransformerEncoder classifier with its loss inside."""
    import io
    import warnings

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(8000, 256)
            layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(256, 10)

        def forward(self, tokens, labels):
            return F.cross_entropy(self.head(self.enc(self.emb(tokens)).mean(1)), labels)

    torch.manual_seed(0)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Classifier().train(), (torch.randint(0, 8000, (2, 16)), torch.randint(0, 10, (2,))), f,
                          dynamo=False, opset_version=17, input_names=["tokens", "labels"], output_names=["loss"],
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          dynamic_axes={"tokens": {0: "batch", 1: "seq"}, "labels": {0: "batch"}})
    return onnx.load_from_string(f.getvalue())


def make(kind: str, layers: int) -> onnx.ModelProto:
    return export_transformer(layers) if kind == "exported" else make_transformer(layers)


def layers_for(kind: str, nodes: int) -> int:
    one, two = len(make(kind, 1).graph.node), len(make(kind, 2).graph.node)
    per_layer = two - one
    return max(1, round((nodes - (one - per_layer)) / per_layer))


def _peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: after fork+exec, ru_maxrss
    still carries the parent's peak."""
    return resident_bytes("VmHWM") / 2**20


def _child(path: str) -> None:
    """Build one model's gradient graph; print timings and peak RSS as JSON."""
    from gradbuilder import GradientGraphBuilder
    from gradbuilder.compiler.builder import default_weights

    t0 = time.perf_counter()
    weights = default_weights(path)
    weights = [w for w in weights if w not in ("scale", "half", "one", "sqrt2")]  # synthetic constants
    b = GradientGraphBuilder(path, weights=weights, outputs=["loss"], loss="loss").build()
    out = path + ".grad.onnx"
    t1 = time.perf_counter()
    b.save(out)
    t2 = time.perf_counter()
    peak = _peak_rss_mb()  # before the counting below
    result = {
        "forward_nodes": len(onnx.load(path).graph.node),
        "output_nodes": len(onnx.load(out).graph.node),
        "load_s": b.timings["load"],
        "differentiate_s": b.timings["differentiate"],
        "serialize_s": b.timings["serialize"] + (t2 - t1),
        "total_s": t2 - t0,
        "peak_rss_mb": peak,
        "model_mb": os.path.getsize(path) / 2**20,
    }
    print(json.dumps(result))


def _session_child(path: str) -> None:
    """Construct a TrainingSession and run its first step; print timings and peak RSS as JSON."""
    from gradbuilder import TrainingParameters, TrainingSession

    base = _peak_rss_mb()
    t0 = time.perf_counter()
    sess = TrainingSession(path, TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw"),
                           providers=["CPUExecutionProvider"])
    t1 = time.perf_counter()
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, 8000, (2, 16)).astype(np.int64), "labels": rng.integers(0, 10, (2,))}
    sess.run(["loss"], feeds)
    t2 = time.perf_counter()
    print(json.dumps({"forward_nodes": len(onnx.load(path).graph.node), "construct_s": t1 - t0,
                      "first_step_s": t2 - t1, "peak_over_start_mb": _peak_rss_mb() - base}))


def _children(args, sizes, flag: str) -> list[dict]:
    """For each size, the model generated and saved, then measured by a fresh child process
    (``flag`` path): the JSON rows it printed."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            path = os.path.join(tmp, f"transformer_{n}.onnx")
            onnx.save(make(args.kind, layers_for(args.kind, n)), path)
            out = subprocess.run([sys.executable, __file__, flag, path], capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"{flag[2:]} on the {n}-node model failed:\n{out.stderr}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def _sessions(args) -> None:
    if args.kind != "exported":
        sys.exit("--session measures the exported model (its inputs are tokens and labels)")
    rows = _children(args, args.nodes, "--session-child")
    print(f"{'fwd nodes':>9} {'construct s':>11} {'1st step s':>10} {'peak MB':>8}")
    for r in rows:
        print(f"{r['forward_nodes']:9d} {r['construct_s']:11.2f} {r['first_step_s']:10.2f} {r['peak_over_start_mb']:8.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[5000, 10000, 20000])
    ap.add_argument("--kind", choices=["exported", "synthetic"], default="exported")
    ap.add_argument("--session", action="store_true", help="measure TrainingSession construction and first step")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--session-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child)
        return
    if args.session_child:
        _session_child(args.session_child)
        return
    if args.session:
        _sessions(args)
        return
    from tqdm import tqdm  # a progress bar on a terminal (stderr), nothing in logs and pipes

    rows = _children(args, tqdm(args.nodes, desc=f"bench_build {args.kind}", unit=" models", disable=None), "--child")
    print(f"kind: {args.kind}")
    print(f"{'fwd nodes':>9} {'out nodes':>9} {'load s':>7} {'diff s':>7} {'ser s':>7} {'total s':>8} "
          f"{'model MB':>9} {'peak MB':>8} {'peak/(3*model+200)':>19} {'us/node':>8}")
    for r in rows:
        budget = 3 * r["model_mb"] + 200
        print(f"{r['forward_nodes']:9d} {r['output_nodes']:9d} {r['load_s']:7.2f} {r['differentiate_s']:7.2f} "
              f"{r['serialize_s']:7.2f} {r['total_s']:8.2f} {r['model_mb']:9.1f} {r['peak_rss_mb']:8.0f} "
              f"{r['peak_rss_mb'] / budget:19.2f} {1e6 * r['total_s'] / r['forward_nodes']:8.0f}")
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        growth = (b["total_s"] / a["total_s"]) / (b["forward_nodes"] / a["forward_nodes"])
        print(f"time growth vs linear from {a['forward_nodes']} to {b['forward_nodes']} nodes: {growth:.2f}x "
              "(1.00 = linear)")


if __name__ == "__main__":
    main()
