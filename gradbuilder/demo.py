"""`gradbuilder demo`: the whole job on a small model shipped inside the package.

Builds the gradient graph of a two-layer MLP classifier with its loss inside, checks it
against float64 finite differences, runs it on onnxruntime, compares, and trains a few
SGD steps with it.
"""

from __future__ import annotations

import time
from importlib import resources

import numpy as np

from .builder import GradientGraphBuilder
from .testing import gradcheck

WEIGHTS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def demo_model_bytes() -> bytes:
    return resources.files("gradbuilder").joinpath("data/demo_mlp.onnx").read_bytes()


def demo_batch(batch: int = 32, seed: int = 0):
    """A learnable toy task: the label is the quadrant of (x0 + x1, x2 - x3)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 8)).astype(np.float32)
    labels = ((x[:, 0] + x[:, 1] > 0).astype(np.int64) * 2 + (x[:, 2] - x[:, 3] > 0)).astype(np.int64)
    return x, labels


def run(print_fn=print, steps: int = 30, lr: float = 0.5) -> bool:
    import onnxruntime as ort

    model = demo_model_bytes()
    x, labels = demo_batch()
    t0 = time.perf_counter()
    builder = GradientGraphBuilder(model, weights=WEIGHTS, outputs=["loss"], loss="loss").build()
    built = builder.get_model()
    t_build = time.perf_counter() - t0
    print_fn(f"built gradient graph: {len(model)} -> {len(built)} bytes in {t_build * 1000:.0f} ms")

    report = gradcheck(model, WEIGHTS, "loss", {"x": x[:6], "labels": labels[:6]})
    print_fn(str(report))

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(built, so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    weights = {w: np.asarray(v) for w, v in _initializers(model).items()}
    got = dict(zip(names, sess.run(None, {"x": x[:6], "labels": labels[:6], **weights})))
    worst = max(
        float(np.abs(got[f"{w}_grad"] - report.gradients[w]).max() / max(1e-6, np.abs(report.gradients[w]).max()))
        for w in WEIGHTS
    )
    ort_ok = worst < 1e-3
    print_fn(f"onnxruntime {ort.__version__} (CPU) float32 gradients vs float64: max relative error "
             f"{worst:.2e} {'ok' if ort_ok else 'MISMATCH'}")

    losses = []
    for _ in range(steps):
        out = dict(zip(names, sess.run(None, {"x": x, "labels": labels, **weights})))
        losses.append(float(out["loss"]))
        for w in WEIGHTS:
            weights[w] = weights[w] - lr * out[f"{w}_grad"]
    trained = losses[-1] < 0.5 * losses[0]
    print_fn(f"SGD on onnxruntime, {steps} steps, lr={lr}: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
             f"{'ok' if trained else 'DID NOT DECREASE'}")
    ok = report.passed and ort_ok and trained
    print_fn("demo: " + ("all checks passed" if ok else "FAILED"))
    return ok


def _initializers(model_bytes: bytes) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    proto = onnx.load_from_string(model_bytes)
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
