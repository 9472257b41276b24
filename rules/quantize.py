"""Quantized weights: DequantizeLinear's scale gradient, and com.microsoft MatMulNBits's
gradient to its float input.

DequantizeLinear (what quantization-aware training, e.g. LSQ, learns):

    y = (x - x_zero_point) * x_scale

x and the zero point are integers (or float8/float4, whose zero point must be 0): they get no
gradient. x_scale, and the zero point with it, is one value per group of x's elements: all of
x (a scalar scale), one slice along ``axis`` (a 1-D scale), or one run of ``block_size``
elements along ``axis`` (a scale of x's rank, the last block possibly short). So

    d x_scale[g] = sum over the group g of dy * (x - zp) = S(dy * x) - zp[g] * S(dy)

with S the sum over each group; the zero point never needs broadcasting. The gradient is
computed in x_scale's type (``output_dtype``, opset 21+, may give y another float type).

MatMulNBits (onnxruntime's weight-only quantized MatMul, what onnxruntime-genai writes for int4
models) is ``Y = A @ W^T (+ bias)`` with W the [N, K] dequantized weight:

    W[n, k] = (q[n, k] - zp[n, k // block_size]) * scales[n, k // block_size]

q is stored row by row in B (uint8, [N, n_blocks, blob_size], n_blocks = ceil(K / block_size),
blob_size = block_size * bits / 8), 8 / bits values per byte, the first in the lowest bits; K
is padded to n_blocks * block_size (the padding is ignored). scales are [N * n_blocks] or
[N, n_blocks]. zero_points are packed like B, ceil(n_blocks * bits / 8) bytes per row, or float
of the scales' shape; absent, zp = 2^(bits - 1). So

    dA = dY @ W,   dbias = dY summed over every axis but the last.

The quantized weight is not trainable (its gradient is refused: train a LoRA adapter on it),
and act-order (g_idx) is not supported.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, dims_of, optional_input
from gradbuilder.rules.helpers import wants
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


# ----------------------------------------------------------------------------- MatMulNBits

MS = "com.microsoft"
_NBITS_INPUTS = ("A", "B", "scales", "zero_points", "g_idx", "bias")


def unpack_bits(e, packed, bits: int):
    """uint8 [L] -> uint8 [L, 8 / bits]: the values packed in each byte, the first in the lowest
    bits. Value j of a byte is (byte << (8 - bits * (j + 1))) >> (8 - bits): BitShift on uint8
    drops the bits shifted out, and BitShift exists from opset 11 (BitwiseAnd only from 18)."""
    per = 8 // bits
    if per == 1:
        return e.Unsqueeze(packed, [1])
    u8 = lambda v: e.const(np.array(v, np.uint8))  # noqa: E731
    parts = []
    for j in range(per):
        left = 8 - bits * (j + 1)
        v = e.BitShift(packed, u8(left), direction="LEFT") if left else packed
        parts.append(e.Unsqueeze(e.BitShift(v, u8(8 - bits), direction="RIGHT"), [1]))
    return e.Concat(*parts, axis=1)


def run_time(e, x, empty):
    """``x`` (an initializer) concatenated with an empty tensor made from ``empty``, an empty
    slice of dy: the same values, but computed at run time.

    onnxruntime's constant folding (at session creation) evaluates every node whose inputs are
    all initializers. Without this it would dequantize each layer's B into a float initializer:
    a float copy of every quantized weight (8x the int4 bytes) held for the whole session, and a
    mere Reshape of B or of the scales would become a second copy of them. Depending on dy's
    values, the dequantization runs in the backward, and each layer's float W exists only while
    its MatMul runs. A shape taken from dy would not do: onnxruntime folds Shape when dy's dims
    are static."""
    d = dims_of(x)
    if d and all(isinstance(k, int) for k in d[1:]):
        shape = e.ints([0, *d[1:]])
    else:
        shape = e.Concat(e.ints([0]), e.Shape(x, start=1), axis=0)
    # the target's 0 copies empty's dim 0 (no allowzero needed): an empty [0, *x.dims[1:]]
    return e.Concat(x, e.Reshape(e.CastLike(empty, x), shape), axis=0)


@register("MatMulNBits", domain=MS)
def matmul_nbits(n, dys, needs, e):
    """Y = A @ W^T (+ bias), W = (q - zp) * scales per block of K:  dA = dY @ W,
    dbias = dY summed over every axis but the last. B, scales and zero_points: refused."""
    for i in (1, 2, 3):
        if wants(needs, i):
            raise GradientRuleError(
                f"MatMulNBits input {_NBITS_INPUTS[i]} ('{n.inputs[i].name}') is part of a quantized "
                "weight, which cannot be trained: freeze it and train a LoRA adapter on it instead "
                "(`gradbuilder lora`, or gradbuilder.add_lora in Python)"
            )
    (dy,) = dys[:1]
    grads = [None] * len(n.inputs)
    if dy is None:
        return grads
    N = int(attr(n, "N"))
    if wants(needs, 5):
        grads[5] = e.reduce("ReduceSum", e.Reshape(dy, [-1, N]), [0], keepdims=False)
    if not needs[0]:
        return grads
    if optional_input(n, 4) is not None:
        raise GradientRuleError(
            f"MatMulNBits with g_idx ('{n.inputs[4].name}', act-order quantization) is not "
            "supported: requantize the model without act-order (desc_act)"
        )
    K, bits, block = int(attr(n, "K")), int(attr(n, "bits", 4)), int(attr(n, "block_size"))
    if bits not in (2, 4, 8):
        raise GradientRuleError(f"MatMulNBits with bits={bits} is not supported (2, 4 or 8)")
    b, scales, zp = n.inputs[1], n.inputs[2], optional_input(n, 3)
    blocks = -(-K // block)
    empty = e.Slice(e.Reshape(dy, [-1]), e.ints([0]), e.ints([0]))  # read B, scales, zp through run_time
    dy = e.CastLike(dy, scales)
    rows = max(1, min(N, CHUNK_ELEMENTS // (blocks * block)))  # rows of W dequantized at a time
    for start in range(0, N, rows):  # dA = sum over row chunks c of dY[..., c] @ W[c]
        stop = min(N, start + rows)
        w = _dequantized_rows(e, b, scales, zp, start, stop, N, K, bits, block, empty)
        part = (e.Slice(dy, e.ints([start]), e.ints([stop]), e.ints([-1])) if (start, stop) != (0, N) else dy) @ w
        grads[0] = part if grads[0] is None else grads[0] + part
    return grads


# a layer's float weight is made this many elements at a time (16 MiB in float32): the
# backward of a large projection (an LLM's vocabulary) never holds the whole of it
CHUNK_ELEMENTS = 2**22


def _dequantized_rows(e, b, scales, zp, start: int, stop: int, N: int, K: int, bits: int, block: int, empty):
    """W[start:stop] = (q - zp) * scales per block of K, as float [stop - start, K], from rows
    ``start:stop`` of B, the scales and the zero points (read through ``run_time``)."""
    blocks, rows = -(-K // block), stop - start

    def own_rows(x, per_row):  # rows start:stop of ``x`` seen as [N, per_row]
        x = e.Reshape(run_time(e, x, empty), [N, per_row])
        return x if (start, stop) == (0, N) else e.Slice(x, e.ints([start]), e.ints([stop]), e.ints([0]))

    def codes(packed, per_row):  # the values packed in rows start:stop, flat
        return unpack_bits(e, e.Reshape(own_rows(packed, per_row), [-1]), bits)

    scale = e.Reshape(own_rows(scales, blocks), [rows, blocks, 1])
    q = e.CastLike(e.Reshape(codes(b, -(-blocks * block * bits // 8)), [rows, blocks, block]), scale)
    if zp is None:
        zero = float(2 ** (bits - 1))
    elif zp.dtype == ir.DataType.UINT8:  # packed like B, whole bytes per row of N
        per_row = e.Reshape(codes(zp, -(-blocks * bits // 8)), [rows, -1])
        zero = e.CastLike(e.Reshape(e.Slice(per_row, e.ints([0]), e.ints([blocks]), e.ints([1])), [rows, blocks, 1]), q)
    else:  # float, one per block
        zero = e.Reshape(own_rows(zp, blocks), [rows, blocks, 1])
    w = e.Reshape((q - zero) * scale, [rows, blocks * block])
    if blocks * block != K:  # drop the padding of the last block
        w = e.Slice(w, e.ints([0]), e.ints([K]), e.ints([1]))
    return w
