"""RNN, GRU and LSTM gradients (rules/recurrent.py).

onnx's reference evaluator ignores sequence_lens, clip, input_forget and (for GRU and LSTM)
the activations attribute, and its RNN knows only Tanh and Affine. The float64 finite
differences therefore run on the full-spec numpy implementation below (``SpecRNN`` etc.,
installed into the reference evaluator by an autouse fixture), which is itself checked
against onnxruntime's forward (layout 0, every attribute) and against onnx's stock reference
(layout 1, which onnxruntime does not run). check_op also runs every float32 gradient graph
with layout 0 on onnxruntime.
"""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import (check_model, check_op, gradcheck, make_op_model, numeric_gradient, ort_session,
                                 patch_reference_evaluator, reference_evaluator, to_float64)

f32 = np.float32
FLOAT = onnx.TensorProto.FLOAT
T, N, I, H = 3, 2, 3, 4  # seq, batch, input, hidden
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}

# ----------------------------------------------------------------------------- the spec in numpy

PARAMS = {  # activations that take alpha/beta: (takes alpha, takes beta, default alpha, default beta)
    "affine": (True, True, 0.0, 0.0), "leakyrelu": (True, False, 0.01, 0.0),
    "thresholdedrelu": (True, False, 0.0, 0.0), "scaledtanh": (True, True, 0.0, 0.0),
    "hardsigmoid": (True, True, 0.2, 0.5), "elu": (True, False, 1.0, 0.0),
}
DEFAULT_ACTS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}


def np_activation(name, a, b):
    return {
        "tanh": np.tanh,
        "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
        "relu": lambda x: np.maximum(x, 0),
        "affine": lambda x: a * x + b,
        "leakyrelu": lambda x: np.where(x >= 0, x, a * x),
        "thresholdedrelu": lambda x: np.where(x > a, x, 0),
        "scaledtanh": lambda x: a * np.tanh(b * x),
        "hardsigmoid": lambda x: np.clip(a * x + b, 0, 1),
        "elu": lambda x: np.where(x >= 0, x, a * (np.exp(x) - 1)),
        "softsign": lambda x: x / (1 + np.abs(x)),
        "softplus": lambda x: np.log1p(np.exp(x)),
    }[name.lower()]


def np_activations(op, num_dirs, names, alphas, betas):
    per = len(DEFAULT_ACTS[op])
    names = list(names) if names else DEFAULT_ACTS[op] * num_dirs
    alphas, betas = list(alphas if alphas is not None else []), list(betas if betas is not None else [])
    fns = []
    for name in names[:per * num_dirs]:
        takes_a, takes_b, a, b = PARAMS.get(name.lower(), (False, False, 0.0, 0.0))
        a = alphas.pop(0) if takes_a and alphas else a
        b = betas.pop(0) if takes_b and betas else b
        fns.append(np_activation(name, a, b))
    return [fns[d * per:(d + 1) * per] for d in range(num_dirs)]


def spec_forward(op, X, W, R, B=None, seq=None, h0=None, c0=None, P=None, *, direction="forward",
                 activations=None, activation_alpha=None, activation_beta=None, clip=None, layout=0,
                 linear_before_reset=0, input_forget=0):
    """The ONNX RNN/GRU/LSTM equations, step by step. Steps past a sequence's length keep the
    state and write zeros to Y; an empty sequence gives Y_h = Y_c = 0 (as onnxruntime)."""
    if layout:
        X = X.swapaxes(0, 1)
        h0 = None if h0 is None else h0.swapaxes(0, 1)
        c0 = None if c0 is None else c0.swapaxes(0, 1)
    G, dt = GATES[op], X.dtype
    steps, batch, _ = X.shape
    D, hid = W.shape[0], R.shape[-1]
    B = np.zeros((D, 2 * G * hid), dt) if B is None else B
    h0 = np.zeros((D, batch, hid), dt) if h0 is None else h0
    c0 = np.zeros((D, batch, hid), dt) if c0 is None else c0
    P = np.zeros((D, 3 * hid), dt) if P is None else P
    seq = np.full(batch, steps) if seq is None else np.asarray(seq)
    acts = np_activations(op, D, activations, activation_alpha, activation_beta)
    cl = (lambda v: np.clip(v, -clip, clip)) if clip is not None else (lambda v: v)
    Y = np.zeros((steps, D, batch, hid), dt)
    Yh, Yc = np.zeros((D, batch, hid), dt), np.zeros((D, batch, hid), dt)
    for d in range(D):
        Wd, Rd, Wb, Rb, f = W[d], R[d], B[d, :G * hid], B[d, G * hid:], acts[d]
        Hs, Cs = h0[d], c0[d]
        rev = direction == "reverse" or d == 1
        for t in (range(steps - 1, -1, -1) if rev else range(steps)):
            x = X[t]
            Cn = Cs
            if op == "RNN":
                Hn = f[0](cl(x @ Wd.T + Hs @ Rd.T + Wb + Rb))
            elif op == "GRU":
                xw, hr = x @ Wd.T + Wb, Hs @ Rd.T
                z = f[0](cl(xw[:, :hid] + hr[:, :hid] + Rb[:hid]))
                r = f[0](cl(xw[:, hid:2 * hid] + hr[:, hid:2 * hid] + Rb[hid:2 * hid]))
                if linear_before_reset:
                    hh = f[1](cl(xw[:, 2 * hid:] + r * (hr[:, 2 * hid:] + Rb[2 * hid:])))
                else:
                    hh = f[1](cl(xw[:, 2 * hid:] + (r * Hs) @ Rd[2 * hid:].T + Rb[2 * hid:]))
                Hn = (1 - z) * hh + z * Hs
            else:
                a = x @ Wd.T + Hs @ Rd.T + Wb + Rb
                pi, po, pf = P[d, :hid], P[d, hid:2 * hid], P[d, 2 * hid:]
                i = f[0](cl(a[:, :hid] + pi * Cs))
                fg = 1 - i if input_forget else f[0](cl(a[:, 2 * hid:3 * hid] + pf * Cs))
                Cn = fg * Cs + i * f[1](cl(a[:, 3 * hid:]))
                Hn = f[0](cl(a[:, hid:2 * hid] + po * Cn)) * f[2](Cn)
            m = (t < seq)[:, None]
            Y[t, d] = np.where(m, Hn, 0)
            Hs, Cs = np.where(m, Hn, Hs), np.where(m, Cn, Cs)
        empty = (seq == 0)[:, None]
        Yh[d], Yc[d] = np.where(empty, 0, Hs), np.where(empty, 0, Cs)
    if layout:
        Y, Yh, Yc = Y.transpose(2, 0, 1, 3), Yh.swapaxes(0, 1), Yc.swapaxes(0, 1)
    return Y, Yh, Yc


def _spec_op(op_name):
    from onnx.reference.op_run import OpRun

    class Spec(OpRun):
        op_domain = ""

        def _run(self, X, W, R, B=None, sequence_lens=None, initial_h=None, initial_c=None, P=None, **_):
            kw = {k: getattr(self, k, None) for k in ("activations", "activation_alpha", "activation_beta", "clip")}
            kw.update({k: getattr(self, k, None) or 0 for k in ("layout", "linear_before_reset", "input_forget")})
            out = spec_forward(op_name, X, W, R, B, sequence_lens, initial_h, initial_c, P,
                               direction=getattr(self, "direction", None) or "forward", **kw)
            return tuple(v.astype(X.dtype) for v in out[:len(self.onnx_node.output)])

    Spec.__name__ = op_name  # new_ops are matched by class name
    return Spec


def name_absent_outputs(proto):
    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    for k, node in enumerate(proto.graph.node):
        for j, name in enumerate(node.output):
            if not name:
                node.output[j] = f"absent__{k}_{j}"
    return proto


@pytest.fixture(autouse=True)
def spec_reference(monkeypatch):
    """The reference evaluator with the full-spec RNN/GRU/LSTM. Absent outputs ("") get a
    name first: the evaluator stores results by name, so a value stored under "" would be read
    back by every later absent input (here: the sequence_lens of a second node)."""
    return patch_reference_evaluator(monkeypatch, *[_spec_op(op) for op in GATES], prepare=name_absent_outputs)


# ----------------------------------------------------------------------------- cases


def make_inputs(op, rng, *, direction="forward", layout=0, bias=True, seq=None, h0=False, c0=False, P=False,
                dtype=f32):
    """The op's inputs [(name, array)] at the tiny sizes, weights and biases scaled by 0.5."""
    G, D = GATES[op], 2 if direction == "bidirectional" else 1
    X = rng.standard_normal((N, T, I) if layout else (T, N, I))
    ins = [("X", X), ("W", rng.standard_normal((D, G * H, I)) * 0.5),
           ("R", rng.standard_normal((D, G * H, H)) * 0.5),
           ("B", rng.standard_normal((D, 2 * G * H)) * 0.5 if bias else None),
           ("sequence_lens", np.array(seq, np.int32) if seq is not None else None),
           ("initial_h", rng.standard_normal((N, D, H) if layout else (D, N, H)) if h0 else None)]
    if op == "LSTM":
        ins += [("initial_c", rng.standard_normal((N, D, H) if layout else (D, N, H)) if c0 else None),
                ("P", rng.standard_normal((D, 3 * H)) * 0.5 if P else None)]
    while ins[-1][1] is None:
        ins.pop()
    return [(name, None if v is None else v.astype(dtype) if v.dtype.kind == "f" else v) for name, v in ins]


def split_case(case):
    """(input options, attributes) of a case dict."""
    keys = ("bias", "seq", "h0", "c0", "P")
    return {k: v for k, v in case.items() if k in keys}, {k: v for k, v in case.items() if k not in keys}


def check(op, case, opset, rng, **kw):
    opts, attrs = split_case(case)
    attrs = {"hidden_size": H, **attrs}
    ins = make_inputs(op, rng, direction=attrs.get("direction", "forward"), layout=attrs.get("layout", 0), **opts)
    return check_op(op, ins, attrs, opset=opset, num_outputs=3 if op == "LSTM" else 2,
                    ort=not attrs.get("layout", 0), **kw)


# ----------------------------------------------------------------------------- the reference itself

SPEC_CASES = [
    ("RNN", {"direction": "bidirectional", "seq": [3, 1], "h0": True, "clip": 0.7}),
    ("RNN", {"direction": "reverse", "seq": [0, 2], "h0": True}),
    ("RNN", {"direction": "bidirectional", "activations": ["Affine", "ScaledTanh"], "activation_alpha": [0.7, 1.3],
             "activation_beta": [0.2, 0.6]}),
    ("RNN", {"activations": ["ThresholdedRelu"], "activation_alpha": [0.2], "h0": True}),
    ("RNN", {"activations": ["HardSigmoid"], "h0": True}),
    ("GRU", {"direction": "bidirectional", "seq": [2, 3], "h0": True, "linear_before_reset": 1, "clip": 0.6}),
    ("GRU", {"direction": "reverse", "seq": [1, 0], "h0": True, "clip": 0.6}),
    ("GRU", {"activations": ["HardSigmoid", "LeakyRelu"], "activation_alpha": [0.3, 0.1], "activation_beta": [0.4]}),
    ("LSTM", {"direction": "bidirectional", "seq": [3, 1], "h0": True, "c0": True, "P": True, "clip": 0.5}),
    ("LSTM", {"direction": "reverse", "seq": [2, 0], "h0": True, "c0": True, "P": True, "input_forget": 1}),
    ("LSTM", {"direction": "bidirectional", "activations": ["Sigmoid", "Elu", "Softsign", "HardSigmoid", "Softplus",
                                                           "Relu"], "activation_alpha": [0.5, 0.25], "P": True}),
]


@pytest.mark.parametrize("op,case", SPEC_CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(SPEC_CASES)])
def test_spec_reference_matches_onnxruntime(op, case, rng):
    """The numpy reference computes what onnxruntime computes, for every attribute."""
    opts, attrs = split_case(case)
    attrs = {"hidden_size": H, **attrs}
    ins = make_inputs(op, rng, direction=attrs.get("direction", "forward"), **opts)
    outs = ["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2]
    node = helper.make_node(op, [n if v is not None else "" for n, v in ins], outs, **attrs)
    graph = helper.make_graph([node], "g", [], [helper.make_empty_tensor_value_info(o) for o in outs],
                              [numpy_helper.from_array(v, n) for n, v in ins if v is not None])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    got = ort_session(model).run(None, {})
    vals = {n: v for n, v in ins}
    want = spec_forward(op, *(vals.get(k) for k in ("X", "W", "R", "B", "sequence_lens", "initial_h",
                                                    "initial_c", "P")),
                        **{k: v for k, v in attrs.items() if k != "hidden_size"})
    for name, g, w in zip(outs, got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"{op} {case} {name}")


@pytest.mark.parametrize("op", list(GATES))
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_spec_reference_matches_onnx_reference_layout1(op, direction, rng, spec_reference):
    """Layout 1 (which onnxruntime does not run) against onnx's stock reference, which gets
    layout and the default activations right."""
    from onnx.reference import ReferenceEvaluator  # the patched one

    attrs = {"hidden_size": H, "direction": direction, "layout": 1}
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    ins = make_inputs(op, rng, direction=direction, layout=1, h0=True, c0=True, P=True)
    outs = ["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2]
    node = helper.make_node(op, [n if v is not None else "" for n, v in ins], outs, **attrs)
    graph = helper.make_graph([node], "g", [], [helper.make_empty_tensor_value_info(o) for o in outs],
                              [numpy_helper.from_array(v.astype(np.float64), n) for n, v in ins if v is not None])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    for a, b in zip(spec_reference(model).run(None, {}), ReferenceEvaluator(model).run(None, {})):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- gradients, every output

BI, REV = {"direction": "bidirectional"}, {"direction": "reverse"}
CASES = {
    "RNN": [
        {},
        {**REV, "h0": True, "bias": False},
        {**BI, "seq": [3, 1], "h0": True},
        {"seq": [2, 3], "h0": True, "clip": 0.8},
        {**REV, "seq": [1, 3], "h0": True, "clip": 0.8, "activations": ["Relu"]},
        {**BI, "layout": 1, "h0": True},
    ],
    "GRU": [
        {},
        {"linear_before_reset": 1, "h0": True},
        {**REV, "seq": [2, 3], "h0": True},
        {**BI, "seq": [3, 1], "h0": True, "clip": 0.7},
        {**BI, "seq": [1, 2], "h0": True, "clip": 0.7, "linear_before_reset": 1},
        {**REV, "layout": 1, "h0": True, "bias": False},
        {**BI, "layout": 1, "h0": True, "linear_before_reset": 1},
        {**BI, "seq": [0, 2], "h0": True, "linear_before_reset": 1},  # an empty sequence: Y_h = 0
    ],
    "LSTM": [
        {},
        {"P": True, "h0": True, "c0": True},
        {**REV, "seq": [2, 3], "h0": True, "c0": True, "input_forget": 1},
        {**BI, "seq": [3, 1], "h0": True, "c0": True, "P": True, "clip": 0.6},
        {**REV, "seq": [1, 2], "c0": True, "P": True, "input_forget": 1, "clip": 0.6},
        {**BI, "bias": False, "h0": True},
        {**BI, "layout": 1, "h0": True, "c0": True, "P": True},
        {**REV, "seq": [3, 0], "h0": True, "c0": True, "P": True},  # an empty sequence: Y_h = Y_c = 0
    ],
}
GRAD_CASES = [(op, i, case) for op, cases in CASES.items() for i, case in enumerate(cases)]


@pytest.mark.parametrize("opset", [14, 18])
@pytest.mark.parametrize("op,i,case", GRAD_CASES, ids=[f"{op}-{i}" for op, i, _ in GRAD_CASES])
def test_gradients(op, i, case, opset, rng):
    check(op, case, opset, rng)


ACTIVATION_CASES = [  # bidirectional, so each direction has its own activations
    ("RNN", {"activations": ["Relu", "Sigmoid"]}),
    ("RNN", {"activations": ["Affine", "LeakyRelu"], "activation_alpha": [0.7, 0.2], "activation_beta": [0.3]}),
    ("RNN", {"activations": ["ThresholdedRelu", "ScaledTanh"], "activation_alpha": [0.2, 1.5],
             "activation_beta": [0.6]}),
    ("RNN", {"activations": ["HardSigmoid", "Elu"], "activation_alpha": [0.3, 0.7], "activation_beta": [0.45]}),
    ("RNN", {"activations": ["Softsign", "Softplus"]}),
    ("RNN", {"activations": ["LeakyRelu", "HardSigmoid"]}),  # default alpha/beta
    ("GRU", {"activations": ["HardSigmoid", "Softsign", "Sigmoid", "Elu"], "activation_alpha": [0.3, 0.5],
             "activation_beta": [0.45], "linear_before_reset": 1}),
    ("GRU", {"activations": ["Softplus", "LeakyRelu", "Tanh", "Relu"], "activation_alpha": [0.1], "clip": 0.9,
             "seq": [3, 2]}),
    ("LSTM", {"activations": ["HardSigmoid", "LeakyRelu", "Softsign", "Sigmoid", "Elu", "ScaledTanh"],
              "activation_alpha": [0.3, 0.1, 1.5, 0.8], "activation_beta": [0.45, 0.9], "P": True}),
    ("LSTM", {"activations": ["Sigmoid", "Relu", "Tanh", "Sigmoid", "Tanh", "Relu"], "input_forget": 1,
              "c0": True}),
]


@pytest.mark.parametrize("op,case", ACTIVATION_CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(ACTIVATION_CASES)])
def test_activations(op, case, rng):
    check(op, {**BI, "h0": True, **case}, 18, rng)


# ----------------------------------------------------------------------------- some outputs only

OUTPUT_NAMES = ["Y", "Y_h", "Y_c"]


def partial_model(op, case, rng, present, used, opset=18):
    """One node with only the outputs in ``present`` (the others absent, as ""), and a loss that
    is a random projection of the outputs in ``used``. Returns (model, weights)."""
    opts, attrs = split_case(case)
    attrs = {"hidden_size": H, **attrs}
    ins = make_inputs(op, rng, direction=attrs.get("direction", "forward"), layout=attrs.get("layout", 0), **opts)
    vals = dict(ins)
    values = spec_forward(op, *(vals.get(k) for k in ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c",
                                                      "P")), **{k: v for k, v in attrs.items() if k != "hidden_size"})
    outs = [o if o in present else "" for o in OUTPUT_NAMES[:3 if op == "LSTM" else 2]]
    while outs and not outs[-1]:
        outs.pop()
    nodes = [helper.make_node(op, [n if v is not None else "" for n, v in ins], outs, name="rnn", **attrs)]
    inits = [numpy_helper.from_array(v, n) for n, v in ins if v is not None]
    terms = []
    for name, value in zip(OUTPUT_NAMES, values):
        if name in used:
            inits.append(numpy_helper.from_array(rng.standard_normal(value.shape).astype(f32), f"{name}_proj"))
            nodes += [helper.make_node("Mul", [name, f"{name}_proj"], [f"{name}_m"]),
                      helper.make_node("ReduceSum", [f"{name}_m"], [f"{name}_s"], keepdims=0)]
            terms.append(f"{name}_s")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model, [n for n, v in ins if v is not None and v.dtype.kind == "f"]


PARTIAL = [
    ("RNN", {**BI, "seq": [3, 1], "h0": True}, ["Y", "Y_h"], ["Y_h"]),
    ("RNN", {**REV, "seq": [2, 3], "h0": True, "clip": 0.8}, ["Y_h"], ["Y_h"]),
    ("GRU", {**BI, "seq": [1, 3], "h0": True, "linear_before_reset": 1}, ["Y_h"], ["Y_h"]),
    ("GRU", {**REV, "seq": [2, 3], "h0": True}, ["Y", "Y_h"], ["Y"]),
    ("GRU", {**BI, "layout": 1, "h0": True}, ["Y_h"], ["Y_h"]),
    ("LSTM", {**BI, "seq": [3, 2], "h0": True, "c0": True, "P": True}, ["Y_c"], ["Y_c"]),
    ("LSTM", {**REV, "seq": [1, 3], "h0": True, "c0": True, "input_forget": 1}, ["Y_h", "Y_c"], ["Y_h", "Y_c"]),
    ("LSTM", {"h0": True, "c0": True, "P": True}, ["Y", "Y_h", "Y_c"], ["Y_h"]),
    ("LSTM", {**REV, "h0": True, "c0": True, "P": True}, ["Y", "Y_h", "Y_c"], ["Y_c"]),
    ("LSTM", {**BI, "seq": [2, 3], "P": True}, ["Y"], ["Y"]),
    ("LSTM", {**BI, "layout": 1, "h0": True, "c0": True, "P": True}, ["Y_h", "Y_c"], ["Y_c"]),
]


@pytest.mark.parametrize("op,case,present,used", PARTIAL,
                         ids=[f"{op}-{'+'.join(p)}-to-{'+'.join(u)}" for op, _, p, u in PARTIAL])
def test_some_outputs(op, case, present, used, rng):
    """Any subset of the outputs carries the gradient; without a Y output the hidden states come
    from a second node of the same op (with layout 0)."""
    model, weights = partial_model(op, case, rng, present, used)
    check_model(model, weights, ort=not case.get("layout", 0))
    built = GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build().model_proto
    recurrent = [n for n in built.graph.node if n.op_type == op]
    assert len(recurrent) == (1 if "Y" in present else 2)
    assert all(a.i == 0 for n in recurrent[1:] for a in n.attribute if a.name == "layout")


# ----------------------------------------------------------------------------- shapes

DYNAMIC = [("RNN", {**BI, "seq": [3, 2], "h0": True}), ("GRU", {**REV, "h0": True, "linear_before_reset": 0}),
           ("LSTM", {**BI, "seq": [2, 3], "h0": True, "c0": True, "P": True})]


@pytest.mark.parametrize("opset", [14, 18])
@pytest.mark.parametrize("op,case", DYNAMIC, ids=[op for op, _ in DYNAMIC])
def test_dynamic_weight_shapes(op, case, opset, rng):
    """Weights and states as graph inputs of unknown shape (hidden size unknown); X static."""
    opts, attrs = split_case(case)
    ins = make_inputs(op, rng, direction=attrs["direction"], **opts)
    wrt = [n for n, v in ins if v is not None and n != "X" and v.dtype.kind == "f"]
    check_op(op, ins, {"hidden_size": H, **attrs}, opset=opset, num_outputs=3 if op == "LSTM" else 2, wrt=wrt,
             weights_as="inputs", dims="dynamic")


def symbolic_model(op, rng, x_dims, layout=0):
    attrs = {"hidden_size": H, "direction": "bidirectional", "layout": layout}
    ins = make_inputs(op, rng, direction="bidirectional", layout=layout, seq=[3, 2], h0=True)
    model, weights, feeds = make_op_model(op, ins, attrs, opset=18, num_outputs=2, weights_as="inputs")
    x = next(i for i in model.graph.input if i.name == "X")
    for dim, v in zip(x.type.tensor_type.shape.dim, x_dims):
        if isinstance(v, str):
            dim.dim_param = v
        elif v is None:
            dim.ClearField("dim_value")
    return model, weights, feeds


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_symbolic_batch(op, rng):
    model, weights, feeds = symbolic_model(op, rng, [T, "batch", I])
    report = gradcheck(model, weights, "loss", feeds)
    assert report.passed, str(report)
    m32 = GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build().get_model()
    got = ort_session(m32).run(["X_grad"], {k: v for k, v in feeds.items()})[0]
    np.testing.assert_allclose(got, report.gradients["X"], rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("op", list(GATES))
def test_graph_does_not_grow_with_the_length(op, rng):
    """The steps run in Scans: the gradient graph is the same at every length. Each backward
    step does one product with R (two for GRU before reset; the LSTM's cell states are
    recomputed by a Scan of their own, without one); gate recomputation and the X, W, R
    gradients are a fixed number of MatMuls over the stacked steps."""
    per_scan, fixed = {"RNN": ([1], 5), "GRU": ([2], 7), "LSTM": ([0, 1], 5)}[op]
    graphs = []
    for steps in (3, 6):
        ins = make_inputs(op, rng, direction="bidirectional", seq=[2, 1], h0=True)
        ins[0] = ("X", rng.standard_normal((steps, N, I)).astype(f32))
        model, weights, _ = make_op_model(op, ins, {"hidden_size": H, "direction": "bidirectional"},
                                          num_outputs=2)
        graphs.append(gradient_graph(model, weights).model_proto)
    assert [n.op_type for n in graphs[0].graph.node] == [n.op_type for n in graphs[1].graph.node]
    nodes = graphs[0].graph.node
    assert sum(n.op_type == "MatMul" for n in nodes) == fixed
    bodies = [a.g for n in nodes if n.op_type == "Scan" for a in n.attribute if a.name == "body"]
    assert [sum(m.op_type == "MatMul" for m in body.node) for body in bodies] == per_scan


# ----------------------------------------------------------------------------- lengths known at run time


def length_model(op, case, source, rng):
    """One node whose sequence length is known only at run time, with a loss that reads every
    output at any length. ``source``: "symbolic" (X a graph input with a named length), "if" (X
    comes out of an If whose else branch doubles the length), "reshape" (X is a flat input
    reshaped to a shape given at run time, so not even its rank is known). The weights and
    states are graph inputs; sequence_lens too, when the case has one ("seq": True).
    Returns (model, weights, feeds) with ``feeds(length, cond=True)``."""
    opts, attrs = split_case(case)
    has_seq = opts.pop("seq", False)
    layout, direction = attrs.get("layout", 0), attrs.get("direction", "forward")
    attrs = {"hidden_size": H, **attrs}
    D, seq_axis = (2 if direction == "bidirectional" else 1), (1 if layout else 0)
    values = {name: v for name, v in make_inputs(op, rng, direction=direction, layout=layout, **opts)[1:]
              if v is not None}
    names = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"][:8 if op == "LSTM" else 6]
    x_dims = [N, "seq", I] if layout else ["seq", N, I]
    inputs = [helper.make_tensor_value_info(n, FLOAT, list(v.shape)) for n, v in values.items()]
    if has_seq:
        inputs.append(helper.make_tensor_value_info("sequence_lens", onnx.TensorProto.INT32, [N]))
    nodes = []
    if source == "reshape":
        inputs += [helper.make_tensor_value_info("X", FLOAT, [None]),
                   helper.make_tensor_value_info("X_shape", onnx.TensorProto.INT64, [None])]
        nodes.append(helper.make_node("Reshape", ["X", "X_shape"], ["X_in"]))
    elif source == "if":
        inputs += [helper.make_tensor_value_info("X", FLOAT, x_dims),
                   helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])]
        then_g = helper.make_graph([helper.make_node("Identity", ["X"], ["X_then"])], "then", [],
                                   [helper.make_tensor_value_info("X_then", FLOAT, None)])
        else_g = helper.make_graph([helper.make_node("Concat", ["X", "X"], ["X_else"], axis=seq_axis)], "else", [],
                                   [helper.make_tensor_value_info("X_else", FLOAT, None)])
        nodes.append(helper.make_node("If", ["cond"], ["X_in"], then_branch=then_g, else_branch=else_g))
    else:
        inputs.append(helper.make_tensor_value_info("X", FLOAT, x_dims))
        nodes.append(helper.make_node("Identity", ["X"], ["X_in"]))
    node_ins = ["X_in"] + [n if n in values or (n == "sequence_lens" and has_seq) else "" for n in names[1:]]
    while not node_ins[-1]:
        node_ins.pop()
    outs = OUTPUT_NAMES[:3 if op == "LSTM" else 2]
    nodes.append(helper.make_node(op, node_ins, outs, **attrs))
    y_proj = [N, 1, D, H] if layout else [1, D, N, H]  # broadcast over the steps
    state_proj = [N, D, H] if layout else [D, N, H]
    inits = [numpy_helper.from_array(rng.standard_normal(y_proj).astype(f32), "Y_proj")]
    nodes += [helper.make_node("Mul", ["Y", "Y"], ["Y_sq"]), helper.make_node("Add", ["Y", "Y_sq"], ["Y_nl"]),
              helper.make_node("Mul", ["Y_nl", "Y_proj"], ["Y_m"])]
    terms = ["Y_m"]
    for name in outs[1:]:
        inits.append(numpy_helper.from_array(rng.standard_normal(state_proj).astype(f32), f"{name}_proj"))
        nodes.append(helper.make_node("Mul", [name, f"{name}_proj"], [f"{name}_m"]))
        terms.append(f"{name}_m")
    nodes += [helper.make_node("ReduceSum", [t], [f"{t}_s"], keepdims=0) for t in terms]
    nodes.append(helper.make_node("Sum", [f"{t}_s" for t in terms], ["loss"]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", FLOAT, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    weights = ["X", *values]

    def feeds(length, cond=True):
        x = rng.standard_normal([N, length, I] if layout else [length, N, I]).astype(f32)
        steps = length if cond else 2 * length
        fed = {**values, "X": x.reshape(-1) if source == "reshape" else x}
        if source == "reshape":
            fed["X_shape"] = np.array(x.shape, np.int64)
        if source == "if":
            fed["cond"] = np.array(cond)
        if has_seq:
            fed["sequence_lens"] = np.array([steps, max(steps - 3, 0)], np.int32)
        return fed

    return model, weights, feeds


def sequence_dim(model, op):
    """The sequence dim shape inference finds for the recurrent node's X: an int, a name, or
    None (unknown dim or rank)."""
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    node = next(n for n in inferred.graph.node if n.op_type == op)
    layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
    info = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.input)}.get(node.input[0])
    if info is None or not info.type.tensor_type.HasField("shape"):
        return None
    dim = info.type.tensor_type.shape.dim[1 if layout else 0]
    return dim.dim_value if dim.HasField("dim_value") else dim.dim_param or None


def gradient_graph(model, weights):
    return GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build()


def check_lengths(model, weights, runs, *, ort=True):
    """One float64 and one float32 gradient graph, each run at every feed in ``runs``: the
    float64 gradients match central finite differences of the float64 forward model (onnx's
    reference evaluator, every element), the float32 graph on onnxruntime matches them."""
    model64 = to_float64(model)
    built64 = gradient_graph(model64, weights).model_proto
    grads64, forward64 = reference_evaluator(built64), reference_evaluator(model64)
    sess32 = ort_session(gradient_graph(model, weights).get_model()) if ort else None
    for feeds in runs:
        feeds64 = {k: v.astype(np.float64) if v.dtype == f32 else v for k, v in feeds.items()}
        got = dict(zip([o.name for o in built64.graph.output], grads64.run(None, feeds64)))
        for w in weights:
            num = numeric_gradient(lambda v: forward64.run(["loss"], {**feeds64, w: v})[0], feeds64[w], 1e-6)
            np.testing.assert_allclose(got[f"{w}_grad"], num, rtol=1e-4, atol=1e-6, err_msg=w)
        if sess32 is not None:
            out = dict(zip([o.name for o in sess32.get_outputs()],
                           sess32.run(None, {i.name: feeds[i.name] for i in sess32.get_inputs()})))
            for w in weights:
                ref = got[f"{w}_grad"]
                np.testing.assert_allclose(out[f"{w}_grad"], ref, rtol=2e-3, atol=2e-4 * max(1.0, np.abs(ref).max()),
                                           err_msg=w)


SEQ = {"seq": True}
LENGTH_CASES = [  # each op forward and bidirectional, its length symbolic and hidden from shape inference
    ("RNN", {"h0": True}, "symbolic"),
    ("RNN", {**BI, **SEQ, "h0": True, "clip": 0.8}, "if"),
    ("RNN", {**REV, "h0": True, "activations": ["Relu"]}, "reshape"),
    ("GRU", {"h0": True, "linear_before_reset": 1}, "reshape"),
    ("GRU", {**BI, **SEQ, "h0": True}, "symbolic"),
    ("GRU", {**BI, "layout": 1, "h0": True}, "if"),
    ("LSTM", {"h0": True, "c0": True, "P": True}, "if"),
    ("LSTM", {**BI, **SEQ, "h0": True, "c0": True, "clip": 0.6}, "symbolic"),
    ("LSTM", {**BI, "h0": True, "c0": True, "P": True, "input_forget": 1}, "reshape"),
    ("LSTM", {**REV, **SEQ, "layout": 1, "h0": True, "c0": True, "P": True}, "symbolic"),
]


@pytest.mark.parametrize("op,case,source", LENGTH_CASES,
                         ids=[f"{op}-{i}-{source}" for i, (op, _, source) in enumerate(LENGTH_CASES)])
def test_sequence_length_known_at_run_time(op, case, source, rng):
    """A length shape inference cannot give (a named dim, one through an If, a Reshape to a
    run-time shape): the same gradient graph runs at lengths 1 and 7 (14 through the If's else
    branch). Layout 1 (which onnxruntime does not run) on the reference evaluator only."""
    model, weights, feeds = length_model(op, case, source, rng)
    assert not isinstance(sequence_dim(model, op), int)
    check_lengths(model, weights, [feeds(1), feeds(7, cond=source != "if")], ort=not case.get("layout", 0))


def test_inside_if_branches(rng):
    """An LSTM in each branch of an If (as Silero VAD picks its model by sample rate), its
    length known at run time: the If's gradient branches hold the Scans."""
    ins = {n: v for n, v in make_inputs("LSTM", rng, h0=True, c0=True, P=True)[1:] if v is not None}

    def branch(name, attrs):
        nodes = [helper.make_node("LSTM", ["X", "W", "R", "B", "", "initial_h", "initial_c", "P"],
                                  [f"Y_{name}", f"Y_h_{name}"], hidden_size=H, **attrs),
                 helper.make_node("Mul", [f"Y_{name}", f"Y_{name}"], [f"Y_sq_{name}"]),
                 helper.make_node("ReduceSum", [f"Y_sq_{name}"], [f"s_{name}"], keepdims=0),
                 helper.make_node("ReduceSum", [f"Y_h_{name}"], [f"t_{name}"], keepdims=0),
                 helper.make_node("Add", [f"s_{name}", f"t_{name}"], [f"loss_{name}"])]
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"loss_{name}", FLOAT, [])])

    inputs = [helper.make_tensor_value_info("X", FLOAT, ["seq", N, I]),
              helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])]
    inputs += [helper.make_tensor_value_info(n, FLOAT, list(v.shape)) for n, v in ins.items()]
    node = helper.make_node("If", ["cond"], ["loss"], then_branch=branch("then", {}),
                            else_branch=branch("else", {"direction": "reverse", "clip": 0.7}))
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("loss", FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    runs = [{**ins, "X": rng.standard_normal((length, N, I)).astype(f32), "cond": np.array(cond)}
            for length, cond in ((1, True), (7, True), (1, False), (7, False))]
    check_lengths(model, ["X", *ins], runs)


# ----------------------------------------------------------------------------- torch

class TorchRecurrent:
    """nn.LSTM / nn.GRU / nn.RNN (exported as the ONNX ops) with a loss on the outputs and the
    final states."""

    @staticmethod
    def make(kind, **kw):
        import torch
        import torch.nn.functional as F

        class Module(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.rnn = getattr(torch.nn, kind)(I, H, **kw)
                self.head = torch.nn.Linear(H * (2 if kw.get("bidirectional") else 1), 2)

            def forward(self, x, target):
                out, state = self.rnn(x)
                states = state if isinstance(state, tuple) else (state,)
                return F.mse_loss(self.head(out), target) + sum((s * s).mean() for s in states)

        return Module()


TORCH = [
    ("LSTM", {"bidirectional": True, "num_layers": 2, "batch_first": True}),
    ("GRU", {"bidirectional": True}),
    ("RNN", {"nonlinearity": "relu", "num_layers": 2}),
    ("RNN", {"nonlinearity": "tanh", "batch_first": True, "bidirectional": True}),
]


@pytest.mark.parametrize("kind,kw", TORCH, ids=[f"{k}-{i}" for i, (k, _) in enumerate(TORCH)])
def test_against_torch(kind, kw):
    import torch

    from tests.torch_models import compare_with_torch, export

    torch.manual_seed(0)
    module = TorchRecurrent.make(kind, **kw)
    x = torch.randn(N, 5, I) if kw.get("batch_first") else torch.randn(5, N, I)
    with torch.no_grad():
        target = torch.randn(*module.head(module.rnn(x)[0]).shape)
    exported = export(module, (x, target), ["x", "target"], dynamo=False, opset=17)
    assert sum(n.op_type == kind for n in exported.graph.node) == kw.get("num_layers", 1)
    compare_with_torch(module, (x, target), ["x", "target"], dynamo=False, opset=17)


def torch_with_states(kind, **kw):
    """nn.LSTM / nn.GRU / nn.RNN taking its initial states as inputs, with a loss on its outputs
    (through a linear head) and its final states."""
    import torch

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = getattr(torch.nn, kind)(I, H, **kw)
            self.head = torch.nn.Linear(H * (2 if kw.get("bidirectional") else 1), 2)

        def forward(self, x, *states):
            out, final = self.rnn(x, states if len(states) > 1 else states[0])
            final = final if isinstance(final, tuple) else (final,)
            return (self.head(out) ** 2).mean() + sum((s * s).mean() for s in final)

    return Module()


TORCH_LENGTHS = [
    ("LSTM", {"bidirectional": True}),
    ("GRU", {"batch_first": True}),
    ("RNN", {"num_layers": 2, "bidirectional": True}),
]


@pytest.mark.parametrize("kind,kw", TORCH_LENGTHS, ids=[k for k, _ in TORCH_LENGTHS])
def test_against_torch_at_run_time_lengths(kind, kw):
    """Exported with a dynamic sequence axis: one gradient graph gives torch autograd's loss and
    gradients of the parameters, the input and the initial states at lengths 1 and 7."""
    import io
    import warnings

    import torch

    torch.manual_seed(0)
    module = torch_with_states(kind, **kw)
    seq_axis = 1 if kw.get("batch_first") else 0
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    state_names = ["h0", "c0"] if kind == "LSTM" else ["h0"]

    def example(length):
        x = torch.randn((N, length, I) if seq_axis else (length, N, I))
        return [x] + [torch.randn(layers, N, H) for _ in state_names]

    names = ["x", *state_names]
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, tuple(example(5)), f, dynamo=False, opset_version=17, input_names=names,
                          output_names=["loss"], do_constant_folding=False, dynamic_axes={"x": {seq_axis: "seq"}})
    model = onnx.load_from_string(f.getvalue())
    assert sum(n.op_type == kind for n in model.graph.node) == kw.get("num_layers", 1)
    assert model.graph.input[0].type.tensor_type.shape.dim[seq_axis].dim_param == "seq"
    params = dict(module.named_parameters())
    weights = [*params, *names]
    sess = ort_session(gradient_graph(model, weights).get_model())
    for length in (1, 7):
        inputs = [v.requires_grad_() for v in example(length)]
        module.zero_grad()
        loss = module(*inputs)
        loss.backward()
        out = dict(zip([o.name for o in sess.get_outputs()],
                       sess.run(None, {n: v.detach().numpy() for n, v in zip(names, inputs)})))
        np.testing.assert_allclose(out["loss"], loss.detach().numpy(), rtol=1e-5)
        refs = {**{n: p.grad for n, p in params.items()}, **{n: v.grad for n, v in zip(names, inputs)}}
        for name, ref in refs.items():
            ref = ref.numpy()
            np.testing.assert_allclose(out[f"{name}_grad"], ref, rtol=1e-3, atol=1e-5 * max(1.0, np.abs(ref).max()),
                                       err_msg=f"length {length}: {name}")


@pytest.mark.parametrize("opset", [13, 22])
@pytest.mark.parametrize("op", list(GATES))
def test_other_opsets(op, opset, rng):
    """The opset-7 form (no layout attribute) and opset 22."""
    check(op, {**BI, "seq": [3, 2], "h0": True, "c0": True, "P": True, "clip": 0.9}, opset, rng)
