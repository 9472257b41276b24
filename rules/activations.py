"""Elementwise activations and friends: Tanh Sigmoid Relu LeakyRelu Elu Selu Gelu Erf Softplus
Softsign HardSigmoid HardSwish Clip Dropout.

Each rule is ``dx = dy * f'(x)``, written with the forward output ``y`` where that is cheaper
(``tanh' = 1 - y^2``). Piecewise ops pick their branch with a mask; at a kink the branch
follows PyTorch's convention.
"""

import math

import onnx_ir as ir

from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, constant_of, optional_input
from gradbuilder.rules.helpers import keep, optional_output, wants


# ----------------------------------------------------------------------------- smooth


@register("Tanh")
def tanh(n, dys, needs, e):
    """dx = dy * (1 - y^2)"""
    (y,) = n.outputs
    return (dys[0] * (1 - y * y),)


@register("Sigmoid")
def sigmoid(n, dys, needs, e):
    """dx = dy * (y (1 - y))"""
    (y,) = n.outputs
    return (dys[0] * (y * (1 - y)),)


@register("Erf")
def erf(n, dys, needs, e):
    """dx = dy * (2/sqrt(pi) exp(-x^2))"""
    (x,) = n.inputs
    return (dys[0] * (2.0 / math.sqrt(math.pi) * e.Exp(-(x * x))),)


@register("Softplus")
def softplus(n, dys, needs, e):
    """y = log(1 + exp(x)):  dx = dy * sigmoid(x)"""
    (x,) = n.inputs
    return (dys[0] * e.Sigmoid(x),)


@register("Softsign")
def softsign(n, dys, needs, e):
    """y = x / (1 + |x|):  dx = dy / (1 + |x|)^2"""
    (x,) = n.inputs
    d = 1 + e.Abs(x)
    return (dys[0] / (d * d),)


def gelu_slope(e, u):
    """d/du of u Phi(u) = Phi(u) + u phi(u), Phi(u) = 0.5 (1 + erf(u (1/sqrt 2))),
    phi(u) = 1/sqrt(2 pi) exp(-0.5 u^2)."""
    cdf = 0.5 * (1 + e.Erf(u * (1.0 / math.sqrt(2.0))))
    pdf = 1.0 / math.sqrt(2.0 * math.pi) * e.Exp(-0.5 * (u * u))
    return cdf + u * pdf


def gelu_tanh_slope(e, u):
    """d/du of u (1 + t)/2 with t = tanh(v), v = k (u + a u^3), k = sqrt(2/pi), a = 0.044715:
    0.5 (1 + t) + (0.5 u) ((1 - t^2) dv), dv = dv/du = k (1 + 3a u^2)."""
    k, a = math.sqrt(2.0 / math.pi), 0.044715
    u2 = u * u
    t = e.Tanh(k * (u + a * (u2 * u)))
    dv = k * (1 + 3 * a * u2)
    return 0.5 * (1 + t) + 0.5 * u * ((1 - t * t) * dv)


@register("Gelu")
def gelu(n, dys, needs, e):
    """dx = dy * d/dx (x Phi(x)) (``gelu_slope``; approximate="tanh": ``gelu_tanh_slope``)."""
    slope = gelu_tanh_slope if attr(n, "approximate", "none") == "tanh" else gelu_slope
    return (dys[0] * slope(e, n.inputs[0]),)


# ----------------------------------------------------------------------------- piecewise


@register("Relu")
def relu(n, dys, needs, e):
    """dx = dy where y > 0, else 0 (y = relu(x)): PyTorch's threshold_backward. It reads the
    output, which the next layer's weight gradient keeps anyway, so the input need not be
    kept; a compare and a Where, two kernels. In bfloat16 (which CUDA's Greater does not take)
    the mask is y cast to bool: y >= 0, so y != 0 is y > 0."""
    (y,) = n.outputs
    zero = e.scalar(0.0, y)
    mask = e.Cast(y, to=int(ir.DataType.BOOL)) if y.dtype == ir.DataType.BFLOAT16 else e.Greater(y, zero)
    return (e.Where(mask, dys[0], zero),)


@register("LeakyRelu")
def leaky_relu(n, dys, needs, e):
    """y = x (x >= 0), alpha x (x < 0):  dx = dy, or alpha dy where x < 0"""
    (x,) = n.inputs
    (dy,) = dys
    alpha = attr(n, "alpha", 0.01)
    return (e.Where(e.Less(x, e.scalar(0.0, x)), dy * alpha, dy),)


@register("Elu")
def elu(n, dys, needs, e):
    """y = x (x >= 0), alpha (exp(x) - 1) (x < 0):  dx = dy, or dy (y + alpha) where x < 0"""
    (x,) = n.inputs
    (y,) = n.outputs
    (dy,) = dys
    alpha = attr(n, "alpha", 1.0)
    return (e.Where(e.Less(x, e.scalar(0.0, x)), dy * (y + alpha), dy),)


@register("Selu")
def selu(n, dys, needs, e):
    """y = gamma x (x > 0), gamma alpha (exp(x) - 1) (x <= 0):
    dx = gamma dy, or dy (y + gamma alpha) where x <= 0"""
    (x,) = n.inputs
    (y,) = n.outputs
    (dy,) = dys
    alpha = attr(n, "alpha", 1.67326319217681884765625)
    gamma = attr(n, "gamma", 1.05070102214813232421875)
    return (e.Where(e.Greater(x, e.scalar(0.0, x)), dy * gamma, dy * (y + gamma * alpha)),)


@register("HardSigmoid")
def hard_sigmoid(n, dys, needs, e):
    """y = clip(alpha x + beta, 0, 1):  dx = alpha dy inside the linear region 0 < y < 1, else 0.

    The region is read off the output, so it agrees bit for bit with the forward clipping.
    """
    (y,) = n.outputs
    alpha = attr(n, "alpha", 0.2)
    inside = e.And(e.Greater(y, e.scalar(0.0, y)), e.Less(y, e.scalar(1.0, y)))
    return (keep(e, inside, dys[0] * alpha),)


@register("HardSwish")
def hard_swish(n, dys, needs, e):
    """y = x clip(x/6 + 1/2, 0, 1):  dx = 0 (x < -3), dy (x > 3), dy (x (1/3) + 0.5) otherwise
    (the inclusive middle branch is PyTorch's hardswish_backward)."""
    (x,) = n.inputs
    (dy,) = dys
    middle = dy * (x * (1.0 / 3.0) + 0.5)
    upper = e.Where(e.Greater(x, e.scalar(3.0, x)), dy, middle)
    return (keep(e, e.Not(e.Less(x, e.scalar(-3.0, x))), upper),)


@register("Clip", since=13)
def clip(n, dys, needs, e):
    """y = min(max(x, lo), hi), lo/hi optional inputs (PyTorch clamp's convention):

    dx  = dy where lo <= x <= hi (inclusive);
    dlo = sum of dy where x < lo (and lo < hi when hi is given);
    dhi = sum of dy where x > hi (or everywhere when hi < lo: then y = hi).
    """
    x, lo, hi = n.inputs[0], optional_input(n, 1), optional_input(n, 2)
    (dy,) = dys
    below = e.Less(x, lo) if lo is not None else None
    above = e.Greater(x, hi) if hi is not None else None
    dx, dlo, dhi = dy, None, None
    if needs[0] and (below is not None or above is not None):
        outside = above if below is None else below if above is None else e.Or(below, above)
        dx = keep(e, e.Not(outside), dy)
    if wants(needs, 1):
        lo_wins = below if hi is None else e.And(below, e.Less(lo, hi))
        dlo = e.unbroadcast(keep(e, lo_wins, dy), lo)
    if wants(needs, 2):
        hi_wins = above if lo is None else e.Or(above, e.Less(hi, lo))
        dhi = e.unbroadcast(keep(e, hi_wins, dy), hi)
    return [dx, dlo, dhi][: len(n.inputs)]


@register("Dropout", since=13)
def dropout(n, dys, needs, e):
    """Inference (training_mode absent/false, or ratio 0): y = x, dx = dy.
    Training: y = x * mask / (1 - ratio), dx = dy * mask / (1 - ratio).

    The mask comes from the node's ``mask`` output when it has one (exact). Without it, the
    mask is read off the forward values: where x != 0, kept <=> y != 0 (exact); where x == 0
    the draw left no trace in y, and dx takes the expected factor, dy (E[mask/(1-ratio)] = 1).
    A dynamic training_mode selects the scale at run time (mask is all true in inference).

    A ratio given at run time gets d ratio = sum(dy * y / (1 - ratio)) for the drawn mask
    (the mask itself is piecewise constant in the ratio).
    """
    x, ratio, training = n.inputs[0], optional_input(n, 1), optional_input(n, 2)
    (y,) = n.outputs[:1]
    dy = dys[0]
    if dy is None:
        return (None,)
    train_c = None if training is None else constant_of(training)
    ratio_wanted = wants(needs, 1)  # a trained ratio is not a constant
    ratio_c = 0.5 if ratio is None else None if ratio_wanted else constant_of(ratio)
    if training is None or (train_c is not None and not bool(train_c)):
        return (dy,)
    if ratio_c is not None and float(ratio_c) == 0.0:
        return (dy,)
    dratio = None
    if ratio_wanted:
        per = dy * y / (1 - e.CastLike(ratio, y))
        if train_c is None:
            per = e.Where(training, per, e.scalar(0.0, y))
        dratio = e.CastLike(e.reduce("ReduceSum", per, None, keepdims=False), ratio)
    return (_dropout_dx(n, e, x, y, dy, ratio, ratio_c, training, train_c), dratio)


def _dropout_dx(n, e, x, y, dy, ratio, ratio_c, training, train_c):
    if ratio_c is not None:
        scale = e.scalar(1.0 / (1.0 - float(ratio_c)), x)
    else:
        r = e.CastLike(ratio, x)
        scale = 1 / (1 - r)
    if train_c is None:
        scale = e.Where(training, scale, e.scalar(1.0, x))
    scaled = dy * scale
    mask = optional_output(n, 1)
    if mask is not None:
        return keep(e, mask, scaled)
    zero = e.scalar(0.0, x)
    kept = keep(e, e.Not(e.Equal(y, zero)), scaled)
    return e.Where(e.Equal(x, zero), dy, kept)
