"""Softmax and LogSoftmax over one axis (opset 13 semantics; older models are upgraded to 13)."""

from gradbuilder.registry import attr, register


def _sum(e, n, v):
    """``v`` summed over the node's axis, keepdims."""
    return e.reduce("ReduceSum", v, [attr(n, "axis", -1)], keepdims=True)


@register("Softmax", since=13)
def softmax(n, dys, needs, e):
    """dx = y * (dy - sum(dy * y, axis))"""
    (y,) = n.outputs
    (dy,) = dys
    return (e.Mul(y, e.Sub(dy, _sum(e, n, e.Mul(dy, y)))),)


@register("LogSoftmax", since=13)
def log_softmax(n, dys, needs, e):
    """dx = dy - exp(y) * sum(dy, axis)"""
    (y,) = n.outputs
    (dy,) = dys
    return (e.Sub(dy, e.Mul(e.Exp(y), _sum(e, n, dy))),)
