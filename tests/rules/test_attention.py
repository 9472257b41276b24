import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import check_op, make_op_model, numeric_gradient, ort_grads, ort_session, to_float64

f32 = np.float32
B, S, D = 2, 3, 4


@pytest.fixture
def t(rng):
    return lambda *shape: rng.standard_normal(shape).astype(f32)


def symbolic_leading_dims(model):
    """Graph inputs with every dim but the last made symbolic (batch, heads, sequence)."""
    for vi in model.graph.input:
        for k, d in enumerate(list(vi.type.tensor_type.shape.dim)[:-1]):
            d.dim_param = f"{vi.name}_d{k}"
    return model


# ----------------------------------------------------------------------------- Attention


def attn_cases(t):
    """(name, inputs, attrs, num_outputs)"""
    no_mask = ("", None)
    return [
        ("mha", [("Q", t(B, 2, S, D)), ("K", t(B, 2, S, D)), ("V", t(B, 2, S, D))], {}, 1),
        ("mha-all-outputs", [("Q", t(B, 2, S, D)), ("K", t(B, 2, S, D)), ("V", t(B, 2, S, D))], {}, 4),
        ("gqa-past-causal-mode3", [("Q", t(B, 4, S, D)), ("K", t(B, 2, S, D)), ("V", t(B, 2, S, 5)), no_mask,
                                   ("past_key", t(B, 2, 2, D)), ("past_value", t(B, 2, 2, 5))],
         {"is_causal": 1, "qk_matmul_output_mode": 3}, 4),
        ("mqa-cross-float-mask", [("Q", t(B, 3, S, D)), ("K", t(B, 1, 5, D)), ("V", t(B, 1, 5, D)),
                                  ("mask", t(B, 1, S, 5))], {"scale": 0.6}, 4),
        ("3d-gqa-mask-past-mode2", [("Q", t(B, S, 4 * D)), ("K", t(B, S, 2 * D)), ("V", t(B, S, 2 * 3)),
                                    ("mask", t(S, 5)), ("past_key", t(B, 2, 2, D)), ("past_value", t(B, 2, 2, 3))],
         {"q_num_heads": 4, "kv_num_heads": 2, "qk_matmul_output_mode": 2}, 4),
        ("3d-bool-mask-causal-softcap-mode1",  # the middle row is fully masked: a zero row
         [("Q", t(B, S, 2 * D)), ("K", t(B, S, 2 * D)), ("V", t(B, S, 2 * D)),
          ("mask", np.array([[True, False, True], [False, False, False], [True, True, False]]))],
         {"q_num_heads": 2, "kv_num_heads": 2, "qk_matmul_output_mode": 1, "softcap": 1.5, "is_causal": 1}, 4),
        ("causal-float-mask-with-inf-past", [("Q", t(B, 2, S, D)), ("K", t(B, 2, S, D)), ("V", t(B, 2, S, D)),
                                             ("mask", np.where(np.eye(S, 5, 1) > 0, -np.inf, t(S, 5)).astype(f32)),
                                             ("past_key", t(B, 2, 2, D)), ("past_value", t(B, 2, 2, D))],
         {"is_causal": 1, "qk_matmul_output_mode": 3}, 4),
        ("scale-softcap-mode1-cross", [("Q", t(B, 2, S, D)), ("K", t(B, 2, 5, D)), ("V", t(B, 2, 5, 3))],
         {"scale": 0.7, "softcap": 2.0, "qk_matmul_output_mode": 1}, 4),
        ("softcap-mode2-gqa", [("Q", t(B, 4, S, D)), ("K", t(B, 2, S, D)), ("V", t(B, 2, S, D)),
                               ("mask", t(B, 4, S, S))], {"softcap": 1.0, "qk_matmul_output_mode": 2}, 4),
        ("present-only", [("Q", t(B, 2, S, D)), ("K", t(B, 2, S, D)), ("V", t(B, 2, S, D)), no_mask,
                          ("past_key", t(B, 2, 1, D)), ("past_value", t(B, 2, 1, D))], {}, 3),
    ]


CASE_NAMES = [c[0] for c in attn_cases(lambda *s: np.zeros(s, f32))]


@pytest.mark.parametrize("k", range(len(CASE_NAMES)), ids=CASE_NAMES)
def test_attention(k, t):
    _, inputs, attrs, outputs = attn_cases(t)[k]
    check_op("Attention", inputs, attrs, opset=23, num_outputs=outputs)


# onnx's shape inference for Attention (onnx 1.23) gives qk_matmul_output a last dim of 0
# when the key sequence length is not a static int, and a 3-D Y a last dim of 0 when V's
# hidden size is not static; such forward models do not type-check. Dynamic-shape cases
# therefore leave out qk_matmul_output, and 3-D inputs keep their hidden size static.
@pytest.mark.parametrize("k", [0, 2, 3, 6, 9], ids=[CASE_NAMES[i] for i in (0, 2, 3, 6, 9)])
def test_attention_dynamic(k, t):
    _, inputs, attrs, outputs = attn_cases(t)[k]
    check_op("Attention", inputs, attrs, opset=23, num_outputs=min(outputs, 3), weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("k", [4, 5], ids=[CASE_NAMES[i] for i in (4, 5)])
def test_attention_3d_symbolic(k, t):
    _, inputs, attrs, outputs = attn_cases(t)[k]
    model, weights, feeds = make_op_model("Attention", inputs, attrs, opset=23, num_outputs=3, weights_as="inputs")
    check_model_untyped(symbolic_leading_dims(model), weights, feeds)


def test_attention_mask_shorter_than_keys(t):
    """onnx's reference pads a mask shorter than the total sequence with -inf (False);
    onnxruntime rejects such a mask, so this form is checked on the reference only."""
    inputs = [("Q", t(B, 2, S, D)), ("K", t(B, 2, S, D)), ("V", t(B, 2, S, D)), ("mask", t(B, 1, S, 4)),
              ("past_key", t(B, 2, 2, D)), ("past_value", t(B, 2, 2, D))]
    check_op("Attention", inputs, {"is_causal": 1}, opset=23, num_outputs=3, ort=False)
    check_op("Attention", inputs, {}, opset=23, num_outputs=3, ort=False, weights_as="inputs", dims="dynamic")


def test_attention_float16_softmax_precision(t):
    """float16 inputs with the softmax in float32. The float64 gradcheck keeps that float32
    softmax (softmax_precision is not widened), so it uses a larger step."""
    inputs = [("Q", t(B, 4, S, D).astype(np.float16)), ("K", t(B, 2, S, D).astype(np.float16)),
              ("V", t(B, 2, S, D).astype(np.float16)), ("mask", t(S, S).astype(np.float16))]
    check_op("Attention", inputs, {"softmax_precision": int(TensorProto.FLOAT), "is_causal": 1}, opset=23,
             num_outputs=4, eps=1e-3, rtol=2e-3, atol=1e-5, ort_rtol=2e-2, ort_atol=2e-2)


def test_attention_grads_for_some_inputs_only(t):
    inputs = [("Q", t(B, 4, S, D)), ("K", t(B, 2, S, D)), ("V", t(B, 2, S, D)), ("mask", t(S, S + 2)),
              ("past_key", t(B, 2, 2, D)), ("past_value", t(B, 2, 2, D))]
    for wrt in (["Q"], ["K", "past_value"], ["mask"], ["V"]):
        check_op("Attention", inputs, {"qk_matmul_output_mode": 2}, opset=23, num_outputs=4, wrt=wrt)
        check_op("Attention", inputs, {"qk_matmul_output_mode": 0, "is_causal": 1}, opset=23, num_outputs=3, wrt=wrt)


def test_attention_qk_mode0_with_softcap(t):
    """Mode 0 returns the raw QK product (spec, function body, onnxruntime); onnx 1.23's
    reference returns the softcapped one, so this case is checked with onnxruntime's own
    float64 finite differences (without is_causal: onnxruntime 1.31 cannot build a float64
    causal Attention)."""
    inputs = [("Q", t(B, 4, S, D)), ("K", t(B, 2, S, D)), ("V", t(B, 2, S, D)), ("mask", t(S, S))]
    ort_gradcheck("Attention", inputs, {"softcap": 1.2, "qk_matmul_output_mode": 0}, outputs=4)


def test_attention_skipped_outputs(t):
    """Y and qk_matmul_output used, present_key / present_value left out ("" outputs)."""
    inputs = {"Q": t(B, 4, S, D), "K": t(B, 2, S, D), "V": t(B, 2, S, D), "mask": t(S, S)}
    for mode in range(4):
        node = helper.make_node("Attention", list(inputs), ["y", "", "", "qk"], qk_matmul_output_mode=mode,
                                softcap=1.3 if mode in (1, 2) else 0.0)
        proj = [numpy_helper.from_array(t(B, 4, S, D), "py"), numpy_helper.from_array(t(B, 4, S, S), "pqk")]
        nodes = [node, helper.make_node("Mul", ["y", "py"], ["my"]), helper.make_node("Mul", ["qk", "pqk"], ["mqk"]),
                 helper.make_node("ReduceSum", ["my"], ["sy"], keepdims=0),
                 helper.make_node("ReduceSum", ["mqk"], ["sqk"], keepdims=0),
                 helper.make_node("Add", ["sy", "sqk"], ["loss"])]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape)
                                               for k, v in inputs.items()],
                                  [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], proj)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
        model.ir_version = 10
        check_model_untyped(model, list(inputs), inputs)


def test_attention_nonpad_kv_seqlen_opset24(t):
    """An external cache: keys at or past nonpad_kv_seqlen[b] are padding, and the causal
    frontier is offset by nonpad_kv_seqlen[b] - q_sequence_length (2 - 3 < 0 fully masks
    the first row of batch 1)."""
    inputs = [("Q", t(B, 4, S, D)), ("K", t(B, 2, 5, D)), ("V", t(B, 2, 5, D)), ("mask", t(S, 5)), ("", None),
              ("", None), ("nonpad", np.array([4, 2]))]
    check_op("Attention", inputs, {"is_causal": 1, "qk_matmul_output_mode": 3}, opset=24, num_outputs=4)
    check_op("Attention", inputs[:3] + [("", None)] * 3 + inputs[6:], {}, opset=24, num_outputs=3,
             weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("attrs", [{"left_window_size": 1, "is_causal": 1},
                                   {"left_window_size": 2, "right_window_size": 0},
                                   {"right_window_size": 1, "qk_matmul_output_mode": 3}])
def test_attention_sliding_window_opset25(attrs, t):
    """onnxruntime 1.31 does not know Attention-25's window attributes: reference only."""
    inputs = [("Q", t(B, 2, S, D)), ("K", t(B, 2, S, D)), ("V", t(B, 2, S, D)), ("mask", t(S, 5)),
              ("past_key", t(B, 2, 2, D)), ("past_value", t(B, 2, 2, D))]
    check_op("Attention", inputs, attrs, opset=25, num_outputs=4, ort=False)


def ort_gradcheck(op, inputs, attrs, *, outputs, opset=23, eps=1e-6):
    """Gradients on onnxruntime (float64) against onnxruntime's finite differences."""
    floats = {n: a.astype(np.float64) for n, a in inputs if n and a.dtype.kind == "f"}
    names = [f"y{i}" for i in range(outputs)]
    node = helper.make_node(op, [n for n, _ in inputs], names, **attrs)
    vi = [helper.make_tensor_value_info(n, TensorProto.DOUBLE, list(a.shape)) for n, a in floats.items()]
    outs = [helper.make_empty_tensor_value_info(y) for y in names]
    probe = helper.make_model(helper.make_graph([node], "p", vi, outs), opset_imports=[helper.make_opsetid("", opset)])
    probe.ir_version = 10
    values = ort_session(probe).run(None, floats)
    rng = np.random.default_rng(7)
    nodes, inits, terms = [node], [], []
    for y, value in zip(names, values):
        inits.append(numpy_helper.from_array(rng.standard_normal(value.shape), f"{y}_p"))
        nodes += [helper.make_node("Mul", [y, f"{y}_p"], [f"{y}_m"]),
                  helper.make_node("ReduceSum", [f"{y}_m"], [f"{y}_s"], keepdims=0)]
        terms.append(f"{y}_s")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    model = helper.make_model(
        helper.make_graph(nodes, "g", vi, [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])], inits),
        opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    got = ort_grads(model, list(floats), floats)
    sess = ort_session(model)
    for w, base in floats.items():
        num = numeric_gradient(lambda v: sess.run(["loss"], {**floats, w: v})[0], base, eps)
        np.testing.assert_allclose(got[w], num, rtol=1e-5, atol=1e-7, err_msg=w)


# ----------------------------------------------------------------------------- float64 check by hand


def check_model_untyped(model, weights, feeds, *, samples=24, eps=1e-6, seed=0):
    """gradbuilder.testing.check_model's two checks, by hand: float64 finite differences on
    onnx's stock reference evaluator without type-checking the float64 model (RotaryEmbedding
    has no float64 type), then the float32 gradients on onnxruntime."""
    built = GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build().model_proto
    base = {k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in feeds.items()}
    inits = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer if i.name in weights}
    wv = {w: base[w] if w in base else inits[w] for w in weights}
    ev = ReferenceEvaluator(to_float64(built))
    out_names = [o.name for o in built.graph.output]
    got = dict(zip(out_names, ev.run(None, {**base, **wv})))
    fwd = ReferenceEvaluator(to_float64(model))
    fwd_inputs = {i.name for i in model.graph.input}

    def loss(w, value):
        feed = {k: v for k, v in {**base, **wv, w: value}.items() if k in fwd_inputs}
        if w not in fwd_inputs:  # an initializer weight: rebuild the evaluator with the new value
            m = to_float64(model)
            for init in m.graph.initializer:
                if init.name == w:
                    init.CopyFrom(numpy_helper.from_array(value, w))
            return float(ReferenceEvaluator(m).run(None, feed)[0])
        return float(fwd.run(None, feed)[0])

    rng = np.random.default_rng(seed)
    for w in weights:
        g = np.asarray(got[f"{w}_grad"])
        x = wv[w]
        assert g.shape == x.shape, (w, g.shape, x.shape)
        directions = [rng.standard_normal(x.shape) for _ in range(2)]
        for i in rng.choice(x.size, min(samples, x.size), replace=False):
            d = np.zeros(x.size)
            d[i] = 1.0
            directions.append(d.reshape(x.shape))
        for d in directions:
            num = (loss(w, x + eps * d) - loss(w, x - eps * d)) / (2 * eps)
            np.testing.assert_allclose(np.sum(g * d), num, rtol=1e-4, atol=1e-6, err_msg=w)
    ort_out = ort_grads(model, weights, feeds)
    for w in weights:
        ref = np.asarray(got[f"{w}_grad"])
        np.testing.assert_allclose(ort_out[w], ref, rtol=2e-3, atol=2e-4 * max(1.0, np.abs(ref).max()))


# ----------------------------------------------------------------------------- RotaryEmbedding

POS = np.array([[0, 1, 2, 3], [4, 2, 2, 0]])  # repeated positions: their cache rows add up

ROPE = [  # (name, x shape, cache shape, positions, attrs)
    ("4d", (B, 3, 4, 6), (5, 3), POS, {}),
    ("4d-interleaved", (B, 3, 4, 6), (5, 3), POS, {"interleaved": 1}),
    ("4d-partial", (B, 3, 4, 8), (5, 2), POS, {"rotary_embedding_dim": 4}),
    ("4d-partial-interleaved", (B, 3, 4, 8), (5, 2), POS, {"rotary_embedding_dim": 4, "interleaved": 1}),
    ("3d", (B, 4, 12), (5, 3), POS, {"num_heads": 2}),
    ("3d-interleaved-partial", (B, 4, 16), (5, 2), POS, {"num_heads": 2, "interleaved": 1,
                                                          "rotary_embedding_dim": 4}),
    ("3d-no-positions", (B, 4, 12), (B, 4, 3), None, {"num_heads": 2}),
    ("4d-no-positions-interleaved-partial", (B, 3, 4, 8), (B, 4, 2), None,
     {"interleaved": 1, "rotary_embedding_dim": 4}),
]


def rope_inputs(t, case):
    _, xs, cs, pos, _ = case
    inputs = [("x", t(*xs)), ("cos", t(*cs)), ("sin", t(*cs))]
    return inputs + ([("pos", pos)] if pos is not None else [])


@pytest.mark.parametrize("case", ROPE, ids=[c[0] for c in ROPE])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_rotary_embedding(case, dims, t):
    model, weights, feeds = make_op_model("RotaryEmbedding", rope_inputs(t, case), case[4], opset=23,
                                          weights_as="inputs", dims=dims)
    check_model_untyped(model, weights, feeds)


def test_rotary_embedding_x_only_and_constant_caches(t):
    """Caches as constants (real cos/sin tables): only x gets a gradient."""
    angles = np.arange(5)[:, None] * np.array([1.0, 0.1, 0.01])
    inputs = [("x", t(B, 3, 4, 6)), ("cos", np.cos(angles).astype(f32)), ("sin", np.sin(angles).astype(f32)),
              ("pos", POS)]
    model, weights, feeds = make_op_model("RotaryEmbedding", inputs, {}, opset=23, wrt=["x"], weights_as="inputs")
    check_model_untyped(model, weights, feeds)


def test_rotary_embedding_float16(t):
    inputs = [(n, a.astype(np.float16) if a.dtype == f32 else a) for n, a in rope_inputs(t, ROPE[1])]
    model, weights, feeds = make_op_model("RotaryEmbedding", inputs, {"interleaved": 1}, opset=23,
                                          weights_as="inputs")
    model32, _, feeds32 = make_op_model("RotaryEmbedding", [(n, a.astype(f32) if a.dtype == np.float16 else a)
                                                            for n, a in inputs], {"interleaved": 1}, opset=23,
                                        weights_as="inputs")
    got16, got32 = ort_grads(model, weights, feeds), ort_grads(model32, weights, feeds32)
    for w in weights:
        np.testing.assert_allclose(got16[w].astype(f32), got32[w], rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- FlexAttention

PREVIEW = "ai.onnx.preview"
F = TensorProto.FLOAT


def modifier(name, nodes, inits=(), dtype=F):
    """A score_mod / prob_mod subgraph (x) -> (out) of rank-4 tensors."""
    return helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", dtype, [None] * 4)],
                             [helper.make_tensor_value_info("out", dtype, [None] * 4)], list(inits))


def np_type(dtype):
    return helper.tensor_dtype_to_np_dtype(dtype)


def positions(prefix):
    """Nodes giving ``{prefix}_q`` (L, 1) and ``{prefix}_k`` (1, S): the int64 positions
    along x's last two axes."""
    def c(name, v):
        return helper.make_node("Constant", [], [f"{prefix}_{name}"], value=numpy_helper.from_array(np.array(v)))

    return [c("zero", 0), c("one", 1), c("two", [2]), c("three", [3]), c("col", [-1, 1]), c("row", [1, -1]),
            helper.make_node("Shape", ["x"], [f"{prefix}_shape"]),
            helper.make_node("Gather", [f"{prefix}_shape", f"{prefix}_two"], [f"{prefix}_L"]),
            helper.make_node("Gather", [f"{prefix}_shape", f"{prefix}_three"], [f"{prefix}_S"]),
            helper.make_node("Squeeze", [f"{prefix}_L"], [f"{prefix}_Ls"]),
            helper.make_node("Squeeze", [f"{prefix}_S"], [f"{prefix}_Ss"]),
            helper.make_node("Range", [f"{prefix}_zero", f"{prefix}_Ls", f"{prefix}_one"], [f"{prefix}_qr"]),
            helper.make_node("Range", [f"{prefix}_zero", f"{prefix}_Ss", f"{prefix}_one"], [f"{prefix}_kr"]),
            helper.make_node("Reshape", [f"{prefix}_qr", f"{prefix}_col"], [f"{prefix}_q"]),
            helper.make_node("Reshape", [f"{prefix}_kr", f"{prefix}_row"], [f"{prefix}_k"])]


def softcap(cap, dtype=F):
    """tanh(x / cap) cap (Gemma 2)"""
    k = numpy_helper.from_array(np.array(cap, dtype=np_type(dtype)), "cap")
    return modifier("softcap", [helper.make_node("Div", ["x", "cap"], ["d"]), helper.make_node("Tanh", ["d"], ["t"]),
                                helper.make_node("Mul", ["t", "cap"], ["out"])], [k], dtype)


def causal(dtype=F):
    """Where(key <= query, x, -inf): the masked scores get no gradient."""
    ninf = numpy_helper.from_array(np.array(-np.inf, dtype=np_type(dtype)), "ninf")
    nodes = positions("p") + [helper.make_node("GreaterOrEqual", ["p_q", "p_k"], ["keep"]),
                              helper.make_node("Where", ["keep", "x", "ninf"], ["out"])]
    return modifier("causal", nodes, [ninf], dtype)


def relative_bias(slope, dtype=F):
    """x + slope (query - key), the positions read from x's shape at run time."""
    s = numpy_helper.from_array(np.array(slope, dtype=np_type(dtype)), "slope")
    nodes = positions("p") + [
        helper.make_node("Sub", ["p_q", "p_k"], ["rel"]), helper.make_node("Cast", ["rel"], ["relf"], to=dtype),
        helper.make_node("Mul", ["relf", "slope"], ["bias"]), helper.make_node("Add", ["x", "bias"], ["out"])]
    return modifier("relative", nodes, [s], dtype)


def sharpen(dtype=F):
    """p^2 / sum(p^2): a non-linear prob_mod."""
    return modifier("sharpen", [helper.make_node("Mul", ["x", "x"], ["sq"]),
                                helper.make_node("ReduceSum", ["sq", "axis"], ["tot"], keepdims=1),
                                helper.make_node("Div", ["sq", "tot"], ["out"])],
                    [numpy_helper.from_array(np.array([-1]), "axis")], dtype)


def scaled(k, dtype=F):
    """x k"""
    return modifier("scaled", [helper.make_node("Mul", ["x", "k"], ["out"])],
                    [numpy_helper.from_array(np.array(k, dtype=np_type(dtype)), "k")], dtype)


def identity(dtype=F):
    return helper.make_graph([], "identity", [helper.make_tensor_value_info("x", dtype, [None] * 4)],
                             [helper.make_tensor_value_info("x", dtype, [None] * 4)])


def flex_inputs(t, hq=2, hkv=2, lq=3, s=4, e=D, ev=D):
    return [("Q", t(B, hq, lq, e)), ("K", t(B, hkv, s, e)), ("V", t(B, hkv, s, ev))]


FLEX = [  # (name, input sizes, attrs)
    ("default", {}, {}),
    ("scale", {}, {"scale": 0.3}),
    ("gqa", dict(hq=4, hkv=2), {}),
    ("mqa-diff-head-sizes", dict(hq=3, hkv=1, ev=5), {}),
    ("softcap", {}, {"score_mod": softcap(1.5)}),
    ("causal", dict(lq=4, s=4), {"score_mod": causal()}),
    ("relative-bias-gqa", dict(hq=4, hkv=2), {"score_mod": relative_bias(0.3)}),
    ("prob-scaled", {}, {"prob_mod": scaled(0.5)}),
    ("prob-sharpen", {}, {"prob_mod": sharpen()}),
    ("both-mods", dict(hq=4, hkv=1, lq=4, s=4), {"score_mod": causal(), "prob_mod": sharpen(), "scale": 0.8}),
    ("identity-mods", {}, {"score_mod": identity(), "prob_mod": identity()}),
    ("softmax-precision-double", {}, {"softmax_precision": int(TensorProto.DOUBLE)}),
]


def check_flex(inputs, attrs, **kw):
    """onnxruntime 1.31 has no FlexAttention: reference evaluator only."""
    return check_op("FlexAttention", inputs, attrs, opset=26, domain=PREVIEW, ort=False, **kw)


@pytest.mark.parametrize("case", FLEX, ids=[c[0] for c in FLEX])
def test_flex_attention(case, t):
    _, sizes, attrs = case
    check_flex(flex_inputs(t, **sizes), attrs)


@pytest.mark.parametrize("k", [2, 6, 9], ids=[FLEX[i][0] for i in (2, 6, 9)])
def test_flex_attention_dynamic(k, t):
    """Unknown dims: the group size and the default scale are computed at run time."""
    _, sizes, attrs = FLEX[k]
    check_flex(flex_inputs(t, **sizes), attrs, weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("wrt", [["Q"], ["K"], ["V"], ["K", "V"]])
def test_flex_attention_some_inputs(wrt, t):
    check_flex(flex_inputs(t, hq=4, hkv=2), {"score_mod": relative_bias(0.2), "prob_mod": sharpen()}, wrt=wrt)


def test_flex_attention_float16(t):
    """float16 inputs with the softmax (and the subgraphs) in float32 by default: the float16
    gradients are close to the float64 ones."""
    inputs = flex_inputs(t, hq=4, hkv=2, lq=4, s=4)
    attrs = {"score_mod": causal(), "prob_mod": scaled(0.5)}
    report = check_flex(inputs, attrs)
    half = [(n, a.astype(np.float16)) for n, a in inputs]
    model, weights, feeds = make_op_model("FlexAttention", half, attrs, opset=26, domain=PREVIEW, weights_as="inputs")
    built = GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build().model_proto
    got = ReferenceEvaluator(built).run([f"{w}_grad" for w in weights], feeds)
    for w, g in zip(weights, got):
        ref = report.gradients[w]
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float64), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max(), err_msg=w)


def test_flex_attention_softmax_precision_float32_for_float16(t):
    """An explicit float32 softmax_precision on float16 inputs (the float64 check keeps the
    float32 softmax, hence the larger step and tolerance)."""
    inputs = [(n, a.astype(np.float16)) for n, a in flex_inputs(t)]
    check_flex(inputs, {"softmax_precision": int(F)}, eps=3e-3, rtol=1e-2, atol=1e-3)


def test_flex_attention_score_mod_reads_an_outer_weight(t):
    """A score_mod that adds an outer (L, S) bias: the bias gets its gradient through the
    subgraph. onnx's reference cannot run a FlexAttention whose subgraph reads outer
    values, so the check is against finite differences of a numpy forward, and the
    gradient graph is built without the forward outputs."""
    q, k, v = (a.astype(np.float64) for _, a in flex_inputs(t, hq=4, hkv=2))
    bias = t(3, 4).astype(np.float64)
    proj = np.random.default_rng(5).standard_normal((B, 4, 3, D))
    mod = modifier("outer", [helper.make_node("Add", ["x", "bias"], ["out"])], dtype=TensorProto.DOUBLE)
    node = helper.make_node("FlexAttention", ["Q", "K", "V"], ["Y"], domain=PREVIEW, score_mod=mod)
    nodes = [node, helper.make_node("Mul", ["Y", "proj"], ["m"]),
             helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    feeds = {"Q": q, "K": k, "V": v, "bias": bias}
    vis = [helper.make_tensor_value_info(n, TensorProto.DOUBLE, a.shape) for n, a in feeds.items()]
    model = helper.make_model(
        helper.make_graph(nodes, "g", vis, [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
                          [numpy_helper.from_array(proj, "proj")]),
        opset_imports=[helper.make_opsetid("", 26), helper.make_opsetid(PREVIEW, 1)])
    model.ir_version = 10
    built = GradientGraphBuilder(model, weights=list(feeds), outputs=[], loss="loss").build().model_proto
    assert not any(n.op_type == "FlexAttention" for n in built.graph.node)
    got = dict(zip([o.name for o in built.graph.output], ReferenceEvaluator(built).run(None, feeds)))

    def loss(values):
        kr, vr = np.repeat(values["K"], 2, axis=1), np.repeat(values["V"], 2, axis=1)
        z = values["Q"] @ kr.swapaxes(-1, -2) * float(np.float32(D) ** -0.5) + values["bias"]
        p = np.exp(z - z.max(-1, keepdims=True))
        return float(np.sum((p / p.sum(-1, keepdims=True) @ vr) * proj))

    for w in feeds:
        num = numeric_gradient(lambda a: loss({**feeds, w: a}), feeds[w], 1e-6)
        np.testing.assert_allclose(got[f"{w}_grad"], num, rtol=1e-5, atol=1e-7, err_msg=w)


def test_flex_attention_through_its_function_body_without_the_rule(monkeypatch, t):
    """The function-body fallback works outside ai.onnx: with the FlexAttention rule hidden,
    the node (domain ai.onnx.preview) is differentiated through its ONNX function body."""
    from gradbuilder.compiler import registry

    lookup = registry.lookup
    monkeypatch.setattr(registry, "lookup",
                        lambda d, op, v: None if op == "FlexAttention" else lookup(d, op, v))
    check_flex(flex_inputs(t), {"scale": 0.8})
