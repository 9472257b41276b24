"""TopK, Compress, OneHot and Unique gradients (rules/selection.py)."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import check_op, make_op_model, reference_evaluator

from .harness import check_graph_ints, distinct, run_grads

f32 = np.float32


def arr(rng, *shape):
    return rng.standard_normal(shape).astype(f32)


# ----------------------------------------------------------------------------- TopK


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("attrs", [{}, {"axis": 0}, {"axis": 1, "largest": 0}, {"axis": -1, "sorted": 0},
                                   {"axis": -3, "largest": 0, "sorted": 0}])
def test_topk(attrs, opset, rng):
    x = distinct(rng, 3, 4, 5)
    # With sorted=0 the order of the values is the runtime's choice: onnxruntime's differs from
    # onnx's reference, so the loss (a projection of the values) differs too; onnxruntime is
    # checked against its own Indices below instead.
    unsorted = attrs.get("sorted", 1) == 0
    check_op("TopK", [("x", x), ("k", np.array([2]))], attrs, opset=opset, num_outputs=2, ort=not unsorted)
    if unsorted:
        model, weights, _ = make_op_model("TopK", [("x", x), ("k", np.array([2]))], attrs, opset=opset,
                                          num_outputs=2)
        got = run_grads(model, weights, {}, extra=["y0_proj", "y1"])
        expected = np.zeros_like(x)
        np.put_along_axis(expected, got["y1"], got["y0_proj"], axis=attrs["axis"])
        np.testing.assert_allclose(got["x"], expected, rtol=1e-6)


@pytest.mark.parametrize("opset", [13, 18])
def test_topk_dynamic(opset, rng):
    check_op("TopK", [("x", distinct(rng, 3, 4, 5)), ("k", np.array([3]))], {"axis": 1, "largest": 0},
             opset=opset, num_outputs=2, weights_as="inputs", dims="dynamic")
    check_graph_ints("TopK", [("x", distinct(rng, 4, 6)), ("k", np.array([4]))], {}, weights_as="inputs",
                     dims="dynamic", graph_ints=["k"], opset=opset, num_outputs=2)


# ----------------------------------------------------------------------------- Compress


COMPRESS = [
    ({"axis": 0}, np.array([True, False, True])),
    ({"axis": 1}, np.array([False, True, True, False])),
    ({"axis": -1}, np.array([True, False, True, True, False])),
    ({"axis": 1}, np.array([False, True])),  # shorter than the axis: the rest is dropped
    ({}, np.array([True, False, False, True, True, False, True] * 3)),  # flattened, shorter than x
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("case", COMPRESS)
def test_compress(case, opset, rng):
    attrs, condition = case
    check_op("Compress", [("x", arr(rng, 3, 4, 5)), ("c", condition)], attrs, opset=opset)


@pytest.mark.parametrize("opset", [13, 18])
def test_compress_dynamic(opset, rng):
    for attrs, condition in COMPRESS[2:]:
        check_op("Compress", [("x", arr(rng, 3, 4, 5)), ("c", condition)], attrs, opset=opset,
                 weights_as="inputs", dims="dynamic")
    check_graph_ints("Compress", [("x", arr(rng, 3, 4, 5)), ("c", COMPRESS[1][1])], COMPRESS[1][0],
                     weights_as="inputs", dims="dynamic", graph_ints=["c"], opset=opset)


# ----------------------------------------------------------------------------- OneHot


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot(axis, opset, rng):
    indices = np.array([[0, 3, -1], [2, 2, 5]])  # 5 is out of range (all off), -1 is the last
    check_op("OneHot", [("i", indices), ("depth", np.array(4)), ("v", np.array([0.3, -1.7], f32))],
             {"axis": axis}, opset=opset)


@pytest.mark.parametrize("opset", [13, 18])
def test_one_hot_dynamic(opset, rng):
    check_graph_ints("OneHot", [("i", np.array([1, 0, 3, 1])), ("depth", np.array(5)),
                                ("v", np.array([2.0, 0.5], f32))], {"axis": 0}, weights_as="inputs",
                     dims="dynamic", graph_ints=["i", "depth"], opset=opset)


def test_one_hot_float_indices_and_depth(rng):
    # indices and depth may be floats (piecewise constant: zero gradients); the values'
    # gradient is computed in the values' type
    indices = np.array([[1.0, 3.0, -1.0], [2.0, 0.0, 7.0]], f32)
    report = check_op("OneHot", [("i", indices), ("depth", np.array(4.0, f32)), ("v", np.array([0.3, -1.7], f32))],
                      {"axis": 1}, opset=18, wrt=["v"])
    assert report.passed
    model, _, feeds = make_op_model("OneHot", [("i", indices), ("depth", np.array(4.0, f32)),
                                               ("v", np.array([0.3, -1.7], f32))], {"axis": 1}, opset=18)
    got = run_grads(model, ["i", "depth", "v"], feeds)
    assert not got["i"].any() and not got["depth"].any()


# ----------------------------------------------------------------------------- Unique

UNIQUE = [  # (x shape, axis, sorted, outputs): the reference evaluator mishandles sorted=0 with an axis but 0
    ((6,), None, 1, 4),
    ((6,), None, 0, 4),
    ((2, 3), None, 1, 4),
    ((2, 3), None, 1, 1),  # Y alone: a second Unique computes inverse_indices and counts
    ((4, 2), 0, 0, 4),
    ((2, 4), 1, 1, 4),
    ((2, 4), -1, 1, 1),
    ((2, 3, 2), -2, 1, 4),
]


@pytest.mark.parametrize("shape,axis,sort,outputs", UNIQUE)
def test_unique_distinct(shape, axis, sort, outputs, rng):
    # distinct entries: Y is a permutation of X's elements (slices)
    attrs = {"sorted": sort} if axis is None else {"sorted": sort, "axis": axis}
    check_op("Unique", [("x", distinct(rng, *shape))], attrs, num_outputs=outputs, opset=13)


def test_unique_dynamic(rng):
    check_op("Unique", [("x", distinct(rng, 2, 4))], {"axis": 1}, num_outputs=4, opset=13,
             weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("axis,outputs", [(None, 4), (None, 1), (0, 4)])
def test_unique_ties(axis, outputs, rng):
    """Tied entries share one entry of Y: the loss has no derivative along one copy alone
    (it changes Y's shape), but along directions that move the copies together it has, and
    the gradient gives it; every copy gets the same share."""
    x = np.array([[2.0, 1.0], [1.0, 3.0], [4.0, 3.0], [2.0, 1.0]])
    # entries that must move together: equal values (equal rows, element by element, with axis 0)
    groups = np.array([[0, 1], [1, 2], [3, 2], [0, 1]]) if axis is None else np.array([[0, 1], [2, 3], [4, 5], [0, 1]])
    attrs = {} if axis is None else {"axis": axis}
    model, weights, _ = make_op_model("Unique", [("x", x)], attrs, num_outputs=outputs, opset=13)
    built = GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build().model_proto
    grad = reference_evaluator(built).run(["x_grad"], {})[0]

    def loss(v):
        return float(reference_evaluator(_with_x(model, v)).run(None, {})[0])

    for _ in range(3):
        d = rng.standard_normal(groups.max() + 1)[groups]  # one step per group of copies
        num = (loss(x + 1e-6 * d) - loss(x - 1e-6 * d)) / 2e-6
        assert abs(num - np.sum(grad * d)) < 1e-6 * max(1.0, abs(num))
    for g in range(groups.max() + 1):
        assert np.ptp(grad[groups == g]) < 1e-12  # an even split
    got = run_grads(model, weights, {})["x"]
    np.testing.assert_allclose(got, grad, rtol=1e-5, atol=1e-6)


def _with_x(model, value):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for i, t in enumerate(m.graph.initializer):
        if t.name == "x":
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(value.astype(np.float64), "x"))
    return m
