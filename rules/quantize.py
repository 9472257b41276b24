"""DequantizeLinear: the scale's gradient (what quantization-aware training, e.g. LSQ, learns).

    y = (x - x_zero_point) * x_scale

x and the zero point are integers (or float8/float4, whose zero point must be 0): they get no
gradient. x_scale, and the zero point with it, is one value per group of x's elements: all of
x (a scalar scale), one slice along ``axis`` (a 1-D scale), or one run of ``block_size``
elements along ``axis`` (a scale of x's rank, the last block possibly short). So

    d x_scale[g] = sum over the group g of dy * (x - zp) = S(dy * x) - zp[g] * S(dy)

with S the sum over each group; the zero point never needs broadcasting. The gradient is
computed in x_scale's type (``output_dtype``, opset 21+, may give y another float type).
"""

from __future__ import annotations

import onnx_ir as ir

from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, dims_of, optional_input
from gradbuilder.rules.sizes import Dims, pad_axis, reshape_like

# x types whose zero point is 0 by definition (the reference ignores it)
_ZERO_POINT_FREE = {
    getattr(ir.DataType, name)
    for name in ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT8E8M0", "FLOAT4E2M1")
    if hasattr(ir.DataType, name)
}


def group_sum(e, g, x, scale, axis: int, block: int):
    """S(g): g (x's shape) summed over each group of elements that share one scale entry."""
    sd = dims_of(scale)
    if block <= 0 and sd is not None and len(sd) == 0:  # per tensor
        return e.reduce("ReduceSum", g, None, keepdims=False)
    dims = Dims(e, x)
    rank = dims.need_rank("DequantizeLinear")
    axis %= rank
    if block <= 0:  # per axis; a 1-element scale is per tensor (unbroadcast sums the axis)
        others = [k for k in range(rank) if k != axis]
        t = e.reduce("ReduceSum", g, others, keepdims=False) if others else g
        return e.unbroadcast(t, scale)
    # blocked: pad the axis to blocks * block_size, split it into (blocks, block_size), sum
    n, blocks = dims[axis], Dims(e, scale)[axis]
    if isinstance(n, int) and isinstance(blocks, int):
        extra = blocks * block - n
    else:
        blocks_v = blocks if not isinstance(blocks, int) else e.ints([blocks])
        n_v = n if not isinstance(n, int) else e.ints([n])
        extra = blocks_v * e.ints([block]) - n_v
    g = pad_axis(e, g, rank, axis, 0, extra)
    target = [e.ints([0] * axis)] if axis else []
    target += [blocks if not isinstance(blocks, int) else e.ints([blocks]), e.ints([block, -1])]
    split = e.Reshape(g, e.Concat(*target, axis=0) if len(target) > 1 else target[0])
    return reshape_like(e, e.reduce("ReduceSum", split, [axis + 1], keepdims=False), scale)


@register("DequantizeLinear")
def dequantize_linear(n, dys, needs, e):
    """y = (x - zp) * scale  =>  d scale = S(dy * x) - zp * S(dy), S the sum over the
    elements sharing a scale entry (per tensor, per axis, or per block); x, zp: integer (or
    float8/float4), no gradient."""
    x, scale = n.inputs[0], n.inputs[1]
    zp = optional_input(n, 2)
    (dy,) = dys
    if dy is None or not needs[1]:
        return [None] * len(n.inputs)
    axis = int(attr(n, "axis", 1))
    block = int(attr(n, "block_size", 0))
    dy = e.CastLike(dy, scale)
    grad = group_sum(e, dy * e.CastLike(x, scale), x, scale, axis, block)
    if zp is not None and x.dtype not in _ZERO_POINT_FREE:
        zpf = e.CastLike(zp, scale)
        if dims_of(zp) != dims_of(scale):  # e.g. a scalar scale with a 1-element zero point
            zpf = reshape_like(e, zpf, scale)
        grad = grad - zpf * group_sum(e, dy, x, scale, axis, block)
    return [None, grad] + [None] * (len(n.inputs) - 2)
