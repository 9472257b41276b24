"""Normalization layers: BatchNormalization LayerNormalization InstanceNormalization
GroupNormalization.

All of them standardize x over some axes and then scale and shift it::

    mu = mean(x), r = 1/sqrt(mean((x-mu)^2) + eps), xhat = (x - mu)*r, y = scale*xhat + B

Over the normalized axes (M elements), with g = dxhat = dy*scale::

    dx = r*(g - mean(g) - xhat*mean(g*xhat)) + (dmu - dr*r^2*xhat)/M

where dmu and dr are the gradients arriving at outputs that expose mu and r (LayerNormalization's
Mean and InvStdDev). dscale = sum(dy*xhat) and dB = sum(dy) over the broadcast axes.

BatchNormalization, InstanceNormalization and GroupNormalization work on x reshaped to
(N, C, L) (or (N, G, L) for the groups), so the statistics axes are static whatever the rank.
The statistics and the backward through them are :class:`gradbuilder.rules.norm_stats.Moments`.
"""

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, dims_of
from gradbuilder.rules.helpers import cast_to, compute_type, wants
from gradbuilder.rules.norm_stats import Moments, trailing_axes
from gradbuilder.rules.sizes import static_dims

# ----------------------------------------------------------------------------- shared pieces


def _grouped(e, v, like, groups=0):
    """``v`` (shaped like ``like``: N, C, d1..dk) as (N, groups, L); groups=0 keeps C."""
    dims = dims_of(like)
    if static_dims(dims) and len(dims) >= 2:
        lead = dims[1] if groups == 0 else groups
        return e.Reshape(v, [dims[0], lead, int(np.prod(dims)) // (dims[0] * lead)])
    return e.Reshape(v, [0, groups, -1])


def _ungrouped(e, v, like):
    """``v`` reshaped back to the shape of ``like``."""
    dims = dims_of(like)
    out = e.Reshape(v, list(dims)) if static_dims(dims) else e.Reshape(v, e.Shape(like))
    e.typed(out, v.dtype, dims)
    return out


def _per_channel(e, v, like):
    """A (C,) vector as (C, 1), to broadcast against (N, C, L), in the dtype of ``like``."""
    return e.Unsqueeze(e.CastLike(v, like), [1])


def _sum_nl(e, v):
    """(N, C, L) -> (C,): the sum over batch and spatial axes."""
    return e.reduce("ReduceSum", v, [0, 2], keepdims=False)


# ----------------------------------------------------------------------------- BatchNormalization


def _batch_norm(n, dys, needs, e, training):
    """The shared BatchNormalization gradient. In training mode the running statistics are
    running_mean = momentum*input_mean + (1-momentum)*mu and running_var = momentum*input_var
    + (1-momentum)*var (population variance), so input_mean/input_var get momentum times their
    gradient and x gets (1-momentum) times it through mu and var. BatchNormalization-9 also
    outputs saved_mean = mu; its saved_var has no agreed meaning (onnxruntime returns
    1/sqrt(var + eps)), so a gradient arriving there is refused."""
    x, scale, b, mean, var = n.inputs[:5]
    dys = list(dys) + [None] * (5 - len(dys))
    dy, drm, drv, dsaved_mu, dsaved_var = dys[:5]
    if dsaved_var is not None:
        raise GradientRuleError(
            "BatchNormalization-9: gradients through saved_var are not supported (the spec calls it the "
            "saved variance; onnxruntime returns 1/sqrt(var + eps))")
    if not training:
        drm = drv = None  # no running outputs in inference mode
    if dy is None and drm is None and drv is None and dsaved_mu is None:
        return [None] * 5
    eps = attr(n, "epsilon", 1e-5)
    momentum = attr(n, "momentum", 0.9)
    ct = compute_type(x)
    x3 = _grouped(e, cast_to(e, x, ct), x)
    dy3 = _grouped(e, cast_to(e, dy, ct), x) if dy is not None else None
    scale_c = _per_channel(e, scale, x3)
    dx = dscale = db = dmean = dvar = None
    if training:
        s = Moments(e, x3, [0, 2], eps)
        xhat = s.xhat
        if needs[0]:
            rest = 1.0 - momentum
            dmu = _per_channel(e, dsaved_mu, x3) if dsaved_mu is not None else None
            if drm is not None:
                part = rest * _per_channel(e, drm, x3)
                dmu = part if dmu is None else dmu + part
            dv = rest * _per_channel(e, drv, x3) if drv is not None else None
            dx = s.backward(dy3 * scale_c if dy3 is not None else None, dmu=dmu, dvar=dv)
        if needs[3] and drm is not None:  # d/dinput_mean = d running_mean * momentum
            dmean = e.CastLike(drm * momentum, mean)
        if needs[4] and drv is not None:
            dvar = e.CastLike(drv * momentum, var)
    else:
        r = e.Reciprocal(e.Sqrt(_per_channel(e, var, x3) + eps))
        xhat = (x3 - _per_channel(e, mean, x3)) * r
        if needs[0]:
            dx = dy3 * (scale_c * r)
    if dy3 is not None:
        sum_dy_xhat = _sum_nl(e, dy3 * xhat) if (needs[1] or (needs[4] and not training)) else None
        sum_dy = _sum_nl(e, dy3) if (needs[2] or (needs[3] and not training)) else None
        if needs[1]:
            dscale = e.CastLike(sum_dy_xhat, scale)
        if needs[2]:
            db = e.CastLike(sum_dy, b)
        if not training:
            r_c = e.Squeeze(r, [1])
            scale_v = e.CastLike(scale, x3)
            if needs[3]:  # d/dmean = -(sum(dy)*(scale*r))
                dmean = e.CastLike(-(sum_dy * (scale_v * r_c)), mean)
            if needs[4]:  # d/dvar = (-1/2 * (scale * r^2)) * sum(dy*xhat)
                half = -0.5 * (scale_v * (r_c * r_c))
                dvar = e.CastLike(half * sum_dy_xhat, var)
    if dx is not None:
        dx = e.CastLike(_ungrouped(e, dx, x), x)
    return dx, dscale, db, dmean, dvar


@register("BatchNormalization")
def batch_norm_9(n, dys, needs, e):
    """BatchNormalization-9: inference mode y = scale*(x-mean)/sqrt(var+eps) + B when it has one
    output; with the training outputs (Y, mean, var, saved_mean, saved_var) Y uses the batch
    statistics mu, var (population variance over all axes but 1); the running
    mean = momentum*input_mean + (1-momentum)*mu and var = momentum*input_var + (1-momentum)*var
    pass momentum times their gradient to input_mean/input_var and the rest to x through mu and
    var; saved_mean = mu."""
    return _batch_norm(n, dys, needs, e, training=len(n.outputs) > 1)


@register("BatchNormalization", since=14)
def batch_norm(n, dys, needs, e):
    """BatchNormalization-14/15: training_mode=0: y = scale*(x-mean)/sqrt(var+eps) + B,
    dx = dy*(scale*r), dmean = -(sum(dy)*(scale*r)), dvar = (-1/2*(scale*r^2))*sum(dy*xhat);
    training_mode=1: y = scale*xhat + B with the batch statistics mu, var (population variance
    over all axes but 1), dx through those statistics; running_mean = momentum*input_mean +
    (1-momentum)*mu and running_var = momentum*input_var + (1-momentum)*var: their gradients
    reach input_mean/input_var times momentum, and x through mu and var times (1-momentum)."""
    return _batch_norm(n, dys, needs, e, training=bool(attr(n, "training_mode", 0)))


# ----------------------------------------------------------------------------- LayerNormalization


@register("LayerNormalization", since=17)
def layer_norm(n, dys, needs, e):
    """LayerNormalization-17: statistics over axes [axis, rank); Y = xhat*Scale + B,
    Mean = mu, InvStdDev = r (computed in stash_type; the backward reads them from the node,
    whose outputs ``passes.expose_masks`` adds where a weight reaches it).
    dX = r*(g - xhat*mean(g*xhat) - mean(g)) + (dMean - dInvStdDev*r^2*xhat)/M with g = dY*Scale;
    dScale = unbroadcast(dY*xhat), dB = unbroadcast(dY)."""
    x, scale = n.inputs[:2]
    b = n.inputs[2] if len(n.inputs) > 2 else None
    dy, dmu, dr = (list(dys) + [None, None])[:3]
    xc = cast_to(e, x, compute_type(x, attr(n, "stash_type", 1)))
    outs = list(n.outputs)
    saved = (outs[1], outs[2]) if len(outs) == 3 and all(o is not None and o.name for o in outs[1:]) else None
    axes = trailing_axes(e, x, attr(n, "axis", -1))
    s = Moments(e, xc, axes, attr(n, "epsilon", 1e-5), form="mean", saved=saved,
                xhat=_normalized(e, n, xc, axes) if saved is not None else None)
    dx = dscale = db = None
    if dy is not None:
        xhat = e.CastLike(s.xhat, x)
        if needs[1]:
            dscale = e.unbroadcast(dy * xhat, scale)
        if wants(needs, 2):
            db = e.unbroadcast(dy, b)
    if needs[0]:
        dxhat = e.CastLike(dy * scale, xc) if dy is not None else None
        dx = s.backward(dxhat, dmu, dr)
        dx = e.CastLike(dx, x) if dx is not None else None
    return [dx, dscale, db][: len(n.inputs)]


def _normalized(e, n, xc, axes):
    """xhat of a LayerNormalization as the same node computes it without its affine part
    (Scale 1, B 0), where the normalized dims are known; else None."""
    d = dims_of(xc)
    if not isinstance(axes, list) or d is None or not all(isinstance(d[a], int) for a in axes):
        return None
    shape = [d[a] for a in axes]
    ones, zeros = (e.const(np.full(shape, v, xc.dtype.numpy())) for v in (1, 0))
    xhat = e.op("LayerNormalization", xc, ones, zeros, axis=axes[0], epsilon=attr(n, "epsilon", 1e-5),
                stash_type=attr(n, "stash_type", 1))
    return e.typed(xhat, xc.dtype, d)


# ----------------------------------------------------------------------------- Instance/GroupNormalization


def _grouped_norm(n, dys, needs, e, groups, per_group_affine, stash):
    """Statistics per (n, group) over the group's channels and the spatial axes; scale and B are
    per group (``per_group_affine``) or per channel. groups=0 means one group per channel."""
    x, scale, b = n.inputs[:3]
    (dy,) = dys[:1]
    if dy is None:
        return None, None, None
    ct = compute_type(x, stash)
    xg = _grouped(e, cast_to(e, x, ct), x, groups)
    s = Moments(e, xg, [2], attr(n, "epsilon", 1e-5))
    if per_group_affine:
        dy_a = _grouped(e, dy, x, groups)
        xhat_a = e.CastLike(s.xhat, x)
    else:  # affine per channel: (N, C, L)
        dy_a = _grouped(e, dy, x)
        xhat_a = e.CastLike(s.xhat if groups == 0 else _ungrouped(e, s.xhat, dy_a), x)
    scale_a = _per_channel(e, scale, dy_a)
    dx = dscale = db = None
    if needs[0]:
        dxhat = dy_a * scale_a
        if not per_group_affine and groups != 0:
            dxhat = _grouped(e, dxhat, x, groups)
        dx = e.CastLike(_ungrouped(e, s.backward(e.CastLike(dxhat, xg)), x), x)
    if needs[1]:
        dscale = e.CastLike(_sum_nl(e, dy_a * xhat_a), scale)
    if needs[2]:
        db = e.CastLike(_sum_nl(e, dy_a), b)
    return dx, dscale, db


@register("InstanceNormalization")
def instance_norm(n, dys, needs, e):
    """InstanceNormalization: statistics per (n, c) over the spatial axes; y = scale[c]*xhat + B[c]."""
    return _grouped_norm(n, dys, needs, e, 0, False, int(ir.DataType.FLOAT))


@register("GroupNormalization", since=18)
def group_norm_18(n, dys, needs, e):
    """GroupNormalization-18: statistics per (n, group); scale and bias per group:
    y = scale[g]*xhat + bias[g]."""
    return _grouped_norm(n, dys, needs, e, attr(n, "num_groups"), True, int(ir.DataType.FLOAT))


@register("GroupNormalization", since=21)
def group_norm(n, dys, needs, e):
    """GroupNormalization-21: statistics per (n, group) in stash_type; scale and bias per channel:
    y = scale[c]*xhat + bias[c]."""
    return _grouped_norm(n, dys, needs, e, attr(n, "num_groups"), False, attr(n, "stash_type", 1))
