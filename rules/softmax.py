"""Softmax and LogSoftmax over one axis (opset 13 semantics; older models are upgraded to 13).

A row of -inf (an attention row masked out entirely) has a NaN softmax, which models mask
to zeros afterwards (ONNX's Attention does), so no gradient reaches it; the rules count NaN
entries of y as 0 so that none spreads through the backward graph either, unless the
forward's input cannot hold -inf (``passes.finite_inputs`` marks those nodes).
"""

import onnx_ir as ir

from gradbuilder.compiler.registry import FINITE_INPUT, register
from gradbuilder.compiler.values import attr
from gradbuilder.rules.helpers import cast_to, sum_over


def _nan_to_zero(e, y):
    """``y`` with NaN entries set to 0 (bfloat16 through float32: onnxruntime's CPU provider
    has no bfloat16 IsNaN)."""
    if y.dtype == ir.DataType.BFLOAT16:
        return cast_to(e, _nan_to_zero(e, e.Cast(y, to=int(ir.DataType.FLOAT))), ir.DataType.BFLOAT16)
    return e.Where(e.IsNaN(y), e.scalar(0.0, like=y), y)


@register("Softmax", since=13)
def softmax(n, dys, needs, e):
    """dx = y * (dy - sum(dy * y, axis))"""
    (y,) = n.outputs
    (dy,) = dys
    if not n.meta.get(FINITE_INPUT):
        y = _nan_to_zero(e, y)
    return (y * (dy - sum_over(e, dy * y, [attr(n, "axis", -1)])),)


@register("LogSoftmax", since=13)
def log_softmax(n, dys, needs, e):
    """dx = dy - exp(y) * sum(dy, axis)"""
    (y,) = n.outputs
    (dy,) = dys
    p = e.Exp(y)
    if not n.meta.get(FINITE_INPUT):
        p = _nan_to_zero(e, p)
    return (dy - p * sum_over(e, dy, [attr(n, "axis", -1)]),)
