"""`gradbuilder demo`: the whole job on a small model shipped inside the package.

A two-layer MLP classifier with its loss inside (``data/demo_mlp.onnx``): its gradient graph
is checked against float64 finite differences and against onnxruntime, then a
TrainingSession trains it with AdamW on synthetic data (a progress bar on a terminal),
exports the trained model for inference and measures its accuracy on held-out data.
"""

from __future__ import annotations

import tempfile
import time
from importlib import resources
from pathlib import Path

import numpy as np

from .compiler.builder import GradientGraphBuilder
from .errors import InvalidArgumentError
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


def run(print_fn=print, steps: int = 300, lr: float = 0.01, batch_size: int = 64, output: str | None = None,
        stream=None, progress: bool | None = None) -> bool:
    """Run the demo, reporting each check through ``print_fn``; True when all of them pass.
    ``output``: also keep the trained inference model there. ``progress``, ``stream``: the
    training progress bar (see ``loop.fit``: by default only on a terminal)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidArgumentError(f"steps must be an int >= 1, got {steps!r}")
    import onnxruntime as ort

    from . import TrainingParameters
    from .runtime.loop import accuracy, fit
    from .runtime.session import TrainingSession

    model = demo_model_bytes()
    x, labels = demo_batch()
    t0 = time.perf_counter()
    built = GradientGraphBuilder(model, weights=WEIGHTS, outputs=["loss"], loss="loss").build().get_model()
    print_fn(f"built gradient graph: {len(model)} -> {len(built)} bytes in {(time.perf_counter() - t0) * 1000:.0f} ms")

    report = gradcheck(model, WEIGHTS, "loss", {"x": x[:6], "labels": labels[:6]})
    print_fn(str(report))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(built, so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    got = dict(zip(names, sess.run(None, {"x": x[:6], "labels": labels[:6], **_initializers(model)})))
    worst = max(
        float(np.abs(got[f"{w}_grad"] - report.gradients[w]).max() / max(1e-6, np.abs(report.gradients[w]).max()))
        for w in WEIGHTS
    )
    ort_ok = worst < 1e-3
    print_fn(f"onnxruntime {ort.__version__} (CPU) float32 gradients vs float64: max relative error "
             f"{worst:.2e} {'ok' if ort_ok else 'MISMATCH'}")

    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw",
                                enable_grad_norm_clip=False)
    session = TrainingSession(model, params)
    session.set_learning_rate(lr)
    train_x, train_y = demo_batch(4096, seed=1)
    print_fn(f"training on {session.get_providers()[0]}: AdamW, lr {lr}, batch {batch_size}, {steps} steps")
    t0 = time.perf_counter()
    losses = fit(session, {"x": train_x, "labels": train_y}, steps, batch_size, stream=stream, progress=progress)
    rate = steps / (time.perf_counter() - t0)
    trained = np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    print_fn(f"loss {np.mean(losses[:10]):.4f} -> {np.mean(losses[-10:]):.4f} (mean of first/last 10 steps), "
             f"{rate:.0f} steps/s {'ok' if trained else 'DID NOT DECREASE'}")

    with tempfile.TemporaryDirectory() as tmp:
        path = output or str(Path(tmp) / "demo_mlp_trained.onnx")
        session.export_model_for_inferencing(path, ["logits"])
        test_x, test_y = demo_batch(1024, seed=2)
        infer = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        acc = accuracy(infer.run(["logits"], {"x": test_x})[0], test_y)
    accurate = acc >= 0.9
    print_fn(f"exported {'to ' + output if output else 'for inference'}; accuracy on 1024 held-out samples: "
             f"{acc:.1%} {'ok' if accurate else 'TOO LOW'}")
    ok = report.passed and ort_ok and trained and accurate
    print_fn("demo: " + ("all checks passed" if ok else "FAILED"))
    return ok


def _initializers(model_bytes: bytes) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    proto = onnx.load_from_string(model_bytes)
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
