"""Rules for onnxruntime's com.microsoft attention ops (rules/contrib_attention.py):
GroupQueryAttention, RotaryEmbedding, MultiHeadAttention.

onnx's reference evaluator runs none of these ops, so, as in test_contrib.py, each case is
checked against a formulation in standard ONNX ops (``*_standard`` below):

* onnxruntime's forward of the contrib op (every output, padded rows included) equals the
  standard formulation's;
* the float64 gradient of the standard formulation, built by gradbuilder and gradchecked with
  finite differences on the reference evaluator, is the expected gradient;
* the gradient graph of the contrib model, made float64 and with the contrib node swapped for
  its standard formulation, matches it on the reference evaluator to float64 precision;
* the float32 gradient graph of the contrib model runs on onnxruntime (kernel forward and all)
  at 1, 2 and 16 intra-op threads, matches it, and agrees with directional finite differences of
  the loss on onnxruntime.

The standard formulations are written differently from the rules on purpose: what the test
knows in advance is baked in as constants (the keys each query sees, computed in numpy from
seqlens_k; one rotation matrix per position, built from the cache rows), and kv heads are
repeated with a Gather. The semantics they encode are those of onnxruntime's CPU kernels
(1.32), which the forward check pins: positions 0 .. S-1 for every row (padding included),
a key j seen by query i when j < seqlens_k[b] + 1, j <= i (causal) and i - j <
local_window_size, softcap applied before attention_bias, a head sink adding exp(sink) to the
denominator, a query that sees no key giving 0.

Padded queries (i >= seqlens_k[b] + 1) are left out of the loss except in
test_gqa_padded_rows_in_the_loss (their output is the CPU kernel's, not the spec's).
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientRuleError
from gradbuilder.testing import gradcheck, ort_session, reference_evaluator, to_float64
from gradbuilder.testing.ort_runs import racing_nodes

from .test_contrib import MS, Nodes, close, grads_of, ort_run

pytestmark = pytest.mark.filterwarnings("ignore:these weights do not reach the loss")

f32 = np.float32
B = 2


def arr(rng, *shape, lo=-1.5, hi=1.5):
    return rng.uniform(lo, hi, shape).astype(f32)


# ----------------------------------------------------------------------------- rotation matrices


def rotation_matrices(cos_rows, sin_rows, head_size, interleaved):
    """(..., D, D) matrices M with x @ M the rotary turn of x (..., D) by the angles whose cos /
    sin are cos_rows / sin_rows (..., R/2): pair (i, i + R/2) (or (2i, 2i + 1)) turns into
    (c x1 - s x2, s x1 + c x2); the entries past R stay as they are."""
    half = cos_rows.shape[-1]
    m = np.zeros(cos_rows.shape[:-1] + (head_size, head_size))
    m[..., np.arange(head_size), np.arange(head_size)] = 1.0
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        c, s = cos_rows[..., i], sin_rows[..., i]
        m[..., a, a], m[..., b, b], m[..., a, b], m[..., b, a] = c, c, s, -s
    return m


def _rotated(b, x4, m):
    """x4 (..., S, D) times its position's matrix: (..., S, 1, D) @ M (..., S, D, D)."""
    mv = b.const(m)
    return b("Squeeze", b("MatMul", b("Unsqueeze", x4, b.const([-2], np.int64)), mv), b.const([-2], np.int64))


def _heads(b, x, shape):
    """(B, S, H * D) -> (B, H, S, D), ``shape`` = (B, S, H, D)."""
    return b("Transpose", b("Reshape", x, b.const(list(shape), np.int64)), perm=[0, 2, 1, 3])


def _merged(b, x4, shape):
    """(B, H, S, D) -> (B, S, H * D), ``shape`` = (B, S, -1)."""
    return b("Reshape", b("Transpose", x4, perm=[0, 2, 1, 3]), b.const(list(shape), np.int64))


def _softmax_masked(b, z, allowed, sink=None):
    """softmax over the keys ``allowed`` (a numpy bool array) lets each query see, with the
    optional (B, H, S, 1) sink logit in the denominator; rows that see no key give 0."""
    z = b("Where", b.const(allowed, np.bool_), z, b.const(-1e30))
    if sink is not None:
        p = b("Softmax", b("Concat", z, sink, axis=-1), axis=-1)
        p = b("Slice", p, b.const([0], np.int64), b.const([-1], np.int64), b.const([-1], np.int64))
    else:
        p = b("Softmax", z, axis=-1)
    return b("Mul", p, b.const(allowed.astype(np.float64)))


# ----------------------------------------------------------------------------- cases


class Case:
    """A contrib node on float ``weights`` (graph inputs, the values differentiated) and
    ``consts`` (graph inputs that are not trained: seqlens_k, an empty past, ...; declared with
    the dims ``dims`` gives, default static), ``inits`` (initializers: the rotary caches), with the
    loss sum_o sum(o * P_o) over ``loss_outputs`` (P_o fixed random, times ``row_masks[o]``).
    ``standard(b, dtype)`` writes the node's outputs in standard ops (constants baked in)."""

    def __init__(self, op, attrs, ins, outs, weights, consts, inits, standard, *, loss_outputs=None,
                 row_masks=None, dims=None, seed=0):
        self.op, self.attrs, self.ins, self.outs = op, attrs, ins, outs
        self.weights, self.consts, self.inits = weights, consts, inits
        self.standard, self.dims = standard, dims or {}
        self.feeds = {**weights, **consts}
        forward = self.standard_forward()
        rng = np.random.default_rng(seed + 1000)
        self.proj = {}
        for o in loss_outputs or [o for o in outs if o]:
            p = rng.standard_normal(forward[o].shape)
            if row_masks and o in row_masks:
                p = p * row_masks[o]
            self.proj[o] = p.astype(f32)
        self.expected_forward = forward

    def _vi(self, name, value, dtype):
        dims = self.dims.get(name, list(value.shape))
        elem = dtype if value.dtype.kind == "f" else helper.np_dtype_to_tensor_dtype(value.dtype)
        return helper.make_tensor_value_info(name, elem, dims)

    def _model(self, nodes, inputs, extra_inits, dtype):
        np_dtype = np.float64 if dtype == TensorProto.DOUBLE else f32
        inits = [numpy_helper.from_array(v.astype(np_dtype) if v.dtype.kind == "f" else v, k)
                 for k, v in {**extra_inits, **{f"{o}_proj": p for o, p in self.proj.items()}}.items()]
        terms = []
        for o in self.proj:
            nodes = nodes + [helper.make_node("Mul", [o, f"{o}_proj"], [f"{o}_m"]),
                             helper.make_node("ReduceSum", [f"{o}_m"], [f"{o}_s"], keepdims=0)]
            terms.append(f"{o}_s")
        nodes.append(helper.make_node("Sum", terms, ["loss"]))
        graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", dtype, [])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
        model.ir_version = 10
        return model

    def contrib_node(self):
        return helper.make_node(self.op, self.ins, self.outs, domain=MS, **self.attrs)

    def contrib_model(self):
        inputs = [self._vi(k, v, TensorProto.FLOAT) for k, v in self.feeds.items()]
        return self._model([self.contrib_node()], inputs, self.inits, TensorProto.FLOAT)

    def _standard_nodes(self, dtype, outs):
        b = Nodes(dtype)
        values = self.standard(b, dtype)
        for o, v in zip(self.outs, values):
            if o and o in outs:
                b("Identity", v, out=o)
        return b.nodes

    def standard_forward(self):
        outs = [o for o in self.outs if o]
        model = helper.make_model(
            helper.make_graph(self._standard_nodes(np.float64, outs), "f",
                              [helper.make_tensor_value_info(k, TensorProto.DOUBLE, list(v.shape))
                               for k, v in self.weights.items()],
                              [helper.make_empty_tensor_value_info(o) for o in outs]),
            opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 10
        values = reference_evaluator(model).run(None, {k: v.astype(np.float64) for k, v in self.weights.items()})
        return dict(zip(outs, values))

    def standard_model(self):
        inputs = [self._vi(k, v, TensorProto.FLOAT) for k, v in self.weights.items()]
        return self._model(self._standard_nodes(f32, list(self.proj)), inputs, {}, TensorProto.FLOAT)

    def swapped(self, built, dtype):
        """``built`` with the contrib node replaced by the standard formulation."""
        proto = onnx.ModelProto()
        proto.CopyFrom(built)
        nodes = list(proto.graph.node)
        k = next(i for i, nd in enumerate(nodes) if nd.op_type == self.op and nd.domain == MS)
        std = self._standard_nodes(dtype, [o for o in nodes[k].output if o])
        del proto.graph.node[:]
        proto.graph.node.extend(nodes[:k] + std + nodes[k + 1:])
        return proto


def _session(model, threads):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def check(case, directions=3):
    """The checks of the module docstring."""
    w = list(case.weights)
    # 1. expected: the standard formulation's float64 gradient, gradchecked on the reference evaluator
    report = gradcheck(case.standard_model(), w, "loss", case.weights, max_elements=6, directions=1)
    assert report.passed, str(report)
    expected = report.gradients

    # 2. the rule's graph in float64 with the contrib node swapped for the standard formulation
    built32 = grads_of(case.contrib_model(), w)
    assert not racing_nodes(built32.graph)
    built64 = case.swapped(to_float64(built32), np.float64)
    names = {i.name for i in built64.graph.input}
    feeds64 = {k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in case.feeds.items() if k in names}
    got = dict(zip([o.name for o in built64.graph.output], reference_evaluator(built64).run(None, feeds64)))
    for name in w:
        close(got[f"{name}_grad"], expected[name], 1e-7, 1e-9)

    # 3. onnxruntime's kernel computes what the standard formulation does
    probe = case.contrib_model()
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_empty_tensor_value_info(o) for o in case.expected_forward)
    forward = ort_run(probe, case.feeds)
    for o, ref in case.expected_forward.items():
        close(forward[o], ref, 1e-4, 1e-5)

    # 4. the float32 gradient graph on onnxruntime, at 1, 2 and 16 threads
    inputs = {i.name for i in built32.graph.input}
    feeds = {k: v for k, v in case.feeds.items() if k in inputs}
    runs = []
    for threads in (1, 2, 16):
        sess = _session(built32, threads)
        runs.append(dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds))))
    for name in w:
        close(runs[0][f"{name}_grad"], expected[name], 1e-3, 1e-4)
        for other in runs[1:]:
            close(other[f"{name}_grad"], runs[0][f"{name}_grad"], 1e-5, 1e-6)

    # 5. directional finite differences of the loss, onnxruntime's forward (float32)
    sess = ort_session(case.contrib_model())
    rng = np.random.default_rng(5)
    t = 1e-2
    for name in w:
        grad = runs[0][f"{name}_grad"].astype(np.float64)
        for _ in range(directions):
            d = rng.uniform(-1, 1, grad.shape)
            plus = sess.run(["loss"], {**case.feeds, name: (case.feeds[name] + t * d).astype(f32)})[0]
            minus = sess.run(["loss"], {**case.feeds, name: (case.feeds[name] - t * d).astype(f32)})[0]
            num = (float(plus) - float(minus)) / (2 * t)
            assert abs(num - np.sum(grad * d)) <= 5e-3 * max(1.0, abs(num)), (name, num, np.sum(grad * d))


# ----------------------------------------------------------------------------- GroupQueryAttention


def allowed_keys(lengths, seq, causal=True, window=-1):
    """(B, 1, S, S) bool: the keys j each query i sees (onnxruntime's CPU kernel)."""
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    out = j[None] < np.asarray(lengths)[:, None, None]
    if causal:
        out = out & (j <= i)
    if window >= 0:
        out = out & (i - j < window)
    return out[:, None]


def gqa_case(rng, *, heads=4, kv_heads=2, head_size=16, seq=4, packed=True, lengths=(4, 2), rotary=True,
             interleaved=False, rotary_dim=None, scale=None, softcap=0.0, window=-1, causal=True, bias_shape=None,
             sink=False, smooth=False, present_in_loss=False, padded_rows_in_loss=False, past="symbolic",
             dynamic=False, seed=0):
    d = head_size
    hid_q, hid_kv = heads * d, kv_heads * d
    q, k, v = arr(rng, B, seq, hid_q), arr(rng, B, seq, hid_kv), arr(rng, B, seq, hid_kv)
    weights = {"qkv": np.concatenate([q, k, v], -1)} if packed else {"q": q, "k": k, "v": v}
    ins = ["qkv", "", ""] if packed else ["q", "k", "v"]
    consts = {"past_key": np.zeros((B, kv_heads, 0, d), f32), "past_value": np.zeros((B, kv_heads, 0, d), f32),
              "seqlens_k": np.asarray(lengths, np.int32) - 1, "total_sequence_length": np.array(seq, np.int32)}
    ins += ["past_key", "past_value", "seqlens_k", "total_sequence_length"]
    dims = {}
    if past == "symbolic":
        dims.update(past_key=["batch", kv_heads, "past_sequence_length", d],
                    past_value=["batch", kv_heads, "past_sequence_length", d])
    if dynamic:
        dims.update({name: ["batch", "sequence", None] for name in weights})
    inits = {}
    half = (rotary_dim or d) // 2
    cos, sin = arr(rng, seq + 3, half, lo=-1, hi=1), arr(rng, seq + 3, half, lo=-1, hi=1)
    if rotary:
        inits.update(cos_cache=cos, sin_cache=sin)
        ins += ["cos_cache", "sin_cache"]
    if bias_shape is not None:
        ins += [""] * (10 - len(ins)) + ["attention_bias"]
        weights["attention_bias"] = arr(rng, *bias_shape)
    if sink:
        ins += [""] * (11 - len(ins)) + ["head_sink"]
        weights["head_sink"] = arr(rng, heads)
    attrs = {"num_heads": heads, "kv_num_heads": kv_heads, "do_rotary": int(rotary),
             "rotary_interleaved": int(interleaved), "local_window_size": window, "softcap": softcap}
    if scale is not None:
        attrs["scale"] = scale
    if not causal:
        attrs["causal"] = 0
    if smooth:
        attrs["smooth_softmax"] = 1
    allowed = allowed_keys(lengths, seq, causal, window)
    group = heads // kv_heads
    m = rotation_matrices(cos[:seq], sin[:seq], d, interleaved) if rotary else None

    def standard(b, dtype):
        if packed:
            x4 = _heads(b, "qkv", (B, seq, heads + 2 * kv_heads, d))
            edges = [0, heads, heads + kv_heads, heads + 2 * kv_heads]
            q4, k4, v4 = (b("Slice", x4, b.const([edges[i]], np.int64), b.const([edges[i + 1]], np.int64),
                            b.const([1], np.int64)) for i in range(3))
        else:
            q4, k4, v4 = (_heads(b, x, (B, seq, h, d)) for x, h in (("q", heads), ("k", kv_heads), ("v", kv_heads)))
        if rotary:
            q4, k4 = _rotated(b, q4, m), _rotated(b, k4, m)
        index = b.const([h // group for h in range(heads)], np.int64)
        kr, vr = b("Gather", k4, index, axis=1), b("Gather", v4, index, axis=1)
        z = b("Mul", b("MatMul", q4, b("Transpose", kr, perm=[0, 1, 3, 2])), b.const(scale or d ** -0.5))
        if softcap > 0:
            z = b("Mul", b("Tanh", b("Div", z, b.const(softcap))), b.const(softcap))
        if bias_shape is not None:
            z = b("Add", z, "attention_bias")
        sink_col = None
        if sink or smooth:
            logit = b("Reshape", "head_sink", b.const([1, heads, 1, 1], np.int64)) if sink else b.const(0.0)
            sink_col = b("Expand", logit, b.const([B, heads, seq, 1], np.int64))
        p = _softmax_masked(b, z, allowed, sink_col)
        return [_merged(b, b("MatMul", p, vr), (B, seq, -1)), k4, v4]

    valid_rows = (np.arange(seq)[None, :, None] < np.asarray(lengths)[:, None, None]).astype(f32)
    return Case("GroupQueryAttention", attrs, ins, ["y", "present_key", "present_value"], weights, consts, inits,
                standard, loss_outputs=["y", "present_key", "present_value"] if present_in_loss else ["y"],
                row_masks=None if padded_rows_in_loss else {"y": valid_rows}, dims=dims, seed=seed)


GQA_CASES = {
    "packed": {},
    "separate": {"packed": False},
    "interleaved": {"interleaved": True},
    "separate-interleaved": {"packed": False, "interleaved": True, "lengths": (3, 4)},
    "no-rotary": {"rotary": False},
    "mqa": {"kv_heads": 1},
    "mha": {"kv_heads": 4, "packed": False},
    "partial-rotary": {"head_size": 32, "rotary_dim": 16, "heads": 2, "kv_heads": 1},
    "scale": {"scale": 0.3, "packed": False},
    "softcap": {"softcap": 1.2, "scale": 0.7},
    "window": {"window": 2, "seq": 5, "lengths": (5, 3)},
    "window-empty-rows": {"window": 1, "lengths": (4, 2), "packed": False, "padded_rows_in_loss": True},
    "bidirectional": {"causal": False, "rotary": False},
    "present-in-loss": {"present_in_loss": True},
    "present-in-loss-separate": {"present_in_loss": True, "packed": False, "interleaved": True},
    "attention-bias": {"bias_shape": (B, 4, 4, 4), "softcap": 1.5},
    "attention-bias-broadcast": {"bias_shape": (1, 1, 4, 4), "packed": False},
    "head-sink": {"sink": True},
    "smooth-softmax": {"smooth": True, "kv_heads": 1},
    "static-empty-past": {"past": "static"},
    "dynamic-dims": {"dynamic": True, "present_in_loss": True},
}


@pytest.mark.parametrize("name", list(GQA_CASES))
def test_gqa(name, rng):
    check(gqa_case(rng, **GQA_CASES[name]))


def test_gqa_padded_rows_in_the_loss(rng):
    """Padded queries see the keys j < seqlens_k[b] + 1 on the CPU kernel; the rule computes
    the same, so even a loss that reads them gets the kernel's gradient."""
    check(gqa_case(rng, padded_rows_in_loss=True, lengths=(1, 3), present_in_loss=True))


def _float16(model):
    """``model`` with its float32 inputs, initializers and loss in float16."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for v in list(out.graph.input) + list(out.graph.output):
        if v.type.tensor_type.elem_type == TensorProto.FLOAT:
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
    for i, t in enumerate(out.graph.initializer):
        if t.data_type == TensorProto.FLOAT:
            half = numpy_helper.to_array(t).astype(np.float16)
            out.graph.initializer[i].CopyFrom(numpy_helper.from_array(half, t.name))
    return out


@pytest.mark.parametrize("name", ["packed", "present-in-loss-separate", "head-sink"])
def test_gqa_float16(name, rng):
    """The float16 model (the backward computed in float32, its gradients cast back) agrees
    with the float64 gradient at float16 precision."""
    case = gqa_case(rng, **GQA_CASES[name])
    expected = gradcheck(case.standard_model(), list(case.weights), "loss", case.weights, max_elements=2,
                         directions=0).gradients
    feeds = {k: v.astype(np.float16) if v.dtype == f32 else v for k, v in case.feeds.items()}
    got = ort_run(grads_of(_float16(case.contrib_model()), list(case.weights)), feeds)
    for w in case.weights:
        assert got[f"{w}_grad"].dtype == np.float16
        close(got[f"{w}_grad"], expected[w], 3e-2, 3e-2)


def test_gqa_cpu_kernel_forms(rng):
    """What the kernel accepts, pinning the forms the cases use: head sizes are multiples of 16,
    and the rotary cache width a multiple of 8 (partial rotary)."""
    case = gqa_case(rng)
    model = case.contrib_model()
    ort_run(model, case.feeds)
    small = gqa_case(rng, head_size=8)
    with pytest.raises(Exception, match="multiple of 16"):
        ort_run(small.contrib_model(), small.feeds)


def test_gqa_node_count(rng):
    """The backward stays a fixed, small set of nodes (no per-head or per-row unrolling)."""
    built = grads_of(gqa_case(rng, present_in_loss=True).contrib_model(), ["qkv"])
    rule_nodes = [nd for nd in built.graph.node if "GroupQueryAttention/grad/" in nd.name]
    assert len(rule_nodes) < 110, len(rule_nodes)
    assert sum(nd.op_type == "MatMul" for nd in rule_nodes) == 5


# ----------------------------------------------------------------------------- refusals


def _gqa_model(rng, extra_inputs=(), attrs=None, outputs=("y", "present_key", "present_value"), past_len=0,
               past_dims=None, loss_on="y", cos_weight=False, batch=B):
    """A float GroupQueryAttention model (packed QKV, heads 4 / 2, D 16) with ``extra_inputs``
    ((index, name, value)) and the loss sum(output ``loss_on``)."""
    seq, d = 4, 16
    feeds = {"qkv": arr(rng, batch, seq, 8 * d), "past_key": np.zeros((batch, 2, past_len, d), f32),
             "past_value": np.zeros((batch, 2, past_len, d), f32),
             "seqlens_k": np.full(batch, past_len + seq - 1, np.int32),
             "total_sequence_length": np.array(past_len + seq, np.int32),
             "cos_cache": arr(rng, 16, d // 2), "sin_cache": arr(rng, 16, d // 2)}
    ins = ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"]
    for i, name, value in extra_inputs:
        ins += [""] * (i + 1 - len(ins))
        ins[i] = name
        feeds[name] = value
    node = helper.make_node("GroupQueryAttention", ins, list(outputs), domain=MS, num_heads=4, kv_num_heads=2,
                            do_rotary=1, **(attrs or {}))
    dims = {k: list(v.shape) for k, v in feeds.items()}
    if past_dims is not None:
        dims["past_key"] = dims["past_value"] = past_dims
    inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), dims[k])
              for k, v in feeds.items()]
    nodes = [node, helper.make_node("ReduceSum", [loss_on], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    return model, feeds, ["qkv", "cos_cache"] if cos_weight else ["qkv"]


REFUSED = {
    "past of static length": (dict(past_len=2), "past_key' of length 2"),
    "position_ids with rotary": (dict(extra_inputs=[(9, "pos", np.zeros((B, 4), np.int64))]), "position_ids"),
    "query_seqlens": (dict(extra_inputs=[(16, "qs", np.full(B, 4, np.int32))]), "query_seqlens"),
    "q_norm_weight": (dict(extra_inputs=[(14, "qn", np.ones(16, f32)), (15, "kn", np.ones(16, f32))]),
                      "q_norm_weight"),
    "k_scale": (dict(extra_inputs=[(12, "ks", np.ones(1, f32))]), "k_scale"),
    "k_quant_type": (dict(attrs={"k_quant_type": "PER_TENSOR"}), "k_quant_type"),
    "sliding_window_cache": (dict(attrs={"sliding_window_cache": 1, "local_window_size": 2}), "sliding_window_cache"),
    "output_qk": (dict(attrs={"qk_output": 1}, outputs=("y", "present_key", "present_value", "qk"), loss_on="qk"),
                  "output_qk"),
    "cos_cache gradient": (dict(cos_weight=True), "cos_cache"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_gqa_refuses(name, rng):
    kw, message = REFUSED[name]
    model, _, weights = _gqa_model(rng, **kw)
    with pytest.raises(GradientRuleError, match=message) as info:
        grads_of(model, weights)
    assert "GroupQueryAttention" in str(info.value)


def test_gqa_non_empty_past_fails_at_run_time(rng):
    """A past whose length shape inference does not know is checked when the gradient runs: a
    past of length 2 (a valid forward: total_sequence_length = 2 + S) stops the step with an
    error that names the requirement (batch 1: the kernel takes a multi-token step after a
    past only then)."""
    model, feeds, weights = _gqa_model(rng, past_len=2, past_dims=[1, 2, "past_sequence_length", 16], batch=1)
    built = grads_of(model, weights)
    ort_run(model, feeds)  # the forward itself runs
    with pytest.raises(Exception, match="needs_an_empty_past_key"):
        ort_run(built, feeds)
    model0, feeds0, _ = _gqa_model(rng, past_dims=[B, 2, "past_sequence_length", 16])
    assert np.isfinite(ort_run(grads_of(model0, weights), feeds0)["qkv_grad"]).all()


# ----------------------------------------------------------------------------- RotaryEmbedding


def rope_case(rng, *, rank=3, interleaved=False, rotary_dim=None, positions="2d", num_heads=True, seed=0):
    heads, d, seq = 2, 8, 3
    half = (rotary_dim or d) // 2
    x = arr(rng, B, seq, heads * d) if rank == 3 else arr(rng, B, heads, seq, d)
    cos, sin = arr(rng, 10, half, lo=-1, hi=1), arr(rng, 10, half, lo=-1, hi=1)
    pos = rng.integers(0, 10, (B, seq)).astype(np.int64) if positions == "2d" else np.array([3], np.int64)
    rows = pos if positions == "2d" else np.tile(np.arange(seq) + pos[0], (B, 1))
    m = rotation_matrices(cos[rows], sin[rows], d, interleaved)[:, None]  # (B, 1, S, D, D)
    attrs = {"interleaved": int(interleaved)}
    if num_heads:
        attrs["num_heads"] = heads
    if rotary_dim:
        attrs["rotary_embedding_dim"] = rotary_dim

    def standard(b, dtype):
        if rank == 3:
            return [_merged(b, _rotated(b, _heads(b, "x", (B, seq, heads, d)), m), (B, seq, -1))]
        return [_rotated(b, "x", m)]

    return Case("RotaryEmbedding", attrs, ["x", "position_ids", "cos_cache", "sin_cache"], ["y"], {"x": x}, {},
                {"position_ids": pos, "cos_cache": cos, "sin_cache": sin}, standard, seed=seed)


ROPE_CASES = [dict(rank=r, interleaved=i, rotary_dim=rd, positions=p)
              for r in (3, 4) for i in (False, True) for rd, p in ((None, "2d"), (4, "offset"))]
ROPE_CASES.append(dict(rank=3, num_heads=False, positions="offset"))


@pytest.mark.parametrize("kw", ROPE_CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_rotary_embedding(kw, rng):
    check(rope_case(rng, **kw), directions=2)


def test_rotary_embedding_refuses(rng):
    case = rope_case(rng)
    model = case.contrib_model()
    model.graph.node[0].attribute.append(helper.make_attribute("is_packed_batching", 1))
    with pytest.raises(GradientRuleError, match="is_packed_batching"):
        grads_of(model, ["x"])
    with pytest.raises(GradientRuleError, match="cos_cache"):
        grads_of(case.contrib_model(), ["x", "cos_cache"])


# ----------------------------------------------------------------------------- MultiHeadAttention


def mha_case(rng, *, heads=2, head_size=8, v_head_size=8, seq=4, kv_seq=4, proj_bias=False, mask=None,
             bias_shape=None, unidirectional=False, scale=None, filter_value=None, present_in_loss=False,
             past=False, seed=0):
    d, dv = head_size, v_head_size
    weights = {"q": arr(rng, B, seq, heads * d), "k": arr(rng, B, kv_seq, heads * d),
               "v": arr(rng, B, kv_seq, heads * dv)}
    ins, consts, dims = ["q", "k", "v"], {}, {}

    def put(i, name):
        ins.extend([""] * (i + 1 - len(ins)))
        ins[i] = name

    if proj_bias:
        weights["bias"] = arr(rng, 2 * heads * d + heads * dv)
        put(3, "bias")
    if mask is not None:
        consts["key_padding_mask"] = mask
        put(4, "key_padding_mask")
    if bias_shape is not None:
        weights["attention_bias"] = arr(rng, *bias_shape)
        put(5, "attention_bias")
    if past:
        consts.update(past_key=np.zeros((B, heads, 0, d), f32), past_value=np.zeros((B, heads, 0, dv), f32))
        put(6, "past_key")
        put(7, "past_value")
        dims.update(past_key=["batch", heads, "past", d], past_value=["batch", heads, "past", dv])
    attrs = {"num_heads": heads, "unidirectional": int(unidirectional)}
    if scale is not None:
        attrs["scale"] = scale
    if filter_value is not None:
        attrs["mask_filter_value"] = filter_value
    add = np.zeros((B, 1, 1, kv_seq))
    fv = -10000.0 if filter_value is None else filter_value
    if mask is not None and mask.ndim == 1:
        add = np.where(np.arange(kv_seq)[None, None, None] >= mask[:, None, None, None], fv, 0.0)
    elif mask is not None:
        add = np.where((mask == 0)[:, None] if mask.ndim == 3 else (mask == 0)[:, None, None], fv, 0.0)
    allowed = np.ones((1, 1, seq, kv_seq), bool)
    if unidirectional:
        allowed = (np.arange(kv_seq)[None] <= np.arange(seq)[:, None])[None, None]

    def standard(b, dtype):
        q, k, v = "q", "k", "v"
        if proj_bias:
            edges = [0, heads * d, 2 * heads * d, 2 * heads * d + heads * dv]
            q, k, v = (b("Add", x, b("Slice", "bias", b.const([edges[i]], np.int64), b.const([edges[i + 1]], np.int64)))
                       for i, x in enumerate((q, k, v)))
        q4, k4 = _heads(b, q, (B, seq, heads, d)), _heads(b, k, (B, kv_seq, heads, d))
        v4 = _heads(b, v, (B, kv_seq, heads, dv))
        z = b("Mul", b("MatMul", q4, b("Transpose", k4, perm=[0, 1, 3, 2])), b.const(scale or d ** -0.5))
        z = b("Add", z, b.const(add))
        if bias_shape is not None:
            z = b("Add", z, "attention_bias")
        p = _softmax_masked(b, z, np.broadcast_to(allowed, (B, 1, seq, kv_seq)))
        return [_merged(b, b("MatMul", p, v4), (B, seq, -1)), k4, v4]

    return Case("MultiHeadAttention", attrs, ins, ["y", "present_key", "present_value"], weights, consts, {}, standard,
                loss_outputs=["y", "present_key", "present_value"] if present_in_loss else ["y"], dims=dims, seed=seed)


MHA_CASES = {
    "plain": {},
    "cross": {"seq": 3, "kv_seq": 5, "v_head_size": 4, "scale": 0.4},
    "projection-bias": {"proj_bias": True, "present_in_loss": True},
    "padding-mask": {"mask": np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int32), "filter_value": -3.0},
    "key-lengths": {"mask": np.array([4, 2], np.int32)},
    "mask-3d": {"mask": np.array([[[1, 0, 1, 1]] * 4, [[1, 1, 0, 0]] * 4], np.int32), "filter_value": -2.0},
    "unidirectional": {"unidirectional": True, "mask": np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.int32),
                       "bias_shape": (1, 2, 4, 4)},
    "unidirectional-more-queries": {"unidirectional": True, "seq": 5, "kv_seq": 3, "bias_shape": (B, 1, 5, 3)},
    "empty-past": {"past": True, "present_in_loss": True, "proj_bias": True},
}


@pytest.mark.parametrize("name", list(MHA_CASES))
def test_mha(name, rng):
    check(mha_case(rng, **MHA_CASES[name]), directions=2)


def test_mha_refuses(rng):
    case = mha_case(rng, seq=3, kv_seq=5, unidirectional=True)
    with pytest.raises(GradientRuleError, match="unidirectional=1 with 3 queries and 5 keys"):
        grads_of(case.contrib_model(), list(case.weights))
    packed = mha_case(rng).contrib_model()
    node = packed.graph.node[0]
    node.input[1] = node.input[2] = ""
    with pytest.raises(GradientRuleError, match="packed QKV"):
        grads_of(packed, ["q"])
    qk = mha_case(rng).contrib_model()
    qk.graph.node[0].output.append("qk")
    qk.graph.node[-1].input.append("qk_s")
    qk.graph.node.insert(1, helper.make_node("ReduceSum", ["qk"], ["qk_s"], keepdims=0))
    with pytest.raises(GradientRuleError, match="'qk'"):
        grads_of(qk, ["q", "k", "v"])
    bnsh = mha_case(rng).contrib_model()  # key and value given as (B, H, T, D)
    for v in bnsh.graph.input[1:3]:
        v.type.tensor_type.shape.dim.insert(1, onnx.TensorShapeProto.Dimension(dim_value=2))
    with pytest.raises(GradientRuleError, match="'key' of rank 4"):
        grads_of(bnsh, ["q"])


# ----------------------------------------------------------------------------- a model builder decoder


def test_model_builder_decoder_against_transformers(tmp_path):
    """onnxruntime-genai's builder output for a tiny Llama (packed QKV into GroupQueryAttention
    with rotary, a right-padded batch): the gradient of the first layer's QKV weight equals
    transformers' float64 autograd gradient of the same checkpoint."""
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("tokenizers")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import json

    from ..genai_models import genai_folder, hf_folder

    folder = genai_folder(tmp_path, "llama")
    model = onnx.load(str(folder / "model.onnx"))
    config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 200, (B, 7)).astype(np.int64)
    mask = np.ones((B, 7), np.int64)
    mask[1, 4:] = 0
    feeds = {"input_ids": ids, "attention_mask": mask}
    for layer in range(config["num_hidden_layers"]):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kv}"] = np.zeros(
                (B, config["num_key_value_heads"], 0, config["head_size"]), f32)
    proj = (rng.standard_normal((B, 7, 1)) * mask[:, :, None]).astype(f32)  # padded positions left out
    model.graph.initializer.append(numpy_helper.from_array(proj, "proj"))
    model.graph.node.extend([helper.make_node("Mul", ["logits", "proj"], ["projected"]),
                             helper.make_node("ReduceSum", ["projected"], ["loss"], keepdims=0)])
    model.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    weight = "model.layers.0.attn.qkv_proj.MatMul.weight"
    assert any(n.op_type == "GroupQueryAttention" and n.domain == MS for n in model.graph.node)
    got = ort_run(grads_of(model, [weight]), feeds)[f"{weight}_grad"]

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_folder(tmp_path, "llama"), dtype=torch.float64,
                                                           attn_implementation="eager")
    logits = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    (logits * torch.tensor(proj, dtype=torch.float64)).sum().backward()
    attn = hf.model.layers[0].self_attn
    expected = torch.cat([p.weight.grad.T for p in (attn.q_proj, attn.k_proj, attn.v_proj)], 1).numpy()
    close(got, expected, 1e-4, 1e-6)
