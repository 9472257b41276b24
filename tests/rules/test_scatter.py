import numpy as np
import pytest

from gradbuilder.testing import check_op, make_op_model

from .harness import check_graph_ints, distinct, run_grads

f32 = np.float32


def arr(rng, *shape):
    return rng.standard_normal(shape).astype(f32)


# ----------------------------------------------------------------------------- ScatterElements

ELEMENTS = [  # (data shape, indices, updates shape, axis)
    ((3, 4), np.array([[2, 0, 1, 1], [0, 1, 2, 0]]), (2, 4), 0),  # unique
    ((3, 4), np.array([[1, 3], [0, 2], [-1, -4]]), (3, 2), 1),  # smaller than data, negative
    ((3, 4), np.array([[1, 1, 0, 0], [1, 2, 0, 2]]), (2, 4), 0),  # repeats
    ((2, 3, 4), np.array([[[0, 2], [3, 3]], [[1, 1], [-1, 0]]]), (2, 2, 2), -1),  # repeats via -1 == 3
]


def elements_inputs(rng, case, reduction):
    shape, idx, ushape, _ = case
    if reduction in ("max", "min"):
        data, upd = distinct(rng, *shape), distinct(rng, *ushape, offset=0.2)
    elif reduction == "mul":
        data, upd = arr(rng, *shape), rng.uniform(0.5, 1.5, ushape).astype(f32) * rng.choice([-1, 1], ushape)
    else:
        data, upd = arr(rng, *shape), arr(rng, *ushape)
    return [("data", data), ("i", idx), ("u", upd.astype(f32))]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("case", ELEMENTS)
def test_scatter_elements_none(case, opset, rng):
    check_op("ScatterElements", elements_inputs(rng, case, "none"), {"axis": case[3]}, opset=opset)


@pytest.mark.parametrize("reduction,opset", [("add", 16), ("mul", 16), ("mul", 18), ("max", 18), ("min", 18)])
@pytest.mark.parametrize("case", ELEMENTS)
def test_scatter_elements_reductions(case, reduction, opset, rng):
    check_op("ScatterElements", elements_inputs(rng, case, reduction), {"axis": case[3], "reduction": reduction},
             opset=opset)


@pytest.mark.parametrize("reduction,opset", [("none", 13), ("add", 16), ("mul", 18), ("max", 18)])
def test_scatter_elements_dynamic(reduction, opset, rng):
    red = {} if reduction == "none" else {"reduction": reduction}
    check_op("ScatterElements", elements_inputs(rng, ELEMENTS[3], reduction), {"axis": -1, **red},
             opset=opset, weights_as="inputs", dims="dynamic")
    check_graph_ints("ScatterElements", elements_inputs(rng, ELEMENTS[1], reduction), {"axis": 1, **red},
                     weights_as="inputs", dims="dynamic", graph_ints=["i"], opset=opset)


def test_scatter_elements_last_write_wins(rng):
    """Repeated indices with reduction none: only the update written last gets its dy."""
    data, upd = arr(rng, 4), arr(rng, 5)
    idx = np.array([1, 3, 1, 1, 0])
    model, weights, _ = make_op_model("ScatterElements", [("data", data), ("i", idx), ("u", upd)], {}, opset=13)
    got = run_grads(model, weights, {}, extra=["y0_proj"])
    proj = got["y0_proj"]
    np.testing.assert_allclose(got["u"], [0, proj[3], 0, proj[1], proj[0]], rtol=1e-6)
    np.testing.assert_allclose(got["data"], [0, 0, proj[2], 0], rtol=1e-6)


def test_scatter_mul_zero_updates():
    """Products of the other updates with zeros among them, exactly."""
    data = np.array([[1.5, -2.0, 0.7], [0.3, 1.1, -0.4]], f32)
    upd = np.array([[0.0, 1.3, 0.0], [0.0, -0.8, 2.0], [1.2, 0.0, 0.9]], f32)
    idx = np.array([[0, 1, 0], [0, 1, 0], [1, 1, 0]])  # column 0 row 0: two zeros; column 2 row 0: one zero
    for op, inputs in (("ScatterElements", [("data", data), ("i", idx), ("u", upd)]),
                       ("ScatterND", [("data", data), ("i", np.array([[0], [0], [1]])), ("u", upd[:, :3])])):
        check_op(op, inputs, {"reduction": "mul"}, opset=18)


def test_scatter_max_ties_split():
    """A tie between data and an update: each gets half of dy."""
    data = np.array([1.0, 2.0, 3.0], f32)
    upd = np.array([2.0, 0.5], f32)
    model, weights, _ = make_op_model("ScatterElements", [("data", data), ("i", np.array([1, 2])), ("u", upd)],
                                      {"reduction": "max"}, opset=18)
    got = run_grads(model, weights, {}, extra=["y0_proj"])
    proj = got["y0_proj"]
    np.testing.assert_allclose(got["data"], [proj[0], proj[1] / 2, proj[2]], rtol=1e-6)
    np.testing.assert_allclose(got["u"], [proj[1] / 2, 0], rtol=1e-6)


def test_scatter_float16(rng):
    """float16 on onnxruntime (its CPU kernels have no float16 add/mul reductions, nor ScatterND
    max/min, so those forwards cannot run there)."""
    data, upd = distinct(rng, 3, 4).astype(np.float16), distinct(rng, 2, 4, offset=0.2).astype(np.float16)
    idx = np.array([[1, 1, 0, 0], [1, 2, 0, 2]])
    for attrs, opset in (({}, 13), ({"reduction": "max"}, 18), ({"reduction": "min"}, 18)):
        check_op("ScatterElements", [("data", data), ("i", idx), ("u", upd)], attrs,
                 opset=opset, ort_rtol=1e-2, ort_atol=1e-2)
    check_op("ScatterND", [("data", data), ("i", np.array([[1], [1]])), ("u", upd)], {},
             opset=13, ort_rtol=1e-2, ort_atol=1e-2)


# ----------------------------------------------------------------------------- ScatterND

ND = [  # (data shape, indices, updates shape)
    ((4, 3), np.array([[2], [0], [-1]]), (3, 3)),  # unique rows (-1 == 3)
    ((4, 3), np.array([[2], [0], [2]]), (3, 3)),  # a repeated row
    ((4, 3), np.array([[0, 1], [3, 2], [0, 1], [-4, 1]]), (4,)),  # elements, repeated 3 times
    ((2, 3, 4), np.array([[[1, 2], [0, 0]], [[1, -1], [1, 2]]]), (2, 2, 4)),
]


def nd_inputs(rng, case, reduction):
    shape, idx, ushape = case
    return elements_inputs(rng, (shape, idx, ushape, 0), reduction)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("case", ND)
def test_scatter_nd_none(case, opset, rng):
    check_op("ScatterND", nd_inputs(rng, case, "none"), {}, opset=opset)


@pytest.mark.parametrize("reduction,opset", [("add", 16), ("mul", 16), ("mul", 18), ("max", 18), ("min", 18)])
@pytest.mark.parametrize("case", ND)
def test_scatter_nd_reductions(case, reduction, opset, rng):
    check_op("ScatterND", nd_inputs(rng, case, reduction), {"reduction": reduction}, opset=opset)


@pytest.mark.parametrize("reduction,opset", [("none", 13), ("add", 16), ("mul", 18), ("min", 18)])
def test_scatter_nd_dynamic(reduction, opset, rng):
    red = {} if reduction == "none" else {"reduction": reduction}
    check_op("ScatterND", nd_inputs(rng, ND[3], reduction), red, opset=opset, weights_as="inputs", dims="dynamic")
    check_graph_ints("ScatterND", nd_inputs(rng, ND[2], reduction), red, weights_as="inputs", dims="dynamic",
                     graph_ints=["i"], opset=opset)


# ----------------------------------------------------------------------------- TensorScatter


TENSOR_SCATTER = [  # (cache shape, update shape, write indices, attrs)
    ((2, 3, 5, 4), (2, 3, 2, 4), None, {}),
    ((2, 3, 5, 4), (2, 3, 2, 4), np.array([1, 3]), {}),
    ((2, 3, 5, 4), (2, 3, 3, 4), np.array([1, 4]), {"mode": "circular"}),
    ((2, 5, 3), (2, 2, 3), np.array([3, 0]), {"axis": 1}),
    ((2, 5, 3), (2, 4, 3), np.array([2, 4]), {"axis": -2, "mode": "circular"}),
]


@pytest.mark.parametrize("case", TENSOR_SCATTER)
def test_tensor_scatter(case, rng):
    cache, update, write, attrs = case
    inputs = [("past", arr(rng, *cache)), ("update", arr(rng, *update))] + ([("w", write)] if write is not None else [])
    check_op("TensorScatter", inputs, attrs, opset=24)


def test_tensor_scatter_dynamic(rng):
    for cache, update, write, attrs in TENSOR_SCATTER[:3]:
        inputs = [("past", arr(rng, *cache)), ("update", arr(rng, *update))]
        inputs += [("w", write)] if write is not None else []
        check_op("TensorScatter", inputs, attrs, opset=24, weights_as="inputs", dims="dynamic")
