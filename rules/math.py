"""Elementwise math and activations not covered elsewhere: the trigonometric and hyperbolic
functions and their inverses, Celu Mish ThresholdedRelu Shrink PRelu Swish Mod, the piecewise
constant ops Floor Ceil Round Sign Hardmax, and Range.

Each elementwise rule is ``dx = dy * f'(x)``. Masks pick the branch of piecewise ops; at a
kink the gradient follows the branch the spec's strict comparison selects.
"""

from __future__ import annotations

import numpy as np

from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr
from gradbuilder.rules.helpers import keep, zero_gradients

# (``keep`` is a Where, which takes bfloat16 from opset 16 only; none of the ops using it here
# takes bfloat16 before that.)

# ----------------------------------------------------------------------------- trigonometric


@register("Sin")
def sin(n, dys, needs, e):
    """dx = dy * cos(x)"""
    return (dys[0] * e.Cos(n.inputs[0]),)


@register("Cos")
def cos(n, dys, needs, e):
    """dx = -(dy * sin(x))"""
    return (-(dys[0] * e.Sin(n.inputs[0])),)


@register("Tan")
def tan(n, dys, needs, e):
    """dx = dy * (1 + y^2)"""
    (y,) = n.outputs
    return (dys[0] * (1 + y * y),)


@register("Asin")
def asin(n, dys, needs, e):
    """dx = dy / sqrt(1 - x^2)"""
    (x,) = n.inputs
    return (dys[0] / e.Sqrt(1 - x * x),)


@register("Acos")
def acos(n, dys, needs, e):
    """dx = -(dy / sqrt(1 - x^2))"""
    (x,) = n.inputs
    return (-(dys[0] / e.Sqrt(1 - x * x)),)


@register("Atan")
def atan(n, dys, needs, e):
    """dx = dy / (1 + x^2)"""
    (x,) = n.inputs
    return (dys[0] / (1 + x * x),)


@register("Sinh")
def sinh(n, dys, needs, e):
    """dx = dy * cosh(x)"""
    return (dys[0] * e.Cosh(n.inputs[0]),)


@register("Cosh")
def cosh(n, dys, needs, e):
    """dx = dy * sinh(x)"""
    return (dys[0] * e.Sinh(n.inputs[0]),)


@register("Asinh")
def asinh(n, dys, needs, e):
    """dx = dy / sqrt(x^2 + 1)"""
    (x,) = n.inputs
    return (dys[0] / e.Sqrt(x * x + 1),)


@register("Acosh")
def acosh(n, dys, needs, e):
    """dx = dy / sqrt(x^2 - 1)   (x > 1)"""
    (x,) = n.inputs
    return (dys[0] / e.Sqrt(x * x - 1),)


@register("Atanh")
def atanh(n, dys, needs, e):
    """dx = dy / (1 - x^2)   (|x| < 1)"""
    (x,) = n.inputs
    return (dys[0] / (1 - x * x),)


# ----------------------------------------------------------------------------- activations


@register("Celu")
def celu(n, dys, needs, e):
    """y = max(0, x) + min(0, alpha (exp(x/alpha) - 1)):
    dx = dy * exp(min(x, 0) / alpha)   (1 for x > 0, exp(x/alpha) for x <= 0)"""
    (x,) = n.inputs
    alpha = attr(n, "alpha", 1.0)
    return (dys[0] * e.Exp(e.Min(x, e.scalar(0.0, x)) / alpha),)


@register("Mish")
def mish(n, dys, needs, e):
    """y = x tanh(softplus(x)):  dx = dy * (t + x (1 - t^2) sigmoid(x)),  t = tanh(softplus(x))"""
    (x,) = n.inputs
    t = e.Tanh(e.Softplus(x))
    return (dys[0] * (t + x * (1 - t * t) * e.Sigmoid(x)),)


@register("ThresholdedRelu")
def thresholded_relu(n, dys, needs, e):
    """y = x (x > alpha), 0 otherwise:  dx = dy where x > alpha, else 0"""
    (x,) = n.inputs
    return (keep(e, e.Greater(x, e.scalar(attr(n, "alpha", 1.0), x)), dys[0]),)


@register("Shrink")
def shrink(n, dys, needs, e):
    """y = x - bias (x > lambd), x + bias (x < -lambd), 0 otherwise:
    dx = dy where |x| > lambd, else 0"""
    (x,) = n.inputs
    lambd = attr(n, "lambd", 0.5)
    outside = e.Or(e.Greater(x, e.scalar(lambd, x)), e.Less(x, e.scalar(-lambd, x)))
    return (keep(e, outside, dys[0]),)


@register("PRelu")
def prelu(n, dys, needs, e):
    """y = slope x (x < 0), x (x >= 0), slope broadcast unidirectionally to x:
    dx = dy * slope where x < 0, else dy;  dslope = unbroadcast(dy * x where x < 0)"""
    x, slope = n.inputs
    (dy,) = dys
    neg = e.Less(x, e.scalar(0.0, x))
    dx = e.Where(neg, dy * slope, dy) if needs[0] else None
    dslope = e.unbroadcast(keep(e, neg, dy * x), slope) if needs[1] else None
    return dx, dslope


@register("Swish", since=24)
def swish(n, dys, needs, e):
    """y = x sigmoid(alpha x):  dx = dy * (s + alpha y (1 - s)),  s = sigmoid(alpha x)"""
    (x,) = n.inputs
    (y,) = n.outputs
    alpha = attr(n, "alpha", 1.0)
    s = e.Sigmoid(alpha * x)
    return (dys[0] * (s + alpha * y * (1 - s)),)


@register("Mod")
def mod(n, dys, needs, e):
    """Floats: z = a - q b with q = trunc(a/b) (fmod=1) or floor(a/b) (fmod=0; onnxruntime
    refuses floats there, the spec's reference computes it). q is piecewise constant:
    da = dy, db = -(dy * q). q is read off the output, q = round((a - z) / b), so it is the
    exact integer the forward used."""
    a, b = n.inputs
    (z,) = n.outputs
    (dy,) = dys
    da = e.unbroadcast(dy, a) if needs[0] else None
    db = None
    if needs[1]:
        q = e.Round((a - z) / b)
        db = e.unbroadcast(-(dy * q), b)
    return da, db


# ----------------------------------------------------------------------------- piecewise constant


@register(["Floor", "Ceil", "Round", "Sign", "Hardmax"])
def piecewise_constant(n, dys, needs, e):
    """Piecewise constant in x (Floor, Ceil, Round, Sign; Hardmax's one-hot of the first
    maximum): the derivative is zero almost everywhere, and undefined at the jumps, where zero
    is used too. dx = 0."""
    return zero_gradients(n, needs, e)


# ----------------------------------------------------------------------------- Range


@register("Range")
def range_(n, dys, needs, e):
    """y_i = start + i delta for i < max(ceil((limit - start) / delta), 0):
    dstart = sum(dy), ddelta = sum(i dy). The length is piecewise constant in the inputs (it
    jumps where (limit - start) / delta crosses an integer): dlimit = 0."""
    start, limit, delta = n.inputs
    (dy,) = dys
    dstart = e.reduce("ReduceSum", dy, None, keepdims=False) if needs[0] else None
    ddelta = None
    if needs[2]:
        steps = e.Range(e.const(np.array(0, np.int64)), e.Size(dy), e.const(np.array(1, np.int64)))
        ddelta = e.reduce("ReduceSum", dy * e.CastLike(steps, dy), None, keepdims=False)
    return dstart, e.zeros_like(limit) if needs[1] else None, ddelta
