"""Signal ops: DFT and STFT.

Both are linear in their float inputs, so each gradient is the adjoint transform applied to
dy. Complex values are pairs (re, im) on the last axis; a real input has a last axis of 1
and gets the real part of the complex gradient.

The N-point DFT matrix F (F[k, n] = exp(-2 pi i k n / N)) is symmetric, so the adjoint of
F is conj(F) and that of the inverse F^H / N is conj(F^H) / N: the adjoint of either
direction is ``conj(DFT(conj(g)))`` with the same direction and length, computed by the DFT
op itself. What surrounds the transform is moved back by its own adjoint: the input cut or
zero-padded to ``dft_length`` (pad or cut dy back), the one-sided output (zero-pad dy to
the full spectrum), STFT's framing (overlap-add) and window (a product).
"""

from __future__ import annotations

import numpy as np

from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, constant_of, optional_input
from gradbuilder.rules.helpers import accumulation_type, cast_to, const_like, wants
from gradbuilder.rules.sizes import (
    Dims,
    as_int64,
    iadd,
    idiv,
    imax,
    imul,
    is_one,
    isub,
    iwrap,
    pad_axis,
    scalar_of,
    stack,
    with_unit_axes,
    vec,
    zeros,
)

# ----------------------------------------------------------------------------- helpers


def _conj(e, v):
    """Complex conjugate of (re, im) pairs on the last axis."""
    return v * const_like(e, [1.0, -1.0], v)


def _fit(e, v, axis, have, want, rank):
    """``v`` cut, or zero-padded at the end, along ``axis`` from ``have`` to ``want`` elements
    (sizes: ints, or 1-element int64 tensors)."""
    if isinstance(have, int) and isinstance(want, int):
        if have == want:
            return v
        if have > want:
            return e.Slice(v, e.ints([0]), e.ints([want]), vec(e, axis))
        return pad_axis(e, v, rank, axis, 0, want - have)
    padded = pad_axis(e, v, rank, axis, 0, imax(e, isub(e, want, have), 0))
    return e.Slice(padded, e.ints([0]), vec(e, want), vec(e, axis))


def _as_parts(e, v, parts):
    """Complex gradient ``v`` (..., 2) for an input with ``parts`` (1: real, 2: complex) on
    the last axis: the real part alone for a real input."""
    if parts == 2:
        return v
    return e.Slice(v, e.ints([0]), vec(e, parts), e.ints([-1]))


def _size(e, v):
    """A scalar int input (constant or not) as a size."""
    c = constant_of(v)
    if c is not None:
        return int(np.asarray(c).reshape(-1)[0])
    return e.Reshape(as_int64(e, v), [1])


# ----------------------------------------------------------------------------- DFT


def _irfft_weights(e, count, bins, trailing, like):
    """w_k for k < bins = N//2 + 1: 1 at k = 0 and (N even) k = N/2, else 2 (those bins
    stand for themselves and their mirror image), along the axis."""
    if isinstance(count, int) and isinstance(trailing, int):
        w = np.full(bins, 2.0)
        w[0] = 1.0
        if count % 2 == 0:
            w[-1] = 1.0
        return const_like(e, w.reshape([-1] + [1] * trailing), like)
    k = e.Range(scalar_of(e, 0), scalar_of(e, bins), scalar_of(e, 1))
    ends = e.Or(e.Equal(k, e.ints([0])), e.Equal(k * e.ints([2]), vec(e, count)))
    w = e.Where(ends, const_like(e, 1.0, like), const_like(e, 2.0, like))
    return with_unit_axes(e, w, 1, trailing)


@register("DFT", since=17)
def dft(n, dys, needs, e):
    """y = F_N P x along the axis (N = dft_length, P cuts or zero-pads x to N), with
    inverse=1 y = conj(F_N) P x / N; onesided=1 keeps the first N//2 + 1 bins (S).

    dx = P^T conj(F conj(S^T dy)) with F the same transform as the forward (S^T pads with
    zeros to N bins; P^T pads or cuts back to the input length), the real part for a real x.

    IRFFT (inverse=1, onesided=1): y_n = Re(sum over k < N//2 + 1 of w_k c_k e^(2 pi i k n/N)) / N
    with w_k = 1 at k = 0 and (N even) N/2, else 2 (the mirrored bins; the imaginary parts
    of those two bins drop out), c the input cut or padded to N//2 + 1 bins. So
    dc_k = w_k conj(IDFT(dy))_k: the first N//2 + 1 bins of conj(IDFT(dy)) = F dy / N.

    The axis and dft_length may be constants or given at run time."""
    x = n.inputs[0]
    (dy,) = dys
    inverse, onesided = attr(n, "inverse", 0), attr(n, "onesided", 0)
    dims = Dims(e, x)
    if e.opset < 20:
        raw_axis = attr(n, "axis", 1)
    else:
        axis_in = optional_input(n, 2)
        raw_axis = -2 if axis_in is None else _size(e, axis_in)
    rank = dims.rank
    if isinstance(raw_axis, int) and rank is not None:
        axis = raw_axis % rank
    else:
        axis = iwrap(e, raw_axis, dims.rank_value())
    length, parts = dims[axis], dims[-1]
    irfft = bool(inverse and onesided)
    length_in = optional_input(n, 1)
    if length_in is not None:
        count = _size(e, length_in)
    else:
        count = imul(e, isub(e, length, 1), 2) if irfft else length
    bins = iadd(e, idiv(e, count, 2), 1)
    if irfft:
        spectrum = _conj(e, e.DFT(dy, raw_axis, inverse=1))
        trailing = isub(e, isub(e, dims.rank_value(), axis), 1)
        g = _irfft_weights(e, count, bins, trailing, dy) * _fit(e, spectrum, axis, count, bins, rank)
        have = bins
    else:
        g = _fit(e, dy, axis, bins, count, rank) if onesided else dy
        g = e.DFT(_conj(e, g), raw_axis, inverse=inverse)
        g = g if is_one(parts) else _conj(e, g)  # a real x drops the imaginary part anyway
        have = count
    return (_as_parts(e, _fit(e, g, axis, have, length, rank), parts),)


# ----------------------------------------------------------------------------- STFT


@register("STFT", since=17)
def stft(n, dys, needs, e):
    """y[b, f, k] = sum over t < W of x[b, f s + t] w[t] e^(-2 pi i k t / W): frames of
    length W = frame_length at steps s, times the window (ones when absent), each through a
    W-point DFT (onesided=1 keeps the first W//2 + 1 bins).

    dz = conj(DFT(conj(dy))) per frame (dy zero-padded to W bins when onesided; the real
    part for a real signal), then dw[t] = sum over b, f and the (re, im) parts of
    dz[b, f, t] x[b, f s + t], and dx = the overlap-add of dz[b, f, t] w[t] at f s + t
    (ScatterElements with reduction="add"). frame_step, frame_length and every size may be
    given at run time."""
    signal, step_in, window, length_in = (optional_input(n, i) for i in range(4))
    (dy,) = dys
    sd = Dims(e, signal)
    if length_in is not None:
        width = _size(e, length_in)
    elif window is not None:
        width = Dims(e, window)[0]
    else:
        width = sd[1]
    step = _size(e, step_in)
    frames = iadd(e, idiv(e, isub(e, sd[1], width), step), 1)
    g = dy
    if attr(n, "onesided", 1):
        # the sizes come from the spec, not from dy's static shape: onnx's shape inference
        # (1.23) takes a missing onesided for 0, the spec and the runtimes for 1. The Slice
        # does nothing at run time; it gives the padded dy the static size W either way.
        g = pad_axis(e, g, 4, 2, 0, isub(e, width, iadd(e, idiv(e, width, 2), 1)))
        g = e.Slice(g, e.ints([0]), vec(e, width), e.ints([2]))
    g = e.DFT(_conj(e, g), 2)
    parts = sd[2]
    dz = _as_parts(e, g if is_one(parts) else _conj(e, g), parts)  # (B, F, W, C)

    starts = e.Range(scalar_of(e, 0), scalar_of(e, frames), scalar_of(e, 1)) * vec(e, step)
    offsets = e.Range(scalar_of(e, 0), scalar_of(e, width), scalar_of(e, 1))
    where = e.Unsqueeze(starts, [1]) + e.Unsqueeze(offsets, [0])  # (F, W): f s + t

    dsignal = dwindow = None
    if wants(needs, 2):
        framed = e.Gather(signal, where, axis=1)  # (B, F, W, C)
        dwindow = e.reduce("ReduceSum", dz * framed, [0, 1, 3], keepdims=False)
    if needs[0]:
        dframes = dz * e.Reshape(window, [-1, 1]) if window is not None else dz
        flat = e.Reshape(dframes, stack(e, [0, -1, parts]))  # (B, F W, C)
        acc = accumulation_type(signal, False)
        positions = e.Expand(e.Reshape(where, [1, -1, 1]), e.Shape(flat))
        summed = e.ScatterElements(zeros(e, sd.vector(), signal, acc), positions, cast_to(e, flat, acc),
                                   axis=1, reduction="add")
        dsignal = cast_to(e, summed, signal.dtype)
    return (dsignal, None, dwindow, None)[:len(n.inputs)]
