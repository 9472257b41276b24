"""Optimizer steps of the ai.onnx.preview.training domain: Adagrad, Momentum, Adam.

Each node updates n tensor groups at once. Inputs: R (learning rate, float or double),
T (int64 update count), then n tensors X, n gradients G and, per optimizer, n of each state
(Adagrad H; Momentum V; Adam V, H). Outputs: the n new X, then the n new states in the same
order. A group's update is an element-wise function of R, X, G and its states, so every
float input gets a gradient from the gradients of every output of its group; R gets the
sum over the groups. T and the attributes are constants of the step. With ``gr`` the
regularized gradient ``norm_coefficient * X + G`` (so ``dX = dX_new_direct + nc * d gr``
and ``dG = d gr``), the formulas are in each rule's docstring.
"""

from __future__ import annotations

import numpy as np

from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr
from gradbuilder.rules.helpers import text_attr

TRAINING = "ai.onnx.preview.training"


# ----------------------------------------------------------------------------- helpers


def _sub(a, b):
    """a - b where None is zero."""
    if b is None:
        return a
    if a is None:
        return -b
    return a - b


def _mul(a, b):
    """a * b where None (a zero tensor) stays None."""
    if a is None or b is None:
        return None
    return a * b


def _scale(v, c: float):
    """v * c for a Python constant c (None stays None; c == 1 emits nothing)."""
    if v is None or c == 0.0:
        return None if c == 0.0 else v
    return v if c == 1.0 else v * c


def _groups(n, dys, k_in: int):
    """(m, per-group input indices, per-group output gradients) for ``k_in`` tensor blocks
    after R and T; outputs come in ``len(n.outputs) // m`` blocks of m."""
    m = (len(n.inputs) - 2) // k_in
    ins = [[2 + b * m + i for b in range(k_in)] for i in range(m)]
    k_out = len(n.outputs) // m
    outs = [[dys[b * m + i] for b in range(k_out)] for i in range(m)]
    return m, ins, outs


def _t_float(e, n, like):
    """T as a scalar of ``like``'s dtype."""
    return e.CastLike(n.inputs[1], like)


def _t_positive(e, n):
    """T > 0 (bool scalar)."""
    return e.Greater(n.inputs[1], e.const(np.array(0, dtype=np.int64)))


def _regularized(e, x, g, nc: float):
    """gr = nc * X + G."""
    return g if nc == 0.0 else nc * x + g


def _finish(e, n, needs, grads, r_parts):
    """Reduce R's contributions (full-shape tensors) to R's shape and dtype; unbroadcast
    the tensor gradients to their inputs."""
    out = [None] * len(n.inputs)
    for i, g in grads.items():
        if needs[i] and g is not None:
            out[i] = e.unbroadcast(g, n.inputs[i])
    r = n.inputs[0]
    if needs[0]:
        parts = [e.unbroadcast(p, r) for p in r_parts if p is not None]
        if parts:
            total = parts[0] if len(parts) == 1 else e.Sum(*parts)
            out[0] = e.CastLike(total, r)
    return out


# ----------------------------------------------------------------------------- Adagrad


@register("Adagrad", domain=TRAINING)
def adagrad(n, dys, needs, e):
    """Adagrad (decay d, epsilon eps, norm_coefficient nc)::

        f = 1 / (1 + T*d),  r = R*f,  gr = nc*X + G
        H_new = H + gr^2,   s = sqrt(H_new) + eps,   X_new = X - r*gr/s

    With a = dX_new, b = dH_new, q = (a/s)*r::

        dH = b + q*gr / (2*s*sqrt(H_new))
        d gr = 2*gr*dH - q,   dX = a + nc*d gr,   dG = d gr,   dR = -sum((a/s)*gr*f)
    """
    nc = attr(n, "norm_coefficient", 0.0)
    decay = attr(n, "decay_factor", 0.0)
    eps = attr(n, "epsilon", 1e-6)
    m, groups, douts = _groups(n, dys, 3)
    like = n.inputs[2]
    f = None
    if decay != 0.0:
        f = 1 / (1 + _t_float(e, n, like) * decay)
    rx = e.CastLike(n.inputs[0], like)
    r = rx if f is None else rx * f
    grads, r_parts = {}, []
    for i, ((ix, ig, ih), (a, b)) in enumerate(zip(groups, douts)):
        x, g = n.inputs[ix], n.inputs[ig]
        h_new = n.outputs[m + i]
        gr = _regularized(e, x, g, nc)
        root = e.Sqrt(h_new)
        s = root + eps
        a_s = None if a is None else a / s
        q = _mul(a_s, r)
        dh = e.accumulate(b, None if q is None else q * gr / (2 * s * root))
        dgr = _sub(_mul(2 * gr, dh), q)
        grads[ix] = e.accumulate(a, _scale(dgr, nc))
        grads[ig] = dgr
        grads[ih] = dh
        if needs[0] and a_s is not None:
            part = -(a_s * gr)
            r_parts.append(part if f is None else part * f)
    return _finish(e, n, needs, grads, r_parts)


# ----------------------------------------------------------------------------- Momentum


@register("Momentum", domain=TRAINING)
def momentum(n, dys, needs, e):
    """Momentum (alpha, beta, norm_coefficient nc, mode)::

        gr = nc*X + G,  ba = beta if T > 0 else 1,  V_new = alpha*V + ba*gr
        standard: X_new = X - R*V_new
        nesterov: X_new = X - R*(gr + alpha*V_new)

    With a = dX_new, b = dV_new::

        standard: dV_new' = b - R*a,          d gr = ba*dV_new',          dR = -sum(a*V_new)
        nesterov: dV_new' = b - alpha*(R*a),  d gr = ba*dV_new' - R*a,    dR = -sum(a*(gr + alpha*V_new))
        dV = alpha*dV_new',  dX = a + nc*d gr,  dG = d gr
    """
    nc = attr(n, "norm_coefficient", 0.0)
    alpha = attr(n, "alpha", 0.0)
    beta = attr(n, "beta", 1.0)
    mode = text_attr(n, "mode", "standard")
    nesterov = mode != "standard"
    m, groups, douts = _groups(n, dys, 3)
    like = n.inputs[2]
    r = e.CastLike(n.inputs[0], like)
    ba = None
    if beta != 1.0:
        ba = e.Where(_t_positive(e, n), e.scalar(beta, like), e.scalar(1.0, like))
    grads, r_parts = {}, []
    for i, ((ix, ig, iv), (a, b)) in enumerate(zip(groups, douts)):
        x, g = n.inputs[ix], n.inputs[ig]
        v_new = n.outputs[m + i]
        ra = _mul(r, a)
        dv_new = _sub(b, _scale(ra, alpha) if nesterov else ra)
        dgr = dv_new if ba is None else _mul(dv_new, ba)
        if nesterov:
            dgr = _sub(dgr, ra)
        grads[ix] = e.accumulate(a, _scale(dgr, nc))
        grads[ig] = dgr
        grads[iv] = _scale(dv_new, alpha)
        if needs[0] and a is not None:
            step = v_new
            if nesterov:
                step = e.accumulate(_regularized(e, x, g, nc), _scale(v_new, alpha))
            r_parts.append(-(a * step))
    return _finish(e, n, needs, grads, r_parts)


# ----------------------------------------------------------------------------- Adam


@register("Adam", domain=TRAINING)
def adam(n, dys, needs, e):
    """Adam (alpha, beta, epsilon eps, norm_coefficient nc, norm_coefficient_post ncp)::

        gr = nc*X + G,  V_new = alpha*V + (1-alpha)*gr,  H_new = beta*H + (1-beta)*gr^2
        s = sqrt(H_new) + eps,  c = sqrt(1-beta^T)/(1-alpha^T) if T > 0 else 1
        X_new = (1-ncp) * (X - R*c*V_new/s)

    With a' = (1-ncp)*dX_new, b = dV_new, h = dH_new, q = (a'/s)*(R*c)::

        dV_new' = b - q,   dH_new' = h + q*V_new / (2*s*sqrt(H_new))
        d gr = (1-alpha)*dV_new' + 2*(1-beta)*gr*dH_new'
        dX = a' + nc*d gr,  dG = d gr,  dV = alpha*dV_new',  dH = beta*dH_new'
        dR = -sum((a'/s)*V_new*c)
    """
    nc = attr(n, "norm_coefficient", 0.0)
    ncp = attr(n, "norm_coefficient_post", 0.0)
    alpha = attr(n, "alpha", 0.9)
    beta = attr(n, "beta", 0.999)
    eps = attr(n, "epsilon", 1e-6)
    m, groups, douts = _groups(n, dys, 4)
    like = n.inputs[2]
    one = e.scalar(1.0, like)
    t = _t_float(e, n, like)
    t = e.Where(_t_positive(e, n), t, one)  # keeps 1 - alpha^T away from 0 where c is 1
    bias = e.Sqrt(1 - beta ** t) / (1 - alpha ** t)
    c = e.Where(_t_positive(e, n), bias, one)
    rc = e.CastLike(n.inputs[0], like) * c
    grads, r_parts = {}, []
    for i, ((ix, ig, iv, ih), (a, b, h)) in enumerate(zip(groups, douts)):
        x = n.inputs[ix]
        v_new, h_new = n.outputs[m + i], n.outputs[2 * m + i]
        gr = _regularized(e, x, n.inputs[ig], nc)
        a = _scale(a, 1.0 - ncp)
        root = e.Sqrt(h_new)
        s = root + eps
        a_s = None if a is None else a / s
        q = _mul(a_s, rc)
        dv_new = _sub(b, q)
        dh_new = e.accumulate(h, None if q is None else q * v_new / (2 * s * root))
        dgr = e.accumulate(_scale(dv_new, 1.0 - alpha), _mul(_scale(gr, 2.0 * (1.0 - beta)), dh_new))
        grads[ix] = e.accumulate(a, _scale(dgr, nc))
        grads[ig] = dgr
        grads[iv] = _scale(dv_new, alpha)
        grads[ih] = _scale(dh_new, beta)
        if needs[0] and a_s is not None:
            r_parts.append(-(a_s * v_new * c))
    return _finish(e, n, needs, grads, r_parts)
