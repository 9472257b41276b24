"""Selections: TopK Compress OneHot Unique.

Each output element is an element of a float input picked by position (TopK, Compress,
Unique) or one of two given values (OneHot), so each gradient sends dy back to the positions
it was read from: a scatter into zeros (TopK, Compress), a gather through the inverse indices
(Unique, shared evenly between tied entries), sums over the hot and cold positions (OneHot).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr
from gradbuilder.rules.helpers import optional_output
from gradbuilder.rules.sizes import Dims, ordinals, reshape_like, zeros


@register("TopK")
def topk(n, dys, needs, e):
    """values = x at indices along axis (each position at most once): dx = zeros with
    d values written at indices; the Indices output carries no gradient."""
    x = n.inputs[0]
    dv = dys[0]
    if dv is None:
        return (None, None)
    return (e.ScatterElements(e.zeros_like(x), n.outputs[1], dv, axis=attr(n, "axis", -1)), None)


@register("Compress")
def compress(n, dys, needs, e):
    """y = the slices (or, without axis, the flattened elements) of x where condition is
    true: the same Compress applied to the element numbers of x tells where each element of
    y came from, and ScatterElements writes dy there into zeros."""
    x, condition = n.inputs
    (dy,) = dys
    axis = attr(n, "axis")
    picked = e.op("Compress", ordinals(e, x), condition, axis=axis)
    flat = e.ScatterElements(zeros(e, e.Reshape(e.Size(x), [1]), x), e.Reshape(picked, [-1]),
                             e.Reshape(dy, [-1]), axis=0)
    return reshape_like(e, flat, x), None


@register("OneHot")
def one_hot(n, dys, needs, e):
    """y = where(hot, on, off) with values = [off, on]: d values = [sum(dy) - sum(dy * hot),
    sum(dy * hot)], hot = OneHot(indices, depth, [0, 1]). Float indices and depth are
    piecewise constant: zero gradients."""
    indices, depth, values = n.inputs
    (dy,) = dys
    dvalues = None
    if needs[2]:
        hot = e.OneHot(indices, depth, e.const(np.array([0.0, 1.0]), dtype=values.dtype or ir.DataType.FLOAT),
                       axis=attr(n, "axis", -1))
        on = e.Reshape(e.reduce("ReduceSum", dy * hot, None, keepdims=False), [1])
        total = e.Reshape(e.reduce("ReduceSum", dy, None, keepdims=False), [1])
        dvalues = e.Concat(total - on, on, axis=0)
    return (e.zeros_like(indices) if needs[0] else None, e.zeros_like(depth) if needs[1] else None, dvalues)


@register("Unique")
def unique(n, dys, needs, e):
    """Y = the distinct elements of X (flattened), or its distinct slices along axis;
    inverse_indices maps every element (slice) of X to its entry of Y, counts[j] is how many
    map to entry j. Where X's entries are distinct, Y is a permutation of them and
    dX = dY[inverse_indices]. Entries that tie share one entry of Y (moving one alone changes
    Y's shape: no derivative there); moving them together moves it, so each of the counts[j]
    copies gets an even share: dX = (dY / counts)[inverse_indices]. The other outputs are
    integers. Without the node's own inverse_indices and counts, a second Unique computes them."""
    (x,) = n.inputs
    dy = dys[0]
    if dy is None:
        return (None,)
    axis = attr(n, "axis")
    inverse, counts = optional_output(n, 2), optional_output(n, 3)
    if inverse is None or counts is None:
        _, _, inverse, counts = e.op("Unique", x, outputs=4, axis=axis, sorted=attr(n, "sorted", 1))
    if axis is None:
        share = dy / e.CastLike(counts, dy)
        return (reshape_like(e, e.Gather(share, inverse), x),)
    trailing = -1 - axis if axis < 0 else Dims(e, x).need_rank("Unique") - 1 - axis
    share = dy / e.Reshape(e.CastLike(counts, dy), [-1] + [1] * trailing)
    return (e.Gather(share, inverse, axis=axis),)
