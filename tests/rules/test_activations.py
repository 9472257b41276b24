import numpy as np
import onnx
import pytest
from onnx import helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import check_op, gradcheck, make_op_model

f32 = np.float32


def away(x, kinks, gap=0.1):
    """``x`` with every element closer than ``gap`` to a kink pushed ``gap`` away from it."""
    x = np.array(x)
    for k in kinks:
        near = np.abs(x - k) < gap
        x[near] = np.where(x[near] >= k, k + gap, k - gap)
    return x


def data(rng, shape=(3, 4), lo=-3.0, hi=3.0, kinks=(), dtype=f32):
    return away(rng.uniform(lo, hi, shape), kinks).astype(dtype)


# op -> (attribute sets, input range, kinks)
UNARY = {
    "Tanh": ([{}], (-2, 2), ()),
    "Sigmoid": ([{}], (-4, 4), ()),
    "Erf": ([{}], (-2, 2), ()),
    "Softplus": ([{}], (-4, 4), ()),
    "Softsign": ([{}], (-3, 3), (0,)),
    "Relu": ([{}], (-2, 2), (0,)),
    "LeakyRelu": ([{}, {"alpha": 0.2}], (-2, 2), (0,)),
    "Elu": ([{}, {"alpha": 0.5}], (-3, 2), (0,)),
    "Selu": ([{}, {"alpha": 1.5, "gamma": 2.0}], (-3, 2), (0,)),
    "HardSigmoid": ([{}], (-4, 4), (-2.5, 2.5)),
    "HardSwish": ([{}], (-5, 5), (-3, 3)),
}
HARD_SIGMOID_ATTRS = {"alpha": 0.5, "beta": 0.3}  # linear for -0.6 < x < 1.4

# onnx's reference Erf computes in float32 even on float64 inputs (np.vectorize(..., otypes="f")), so
# finite differences through Erf (and Gelu's Erf body) need a wider step and looser tolerances.
ERF_FD = {"eps": 3e-3, "rtol": 1e-3, "atol": 2e-4}


def fd(op, attrs=None):
    erf_based = op == "Erf" or (op == "Gelu" and (attrs or {}).get("approximate", "none") == "none")
    return ERF_FD if erf_based else {}


def unary_cases():
    for op, (attr_sets, _, _) in UNARY.items():
        for attrs in attr_sets:
            for opset in (14, 18) if op == "HardSwish" else (13, 18):  # HardSwish is new in opset 14
                yield pytest.param(op, attrs, opset, id=f"{op}-{attrs}-{opset}")
    for opset in (13, 18):
        yield pytest.param("HardSigmoid", HARD_SIGMOID_ATTRS, opset, id=f"HardSigmoid-custom-{opset}")


def unary_input(rng, op, attrs, shape=(3, 5), dtype=f32):
    _, (lo, hi), kinks = UNARY[op]
    if op == "HardSigmoid" and attrs:
        a, b = attrs["alpha"], attrs["beta"]
        kinks = (-b / a, (1 - b) / a)
    return data(rng, shape, lo, hi, kinks, dtype)


@pytest.mark.parametrize("op,attrs,opset", list(unary_cases()))
def test_unary(op, attrs, opset, rng):
    check_op(op, [("x", unary_input(rng, op, attrs, (3, 5)))], attrs, opset=opset, **fd(op))


@pytest.mark.parametrize("op", list(UNARY))
def test_unary_dynamic_shape(op, rng):
    check_op(op, [("x", unary_input(rng, op, {}, (2, 3, 4)))], opset=18, weights_as="inputs", dims="dynamic",
             **fd(op))


@pytest.mark.parametrize("op", ["Tanh", "Sigmoid", "Relu", "LeakyRelu", "Elu", "Softsign"])
def test_unary_float64(op, rng):
    x = unary_input(rng, op, {}, (3, 4), dtype=np.float64)
    check_op(op, [("x", x)], opset=18, ort_rtol=1e-9, ort_atol=1e-10)


def test_hard_sigmoid_zero_outside_linear_region():
    x = np.array([-4.0, -3.0, -1.0, 0.0, 2.0, 3.0, 10.0], dtype=f32)
    dx, dy = _grad_and_dy("HardSigmoid", [("x", x)], {"alpha": 0.2, "beta": 0.5}, opset=18)
    np.testing.assert_allclose(dx, dy * np.where(np.abs(x) < 2.5, 0.2, 0.0), rtol=1e-6)


def test_hard_swish_branches():
    x = np.array([-5.0, -3.0, -1.0, 0.0, 2.0, 3.0, 4.0], dtype=f32)
    dx, dy = _grad_and_dy("HardSwish", [("x", x)], {}, opset=18)
    want = np.where(x < -3, 0.0, np.where(x > 3, 1.0, x / 3 + 0.5))  # torch's hardswish_backward
    np.testing.assert_allclose(dx, dy * want, rtol=1e-6)


@pytest.mark.parametrize("approximate", [None, "none", "tanh"])
def test_gelu(approximate, rng):
    attrs = {} if approximate is None else {"approximate": approximate}
    check_op("Gelu", [("x", data(rng, (3, 5), -4, 4))], attrs, opset=20, **fd("Gelu", attrs))


def test_gelu_dynamic_shape(rng):
    check_op("Gelu", [("x", data(rng, (2, 3, 4), -4, 4))], {"approximate": "tanh"}, opset=20,
             weights_as="inputs", dims="dynamic")


# ----------------------------------------------------------------------------- Clip

LO, HI = np.array(-0.5, f32), np.array(0.7, f32)


def clip_x(rng, shape=(4, 5)):
    return data(rng, shape, -2, 2, (float(LO), float(HI)))


CLIP_INPUTS = {
    "both": lambda x: [("x", x), ("lo", LO), ("hi", HI)],
    "min_only": lambda x: [("x", x), ("lo", LO)],
    "max_only": lambda x: [("x", x), ("", None), ("hi", HI)],
    "neither": lambda x: [("x", x)],
    "empty_both": lambda x: [("x", x), ("", None), ("", None)],
}


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("form", list(CLIP_INPUTS))
def test_clip_bounds_as_weights(form, opset, rng):
    # every float input is a weight: x, and min/max get sum(dy) where x falls below/above them
    check_op("Clip", CLIP_INPUTS[form](clip_x(rng)), opset=opset)


@pytest.mark.parametrize("form", ["both", "min_only", "max_only"])
def test_clip_constant_bounds(form, rng):
    check_op("Clip", CLIP_INPUTS[form](clip_x(rng)), opset=13, wrt=["x"])


@pytest.mark.parametrize("dims", ["symbolic", "dynamic"])
def test_clip_dynamic_shape(dims, rng):
    check_op("Clip", CLIP_INPUTS["both"](clip_x(rng, (2, 3, 4))), opset=18, weights_as="inputs", dims=dims)


def test_clip_float64(rng):
    x = clip_x(rng).astype(np.float64)
    check_op("Clip", [("x", x), ("lo", LO.astype(np.float64)), ("hi", HI.astype(np.float64))], opset=18,
             ort_rtol=1e-9, ort_atol=1e-10)


def test_clip_inclusive_bounds_and_min_above_max():
    x = np.array([-1.0, -0.5, 0.0, 0.7, 1.0], dtype=f32)
    got = _grads("Clip", [("x", x), ("lo", LO), ("hi", HI)], {}, opset=13)
    dy = got["y0_proj"]
    np.testing.assert_allclose(got["x_grad"], dy * [0, 1, 1, 1, 0])  # torch.clamp: min <= x <= max
    np.testing.assert_allclose(got["lo_grad"], dy[0], rtol=1e-6)
    np.testing.assert_allclose(got["hi_grad"], dy[4], rtol=1e-6)
    # min > max: y = max everywhere (np.clip / onnxruntime), so max takes all of dy
    check_op("Clip", [("x", np.array([-1.0, 0.2, 0.6, 1.0], f32)), ("lo", np.array(0.5, f32)),
                      ("hi", np.array(-0.3, f32))], opset=13)


# ----------------------------------------------------------------------------- Dropout


def test_dropout_inference_forms(rng):
    x = data(rng, (3, 4))
    r = np.array(0.3, f32)
    for opset in (13, 18):
        check_op("Dropout", [("x", x)], opset=opset)
        check_op("Dropout", [("x", x), ("r", r)], opset=opset, wrt=["x"], num_outputs=2)
        check_op("Dropout", [("x", x), ("r", r), ("t", np.array(False))], opset=opset, wrt=["x"])
        # ratio 0 in training mode is the identity too
        check_op("Dropout", [("x", x), ("r", np.array(0.0, f32)), ("t", np.array(True))], opset=opset,
                 wrt=["x"], num_outputs=2)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("with_mask", [True, False])
@pytest.mark.parametrize("ratio", [0.3, 0.75])
def test_dropout_training_gradcheck(ratio, with_mask, opset, rng):
    # The reference evaluator draws the mask from RandomState(seed) on every run, so the loss is
    # a deterministic function of x and finite differences apply. x has no zeros here. (The
    # default ratio, input "", is tested on onnxruntime only: the reference Dropout fails on it.)
    x = away(rng.uniform(-2, 2, (4, 6)), [0.0]).astype(f32)
    ins = [("x", x), ("r", np.array(ratio, f32)), ("t", np.array(True))]
    check_op("Dropout", ins, {"seed": 7}, opset=opset, wrt=["x"], num_outputs=2 if with_mask else 1, ort=False)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("ratio", [None, 0.4])
@pytest.mark.parametrize("with_mask", [True, False])
def test_dropout_training_onnxruntime_against_its_own_mask(with_mask, ratio, opset, rng):
    # onnxruntime draws its own mask; check its gradient against dy * mask / (1 - ratio)
    # computed in numpy from that run's mask. Without a mask output the builder exposes the
    # mask on its copy of the node, so the gradient is exact even where x == 0 (y tells
    # nothing there): each such element gets either 0 or dy / (1 - ratio).
    x = data(rng, (6, 8), kinks=(0.0,))
    x[0, :3] = 0.0
    ins = [("x", x), ("r", np.array(0.4 if ratio is None else ratio, f32)), ("t", np.array(True))]
    outs = ["y0", "y1"] if with_mask else ["y0"]
    model, weights, feeds = make_op_model("Dropout", ins, {"seed": 3}, opset=opset, num_outputs=len(outs),
                                          wrt=["x"])
    if ratio is None:  # default ratio 0.5: input "" (built by hand, onnx's reference Dropout rejects it)
        model = _omit_input(model, "r")
        ratio = 0.5
    got = _run_ort(model, weights, feeds, ["loss", "y0_proj", *outs])
    dy, y = got["y0_proj"], got["y0"]
    kept = got["y1"] if with_mask else (y != 0)
    want = dy * kept / (1 - ratio)
    assert 0 < kept.mean() < 1
    if not with_mask:
        zero = x == 0
        g = got["x_grad"][zero]
        assert np.all(np.isclose(g, 0) | np.isclose(g, dy[zero] / (1 - ratio), rtol=1e-6))
        want = np.where(zero, got["x_grad"], want)
    np.testing.assert_allclose(got["x_grad"], want, rtol=1e-6, atol=1e-7)
    # the built graph's Dropout returns its mask; the caller's model is left as it was
    assert len(got["model"].graph.node[0].output) == 2
    assert len(model.graph.node[0].output) == len(outs)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("with_mask", [True, False])
def test_dropout_dynamic_ratio_and_training_mode(training, with_mask, rng):
    # ratio and training_mode are graph inputs (not weights): the scale is chosen at run time
    x = away(rng.uniform(-2, 2, (2, 3, 4)), [0.0]).astype(f32)
    ins = [("x", x), ("r", np.array(0.25, f32)), ("t", np.array(training))]
    model, weights, feeds = make_op_model("Dropout", ins, {"seed": 5}, opset=18, wrt=["x"],
                                          num_outputs=2 if with_mask else 1, weights_as="inputs",
                                          dims="dynamic")
    model = _inits_to_inputs(model, ["r", "t"])
    feeds = {**feeds, "r": ins[1][1], "t": ins[2][1]}
    report = gradcheck(model, weights, "loss", feeds)
    assert report.passed, str(report)
    got = _run_ort(model, weights, feeds, ["loss", "y0", "y0_proj"] + (["y1"] if with_mask else []))
    kept = got["y1"] if with_mask else (got["y0"] != 0)
    scale = 1 / (1 - 0.25) if training else 1.0
    np.testing.assert_allclose(got["x_grad"], got["y0_proj"] * kept * scale, rtol=1e-6, atol=1e-7)


def test_dropout_float64(rng):
    x = away(rng.uniform(-2, 2, (3, 4)), [0.0])
    check_op("Dropout", [("x", x), ("r", np.array(0.5)), ("t", np.array(True))], {"seed": 1}, opset=13,
             wrt=["x"], num_outputs=2, ort=False)


# ----------------------------------------------------------------------------- helpers


def _inits_to_inputs(model, names):
    """``model`` with the initializers ``names`` turned into graph inputs (values no longer known)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = []
    for t in out.graph.initializer:
        if t.name in names:
            out.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            keep.append(t)
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    return out


def _omit_input(model, name):
    """``model`` with node input ``name`` replaced by "" (an omitted optional input)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        node.input[:] = ["" if i == name else i for i in node.input]
    keep = [t for t in out.graph.initializer if t.name != name]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    return out


def _run_ort(model, weights, feeds, outputs):
    import onnxruntime as ort

    built = GradientGraphBuilder(model, weights=weights, outputs=outputs, loss="loss").build().model_proto
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(built.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    run_feeds = {i.name: feeds[i.name] for i in sess.get_inputs() if i.name in feeds}
    got = dict(zip(names, sess.run(None, run_feeds)))
    got["model"] = built
    return got


def _grads(op, ins, attrs, *, opset):
    """The gradients of a one-op model and dy (= ``y0_proj``), on onnx's reference evaluator."""
    from onnx.reference import ReferenceEvaluator

    model, weights, feeds = make_op_model(op, ins, attrs, opset=opset)
    built = GradientGraphBuilder(model, weights=weights, outputs=["loss", "y0_proj"], loss="loss").build()
    proto = built.model_proto
    return dict(zip([o.name for o in proto.graph.output], ReferenceEvaluator(proto).run(None, feeds)))


def _grad_and_dy(op, ins, attrs, *, opset):
    got = _grads(op, ins, attrs, opset=opset)
    return got[f"{ins[0][0]}_grad"], got["y0_proj"]


@pytest.mark.parametrize("seed", [None, 3])
@pytest.mark.parametrize("dynamic_training", [False, True])
def test_dropout_gradient_for_a_ratio_given_at_run_time(seed, dynamic_training):
    """y = x * mask / (1 - r): d r = sum(dy * y) / (1 - r) for the drawn mask. onnxruntime
    draws other masks than onnx's reference, so the check runs on the reference only."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.5, (3, 4))
    attrs = {} if seed is None else {"seed": seed}
    check_op("Dropout", [("x", x), ("r", np.array(0.3)), ("t", np.array(True))], attrs,
             opset=13, num_outputs=2, wrt=["x", "r"], weights_as="inputs" if dynamic_training else "initializers",
             ort=False)
