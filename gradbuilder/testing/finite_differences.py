"""``gradcheck``: the built gradients of a model against float64 central finite differences, on
onnx's reference evaluator (with :mod:`gradbuilder.testing.reference`'s fixes); ``numeric_gradient``
for checks written by hand."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..compiler.builder import GradientGraphBuilder
from ..errors import InvalidArgumentError, InvalidModelError
from .float64 import to_float64
from .reference import reference_evaluator


@dataclasses.dataclass
class WeightCheck:
    name: str
    checked: int
    max_abs_err: float
    max_rel_err: float
    passed: bool


@dataclasses.dataclass
class GradcheckReport:
    weights: list[WeightCheck]
    loss: float
    gradients: dict[str, np.ndarray]

    @property
    def passed(self) -> bool:
        return all(w.passed for w in self.weights)

    def __str__(self) -> str:
        lines = [f"gradcheck loss={self.loss:.6g}: {'PASS' if self.passed else 'FAIL'}"]
        for w in self.weights:
            lines.append(
                f"  {w.name:30s} checked={w.checked:4d} max_abs={w.max_abs_err:.3g} "
                f"max_rel={w.max_rel_err:.3g} {'ok' if w.passed else 'MISMATCH'}"
            )
        return "\n".join(lines)


def forward_model(proto: onnx.ModelProto, weights: Sequence[str], loss: str) -> onnx.ModelProto:
    """``proto`` with ``weights`` as graph inputs and ``loss`` as the only output."""
    fwd = onnx.ModelProto()
    fwd.CopyFrom(proto)
    inferred = onnx.shape_inference.infer_shapes(fwd)
    vi = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)
          + list(inferred.graph.input)}
    inputs = {i.name for i in fwd.graph.input}
    for t in fwd.graph.initializer:
        if t.name in weights and t.name not in inputs:
            fwd.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    del fwd.graph.output[:]
    if loss in vi:
        fwd.graph.output.append(vi[loss])
    else:
        fwd.graph.output.append(helper.make_empty_tensor_value_info(loss))
    return fwd


def _weight_values(proto: onnx.ModelProto, weights, feeds) -> dict[str, np.ndarray]:
    inits = {t.name: t for t in proto.graph.initializer}
    out = {}
    for w in weights:
        if w in feeds:
            out[w] = np.asarray(feeds[w], dtype=np.float64)
        elif w in inits:
            out[w] = numpy_helper.to_array(inits[w]).astype(np.float64)
        else:
            raise InvalidArgumentError(f"gradcheck: weight '{w}' is a graph input; give its value in inputs")
    return out


def gradcheck(
    model,
    weights: Sequence[str],
    loss: str,
    inputs: Mapping[str, np.ndarray] | None = None,
    *,
    eps: float = 1e-6,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    max_elements: int = 24,
    directions: int = 2,
    seed: int = 0,
) -> GradcheckReport:
    """Compare the built gradients of ``loss`` w.r.t. ``weights`` with finite differences.

    Everything runs in float64 on onnx's reference evaluator. Each weight is checked on up to
    ``max_elements`` sampled elements plus ``directions`` random directional derivatives.
    An element passes when ``|analytic - numeric| <= atol + rtol * |numeric|``.
    """
    rng = np.random.default_rng(seed)
    proto = to_float64(model)
    graph_inputs = {i.name for i in proto.graph.input}
    init_names = {t.name for t in proto.graph.initializer}
    feeds64 = {}
    for k, v in (inputs or {}).items():
        arr = np.asarray(v)
        feeds64[k] = arr.astype(np.float64) if arr.dtype.kind == "f" else arr
    missing = [n for n in graph_inputs - init_names - set(feeds64)]
    if missing:
        raise InvalidArgumentError(f"gradcheck: give values for the graph inputs {sorted(missing)}")
    wvals = _weight_values(proto, weights, feeds64)

    built = _build_float64(model, proto, list(weights), loss)
    grad_eval = reference_evaluator(built)
    res = grad_eval.run(None, {**feeds64, **wvals})
    names = [o.name for o in built.graph.output]
    got = dict(zip(names, res))
    grads = {w: np.asarray(got[f"{w}_grad"], dtype=np.float64) for w in weights}

    fwd_eval = reference_evaluator(forward_model(proto, weights, loss))

    def f(wname, value):
        feed = {**feeds64, **wvals, wname: value}
        return float(np.asarray(fwd_eval.run(None, feed)[0]).reshape(-1)[0])

    checks = []
    for w in weights:
        base = wvals[w]
        g = grads[w]
        if g.shape != base.shape:
            checks.append(WeightCheck(w, 0, float("inf"), float("inf"), False))
            continue
        flat = base.reshape(-1)
        idx = np.arange(flat.size) if flat.size <= max_elements else rng.choice(flat.size, max_elements, replace=False)
        pairs = []
        for i in idx:
            plus, minus = flat.copy(), flat.copy()
            plus[i] += eps
            minus[i] -= eps
            num = (f(w, plus.reshape(base.shape)) - f(w, minus.reshape(base.shape))) / (2 * eps)
            pairs.append((float(g.reshape(-1)[i]), num))
        for _ in range(directions if flat.size > 1 else 0):
            d = rng.standard_normal(base.shape)
            d /= np.linalg.norm(d)
            num = (f(w, base + eps * d) - f(w, base - eps * d)) / (2 * eps)
            pairs.append((float(np.sum(g * d)), num))
        a = np.array([p[0] for p in pairs])
        n = np.array([p[1] for p in pairs])
        err = np.abs(a - n)
        ok = bool(np.all(err <= atol + rtol * np.abs(n))) and bool(np.all(np.isfinite(a)))
        rel = err / np.maximum(np.abs(n), 1e-12)
        checks.append(WeightCheck(w, len(pairs), float(err.max(initial=0)), float(rel.max(initial=0)), ok))
    loss_value = float(np.asarray(got[loss]).reshape(-1)[0]) if loss in got else float("nan")
    return GradcheckReport(checks, loss_value, grads)


def _build_float64(model, proto64: onnx.ModelProto, weights: list[str], loss: str) -> onnx.ModelProto:
    """The gradient graph of the float64 model; where that does not type-check (ops whose
    schema has no float64 type: RotaryEmbedding, LinearAttention; function bodies with
    float32 constants: MeanVarianceNormalization) the graph is built in the model's own
    precision and then converted, so the reference evaluator still runs it in float64."""
    try:
        return GradientGraphBuilder(proto64, weights=weights, outputs=[loss], loss=loss).build().model_proto
    except InvalidModelError:
        pass  # e.g. a float32 constant in an op's function body no longer type-checks
    built = GradientGraphBuilder(model, weights=weights, outputs=[loss], loss=loss).build().model_proto
    return to_float64(built)


def numeric_gradient(f, base: np.ndarray, eps: float) -> np.ndarray:
    """Central finite differences of the scalar function ``f`` at ``base``, every element."""
    num = np.zeros_like(base)
    flat = base.reshape(-1)
    for i in range(flat.size):
        plus, minus = flat.copy(), flat.copy()
        plus[i] += eps
        minus[i] -= eps
        num.reshape(-1)[i] = (f(plus.reshape(base.shape)) - f(minus.reshape(base.shape))) / (2 * eps)
    return num
