"""Gradients of the running products and sums (rules/cumulative.py): CumSum and CumProd."""

import numpy as np
import pytest

from gradbuilder.testing import check_op

from .harness import check_graph_ints, check_unknown_rank

f32, f64 = np.float32, np.float64


def arr(rng, *shape, lo=-1.0, hi=1.0, dtype=f32):
    return rng.uniform(lo, hi, shape).astype(dtype)


# ----------------------------------------------------------------------------- CumSum


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [0, -1, np.int32(1)])
def test_cumsum(axis, exclusive, reverse, opset, rng):
    axis_arr = np.array(axis, dtype=np.int32 if isinstance(axis, np.int32) else np.int64)
    check_op("CumSum", [("x", arr(rng, 3, 4, lo=-3.0, hi=3.0)), ("axis", axis_arr)],
             {"exclusive": exclusive, "reverse": reverse}, opset=opset)


def test_cumsum_dynamic_shape_and_float64(rng):
    check_op("CumSum", [("x", arr(rng, 2, 3, 4, lo=-3.0, hi=3.0)), ("axis", np.array(1))], {"reverse": 1}, opset=18,
             weights_as="inputs", dims="dynamic")
    check_op("CumSum", [("x", arr(rng, 3, 4, lo=-3.0, hi=3.0, dtype=f64)), ("axis", np.array(0))], {"exclusive": 1},
             opset=13, ort_rtol=1e-9, ort_atol=1e-10)


# ----------------------------------------------------------------------------- CumProd


@pytest.mark.parametrize("axis,dtype", [(0, f32), (1, f64), (-1, f32)], ids=["0-f32", "1-f64", "-1-f32"])
@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod(exclusive, reverse, axis, dtype, rng):
    x = arr(rng, 3, 4, 2, lo=0.5, hi=1.5, dtype=dtype) * rng.choice([-1, 1], (3, 4, 2)).astype(dtype)
    check_op("CumProd", [("x", x), ("axis", np.array(axis, np.int64))],
             {"exclusive": exclusive, "reverse": reverse}, opset=26)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod_with_zeros(exclusive, reverse, rng):
    # one and two zeros on a row: the gradient stays exact (no division by x)
    x = arr(rng, 3, 5, lo=0.5, hi=1.5)
    x[0, 2] = 0.0
    x[1, 1] = x[1, 3] = 0.0
    report = check_op("CumProd", [("x", x), ("axis", np.array(1, np.int64))],
                      {"exclusive": exclusive, "reverse": reverse}, opset=26)
    assert np.all(np.isfinite(report.gradients["x"]))


@pytest.mark.parametrize("dims", ["symbolic", "dynamic"])
@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 1)])
def test_cumprod_unknown_shapes(exclusive, reverse, dims, rng):
    x = arr(rng, 2, 4, 3, lo=0.5, hi=1.5)
    check_op("CumProd", [("x", x), ("axis", np.array(-2, np.int64))],
             {"exclusive": exclusive, "reverse": reverse}, opset=26, wrt=["x"], weights_as="inputs", dims=dims)


@pytest.mark.parametrize("axis,itype", [(1, np.int64), (-1, np.int32), (0, np.int32)], ids=["1-i64", "-1-i32", "0-i32"])
@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod_axis_at_run_time(exclusive, reverse, axis, itype, rng):
    # the axis is a graph input: the masks and the unit axes are built at run time
    x = arr(rng, 3, 4, lo=0.5, hi=1.5) * rng.choice([-1, 1], (3, 4)).astype(f32)
    x[1, 2] = 0.0
    check_graph_ints("CumProd", [("x", x), ("axis", np.array(axis, itype))],
                     {"exclusive": exclusive, "reverse": reverse}, graph_ints=["axis"], opset=26)


@pytest.mark.parametrize("axis", [1, -3])
def test_cumprod_axis_at_run_time_dynamic(axis, rng):
    x = arr(rng, 2, 3, 2, lo=0.5, hi=1.5)
    check_graph_ints("CumProd", [("x", x), ("axis", np.array(axis, np.int64))], {"exclusive": 1},
                     graph_ints=["axis"], opset=26, weights_as="inputs", dims="dynamic")


def test_cumprod_unknown_rank(rng):
    x = arr(rng, 2, 3, 2, lo=0.5, hi=1.5)
    check_unknown_rank("CumProd", [("x", x), ("axis", np.array(-2, np.int64))], {"reverse": 1}, opset=26)
