import numpy as np
import onnxruntime as ort
import pytest

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import check_model, check_op, make_op_model, pairwise

f32 = np.float32
C = 4
SHAPES = [(3, C), (3, C, 2), (2, C, 2, 3)]
IGNORE = [None, 1, -100, 7]  # none, a real class, negative (torch's -100), >= C


def labels_for(rng, shape, ignore_index, dtype=np.int64):
    """Labels (N, d..) in [0, C), with some set to ignore_index, at least two kept."""
    t = rng.integers(0, C, (shape[0],) + shape[2:]).astype(dtype)
    flat = t.reshape(-1)
    flat[0], flat[-1] = 0, 2
    if ignore_index is not None:
        flat[1::3] = ignore_index
    return t


def loss_inputs(rng, shape, weighted, ignore_index, dtype=np.int64):
    x = rng.standard_normal(shape).astype(f32)
    inputs = [("x", x), ("t", labels_for(rng, shape, ignore_index, dtype))]
    if weighted:
        inputs.append(("w", rng.uniform(0.5, 2.0, (C,)).astype(f32)))
    return inputs


def attrs_for(reduction, ignore_index):
    attrs = {"reduction": reduction}
    if ignore_index is not None:
        attrs["ignore_index"] = ignore_index
    return attrs


def check_with_loss_of(op, inputs, attrs, keep, *, opset, num_outputs):
    """Like check_op, but the loss projects only the outputs ``keep``."""
    model, weights, feeds = make_op_model(op, inputs, attrs, num_outputs=num_outputs, opset=opset)
    loss = model.graph.node[-1]
    del loss.input[:]
    loss.input.extend(f"y{i}_s" for i in keep)
    loss.op_type = "Sum"
    return check_model(model, weights, feeds)


# Covering sets, not the full grids (144 and 288 cases). In rules/losses.py reduction,
# the class weights and ignore_index enter the same arithmetic (c = dy or dy/sum(M*w), the
# mask M, dw's nll - L for mean), so those three run in every combination (24). The rank
# (the class-vector unsqueeze and _sum_but_classes' axes), the opset (the rule does not read
# it; the emitted reductions do) and SoftmaxCrossEntropyLoss's log_prob output (lp taken from
# the node, dlog_prob added to G) are independent branches: each of their values meets every
# value of every other parameter (all pairs), which is what the full grid added.
LOSS_PARAMS = {"reduction": ["none", "sum", "mean"], "weighted": [False, True], "ignore_index": IGNORE,
               "shape": SHAPES, "opset": [13, 18]}
NLL_CASES = pairwise(LOSS_PARAMS, whole=["reduction", "weighted", "ignore_index"])
SCE_CASES = pairwise({**LOSS_PARAMS, "num_outputs": [1, 2]}, whole=["reduction", "weighted", "ignore_index"])


def loss_case_id(case):
    reduction, weighted, ignore_index, shape, opset, *num_outputs = case
    return "-".join([reduction, "weighted" if weighted else "unweighted", f"ignore{ignore_index}",
                     f"rank{len(shape)}", str(opset), *[f"out{k}" for k in num_outputs]])


@pytest.mark.parametrize("reduction,weighted,ignore_index,shape,opset", NLL_CASES,
                         ids=[loss_case_id(c) for c in NLL_CASES])
def test_nll_loss(reduction, weighted, ignore_index, shape, opset, rng):
    check_op("NegativeLogLikelihoodLoss", loss_inputs(rng, shape, weighted, ignore_index),
             attrs_for(reduction, ignore_index), opset=opset)


@pytest.mark.parametrize("reduction,weighted,ignore_index,shape,opset,num_outputs", SCE_CASES,
                         ids=[loss_case_id(c) for c in SCE_CASES])
def test_softmax_cross_entropy(reduction, weighted, ignore_index, shape, opset, num_outputs, rng):
    # num_outputs=2: the loss uses both the loss and log_prob outputs
    check_op("SoftmaxCrossEntropyLoss", loss_inputs(rng, shape, weighted, ignore_index),
             attrs_for(reduction, ignore_index), opset=opset, num_outputs=num_outputs)


@pytest.mark.filterwarnings("ignore:these weights do not reach the loss")
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_softmax_cross_entropy_log_prob_only(reduction, rng):
    # only log_prob reaches the loss: the loss output's gradient arrives as None
    inputs = loss_inputs(rng, (3, C, 2), True, 1)
    report = check_with_loss_of("SoftmaxCrossEntropyLoss", inputs, attrs_for(reduction, 1), [1],
                                opset=18, num_outputs=2)
    assert not np.any(report.gradients["w"])


@pytest.mark.parametrize("op", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_dynamic_dims(op, reduction, rng):
    inputs = loss_inputs(rng, (2, C, 3), True, -100)
    check_op(op, inputs, attrs_for(reduction, -100), opset=18, weights_as="inputs", dims="dynamic")
    inputs = loss_inputs(rng, (3, C), True, 2)
    check_op(op, inputs, attrs_for(reduction, 2), opset=13, weights_as="inputs", dims="dynamic")


def grads_without_shapes(op, inputs, attrs, *, opset, num_outputs=1):
    """The gradients built when no value has a known shape or rank (as for models over 2 GB,
    which skip shape inference), in float64 on the reference evaluator and in float32 on
    onnxruntime, against check_op's float64 gradients."""
    import onnx_ir as ir
    from onnx.reference import ReferenceEvaluator

    from gradbuilder.compiler.autodiff import differentiate
    from gradbuilder.compiler.emitter import Emitter
    from gradbuilder.testing import to_float64

    expected = check_op(op, inputs, attrs, opset=opset, num_outputs=num_outputs).gradients
    model, weights, _ = make_op_model(op, inputs, attrs, opset=opset, num_outputs=num_outputs)
    for proto, tol in ((to_float64(model), 1e-7), (model, 1e-4)):
        m = ir.from_proto(proto)
        values = {v.name: v for v in m.graph.inputs}
        values.update(m.graph.initializers)
        for node in m.graph:
            for v in node.outputs:
                v.shape = None
                values[v.name] = v
        for v in list(m.graph.inputs) + list(m.graph.initializers.values()):
            v.shape = None
        res = differentiate(m.graph, [values[w] for w in weights], values["loss"], Emitter(m.graph, opset))
        m.graph.outputs.clear()
        m.graph.outputs.extend(res.grads[w] for w in weights)
        built = ir.to_proto(m)
        if proto is model:
            got = ort.InferenceSession(built.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})
        else:
            got = ReferenceEvaluator(built).run(None, {})
        for w, g in zip(weights, got):
            np.testing.assert_allclose(g, expected[w], rtol=tol * 10, atol=tol * max(1, np.abs(expected[w]).max()))


@pytest.mark.parametrize("op", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
@pytest.mark.parametrize("ignore_index", [None, 1, -100])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_no_shape_information(op, ignore_index, reduction, rng):
    inputs = loss_inputs(rng, (2, C, 2, 2), True, ignore_index)
    grads_without_shapes(op, inputs, attrs_for(reduction, ignore_index), opset=18)


@pytest.mark.parametrize("op", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
def test_int32_labels_and_default_reduction(op, rng):
    inputs = loss_inputs(rng, (3, C, 2), True, -100, dtype=np.int32)
    check_op(op, inputs, {"ignore_index": -100}, opset=13)


def test_sce_matches_nll_of_log_softmax(rng):
    """The weights gradient of SoftmaxCrossEntropyLoss equals NegativeLogLikelihoodLoss's on log_prob."""
    from onnx.reference import ReferenceEvaluator

    x = rng.standard_normal((3, C, 2)).astype(f32)
    t = labels_for(rng, x.shape, 1)
    w = rng.uniform(0.5, 2, (C,)).astype(f32)
    lp = x - np.log(np.exp(x).sum(1, keepdims=True))
    grads = []
    for op, first in (("SoftmaxCrossEntropyLoss", x), ("NegativeLogLikelihoodLoss", lp)):
        model, weights, _ = make_op_model(op, [("x", first), ("t", t), ("w", w)],
                                          {"ignore_index": 1}, opset=18, wrt=["w"])
        built = GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto
        grads.append(ReferenceEvaluator(built).run(None, {"w": w})[1])
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_nll_minus_infinity_log_probs(reduction, rng):
    # log-probabilities of -inf for classes that are not the target (masked logits) leave
    # the gradients finite
    inputs = loss_inputs(rng, (3, C, 2), True, 1)
    x, t = inputs[0][1], inputs[1][1]
    for i, j in np.ndindex(t.shape):
        x[i, (t[i, j] + 1) % C, j] = -np.inf
    report = check_op("NegativeLogLikelihoodLoss", inputs, attrs_for(reduction, 1), opset=18, wrt=["w"])
    assert np.all(np.isfinite(report.gradients["w"]))


@pytest.mark.parametrize("op,num_outputs", [("NegativeLogLikelihoodLoss", 1), ("SoftmaxCrossEntropyLoss", 2)])
def test_float16(op, num_outputs, rng):
    inputs = [(k, v.astype(np.float16) if v.dtype == f32 else v) for k, v in loss_inputs(rng, (3, C, 2), True, -100)]
    check_op(op, inputs, attrs_for("mean", -100), opset=18, num_outputs=num_outputs, ort_rtol=2e-2, ort_atol=2e-2)
