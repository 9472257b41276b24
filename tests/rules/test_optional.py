import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder.testing import check_op, numeric_gradient, ort_grad_session, ort_session


@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_optional_get_element_of_tensor(dims, rng):
    # from opset 18 a plain tensor passes through OptionalGetElement unchanged
    check_op("OptionalGetElement", [("x", rng.standard_normal((3, 4)).astype(np.float32))], opset=18,
             weights_as="inputs", dims=dims)


def optional_model(opset, dtype):
    """x -> Optional -> (OptionalHasElement, OptionalGetElement) -> loss = sum(y * p * has * y):
    the gradient goes through the wrapping; the bool output carries none."""
    t = TensorProto.DOUBLE if dtype == np.float64 else TensorProto.FLOAT
    nodes = [helper.make_node("Optional", ["x"], ["o"]),
             helper.make_node("OptionalHasElement", ["o"], ["has"]),
             helper.make_node("Cast", ["has"], ["hasf"], to=t),
             helper.make_node("OptionalGetElement", ["o"], ["y"]),
             helper.make_node("Mul", ["y", "p"], ["m"]),
             helper.make_node("Mul", ["m", "hasf"], ["m2"]),
             helper.make_node("Mul", ["m2", "y"], ["m3"]),
             helper.make_node("ReduceSum", ["m3"], ["loss"], keepdims=0)]
    proj = numpy_helper.from_array(np.random.default_rng(1).standard_normal((3, 4)).astype(dtype), "p")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", t, [3, 4])],
                              [helper.make_tensor_value_info("loss", t, [])], [proj])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("opset", [15, 18])
def test_optional_wrapping(opset, rng):
    """onnx's reference evaluator hands Optional's list wrapper on from OptionalGetElement, so
    this gradient is checked on onnxruntime (float64) against finite differences there."""
    x = rng.standard_normal((3, 4))
    model = optional_model(opset, np.float64)
    _, got = ort_grad_session(model, ["x"], {"x": x})
    sess = ort_session(model)
    num = numeric_gradient(lambda v: sess.run(["loss"], {"x": v})[0], x, 1e-6)
    np.testing.assert_allclose(got["x_grad"], num, rtol=1e-6, atol=1e-8)
    # float32 too
    x32 = x.astype(np.float32)
    _, got32 = ort_grad_session(optional_model(opset, np.float32), ["x"], {"x": x32})
    np.testing.assert_allclose(got32["x_grad"], num, rtol=1e-4, atol=1e-5)
