import numpy as np
import onnx
import pytest
from onnx import helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import check_op, make_op_model, ort_run, patch_reference_evaluator, reference_fix

from .harness import ort_directional_check, signed

f32, f64 = np.float32, np.float64

# each op at opsets 13 and 18, one in float32 (also run on onnxruntime), one in float64
FORMS = [(13, f32), (18, f64)]
FORM_IDS = ["13-f32", "18-f64"]

# ops whose forward onnxruntime's CPU provider runs in float32 only: their float64 cases are
# gradchecked on the reference evaluator alone
NO_ORT_F64 = {"LRN"}


def on_ort(op, dtype):
    return not (dtype == f64 and op in NO_ORT_F64)


def arr(rng, *shape, lo=-1.0, hi=1.0, dtype=f32):
    return rng.uniform(lo, hi, shape).astype(dtype)


def single_node(op, x, attrs, opset):
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    graph = helper.make_graph([node], "g", [], [helper.make_empty_tensor_value_info("y")],
                              [onnx.numpy_helper.from_array(x, "x")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def assert_forward_agrees(op, x, attrs, opset):
    """onnx's reference (with the fixes below) and onnxruntime compute the same forward."""
    from onnx import reference  # looked up at call time: the fixture patches it

    model = single_node(op, x.astype(f32), attrs, opset)
    ref = reference.ReferenceEvaluator(model).run(None, {})[0]
    got = ort_run(model, {})["y"]
    assert ref.shape == got.shape and np.allclose(ref, got, rtol=1e-4, atol=1e-5), (op, attrs)


# ----------------------------------------------------------------------------- reference fixes


@pytest.fixture(autouse=True)
def fixed_reference(monkeypatch):
    """onnx's reference evaluator is wrong for two ops here:
    LRN sums the channel window for c < N (the batch size) only; LpNormalization takes sum(x^p)
    without |x| (wrong for p = 1 with negatives). Each replacement is checked against
    onnxruntime's forward in the tests. (GlobalLpPool's, which the reference lacks, is in
    test_pooling.py.)"""
    from onnx.reference.op_run import OpRun

    class LRN(OpRun):  # new_ops are matched by class name
        op_domain = ""

        def _run(self, x, alpha=None, beta=None, bias=None, size=None):
            lo, hi, c = (size - 1) // 2, size // 2, x.shape[1]
            sq = x * x
            square_sum = np.stack([sq[:, max(0, k - lo):min(c, k + hi + 1)].sum(axis=1) for k in range(c)], axis=1)
            return ((x / (bias + alpha / size * square_sum) ** beta).astype(x.dtype),)

    # LpNormalization: gradbuilder.testing's fix (|x|**p), here for the stock evaluator too
    patch_reference_evaluator(monkeypatch, LRN, reference_fix("LpNormalization"))


# ----------------------------------------------------------------------------- LpNormalization

LPNORM = [({}, (3, 4)), ({"p": 1}, (3, 4)), ({"axis": 0}, (3, 4)), ({"p": 1, "axis": 1}, (2, 3, 4)),
          ({"p": 2, "axis": -2}, (2, 3, 4))]


@pytest.mark.parametrize("opset,dtype", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("attrs,shape", LPNORM, ids=[str(a) for a, _ in LPNORM])
def test_lp_normalization(attrs, shape, opset, dtype, rng):
    x = signed(rng, *shape, lo=0.2, hi=1.5, dtype=dtype)
    assert_forward_agrees("LpNormalization", x, attrs, opset)
    check_op("LpNormalization", [("x", x)], attrs, opset=opset, ort=on_ort("LpNormalization", dtype))


@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization_dynamic(p, rng):
    check_op("LpNormalization", [("x", signed(rng, 2, 3, 4, lo=0.2, hi=1.5))], {"p": p, "axis": 1},
             weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization_zero_slice(p, rng):
    # an all-zero row normalizes to zeros; its gradient is 0 (not NaN), the other rows' are exact
    from onnx.reference import ReferenceEvaluator

    x = signed(rng, 3, 4, lo=0.2, hi=1.5)
    x[1] = 0
    model, weights, _ = make_op_model("LpNormalization", [("x", x)], {"p": p})
    built = GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto
    for got in (ReferenceEvaluator(built).run(None, {})[1], ort_run(built, {})["x_grad"]):
        assert np.all(got[1] == 0) and np.all(np.isfinite(got))
    rows = np.delete(x, 1, axis=0)
    check_op("LpNormalization", [("x", rows)], {"p": p})


@pytest.mark.parametrize("axis", [0, -1])
def test_lp_normalization_p1_zero_element(axis, rng):
    # |x| has a kink at 0 (onnx's backend case test_l1normalization_axis_last has zeros): there the
    # gradient takes sign(0) = 0, the mean of the two one-sided derivatives, which central
    # differences reproduce; p = 2 is smooth at a zero element of a nonzero slice
    x = signed(rng, 3, 4, lo=0.2, hi=1.5)
    x[0, 1] = x[2, 3] = 0
    for p in (1, 2):
        check_op("LpNormalization", [("x", x)], {"p": p, "axis": axis}, opset=18)


# ----------------------------------------------------------------------------- MeanVarianceNormalization

MVN_AXES = [[0, 2, 3], [1], [2, 3], [0, 1, 2, 3], [-1]]  # the default [0, 2, 3] spelled out: see below


# float32 only: the function body's epsilon is a float32 constant, so a float64 (or float16)
# MeanVarianceNormalization does not type-check; checked on onnxruntime (own kernel) instead


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("axes", MVN_AXES, ids=[str(a) for a in MVN_AXES])
def test_mean_variance_normalization(axes, opset, rng):
    attrs = {} if axes is None else {"axes": axes}
    x = arr(rng, 2, 3, 3, 4, lo=-2, hi=2)
    assert_forward_agrees("MeanVarianceNormalization", x, attrs, opset)
    ort_directional_check("MeanVarianceNormalization", [("x", x)], attrs, opset)


@pytest.mark.parametrize("opset", [13, 18])
def test_mean_variance_normalization_dynamic(opset, rng):
    ort_directional_check("MeanVarianceNormalization", [("x", arr(rng, 2, 3, 3, 4, lo=-2, hi=2))], {"axes": [0, 2]},
                          opset, dims="dynamic")


def test_mean_variance_normalization_reference_graph(rng):
    # the float32 gradient graph on onnx's reference evaluator agrees with onnxruntime
    from onnx.reference import ReferenceEvaluator

    x = arr(rng, 2, 3, 3, 4, lo=-2, hi=2)
    model, weights, _ = make_op_model("MeanVarianceNormalization", [("x", x)], {"axes": [1, 3]})
    built = GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto
    np.testing.assert_allclose(ReferenceEvaluator(built).run(None, {})[1], ort_run(built, {})["x_grad"],
                               rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- LRN

LRN = [{"size": 3}, {"size": 1}, {"size": 2, "alpha": 0.3, "beta": 0.5, "bias": 2.0},
       {"size": 5, "alpha": 0.5, "beta": 1.2, "bias": 0.7}, {"size": 4, "alpha": 1.0}]


@pytest.mark.parametrize("opset,dtype", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("attrs", LRN, ids=[str(a) for a in LRN])
def test_lrn(attrs, opset, dtype, rng):
    # onnxruntime takes odd sizes only: even ones are checked on the (fixed) reference alone
    x = arr(rng, 2, 5, 3, 2, lo=-2, hi=2, dtype=dtype)
    odd = attrs["size"] % 2 == 1
    if odd:
        assert_forward_agrees("LRN", x, attrs, opset)
    check_op("LRN", [("x", x)], attrs, opset=opset, ort=odd and on_ort("LRN", dtype))


def test_lrn_dynamic(rng):
    check_op("LRN", [("x", arr(rng, 2, 4, 3, 3, lo=-2, hi=2))], {"size": 3, "alpha": 0.5, "beta": 0.9},
             weights_as="inputs", dims="dynamic")


def test_lrn_3d_input(rng):
    # (N, C, L): the rule is rank-generic (onnxruntime takes 4-D only, so the reference checks it)
    check_op("LRN", [("x", arr(rng, 2, 5, 3, lo=-2, hi=2, dtype=f64))], {"size": 3, "alpha": 0.5}, ort=False)


# ----------------------------------------------------------------------------- RMSNormalization

RMS = [((2, 3, 4), {}, (4,)), ((2, 3, 4), {"axis": -2}, (3, 4)), ((2, 3, 4), {"axis": 1}, (1, 4)),
       ((2, 3, 4), {"axis": 0, "epsilon": 0.1}, (2, 3, 4)), ((3, 5), {"epsilon": 1e-3}, (1,)),
       ((2, 3, 4), {"axis": -1}, (3, 1))]


@pytest.mark.parametrize("dtype", [f32, f64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape,attrs,scale_shape", RMS, ids=[f"{a}-{s}" for _, a, s in RMS])
def test_rms_normalization(shape, attrs, scale_shape, dtype, rng):
    check_op("RMSNormalization", [("x", arr(rng, *shape, dtype=dtype)), ("scale", arr(rng, *scale_shape, dtype=dtype))],
             attrs, opset=23)


@pytest.mark.parametrize("dims", ["symbolic", "dynamic"])
@pytest.mark.parametrize("axis", [-2, 1])
def test_rms_normalization_unknown_shapes(axis, dims, rng):
    check_op("RMSNormalization", [("x", arr(rng, 2, 3, 4)), ("scale", arr(rng, 3, 4))], {"axis": axis},
             opset=23, weights_as="inputs", dims=dims)


@pytest.mark.parametrize("axis", [-2, 1])
def test_rms_normalization_unknown_rank(axis, rng):
    # x reshaped by a shape fed at run time: its rank is unknown when the gradient is built, and
    # the normalized axes come from Range(axis, rank) at run time (axis >= 0)
    from gradbuilder.testing import gradcheck

    TP = onnx.TensorProto
    x, scale, proj = arr(rng, 6, 4), arr(rng, 3, 4), arr(rng, 2, 3, 4)
    nodes = [helper.make_node("Reshape", ["x", "s"], ["r"]),
             helper.make_node("RMSNormalization", ["r", "scale"], ["y"], axis=axis),
             helper.make_node("Mul", ["y", "proj"], ["m"]), helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    inputs = [helper.make_tensor_value_info("x", TP.FLOAT, [6, 4]),
              helper.make_tensor_value_info("s", TP.INT64, [None])]
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("loss", TP.FLOAT, [])],
        [onnx.numpy_helper.from_array(scale, "scale"), onnx.numpy_helper.from_array(proj, "proj")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    feeds = {"x": x, "s": np.array([2, 3, 4], np.int64)}
    report = gradcheck(model, ["x", "scale"], "loss", feeds)
    assert report.passed, str(report)
    built = GradientGraphBuilder(model, ["x", "scale"], ["loss"], "loss").build().model_proto
    assert any(n.op_type == "Range" for n in built.graph.node) == (axis >= 0)
    got = ort_run(built, feeds)
    for w in ("x", "scale"):
        np.testing.assert_allclose(got[f"{w}_grad"], report.gradients[w], rtol=2e-3, atol=2e-4)


def test_rms_normalization_float16_stash(rng):
    # statistics in float32 for float16 x (stash_type 1): checked against the float32 gradient
    x, scale = arr(rng, 2, 3, 4), arr(rng, 4)
    m32, w, _ = make_op_model("RMSNormalization", [("x", x), ("scale", scale)], opset=23)
    m16, _, _ = make_op_model("RMSNormalization", [("x", x.astype(np.float16)), ("scale", scale.astype(np.float16))],
                              opset=23)
    g32 = ort_run(GradientGraphBuilder(m32, w, ["loss"], "loss").build().model_proto, {})
    g16 = ort_run(GradientGraphBuilder(m16, w, ["loss"], "loss").build().model_proto, {})
    for name in ("x_grad", "scale_grad"):
        assert g16[name].dtype == np.float16
        np.testing.assert_allclose(g16[name].astype(f32), g32[name], rtol=2e-2, atol=2e-2)
