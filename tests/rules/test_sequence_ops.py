"""CausalConvWithState (opset 27).

onnxruntime 1.31 loads no opset-27 model, so everything runs on onnx's reference evaluator.
Its CausalConvWithState (and the operator's function body) round the silu activation
through float32 even for float64 inputs, which makes float64 finite differences noise;
the checks here use gradbuilder.testing's copy of it that keeps the input's precision.
"""

import numpy as np
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import numeric_gradient, reference_fix, to_float64

OPSET = 27
B, C, L, K = 2, 3, 5, 3


def evaluator(model):
    """The stock reference evaluator with the float64-preserving CausalConvWithState only."""
    return ReferenceEvaluator(model, new_ops=[reference_fix("CausalConvWithState")])


def conv_model(inputs, attrs, *, used=(0, 1), dims="static", wrt=None, seed=3):
    """One CausalConvWithState node; loss = random projections of the outputs in ``used``.
    The float inputs (or ``wrt``) are graph inputs with ``dims`` static or unknown."""
    rng = np.random.default_rng(seed)
    names, vis, feeds = [], [], {}
    for name, arr in inputs:
        names.append(name or "")
        if name:
            shape = list(arr.shape) if dims == "static" else [None] * arr.ndim
            vis.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), shape))
            feeds[name] = arr
    weights = [n for n, a in inputs if n and (wrt is None or n in wrt)]
    node = helper.make_node("CausalConvWithState", names, ["y", "state"], **attrs)
    probe = helper.make_model(helper.make_graph([node], "probe", vis, [helper.make_empty_tensor_value_info("y"),
                                                                        helper.make_empty_tensor_value_info("state")]),
                              opset_imports=[helper.make_opsetid("", OPSET)])
    values = evaluator(probe).run(None, feeds)
    nodes, inits, terms = [node], [], []
    for i in used:
        out = ("y", "state")[i]
        inits.append(numpy_helper.from_array(rng.standard_normal(values[i].shape).astype(values[i].dtype), f"{out}_p"))
        nodes += [helper.make_node("Mul", [out, f"{out}_p"], [f"{out}_m"]),
                  helper.make_node("ReduceSum", [f"{out}_m"], [f"{out}_s"], keepdims=0)]
        terms.append(f"{out}_s")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    dtype = helper.np_dtype_to_tensor_dtype(inputs[0][1].dtype)
    model = helper.make_model(helper.make_graph(nodes, "ccws", vis, [helper.make_tensor_value_info("loss", dtype, [])],
                                                inits), opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 10
    return model, weights, feeds


def gradients(model, weights, feeds, *, float64=False):
    """The built gradients; ``float64``: the graph (built in the model's precision, as the
    op has no float64 type) evaluated in float64."""
    built = GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build().model_proto
    if float64:
        built, feeds = to_float64(built), {k: v.astype(np.float64) for k, v in feeds.items()}
    got = evaluator(built).run([f"{w}_grad" for w in weights], feeds)
    return dict(zip(weights, got))


def check(inputs, attrs, **kw):
    """Every element of every weight's gradient against float64 central differences."""
    model, weights, feeds = conv_model(inputs, attrs, **kw)
    feeds64 = {k: v.astype(np.float64) for k, v in feeds.items()}
    got = gradients(model, weights, feeds, float64=True)
    fwd = evaluator(to_float64(model))
    for w in weights:
        num = numeric_gradient(lambda v: float(fwd.run(None, {**feeds64, w: v})[0]), feeds64[w], 1e-6)
        np.testing.assert_allclose(got[w], num, rtol=1e-6, atol=1e-8, err_msg=w)
    return got


@pytest.fixture
def t(rng):
    return lambda *shape: rng.standard_normal(shape).astype(np.float32)


def conv_inputs(t, *, bias=True, past=True, k=K, length=L):
    return [("x", t(B, C, length)), ("w", t(C, 1, k)), ("b", t(C) if bias else None) if bias or past else None,
            ("p", t(B, C, k - 1)) if past else None]


def cleaned(inputs):
    out = [(n, a) if a is not None else ("", None) for n, a in (i for i in inputs if i is not None)]
    while out and not out[-1][0]:
        out.pop()
    return out


CASES = [  # (name, conv_inputs kwargs, attrs)
    ("plain", dict(bias=False, past=False), {}),
    ("bias", dict(past=False), {}),
    ("past", dict(bias=False), {}),
    ("bias-past", {}, {"activation": "none"}),
    ("silu", dict(bias=False, past=False), {"activation": "silu"}),
    ("swish-bias-past", {}, {"activation": "swish"}),
    ("silu-past-no-bias", dict(bias=False), {"activation": "silu"}),
    ("kernel-1-silu", dict(k=1), {"activation": "silu"}),
    ("short-input-silu", dict(length=1, k=4), {"activation": "silu"}),  # present_state reaches into the past
]


@pytest.mark.parametrize("dims", ["static", "dynamic"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_causal_conv_with_state(case, dims, t):
    """static: the taps as shifted slices; dynamic (kernel size unknown): the gathered taps."""
    _, kw, attrs = case
    check(cleaned(conv_inputs(t, **kw)), attrs, dims=dims)


@pytest.mark.parametrize("used", [(0,), (1,)], ids=["output-only", "present-state-only"])
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_causal_conv_with_state_one_output(used, activation, t):
    check(cleaned(conv_inputs(t)), {"activation": activation}, used=used)
    check(cleaned(conv_inputs(t, past=False, length=2, k=4)), {"activation": activation}, used=used, dims="dynamic")


@pytest.mark.parametrize("wrt", [["x"], ["w"], ["b"], ["p"], ["w", "p"]])
def test_causal_conv_with_state_some_inputs(wrt, t):
    check(cleaned(conv_inputs(t)), {"activation": "silu"}, wrt=wrt)


def test_causal_conv_with_state_matches_the_function_body(t):
    """The direct rule and the function-body fallback give the same gradients."""
    from gradbuilder.compiler import registry

    model, weights, feeds = conv_model(cleaned(conv_inputs(t)), {"activation": "silu"})
    direct = gradients(model, weights, feeds, float64=True)
    key = ("", "CausalConvWithState")
    saved = registry._RULES.pop(key)
    try:
        body = gradients(model, weights, feeds, float64=True)
    finally:
        registry._RULES[key] = saved
    for w in weights:
        np.testing.assert_allclose(direct[w], body[w], rtol=1e-5, atol=1e-6, err_msg=w)  # the body rounds via float32


@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_causal_conv_with_state_float16(dims, t):
    """float16 inputs: the silu derivative in float32, the result close to float64's."""
    inputs = cleaned(conv_inputs(t))
    ref = check(inputs, {"activation": "silu"}, dims=dims)
    model, weights, feeds = conv_model([(n, a.astype(np.float16) if a is not None else a) for n, a in inputs],
                                       {"activation": "silu"}, dims=dims)
    got = gradients(model, weights, feeds)
    for w in weights:
        assert got[w].dtype == np.float16
        np.testing.assert_allclose(got[w].astype(np.float64), ref[w], rtol=2e-2, atol=2e-2 * np.abs(ref[w]).max())
