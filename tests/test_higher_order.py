"""The builder's output can be differentiated again: Hessian-vector products against finite
differences of gradients."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import numeric_gradient, run_onnxruntime, to_float64

from .helpers import make_model, tensor, vi


def mlp_model(act):
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node(act, ["hb"], ["a"]),
        helper.make_node("MatMul", ["a", "W2"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], reduction="mean"),
    ]
    inits = [tensor("W1", rng.standard_normal((4, 5)).astype(np.float64) * 0.5),
             tensor("b1", rng.standard_normal(5).astype(np.float64) * 0.1),
             tensor("W2", rng.standard_normal((5, 3)).astype(np.float64) * 0.5)]
    return make_model(nodes, [vi("x", [6, 4], TensorProto.DOUBLE), vi("labels", [6], TensorProto.INT64)],
                      [vi("loss", [], TensorProto.DOUBLE)], inits)


def hvp_model(model, weights, vectors):
    """loss -> grads (first build), then gv = sum_w <w_grad, v_w>, then d gv / d w = H v."""
    g1 = GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto
    terms = []
    for w in weights:
        g1.graph.initializer.append(numpy_helper.from_array(vectors[w], f"{w}_v"))
        g1.graph.node.append(helper.make_node("Mul", [f"{w}_grad", f"{w}_v"], [f"{w}_gv"]))
        g1.graph.node.append(helper.make_node("ReduceSum", [f"{w}_gv"], [f"{w}_gvs"], keepdims=0))
        terms.append(f"{w}_gvs")
    g1.graph.node.append(helper.make_node("Sum", terms, ["gv"]))
    g1.graph.output.append(helper.make_tensor_value_info("gv", TensorProto.DOUBLE, []))
    return GradientGraphBuilder(g1, weights, ["gv"], "gv", gradient_suffix="_hvp").build().model_proto


@pytest.mark.parametrize("act", ["Tanh", "Sigmoid", "Softplus"])
def test_hessian_vector_product_matches_finite_differences_of_gradients(act):
    model = mlp_model(act)
    weights = ["W1", "b1", "W2"]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 4))
    labels = rng.integers(0, 3, 6)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    vectors = {w: rng.standard_normal(inits[w].shape) for w in weights}

    hvp = hvp_model(model, weights, vectors)
    onnx.checker.check_model(hvp, full_check=True)
    got = dict(zip([o.name for o in hvp.graph.output],
                   ReferenceEvaluator(hvp).run(None, {"x": x, "labels": labels, **inits})))

    grad_model = GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto
    ev = ReferenceEvaluator(grad_model)

    def grads(shift):
        feed = {"x": x, "labels": labels, **{w: inits[w] + shift * vectors[w] for w in weights}}
        out = dict(zip([o.name for o in grad_model.graph.output], ev.run(None, feed)))
        return {w: out[f"{w}_grad"] for w in weights}

    eps = 1e-5
    plus, minus = grads(eps), grads(-eps)
    for w in weights:
        numeric = (plus[w] - minus[w]) / (2 * eps)
        np.testing.assert_allclose(got[f"{w}_hvp"], numeric, rtol=1e-5, atol=1e-8)


def test_hessian_vector_product_through_layernorm_softmax_and_division():
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"]),
        helper.make_node("LayerNormalization", ["q", "g", "b"], ["n"], axis=-1),
        helper.make_node("Softmax", ["n"], ["p"], axis=-1),
        helper.make_node("Div", ["p", "t"], ["pt"]),
        helper.make_node("Mul", ["pt", "pt"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
    ]
    inits = [tensor("Wq", rng.standard_normal((3, 4))), tensor("g", rng.standard_normal(4)),
             tensor("b", rng.standard_normal(4)), tensor("t", rng.uniform(0.5, 1.5, 4))]
    model = make_model(nodes, [vi("x", [5, 3], TensorProto.DOUBLE)], [vi("loss", [], TensorProto.DOUBLE)], inits)
    weights = ["Wq", "g", "b", "t"]
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    vectors = {w: rng.standard_normal(values[w].shape) for w in weights}
    x = rng.standard_normal((5, 3))
    hvp = hvp_model(model, weights, vectors)
    got = dict(zip([o.name for o in hvp.graph.output], ReferenceEvaluator(hvp).run(None, {"x": x, **values})))
    grad_model = GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto
    ev = ReferenceEvaluator(grad_model)
    names = [o.name for o in grad_model.graph.output]

    def grads(shift):
        out = dict(zip(names, ev.run(None, {"x": x, **{w: values[w] + shift * vectors[w] for w in weights}})))
        return {w: out[f"{w}_grad"] for w in weights}

    plus, minus = grads(1e-5), grads(-1e-5)
    for w in weights:
        np.testing.assert_allclose(got[f"{w}_hvp"], (plus[w] - minus[w]) / 2e-5, rtol=1e-5, atol=1e-8)


def test_second_order_of_a_vector_matrix_product_accepts_our_own_output():
    """loss = sum(tanh(x[3] @ W[3, 2])): the first-order graph computes W_grad as
    Unsqueeze(x, 1) * Unsqueeze(dy, 0), which onnx's data propagation misreads (it takes the
    1-D x's dims for shape data) although the model is valid; building again from it must
    work. The Hessian-vector product in float32 on onnxruntime against float64 finite
    differences of the first-order gradient."""
    rng = np.random.default_rng(3)
    model = make_model([helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Tanh", ["y"], ["t"]),
                        helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0)],
                       [vi("x", [3])], [vi("loss", [])], [tensor("W", rng.standard_normal((3, 2)).astype(np.float32))])
    v = rng.standard_normal((3, 2)).astype(np.float32)
    first = GradientGraphBuilder(model, ["W"], ["loss"], "loss").build().model_proto
    first.graph.initializer.append(numpy_helper.from_array(v, "V"))
    first.graph.node.extend([helper.make_node("Mul", ["W_grad", "V"], ["wv"]),
                             helper.make_node("ReduceSum", ["wv"], ["gv"], keepdims=0)])
    first.graph.output.append(vi("gv", []))
    second = GradientGraphBuilder(first, ["W"], ["gv"], "gv", gradient_suffix="_grad2").build()
    onnx.checker.check_model(second.model_proto, full_check=True)
    x = rng.standard_normal(3).astype(np.float32)
    got = run_onnxruntime(second.get_model(), {"x": x})["W_grad2"]

    first64 = to_float64(first)
    ev = ReferenceEvaluator(first64)
    names = [o.name for o in first64.graph.output]
    w0 = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    numeric = numeric_gradient(lambda w: dict(zip(names, ev.run(None, {"x": x.astype(np.float64), "W": w})))["gv"],
                               w0, 1e-6)
    np.testing.assert_allclose(got, numeric, rtol=1e-4, atol=1e-5)
