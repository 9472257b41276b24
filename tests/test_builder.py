import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.errors import InvalidModelError
from gradbuilder.testing import gradcheck, ort_run

from .helpers import linear_model, make_model, tensor, vi


def x_batch(n=5):
    return np.random.default_rng(1).standard_normal((n, 1, 4)).astype(np.float32)


def init(model, name):
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def expected_linear(model, x):
    w, b = init(model, "W"), init(model, "B")
    y = x * w + b
    return (2 * y * x).sum(0), (2 * y).sum((0, 1))


@pytest.mark.parametrize("form", ["proto", "bytes", "path"])
def test_model_forms_and_output_layout(form, tmp_path):
    model = linear_model()
    original = model.SerializeToString()
    src = {"proto": model, "bytes": original, "path": str(tmp_path / "m.onnx")}[form]
    if form == "path":
        onnx.save(model, src)
    b = GradientGraphBuilder(src, ["W", "B"], ["loss", "y"], "loss").build()
    out = onnx.load_from_string(b.get_model())
    assert [o.name for o in out.graph.output] == ["loss", "y", "W_grad", "B_grad"]
    assert model.SerializeToString() == original  # the caller's model is never modified
    assert [i.name for i in out.graph.input] == ["x", "W", "B"]
    assert {"W", "B"} <= {t.name for t in out.graph.initializer}  # kept as default values
    grads = {o.name: o for o in out.graph.output}
    assert [d.dim_value for d in grads["W_grad"].type.tensor_type.shape.dim] == [3, 4]
    assert grads["B_grad"].type.tensor_type.elem_type == TensorProto.FLOAT
    onnx.checker.check_model(out, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in out.graph.node)


def test_runs_on_onnxruntime_with_initializer_defaults_and_fed_weights():
    model = linear_model()
    built = GradientGraphBuilder(model, weights=["W", "B"], outputs=["loss"], loss="loss").build().get_model()
    x = x_batch()
    got = ort_run(built, {"x": x})  # W and B come from their initializer defaults
    gw, gb = expected_linear(model, x)
    np.testing.assert_allclose(got["W_grad"], gw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["B_grad"], gb, rtol=1e-5, atol=1e-5)
    w2 = init(model, "W") * 2  # a training loop feeds new weights
    got2 = ort_run(built, {"x": x, "W": w2})
    y = x * w2 + init(model, "B")
    np.testing.assert_allclose(got2["W_grad"], (2 * y * x).sum(0), rtol=1e-5, atol=1e-5)


def test_shared_weight_matches_finite_differences():
    report = gradcheck(linear_model(), ["W", "B"], "loss", {"x": x_batch(3)})
    assert report.passed, report


def test_save_is_atomic_and_loadable(tmp_path):
    path = tmp_path / "out.onnx"
    GradientGraphBuilder(linear_model(), ["W"], ["loss"], "loss").build().save(path)
    onnx.checker.check_model(str(path), full_check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx"]


def big_model():
    """A model whose weights are large enough to be held apart from the graph while building."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
             helper.make_node("MatMul", ["t", "W2"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    inits = [tensor("W1", rng.standard_normal((16, 64)).astype(np.float32)),
             tensor("W2", rng.standard_normal((64, 8)).astype(np.float32)),
             tensor("unused_big", rng.standard_normal((32, 32)).astype(np.float32))]
    return make_model(nodes, [vi("x", ["batch", 16])], [vi("loss", [])], inits)


def expected_big(model, x):
    w1, w2 = init(model, "W1"), init(model, "W2")
    t = np.tanh(x @ w1)
    dt = np.ones((x.shape[0], 8), np.float32) @ w2.T
    return x.T @ (dt * (1 - t * t)), t.T @ np.ones((x.shape[0], 8), np.float32)


@pytest.mark.parametrize("how", ["bytes", "file", "external"])
def test_large_weights_round_trip(how, tmp_path):
    model = big_model()
    b = GradientGraphBuilder(model, ["W1", "W2"], ["loss"], "loss").build()
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    path = tmp_path / "m.onnx"
    if how == "bytes":
        src = b.get_model()
        parsed = onnx.load_from_string(src)
    else:
        b.save(path, external_data=(how == "external"))
        expected_files = ["m.onnx", "m.onnx.data"] if how == "external" else ["m.onnx"]
        assert sorted(p.name for p in tmp_path.iterdir()) == expected_files
        src = str(path)
        parsed = onnx.load(src)
    onnx.checker.check_model(parsed, full_check=True)
    full = b.model_proto
    assert {t.name: numpy_helper.to_array(t).tobytes() for t in parsed.graph.initializer} == \
        {t.name: numpy_helper.to_array(t).tobytes() for t in full.graph.initializer}
    assert [n.SerializeToString() for n in parsed.graph.node] == [n.SerializeToString() for n in full.graph.node]
    got = ort_run(src if how != "bytes" else src, {"x": x})
    g1, g2 = expected_big(model, x)
    np.testing.assert_allclose(got["W1_grad"], g1, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["W2_grad"], g2, rtol=1e-4, atol=1e-4)


def test_weight_through_cast_and_identity_and_multiple_consumers():
    nodes = [
        helper.make_node("Identity", ["W"], ["w_id"]),
        helper.make_node("Cast", ["w_id"], ["w64"], to=TensorProto.DOUBLE),
        helper.make_node("Cast", ["x"], ["x64"], to=TensorProto.DOUBLE),
        helper.make_node("Mul", ["x64", "w64"], ["a"]),
        helper.make_node("Mul", ["a", "w64"], ["b"]),  # W used again
        helper.make_node("Exp", ["w_id"], ["c32"]),
        helper.make_node("Cast", ["c32"], ["c"], to=TensorProto.DOUBLE),
        helper.make_node("Add", ["b", "c"], ["d"]),
        helper.make_node("ReduceSum", ["d"], ["loss"], keepdims=0),
    ]
    w = np.array([0.5, -1.0, 2.0], np.float32)
    model = make_model(nodes, [vi("x", [3])], [vi("loss", [], TensorProto.DOUBLE)], [tensor("W", w)])
    x = np.array([1.0, 2.0, 3.0], np.float32)
    got = ort_run(GradientGraphBuilder(model, ["W"], ["loss"], "loss").build().get_model(), {"x": x})
    assert got["W_grad"].dtype == np.float32
    np.testing.assert_allclose(got["W_grad"], 2 * x * w + np.exp(w), rtol=1e-5)


@pytest.mark.parametrize("static", [True, False], ids=["static-shape", "symbolic-shape"])
def test_integer_paths_and_shape_computations_get_no_gradient(static):
    """y = Reshape(W, Shape(v)) * Cast(sum(Shape(v))) = W * 5 for v = W (a static shape: the
    integer branch is folded into constants before the walk) or an input x of the same shape
    with a symbolic axis (it stays and the walk passes it by): no gradient flows through it."""
    v = "W" if static else "x"
    nodes = [
        helper.make_node("Shape", [v], ["s"]),
        helper.make_node("Reshape", ["W", "s"], ["w2"]),
        helper.make_node("ReduceSum", ["s"], ["n"], keepdims=0),
        helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["w2", "nf"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    inputs = [] if static else [vi("x", ["a", 3])]
    model = make_model(nodes, inputs, [vi("loss", [])], [tensor("W", np.ones((2, 3), np.float32))])
    b = GradientGraphBuilder(model, ["W"], ["loss"], "loss").build()
    got = ort_run(b.get_model(), {} if static else {"x": np.zeros((2, 3), np.float32)})
    np.testing.assert_allclose(got["W_grad"], np.full((2, 3), 5.0))
    ops = [n.op_type for n in b.model_proto.graph.node]
    assert ("Shape" in ops) is not static  # no rule was needed for Shape, ReduceSum(int) or Cast(int)


def test_unreached_weight_gets_zero_gradient_and_warning():
    nodes = [helper.make_node("Mul", ["x", "W"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    model = make_model(nodes, [vi("x", [2])], [vi("loss", [])],
                       [tensor("W", np.ones(2, np.float32)), tensor("U", np.ones((2, 2), np.float32))])
    with pytest.warns(UserWarning, match="U"):
        b = GradientGraphBuilder(model, ["W", "U"], ["loss"], "loss").build()
    assert b.unreached_weights == ["U"]
    got = ort_run(b.get_model(), {"x": np.array([3.0, 4.0], np.float32)})
    np.testing.assert_allclose(got["U_grad"], np.zeros((2, 2)))
    np.testing.assert_allclose(got["W_grad"], [3.0, 4.0])


def test_weight_as_graph_input_and_fully_dynamic_shapes():
    nodes = [helper.make_node("Mul", ["x", "W"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    model = make_model(nodes, [vi("x", [None, None]), vi("W", [None, None])], [vi("loss", [])])
    b = GradientGraphBuilder(model, ["W"], ["loss"], "loss").build()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = ort_run(b.get_model(), {"x": x, "W": np.ones((1, 3), np.float32)})
    np.testing.assert_allclose(got["W_grad"], x.sum(0, keepdims=True))


@pytest.mark.parametrize("opset", [11, 13, 15, 18, 21, 23])
def test_opsets(opset):
    b = GradientGraphBuilder(linear_model(opset=opset), ["W", "B"], ["loss"], "loss").build()
    out = b.model_proto
    assert max(i.version for i in out.opset_import if i.domain in ("", "ai.onnx")) == max(opset, 13)
    got = ort_run(b.get_model(), {"x": x_batch()})
    np.testing.assert_allclose(got["W_grad"], expected_linear(linear_model(), x_batch())[0], rtol=1e-5, atol=1e-5)


def test_float16_and_float64_weights():
    for dtype, elem in [(np.float16, TensorProto.FLOAT16), (np.float64, TensorProto.DOUBLE)]:
        nodes = [helper.make_node("Mul", ["W", "W"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
        model = make_model(nodes, [], [vi("loss", [], elem)], [tensor("W", np.array([1.0, 2.0], dtype))])
        got = ort_run(GradientGraphBuilder(model, ["W"], ["loss"], "loss").build().get_model(), {})
        assert got["W_grad"].dtype == dtype
        np.testing.assert_allclose(got["W_grad"].astype(np.float64), [2.0, 4.0])


def test_bfloat16_weight_builds_and_checks():
    nodes = [helper.make_node("Mul", ["W", "W"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    w = helper.make_tensor("W", TensorProto.BFLOAT16, [2], [1.0, 2.0])
    model = make_model(nodes, [], [vi("loss", [], TensorProto.BFLOAT16)], [w])
    out = GradientGraphBuilder(model, ["W"], ["loss"], "loss").build().model_proto
    grad = next(o for o in out.graph.output if o.name == "W_grad")
    assert grad.type.tensor_type.elem_type == TensorProto.BFLOAT16


def test_partial_multi_output_node_gets_none_for_unused_outputs():
    # Split with only the first half used: the rule sees None for the second output
    nodes = [
        helper.make_node("Split", ["W", "sizes"], ["a", "b"], axis=0),
        helper.make_node("Mul", ["a", "a"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    model = make_model(nodes, [], [vi("loss", [])],
                       [tensor("W", np.array([1.0, 2.0, 3.0], np.float32)), tensor("sizes", np.array([1, 2]))])
    got = ort_run(GradientGraphBuilder(model, ["W"], ["loss"], "loss").build().get_model(), {})
    np.testing.assert_allclose(got["W_grad"], [2.0, 0.0, 0.0])


def test_stop_gradient_edge():
    nodes = [helper.make_node("Mul", ["W", "W"], ["sq"]), helper.make_node("Mul", ["sq", "W"], ["y"]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    model = make_model(nodes, [], [vi("loss", [])], [tensor("W", np.array([2.0], np.float32))])
    b = GradientGraphBuilder(model, ["W"], ["loss"], "loss", stop_gradients=["sq"]).build()
    np.testing.assert_allclose(ort_run(b.get_model(), {})["W_grad"], [4.0])  # d(W*const)/dW = W^2


def test_timings_recorded():
    b = GradientGraphBuilder(linear_model(), ["W"], ["loss"], "loss").build()
    assert set(b.timings) == {"load", "differentiate", "serialize"}
    assert all(v >= 0 for v in b.timings.values())


def test_no_warning_for_reached_weights():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradientGraphBuilder(linear_model(), ["W", "B"], ["loss"], "loss").build()


def fan_out_model():
    """h = x W used by three branches (Tanh, Sigmoid, Relu) whose sum is reduced to the loss:
    h's gradient has three contributions."""
    w = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Tanh", ["h"], ["a"]),
             helper.make_node("Sigmoid", ["h"], ["b"]), helper.make_node("Relu", ["h"], ["c"]),
             helper.make_node("Sum", ["a", "b", "c"], ["s"]), helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "fan", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_memory_efficient_gradient_adds_contributions_as_they_arrive():
    model = fan_out_model()
    x = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)
    plain = GradientGraphBuilder(model, ["W"], ["loss"], "loss").build().model_proto
    eager = GradientGraphBuilder(model, ["W"], ["loss"], "loss", memory_efficient_gradient=True).build().model_proto
    assert "Sum" in [n.op_type for n in plain.graph.node[6:]]  # one Sum of the three contributions
    assert "Sum" not in [n.op_type for n in eager.graph.node[6:]]  # running Adds instead
    np.testing.assert_allclose(ort_run(eager, {"x": x})["W_grad"], ort_run(plain, {"x": x})["W_grad"], rtol=1e-6)
    report = gradcheck(model, ["W"], "loss", {"x": x})
    assert report.passed, str(report)


def test_graph_input_without_a_shape_is_refused_naming_it():
    """onnx.checker requires a shape (at least a rank) on every graph input; the written model
    must pass it, so a model without one is refused before any work, naming the input."""
    model = make_model([helper.make_node("Mul", ["x", "W"], ["y"]),
                        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)], [vi("loss", [])],
                       [tensor("W", np.ones(3, np.float32))])
    with pytest.raises(InvalidModelError, match="graph input 'x' declares no shape, not even a rank"):
        GradientGraphBuilder(model, ["W"], ["loss"], "loss").build()


def test_output_of_unknown_rank_is_refused_naming_it():
    model = make_model([helper.make_node("Reshape", ["W", "s"], ["r"]),
                        helper.make_node("ReduceSum", ["r"], ["loss"], keepdims=0)],
                       [vi("s", [None], TensorProto.INT64)], [vi("loss", [])], [tensor("W", np.ones(3, np.float32))])
    with pytest.raises(InvalidModelError, match=r"output 'r' \(computed by an unnamed Reshape node\) has a rank"):
        GradientGraphBuilder(model, ["W"], ["loss", "r"], "loss").build()


def test_max_values_and_indices_as_outputs():
    """ReduceMax + ArgMax become the values gathered at the indices (PyTorch's gradient); the
    max's output keeps its name, and the built graph still outputs it (and the indices)."""
    import onnxruntime as ort

    from gradbuilder import GradientGraphBuilder

    from .helpers import make_model, tensor, vi

    w = np.array([[1.0, 3.0, 3.0], [2.0, 0.5, -1.0]], np.float32)
    nodes = [helper.make_node("Mul", ["x", "W"], ["y"]),
             helper.make_node("ReduceMax", ["y", "axes"], ["v"], keepdims=0),
             helper.make_node("ArgMax", ["y"], ["i"], axis=1, keepdims=0),
             helper.make_node("ReduceSum", ["v"], ["loss"], keepdims=0)]
    model = make_model(nodes, [vi("x", [2, 3])], [vi("v", [2]), vi("i", [2], TensorProto.INT64), vi("loss", [])],
                       [tensor("W", w), tensor("axes", np.array([1], np.int64))], opset=18)
    built = GradientGraphBuilder(model, weights=["W"], outputs=["v", "i", "loss"], loss="loss").build().get_model()
    x = np.ones((2, 3), np.float32)
    v, i, loss, grad = ort.InferenceSession(built, providers=["CPUExecutionProvider"]).run(
        ["v", "i", "loss", "W_grad"], {"x": x, "W": w})
    np.testing.assert_array_equal(v, [3.0, 2.0])
    np.testing.assert_array_equal(i, [1, 0])
    assert float(loss) == 5.0
    np.testing.assert_array_equal(grad, [[0, 1, 0], [1, 0, 0]])  # the first of the tied maxima, as PyTorch
