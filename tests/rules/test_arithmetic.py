import numpy as np
import onnx
import pytest

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import check_op

f32 = np.float32


def arr(rng, *shape, lo=None, hi=None):
    if lo is not None:
        return rng.uniform(lo, hi, shape).astype(f32)
    return rng.standard_normal(shape).astype(f32)


BROADCASTS = [((3, 4), (3, 4)), ((3, 4), (4,)), ((3, 1), (1, 4)), ((2, 3, 4), (3, 1)), ((), (2, 3))]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("shapes", BROADCASTS)
def test_binary_broadcast(op, shapes, rng):
    a = arr(rng, *shapes[0])
    b = arr(rng, *shapes[1], lo=0.5, hi=2.0)
    check_op(op, [("a", a), ("b", b)])


@pytest.mark.parametrize("dims", ["static", "symbolic", "dynamic"])
@pytest.mark.parametrize("op", ["Add", "Mul", "Div", "Sub"])
def test_binary_broadcast_unknown_shapes(op, dims, rng):
    check_op(op, [("a", arr(rng, 2, 3, 4)), ("b", arr(rng, 3, 1, lo=0.5, hi=2))], weights_as="inputs", dims=dims)


@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((3, 4), (1, 4)), ((2, 3), ())])
def test_pow(shapes, rng):
    check_op("Pow", [("a", arr(rng, *shapes[0], lo=0.5, hi=2)), ("b", arr(rng, *shapes[1], lo=0.5, hi=3))])


def test_pow_integer_exponent(rng):
    check_op("Pow", [("a", arr(rng, 3, 4)), ("b", np.array(2, dtype=np.int64))])


def test_pow_by_a_constant_two_is_differentiated_without_pow(rng):
    """x^2 with a constant 2 (RMSNorm's): d x = dy * 2x, no Pow in the gradient."""
    from gradbuilder.testing import make_op_model

    check_op("Pow", [("a", arr(rng, 3, 4)), ("b", np.array(2.0, dtype=np.float32))], wrt=["a"])
    model, weights, feeds = make_op_model("Pow", [("a", arr(rng, 3, 4)), ("b", np.array(2.0, dtype=np.float32))],
                                          wrt=["a"])
    built = onnx.load_from_string(GradientGraphBuilder(model, weights, ["loss"], "loss").build().get_model())
    assert [n.op_type for n in built.graph.node].count("Pow") == 1  # the forward's own


@pytest.mark.parametrize("op,lo,hi", [("Sqrt", 0.5, 2), ("Reciprocal", 0.5, 2), ("Exp", -1, 1),
                                      ("Log", 0.5, 2), ("Neg", -1, 1), ("Identity", -1, 1), ("Abs", 0.2, 1)])
def test_unary(op, lo, hi, rng):
    x = arr(rng, 3, 5, lo=lo, hi=hi)
    if op == "Abs":
        x[0] *= -1
    check_op(op, [("x", x)])


@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic(op, rng):
    check_op(op, [("a", arr(rng, 3, 4)), ("b", arr(rng, 4)), ("c", arr(rng, 3, 1))])


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_extreme_ties_split_evenly(op):
    from gradbuilder import GradientGraphBuilder
    from gradbuilder.testing import make_op_model
    from onnx.reference import ReferenceEvaluator

    a = np.array([1.0, 2.0], dtype=f32)
    model, weights, _ = make_op_model(op, [("a", a), ("b", a.copy())])
    built = GradientGraphBuilder(model, weights, ["loss", "y0_proj"], "loss").build().model_proto
    got = ReferenceEvaluator(built).run(None, {"a": a, "b": a})
    proj = got[1]
    np.testing.assert_allclose(got[2], proj / 2)
    np.testing.assert_allclose(got[3], proj / 2)


def test_where(rng):
    c = rng.random((3, 4)) > 0.5
    check_op("Where", [("c", c), ("a", arr(rng, 3, 4)), ("b", arr(rng, 4))])


@pytest.mark.parametrize("to", [1, 11, 10])
def test_cast_roundtrip(to, rng):
    # float32 -> (float, double, float16): the gradient comes back in float32
    check_op("Cast", [("x", arr(rng, 3, 4))], {"to": to}, ort_rtol=1e-2, ort_atol=1e-2, rtol=1e-3, atol=1e-5)


def test_castlike(rng):
    check_op("CastLike", [("x", arr(rng, 3, 4)), ("t", np.zeros((), np.float64))], wrt=["x"], opset=15)


def test_pow_exponent_gradient_is_finite_where_the_base_is_zero():
    """d/dy x^y = x^y log x -> 0 as x -> 0 for y > 0; the rule must not give 0 * -inf."""
    from gradbuilder import GradientGraphBuilder
    from gradbuilder.testing import make_op_model, run_onnxruntime

    x = np.array([0.0, 0.5, 2.0], np.float32)
    y = np.array([1.5, 2.0, 0.5], np.float32)
    model, weights, feeds = make_op_model("Pow", [("x", x), ("y", y)], wrt=["y"], weights_as="inputs")
    built = GradientGraphBuilder(model, weights, ["loss"], "loss").build().get_model()
    got = run_onnxruntime(built, {**feeds, "x": x})["y_grad"]
    assert np.all(np.isfinite(got)) and got[0] == 0.0
