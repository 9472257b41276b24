"""Cumulative ops along one axis: CumSum CumProd.

CumSum is linear: its adjoint is the cumulative sum in the other direction. CumProd's
derivative is a product of the other factors, computed without division so that zeros in x
are exact.
"""

from __future__ import annotations

import numpy as np

from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, constant_of
from gradbuilder.rules.helpers import keep
from gradbuilder.rules.sizes import Dims, as_int64, iadd, isub, iwrap, scalar_of, vec, with_unit_axes


@register("CumSum")
def cumsum(n, dys, needs, e):
    """Linear; its adjoint is the cumulative sum in the other direction:
    dx = CumSum(dy, axis, exclusive, reverse = not reverse)."""
    axis = n.inputs[1]
    return (e.CumSum(dys[0], axis, exclusive=attr(n, "exclusive", 0), reverse=1 - attr(n, "reverse", 0)),)


_FACTOR_TEST = {(0, 0): "LessOrEqual", (1, 0): "Less", (0, 1): "GreaterOrEqual", (1, 1): "Greater"}


def _cumprod_masks(e, x, dims, axis, exclusive, reverse):
    """Two (n, n, 1, ..., 1) bool masks over (j, i), aligned with x unsqueezed at ``axis``:
    ``eye`` (i == j) and ``inside`` (x_j is a factor of y_i: j <= i, j < i with exclusive,
    mirrored with reverse). Constants for a static axis and length, else Range-based."""
    test = _FACTOR_TEST[(int(bool(exclusive)), int(bool(reverse)))]
    length = dims[axis]
    trailing = isub(e, isub(e, dims.rank_value(), axis), 1)
    if isinstance(length, int) and isinstance(trailing, int):
        j, i = np.arange(length)[:, None], np.arange(length)[None, :]
        inside = {"LessOrEqual": j <= i, "Less": j < i, "GreaterOrEqual": j >= i, "Greater": j > i}[test]
        shape = (length, length) + (1,) * trailing
        return e.const((j == i).reshape(shape)), e.const(inside.reshape(shape))
    idx = e.Range(scalar_of(e, 0), scalar_of(e, length), scalar_of(e, 1))
    j, i = e.Unsqueeze(idx, [1]), e.Unsqueeze(idx, [0])
    return with_unit_axes(e, e.Equal(j, i), 2, trailing), with_unit_axes(e, e.op(test, j, i), 2, trailing)


@register("CumProd", since=26)
def cumprod(n, dys, needs, e):
    """y_i = prod of x_k over k in S_i (S_i: k <= i, k < i with exclusive, mirrored with reverse).

    dx_j = sum over i with j in S_i of dy_i * prod of x_k over k in S_i, k != j: exact also
    where x has zeros (no division). For every j the row with x_j replaced by 1 goes through
    CumProd with the node's attributes; that costs n times the memory of x (n = length of the
    axis). The axis may be a constant or given at run time (then the masks are built with
    Range and the unit axes with ConstantOfShape)."""
    x, axis_v = n.inputs
    (dy,) = dys
    dims = Dims(e, x)
    axis_c = constant_of(axis_v)
    if axis_c is not None and dims.rank is not None:
        axis = int(np.asarray(axis_c).reshape(-1)[0]) % dims.rank
    elif axis_c is not None:
        axis = iwrap(e, int(np.asarray(axis_c).reshape(-1)[0]), dims.rank_value())
    else:
        axis = iwrap(e, e.Reshape(as_int64(e, axis_v), [1]), dims.rank_value())
    exclusive, reverse = attr(n, "exclusive", 0), attr(n, "reverse", 0)
    eye, inside = _cumprod_masks(e, x, dims, axis, exclusive, reverse)
    rows = e.Where(eye, e.scalar(1.0, x), e.Unsqueeze(x, vec(e, axis)))  # (..., n_j, n_i, ...)
    inner = iadd(e, axis, 1)
    inner_scalar = e.const(np.array(inner, np.int64)) if isinstance(inner, int) else e.Reshape(inner, [])
    partial = e.CumProd(rows, inner_scalar, exclusive=exclusive, reverse=reverse)
    terms = keep(e, inside, e.Unsqueeze(dy, vec(e, axis)) * partial)
    return e.reduce("ReduceSum", terms, [inner] if isinstance(inner, int) else inner, keepdims=False), None
