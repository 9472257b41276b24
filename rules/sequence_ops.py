"""Sequence-model ops: CausalConvWithState (opset 27).

CausalConvWithState is a depthwise causal 1-D convolution over ``(B, C, L)`` with a carried
state of the last ``k - 1`` positions. With ``P = concat(past_state or zeros, input)``
(length ``L + k - 1``) and ``U[b, c, t, j] = P[b, c, t + j]`` (the ``k`` taps of output
``t``)::

    conv[b, c, t] = sum_j U[b, c, t, j] w[c, 0, j] + bias[c]
    output        = conv, or silu(conv) = conv * sigmoid(conv)   (activation silu / swish)
    present_state = P[:, :, L:]

The gradient is written with the same taps::

    d conv = d output (activation none), or d output * s (1 + conv (1 - s)), s = sigmoid(conv)
    d P[s] = sum_j w[j] d conv[s - j]   (zero outside 0..L-1)   + d present_state at L..
    d past_state, d input = d P split after k - 1 positions
    d w[c, 0, j] = sum_{b, t} U[b, c, t, j] d conv[b, c, t]      d bias = sum_{b, t} d conv

The activation is evaluated in float32 for float16 / bfloat16 inputs, as the operator does.
With a static kernel size (depthwise causal kernels are short: 2..4) each tap is a slice of
P and each correlation k element-wise products, which onnxruntime runs faster than grouped
Conv / ConvTranspose nodes (and the function body's gradient); otherwise U is gathered at
run time, which needs neither the channel count nor the kernel size.
"""

from __future__ import annotations

import onnx_ir as ir

from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, optional_input
from gradbuilder.rules.helpers import HALF_TYPES, cast_to, wants
from gradbuilder.rules.sizes import INT64_MAX, Dims, iadd, isub, reverse, scalar_of, stack


def _taps(e, x, length, k):
    """U[b, c, t, j] = x[b, c, t + j] for t < length, j < k: (B, C, length, k)."""
    rows = e.Reshape(e.Range(scalar_of(e, 0), scalar_of(e, length), scalar_of(e, 1)), [-1, 1])
    cols = e.Reshape(e.Range(scalar_of(e, 0), scalar_of(e, k), scalar_of(e, 1)), [1, -1])
    return e.Gather(x, e.Add(rows, cols), axis=2)


def _dot_taps(e, u, w):
    """sum_j u[b, c, t, j] w[c, 0, j]: (B, C, T)."""
    return e.reduce("ReduceSum", e.Mul(u, w), [3], keepdims=False)


def _pad_time(e, v, before, after):
    """``v`` (B, C, T) zero-padded on the time axis."""
    return e.Pad(v, stack(e, [0, 0, before, 0, 0, after]))


class _Shifted:
    """The correlations as k shifted slices of P (the kernel size is known statically)."""

    def __init__(self, e, padded, w, k, length):
        self.e, self.padded, self.k = e, padded, k
        self.w = e.Reshape(w, [0, -1])  # (C, k)

    def tap(self, v, j, tail):
        """v[:, :, j : len(v) - tail]"""
        return self.e.Slice(v, self.e.ints([j]), self.e.ints([-tail if tail else INT64_MAX]), self.e.ints([2]))

    def weight(self, j):
        return self.e.Slice(self.w, self.e.ints([j]), self.e.ints([j + 1]), self.e.ints([1]))  # (C, 1)

    def total(self, parts):
        return parts[0] if len(parts) == 1 else self.e.Sum(*parts)

    def conv(self):
        """sum_j P[:, :, j : j + L] w[:, j]"""
        k = self.k
        return self.total([self.e.Mul(self.tap(self.padded, j, k - 1 - j), self.weight(j)) for j in range(k)])

    def input_grad(self, dconv):
        """d P = sum_j w[:, j] (d conv shifted right by j), as a slice of d conv padded on both sides"""
        e, k = self.e, self.k
        padded = _pad_time(e, dconv, k - 1, k - 1)
        return self.total([e.Mul(self.tap(padded, k - 1 - j, j), self.weight(j)) for j in range(k)])

    def weight_grad(self, dconv):
        """d w[:, 0, j] = sum over b, t of P[:, :, j : j + L] d conv"""
        e, k = self.e, self.k
        cols = [e.reduce("ReduceSum", e.Mul(self.tap(self.padded, j, k - 1 - j), dconv), [0, 2], keepdims=True)
                for j in range(k)]  # (1, C, 1) each
        return e.Transpose(e.Concat(*cols, axis=2) if k > 1 else cols[0], perm=[1, 0, 2])


class _Unfolded:
    """The same correlations on the gathered taps U (the kernel size known at run time only)."""

    def __init__(self, e, padded, w, k, length):
        self.e, self.padded, self.w, self.k, self.length = e, padded, w, k, length
        self._u = None

    def taps(self):
        if self._u is None:
            self._u = _taps(self.e, self.padded, self.length, self.k)  # (B, C, L, k)
        return self._u

    def conv(self):
        return _dot_taps(self.e, self.taps(), self.w)

    def input_grad(self, dconv):
        """d P[s] = sum_j w[k-1-j] d conv[s - (k-1) + j]"""
        e, km1 = self.e, isub(self.e, self.k, 1)
        back = _taps(e, _pad_time(e, dconv, km1, km1), iadd(e, self.length, km1), self.k)
        return _dot_taps(e, back, reverse(e, self.w, [2]))

    def weight_grad(self, dconv):
        """(C, 1, B * L) @ (C, B * L, k) -> (C, 1, k)"""
        e = self.e
        lhs = e.Reshape(e.Transpose(dconv, perm=[1, 0, 2]), [0, 1, -1])
        rhs = e.Reshape(e.Transpose(self.taps(), perm=[1, 0, 2, 3]), stack(e, [0, -1, self.k]))
        return e.MatMul(lhs, rhs)


def _silu_slope(e, conv, like):
    """d silu(c) / dc = s (1 + c (1 - s)), in float32 for float16 / bfloat16."""
    wide = ir.DataType.FLOAT if like.dtype in HALF_TYPES else None
    c = cast_to(e, conv, wide)
    s = e.Sigmoid(c)
    one = e.scalar(1.0, like=c)
    return e.Mul(s, e.Add(one, e.Mul(c, e.Sub(one, s)))), wide


@register("CausalConvWithState")
def causal_conv_with_state(n, dys, needs, e):
    """See the module doc. With a static kernel size the correlations are k shifted
    slices; otherwise they run on the unfolded taps."""
    x, w = n.inputs[:2]
    bias, past = optional_input(n, 2), optional_input(n, 3)
    dy, d_present = (list(dys) + [None])[:2]
    need_x, need_w, need_b = needs[0], needs[1], wants(needs, 2)
    need_past = wants(needs, 3)
    k, length = Dims(e, w)[2], Dims(e, x)[2]
    km1 = isub(e, k, 1)
    padded = e.Concat(past, x, axis=2) if past is not None else _pad_time(e, x, km1, 0)
    ops = (_Shifted if isinstance(k, int) else _Unfolded)(e, padded, w, k, length)

    dconv = dy
    if dy is not None and attr(n, "activation", "none") in ("silu", "swish"):
        conv = ops.conv()
        if bias is not None:
            conv = e.Add(conv, e.Unsqueeze(bias, [1]))
        slope, wide = _silu_slope(e, conv, x)
        dconv = cast_to(e, e.Mul(cast_to(e, dy, wide), slope), x.dtype if wide else None)

    dx = dpast = dw = db = None
    if need_x or need_past:
        parts = [ops.input_grad(dconv)] if dconv is not None else []
        if d_present is not None:  # present_state = P[:, :, L:]
            parts.append(_pad_time(e, d_present, length, 0))
        if parts:
            dpad = parts[0] if len(parts) == 1 else e.Add(*parts)
            cut = e.ints([km1]) if isinstance(km1, int) else km1
            dx = e.Slice(dpad, cut, e.ints([INT64_MAX]), e.ints([2])) if need_x else None
            dpast = e.Slice(dpad, e.ints([0]), cut, e.ints([2])) if need_past else None
    if need_w and dconv is not None:
        dw = ops.weight_grad(dconv)
    if need_b and dconv is not None:
        db = e.reduce("ReduceSum", dconv, [0, 2], keepdims=False)
    grads = [dx, dw, db, dpast]
    return [(g if g is not None else e.zeros_like(v)) if need else None
            for v, need, g in zip(n.inputs, needs, grads)]
