import numpy as np
import pytest

from gradbuilder.testing import check_op

OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceL1", "ReduceL2", "ReduceLogSum",
       "ReduceLogSumExp", "ReduceSumSquare", "ReduceProd"]


def data(rng, op):
    x = rng.uniform(0.5, 2.0, (3, 4, 5)).astype(np.float32)
    if op in ("ReduceL1",):
        x[0] *= -1
    return x


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_axes_attribute_opset13(op, keepdims, rng):
    x = data(rng, op)
    if op == "ReduceSum":
        check_op(op, [("x", x), ("axes", np.array([-1, 0]))], {"keepdims": keepdims}, opset=13)
    else:
        check_op(op, [("x", x)], {"keepdims": keepdims, "axes": [-1, 0]}, opset=13)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_axes_input_opset18(op, keepdims, rng):
    check_op(op, [("x", data(rng, op)), ("axes", np.array([1]))], {"keepdims": keepdims}, opset=18)


@pytest.mark.parametrize("op", OPS)
def test_all_axes_and_noop(op, rng):
    x = data(rng, op)
    check_op(op, [("x", x)], {"keepdims": 0}, opset=18)
    check_op(op, [("x", x)], {"keepdims": 1, "noop_with_empty_axes": 1}, opset=18)


def test_dynamic_shape_input(rng):
    check_op("ReduceMean", [("x", data(rng, "ReduceMean")), ("axes", np.array([1]))], {"keepdims": 0},
             opset=18, weights_as="inputs", dims="dynamic")


def test_reduce_prod_with_zeros():
    x = np.array([[0.0, 2.0, 3.0], [0.0, 0.0, 4.0], [1.5, 2.0, 0.5]], dtype=np.float32)
    check_op("ReduceProd", [("x", x), ("axes", np.array([1]))], {"keepdims": 0}, opset=18)


def test_reduce_max_ties_shared():
    x = np.array([[1.0, 3.0, 3.0]], dtype=np.float32)
    from gradbuilder import GradientGraphBuilder
    from gradbuilder.testing import make_op_model
    from onnx.reference import ReferenceEvaluator

    model, w, _ = make_op_model("ReduceMax", [("x", x), ("axes", np.array([1]))], {"keepdims": 0}, opset=18)
    built = GradientGraphBuilder(model, w, ["loss", "y0_proj"], "loss").build().model_proto
    _, proj, gx = ReferenceEvaluator(built).run(None, {})
    np.testing.assert_allclose(gx, [[0.0, proj[0] / 2, proj[0] / 2]], rtol=1e-6)
