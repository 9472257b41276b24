"""Values written as math inside ``with e.math():`` emit the ONNX ops they name, Python
numbers become constants of the other operand's dtype, and a value of a graph the emitter
cannot read is refused by name."""

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from gradbuilder.compiler.emitter import Emitter
from gradbuilder.errors import GradientRuleError


def _graph(dtype=ir.DataType.DOUBLE):
    x = ir.Value(name="x", type=ir.TensorType(dtype), shape=ir.Shape([2, 2]))
    y = ir.Value(name="y", type=ir.TensorType(dtype), shape=ir.Shape([2, 2]))
    return ir.Graph([x, y], [], nodes=[], opset_imports={"": 18}, name="g"), x, y


def _run(graph, out, feeds):
    graph.outputs.append(out)
    model = ir.Model(graph, ir_version=9)
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


@pytest.mark.parametrize("dtype,np_dtype", [(ir.DataType.DOUBLE, np.float64), (ir.DataType.FLOAT, np.float32)])
def test_math_on_values_emits_the_ops_it_names(dtype, np_dtype):
    graph, x, y = _graph(dtype)
    e = Emitter(graph, 18)
    with e.math():
        out = (2 - x * y) / (x ** 2) + (-y) @ x - 1.5 * y
    assert out.dtype == dtype
    assert sorted({n.op_type for n in graph}) == ["Add", "Constant", "Div", "MatMul", "Mul", "Neg", "Pow", "Sub"]
    a = np.array([[1.0, 2.0], [3.0, 4.0]], np_dtype)
    b = np.array([[0.5, -1.0], [2.0, 0.25]], np_dtype)
    got = _run(graph, out, {"x": a, "y": b})
    np.testing.assert_allclose(got, (2 - a * b) / a ** 2 + (-b) @ a - 1.5 * b, rtol=1e-6)


def test_math_is_off_outside_the_block():
    graph, x, y = _graph()
    e = Emitter(graph, 18)
    with e.math():
        pass
    with pytest.raises(ValueError):
        x + y


def test_a_subgraphs_value_in_the_parents_math_is_refused_by_name():
    graph, x, _ = _graph()
    e = Emitter(graph, 18)
    body = ir.Graph([], [], nodes=[], name="body")
    sub = e.child(body)
    inner = sub.Identity(x)  # a value of the subgraph
    with e.math(), pytest.raises(GradientRuleError, match=f"'{inner.name}'.*subgraph"):
        x * inner
    with sub.math():
        assert (inner * x).producer().graph is body  # the subgraph reads its parent's values
