import numpy as np
import onnx
import pytest
from onnx import helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import check_op, make_op_model, max_pool_reference, ort_run, patch_reference_evaluator

from .harness import check_graph_ints, ort_directional_check, signed

f32 = np.float32


def distinct(rng, *shape):
    """Values with well separated entries, so no window maximum is near a tie."""
    n = int(np.prod(shape))
    return (rng.permutation(n).reshape(shape) * 0.25 + rng.uniform(-0.05, 0.05, shape)).astype(f32)


def single_node(op, x, attrs, opset, outputs=("y",)):
    node = helper.make_node(op, ["x"], list(outputs), **attrs)
    graph = helper.make_graph([node], "g", [], [helper.make_empty_tensor_value_info(o) for o in outputs],
                              [onnx.numpy_helper.from_array(x, "x")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def assert_forward_agrees(op, x, attrs, opset, outputs=("y",)):
    """onnx's reference and onnxruntime compute the same forward: the case tests agreed semantics
    (the reference gets ceil_mode windows wrong when they overhang the end by 2 or more, and
    MaxPool with all strides 1 and padding)."""
    from onnx import reference  # looked up at call time: tests may patch it

    model = single_node(op, x, attrs, opset, outputs)
    ref = reference.ReferenceEvaluator(model).run(None, {})
    got = ort_run(model, {})
    for name, r in zip(outputs, ref):
        assert r.shape == got[name].shape and np.allclose(r, got[name], atol=1e-5), (op, attrs, name)


def check_pool(op, x, attrs, opset, **kw):
    assert_forward_agrees(op, x, attrs, opset)
    check_op(op, [("x", x)], attrs, opset=opset, **kw)


X2 = (2, 4, 5, 6)

# ----------------------------------------------------------------------------- MaxPool

MAXPOOL = [
    ("k3s2", X2, {"kernel_shape": [3, 3], "strides": [2, 2]}),
    ("k3s2p1-overlap", X2, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("k2s2-ceil", X2, {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    ("k3s2-ceil-pads", X2, {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 1, 0, 0], "ceil_mode": 1}),
    ("stride-1-axis-padded", X2, {"kernel_shape": [3, 3], "strides": [2, 1], "pads": [1, 1, 1, 1]}),
    ("dilations", X2, {"kernel_shape": [2, 3], "strides": [1, 2], "dilations": [2, 1], "pads": [1, 0, 0, 1]}),
    ("dilations-ceil", X2, {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 2], "ceil_mode": 1}),
    ("same-upper", X2, {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ("valid", X2, {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "VALID"}),
    ("1d", (2, 4, 7), {"kernel_shape": [3], "strides": [2], "pads": [1, 1], "ceil_mode": 1}),
    ("3d", (1, 2, 4, 5, 3), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 1], "pads": [0, 1, 0, 0, 0, 1]}),
    # windows that do not overlap and cover x (opset 16+: MaxUnpool instead of a scatter-add)
    ("k2s2-tiles", (2, 3, 6, 4), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ("k2s2-tiles-pads", (2, 3, 6, 4), {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("k2s3-gaps", (2, 3, 8, 5), {"kernel_shape": [2, 2], "strides": [3, 3]}),
    ("1d-tiles", (2, 4, 6), {"kernel_shape": [3], "strides": [3]}),
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("case", MAXPOOL, ids=[c[0] for c in MAXPOOL])
def test_max_pool(case, opset, rng):
    _, shape, attrs = case
    check_pool("MaxPool", distinct(rng, *shape), attrs, opset)


# onnx's reference MaxPool gives wrong Indices when every stride and dilation is 1, so the
# opset-16+ form (re-run MaxPool for Indices) is checked there on onnxruntime (ORT_ONLY below);
# here opsets 13 and 15.
@pytest.mark.parametrize("opset", [13, 15])
@pytest.mark.parametrize("shape,attrs", [
    (X2, {"kernel_shape": [3, 3]}),
    (X2, {"kernel_shape": [2, 3], "ceil_mode": 1}),
    ((2, 4, 7), {"kernel_shape": [3]}),
], ids=["2d", "2d-ceil", "1d"])
def test_max_pool_stride_one(shape, attrs, opset, rng):
    check_pool("MaxPool", distinct(rng, *shape), attrs, opset)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("storage_order", [0, 1])
def test_max_pool_with_indices_output(storage_order, opset, rng):
    x = distinct(rng, *X2)
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "storage_order": storage_order}
    from onnx import reference

    model = single_node("MaxPool", x, attrs, opset, ("y", "i"))
    ref, ort_out = reference.ReferenceEvaluator(model).run(None, {}), ort_run(model, {})
    np.testing.assert_allclose(ref[0], ort_out["y"])
    np.testing.assert_array_equal(ref[1], ort_out["i"])
    check_op("MaxPool", [("x", x)], attrs, opset=opset, num_outputs=2)


@pytest.mark.parametrize("opset", [13, 18])
def test_max_pool_dynamic(opset, rng):
    check_op("MaxPool", [("x", distinct(rng, *X2))],
             {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1}, opset=opset,
             weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("opset", [13, 18])
def test_max_pool_dynamic_same(opset, rng):
    check_op("MaxPool", [("x", distinct(rng, *X2))], {"kernel_shape": [3, 3], "strides": [2, 2],
                                                      "auto_pad": "SAME_UPPER"},
             opset=opset, weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("attrs", [{"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                                   {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 0, 0, 0]}],
                         ids=["overlapping", "tiles"])
def test_max_pool_ties_go_to_the_first_maximum(attrs, opset):
    # After a Relu most windows are all zeros: each window's dy goes to its first maximum
    # (row-major), the element its Indices output names, and overlapping windows add up.
    x = np.maximum(np.random.default_rng(3).standard_normal((1, 2, 5, 6)), 0).astype(f32)
    x[0, 0, 1:3, 1:3] = 1.5
    indices = ort_run(single_node("MaxPool", x, attrs, 18, ("y", "i")), {})["i"]

    model, weights, _ = make_op_model("MaxPool", [("x", x)], attrs, opset=opset)
    built = GradientGraphBuilder(model, weights, ["loss", "y0_proj"], "loss").build().model_proto
    from onnx.reference import ReferenceEvaluator

    for got in (ReferenceEvaluator(built).run(None, {}), list(ort_run(built, {}).values())):
        _, proj, gx = got
        expected = np.zeros(x.size, f32)
        np.add.at(expected, indices.reshape(-1), proj.reshape(-1))
        np.testing.assert_allclose(gx.reshape(-1), expected, rtol=1e-6)


# the attribute forms of onnx's backend cases test_maxpool_{1d,2d,3d}_default, _2d_same_upper,
# _2d_same_lower, _2d_pads, _3d_dilations (whose own data has ties), and a few more
SPEC_MAXPOOL = [
    ("1d-default", (1, 3, 8), {"kernel_shape": [2]}),
    ("2d-default", (1, 3, 5, 6), {"kernel_shape": [2, 2]}),
    ("3d-default", (1, 2, 4, 3, 4), {"kernel_shape": [2, 2, 2]}),
    ("2d-same-upper", (1, 3, 5, 6), {"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER"}),
    ("2d-same-lower", (1, 3, 5, 6), {"kernel_shape": [2, 2], "auto_pad": "SAME_LOWER"}),
    ("2d-pads", (1, 3, 5, 6), {"kernel_shape": [3, 3], "pads": [2, 2, 2, 2]}),
    ("3d-dilations", (1, 1, 4, 4, 4), {"kernel_shape": [2, 2, 2], "strides": [1, 1, 1], "dilations": [2, 2, 2]}),
    ("2d-storage-order", (2, 2, 5, 6), {"kernel_shape": [3, 2], "pads": [1, 0, 1, 1], "storage_order": 1}),
    ("2d-ceil-overhang", (2, 2, 7, 7), {"kernel_shape": [3, 3], "strides": [3, 3], "ceil_mode": 1}),
]


@pytest.mark.parametrize("opset", [13, 22])
@pytest.mark.parametrize("case", SPEC_MAXPOOL, ids=[c[0] for c in SPEC_MAXPOOL])
def test_max_pool_spec_reference(case, opset, rng):
    _, shape, attrs = case
    x = distinct(rng, *shape)
    model = single_node("MaxPool", x, attrs, opset, ("y", "i"))
    ref = max_pool_reference(x, **attrs)
    got = ort_run(model, {})
    np.testing.assert_array_equal(ref[0], got["y"])
    np.testing.assert_array_equal(ref[1], got["i"])
    check_op("MaxPool", [("x", x)], attrs, opset=opset)


# ----------------------------------------------------------------------------- AveragePool

AVGPOOL = [
    ("k3s2", X2, {"kernel_shape": [3, 3], "strides": [2, 2]}),
    ("k3s2p1", X2, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("k2s1p-asym", X2, {"kernel_shape": [2, 2], "pads": [1, 0, 0, 1]}),
    ("k2s2-ceil", X2, {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    ("k3s2-ceil-pads", X2, {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 1, 0, 0], "ceil_mode": 1}),
    ("same-upper", X2, {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ("same-lower", X2, {"kernel_shape": [2, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ("valid", X2, {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "VALID"}),
    ("1d", (2, 4, 7), {"kernel_shape": [3], "strides": [2], "pads": [1, 1], "ceil_mode": 1}),
    ("3d", (1, 2, 4, 5, 3), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 1], "pads": [0, 1, 0, 0, 0, 1]}),
    # windows that do not overlap and cover x (opset 16+: MaxUnpool instead of a scatter-add)
    ("k2s2-tiles", (2, 3, 6, 4), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ("k2s2-tiles-pads", (2, 3, 6, 4), {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("k2s3-gaps", (2, 3, 8, 5), {"kernel_shape": [2, 2], "strides": [3, 3]}),
    ("1d-tiles", (2, 4, 6), {"kernel_shape": [3], "strides": [3]}),
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("case", AVGPOOL, ids=[c[0] for c in AVGPOOL])
def test_average_pool(case, count_include_pad, opset, rng):
    _, shape, attrs = case
    check_pool("AveragePool", distinct(rng, *shape), {**attrs, "count_include_pad": count_include_pad}, opset)


AVGPOOL_19 = [
    ("dilations", X2, {"kernel_shape": [2, 3], "strides": [1, 2], "dilations": [2, 1], "pads": [1, 0, 0, 1]}),
    ("dilations-ceil", X2, {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 2], "ceil_mode": 1,
                            "pads": [0, 1, 0, 0]}),
    ("1d-dilations", (2, 4, 7), {"kernel_shape": [2], "strides": [2], "dilations": [3], "pads": [1, 1]}),
]


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("case", AVGPOOL_19, ids=[c[0] for c in AVGPOOL_19])
def test_average_pool_dilations_opset19(case, count_include_pad, rng):
    _, shape, attrs = case
    check_pool("AveragePool", distinct(rng, *shape), {**attrs, "count_include_pad": count_include_pad}, 19)


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1},
    {"kernel_shape": [2, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER"},
], ids=["pads-ceil", "same-lower"])
def test_average_pool_dynamic(attrs, count_include_pad, rng):
    check_op("AveragePool", [("x", distinct(rng, *X2))], {**attrs, "count_include_pad": count_include_pad},
             opset=18, weights_as="inputs", dims="dynamic")


FAST_REFERENCE = [
    ("AveragePool", 19, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 2], "count_include_pad": 0}),
    ("AveragePool", 19, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 2], "count_include_pad": 1}),
    ("AveragePool", 19, {"kernel_shape": [2, 3], "strides": [2, 1], "dilations": [2, 1], "pads": [1, 1, 1, 1]}),
    ("AveragePool", 19, {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1, "count_include_pad": 1,
                         "pads": [1, 1, 1, 1]}),
    ("AveragePool", 19, {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER", "count_include_pad": 0}),
    ("AveragePool", 19, {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_LOWER", "count_include_pad": 1}),
    ("AveragePool", 19, {"kernel_shape": [2, 2, 2]}),
    ("AveragePool", 19, {"kernel_shape": [2, 2, 2], "strides": [1, 2, 1], "dilations": [2, 1, 2], "ceil_mode": 1,
                         "count_include_pad": 1, "pads": [1, 0, 1, 0, 1, 1]}),
    ("AveragePool", 7, {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ("LpPool", 18, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 2], "p": 2}),
    ("LpPool", 18, {"kernel_shape": [2, 3], "dilations": [2, 1], "p": 3}),
    ("LpPool", 18, {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER", "p": 1}),
    ("LpPool", 18, {"kernel_shape": [2, 2, 2], "strides": [2, 1, 2], "p": 2}),
]


@pytest.mark.parametrize("op,opset,attrs", FAST_REFERENCE,
                         ids=[f"{o}-{v}-{i}" for i, (o, v, _) in enumerate(FAST_REFERENCE)])
def test_the_fast_pool_references_compute_what_onnxruntime_does(op, opset, attrs, rng):
    """The reference fixes' AveragePool and LpPool (one pass over the windows, where onnx's loop
    over them in Python) against onnxruntime's forward, and against onnx's own stock kernels."""
    from onnx.reference import ReferenceEvaluator

    from gradbuilder.testing import reference_evaluator

    shape = (2, 3, 5, 6, 4) if len(attrs["kernel_shape"]) == 3 else (2, 3, 7, 8)
    x = signed(rng, *shape)
    model = single_node(op, x, attrs, opset)
    fast = reference_evaluator(model).run(None, {})[0]
    np.testing.assert_allclose(fast, ort_run(model, {})["y"], rtol=1e-5, atol=1e-5)
    model64 = single_node(op, x.astype(np.float64), attrs, opset)  # float64: the same sums in any order
    np.testing.assert_allclose(reference_evaluator(model64).run(None, {})[0],
                               ReferenceEvaluator(model64).run(None, {})[0], rtol=1e-12, atol=1e-12)


def test_the_fast_pool_references_agree_with_the_stock_ones_on_onnx_backend_cases(rng):
    """The attributes of every AveragePool and LpPool case of ONNX's backend tests, in float64,
    on an input two strides wider than the window (the stock kernel takes seconds on the cases'
    own 32x32x32 inputs): the fixes' kernels give what onnx's stock kernels give (op coverage
    computes its finite differences with them)."""
    import warnings

    from onnx.backend.test.case.node import collect_testcases
    from onnx.reference import ReferenceEvaluator

    from gradbuilder.testing import reference_evaluator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = [c for c in collect_testcases() if c.model is not None
                 and [n.op_type for n in c.model.graph.node] in (["AveragePool"], ["LpPool"])]
    assert len(cases) >= 28, [c.name for c in cases]
    for case in cases:
        node = case.model.graph.node[0]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        kernel = attrs["kernel_shape"]
        r = len(kernel)
        dilations, strides = attrs.get("dilations", [1] * r), attrs.get("strides", [1] * r)
        pads = attrs.get("pads", [0] * 2 * r)
        # windows that tile the padded input exactly: ceil_mode adds no window (the stock kernel
        # places a window that overhangs the end by 2 or more wrongly: see "where the reference is wrong")
        sizes = [max((k - 1) * d + 1 + 2 * st - pads[i] - pads[r + i], 1 + st)
                 for i, (k, d, st) in enumerate(zip(kernel, dilations, strides))]
        x = rng.standard_normal((1, 2, *sizes))
        opset = next(o.version for o in case.model.opset_import if o.domain in ("", "ai.onnx"))
        model = single_node(node.op_type, x, attrs, opset)
        stock = ReferenceEvaluator(model).run(None, {})[0]
        fast = reference_evaluator(model).run(None, {})[0]
        assert fast.shape == stock.shape, case.name
        np.testing.assert_allclose(fast, stock, rtol=1e-12, atol=1e-12, err_msg=case.name)


# ----------------------------------------------------------------------------- global pools


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("shape", [(2, 4, 7), X2, (1, 2, 3, 4, 2)], ids=["1d", "2d", "3d"])
def test_global_average_pool(shape, opset, rng):
    check_pool("GlobalAveragePool", distinct(rng, *shape), {}, opset)


def test_global_average_pool_dynamic(rng):
    check_op("GlobalAveragePool", [("x", distinct(rng, *X2))], weights_as="inputs", dims="dynamic")


@pytest.fixture
def fixed_global_max_pool(monkeypatch):
    """onnx's reference GlobalMaxPool reduces the wrong axes unless there are two spatial axes."""
    from onnx.reference.op_run import OpRun

    class GlobalMaxPool(OpRun):  # new_ops are matched by class name
        op_domain = ""

        def _run(self, x):
            return (x.max(axis=tuple(range(2, x.ndim)), keepdims=True),)

    patch_reference_evaluator(monkeypatch, GlobalMaxPool)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("shape", [(2, 4, 7), X2, (1, 2, 3, 4, 2)], ids=["1d", "2d", "3d"])
def test_global_max_pool(shape, opset, rng, fixed_global_max_pool):
    check_pool("GlobalMaxPool", distinct(rng, *shape), {}, opset)


def test_global_max_pool_dynamic(rng):
    check_op("GlobalMaxPool", [("x", distinct(rng, *X2))], weights_as="inputs", dims="dynamic")


def test_global_max_pool_ties_shared():
    x = np.array([[[[1.0, 3.0], [3.0, 2.0]]]], dtype=f32)
    model, weights, _ = make_op_model("GlobalMaxPool", [("x", x)])
    built = GradientGraphBuilder(model, weights, ["loss", "y0_proj"], "loss").build().model_proto
    from onnx.reference import ReferenceEvaluator

    _, proj, gx = ReferenceEvaluator(built).run(None, {})
    p = proj.reshape(-1)[0]
    np.testing.assert_allclose(gx, [[[[0.0, p / 2], [p / 2, 0.0]]]], rtol=1e-6)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("op,attrs", [
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
], ids=["MaxPool", "AveragePool"])
def test_float16(op, attrs, opset, rng):
    # float16 on onnxruntime (MaxPool's scatter-add accumulates in float32 there)
    x = distinct(rng, *X2).astype(np.float16)
    check_op(op, [("x", x)], attrs, opset=opset, ort_rtol=1e-2, ort_atol=1e-2)


# ----------------------------------------------------------------------------- where the reference is wrong


def ort_gradcheck(op, x, attrs, opset, seed=0, t=0.1, directions=4):
    """Directional finite differences of the loss on onnxruntime itself (float32): for the
    configurations where onnx's reference computes a different forward than onnxruntime and the
    ONNX spec (ceil_mode windows overhanging by 2+, MaxPool SAME_LOWER, SAME with dilations).
    Pooling is piecewise linear and the inputs are well separated, so small steps are exact up
    to float32 rounding."""
    rng = np.random.default_rng(seed)
    y = ort_run(single_node(op, x, attrs, opset), {})["y"]
    proj = rng.standard_normal(y.shape).astype(f32)
    nodes = [helper.make_node(op, ["x"], ["y"], **attrs), helper.make_node("Mul", ["y", "proj"], ["m"]),
             helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])],
                              [onnx.numpy_helper.from_array(proj, "proj")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    built = GradientGraphBuilder(model, ["x"], ["loss"], "loss").build().model_proto
    grad = ort_run(built, {"x": x})["x_grad"].astype(np.float64)

    def loss(v):
        return float(ort_run(model, {"x": v.astype(f32)})["loss"])

    for _ in range(directions):
        d = rng.uniform(-1, 1, x.shape)
        num = (loss(x + t * d) - loss(x - t * d)) / (2 * t)
        assert abs(num - np.sum(grad * d)) <= 2e-3 * max(1.0, abs(num)), (op, attrs, num, np.sum(grad * d))
    return grad


ORT_ONLY = [
    ("AveragePool", 18, {"kernel_shape": [3, 3], "strides": [3, 3], "ceil_mode": 1, "count_include_pad": 0}),
    ("AveragePool", 18, {"kernel_shape": [3, 3], "strides": [3, 3], "ceil_mode": 1, "count_include_pad": 1,
                         "pads": [1, 0, 0, 0]}),
    ("MaxPool", 13, {"kernel_shape": [3, 3], "strides": [3, 3], "ceil_mode": 1}),
    ("MaxPool", 18, {"kernel_shape": [3, 3], "strides": [3, 3], "ceil_mode": 1}),
    ("MaxPool", 13, {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ("MaxPool", 18, {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ("MaxPool", 13, {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),  # stride 1 with padding
    # all strides 1: the reference's Indices are off by one there (onnxruntime's are right)
    ("MaxPool", 18, {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    ("MaxPool", 18, {"kernel_shape": [2, 3]}),
    ("AveragePool", 19, {"kernel_shape": [2, 2], "strides": [1, 2], "dilations": [2, 3], "auto_pad": "VALID"}),
    ("MaxPool", 13, {"kernel_shape": [2, 2], "strides": [1, 2], "dilations": [2, 3], "auto_pad": "VALID"}),
]


@pytest.mark.parametrize("op,opset,attrs", ORT_ONLY, ids=[f"{o}-{v}-{i}" for i, (o, v, _) in enumerate(ORT_ONLY)])
def test_against_onnxruntime_forward(op, opset, attrs, rng):
    ort_gradcheck(op, distinct(rng, 2, 3, 7, 7), attrs, opset)


@pytest.mark.parametrize("op,opset", [("MaxPool", 13), ("AveragePool", 19)])
def test_same_with_dilations_is_refused(op, opset, rng):
    # the spec says out = ceil(in / stride); onnxruntime and the reference each compute another.
    # (MaxPool at opset 16+ re-runs the node for Indices, which follows whatever the runtime does.)
    from gradbuilder.errors import GradientRuleError

    attrs = {"kernel_shape": [2, 2], "strides": [2, 1], "dilations": [2, 2], "auto_pad": "SAME_UPPER"}
    x = distinct(rng, *X2)
    model, weights, _ = make_op_model(op, [("x", x)], attrs, opset=opset, weights_as="inputs", dims="dynamic")
    with pytest.raises(GradientRuleError, match="dilations"):
        GradientGraphBuilder(model, weights, ["loss"], "loss").build()


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("op,attrs", [
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}),
    ("AveragePool", {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 1, 0, 0], "ceil_mode": 1}),
    ("GlobalMaxPool", {}),
], ids=["MaxPool", "AveragePool", "GlobalMaxPool"])
def test_symbolic_batch(op, attrs, opset, rng):
    from gradbuilder.testing import gradcheck

    model, weights, feeds = make_op_model(op, [("x", distinct(rng, *X2))], attrs, opset=opset, weights_as="inputs")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    report = gradcheck(model, weights, "loss", feeds)
    assert report.passed, str(report)
    got = ort_run(GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto, feeds)
    np.testing.assert_allclose(got["x_grad"], report.gradients["x"], rtol=2e-3, atol=2e-3)


# ----------------------------------------------------------------------------- MaxUnpool


def pooled_with_indices(rng, shape, attrs):
    """(values, Indices) of an onnxruntime MaxPool of distinct values: MaxUnpool's usual inputs."""
    got = ort_run(single_node("MaxPool", distinct(rng, *shape), attrs, 18, ("y", "i")), {})
    return got["y"] + rng.uniform(-0.5, 0.5, got["y"].shape).astype(f32), got["i"]


def unpool_attrs(attrs):
    return {k: v for k, v in attrs.items() if k in ("kernel_shape", "strides", "pads")}


# (id, MaxPool input shape, attributes): kernels wider than their strides give repeated
# indices, where the last value written wins
MAXUNPOOL = [
    ("2d-k2s2", (2, 3, 4, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ("2d-overlap", (2, 3, 5, 5), {"kernel_shape": [3, 3], "strides": [1, 2]}),
    ("2d-pads", (1, 2, 5, 5), {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1]}),
    ("1d-overlap", (2, 2, 9), {"kernel_shape": [3], "strides": [1]}),
    ("3d", (1, 2, 4, 4, 6), {"kernel_shape": [2, 2, 3], "strides": [2, 2, 3]}),
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("case", MAXUNPOOL, ids=[c[0] for c in MAXUNPOOL])
def test_max_unpool(case, opset, rng):
    _, shape, attrs = case
    x, idx = pooled_with_indices(rng, shape, attrs)
    inputs = [("x", x), ("i", idx)]
    from onnx import reference

    model = single_node("MaxUnpool", x, unpool_attrs(attrs), opset)
    model.graph.node[0].input.append("i")
    model.graph.initializer.append(onnx.numpy_helper.from_array(idx, "i"))
    np.testing.assert_array_equal(reference.ReferenceEvaluator(model).run(None, {})[0], ort_run(model, {})["y"])
    check_op("MaxUnpool", inputs, unpool_attrs(attrs), opset=opset)


def test_max_unpool_repeated_indices_go_to_the_last_writer(rng):
    # an explicit pattern: x[0] and x[2] both write position 1; x[2] (written last) shows in y
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]], f32)
    idx = np.array([[[1, 3, 1, 4]]])
    model, weights, _ = make_op_model("MaxUnpool", [("x", x), ("i", idx)], {"kernel_shape": [2], "strides": [1]},
                                      opset=18)
    built = GradientGraphBuilder(model, weights, ["loss", "y0_proj"], "loss").build().model_proto
    _, proj, gx = ort_run(built, {}).values()
    np.testing.assert_allclose(gx.reshape(-1), [0.0, proj.reshape(-1)[3], proj.reshape(-1)[1], proj.reshape(-1)[4]])
    check_op("MaxUnpool", [("x", x), ("i", idx)], {"kernel_shape": [2], "strides": [1]}, opset=13)


@pytest.mark.parametrize("opset", [13, 18])
def test_max_unpool_output_shape(opset, rng):
    # output_shape larger than the default shape: as onnx's reference and backend test data, the
    # indices address the default shape and the rest is zero padding (onnxruntime instead indexes
    # the output_shape tensor, a different forward; the gradient follows the spec)
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    x, idx = pooled_with_indices(rng, (2, 3, 4, 6), attrs)
    check_op("MaxUnpool", [("x", x), ("i", idx), ("shape", np.array([2, 3, 5, 7]))], attrs, opset=opset)
    # equal to the default shape: the runtimes agree
    check_op("MaxUnpool", [("x", x), ("i", idx), ("shape", np.array([2, 3, 4, 6]))], attrs, opset=opset)


@pytest.mark.parametrize("opset", [13, 18])
def test_max_unpool_dynamic(opset, rng):
    attrs = {"kernel_shape": [3, 3], "strides": [1, 2], "pads": [1, 1, 0, 0]}
    x, idx = pooled_with_indices(rng, (2, 2, 5, 6), attrs)
    check_op("MaxUnpool", [("x", x), ("i", idx)], unpool_attrs(attrs), opset=opset, weights_as="inputs",
             dims="dynamic")
    check_graph_ints("MaxUnpool", [("x", x), ("i", idx), ("shape", np.array([2, 2, 6, 7]))], unpool_attrs(attrs),
                     graph_ints=["i", "shape"], opset=opset, weights_as="inputs", dims="dynamic")


# ----------------------------------------------------------------------------- LpPool, GlobalLpPool helpers

f64 = np.float64

# each op at opsets 13 and 18, one in float32 (also run on onnxruntime), one in float64; the Lp
# pools' forward onnxruntime's CPU provider runs in float32 only: their float64 cases are
# gradchecked on the reference evaluator alone
LP_FORMS = [(13, f32), (18, f64)]
LP_FORM_IDS = ["13-f32", "18-f64"]


def lp_on_ort(op, dtype):
    return dtype != f64


@pytest.fixture
def fixed_global_lp_pool(monkeypatch):
    """onnx's reference evaluator has no GlobalLpPool; this one is checked against onnxruntime's
    forward in the tests."""
    from onnx.reference.op_run import OpRun

    class GlobalLpPool(OpRun):  # new_ops are matched by class name
        op_domain = ""

        def _run(self, x, p=None):
            axes = tuple(range(2, x.ndim))
            return (np.power(np.power(np.abs(x), p).sum(axis=axes, keepdims=True), 1.0 / p).astype(x.dtype),)

    patch_reference_evaluator(monkeypatch, GlobalLpPool)


# ----------------------------------------------------------------------------- GlobalLpPool

SPATIAL = [(2, 3, 5), (2, 3, 3, 4), (1, 2, 2, 3, 2)]


@pytest.mark.parametrize("opset,dtype", LP_FORMS, ids=LP_FORM_IDS)
@pytest.mark.parametrize("p", [None, 1, 3])
@pytest.mark.parametrize("shape", SPATIAL, ids=["1d", "2d", "3d"])
@pytest.mark.usefixtures("fixed_global_lp_pool")
def test_global_lp_pool(shape, p, opset, dtype, rng):
    attrs = {} if p is None else {"p": p}
    x = signed(rng, *shape, dtype=dtype)
    assert_forward_agrees("GlobalLpPool", x.astype(f32), attrs, opset)
    check_op("GlobalLpPool", [("x", x)], attrs, opset=opset, ort=lp_on_ort("GlobalLpPool", dtype))


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.usefixtures("fixed_global_lp_pool")
def test_global_lp_pool_dynamic(p, rng):
    check_op("GlobalLpPool", [("x", signed(rng, 2, 3, 3, 4))], {"p": p}, weights_as="inputs", dims="dynamic")


# ----------------------------------------------------------------------------- LpPool

LP_X2 = (1, 2, 5, 6)
# p: 2 (the default, absent), 1 or 3, spread over the window configurations
LPPOOL = [
    ("k2", LP_X2, {"kernel_shape": [2, 2]}),
    ("k3s2p1-p1", LP_X2, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "p": 1}),
    ("k3s2p1-p3", LP_X2, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "p": 3}),
    ("k2s1p-asym-p3", LP_X2, {"kernel_shape": [2, 3], "pads": [1, 0, 0, 1], "p": 3}),
    ("same-upper", LP_X2, {"kernel_shape": [2, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ("same-lower-p1", LP_X2, {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_LOWER", "p": 1}),
    ("valid-p3", LP_X2, {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "VALID", "p": 3}),
    ("1d", (2, 3, 7), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    ("1d-p1", (2, 3, 7), {"kernel_shape": [2], "strides": [1], "pads": [0, 1], "p": 1}),
    ("3d-p3", (1, 2, 4, 3, 3), {"kernel_shape": [2, 2, 2], "strides": [2, 1, 1], "pads": [0, 1, 0, 0, 0, 1], "p": 3}),
]


@pytest.mark.parametrize("opset,dtype", LP_FORMS, ids=LP_FORM_IDS)
@pytest.mark.parametrize("case", LPPOOL, ids=[c[0] for c in LPPOOL])
@pytest.mark.usefixtures("fixed_global_lp_pool")
def test_lp_pool(case, opset, dtype, rng):
    _, shape, attrs = case
    x = signed(rng, *shape, dtype=dtype)
    assert_forward_agrees("LpPool", x.astype(f32), attrs, opset)
    check_op("LpPool", [("x", x)], attrs, opset=opset, ort=lp_on_ort("LpPool", dtype))


LPPOOL_18 = [
    ("dilations", LP_X2, {"kernel_shape": [2, 2], "dilations": [2, 2]}),
    ("dilations-strides-pads", LP_X2, {"kernel_shape": [2, 3], "strides": [1, 2], "dilations": [2, 1],
                                    "pads": [1, 0, 0, 1]}),
]


@pytest.mark.parametrize("p,dtype", [(2, f32), (3, f64)], ids=["p2-f32", "p3-f64"])
@pytest.mark.parametrize("case", LPPOOL_18, ids=[c[0] for c in LPPOOL_18])
@pytest.mark.usefixtures("fixed_global_lp_pool")
def test_lp_pool_dilations(case, p, dtype, rng):
    _, shape, attrs = case
    x = signed(rng, *shape, dtype=dtype)
    assert_forward_agrees("LpPool", x.astype(f32), {**attrs, "p": p}, 18)
    check_op("LpPool", [("x", x)], {**attrs, "p": p}, opset=18, ort=lp_on_ort("LpPool", dtype))


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1},
    {"kernel_shape": [3, 3], "strides": [3, 3], "ceil_mode": 1},
], ids=["k2s2", "k3s2-pads", "overhang-2"])
@pytest.mark.usefixtures("fixed_global_lp_pool")
def test_lp_pool_ceil_mode(attrs, p, rng):
    # onnx's reference divides the ceil_mode overhang windows wrongly (it scales an average);
    # finite differences on onnxruntime instead
    ort_directional_check("LpPool", [("x", signed(rng, 2, 3, 7, 7))], {**attrs, "p": p}, 18)


@pytest.mark.parametrize("attrs,p", [
    ({"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 0, 1]}, 2),
    ({"kernel_shape": [2, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER"}, 3),
], ids=["pads-p2", "same-lower-p3"])
@pytest.mark.usefixtures("fixed_global_lp_pool")
def test_lp_pool_dynamic(attrs, p, rng):
    check_op("LpPool", [("x", signed(rng, *LP_X2))], {**attrs, "p": p}, opset=18, weights_as="inputs", dims="dynamic")


@pytest.mark.usefixtures("fixed_global_lp_pool")
def test_lp_pool_dynamic_ceil_mode(rng):
    ort_directional_check("LpPool", [("x", signed(rng, 2, 3, 7, 7))],
                  {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1, "p": 1}, 18,
                  dims="dynamic")


@pytest.mark.usefixtures("fixed_global_lp_pool")
def test_lp_pool_zero_window_has_zero_gradient(rng):
    from onnx.reference import ReferenceEvaluator

    x = signed(rng, 1, 1, 4, 4)
    x[0, 0, :2, :2] = 0  # the first 2x2 window is all zeros: y = 0 there
    model, weights, _ = make_op_model("LpPool", [("x", x)], {"kernel_shape": [2, 2], "strides": [2, 2]})
    built = GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto
    for got in (ReferenceEvaluator(built).run(None, {})[1], ort_run(built, {})["x_grad"]):
        assert np.all(np.isfinite(got)) and np.all(got[0, 0, :2, :2] == 0)
