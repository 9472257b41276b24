"""Losses: SoftmaxCrossEntropyLoss NegativeLogLikelihoodLoss.

With lp the log-probabilities (N, C, d1..dk), labels t and class weights w (1 without)::

    M[n,c,..] = (t[n,..] == c) and (t[n,..] != ignore_index)      (one-hot of the kept targets)
    nll[n,..] = -sum_c M*lp,  W[n,..] = sum_c M*w,  loss[n,..] = W*nll
    reduction: none -> loss, sum -> sum(loss), mean -> sum(loss)/sum(W)

The one-hot is an Equal against a Range of the classes, so targets outside [0, C) (such as
ignore_index=-100) give an all-zero row and never index anything. With c the gradient each
sample's loss receives (dy, dy broadcast, or dy/sum(W))::

    dlp = -(c*(M*w))                   (NegativeLogLikelihoodLoss: d input)
    dscores = G - softmax*sum_c(G),    G = dlp + d log_prob   (SoftmaxCrossEntropyLoss)
    dw[c] = sum over n,d of M*(c*nll)          (none, sum)
    dw[c] = sum over n,d of M*(c*(nll - L))    (mean, L = the loss output)
"""

import numpy as np
import onnx_ir as ir

from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, dims_of
from gradbuilder.rules.helpers import optional_output, text_attr, wants


def _class_vector(e, v, x):
    """A (C,) vector shaped (C, 1, .., 1) so it broadcasts along axis 1 of ``x`` (N, C, d..)."""
    dims = dims_of(x)
    if dims is not None:
        return e.Unsqueeze(v, list(range(1, len(dims) - 1))) if len(dims) > 2 else v
    extra = e.Shape(e.Shape(x)) - e.ints([2])
    ones = e.op("ConstantOfShape", extra, value=ir.tensor(np.array([1], dtype=np.int64)))
    return e.Reshape(v, e.op("Concat", e.ints([-1]), ones, axis=0))


def _classes(e, x):
    """Range(0, C) as int64."""
    dims = dims_of(x)
    if dims is not None and isinstance(dims[1], int):
        return e.const(np.arange(dims[1], dtype=np.int64))
    c = e.Gather(e.Shape(x), e.const(np.array(1, dtype=np.int64)), axis=0)
    return e.Range(e.const(np.array(0, dtype=np.int64)), c, e.const(np.array(1, dtype=np.int64)))


def _may_be_a_class(index, x):
    """False when ``index`` is statically outside [0, C): the one-hot already excludes it."""
    dims = dims_of(x)
    return dims is None or not isinstance(dims[1], int) or 0 <= index < dims[1]


def _target_mask(e, x, labels, ignore_index):
    """M, the one-hot of the labels along axis 1 without the ignored targets (bool)."""
    t = e.Unsqueeze(labels if labels.dtype == ir.DataType.INT64 else e.Cast(labels, to=int(ir.DataType.INT64)), [1])
    onehot = e.Equal(t, _class_vector(e, _classes(e, x), x))
    if ignore_index is not None and _may_be_a_class(ignore_index, x):
        onehot = e.And(onehot, e.Not(e.Equal(t, e.const(np.array(ignore_index, dtype=np.int64)))))
    return onehot


def _sum_but_classes(e, v, x):
    """(N, C, d..) -> (C,)."""
    dims = dims_of(x)
    if dims is not None:
        return e.reduce("ReduceSum", v, [0] + list(range(2, len(dims))), keepdims=False)
    return e.reduce("ReduceSum", e.Reshape(v, [0, 0, -1]), [0, 2], keepdims=False)


def _loss_grads(n, dy, needs, e, lp):
    """(d lp from the loss output, d weights); ``lp`` are the log-probabilities (N, C, d..)."""
    x, labels = n.inputs[:2]
    weights = n.inputs[2] if len(n.inputs) > 2 else None
    reduction = text_attr(n, "reduction", "mean")
    keep = _target_mask(e, x, labels, attr(n, "ignore_index", None))
    m = e.CastLike(keep, x)
    w = _class_vector(e, e.CastLike(weights, x), x) if weights is not None else None
    mw = m * w if w is not None else m
    if reduction == "none":
        c = e.Unsqueeze(dy, [1])
    elif reduction == "sum":
        c = dy
    else:
        c = dy / e.reduce("ReduceSum", mw, None, keepdims=False)
    dlp = -(c * mw)
    dw = None
    if wants(needs, 2):
        # Where, not M*lp: log-probabilities of other classes may be -inf
        nll = -e.reduce("ReduceSum", e.Where(keep, lp, e.scalar(0.0, lp)), [1], keepdims=True)
        if reduction == "mean":
            nll = nll - n.outputs[0]
        dw = e.CastLike(_sum_but_classes(e, m * (c * nll), x), weights)
    return dlp, dw


@register("NegativeLogLikelihoodLoss")
def nll_loss(n, dys, needs, e):
    """loss = -w[t]*input[n, t, ..] (0 for ignored targets), reduced:
    d input = -(c*(M*w)), d w[c] = sum M*(c*nll) (nll minus the mean loss for 'mean')."""
    (dy,) = dys
    dinput, dw = _loss_grads(n, dy, needs, e, n.inputs[0])
    return [dinput if needs[0] else None, None, dw][: len(n.inputs)]


@register("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(n, dys, needs, e):
    """log_prob = LogSoftmax(scores, axis=1); loss = NegativeLogLikelihoodLoss(log_prob):
    G = -(c*(M*w)) + d log_prob, d scores = G - softmax*sum_c(G)."""
    x = n.inputs[0]
    dy, dlog_prob = (list(dys) + [None])[:2]
    lp = optional_output(n, 1)
    if lp is None:
        lp = e.LogSoftmax(x, axis=1)
    g, dw = _loss_grads(n, dy, needs, e, lp) if dy is not None else (None, None)
    if dlog_prob is not None:
        g = dlog_prob if g is None else g + dlog_prob
    dx = None
    if needs[0] and g is not None:
        dx = g - e.Exp(lp) * e.reduce("ReduceSum", g, [1], keepdims=True)
    return [dx, None, dw][: len(n.inputs)]
