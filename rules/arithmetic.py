"""Elementwise arithmetic: Add Sub Mul Div Neg Pow Sqrt Reciprocal Exp Log Abs Sum Mean Min Max
Identity Cast CastLike Where."""

from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import constant_of


@register("Add")
def add(n, dys, needs, e):
    x, y = n.inputs
    (dy,) = dys
    return e.unbroadcast(dy, x), e.unbroadcast(dy, y)


@register("Sub")
def sub(n, dys, needs, e):
    x, y = n.inputs
    (dy,) = dys
    return e.unbroadcast(dy, x), e.unbroadcast(-dy, y) if needs[1] else None


@register("Mul")
def mul(n, dys, needs, e):
    x, y = n.inputs
    (dy,) = dys
    return (
        e.unbroadcast(dy * y, x) if needs[0] else None,
        e.unbroadcast(dy * x, y) if needs[1] else None,
    )


@register("Div")
def div(n, dys, needs, e):
    """z = x/y:  d x = dy/y,  d y = -dy*x/y^2 = -((dy/y)*z)"""
    x, y = n.inputs
    (z,) = n.outputs
    (dy,) = dys
    dx = dy / y
    return (
        e.unbroadcast(dx, x) if needs[0] else None,
        e.unbroadcast(-(dx * z), y) if needs[1] else None,
    )


@register("Neg")
def neg(n, dys, needs, e):
    return (-dys[0],)


@register("Identity")
def identity(n, dys, needs, e):
    return (dys[0],)


@register("Pow")
def pow_(n, dys, needs, e):
    """d(x^y) = y*x^(y-1) dx + x^y*log(x) dy  (the second term taken as 0 at x = 0, y >= 0)"""
    x, y = n.inputs
    (z,) = n.outputs
    (dy,) = dys
    dx = dyy = None
    power = constant_of(y)
    if needs[0] and not needs[1] and power is not None and power.size == 1 and float(power.reshape(-1)[0]) == 2.0:
        dx = e.unbroadcast(dy * (x * 2), x)  # x^2 (RMSNorm's): dy * 2x, no Pow
    elif needs[0]:
        yx = e.CastLike(y, x) if y.dtype != x.dtype else y
        dx = e.unbroadcast(dy * (yx * x ** (yx - 1)), x)
    if needs[1]:
        xy = e.CastLike(x, y) if y.dtype != x.dtype else x
        zy = e.CastLike(z, y) if y.dtype != z.dtype else z
        zero = e.scalar(0.0, y)
        # x^y log x at x = 0 is 0 * -inf; its limit is 0 for y >= 0 (as torch defines it)
        at_zero = e.And(e.Equal(xy, zero), e.GreaterOrEqual(y, zero))
        dlog = e.Where(at_zero, zero, zy * e.Log(xy))
        dyy = e.unbroadcast((e.CastLike(dy, y) if y.dtype != x.dtype else dy) * dlog, y)
    return dx, dyy


@register("Sqrt")
def sqrt(n, dys, needs, e):
    """d sqrt(x) = dy / (2 z), z = sqrt(x)"""
    (z,) = n.outputs
    return (dys[0] / (2 * z),)


@register("Reciprocal")
def reciprocal(n, dys, needs, e):
    """d(1/x) = -dy / x^2 = -(dy * z^2), z = 1/x"""
    (z,) = n.outputs
    return (-(dys[0] * (z * z)),)


@register("Exp")
def exp(n, dys, needs, e):
    return (dys[0] * n.outputs[0],)


@register("Log")
def log(n, dys, needs, e):
    return (dys[0] / n.inputs[0],)


@register("Abs")
def abs_(n, dys, needs, e):
    return (dys[0] * e.Sign(n.inputs[0]),)


@register("Sum")
def sum_(n, dys, needs, e):
    return [e.unbroadcast(dys[0], x) if need else None for x, need in zip(n.inputs, needs)]


@register("Mean")
def mean(n, dys, needs, e):
    dy = dys[0] / float(len(n.inputs))
    return [e.unbroadcast(dy, x) if need else None for x, need in zip(n.inputs, needs)]


def _select_extreme(n, dys, needs, e):
    """Min/Max: the gradient goes to the inputs equal to the result, split evenly on ties."""
    (z,) = n.outputs
    (dy,) = dys
    masks = [e.CastLike(e.Equal(x, z), z) for x in n.inputs]
    count = masks[0] if len(masks) == 1 else e.Sum(*masks)
    share = dy / count
    return [
        e.unbroadcast(share * m, x) if need else None
        for x, m, need in zip(n.inputs, masks, needs)
    ]


register("Max")(_select_extreme)
register("Min")(_select_extreme)


@register("Cast")
def cast(n, dys, needs, e):
    """A cast back to the input's type; no gradient into integer inputs."""
    (x,) = n.inputs
    return (e.Cast(dys[0], to=int(x.dtype)) if x.dtype is not None else e.CastLike(dys[0], x),)


@register("CastLike")
def cast_like(n, dys, needs, e):
    (x, _) = n.inputs
    return e.CastLike(dys[0], x), None


@register("Where")
def where(n, dys, needs, e):
    c, x, y = n.inputs
    (dy,) = dys
    zero = e.scalar(0.0, dy)
    return (
        None,
        e.unbroadcast(e.Where(c, dy, zero), x) if needs[1] else None,
        e.unbroadcast(e.Where(c, zero, dy), y) if needs[2] else None,
    )
