import numpy as np
import pytest

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import check_op, gradcheck, make_op_model, ort_run, reference_evaluator

from .harness import ort_directional_check


f32, f64 = np.float32, np.float64


def arr(rng, *shape, lo=-1.0, hi=1.0, dtype=f32):
    return rng.uniform(lo, hi, shape).astype(dtype)


def away(rng, *shape, points=(0.0,), gap=0.2, lo=-2.0, hi=2.0, dtype=f32):
    """Uniform values at least ``gap`` away from every kink in ``points``."""
    x = rng.uniform(lo, hi, shape)
    for p in points:
        near = np.abs(x - p) < gap
        x = np.where(near, p + np.where(x >= p, gap, -gap) * 1.5, x)
    return x.astype(dtype)


# ops whose forward onnxruntime's CPU provider runs in float32 only (at these opsets): their
# float64 cases are gradchecked on the reference evaluator alone
NO_ORT_F64 = {"Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Hardmax", "PRelu"}


def on_ort(op, opset, dtype):
    return not (dtype == f64 and op in NO_ORT_F64)


# each op at opsets 13 and 18, one in float32 (also run on onnxruntime), one in float64
FORMS = [(13, f32), (18, f64)]
FORM_IDS = ["13-f32", "18-f64"]

# ----------------------------------------------------------------------------- trigonometric

TRIG = [("Sin", -3, 3), ("Cos", -3, 3), ("Tan", -1.2, 1.2), ("Asin", -0.9, 0.9), ("Acos", -0.9, 0.9),
        ("Atan", -3, 3), ("Sinh", -2, 2), ("Cosh", -2, 2), ("Asinh", -3, 3), ("Acosh", 1.2, 3),
        ("Atanh", -0.9, 0.9)]


@pytest.mark.parametrize("opset,dtype", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("op,lo,hi", TRIG, ids=[t[0] for t in TRIG])
def test_trig(op, lo, hi, opset, dtype, rng):
    check_op(op, [("x", arr(rng, 3, 4, lo=lo, hi=hi, dtype=dtype))], opset=opset, ort=on_ort(op, opset, dtype))


@pytest.mark.parametrize("op,lo,hi", TRIG, ids=[t[0] for t in TRIG])
def test_trig_dynamic(op, lo, hi, rng):
    check_op(op, [("x", arr(rng, 2, 3, 2, lo=lo, hi=hi))], opset=18, weights_as="inputs", dims="dynamic")


def test_trig_float16(rng):
    check_op("Sin", [("x", arr(rng, 3, 4, lo=-2, hi=2, dtype=np.float16))], ort_rtol=1e-2, ort_atol=1e-2)


# ----------------------------------------------------------------------------- activations


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("alpha", [None, 0.5, 2.0])
def test_celu(alpha, opset, rng):
    attrs = {} if alpha is None else {"alpha": alpha}
    # Celu takes float32 only (no float64 model to gradcheck): finite differences on onnxruntime
    ort_directional_check("Celu", [("x", arr(rng, 3, 5, lo=-3, hi=2))], attrs, opset)


def test_celu_dynamic(rng):
    ort_directional_check("Celu", [("x", arr(rng, 2, 3, 4, lo=-3, hi=2))], {"alpha": 0.7}, 18, dims="dynamic")


def test_celu_matches_formula(rng):
    # elementwise: the gradient is proj * celu'(x), celu'(x) = 1 (x > 0), exp(x/alpha) (x <= 0)
    x, alpha = arr(rng, 3, 5, lo=-3, hi=2), 0.7
    model, weights, feeds = make_op_model("Celu", [("x", x)], {"alpha": alpha}, weights_as="inputs")
    built = GradientGraphBuilder(model, weights, ["loss", "y0_proj"], "loss").build().model_proto
    got = ort_run(built, feeds)
    expected = got["y0_proj"] * np.where(x > 0, 1.0, np.exp(x / alpha))
    np.testing.assert_allclose(got["x_grad"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [f32, f64], ids=["f32", "f64"])
def test_mish(dtype, rng):
    check_op("Mish", [("x", arr(rng, 3, 5, lo=-4, hi=4, dtype=dtype))], opset=18)


def test_mish_dynamic(rng):
    check_op("Mish", [("x", arr(rng, 2, 3, 4, lo=-4, hi=4))], opset=18, weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("opset,dtype", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("alpha", [None, 0.3, -0.5])
def test_thresholded_relu(alpha, opset, dtype, rng):
    attrs = {} if alpha is None else {"alpha": alpha}
    x = away(rng, 4, 5, points=[1.0 if alpha is None else alpha], lo=-2, hi=3, dtype=dtype)
    check_op("ThresholdedRelu", [("x", x)], attrs, opset=opset, ort=on_ort("ThresholdedRelu", opset, dtype))


@pytest.mark.parametrize("opset,dtype", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("attrs", [{}, {"bias": 1.5, "lambd": 1.0}, {"bias": -0.3, "lambd": 0.0}],
                         ids=["default", "bias-lambd", "lambd0"])
def test_shrink(attrs, opset, dtype, rng):
    lambd = attrs.get("lambd", 0.5)
    x = away(rng, 4, 5, points=[-lambd, lambd], lo=-3, hi=3, dtype=dtype)
    check_op("Shrink", [("x", x)], attrs, opset=opset)


def test_activations_dynamic(rng):
    check_op("ThresholdedRelu", [("x", away(rng, 2, 3, 4, points=[0.3]))], {"alpha": 0.3},
             weights_as="inputs", dims="dynamic")
    check_op("Shrink", [("x", away(rng, 2, 3, 4, points=[-0.5, 0.5]))], {"bias": 0.2},
             weights_as="inputs", dims="dynamic")


PRELU_SLOPES = [(2, 3, 4, 5), (1,), (5,), (3, 1, 1), (4, 5), (1, 3, 1, 5)]


@pytest.mark.parametrize("opset,dtype", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("slope_shape", PRELU_SLOPES, ids=[str(s) for s in PRELU_SLOPES])
def test_prelu(slope_shape, opset, dtype, rng):
    x = away(rng, 2, 3, 4, 5, dtype=dtype)
    check_op("PRelu", [("x", x), ("slope", arr(rng, *slope_shape, lo=0.1, hi=0.9, dtype=dtype))], opset=opset,
             ort=on_ort("PRelu", opset, dtype))


@pytest.mark.parametrize("dims", ["symbolic", "dynamic"])
@pytest.mark.parametrize("slope_shape", [(3, 1, 1), (5,)], ids=["channel", "last"])
def test_prelu_unknown_shapes(slope_shape, dims, rng):
    check_op("PRelu", [("x", away(rng, 2, 3, 4, 5)), ("slope", arr(rng, *slope_shape, lo=0.1, hi=0.9))],
             weights_as="inputs", dims=dims)


@pytest.mark.parametrize("dtype", [f32, f64], ids=["f32", "f64"])
@pytest.mark.parametrize("alpha", [None, 0.5, 2.0])
def test_swish(alpha, dtype, rng):
    attrs = {} if alpha is None else {"alpha": alpha}
    check_op("Swish", [("x", arr(rng, 3, 5, lo=-4, hi=4, dtype=dtype))], attrs, opset=24)


def test_swish_dynamic(rng):
    check_op("Swish", [("x", arr(rng, 2, 3, 4, lo=-4, hi=4))], {"alpha": 1.5}, opset=24,
             weights_as="inputs", dims="dynamic")


# ----------------------------------------------------------------------------- Mod


def mod_inputs(rng, a_shape, b_shape, dtype=f32):
    """a/b at least 0.1 away from an integer, so the quotient does not jump under a small step."""
    b = rng.uniform(0.5, 1.5, b_shape) * rng.choice([-1.0, 1.0], b_shape)
    shape = np.broadcast_shapes(a_shape, b_shape)
    q = rng.integers(-4, 5, shape) + rng.uniform(0.1, 0.9, shape)
    return (q * b).astype(dtype), b.astype(dtype)  # a has the broadcast shape in every case here


MOD_SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 3, 4), (3, 1)), ((3, 4), ())]


@pytest.mark.parametrize("opset,dtype", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("shapes", MOD_SHAPES, ids=[str(s) for s in MOD_SHAPES])
def test_mod_fmod(shapes, opset, dtype):
    a, b = mod_inputs(np.random.default_rng(5), *shapes, dtype=dtype)
    check_op("Mod", [("a", a), ("b", b)], {"fmod": 1}, opset=opset)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("shapes", MOD_SHAPES, ids=[str(s) for s in MOD_SHAPES])
def test_mod_floor(shapes, opset):
    # fmod=0 on floats: the spec's reference computes Python's %, onnxruntime refuses it, so the
    # float64 gradcheck on the reference is the check here.
    a, b = mod_inputs(np.random.default_rng(5), *shapes, dtype=f64)
    check_op("Mod", [("a", a), ("b", b)], {"fmod": 0}, opset=opset, ort=False)


@pytest.mark.parametrize("dims", ["symbolic", "dynamic"])
def test_mod_unknown_shapes(dims):
    a, b = mod_inputs(np.random.default_rng(5), (2, 3, 4), (3, 1))
    check_op("Mod", [("a", a), ("b", b)], {"fmod": 1}, weights_as="inputs", dims=dims)


def test_mod_floor_and_trunc_quotients_differ():
    # one negative quotient: floor and trunc differ by one there, and so do the b gradients
    a, b = np.array([-2.5, 2.5], f64), np.array([1.0, 1.0], f64)
    grads = {}
    for fmod in (0, 1):
        model, weights, feeds = make_op_model("Mod", [("a", a), ("b", b)], {"fmod": fmod})
        report = gradcheck(model, weights, "loss", feeds)
        assert report.passed, str(report)
        grads[fmod] = report.gradients["b"]
    proj = np.random.default_rng(1234).standard_normal(2)  # make_op_model's projection
    np.testing.assert_allclose(grads[0], -proj * np.floor(a / b))
    np.testing.assert_allclose(grads[1], -proj * np.trunc(a / b))


# ----------------------------------------------------------------------------- piecewise constant


@pytest.mark.parametrize("opset,dtype", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("op", ["Floor", "Ceil", "Round", "Sign"])
def test_piecewise_constant(op, opset, dtype, rng):
    x = (rng.integers(-3, 4, (3, 4)) + rng.uniform(0.1, 0.4, (3, 4))).astype(dtype)  # away from jumps
    report = check_op(op, [("x", x)], opset=opset)
    assert np.all(report.gradients["x"] == 0)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("axis", [None, 0, -1, 1])
def test_hardmax(axis, opset, rng):
    attrs = {} if axis is None else {"axis": axis}
    x = rng.permutation(24).reshape(2, 3, 4).astype(f64)  # no ties
    report = check_op("Hardmax", [("x", x)], attrs, opset=opset, ort=False)  # float64: see NO_ORT_F64
    assert np.all(report.gradients["x"] == 0)
    report = check_op("Hardmax", [("x", x.astype(f32))], attrs, opset=opset)
    assert np.all(report.gradients["x"] == 0)


@pytest.mark.parametrize("op", ["Floor", "Hardmax"])
def test_piecewise_constant_dynamic(op, rng):
    x = (rng.permutation(24).reshape(2, 3, 4) + 0.5).astype(f32)
    check_op(op, [("x", x)], weights_as="inputs", dims="dynamic")


# ----------------------------------------------------------------------------- Range

# (start, limit, delta): (limit - start) / delta away from an integer, where the length jumps
RANGES = [(1.5, 6.2, 0.7), (3.0, -2.1, -0.45), (0.25, 0.3, 1.0), (2.0, 1.0, 0.5)]  # the last one is empty


@pytest.mark.parametrize("opset,dtype", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("start,limit,delta", RANGES)
def test_range(start, limit, delta, opset, dtype):
    check_op("Range", [("start", np.array(start, dtype)), ("limit", np.array(limit, dtype)),
                       ("delta", np.array(delta, dtype))], opset=opset)


def test_range_dynamic():
    check_op("Range", [("start", np.array(1.5, f32)), ("limit", np.array(6.2, f32)), ("delta", np.array(0.7, f32))],
             opset=18, weights_as="inputs", dims="dynamic")


def test_range_float16():
    # float16 from opset 27, which onnxruntime does not load yet: the float16 gradient graph
    # runs on the reference evaluator and agrees with the float64 one
    inputs = [("start", np.array(1.5, np.float16)), ("limit", np.array(6.2, np.float16)),
              ("delta", np.array(0.75, np.float16))]
    report = check_op("Range", inputs, opset=27, ort=False)
    model, weights, _ = make_op_model("Range", inputs, opset=27)
    built = GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build().model_proto
    got = reference_evaluator(built).run([f"{w}_grad" for w in weights], {})
    for w, g in zip(weights, got):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(f64), report.gradients[w], rtol=1e-2, atol=1e-2)
