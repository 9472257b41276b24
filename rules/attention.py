"""Attention (opset 23) and RotaryEmbedding (opset 23).

Attention's gradient is written out with MatMul and Softmax math on the 4-D
``(batch, heads, sequence, head_size)`` layout (3-D inputs are split into heads first and
the gradients merged back)::

    K, V   = concat(past, new) along the sequence   (present_key / present_value)
    Kr, Vr = K, V with each kv head repeated q_heads / kv_heads times (grouped-query)
    R = (Q sqrt(s)) (Kr sqrt(s))^T                    qk_matmul_output, mode 0
    C = cap tanh(R / cap)   (softcap > 0, else C = R)  mode 1
    Z = C + bias                                       mode 2
    P = softmax(Z), rows whose bias is all -inf -> 0   mode 3
    Y = P Vr

    dP = dY Vr^T (+ dqk, mode 3)      dVr = P^T dY
    dZ = P (dP - rowsum(dP P)) (+ dqk, mode 2)      d attn_mask = dZ summed to the mask's shape
    dC = dZ (+ dqk, mode 1)      dR = dC (1 - tanh(R / cap)^2) (+ dqk, mode 0)
    dQ = dR (Kr sqrt(s)) sqrt(s)      dKr = dR^T (Q sqrt(s)) sqrt(s)

and dKr, dVr are summed over each kv head's group, the present_key / present_value
gradients added, and the sum split into the past and new parts along the sequence.

``bias`` is the float mask (or 0 / -inf for a bool mask; a mask shorter than the total
sequence is padded with -inf, as onnx's reference does) plus -inf where the position rules
block a key: is_causal (key j > query i + past_sequence_length), and from later opsets
nonpad_kv_seqlen (keys past each batch's length; the causal offset becomes
nonpad_kv_seqlen[b] - q_sequence_length) and the sliding window (left_window_size /
right_window_size). P is recomputed in the gradient graph, in softmax_precision when that
is set.

qk_matmul_output mode 0 is taken to be R, the raw scaled QK product, as the ONNX spec,
the operator's function body and onnxruntime have it; onnx 1.23's reference evaluator
returns the softcapped C there instead when softcap is set.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from gradbuilder.compiler.autodiff import walk
from gradbuilder.compiler.traversal import captures
from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, dims_of, optional_input
from gradbuilder.rules.helpers import accumulation_type, cast_to, compute_type, wants
from gradbuilder.rules.sizes import INT64_MAX, Dims, as_int64, iadd, isub, reshape_like, scalar_of, stack, vec, zeros


def _add(e, *parts):
    """Sum of the parts that are not None (None when all are)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else e.Sum(*parts)


def _t(e, x):
    """Swap the last two axes of a 4-D tensor."""
    return e.Transpose(x, perm=[0, 1, 3, 2])


# ----------------------------------------------------------------------------- Attention layout


def _split_heads(e, x, heads):
    """(B, S, H * D) -> (B, H, S, D)"""
    return e.Transpose(e.Reshape(x, [0, 0, heads, -1]), perm=[0, 2, 1, 3])


def _merge_heads(e, x4, like):
    """(B, H, S, D) -> (B, S, H * D), shaped like the 3-D input ``like``"""
    return reshape_like(e, e.Transpose(x4, perm=[0, 2, 1, 3]), like)


def _repeat_heads(e, x4, group):
    """(B, Hkv, T, D) -> (B, Hkv * group, T, D): each kv head repeated ``group`` times in a row."""
    if group == 1:
        return x4
    d = Dims(e, x4)
    wide = e.Expand(e.Unsqueeze(x4, [2]), stack(e, [1, 1, group, 1, 1]))
    return e.Reshape(wide, stack(e, [d[0], -1, d[2], d[3]]))


def _sum_groups(e, g4, group, like4):
    """(B, Hkv * group, T, D) -> (B, Hkv, T, D): the gradient of _repeat_heads."""
    if g4 is None or group == 1:
        return g4
    d = Dims(e, like4)
    return e.reduce("ReduceSum", e.Reshape(g4, stack(e, [d[0], d[1], -1, d[2], d[3]])), [2], keepdims=False)


def _size(e, value, axis):
    """Size of one axis of a forward input: an int when static, else a 1-element tensor."""
    return Dims(e, value)[axis]


class _Layout:
    """The node's inputs in the 4-D layout and the sizes the gradient needs."""

    def __init__(self, n, e):
        q, k, v = n.inputs[:3]
        self.past_k, self.past_v = optional_input(n, 4), optional_input(n, 5)
        rank = Dims(e, q).rank
        self.three_d = rank == 3 if rank is not None else attr(n, "q_num_heads") is not None
        if self.three_d:
            hq, hkv = attr(n, "q_num_heads"), attr(n, "kv_num_heads")
            if hq is None or hkv is None:
                raise GradientRuleError("3-D Attention needs the q_num_heads and kv_num_heads attributes")
            self.q4, self.k4, self.v4 = _split_heads(e, q, hq), _split_heads(e, k, hkv), _split_heads(e, v, hkv)
            hidden = dims_of(q)[2] if dims_of(q) is not None else None
            self.head_size = hidden // hq if isinstance(hidden, int) else Dims(e, self.q4)[3]
            self.q_len, kv_len = _size(e, q, 1), _size(e, k, 1)
        else:
            self.q4, self.k4, self.v4 = q, k, v
            hq, hkv = _size(e, q, 1), _size(e, self.past_k if self.past_k is not None else k, 1)
            self.head_size = _size(e, q, 3)
            self.q_len, kv_len = _size(e, q, 2), _size(e, k, 2)
        self.heads = hq
        if isinstance(hq, int) and isinstance(hkv, int):
            self.group = hq // hkv
        else:
            self.group = vec(e, hq) / vec(e, hkv)
        outs = n.outputs
        self.present_k = self._present(e, outs, 1, self.past_k, self.k4)
        self.present_v = self._present(e, outs, 2, self.past_v, self.v4)
        self.past_len = _size(e, self.past_k, 2) if self.past_k is not None else 0
        self.total = iadd(e, self.past_len, kv_len)

    @staticmethod
    def _present(e, outs, i, past, new4):
        if len(outs) > i and outs[i].name:
            return outs[i]
        return e.Concat(past, new4, axis=2) if past is not None else new4

    def to_input(self, e, g4, like):
        return _merge_heads(e, g4, like) if self.three_d and g4 is not None else g4

    def split_past(self, e, g):
        """The gradient of present (B, H, past + new, D) as (d past, d new)."""
        if g is None or self.past_k is None:
            return None, g
        length = vec(e, self.past_len)
        return (e.Slice(g, e.ints([0]), length, e.ints([2])),
                e.Slice(g, length, e.ints([INT64_MAX]), e.ints([2])))


def _scale_root(e, n, lay, like):
    """sqrt(scale), scale defaulting to 1 / sqrt(head_size)."""
    scale = attr(n, "scale")
    if scale is not None:
        return e.scalar(float(np.sqrt(scale)), like=like)
    d = lay.head_size
    if isinstance(d, int):
        return e.scalar(float(d) ** -0.25, like=like)
    return e.CastLike(d, like) ** -0.25


def _allowed(e, n, lay):
    """Where a query may attend a key by position (bool, broadcastable to (B, H, Sq, T)), or
    None: is_causal (key j <= i + offset), the sliding window (opset 25) and the padding
    given by nonpad_kv_seqlen (opset 24). The offset of query i is past_sequence_length,
    or nonpad_kv_seqlen[b] - Sq with an external cache."""
    causal = attr(n, "is_causal", 0)
    left, right = attr(n, "left_window_size", -1), attr(n, "right_window_size", -1)
    nonpad = optional_input(n, 6)
    if not causal and left < 0 and right < 0 and nonpad is None:
        return None
    cols = e.Reshape(e.Range(scalar_of(e, 0), scalar_of(e, lay.total), scalar_of(e, 1)), [1, -1])
    valid = None
    if nonpad is not None:
        nonpad = e.Reshape(as_int64(e, nonpad), [-1, 1, 1, 1])
        valid = e.Less(cols, nonpad)  # (B, 1, 1, T)
    allowed = []
    if causal or left >= 0 or right >= 0:
        rows = e.Reshape(e.Range(scalar_of(e, 0), scalar_of(e, lay.q_len), scalar_of(e, 1)), [-1, 1])
        if nonpad is not None and lay.past_k is None:
            rows = rows + (nonpad - vec(e, lay.q_len))  # (B, 1, Sq, 1)
        elif lay.past_len != 0:
            rows = rows + vec(e, lay.past_len)
        diff = rows - cols  # query position - key position
        if causal:
            allowed.append(e.GreaterOrEqual(diff, e.ints([0])))
        if left >= 0:
            allowed.append(e.LessOrEqual(diff, e.ints([left])))
        if right >= 0:
            allowed.append(e.GreaterOrEqual(diff, e.ints([-right])))
    if valid is not None:
        allowed.append(valid)
    out = allowed[0]
    for a in allowed[1:]:
        out = e.And(out, a)
    return out


def _bias(e, n, lay, like):
    """(bias or None, mask length when the mask may be shorter than the total sequence)."""
    mask = optional_input(n, 3)
    neg_inf, zero = e.scalar(float("-inf"), like=like), e.scalar(0.0, like=like)
    parts, mask_len = [], None
    total = lay.total
    allowed = _allowed(e, n, lay)
    if allowed is not None:
        parts.append(e.Where(allowed, zero, neg_inf))
    if mask is not None:
        m = e.Where(mask, zero, neg_inf) if mask.dtype == ir.DataType.BOOL else cast_to(e, mask, like.dtype)
        md = Dims(e, mask)
        if md.rank is not None and not (isinstance(md[md.rank - 1], int) and md[md.rank - 1] == total):
            mask_len = md[md.rank - 1]
            pads = stack(e, [0] * (2 * md.rank - 1) + [isub(e, total, mask_len)])
            m = e.Pad(m, pads, neg_inf)
        parts.append(m)
    bias = None if not parts else parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return bias, mask_len


def _probabilities(e, n, z, bias, like):
    """softmax(z) over the keys (in softmax_precision), rows with an all -inf bias zeroed
    (their logits are set to 0 first, so no NaN arises)."""
    blocked = None
    if bias is not None:
        blocked = e.IsInf(e.reduce("ReduceMax", bias, [-1], keepdims=True), detect_positive=0)
        z = e.Where(blocked, e.scalar(0.0, like=like), z)
    precision = attr(n, "softmax_precision")
    if precision is not None and like.dtype is not None and int(precision) != int(like.dtype):
        p = cast_to(e, e.Softmax(e.Cast(z, to=int(precision)), axis=-1), like.dtype)
    else:
        p = e.Softmax(z, axis=-1)
    return p if blocked is None else e.Where(blocked, e.scalar(0.0, like=like), p)


@register("Attention", since=23)
def attention(n, dys, needs, e):
    """Scaled dot-product attention; see the module doc for the formulas. Gradients for Q,
    K, V, a float attn_mask, past_key and past_value through Y, present_key,
    present_value and qk_matmul_output (any mode)."""
    q, k, v = n.inputs[:3]
    mask = optional_input(n, 3)
    dy, d_present_k, d_present_v, dqk = (list(dys) + [None] * 4)[:4]
    mode = attr(n, "qk_matmul_output_mode", 0)
    cap = float(attr(n, "softcap", 0.0) or 0.0)
    if dqk is not None and mode not in (0, 1, 2, 3):
        raise GradientRuleError(f"unknown qk_matmul_output_mode {mode}")
    mode_grad = {m: (dqk if mode == m else None) for m in range(4)}
    lay = _Layout(n, e)

    kr = _repeat_heads(e, lay.present_k, lay.group)
    root = _scale_root(e, n, lay, q)
    qs, ks = lay.q4 * root, kr * root
    needs_p = dy is not None or mode_grad[3] is not None
    needs_r = needs_p or (cap > 0 and (mode_grad[1] is not None or mode_grad[2] is not None))
    r = qs @ _t(e, ks) if needs_r else None
    tanh = e.Tanh(r / cap) if cap > 0 and needs_r else None

    d_vr = dp = None
    mask_grad = wants(needs, 3)
    bias, mask_len = _bias(e, n, lay, q) if needs_p or (mask_grad and mode_grad[2] is not None) else (None, None)
    if needs_p:
        c = cap * tanh if tanh is not None else r
        p = _probabilities(e, n, c + bias if bias is not None else c, bias, q)
        if dy is not None:
            dy4 = _split_heads(e, dy, lay.heads) if lay.three_d else dy
            vr = _repeat_heads(e, lay.present_v, lay.group)
            dp = dy4 @ _t(e, vr)
            d_vr = _t(e, p) @ dy4
        dp = _add(e, dp, mode_grad[3])
        dz = p * (dp - e.reduce("ReduceSum", dp * p, [-1], keepdims=True))
    else:
        dz = None
    dz = _add(e, dz, mode_grad[2])
    dc = _add(e, dz, mode_grad[1])
    if dc is not None and tanh is not None:
        dc = dc * (1 - tanh * tanh)
    dr = _add(e, dc, mode_grad[0])

    dq4 = d_kr = None
    if dr is not None:
        dq4 = (dr @ ks) * root if needs[0] else None
        d_kr = (_t(e, dr) @ qs) * root if needs[1] or wants(needs, 4) else None
    d_past_k, dk4 = lay.split_past(e, _add(e, _sum_groups(e, d_kr, lay.group, lay.present_k), d_present_k))
    d_past_v, dv4 = lay.split_past(e, _add(e, _sum_groups(e, d_vr, lay.group, lay.present_v), d_present_v))

    dmask = None
    if mask_grad and dz is not None:
        g = dz if mask_len is None else e.Slice(dz, e.ints([0]), vec(e, mask_len), e.ints([-1]))
        dmask = cast_to(e, e.unbroadcast(g, mask), mask.dtype)

    grads = [lay.to_input(e, dq4, q), lay.to_input(e, dk4, k), lay.to_input(e, dv4, v), dmask, d_past_k, d_past_v]
    out = []
    for value, need, g in zip(n.inputs, needs, grads + [None] * len(n.inputs)):
        out.append((g if g is not None else e.zeros_like(value)) if need else None)
    return out


# ----------------------------------------------------------------------------- RotaryEmbedding


def _rope_layout(e, n, x):
    """x as (B, S, H, D): 4-D inputs are (B, H, S, D), 3-D ones (B, S, H * D)."""
    rank = Dims(e, x).rank
    if rank is None:
        rank = 3 if attr(n, "num_heads") else 4
    if rank == 4:
        return e.Transpose(x, perm=[0, 2, 1, 3])
    return e.Reshape(x, [0, 0, attr(n, "num_heads"), -1])


def _rope_halves(e, n, x):
    """The two rotated components (x1, x2) of each pair: halves, or even/odd entries."""
    rot = attr(n, "rotary_embedding_dim", 0)
    if rot:
        x = e.Slice(x, e.ints([0]), e.ints([rot]), e.ints([3]))
    if attr(n, "interleaved", 0):
        return (e.Slice(x, e.ints([0]), e.ints([INT64_MAX]), e.ints([3]), e.ints([2])),
                e.Slice(x, e.ints([1]), e.ints([INT64_MAX]), e.ints([3]), e.ints([2])))
    return e.op("Split", x, axis=3, num_outputs=2, outputs=2)


def _to_cache(e, g, cache, positions):
    """(B, S, R/2) gradient of the gathered cache rows -> the cache's gradient."""
    if positions is None:
        return e.unbroadcast(g, cache)
    acc = accumulation_type(cache, False)
    base = zeros(e, Dims(e, cache).vector(), cache, acc)
    out = e.ScatterND(base, e.Unsqueeze(as_int64(e, positions), [-1]), cast_to(e, g, acc), reduction="add")
    return cast_to(e, out, cache.dtype)


@register("RotaryEmbedding", since=23)
def rotary_embedding(n, dys, needs, e):
    """Each pair (x1, x2) turns into (c x1 - s x2, s x1 + c x2) with c, s = the cache rows
    at the token's position. The transpose is the rotation by the negative angle:
    dx = RotaryEmbedding(dy, cos, -sin) with the same attributes. Per pair,
    d cos = dy1 x1 + dy2 x2 and d sin = dy2 x1 - dy1 x2, summed over the heads, then
    scatter-added into the cache rows named by position_ids (or, without them, the
    caches are (B, S, R/2) already)."""
    x, cos, sin = n.inputs[:3]
    positions = optional_input(n, 3)
    (dy,) = dys
    dx = dcos = dsin = None
    if needs[0]:
        extra = [positions] if positions is not None else []
        dx = e.RotaryEmbedding(dy, cos, -sin, *extra, interleaved=attr(n, "interleaved", 0),
                               rotary_embedding_dim=attr(n, "rotary_embedding_dim", 0),
                               num_heads=attr(n, "num_heads"))
    if needs[1] or needs[2]:
        x1, x2 = _rope_halves(e, n, _rope_layout(e, n, x))
        g1, g2 = _rope_halves(e, n, _rope_layout(e, n, dy))
        if needs[1]:
            dcos = _to_cache(e, e.reduce("ReduceSum", g1 * x1 + g2 * x2, [2], keepdims=False),
                             cos, positions)
        if needs[2]:
            dsin = _to_cache(e, e.reduce("ReduceSum", g2 * x1 - g1 * x2, [2], keepdims=False),
                             sin, positions)
    return (dx, dcos, dsin, None)[:len(n.inputs)]


# ----------------------------------------------------------------------------- FlexAttention


def _inline_modifier(e, n, name, x):
    """The node's ``name`` subgraph (score_mod / prob_mod) applied to ``x``: a copy of its
    nodes emitted into the gradient graph, reading ``x`` for the subgraph's input. Returns
    (output, the copied nodes) — (x, []) when the attribute is absent."""
    a = n.attributes.get(name)
    if a is None or a.type != ir.AttributeType.GRAPH:
        return x, []
    g = a.value.clone(allow_outer_scope_values=True)
    if len(g.inputs) != 1 or len(g.outputs) != 1:
        raise GradientRuleError(f"FlexAttention {name} must have one input and one output")
    _infer_dtypes(g, e.opset)
    (out,), nodes = e.inline(g, {g.inputs[0]: x}, prefix=f"{name}/")
    return out, nodes


def _infer_dtypes(g, opset):
    """Element types for the subgraph's values (onnx's inference leaves a node's subgraphs
    untyped): the walk treats untyped values as float, which would send gradients into
    the index arithmetic of a mask."""
    model = onnx.helper.make_model(ir.serde.serialize_graph(g), opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - types stay unknown; the walk then assumes float
        return
    types = {vi.name: vi.type.tensor_type.elem_type for vi in inferred.graph.value_info}
    for node in g:
        for out in node.outputs:
            if out.dtype is None and types.get(out.name):
                out.dtype = ir.DataType(types[out.name])


def _through_modifier(e, nodes, x, out, dout, captured):
    """Gradients of sum(dout * out) with respect to ``x`` and the ``captured`` outer values,
    walking back through the copied modifier ``nodes``."""
    if not nodes:
        return {x: dout} if out is x else {}
    return walk(nodes, [x, *captured], {out: dout}, e.child(e.graph))


def _softmax_type(n, q):
    """softmax_precision, defaulting to float32 for float16/bfloat16 inputs and to the
    input type otherwise."""
    precision = attr(n, "softmax_precision")
    if precision is not None:
        return ir.DataType(int(precision))
    return compute_type(q)


def _flex_scale_root(e, n, q):
    """sqrt(scale) in float32, then in Q's type (scale defaults to 1 / sqrt(head_size)), as
    the operator computes it."""
    scale = attr(n, "scale")
    d = _size(e, q, 3)
    if scale is None and not isinstance(d, int):
        f32 = int(ir.DataType.FLOAT)
        return e.CastLike(e.Sqrt(e.Reciprocal(e.Sqrt(e.Cast(d, to=f32)))), q)
    if scale is None:
        scale = np.float32(1.0) / np.sqrt(np.float32(d))
    return e.scalar(float(np.sqrt(np.float32(scale))), like=q)


@register("FlexAttention", domain="ai.onnx.preview")
def flex_attention(n, dys, needs, e):
    """Attention with user subgraphs on the scores and the probabilities (rank-4 inputs,
    kv heads repeated for grouped queries, everything after QK^T in softmax_precision)::

        R = (Q sqrt(s)) (Kr sqrt(s))^T     Z = score_mod(R)     P = softmax(Z)
        P' = prob_mod(P)                   Y = P' Vr

        dP' = dY Vr^T     dVr = P'^T dY      dP = dP' walked back through prob_mod
        dZ = P (dP - rowsum(dP P))          dR = dZ walked back through score_mod
        dQ = dR (Kr sqrt(s)) sqrt(s)        dKr = dR^T (Q sqrt(s)) sqrt(s)

    The subgraphs are copied into the gradient graph (they recompute Z and P') and
    differentiated with the other rules; outer values they read get gradients too. dKr and
    dVr are summed over each kv head's group.
    """
    q, k, v = n.inputs[:3]
    (dy,) = dys
    captured = captures(n)
    sp = _softmax_type(n, q)
    dq = dk = dv = None
    grads = {}
    if dy is not None:
        hq, hkv = _size(e, q, 1), _size(e, k, 1)
        group = hq // hkv if isinstance(hq, int) and isinstance(hkv, int) else vec(e, hq) / vec(e, hkv)
        root = _flex_scale_root(e, n, q)
        kr, vr = _repeat_heads(e, k, group), _repeat_heads(e, v, group)
        qs, ks = q * root, kr * root
        r = cast_to(e, qs @ _t(e, ks), sp)
        wanted = [c for c, need in zip(captured, needs[3:]) if need]
        z, score_nodes = _inline_modifier(e, n, "score_mod", r)
        p = e.Softmax(z, axis=-1)
        p2, prob_nodes = _inline_modifier(e, n, "prob_mod", p)
        dys_ = cast_to(e, dy, sp)
        if needs[2]:
            dv = _sum_groups(e, cast_to(e, _t(e, p2) @ dys_, v.dtype), group, v)
        if needs[0] or needs[1] or wanted:
            dp2 = dys_ @ _t(e, cast_to(e, vr, sp))
            grads = _through_modifier(e, prob_nodes, p, p2, dp2, wanted)
            dp = grads.get(p)
            dr = None
            if dp is not None:
                dz = p * (dp - e.reduce("ReduceSum", dp * p, [-1], keepdims=True))
                more = _through_modifier(e, score_nodes, r, z, dz, wanted)
                dr = more.pop(r, None)
                for c, g in more.items():
                    grads[c] = _add(e, grads.get(c), g)
            if dr is not None:
                dr = cast_to(e, dr, q.dtype)
                dq = (dr @ ks) * root if needs[0] else None
                dk = _sum_groups(e, (_t(e, dr) @ qs) * root, group, k) if needs[1] else None
    out = [dq, dk, dv] + [grads.get(c) for c in captured]
    return [(g if g is not None else e.zeros_like(value)) if need else None
            for value, need, g in zip([q, k, v, *captured], needs, out)]
