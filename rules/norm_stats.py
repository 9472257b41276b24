"""Normalization statistics shared by the normalization rules (normalization.py, contrib.py,
misc_norm.py). A helper module: it registers no rule.

Over the normalized axes (M elements)::

    mu = mean(x), r = 1/sqrt(mean((x - mu)^2) + eps), xhat = (x - mu) r

(``centered=False``, RMS normalization: mu = 0, r = 1/sqrt(mean(x^2) + eps), xhat = x r), and
the standard backward, with g = dxhat and the gradients dmu, dr, dvar arriving at outputs that
expose mu, r or the variance::

    dx = r (g - mean(g) - xhat mean(g xhat)) + (dmu - dr r^2 xhat + (2 dvar / r) xhat)/M

(no mean(g) and no dmu when not centered). The dtype the statistics are computed in is
:func:`gradbuilder.rules.helpers.compute_type`.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradbuilder.compiler.values import dims_of
from gradbuilder.rules.helpers import cast_to


def trailing_axes(e, x, axis):
    """The axes [axis, rank) of ``x``: a list when the rank is known (or axis < 0), else a
    Range computed at run time."""
    d = dims_of(x)
    if d is not None:
        return list(range(axis % len(d), len(d))) if d else []
    if axis < 0:
        return list(range(axis, 0))
    rank = e.Size(e.Shape(x))
    return e.Range(e.const(np.array(axis, np.int64)), rank, e.const(np.array(1, np.int64)))


def count_over(e, like, axes, reduced=None):
    """M, the number of elements of ``like`` over ``axes`` (a list or an int64 value), in
    ``like``'s dtype: a constant when static; else Size(like) / Size(reduced) when a reduction
    of ``like`` over the axes is at hand, or the product of the axes' sizes (float when like's
    dtype is unknown before opset 15, as ``e.scalar`` assumes)."""
    d = dims_of(like)
    if isinstance(axes, list) and d is not None and all(isinstance(d[a], int) for a in axes):
        return e.scalar(float(np.prod([d[a] for a in axes])), like)
    if reduced is not None:
        return e.CastLike(e.Size(like) / e.Size(reduced), like)
    index = e.ints(axes) if isinstance(axes, list) else axes
    count = e.reduce("ReduceProd", e.Gather(e.Shape(like), index, axis=0), None, keepdims=False)
    if like.dtype is not None or e.opset >= 15:
        return e.CastLike(count, like)
    return e.Cast(count, to=int(ir.DataType.FLOAT))


class Moments:
    """mu, r = 1/sqrt(var + eps) and xhat of ``x`` over ``axes`` (a list or an int64 value),
    and the standard backward of a normalization by them.

    ``form`` says how a mean is written; each rule keeps the form (and the order of the
    backward's subtractions) it had before the rules shared this class, so no rule's rounding
    changed:

    * ``"sum"`` (BatchNormalization, Instance and GroupNormalization): ReduceSum / M, M =
      Size(x) / Size(the first sum) when not static; the backward subtracts mean(g) first:
      ``(g - mean(g)) - xhat mean(g xhat)``;
    * ``"mean"`` (LayerNormalization, RMSNormalization, the com.microsoft normalizations; one
      node per mean where "sum" takes two, 24 fewer per step in a 12-norm encoder): ReduceMean (ReduceSum / M
      for axes given at run time before opset 18, where ReduceMean takes no axes input); the
      backward subtracts the projection first: ``(g - xhat mean(g xhat)) - mean(g)``.
    """

    def __init__(self, e, x, axes, eps, centered: bool = True, form: str = "sum", saved=None, xhat=None):
        """``saved``: (mu, r) as the forward node computed them (its Mean and InvStdDev
        outputs), taken instead of computing them again; ``xhat`` with them: xhat as the
        caller computes it (one normalization kernel instead of a Sub and a Mul)."""
        if form not in ("sum", "mean"):
            raise ValueError(f"unknown form {form!r}")
        self.e, self.x, self.axes, self.centered, self.form = e, x, axes, centered, form
        self._count = None
        if saved is not None:
            self.mu, self.r = (cast_to(e, v, x.dtype) for v in saved)
            self.xhat = xhat if xhat is not None else (x - self.mu if centered else x) * self.r
            return
        self.mu = self.mean(x) if centered else None
        d = x - self.mu if centered else x
        self.r = e.Reciprocal(e.Sqrt(self.mean(d * d) + eps))
        self.xhat = d * self.r

    @property
    def count(self):
        """M, the number of elements per statistic, in x's dtype (emitted on first use)."""
        if self._count is None:
            self._count = count_over(self.e, self.x, self.axes)
        return self._count

    def mean(self, v):
        """The mean of ``v`` (shaped like x) over the axes, keepdims."""
        e = self.e
        if self.form == "mean" and (isinstance(self.axes, list) or e.opset >= 18):
            return e.reduce("ReduceMean", v, self.axes, keepdims=True)
        total = e.reduce("ReduceSum", v, self.axes, keepdims=True)
        if self._count is None and self.form == "sum":
            self._count = count_over(e, self.x, self.axes, total)
        return total / self.count

    def backward(self, g, dmu=None, dr=None, dvar=None):
        """dx from g = dxhat and the gradients of mu, r and var = mean((x - mu)^2) (any may be
        None; dmu counts only when centered); None when none flows."""
        e, xhat, r = self.e, self.xhat, self.r
        dx = None
        if g is not None:
            projection = lambda: xhat * self.mean(g * xhat)  # noqa: E731
            if not self.centered:
                inner = g - projection()
            elif self.form == "sum":
                inner = g - self.mean(g) - projection()
            else:
                inner = g - projection() - self.mean(g)
            dx = r * inner
        extra = None
        if dmu is not None and self.centered:
            extra = cast_to(e, dmu, xhat.dtype)
        if dr is not None:
            part = cast_to(e, dr, xhat.dtype) * (r * r) * xhat
            extra = -part if extra is None else extra - part
        if dvar is not None:
            part = cast_to(e, dvar, xhat.dtype) * 2 / r * xhat
            extra = part if extra is None else extra + part
        if extra is None:
            return dx
        extra = extra / self.count
        if dx is not None:
            return dx + extra
        # dmu alone is one value per statistic: broadcast it to x's shape
        return e.expand_like(extra, xhat) if dr is None and dvar is None else extra
