"""One operator made a model whose loss is a fixed random projection of every float output
(:func:`make_op_model`), and the two checks every rule passes: float64 finite differences on the
reference evaluator, then the float32 gradient graph on onnxruntime (:func:`check_op` for one op,
:func:`check_model` for a prepared model)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..compiler.builder import GradientGraphBuilder
from ..errors import InvalidArgumentError
from .finite_differences import GradcheckReport, gradcheck
from .ort_runs import ort_grads, run_onnxruntime
from .reference import reference_evaluator


_NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE,
               np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.int64): TensorProto.INT64,
               np.dtype(np.int32): TensorProto.INT32, np.dtype(np.bool_): TensorProto.BOOL}


def _onnx_type(arr: np.ndarray) -> int:
    return _NP_TO_ONNX[np.asarray(arr).dtype]


def make_op_model(
    op_type: str,
    inputs: Sequence[tuple[str, np.ndarray | None]],
    attrs: Mapping | None = None,
    *,
    num_outputs: int = 1,
    opset: int = 17,
    domain: str = "",
    wrt: Sequence[str] | None = None,
    weights_as: str = "initializers",
    dims: str = "static",
    seed: int = 1234,
) -> tuple[onnx.ModelProto, list[str], dict[str, np.ndarray]]:
    """One ``op_type`` node whose loss is a fixed random projection of every float output.

    ``inputs`` is a list of (name, array) — None or "" name for a skipped optional input.
    Float inputs (or only ``wrt``) are the weights: initializers, or graph inputs when
    ``weights_as="inputs"`` (their dims then "static", "symbolic" or "dynamic"). Returns
    (model, weights, feeds).
    """
    rng = np.random.default_rng(seed)
    node_inputs, graph_inputs, inits, feeds, weights = [], [], [], {}, []
    for name, arr in inputs:
        if not name or arr is None:
            node_inputs.append("")
            continue
        node_inputs.append(name)
        arr = np.asarray(arr)
        is_weight = (arr.dtype.kind == "f") if wrt is None else (name in wrt)
        if is_weight:
            weights.append(name)
        if is_weight and weights_as == "inputs":
            shape = {"static": list(arr.shape),
                     "symbolic": [f"{name}_d{i}" if d != 1 else 1 for i, d in enumerate(arr.shape)],
                     "dynamic": [None] * arr.ndim}[dims]
            graph_inputs.append(helper.make_tensor_value_info(name, _onnx_type(arr), shape))
            feeds[name] = arr
        else:
            inits.append(numpy_helper.from_array(arr, name))
    outs = [f"y{i}" for i in range(num_outputs)]
    node = helper.make_node(op_type, node_inputs, outs, domain=domain, **dict(attrs or {}))
    opsets = [helper.make_opsetid("", opset)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    probe = helper.make_model(
        helper.make_graph([node], "probe", graph_inputs, [helper.make_empty_tensor_value_info(o) for o in outs], inits),
        opset_imports=opsets,
    )
    values = reference_evaluator(probe).run(None, feeds)
    nodes = [node]
    terms = []
    for o, v in zip(outs, values):
        v = np.asarray(v)
        if v.dtype.kind != "f":
            continue
        proj = rng.standard_normal(v.shape).astype(v.dtype)
        pname = f"{o}_proj"
        inits.append(numpy_helper.from_array(proj, pname))
        nodes.append(helper.make_node("Mul", [o, pname], [f"{o}_m"]))
        nodes.append(helper.make_node("ReduceSum", [f"{o}_m"], [f"{o}_s"], keepdims=0))
        terms.append(f"{o}_s")
    if not terms:
        raise InvalidArgumentError(f"{op_type} has no float output to build a loss from")
    nodes.append(helper.make_node("Sum", terms, ["loss"]) if len(terms) > 1 else helper.make_node("Identity", terms, ["loss"]))
    ltype = _onnx_type(np.asarray(values[0]) if np.asarray(values[0]).dtype.kind == "f" else np.float32(0))
    model = helper.make_model(
        helper.make_graph(nodes, op_type.lower(), graph_inputs,
                          [helper.make_tensor_value_info("loss", ltype, [])], inits),
        opset_imports=opsets,
    )
    model.ir_version = min(model.ir_version, 10)
    return model, weights, feeds


def check_op(
    op_type: str,
    inputs: Sequence[tuple[str, np.ndarray | None]],
    attrs: Mapping | None = None,
    *,
    num_outputs: int = 1,
    opset: int = 17,
    domain: str = "",
    wrt: Sequence[str] | None = None,
    weights_as: str = "initializers",
    dims: str = "static",
    ort: bool = True,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    ort_rtol: float = 2e-3,
    ort_atol: float = 2e-4,
    **gradcheck_kwargs,
) -> GradcheckReport:
    """Gradcheck one operator; raise AssertionError with the report when it does not match.

    With ``ort=True`` the float32 gradient graph also runs on onnxruntime's CPU provider and
    must agree with the float64 gradients.
    """
    model, weights, feeds = make_op_model(
        op_type, inputs, attrs, num_outputs=num_outputs, opset=opset, domain=domain, wrt=wrt,
        weights_as=weights_as, dims=dims,
    )
    report = gradcheck(model, weights, "loss", feeds, rtol=rtol, atol=atol, **gradcheck_kwargs)
    if not report.passed:
        raise AssertionError(f"{op_type} opset {opset} {dict(attrs or {})}:\n{report}")
    if ort:
        m32 = GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build().get_model()
        got = run_onnxruntime(m32, feeds)
        for w in weights:
            ref = report.gradients[w]
            g = np.asarray(got[f"{w}_grad"], dtype=np.float64)
            scale = max(1.0, float(np.abs(ref).max(initial=0)))
            if g.shape != ref.shape or not np.allclose(g, ref, rtol=ort_rtol, atol=ort_atol * scale):
                raise AssertionError(
                    f"{op_type} opset {opset}: onnxruntime gradient of '{w}' differs from float64: "
                    f"max abs diff {np.abs(g - ref).max() if g.shape == ref.shape else 'shape ' + str(g.shape)}"
                )
    return report


def check_model(model, weights: Sequence[str], feeds: Mapping[str, np.ndarray] | None = None, *, ort: bool = True,
                loss: str = "loss", **gradcheck_kwargs) -> GradcheckReport:
    """:func:`check_op`'s two checks on a prepared model: :func:`gradcheck` (float64 finite
    differences on the reference evaluator) must pass, then (with ``ort=True``) the float32
    gradient graph on onnxruntime must agree with the float64 gradients within
    ``rtol=2e-3, atol=2e-4 * max(1, max|grad|)``. Raises AssertionError; returns the report."""
    feeds = dict(feeds or {})
    report = gradcheck(model, weights, loss, feeds, **gradcheck_kwargs)
    assert report.passed, str(report)
    if ort:
        got = ort_grads(model, weights, feeds, loss=loss)
        for w in weights:
            ref = report.gradients[w]
            np.testing.assert_allclose(got[w], ref, rtol=2e-3, atol=2e-4 * max(1.0, np.abs(ref).max()), err_msg=w)
    return report
