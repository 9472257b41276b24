"""onnxruntime's com.microsoft attention ops, as onnxruntime-genai's model builder and
onnxruntime's transformer optimizer emit them: GroupQueryAttention, RotaryEmbedding,
MultiHeadAttention.

The forward node stays in the model (onnxruntime's kernel computes the outputs); each rule
recomputes what its backward needs in standard ai.onnx ops and writes the backward out.

**GroupQueryAttention** (training form: an empty past, a right-padded batch). With ``H`` query
heads, ``Hkv`` kv heads, ``g = H / Hkv``, ``D`` the head size and ``L[b] = seqlens_k[b] + 1`` the
valid length of row ``b``, onnxruntime's CPU kernel (1.32) computes, as the tests check::

    Q, K, V  = the heads of query (packed [Q | K | V] when key/value are absent), key, value
    Qr, Kr   = Q, K turned by the rotary angles of positions 0 .. S-1 (do_rotary; every
               row, padding included; the first 2 * cos_cache.shape[1] entries of a head,
               halves or interleaved pairs); present_key = Kr, present_value = V
    R = scale Qr Kr^T  (each kv head serving g query heads; scale = 1/sqrt(D) when 0 or absent)
    C = softcap tanh(R / softcap)  (softcap > 0, else C = R)
    Z = C + attention_bias
    key j is seen by query i when  j < L[b],  j <= i (causal), i - j < local_window_size (>= 0)
    P = softmax over the seen keys, with exp(head_sink[h]) (or exp(0) for smooth_softmax)
        added to the denominator; a query that sees no key gets P = 0
    Y = P V

Padded queries (i >= L[b]) see the keys j < L[b] (their output is defined on the CPU; the
operator's spec leaves it open, so a loss should not read it). The backward::

    dP = dY V^T        dV = P^T dY  (+ d present_value)
    dZ = P (dP - rowsum(dP P))     d attention_bias = dZ summed to its shape
    d head_sink[h] = -sum over the rows of head h of (1 - rowsum(P)) rowsum(dP P)
    dR = dZ (1 - tanh(R / softcap)^2)  (softcap > 0)
    dQr = scale dR Kr      dKr = scale dR^T Qr  (+ d present_key)
    dQ, dK = dQr, dKr turned back (the rotation by the negative angles: its transpose)

with dK, dV summed over the g query heads each kv head serves. The work is laid out as
``(B, Hkv, g, S, D)`` for the queries and ``(B, Hkv, 1, S, D)`` for keys and values, so that the
kv heads broadcast instead of being copied. past_key / past_value must be empty (prefill,
P = 0): a static length > 0 is refused here, a symbolic one is checked at run time (a Reshape
to length 0 that fails otherwise). Their gradient is then empty.

Refused (GradientRuleError, naming the input or attribute): a non-empty past; position_ids
with do_rotary (in a prompt the CPU kernel reads only position_ids[0, 0]); query_seqlens;
q_norm_weight / k_norm_weight; a quantized cache (k_scale, v_scale, kv_cache_bit_width,
k_quant_type, v_quant_type); sliding_window_cache; a gradient through output_qk; a gradient
for cos_cache / sin_cache.

**RotaryEmbedding** turns each pair (x1, x2) of the first rotary_embedding_dim entries of a
head (halves, or even / odd entries when interleaved) into (c x1 - s x2, s x1 + c x2), with
c, s the cache rows at the token's position (position_ids (B, S), or a 1-element offset: the
position is offset + s). Its transpose is the turn by -angle: dx = rotate(dy, c, -s).

**MultiHeadAttention** (separate query (B, S, H*D), key / value (B, T, H*D)):
Y = softmax(scale Q K^T + mask) V with the mask adding mask_filter_value where
key_padding_mask is 0 (shape (B, T)) or the key lies past the key length (shape (B,)), and
where a key is later than the query (unidirectional). Its gradient is GroupQueryAttention's
without rotary and groups.
"""

from __future__ import annotations

import numpy as np

from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, dims_of, optional_input
from gradbuilder.errors import GradientRuleError
from gradbuilder.rules.helpers import cast_to, compute_type, keep, rank_of, sum_over, text_attr, wants
from gradbuilder.rules.sizes import INT64_MAX, Dims, as_int64, imul, is_static, scalar_of, stack, vec

MS = "com.microsoft"

# GroupQueryAttention's inputs
_Q, _K, _V, _PAST_K, _PAST_V, _SEQLENS, _TOTAL, _COS, _SIN, _POS, _BIAS, _SINK = range(12)
_K_SCALE, _V_SCALE, _Q_NORM, _K_NORM, _QUERY_SEQLENS = range(12, 17)
_GQA_NAMES = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
              "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale", "v_scale",
              "q_norm_weight", "k_norm_weight", "query_seqlens"]

_LOWEST = float(np.finfo(np.float32).min)  # a masked logit: finite, so a row with no key is no NaN


# ----------------------------------------------------------------------------- rotary


def _rotate(e, x, c, s, interleaved, half, whole, rank):
    """``x`` (..., D) of ``rank`` with its first 2 * half entries turned: each pair (x1, x2) (the two
    halves, or even / odd entries) becomes (c x1 - s x2, s x1 + c x2); c, s broadcast against
    (..., half). ``whole``: the pairs fill the head (no entries left as they are)."""
    rot = imul(e, half, 2)
    xr = x if whole else e.Slice(x, e.ints([0]), vec(e, rot), e.ints([-1]))
    if interleaved:
        x1 = e.Slice(xr, e.ints([0]), e.ints([INT64_MAX]), e.ints([-1]), e.ints([2]))
        x2 = e.Slice(xr, e.ints([1]), e.ints([INT64_MAX]), e.ints([-1]), e.ints([2]))
    else:
        x1 = e.Slice(xr, e.ints([0]), vec(e, half), e.ints([-1]))
        x2 = e.Slice(xr, vec(e, half), vec(e, rot), e.ints([-1]))
    o1, o2 = x1 * c - x2 * s, x1 * s + x2 * c
    if interleaved:
        pairs = e.Concat(e.Unsqueeze(o1, [-1]), e.Unsqueeze(o2, [-1]), axis=-1)
        out = e.Reshape(pairs, [0] * (rank - 1) + [-1])
    else:
        out = e.Concat(o1, o2, axis=-1)
    return out if whole else e.Concat(out, e.Slice(x, vec(e, rot), e.ints([INT64_MAX]), e.ints([-1])), axis=-1)


def _half_and_whole(e, cache, head_size):
    """(half = cache.shape[1], whether 2 * half == head_size) for a (positions, half) cache."""
    half = Dims(e, cache)[1]
    return half, is_static(half, head_size) and 2 * half == head_size


# ----------------------------------------------------------------------------- shared attention math


def _t(e, x):
    """Swap the last two axes of a 5-D tensor."""
    return e.Transpose(x, perm=[0, 1, 2, 4, 3])


def _to_heads(e, x, groups, g):
    """(B, S, groups * g * D) -> (B, groups, g, S, D)"""
    return e.Transpose(e.Reshape(x, [0, 0, groups, g, -1]), perm=[0, 2, 3, 1, 4])


def _from_heads(e, x5):
    """(B, groups, g, S, D) -> (B, S, groups * g * D)"""
    return e.Reshape(e.Transpose(x5, perm=[0, 3, 1, 2, 4]), [0, 0, -1])


def _heads4(e, z5, heads):
    """(B, Hkv, g, S, T) -> (B, heads, S, T): the layout of a 4-D attention bias."""
    return e.Reshape(z5, e.Concat(e.Shape(z5, 0, 1), e.ints([heads]), e.Shape(z5, 3, 5), axis=0))


class _Softmax:
    """P = softmax over the keys ``allowed`` lets a query see (bool, broadcasting against the
    scores), with an optional extra logit per row (a head sink) in the denominator only; rows
    that see no key get 0. The masked logits are the lowest float, not -inf, so no row is NaN."""

    def __init__(self, e, z, allowed, sink_col):
        if allowed is not None:
            z = e.Where(allowed, z, e.scalar(_LOWEST, like=z))
        self.sink = None
        if sink_col is None:
            p = e.Softmax(z, axis=-1)
        else:
            both = e.Softmax(e.Concat(z, sink_col, axis=-1), axis=-1)
            p = e.Slice(both, e.ints([0]), e.ints([-1]), e.ints([-1]))
            self.sink = e.Slice(both, e.ints([-1]), e.ints([INT64_MAX]), e.ints([-1]))
        self.p = keep(e, allowed, p) if allowed is not None else p

    def backward(self, e, dp):
        """(dZ, rowsum(dP P)) for the gradient dP of P."""
        rs = sum_over(e, dp * self.p, [-1])
        return self.p * (dp - rs), rs


class _Backward:
    """Attention recomputed and differentiated in the 5-D layout: queries (B, Hkv, g, S, D),
    keys and values (B, Hkv, 1, T, D), the output gradient dy5 like the queries::

        R = scale Q K^T    C = cap tanh(R / cap) (cap > 0)    Z = add(C)    P = softmax(Z)
        dP = dY V^T        dV = P^T dY      dZ = P (dP - rowsum(dP P))
        dR = dZ (1 - tanh^2)     dQ = scale dR K      dK = scale dR^T Q

    with dK, dV summed over the g queries of each kv head. ``add`` adds the biases to the
    scores, ``allowed`` / ``sink_col`` are those of :class:`_Softmax`."""

    def __init__(self, e, q5, key5, val5, dy5, g, scale, cap, add=None, allowed=None, sink_col=None):
        r = (q5 @ _t(e, key5)) * scale
        tanh = e.Tanh(r / cap) if cap > 0 else None
        z = cap * tanh if tanh is not None else r
        if add is not None:
            z = add(z)
        self.softmax = sm = _Softmax(e, z, allowed, sink_col(z) if sink_col is not None else None)
        self.dv = _group_sum(e, _t(e, sm.p) @ dy5, g)
        self.dz, self.rowsum = sm.backward(e, dy5 @ _t(e, val5))
        dr = self.dz * (1 - tanh * tanh) if tanh is not None else self.dz
        drs = dr * scale
        self.dq = drs @ key5
        self.dk = _group_sum(e, _t(e, drs) @ q5, g)


def _group_sum(e, x5, g):
    """(B, Hkv, g, T, D) summed over the g queries of each kv head (axis 2 kept)."""
    return x5 if g == 1 else sum_over(e, x5, [2])


def _scale_value(e, scale, head_size, like):
    """The score scale: ``scale`` when set (non-zero), else 1/sqrt(head size)."""
    if scale:
        return e.scalar(float(scale), like=like)
    if isinstance(head_size, int):
        return e.scalar(float(head_size) ** -0.5, like=like)
    return e.CastLike(head_size, like) ** -0.5


# ----------------------------------------------------------------------------- GroupQueryAttention


def _refuse(what, why):
    return GradientRuleError(f"GroupQueryAttention gradient: {what} is not supported ({why})")


def _check_gqa(n, dys, needs):
    """GradientRuleError for the forms the rule does not differentiate."""
    present = {i: optional_input(n, i) is not None for i in range(len(_GQA_NAMES))}
    for i, why in ((_QUERY_SEQLENS, "right-padded query chunks after a cache"),
                   (_Q_NORM, "per-head Q/K RMS normalization"), (_K_NORM, "per-head Q/K RMS normalization"),
                   (_K_SCALE, "a quantized KV cache"), (_V_SCALE, "a quantized KV cache")):
        if present[i]:
            raise _refuse(f"input {i} '{_GQA_NAMES[i]}'", why)
    for name in ("k_quant_type", "v_quant_type"):
        if text_attr(n, name, "NONE") not in ("NONE", ""):
            raise _refuse(f"attribute {name}={text_attr(n, name)!r}", "a quantized KV cache")
    if attr(n, "kv_cache_bit_width", 0):
        raise _refuse(f"attribute kv_cache_bit_width={attr(n, 'kv_cache_bit_width')}", "a quantized KV cache")
    if attr(n, "sliding_window_cache", 0):
        raise _refuse("attribute sliding_window_cache=1", "a window-sized cache that evicts")
    if attr(n, "do_rotary", 0) and present[_POS]:
        raise _refuse("input 9 'position_ids' with do_rotary=1",
                      "in a prompt the CPU kernel turns row b by position_ids[0, 0] + s, not position_ids[b, s]; "
                      "leave position_ids out to use the positions 0 .. S-1")
    if len(dys) > 3 and dys[3] is not None:
        raise _refuse("a gradient through output 3 'output_qk'", "it is a diagnostic output")
    for i in (_COS, _SIN):
        if wants(needs, i):
            raise _refuse(f"a gradient for input {i} '{_GQA_NAMES[i]}'",
                          "the rotary caches are constants here; make them initializers that are not trained")
    if present[_PAST_K] != present[_PAST_V]:
        raise _refuse("past_key without past_value (or the reverse)", "the kernel needs both")
    for i in (_PAST_K, _PAST_V):
        if present[i]:
            d = dims_of(n.inputs[i])
            if d is not None and len(d) == 4 and isinstance(d[2], int) and d[2] > 0:
                raise _refuse(f"input {i} '{_GQA_NAMES[i]}' of length {d[2]}",
                              "training runs the prompt form: feed an empty past (sequence axis 0)")


def _empty_past(e, past):
    """past (B, Hkv, P, D) as (B, Hkv, 1, 0, D): Unsqueeze when P is statically 0, else a
    Reshape to length 0 (allowzero) that fails at run time unless P == 0 (its node's name says
    so), or None when the opset has no allowzero (then P is taken to be 0 unchecked)."""
    d = Dims(e, past)
    if d.static is not None and d.static[2] == 0:
        return e.Unsqueeze(past, [2])
    if e.opset < 14:
        return None
    with e.scoped(f"{e.scope}needs_an_empty_{past.name}/"):
        return e.op("Reshape", past, stack(e, [d[0], d[1], 1, 0, d[3]]), allowzero=1)


@register("GroupQueryAttention", domain=MS)
def group_query_attention(n, dys, needs, e):
    """Grouped-query attention with rotary embedding, causal / local-window / padding masks,
    softcap, attention_bias and head sinks, in its training form (empty past); see the module
    doc for the formulas. Gradients for query (packed QKV or separate), key, value,
    attention_bias, head_sink and the empty past_key / past_value, through output,
    present_key and present_value."""
    _check_gqa(n, dys, needs)
    q = n.inputs[_Q]
    k, v = optional_input(n, _K), optional_input(n, _V)
    packed = k is None
    heads, kv_heads = int(attr(n, "num_heads")), int(attr(n, "kv_num_heads"))
    g = heads // kv_heads
    dy, d_present_k, d_present_v = (list(dys) + [None] * 3)[:3]
    ct = compute_type(q)

    # ---- the inputs in the (B, Hkv, g, S, D) / (B, Hkv, 1, S, D) layout
    hidden = (dims_of(q) or (None,) * 3)[-1]
    width = heads + 2 * kv_heads if packed else heads
    if packed:
        x4 = e.Reshape(cast_to(e, q, ct), [0, 0, width, -1])  # (B, S, H + 2 Hkv, D)
        parts = [e.Slice(x4, e.ints([a]), e.ints([b]), e.ints([2]))
                 for a, b in ((0, heads), (heads, heads + kv_heads), (heads + kv_heads, width))]
        q5 = _to_heads(e, parts[0], kv_heads, g)
        k5, v5 = _to_heads(e, parts[1], kv_heads, 1), _to_heads(e, parts[2], kv_heads, 1)
    else:
        q5 = _to_heads(e, cast_to(e, q, ct), kv_heads, g)
        k5, v5 = _to_heads(e, cast_to(e, k, ct), kv_heads, 1), _to_heads(e, cast_to(e, v, ct), kv_heads, 1)
    head_size = hidden // width if isinstance(hidden, int) else Dims(e, q5)[4]
    seq = Dims(e, q)[1]

    rotary = bool(attr(n, "do_rotary", 0))
    if rotary:
        cos, sin = n.inputs[_COS], n.inputs[_SIN]
        half, whole = _half_and_whole(e, cos, head_size)
        rows = (e.ints([0]), vec(e, seq), e.ints([0]))
        c, s = cast_to(e, e.Slice(cos, *rows), ct), cast_to(e, e.Slice(sin, *rows), ct)  # (S, R/2)
        interleaved = bool(attr(n, "rotary_interleaved", 0))

        def turn(x5, sin_):
            return _rotate(e, x5, c, sin_, interleaved, half, whole, 5)

        q5, k5 = _unpair(e, turn(e.Concat(q5, k5, axis=2), s), g)

    past_k, past_v = optional_input(n, _PAST_K), optional_input(n, _PAST_V)
    past_k5 = cast_to(e, _empty_past(e, past_k), ct) if past_k is not None else None
    past_v5 = cast_to(e, _empty_past(e, past_v), ct) if past_v is not None else None
    key5 = e.Concat(past_k5, k5, axis=3) if past_k5 is not None else k5  # present_key, (B, Hkv, 1, T, D)
    val5 = e.Concat(past_v5, v5, axis=3) if past_v5 is not None else v5

    # ---- the backward through output
    bias, sink = optional_input(n, _BIAS), optional_input(n, _SINK)
    d_q5 = d_key5 = d_val5 = d_bias = d_sink = None
    if dy is not None:
        def add_bias(z):
            return e.Reshape(_heads4(e, z, heads) + cast_to(e, bias, ct), e.Shape(z))

        def sink_col(z):
            logit = (e.Reshape(cast_to(e, sink, ct), [1, kv_heads, g, 1, 1]) if sink is not None
                     else e.scalar(0.0, like=z))
            return e.Expand(logit, e.Concat(e.Shape(z, 0, 4), e.ints([1]), axis=0))

        scale = _scale_value(e, attr(n, "scale"), head_size, q5)
        dy5 = _to_heads(e, cast_to(e, dy, ct), kv_heads, g)
        b = _Backward(e, q5, key5, val5, dy5, g, scale, float(attr(n, "softcap", 0.0) or 0.0),
                      add_bias if bias is not None else None, _gqa_allowed(e, n, seq),
                      sink_col if sink is not None or attr(n, "smooth_softmax", 0) else None)
        d_q5, d_key5, d_val5 = b.dq, b.dk, b.dv
        if wants(needs, _SINK) and sink is not None:
            summed = e.reduce("ReduceSum", b.softmax.sink * b.rowsum, [0, 3, 4], keepdims=False)
            d_sink = cast_to(e, -e.Reshape(summed, [-1]), sink.dtype)
        if wants(needs, _BIAS):
            d_bias = cast_to(e, e.unbroadcast(_heads4(e, b.dz, heads), bias), bias.dtype)

    # ---- present_key / present_value, and the split into past and new
    if d_present_k is not None:
        d_key5 = e.accumulate(d_key5, e.Unsqueeze(cast_to(e, d_present_k, ct), [2]))
    if d_present_v is not None:
        d_val5 = e.accumulate(d_val5, e.Unsqueeze(cast_to(e, d_present_v, ct), [2]))
    d_k5 = _new_part(e, d_key5, past_k5)
    d_v5 = _new_part(e, d_val5, past_v5)

    if rotary:
        neg = -s
        if d_q5 is not None and d_k5 is not None:
            d_q5, d_k5 = _unpair(e, turn(e.Concat(d_q5, d_k5, axis=2), neg), g)
        elif d_q5 is not None:
            d_q5 = turn(d_q5, neg)
        elif d_k5 is not None:
            d_k5 = turn(d_k5, neg)

    # ---- back to the inputs' layout
    def flat(d5, like5):
        return _from_heads(e, d5 if d5 is not None else e.zeros_like(like5))

    grads = [None] * len(n.inputs)
    if packed:
        if needs[_Q] and (d_q5 is not None or d_k5 is not None or d_v5 is not None):
            grads[_Q] = cast_to(e, e.Concat(flat(d_q5, q5), flat(d_k5, k5), flat(d_v5, v5), axis=-1), q.dtype)
    else:
        for i, d5, x in ((_Q, d_q5, q), (_K, d_k5, k), (_V, d_v5, v)):
            if needs[i] and d5 is not None:
                grads[i] = cast_to(e, _from_heads(e, d5), x.dtype)
    for i, past in ((_PAST_K, past_k), (_PAST_V, past_v)):
        if wants(needs, i):
            grads[i] = e.zeros_like(past)  # empty
    for i, gr in ((_BIAS, d_bias), (_SINK, d_sink)):
        if len(grads) > i:
            grads[i] = gr
    return [gr if need else None for gr, need in zip(grads, list(needs) + [False] * len(grads))]


def _unpair(e, qk5, g):
    """(B, Hkv, g + 1, S, D) -> its g query heads and its key head, (B, Hkv, g | 1, S, D)."""
    return (e.Slice(qk5, e.ints([0]), e.ints([g]), e.ints([2])),
            e.Slice(qk5, e.ints([g]), e.ints([g + 1]), e.ints([2])))


def _new_part(e, d5, past5):
    """The gradient of present (B, Hkv, 1, P + S, D) without its (empty) past part: a Slice
    from P = past5's length, so that the run-time check on the past runs on this path too."""
    if d5 is None or past5 is None:
        return d5
    start = Dims(e, past5)[3]
    if isinstance(start, int) and start == 0:
        return d5
    return e.Slice(d5, vec(e, start), e.ints([INT64_MAX]), e.ints([3]))


def _gqa_allowed(e, n, seq):
    """Which keys each query sees, (B, 1, 1, S, S) bool: j < seqlens_k[b] + 1, j <= i (causal),
    i - j < local_window_size (when >= 0)."""
    idx = e.Range(scalar_of(e, 0), scalar_of(e, seq), scalar_of(e, 1))
    rows, cols = e.Reshape(idx, [-1, 1]), e.Reshape(idx, [1, -1])
    lengths = e.Reshape(as_int64(e, n.inputs[_SEQLENS]), [-1, 1, 1, 1, 1]) + 1
    allowed = e.Less(cols, lengths)
    if attr(n, "causal", 1):
        allowed = e.And(allowed, e.LessOrEqual(cols, rows))
    window = int(attr(n, "local_window_size", -1))
    if window >= 0:
        allowed = e.And(allowed, e.Less(rows - cols, e.ints([window])))
    return allowed


# ----------------------------------------------------------------------------- RotaryEmbedding


@register("RotaryEmbedding", domain=MS)
def rotary_embedding(n, dys, needs, e):
    """y = x with each pair of the first rotary_embedding_dim entries of a head turned by the
    angles of its position (see the module doc); 3-D input (B, S, H*D) or 4-D (B, H, S, D).
    dx = the same turn by the negative angles: rotate(dy, c, -s). No gradient for the caches
    (refused by name) or the positions; is_packed_batching is refused."""
    x, positions, cos, sin = n.inputs[:4]
    if attr(n, "is_packed_batching", 0):
        raise GradientRuleError("RotaryEmbedding gradient: attribute is_packed_batching=1 is not supported")
    for i, name in ((2, "cos_cache"), (3, "sin_cache")):
        if wants(needs, i):
            raise GradientRuleError(f"RotaryEmbedding gradient: a gradient for input {i} '{name}' is not supported "
                                    "(the rotary caches are constants here)")
    (dy,) = dys[:1]
    if not needs[0] or dy is None:
        return [None] * len(n.inputs)
    rank = rank_of(x, dy, op="RotaryEmbedding")
    pos_rank = rank_of(positions, op="RotaryEmbedding")
    heads, rot_dim = int(attr(n, "num_heads", 0) or 0), int(attr(n, "rotary_embedding_dim", 0) or 0)
    half = rot_dim // 2 if rot_dim else Dims(e, cos)[1]
    if rank == 4:
        g4, seq, head_size = dy, Dims(e, x)[2], Dims(e, x)[3]
    else:
        g4 = e.Reshape(dy, [0, 0, heads, -1] if heads else stack(e, [0, 0, -1, imul(e, half, 2)]))
        seq, hidden = Dims(e, x)[1], Dims(e, x)[2]
        head_size = hidden // heads if heads and isinstance(hidden, int) else (None if heads else imul(e, half, 2))
    whole = is_static(half, head_size) and 2 * half == head_size
    if pos_rank == 2:  # (B, S): the cache rows at each token's position
        c, s = e.Gather(cos, positions, axis=0), e.Gather(sin, positions, axis=0)  # (B, S, half)
        axis = 1 if rank == 4 else 2
        c, s = e.Unsqueeze(c, [axis]), e.Unsqueeze(s, [axis])
    else:  # one offset: positions offset .. offset + S - 1
        start = e.Reshape(as_int64(e, positions), [1])
        rows = (start, start + vec(e, seq), e.ints([0]))
        c, s = e.Slice(cos, *rows), e.Slice(sin, *rows)  # (S, half)
        if rank == 3:
            c, s = e.Unsqueeze(c, [1]), e.Unsqueeze(s, [1])
    if dims_of(cos) is not None and rot_dim and dims_of(cos)[1] != half:
        cols = (e.ints([0]), e.ints([half]), e.ints([-1]))
        c, s = e.Slice(c, *cols), e.Slice(s, *cols)
    c, s = cast_to(e, c, dy.dtype), cast_to(e, s, dy.dtype)
    dx = _rotate(e, g4, c, -s, bool(attr(n, "interleaved", 0)), half, whole, 4)
    if rank == 3:
        dx = e.Reshape(dx, [0, 0, -1])
    return [dx] + [None] * (len(n.inputs) - 1)


# ----------------------------------------------------------------------------- MultiHeadAttention

_MHA_NAMES = ["query", "key", "value", "bias", "key_padding_mask", "attention_bias", "past_key", "past_value",
              "past_sequence_length", "cache_indirection"]


def _check_mha(n, dys):
    def refuse(what, why):
        return GradientRuleError(f"MultiHeadAttention gradient: {what} is not supported ({why})")

    for i, why in ((8, "a shared past/present buffer"), (9, "beam search")):
        if optional_input(n, i) is not None:
            raise refuse(f"input {i} '{_MHA_NAMES[i]}'", why)
    q, k = n.inputs[0], optional_input(n, 1)
    if k is None or optional_input(n, 2) is None:
        raise refuse("packed QKV in query (key and value absent)", "give query, key and value separately")
    for i in (0, 1, 2):
        d = dims_of(n.inputs[i])
        if d is None:
            raise GradientRuleError(
                f"MultiHeadAttention gradient needs the rank of input {i} '{_MHA_NAMES[i]}', which shape inference "
                "left unknown (onnx infers no com.microsoft op; give the model's values shapes, e.g. with "
                "onnxruntime's symbolic shape inference)")
        if len(d) != 3:
            raise refuse(f"input {i} '{_MHA_NAMES[i]}' of rank {len(d)}",
                         "only the 3-D (batch, sequence, hidden) form is differentiated: no packed QKV / KV, "
                         "no key and value given as a BNSH past")
    if len(dys) > 3 and dys[3] is not None:
        raise refuse("a gradient through output 3 'qk'", "it is a diagnostic output")
    if (optional_input(n, 6) is None) != (optional_input(n, 7) is None):
        raise refuse("past_key without past_value (or the reverse)", "the kernel needs both")
    for i in (6, 7):
        past = optional_input(n, i)
        d = dims_of(past) if past is not None else None
        if d is not None and len(d) == 4 and isinstance(d[2], int) and d[2] > 0:
            raise refuse(f"input {i} '{_MHA_NAMES[i]}' of length {d[2]}", "feed an empty past (sequence axis 0)")
    mask = optional_input(n, 4)
    if mask is not None:
        md, qd = dims_of(mask), dims_of(q)
        if md is None or len(md) not in (1, 2, 3):
            raise refuse(f"input 4 'key_padding_mask' of rank {None if md is None else len(md)}",
                         "the forms (B,), (B, T) and (B, S, T) are differentiated")
        if len(md) == 1 and isinstance(md[0], int) and isinstance(qd[0], int) and md[0] != qd[0]:
            raise refuse("input 4 'key_padding_mask' of shape (3 * batch + 2)", "the key and query start offsets form")
    if attr(n, "unidirectional", 0):
        s, t = dims_of(q)[1], dims_of(k)[1]
        if isinstance(s, int) and isinstance(t, int) and s < t:
            raise refuse(f"unidirectional=1 with {s} queries and {t} keys",
                         "the CPU kernel's causal mask is not the shifted one there; use as many queries as keys")


def _mha_padding(e, n, mask, like, seq_k):
    """mask_filter_value where key_padding_mask hides a key, as (B, 1, 1, S | 1, T) in like's
    dtype: 1-D masks are key lengths, 2-D and 3-D ones are 0 (hidden) / 1 (seen)."""
    filt = e.scalar(float(attr(n, "mask_filter_value", -10000.0)), like=like)
    zero = e.scalar(0.0, like=like)
    rank = len(dims_of(mask))
    if rank == 1:
        cols = e.Reshape(e.Range(scalar_of(e, 0), scalar_of(e, seq_k), scalar_of(e, 1)), [1, -1])
        hidden = e.GreaterOrEqual(cols, e.Reshape(as_int64(e, mask), [-1, 1]))  # (B, T)
    else:
        hidden = e.Equal(as_int64(e, mask), e.ints(0))
    out = e.Where(hidden, filt, zero)
    return e.Unsqueeze(out, [1, 2, 3] if rank < 3 else [1, 2])


@register("MultiHeadAttention", domain=MS)
def multi_head_attention(n, dys, needs, e):
    """Multi-head attention on separate 3-D query, key and value with the optional input
    projection bias, key_padding_mask (mask_filter_value added to the hidden keys' scores),
    attention_bias, unidirectional (later keys excluded) and an empty past::

        Q = query + bias_q    K = key + bias_k    V = value + bias_v   (present_key / value: K, V)
        Y = softmax(scale Q K^T + padding + attention_bias) V

    Gradients for query, key, value, bias and attention_bias through output, present_key and
    present_value; the backward is GroupQueryAttention's (one query per kv head)."""
    _check_mha(n, dys)
    q, k, v = n.inputs[:3]
    pbias, mask, abias = optional_input(n, 3), optional_input(n, 4), optional_input(n, 5)
    past_k, past_v = optional_input(n, 6), optional_input(n, 7)
    heads = int(attr(n, "num_heads"))
    dy, d_present_k, d_present_v = (list(dys) + [None] * 3)[:3]
    ct = compute_type(q)

    qx, kx, vx = cast_to(e, q, ct), cast_to(e, k, ct), cast_to(e, v, ct)
    hq = Dims(e, q)[2]
    if pbias is not None:
        b = cast_to(e, pbias, ct)
        edges = [0, hq, imul(e, hq, 2), INT64_MAX]
        bq, bk, bv = (e.Slice(b, vec(e, edges[i]), vec(e, edges[i + 1]), e.ints([0])) for i in range(3))
        qx, kx, vx = qx + bq, kx + bk, vx + bv
    q5, k5, v5 = (_to_heads(e, x, heads, 1) for x in (qx, kx, vx))
    past_k5 = cast_to(e, _empty_past(e, past_k), ct) if past_k is not None else None
    past_v5 = cast_to(e, _empty_past(e, past_v), ct) if past_v is not None else None
    key5 = e.Concat(past_k5, k5, axis=3) if past_k5 is not None else k5
    val5 = e.Concat(past_v5, v5, axis=3) if past_v5 is not None else v5

    d_q5 = d_key5 = d_val5 = d_abias = None
    if dy is not None:
        seq, seq_k = Dims(e, q)[1], Dims(e, k)[1]
        head_size = hq // heads if isinstance(hq, int) else Dims(e, q5)[4]
        parts = []
        if mask is not None:
            parts.append(_mha_padding(e, n, mask, q5, seq_k))
        if abias is not None:
            parts.append(e.Unsqueeze(cast_to(e, abias, ct), [2]))

        def add(z):
            for p in parts:
                z = z + p
            return z

        allowed = None
        if attr(n, "unidirectional", 0):
            rows = e.Reshape(e.Range(scalar_of(e, 0), scalar_of(e, seq), scalar_of(e, 1)), [-1, 1])
            cols = e.Reshape(e.Range(scalar_of(e, 0), scalar_of(e, seq_k), scalar_of(e, 1)), [1, -1])
            allowed = e.LessOrEqual(cols, rows)
        scale = _scale_value(e, attr(n, "scale"), head_size, q5)
        b = _Backward(e, q5, key5, val5, _to_heads(e, cast_to(e, dy, ct), heads, 1), 1, scale, 0.0,
                      add if parts else None, allowed)
        d_q5, d_key5, d_val5 = b.dq, b.dk, b.dv
        if wants(needs, 5):
            d_abias = cast_to(e, e.unbroadcast(e.Squeeze(b.dz, [2]), abias), abias.dtype)
    if d_present_k is not None:
        d_key5 = e.accumulate(d_key5, e.Unsqueeze(cast_to(e, d_present_k, ct), [2]))
    if d_present_v is not None:
        d_val5 = e.accumulate(d_val5, e.Unsqueeze(cast_to(e, d_present_v, ct), [2]))
    d_k5, d_v5 = _new_part(e, d_key5, past_k5), _new_part(e, d_val5, past_v5)

    flat = {i: _from_heads(e, d5) if d5 is not None else None for i, d5 in enumerate((d_q5, d_k5, d_v5))}
    grads = [None] * len(n.inputs)
    for i, x in enumerate((q, k, v)):
        if needs[i] and flat[i] is not None:
            grads[i] = cast_to(e, flat[i], x.dtype)
    if wants(needs, 3) and any(f is not None for f in flat.values()):
        sums = [e.reduce("ReduceSum", flat[i], [0, 1], keepdims=False) if flat[i] is not None
                else e.zeros_like(e.Slice(pbias, vec(e, a), vec(e, z), e.ints([0])))
                for i, (a, z) in enumerate(((0, hq), (hq, imul(e, hq, 2)), (imul(e, hq, 2), INT64_MAX)))]
        grads[3] = cast_to(e, e.Concat(*sums, axis=0), pbias.dtype)
    if len(grads) > 5:
        grads[5] = d_abias
    for i, past in ((6, past_k), (7, past_v)):
        if wants(needs, i):
            grads[i] = e.zeros_like(past)
    return [gr if need else None for gr, need in zip(grads, list(needs) + [False] * len(grads))]
