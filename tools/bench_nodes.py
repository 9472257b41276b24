"""Node executions per training step: what onnxruntime runs for one steady
``TrainingSession.run()`` of the step a GPU session runs (``optimizer_state_layout="flat"``,
run here on the CPU), counted with its profiler (``SessionOptions.enable_profiling``: the
events of category ``Node`` whose name ends in ``_kernel_time``, inside the last
``model_run``).

On a GPU each computing node launches at least one kernel, and every node, computing or not,
costs host time on every device: the count is what bounds a step before its arithmetic does.
``computing`` leaves out Reshape, Squeeze, Unsqueeze, Flatten and Identity (onnxruntime's CUDA
provider aliases them, as PyTorch's views are free). The count does not depend on the
models' widths.

Models:

- ``encoder`` (default): the shape of the GPU benchmark's encoder at small widths: Embedding
  + learned positions + 6 x TransformerEncoderLayer(d 96, 12 heads, ff 384, dropout 0,
  batch_first) + mean + Linear(96, 10), cross-entropy inside; tokens [4, 32]; exported by
  torch's TorchScript exporter in training mode at opset 17 with static shapes;
- ``mlp``, ``transformer``, ``cnn``: ``tools/bench_train.py``'s models and batches.

    python tools/bench_nodes.py                                   # encoder, float32 and float16
    python tools/bench_nodes.py --models encoder mlp transformer cnn --precision float32
    python tools/bench_nodes.py --layers 12 --json nodes.json
    python tools/bench_nodes.py --layout per_tensor                # the CPU's layout ("auto" there)

Printed per model and precision: all node executions, the computing ones, the shape
computations (Shape, Size, Range, ConstantOfShape: each reads a size on the host), the
control-flow nodes (If, Loop, Scan: each reads a condition on the host), the Casts onnxruntime
inserted itself around half-precision nodes its CPU provider has no kernel for (MatMul, Gemm,
Transpose, Add, Mul in float16: they exist on the CPU only, and keep those nodes from its
fusions), the nodes and Casts of the step graph as it is handed to onnxruntime (before its
optimizations: what a GPU session starts from) and the most frequent op types. The CPU pressure (``/proc/pressure/cpu``) is printed before and after: a count does
not depend on it, the profile's times would.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from benchmodels import BUILDERS, EncoderClassifier, WithLoss, export_onnx, make_batch  # noqa: E402

from gradbuilder import TrainingParameters, TrainingSession  # noqa: E402

VIEWS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
SHAPES = frozenset({"Shape", "Size", "Range", "ConstantOfShape"})
CONTROL = frozenset({"If", "Loop", "Scan"})


def encoder(layers: int = 6) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    module = WithLoss(EncoderClassifier(vocab=1000, d=96, heads=12, ff=384, layers=layers, seq=32))
    rng = np.random.default_rng(0)
    batch = {"x": rng.integers(0, 1000, (4, 32), dtype=np.int64), "y": rng.integers(0, 10, (4,), dtype=np.int64)}
    return module, batch


def model(name: str, layers: int) -> tuple[bytes, dict]:
    if name == "encoder":
        module, batch = encoder(layers)
    else:
        torch.manual_seed(0)
        module, batch = BUILDERS[name](), make_batch(name)
    return export_onnx(module.train(), batch, "training"), batch


def count_step(onnx_bytes: bytes, batch: dict, precision: str, optimizer: str = "adamw", layout: str = "flat",
               threads: int = 1, steps: int = 3) -> tuple[collections.Counter, int, collections.Counter]:
    """({op type: executions} of the last of ``steps`` steps (the earlier ones warm up), how many
    of them are Casts onnxruntime inserted around half-precision nodes the CPU has no kernel for,
    {op type: nodes} of the step graph as it is handed to onnxruntime, before its optimizations)."""
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    folder = tempfile.mkdtemp()
    so.profile_file_prefix = os.path.join(folder, "step")
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name=optimizer,
                                use_mixed_precision=precision != "float32", optimizer_state_layout=layout,
                                mixed_precision_dtype=precision if precision != "float32" else "float16")
    session = TrainingSession(onnx_bytes, params, sess_options=so, providers=["CPUExecutionProvider"])
    for _ in range(steps):
        session.run(["loss"], batch)
    counts, inserted = last_run_nodes(session.end_profiling())
    built = onnx.ModelProto.FromString(session.graphs.serialized("step")).graph.node
    handed = collections.Counter(n.op_type for n in built if n.op_type != "Constant")
    return counts, inserted, handed


def last_run_nodes(profile: str) -> tuple[collections.Counter, int]:
    """({op type: executions} in the last ``model_run`` of an onnxruntime profile, how many of
    them are Casts onnxruntime inserted around half-precision nodes)."""
    with open(profile) as f:
        events = json.load(f)
    last = [e for e in events if e.get("name") == "model_run"][-1]
    start, end = last["ts"], last["ts"] + last["dur"]
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")
             and start <= e["ts"] <= end]
    inserted = sum(e["name"].startswith("InsertedPrecisionFreeCast") for e in nodes)
    return collections.Counter(e["args"]["op_name"] for e in nodes), inserted


def summary(counts: collections.Counter, inserted: int, handed: collections.Counter) -> dict:
    return {"all": sum(counts.values()), "computing": sum(v for k, v in counts.items() if k not in VIEWS),
            "shape computations": sum(counts[k] for k in SHAPES), "control flow": sum(counts[k] for k in CONTROL),
            "casts onnxruntime inserted": inserted, "graph nodes": sum(handed.values()), "graph casts": handed["Cast"],
            "by op type": dict(counts.most_common())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["encoder"], choices=["encoder", *BUILDERS])
    ap.add_argument("--precision", nargs="+", default=["float32", "float16"], choices=["float32", "float16"])
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--layers", type=int, default=6, help="the encoder's layers")
    ap.add_argument("--layout", default="flat", choices=["flat", "per_tensor"],
                    help="TrainingParameters.optimizer_state_layout: flat (default) is the step a GPU session runs")
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args()
    print(f"onnxruntime {ort.__version__}, torch {torch.__version__}, {args.optimizer}, optimizer_state_layout "
          f"{args.layout}; {benchlib.reading()}")
    out = {}
    for name in args.models:
        onnx_bytes, batch = model(name, args.layers)
        for precision in args.precision:
            figures = summary(*count_step(onnx_bytes, batch, precision, args.optimizer, args.layout))
            out[f"{name} {precision}"] = figures
            top = ", ".join(f"{k} {v}" for k, v in list(figures["by op type"].items())[:10])
            print(f"{name:<12} {precision:<8} all {figures['all']:>5}  computing {figures['computing']:>5}  "
                  f"shape computations {figures['shape computations']}  control flow {figures['control flow']}  "
                  f"casts onnxruntime inserted {figures['casts onnxruntime inserted']}  graph handed to onnxruntime "
                  f"{figures['graph nodes']} nodes, {figures['graph casts']} Casts  ({top})")
    print(f"  {benchlib.reading()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
