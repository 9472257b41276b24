"""Public extension API: rules for custom ops, stop-gradient edges."""

import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from gradbuilder import (
    GradientGraphBuilder,
    UnsupportedOpError,
    register_custom_stop_gradient_edges,
    register_gradient,
    register_gradient_definition,
)
from gradbuilder.compiler import registry

from .helpers import make_model, tensor, vi


class CubePlus(OpRun):
    """my.ops::CubePlus(x, y) = x^3 + k * y, a custom op for the reference evaluator."""

    op_domain = "my.ops"

    def _run(self, x, y, k=None):
        return (x**3 + k * y,)


@pytest.fixture
def clean_registry():
    with registry.scoped():
        yield


def custom_model():
    nodes = [helper.make_node("CubePlus", ["W", "V"], ["c"], domain="my.ops", k=2.0),
             helper.make_node("ReduceSum", ["c"], ["loss"], keepdims=0)]
    return make_model(nodes, [], [vi("loss", [])],
                      [tensor("W", np.array([1.0, -2.0], np.float32)), tensor("V", np.array([0.5, 3.0], np.float32))],
                      domains=["my.ops"])


def run(model_proto):
    names = [o.name for o in model_proto.graph.output]
    return dict(zip(names, ReferenceEvaluator(model_proto, new_ops=[CubePlus]).run(None, {})))


def test_custom_op_without_rule_is_refused(clean_registry):
    with pytest.raises(UnsupportedOpError, match="CubePlus"):
        GradientGraphBuilder(custom_model(), ["W", "V"], ["loss"], "loss").build()


def test_decorator_registers_a_rule_for_a_custom_op(clean_registry):
    @register_gradient("CubePlus", domain="my.ops")
    def cube_plus(n, dys, needs, e):
        """d(x^3 + k y) = 3 x^2 dx + k dy"""
        x, _ = n.inputs
        (dy,) = dys
        k = n.attributes["k"].value
        return e.Mul(dy, e.Mul(e.scalar(3.0, x), e.Mul(x, x))), e.Mul(dy, e.scalar(k, x))

    out = GradientGraphBuilder(custom_model(), ["W", "V"], ["loss"], "loss").build().model_proto
    got = run(out)
    np.testing.assert_allclose(got["W_grad"], 3 * np.array([1.0, 4.0]))
    np.testing.assert_allclose(got["V_grad"], [2.0, 2.0])


def test_function_form_and_stop_gradient_edge(clean_registry):
    def rule(n, dys, needs, e):
        x, _ = n.inputs
        return e.Mul(dys[0], e.Mul(e.scalar(3.0, x), e.Mul(x, x))), e.Mul(dys[0], e.scalar(2.0, x))

    register_gradient_definition("my.ops", "CubePlus", rule)
    register_custom_stop_gradient_edges({1}, "CubePlus", "my.ops")
    with pytest.warns(UserWarning, match="V"):
        out = GradientGraphBuilder(custom_model(), ["W", "V"], ["loss"], "loss").build().model_proto
    got = run(out)
    np.testing.assert_allclose(got["W_grad"], [3.0, 12.0])
    np.testing.assert_allclose(got["V_grad"], [0.0, 0.0])  # the edge carries no gradient


def test_stop_gradient_edge_on_a_standard_op(clean_registry):
    register_custom_stop_gradient_edges({1}, "Mul")
    nodes = [helper.make_node("Mul", ["W", "W"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    model = make_model(nodes, [], [vi("loss", [])], [tensor("W", np.array([3.0], np.float32))])
    got = run(GradientGraphBuilder(model, ["W"], ["loss"], "loss").build().model_proto)
    np.testing.assert_allclose(got["W_grad"], [3.0])  # only the first factor's path


def test_op_without_rule_is_differentiated_through_its_function_body(clean_registry):
    from gradbuilder.testing import check_op

    assert registry.unregister("", "ThresholdedRelu")  # an ONNX function: Greater, Where
    x = np.random.default_rng(0).uniform(-2, 2, (3, 4)).astype(np.float32)
    check_op("ThresholdedRelu", [("x", x)], {"alpha": 0.5}, opset=18)
    model = make_model([helper.make_node("ThresholdedRelu", ["W"], ["y"], alpha=0.5),
                        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
                       [], [vi("loss", [])], [tensor("W", x)], opset=18)
    out = GradientGraphBuilder(model, ["W"], ["loss"], "loss").build().model_proto
    assert "ThresholdedRelu" not in {n.op_type for n in out.graph.node}


def test_a_scoped_block_leaves_the_rules_and_edges_as_they_were():
    before = registry.all_rules()
    relu = registry.lookup("", "Relu", 17)
    with pytest.raises(RuntimeError, match="inside"), registry.scoped():
        register_gradient("CubePlus", domain="my.ops")(lambda n, dys, needs, e: (None, None))
        register_custom_stop_gradient_edges({0}, "Relu")
        assert [r.op_type for r in registry.unregister("", "Relu")] == ["Relu"]
        assert registry.lookup("", "Relu", 17) is None and registry.unregister("", "Relu") == []
        raise RuntimeError("inside")
    assert registry.all_rules() == before and registry.lookup("", "Relu", 17) == relu
    assert registry.lookup("my.ops", "CubePlus", 17) is None
    assert registry.stop_gradient_edges("", "Relu") == frozenset()


def test_new_function_op_swiglu_gets_a_gradient_without_a_rule():
    from gradbuilder.testing import gradcheck, make_op_model

    rng = np.random.default_rng(1)
    if not any(s.name == "SwiGLU" for s in __import__("onnx").defs.get_all_schemas()):
        raise AssertionError("this onnx has no SwiGLU function op")
    model, weights, feeds = make_op_model("SwiGLU", [("a", rng.standard_normal((2, 6)).astype(np.float32)),
                                                     ("b", rng.standard_normal((2, 6)).astype(np.float32))],
                                          {"alpha": 1.2}, opset=28)
    report = gradcheck(model, weights, "loss", feeds)
    assert report.passed, report
