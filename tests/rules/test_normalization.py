import numpy as np
import onnx
import onnxruntime as ort
import pytest

from gradbuilder import GradientGraphBuilder, GradientRuleError
from gradbuilder.testing import check_model, check_op, make_op_model, ort_grads, pairwise, patch_reference_evaluator

f32 = np.float32


def arr(rng, *shape, lo=None, hi=None):
    if lo is not None:
        return rng.uniform(lo, hi, shape).astype(f32)
    return rng.standard_normal(shape).astype(f32)


def eps_attr(eps):
    return {} if eps is None else {"epsilon": eps}


def op_model(op, inputs, attrs, *, keep=None, cast_outputs=(), cast_to=onnx.TensorProto.FLOAT, **kw):
    """make_op_model, with a loss projecting only the outputs ``keep`` (all when None), and the
    outputs ``cast_outputs`` passed through Cast(to=cast_to) before their projection.

    The Cast is for LayerNormalization's Mean and InvStdDev: their type is stash_type (float),
    so in the float64 copy gradcheck makes they would not type-check against float64
    projections; the Cast becomes Cast(to=DOUBLE) there (the reference evaluator computes them
    in float64)."""
    model, weights, feeds = make_op_model(op, inputs, attrs, **kw)
    if keep is not None:
        loss = model.graph.node[-1]
        del loss.input[:]
        loss.input.extend(f"y{i}_s" for i in keep)
        loss.op_type = "Sum"
    node = model.graph.node[0]
    for i in cast_outputs:
        node.output[i] = f"y{i}_raw"
        model.graph.node.insert(1, onnx.helper.make_node("Cast", [f"y{i}_raw"], [f"y{i}"], to=cast_to))
    return model, weights, feeds


def check(op, inputs, attrs, on_ort=True, **kw):
    return check_model(*op_model(op, inputs, attrs, **kw), ort=on_ort)


def differentiate_model(model, weights, *, forget_shapes=False):
    """The gradient model built by the reverse walk alone (no onnx.checker on the result);
    ``forget_shapes`` drops every shape and rank first, as for models over 2 GB, which skip
    shape inference."""
    import onnx_ir as ir

    from gradbuilder.compiler import modelio
    from gradbuilder.compiler.autodiff import differentiate
    from gradbuilder.compiler.emitter import Emitter

    opset = model.opset_import[0].version
    m = ir.from_proto(model if forget_shapes else modelio.normalize(model))
    values = {v.name: v for v in m.graph.inputs}
    values.update(m.graph.initializers)
    for node in m.graph:
        values.update((v.name, v) for v in node.outputs)
    if forget_shapes:
        for v in values.values():
            v.shape = None
    res = differentiate(m.graph, [values[w] for w in weights], values["loss"], Emitter(m.graph, opset))
    m.graph.outputs.clear()
    m.graph.outputs.extend(res.grads[w] for w in weights)
    return ir.to_proto(m)


def run_grads(model, weights, feeds=None, runtime="reference", **kw):
    from onnx.reference import ReferenceEvaluator

    built = differentiate_model(model, weights, **kw)
    if runtime == "reference":
        got = ReferenceEvaluator(built).run(None, feeds or {})
    else:
        sess = ort.InferenceSession(built.SerializeToString(), providers=["CPUExecutionProvider"])
        got = sess.run(None, {i.name: (feeds or {})[i.name] for i in sess.get_inputs()})
    return dict(zip(weights, got))


def grads_without_shapes(op, inputs, attrs, *, rtol=1e-6, **kw):
    """The gradients built when no value has a known shape or rank, in float64 on the reference
    evaluator and in float32 on onnxruntime, against the finite-difference-checked ones."""
    from gradbuilder.testing import to_float64

    expected = check(op, inputs, attrs, **kw).gradients
    model, weights, _ = op_model(op, inputs, attrs, **kw)
    for proto, tol, runtime in ((to_float64(model), rtol, "reference"), (model, 1e-4, "ort")):
        got = run_grads(proto, weights, runtime=runtime, forget_shapes=True)
        for w in weights:
            np.testing.assert_allclose(got[w], expected[w], rtol=tol * 10,
                                       atol=tol * max(1, np.abs(expected[w]).max()))


# ----------------------------------------------------------------------------- BatchNormalization

BN_SHAPES = [(4, 3), (3, 3, 4), (2, 3, 2, 2)]


def bn_inputs(rng, shape, stats_dtype=f32):
    c = shape[1]
    return [("x", arr(rng, *shape)), ("s", arr(rng, c, lo=0.5, hi=1.5)), ("b", arr(rng, c)),
            ("mean", arr(rng, c).astype(stats_dtype)), ("var", arr(rng, c, lo=0.5, hi=1.5).astype(stats_dtype))]


def check_bn(inputs, attrs, *, opset, **kw):
    """check_op; at opset 13 (BatchNormalization-9) onnx's reference evaluator blends in the
    batch statistics even in inference mode, so there the gradients run on onnxruntime and
    must match the finite-difference-checked ones of the same node at opset 15."""
    if opset >= 14:
        return check_op("BatchNormalization", inputs, attrs, opset=opset, **kw)
    expected = check_op("BatchNormalization", inputs, attrs, opset=15, **kw).gradients
    model, weights, feeds = make_op_model("BatchNormalization", inputs, attrs, opset=opset, **kw)
    got = ort_grads(model, weights, feeds)
    for w in weights:
        np.testing.assert_allclose(got[w], expected[w], rtol=2e-3, atol=2e-4 * max(1.0, np.abs(expected[w]).max()))


@pytest.mark.parametrize("opset", [13, 15, 18])
@pytest.mark.parametrize("eps", [None, 0.1])
@pytest.mark.parametrize("shape", BN_SHAPES, ids=lambda s: f"rank{len(s)}")
def test_batch_norm_inference(shape, eps, opset, rng):
    # gradients for X, scale, B, input_mean and input_var
    attrs = eps_attr(eps)
    check_bn(bn_inputs(rng, shape), attrs, opset=opset)
    if opset >= 14:
        attrs.update(training_mode=0, momentum=0.7)  # momentum is unused in inference mode
        check_bn(bn_inputs(rng, shape), attrs, opset=opset)


@pytest.mark.parametrize("opset", [13, 18])
def test_batch_norm_inference_some_weights(opset, rng):
    check_bn(bn_inputs(rng, (2, 3, 4)), {}, opset=opset, wrt=["x", "s", "b"])
    check_bn(bn_inputs(rng, (2, 3, 4)), {}, opset=opset, wrt=["mean", "var"])
    check_bn(bn_inputs(rng, (2, 3, 4)), {}, opset=opset, wrt=["x"])


@pytest.mark.filterwarnings("ignore:these weights do not reach the loss")
@pytest.mark.parametrize("opset", [14, 15, 18])
@pytest.mark.parametrize("momentum", [None, 0.5])
@pytest.mark.parametrize("eps", [None, 0.1])
@pytest.mark.parametrize("shape", BN_SHAPES, ids=lambda s: f"rank{len(s)}")
def test_batch_norm_training(shape, eps, momentum, opset, rng):
    # the loss projects Y only, which uses the batch statistics: input_mean/input_var get a
    # zero gradient (the running statistics are checked below)
    attrs = {"training_mode": 1, **eps_attr(eps)}
    if momentum is not None:
        attrs["momentum"] = momentum
    report = check("BatchNormalization", bn_inputs(rng, shape), attrs, keep=[0], opset=opset, num_outputs=3)
    assert not np.any(report.gradients["mean"]) and not np.any(report.gradients["var"])


@pytest.mark.parametrize("opset", [15, 18])
@pytest.mark.parametrize("momentum", [None, 0.3])
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 2, 2)], ids=lambda s: f"rank{len(s)}")
def test_batch_norm_training_running_stats(shape, momentum, opset, rng):
    # running_mean = m*input_mean + (1-m)*mu, running_var = m*input_var + (1-m)*var (population):
    # the loss of all three outputs reaches input_mean/input_var and, through mu and var, x
    attrs = {"training_mode": 1, **({} if momentum is None else {"momentum": momentum})}
    check_op("BatchNormalization", bn_inputs(rng, shape), attrs, opset=opset, num_outputs=3)


def test_batch_norm_training_running_stats_only(rng):
    # only the running statistics reach the loss: Y's gradient arrives as None
    inputs = bn_inputs(rng, (3, 3, 2))
    check("BatchNormalization", inputs, {"training_mode": 1, "momentum": 0.6}, keep=[1, 2], num_outputs=3,
          opset=15, wrt=["x", "mean", "var"])
    check("BatchNormalization", inputs, {"training_mode": 1}, keep=[2], num_outputs=3, opset=15, wrt=["x", "var"])


@pytest.fixture
def bn9_reference(monkeypatch):
    """onnx's reference BatchNormalization-9 has one output; this one computes its training
    outputs as onnxruntime does: Y with the batch statistics, running mean/var blended with
    momentum, saved_mean = the batch mean, saved_var = 1/sqrt(var + eps)."""
    from onnx.reference.op_run import OpRun

    class BatchNormalization(OpRun):  # new_ops are matched by class name
        op_domain = ""

        def _run(self, x, scale, bias, mean, var, epsilon=None, momentum=None, training_mode=None):
            eps, mom = (1e-5 if epsilon is None else epsilon), (0.9 if momentum is None else momentum)
            axes = (0,) + tuple(range(2, x.ndim))
            shape = (1, -1) + (1,) * (x.ndim - 2)
            if len(self.output) == 1:
                mu, v = mean, var
            else:
                mu, v = x.mean(axis=axes), x.var(axis=axes)
            y = scale.reshape(shape) * (x - mu.reshape(shape)) / np.sqrt(v.reshape(shape) + eps) + bias.reshape(shape)
            if len(self.output) == 1:
                return (y.astype(x.dtype),)
            return (y.astype(x.dtype), mean * mom + mu * (1 - mom), var * mom + v * (1 - mom), mu,
                    1 / np.sqrt(v + eps))

    patch_reference_evaluator(monkeypatch, BatchNormalization)


@pytest.mark.filterwarnings("ignore:these weights do not reach the loss")
@pytest.mark.parametrize("keep", [[0], [0, 1, 2, 3], [3]], ids=["Y", "all-but-saved_var", "saved_mean"])
def test_batch_norm_9_training_outputs(keep, rng, bn9_reference):
    """BatchNormalization-9 with its training outputs (opset 13): Y uses the batch statistics,
    the running mean/var blend in momentum, saved_mean is the batch mean (checked on the
    reference above and on onnxruntime)."""
    inputs = bn_inputs(rng, (3, 3, 2))
    check("BatchNormalization", inputs, {"momentum": 0.7, "epsilon": 0.01}, keep=keep, num_outputs=5, opset=13)


def test_batch_norm_9_saved_var_is_refused(rng, bn9_reference):
    # saved_var has no agreed meaning (onnxruntime gives 1/sqrt(var + eps)): refused, not dropped
    model, weights, _ = op_model("BatchNormalization", bn_inputs(rng, (3, 3, 2)), {}, keep=[0, 4],
                                 num_outputs=5, opset=13)
    with pytest.raises(GradientRuleError, match="saved_var"):
        GradientGraphBuilder(model, weights, ["loss"], "loss").build()


@pytest.mark.filterwarnings("ignore:these weights do not reach the loss")
def test_batch_norm_dynamic_dims(rng):
    check_op("BatchNormalization", bn_inputs(rng, (2, 3, 2, 2)), {"training_mode": 0}, opset=15,
             weights_as="inputs", dims="dynamic")
    check("BatchNormalization", bn_inputs(rng, (2, 3, 2, 2)), {"training_mode": 1}, keep=[0], num_outputs=3,
          opset=15, weights_as="inputs", dims="dynamic")
    grads_without_shapes("BatchNormalization", bn_inputs(rng, (2, 3, 4)), {}, opset=18)
    grads_without_shapes("BatchNormalization", bn_inputs(rng, (2, 3, 4)), {"training_mode": 1}, keep=[0],
                         num_outputs=3, opset=18)


@pytest.mark.parametrize("training", [0, 1])
def test_batch_norm_mixed_types(training, rng):
    # opset 15: input_mean/input_var (T2) may have another type than X and scale; onnxruntime
    # has no kernel for that, so only the float64 check runs
    inputs = bn_inputs(rng, (2, 3, 4), stats_dtype=np.float64)
    if training:
        check("BatchNormalization", inputs, {"training_mode": 1}, keep=[0], num_outputs=3, opset=15, on_ort=False,
              wrt=["x", "s", "b"])
    else:
        check_op("BatchNormalization", inputs, {}, opset=15, ort=False)


# ----------------------------------------------------------------------------- LayerNormalization

# (x shape, axis, scale/B shape): scale and B broadcast to the normalized shape
LN_CASES = [
    ((3, 5), -1, (5,)),
    ((3, 5), 1, (1, 5)),
    ((3, 5), 0, (3, 5)),
    ((2, 3, 4), -1, (4,)),
    ((2, 3, 4), 1, (3, 4)),
    ((2, 3, 4), -2, (1, 4)),
    ((2, 3, 4), -2, (3, 1)),
    ((2, 3, 4), 0, (2, 3, 4)),
    ((2, 3, 4), -3, (4,)),
]


def ln_inputs(rng, shape, pshape, bias=True):
    inputs = [("x", arr(rng, *shape)), ("s", arr(rng, *pshape, lo=0.5, hi=1.5))]
    if bias:
        inputs.append(("b", arr(rng, *pshape)))
    return inputs


def check_ln(inputs, attrs, num_outputs, **kw):
    """check_op for LayerNormalization; its Mean and InvStdDev outputs reach the loss too."""
    return check("LayerNormalization", inputs, attrs, num_outputs=num_outputs,
                 cast_outputs=range(1, num_outputs), **kw)


# A covering set, not the full grid (216 cases). In rules/normalization.py the case (rank,
# axis and Scale/B shapes: trailing_axes, the Moments reductions, unbroadcast) and the outputs
# that reach the loss (dMean, dInvStdDev in Moments.backward over the same axes) interact, so
# those two run in every combination (27). B (db = unbroadcast(dy, b)), the opset (how the
# reductions over those axes are emitted) and epsilon (a scalar in Moments) are separate
# branches: every one of their values meets every case and every other value (all pairs).
LN_GRID = pairwise({"case": LN_CASES, "num_outputs": [1, 2, 3], "eps": [None, 0.1], "bias": [True, False],
                    "opset": [17, 18]}, whole=["case", "num_outputs"])


def ln_case_id(c):
    (shape, axis, pshape), num_outputs, eps, bias, opset = c
    return (f"{len(shape)}d-axis{axis}-{'x'.join(map(str, pshape))}-out{num_outputs}-eps{eps}"
            f"-{'bias' if bias else 'nobias'}-{opset}")


@pytest.mark.parametrize("case,num_outputs,eps,bias,opset", LN_GRID, ids=[ln_case_id(c) for c in LN_GRID])
def test_layer_norm(case, eps, bias, num_outputs, opset, rng):
    # num_outputs 2/3: the loss also uses Mean (and InvStdDev)
    shape, axis, pshape = case
    check_ln(ln_inputs(rng, shape, pshape, bias), {"axis": axis, **eps_attr(eps)}, num_outputs, opset=opset)


@pytest.mark.parametrize("keep", [[1], [2], [1, 2], [0, 2]])
def test_layer_norm_statistics_outputs(keep, rng):
    # losses that use Mean and/or InvStdDev but not Y (Y's gradient arrives as None)
    check_ln(ln_inputs(rng, (2, 3, 4), (4,)), {"axis": 1}, 3, keep=keep, opset=17, wrt=["x"])


def test_layer_norm_default_attributes(rng):
    check_ln(ln_inputs(rng, (2, 3, 4), (4,)), {}, 3, opset=17)
    check_ln(ln_inputs(rng, (2, 3, 4), (4,)), {"stash_type": 1}, 3, opset=17)


@pytest.mark.parametrize("axis", [1, -1])
def test_layer_norm_dynamic_dims(axis, rng):
    pshape = (3, 4) if axis == 1 else (4,)
    check_ln(ln_inputs(rng, (2, 3, 4), pshape), {"axis": axis}, 3, opset=17, weights_as="inputs", dims="dynamic")
    # unknown rank: a negative axis gives static axes, a positive one a Range
    grads_without_shapes("LayerNormalization", ln_inputs(rng, (2, 3, 4), pshape), {"axis": axis},
                         opset=18, num_outputs=3, cast_outputs=[1, 2])


# ----------------------------------------------------------------------------- InstanceNormalization


def affine_inputs(rng, shape, c):
    return [("x", arr(rng, *shape)), ("s", arr(rng, c, lo=0.5, hi=1.5)), ("b", arr(rng, c))]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("eps", [None, 0.1])
@pytest.mark.parametrize("shape", [(2, 3, 4), (2, 3, 2, 3), (1, 2, 2, 2, 2)], ids=lambda s: f"rank{len(s)}")
def test_instance_norm(shape, eps, opset, rng):
    check_op("InstanceNormalization", affine_inputs(rng, shape, shape[1]), eps_attr(eps), opset=opset)


def test_instance_norm_dynamic_dims(rng):
    check_op("InstanceNormalization", affine_inputs(rng, (2, 3, 2, 2), 3), {}, opset=18,
             weights_as="inputs", dims="dynamic")
    grads_without_shapes("InstanceNormalization", affine_inputs(rng, (2, 3, 4), 3), {}, opset=18)


# ----------------------------------------------------------------------------- GroupNormalization

GN_CASES = [((2, 4, 3), 2), ((2, 4, 3), 1), ((2, 4, 3), 4), ((2, 6, 2, 2), 3), ((3, 4), 2)]
gn_id = lambda c: f"{'x'.join(map(str, c[0]))}-g{c[1]}"  # noqa: E731


@pytest.mark.parametrize("eps", [None, 0.1])
@pytest.mark.parametrize("case", GN_CASES, ids=gn_id)
def test_group_norm_21(case, eps, rng):
    # opset 21: scale and bias per channel; stash_type=11 keeps the float64 check in float64
    shape, groups = case
    attrs = {"num_groups": groups, "stash_type": 11, **eps_attr(eps)}
    check_op("GroupNormalization", affine_inputs(rng, shape, shape[1]), attrs, opset=21)


@pytest.mark.parametrize("stash_type", [None, 1])
@pytest.mark.parametrize("case", [((2, 4, 3), 2), ((2, 6, 2, 2), 3)], ids=gn_id)
def test_group_norm_21_float_stash(case, stash_type, rng):
    # stash_type=1 (the default): the forward function computes in float32 even in the float64
    # check, so the finite differences take a wider step and looser tolerances
    shape, groups = case
    attrs = {"num_groups": groups, "epsilon": 0.1}
    if stash_type is not None:
        attrs["stash_type"] = stash_type
    check_op("GroupNormalization", affine_inputs(rng, shape, shape[1]), attrs, opset=21,
             eps=1e-3, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("eps", [None, 0.1])
@pytest.mark.parametrize("case", GN_CASES, ids=gn_id)
def test_group_norm_18(case, eps, rng):
    """opset 18: scale and bias per group. onnx.checker rejects GroupNormalization-18 as
    deprecated, so the builder cannot emit such a model; the reverse walk's gradients must equal
    those of GroupNormalization-21 (checked by finite differences) with each group's scale and
    bias repeated over its channels, the per-channel scale/bias gradients summed per group."""
    from gradbuilder.testing import to_float64

    shape, groups = case
    c = shape[1]
    inputs = affine_inputs(rng, shape, groups)
    per_channel = [inputs[0]] + [(k, np.repeat(v, c // groups)) for k, v in inputs[1:]]
    expected = check_op("GroupNormalization", per_channel, {"num_groups": groups, "stash_type": 11,
                                                            **eps_attr(eps)}, opset=21).gradients
    model, weights, feeds = make_op_model("GroupNormalization", inputs, {"num_groups": groups, **eps_attr(eps)},
                                          opset=18)
    for proto, tol, runtime in ((to_float64(model), 1e-9, "reference"), (model, 1e-4, "ort")):
        got = run_grads(proto, weights, feeds, runtime=runtime)
        np.testing.assert_allclose(got["x"], expected["x"], rtol=tol * 10, atol=tol)
        for w in ("s", "b"):
            np.testing.assert_allclose(got[w], expected[w].reshape(groups, -1).sum(1), rtol=tol * 10, atol=tol)


def test_group_norm_dynamic_dims(rng):
    check_op("GroupNormalization", affine_inputs(rng, (2, 4, 3), 4), {"num_groups": 2, "stash_type": 11}, opset=21,
             weights_as="inputs", dims="dynamic")
    grads_without_shapes("GroupNormalization", affine_inputs(rng, (2, 4, 2, 2), 4),
                         {"num_groups": 2, "stash_type": 11}, opset=21)
    # opset 18, with shapes forgotten
    from gradbuilder.testing import to_float64

    inputs = affine_inputs(rng, (2, 4, 3), 2)
    model, weights, _ = make_op_model("GroupNormalization", inputs, {"num_groups": 2}, opset=18)
    known = run_grads(to_float64(model), weights)
    unknown = run_grads(to_float64(model), weights, forget_shapes=True)
    for w in weights:
        np.testing.assert_allclose(unknown[w], known[w], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- float16


def half(inputs):
    return [(k, v.astype(np.float16)) for k, v in inputs]


def test_float16(rng):
    # the float64 check runs on the float16 values; onnxruntime runs the float16 graph
    tol = dict(ort_rtol=2e-2, ort_atol=2e-2)
    check_op("BatchNormalization", half(bn_inputs(rng, (2, 3, 4))), {}, opset=15, **tol)
    check("BatchNormalization", half(bn_inputs(rng, (2, 3, 4))), {"training_mode": 1}, keep=[0], num_outputs=3,
          opset=15, wrt=["x", "s", "b"])
    check_op("InstanceNormalization", half(affine_inputs(rng, (2, 3, 4), 3)), {}, opset=18, **tol)
    check_op("GroupNormalization", half(affine_inputs(rng, (2, 4, 3), 4)), {"num_groups": 2, "epsilon": 0.1},
             opset=21, eps=1e-3, rtol=1e-2, atol=1e-3, **tol)
    model, weights, feeds = op_model("LayerNormalization", half(ln_inputs(rng, (2, 3, 4), (4,))), {"axis": 1},
                                     num_outputs=3, cast_outputs=[1, 2], cast_to=onnx.TensorProto.FLOAT16,
                                     opset=17)
    expected = check_model(model, weights, feeds, ort=False).gradients
    got = ort_grads(model, weights, feeds)
    for w in weights:
        np.testing.assert_allclose(got[w].astype(np.float64), expected[w], rtol=2e-2, atol=2e-2)
