"""ai.onnx.ml rules.

Each model is one ml node whose float outputs are cast to float (to double in gradcheck's
float64 copy: several ml ops declare a float output whatever the input type, while onnx's
reference evaluator keeps the input's precision) and projected into a scalar loss.
``check_ref`` compares with float64 finite differences on onnx's reference evaluator and runs
the float32 gradient graph on onnxruntime; ``check_ort`` takes the finite differences on
onnxruntime itself (float32, larger step), for the forms where the reference evaluator
computes something else than onnxruntime (1-D inputs, post transforms of LinearRegressor,
binary LinearClassifier, Normalizer MAX of a row whose largest magnitude is negative).
"""

import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.errors import GradientRuleError
from gradbuilder.testing import check_model, numeric_gradient, ort_grad_session, ort_session

ML = "ai.onnx.ml"
f32 = np.float32


def ml_model(op, inputs, attrs=None, *, ml_opset=1, opset=17, weights_as="initializers", dims="static",
             graph_ints=(), seed=3):
    """(model, weights, feeds): one ``op`` node; float inputs are the weights (initializers or
    graph inputs with static or unknown dims), integer inputs constants or, when named in
    ``graph_ints``, graph inputs of unknown shape. Outputs of a float type (learnt by running
    the node on onnxruntime) are projected into the loss."""
    rng = np.random.default_rng(seed)
    node = helper.make_node(op, [n for n, _ in inputs], ["y0", "y1"][: _n_outputs(op)], domain=ML, **dict(attrs or {}))
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(ML, ml_opset)]
    graph_inputs, inits, feeds, weights = [], [], {}, []
    for name, arr in inputs:
        if arr.dtype.kind == "f":
            weights.append(name)
        as_input = (arr.dtype.kind == "f" and weights_as == "inputs") or name in graph_ints
        if as_input:
            shape = list(arr.shape) if dims == "static" and name not in graph_ints else [None] * arr.ndim
            dtype = TensorProto.FLOAT if arr.dtype.kind == "f" else TensorProto.INT64
            graph_inputs.append(helper.make_tensor_value_info(name, dtype, shape))
            feeds[name] = arr
        else:
            inits.append(numpy_helper.from_array(arr, name))
    outs = list(node.output)
    probe = helper.make_model(
        helper.make_graph([node], "probe", graph_inputs, [helper.make_empty_tensor_value_info(o) for o in outs], inits),
        opset_imports=opsets)
    probe.ir_version = 10
    values = ort_session(probe).run(None, feeds)
    nodes, terms = [node], []
    for o, v in zip(outs, values):
        if v.dtype.kind != "f":
            continue
        inits.append(numpy_helper.from_array(rng.standard_normal(v.shape).astype(f32), f"{o}_proj"))
        nodes += [helper.make_node("Cast", [o], [f"{o}_f"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", [f"{o}_f", f"{o}_proj"], [f"{o}_m"]),
                  helper.make_node("ReduceSum", [f"{o}_m"], [f"{o}_s"], keepdims=0)]
        terms.append(f"{o}_s")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    loss = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    model = helper.make_model(helper.make_graph(nodes, op.lower(), graph_inputs, [loss], inits), opset_imports=opsets)
    model.ir_version = 10
    return model, weights, feeds


def _n_outputs(op):
    return 2 if op in ("LinearClassifier", "TreeEnsembleClassifier") else 1


def check_ref(op, inputs, attrs=None, **kw):
    check_model(*ml_model(op, inputs, attrs, **kw))


def check_ort(op, inputs, attrs=None, eps=1e-2, **kw):
    """The float32 gradient graph on onnxruntime against onnxruntime's own finite differences
    (central, step ``eps``)."""
    model, weights, feeds = ml_model(op, inputs, attrs, **kw)
    sess, got = ort_grad_session(model, weights, feeds)
    values = {**feeds}
    for t in model.graph.initializer:
        if t.name in weights:
            values[t.name] = numpy_helper.to_array(t)
    for w in weights:
        base = values[w].astype(np.float64)
        num = np.zeros_like(base)
        for i in range(base.size):
            loss = []
            for step in (eps, -eps):
                moved = base.copy()
                moved.reshape(-1)[i] += step
                loss.append(float(sess.run(["loss"], {**values, w: moved.astype(f32)})[0]))
            num.reshape(-1)[i] = (loss[0] - loss[1]) / (2 * eps)
        np.testing.assert_allclose(got[f"{w}_grad"], num, rtol=2e-3, atol=2e-3)


def grads_on_ort(op, inputs, attrs=None, **kw):
    model, weights, feeds = ml_model(op, inputs, attrs, **kw)
    _, got = ort_grad_session(model, weights, feeds)
    projection = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith("_proj")}
    return got, projection


# ----------------------------------------------------------------------------- piecewise constant


@pytest.mark.parametrize("threshold", [None, 0.5])
def test_binarizer(rng, threshold):
    x = rng.uniform(-1, 1, (3, 4)).astype(f32)
    x[np.abs(x - (threshold or 0.0)) < 0.05] += 0.1
    check_ref("Binarizer", [("x", x)], {} if threshold is None else {"threshold": threshold})


TREE = dict(nodes_treeids=[0, 0, 0, 1, 1, 1], nodes_nodeids=[0, 1, 2, 0, 1, 2], nodes_featureids=[0, 0, 0, 1, 0, 0],
            nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF", "BRANCH_GT", "LEAF", "LEAF"],
            nodes_values=[0.1, 0, 0, -0.3, 0, 0], nodes_truenodeids=[1, 0, 0, 1, 0, 0],
            nodes_falsenodeids=[2, 0, 0, 2, 0, 0])


def tree_input(rng):
    x = rng.uniform(-1, 1, (4, 2)).astype(f32)
    x[:, 0] = [-0.8, -0.2, 0.4, 0.9]
    x[:, 1] = [0.5, -0.9, -0.1, 0.7]
    return x


@pytest.mark.parametrize("ml_opset", [1, 3])
@pytest.mark.parametrize("post_transform", ["NONE", "LOGISTIC"])
def test_tree_ensemble_regressor(rng, ml_opset, post_transform):
    attrs = dict(TREE, n_targets=2, target_treeids=[0, 0, 1, 1], target_nodeids=[1, 2, 1, 2], target_ids=[0, 1, 1, 0],
                 target_weights=[1.5, -2.0, 0.5, 3.0], aggregate_function="SUM", post_transform=post_transform)
    check = check_ref if post_transform == "NONE" else check_ort  # the reference implements NONE only
    check("TreeEnsembleRegressor", [("x", tree_input(rng))], attrs, ml_opset=ml_opset)


def test_tree_ensemble_classifier(rng):
    attrs = dict(TREE, class_treeids=[0, 0, 1, 1], class_nodeids=[1, 2, 1, 2], class_ids=[0, 1, 1, 0],
                 class_weights=[0.7, 0.4, 0.2, 0.9], classlabels_int64s=[3, 5], post_transform="SOFTMAX")
    check_ref("TreeEnsembleClassifier", [("x", tree_input(rng))], attrs, ml_opset=3)


def test_tree_ensemble(rng):
    attrs = dict(aggregate_function=1, n_targets=2, post_transform=0, tree_roots=[0],
                 nodes_featureids=[0, 1], nodes_modes=numpy_helper.from_array(np.array([0, 3], np.uint8)),
                 nodes_splits=numpy_helper.from_array(np.array([0.1, -0.3], f32)),
                 nodes_truenodeids=[0, 0], nodes_trueleafs=[1, 1], nodes_falsenodeids=[1, 1], nodes_falseleafs=[0, 1],
                 leaf_targetids=[0, 1, 0], leaf_weights=numpy_helper.from_array(np.array([1.0, 2.0, 3.0], f32)))
    check_ref("TreeEnsemble", [("x", tree_input(rng))], attrs, ml_opset=5)


def test_one_hot_encoder_and_label_encoder(rng):
    x = np.array([[1.0, 2.0], [3.0, 1.0]], f32)
    check_ref("OneHotEncoder", [("x", x)], {"cats_int64s": [1, 2, 3], "zeros": 1})
    keys = numpy_helper.from_array(np.array([1.0, 2.0], f32))
    values = numpy_helper.from_array(np.array([5.0, -6.0], f32))
    default = numpy_helper.from_array(np.array([-1.0], f32))
    check_ref("LabelEncoder", [("x", x)], {"keys_tensor": keys, "values_tensor": values, "default_tensor": default},
              ml_opset=4)


# ----------------------------------------------------------------------------- ArrayFeatureExtractor


@pytest.mark.parametrize("shape,idx", [
    ((3, 5), np.array([0, 2, 2, 4])),          # repeated index: its gradients add up
    ((3, 5), np.array([[4, 1, 1]])),
    ((3, 5), np.array([[3, 0], [2, 3]])),
    ((5,), np.array([1, 3, 3])),
    ((2, 3, 4), np.array([3, 0])),
])
def test_array_feature_extractor(rng, shape, idx):
    check_ref("ArrayFeatureExtractor", [("x", rng.standard_normal(shape).astype(f32)), ("i", idx)])


def test_array_feature_extractor_indices_at_run_time(rng):
    x = rng.standard_normal((3, 5)).astype(f32)
    check_ref("ArrayFeatureExtractor", [("x", x), ("i", np.array([[4, 1, 1]]))], graph_ints=["i"],
              weights_as="inputs", dims="dynamic")


def test_array_feature_extractor_negative_indices(rng):
    """onnxruntime rejects negative indices; the reference evaluator counts them from the end."""
    from gradbuilder.testing import gradcheck

    for graph_ints in ((), ("i",)):
        model, weights, feeds = ml_model("ArrayFeatureExtractor", [("x", rng.standard_normal((3, 4)).astype(f32)),
                                                                  ("i", np.array([1, 2]))], graph_ints=graph_ints)
        for t in model.graph.initializer:
            if t.name == "i":
                t.CopyFrom(numpy_helper.from_array(np.array([-1, 2, -4]), "i"))
        feeds = {**feeds, "i": np.array([-1, 2, -4])} if graph_ints else feeds
        proj = next(t for t in model.graph.initializer if t.name == "y0_proj")
        proj.CopyFrom(numpy_helper.from_array(rng.standard_normal((3, 3)).astype(f32), "y0_proj"))
        report = gradcheck(model, weights, "loss", feeds)
        assert report.passed, str(report)


# ----------------------------------------------------------------------------- element-wise


@pytest.mark.parametrize("attrs", [
    {"scale": [2.0, -0.5, 3.0], "offset": [0.1, 0.2, -0.3]},
    {"scale": [1.5], "offset": [0.25]},
])
def test_scaler(rng, attrs):
    check_ref("Scaler", [("x", rng.standard_normal((4, 3)).astype(f32))], attrs)


def test_scaler_dynamic_and_1d(rng):
    attrs = {"scale": [2.0, -0.5, 3.0], "offset": [0.1, 0.2, -0.3]}
    check_ref("Scaler", [("x", rng.standard_normal((4, 3)).astype(f32))], attrs, weights_as="inputs", dims="dynamic")
    check_ref("Scaler", [("x", rng.standard_normal(3).astype(f32))], attrs)


@pytest.mark.parametrize("replaced", [0.0, -1.0])
@pytest.mark.parametrize("imputed", [[7.0], [7.0, 8.0, 9.0]])
def test_imputer_nothing_replaced(rng, replaced, imputed):
    x = rng.uniform(0.5, 2.0, (4, 3)).astype(f32)
    check_ref("Imputer", [("x", x)], {"replaced_value_float": replaced, "imputed_value_floats": imputed})


@pytest.mark.parametrize("replaced", [-1.0, math.nan])
def test_imputer_replaced_elements_get_zero(replaced):
    x = np.array([[1.0, -1.0, 2.0], [np.nan, 3.0, -1.0]], f32)
    attrs = {"replaced_value_float": replaced, "imputed_value_floats": [7.0, 8.0, 9.0]}
    got, proj = grads_on_ort("Imputer", [("x", x)], attrs)
    hit = np.isnan(x) if math.isnan(replaced) else x == replaced
    np.testing.assert_allclose(got["x_grad"], np.where(hit, 0.0, proj["y0_proj"]), rtol=1e-6)
    assert hit.any()


# ----------------------------------------------------------------------------- Normalizer


def normalizer_rows(rng):
    """Rows whose largest value is also their largest magnitude (the reference evaluator
    divides by the latter, onnxruntime by the former); no ties."""
    x = rng.uniform(-1, 1, (3, 4)).astype(f32)
    x[:, 0] = [2.0, 1.5, 3.0]
    return x


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
def test_normalizer(rng, norm, opset):
    check_ref("Normalizer", [("x", normalizer_rows(rng))], {"norm": norm}, opset=opset)


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
def test_normalizer_dynamic(rng, norm):
    check_ref("Normalizer", [("x", normalizer_rows(rng))], {"norm": norm}, weights_as="inputs", dims="dynamic",
              opset=18)


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
def test_normalizer_onnxruntime_forms(rng, norm):
    """A 1-D input, and a MAX row whose largest magnitude is a negative value."""
    check_ort("Normalizer", [("x", np.array([0.5, -0.25, 1.5, 0.75], f32))], {"norm": norm}, eps=1e-3)
    check_ort("Normalizer", [("x", np.array([[-3.0, 0.5, 1.0], [0.2, 0.7, -0.4]], f32))], {"norm": norm}, eps=1e-3)


def test_normalizer_zero_row_copies_the_gradient():
    x = np.array([[0.0, 0.0, 0.0], [1.0, 2.0, -0.5]], f32)
    for norm in ("L1", "L2"):
        got, proj = grads_on_ort("Normalizer", [("x", x)], {"norm": norm})
        np.testing.assert_allclose(got["x_grad"][0], proj["y0_proj"][0], rtol=1e-6)
        assert np.all(np.isfinite(got["x_grad"]))


# ----------------------------------------------------------------------------- FeatureVectorizer


@pytest.mark.parametrize("widths", [[2, 1, 3], [1, 2, 4], [3, 1, 2]])
def test_feature_vectorizer(rng, widths):
    """Inputs of 2, 1 and 3 columns cut or zero-padded to ``widths``."""
    ins = [("a", rng.standard_normal((3, 2)).astype(f32)), ("k", rng.standard_normal((3, 1)).astype(f32)),
           ("b", rng.standard_normal((3, 3)).astype(f32))]
    check_ref("FeatureVectorizer", ins, {"inputdimensions": widths})


@pytest.mark.parametrize("widths", [[1, 4], [3, 2]])
def test_feature_vectorizer_dynamic(rng, widths):
    ins = [("a", rng.standard_normal((3, 2)).astype(f32)), ("b", rng.standard_normal((3, 3)).astype(f32))]
    check_ref("FeatureVectorizer", ins, {"inputdimensions": widths}, weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_feature_vectorizer_onnxruntime_forms(rng, dims):
    """A 3-D input (flattened after axis 0) and a 1-D one (one row)."""
    ins = [("a", rng.standard_normal((3, 2, 2)).astype(f32)), ("b", rng.standard_normal((3, 3)).astype(f32))]
    check_ort("FeatureVectorizer", ins, {"inputdimensions": [3, 5]}, weights_as="inputs", dims=dims)
    ins = [("a", rng.standard_normal(4).astype(f32)), ("b", rng.standard_normal((1, 3)).astype(f32))]
    check_ort("FeatureVectorizer", ins, {"inputdimensions": [2, 4]}, weights_as="inputs", dims=dims)


# ----------------------------------------------------------------------------- linear models


COEF = [0.3, -0.2, 0.5, 0.1, 0.4, -0.3, -0.1, 0.2, 0.25, 0.15, -0.35, 0.05]  # 3 classes x 4 features


@pytest.mark.parametrize("targets,intercepts", [(1, [0.5]), (3, [0.1, -0.2, 0.3]), (2, None)])
def test_linear_regressor(rng, targets, intercepts):
    attrs = {"coefficients": COEF[: targets * 4], "targets": targets}
    if intercepts:
        attrs["intercepts"] = intercepts
    # Without intercepts the reference evaluator adds NaN; onnxruntime adds nothing.
    check = check_ref if intercepts else check_ort
    check("LinearRegressor", [("x", rng.standard_normal((3, 4)).astype(f32))], attrs)


def test_linear_regressor_dynamic(rng):
    attrs = {"coefficients": COEF[:8], "targets": 2, "intercepts": [0.1, 0.2]}
    check_ref("LinearRegressor", [("x", rng.standard_normal((3, 4)).astype(f32))], attrs,
              weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("transform", ["LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT"])
@pytest.mark.parametrize("targets", [1, 3])
def test_linear_regressor_post_transform(rng, transform, targets):
    """onnxruntime applies the transform (with one target, PROBIT only); the reference
    evaluator implements NONE only."""
    coef = [c * 0.5 for c in COEF[: targets * 4]]
    attrs = {"coefficients": coef, "targets": targets, "intercepts": [0.5, 0.45, 0.55][:targets],
             "post_transform": transform}
    x = rng.uniform(-0.5, 0.5, (3, 4)).astype(f32)
    check_ort("LinearRegressor", [("x", x)], attrs)
    check_ort("LinearRegressor", [("x", x[0])], attrs, weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT"])
@pytest.mark.parametrize("labels", [{"classlabels_ints": [4, 5, 6]}, {"classlabels_strings": ["a", "b", "c"]}])
def test_linear_classifier(rng, transform, labels):
    attrs = {"coefficients": [c * 0.5 for c in COEF], "intercepts": [0.5, 0.45, 0.55], "post_transform": transform,
             **labels}
    opset = 13 if "classlabels_ints" in labels else 18
    check_ref("LinearClassifier", [("x", rng.uniform(-0.5, 0.5, (3, 4)).astype(f32))], attrs, opset=opset)


@pytest.mark.parametrize("transform", ["NONE", "SOFTMAX", "PROBIT"])
def test_linear_classifier_dynamic(rng, transform):
    attrs = {"coefficients": [c * 0.5 for c in COEF], "intercepts": [0.5, 0.45, 0.55], "post_transform": transform,
             "classlabels_ints": [4, 5, 6]}
    check_ref("LinearClassifier", [("x", rng.uniform(-0.5, 0.5, (3, 4)).astype(f32))], attrs,
              weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
@pytest.mark.parametrize("labels", [{"classlabels_ints": [0, 1]}, {"classlabels_strings": ["no", "yes"]}])
def test_linear_classifier_binary(rng, transform, labels):
    """One score column and two labels: onnxruntime writes [1 - s, s] ([sigmoid(-s),
    sigmoid(s)] for LOGISTIC)."""
    attrs = {"coefficients": COEF[:4], "intercepts": [0.2], "post_transform": transform, **labels}
    x = rng.uniform(-1, 1, (3, 4)).astype(f32)
    check_ort("LinearClassifier", [("x", x)], attrs)
    check_ort("LinearClassifier", [("x", x[1])], attrs, weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "PROBIT"])
def test_linear_classifier_one_column(rng, transform):
    """One score column, no labels: onnxruntime transforms it with PROBIT only."""
    attrs = {"coefficients": [c * 0.5 for c in COEF[:4]], "intercepts": [0.5], "post_transform": transform}
    check_ort("LinearClassifier", [("x", rng.uniform(-0.5, 0.5, (3, 4)).astype(f32))], attrs)


def test_linear_classifier_binary_probit_is_refused(rng):
    attrs = {"coefficients": COEF[:4], "intercepts": [0.2], "post_transform": "PROBIT", "classlabels_ints": [0, 1]}
    model, weights, _ = ml_model("LinearClassifier", [("x", rng.uniform(-0.5, 0.5, (3, 4)).astype(f32))], attrs)
    with pytest.raises(GradientRuleError, match="PROBIT"):
        GradientGraphBuilder(model, weights, ["loss"], "loss").build()


def test_linear_classifier_softmax_zero_band(rng):
    """SOFTMAX_ZERO gives a score within 1e-7 of zero the value s/T instead of exp(s)/T, T the
    sum of exp over the other scores (onnxruntime's ComputeSoftmaxZero; onnx's reference adds
    the s values into T as well). A zero row with a zero intercept puts class 1 there; the
    gradient computed on onnxruntime is compared with float64 finite differences of that
    function written in numpy, with a step small enough to stay inside the band."""
    x = rng.uniform(-0.5, 0.5, (3, 4)).astype(f32)
    x[1] = 0.0
    coef = np.array([c * 0.5 for c in COEF], f32)
    intercepts = np.array([0.5, 0.0, 0.55], f32)
    attrs = {"coefficients": coef.tolist(), "intercepts": intercepts.tolist(), "post_transform": "SOFTMAX_ZERO",
             "classlabels_ints": [4, 5, 6]}
    got, proj = grads_on_ort("LinearClassifier", [("x", x)], attrs)

    def softmax_zero(s):
        kept = np.abs(s) > 1e-7
        e = np.where(kept, np.exp(s - s.max(axis=1, keepdims=True)), s * np.exp(-s.max(axis=1, keepdims=True)))
        return e / np.sum(np.where(kept, e, 0.0), axis=1, keepdims=True)

    w, b, p = coef.astype(np.float64).reshape(3, 4), intercepts.astype(np.float64), proj["y1_proj"].astype(np.float64)
    base = x.astype(np.float64)
    num = numeric_gradient(lambda v: float(np.sum(p * softmax_zero(v @ w.T + b))), base, 1e-9)
    np.testing.assert_allclose(got["x_grad"], num, rtol=1e-4, atol=1e-5)


def test_linear_classifier_probit_at_one_half(rng):
    """A score of exactly 0.5 gives Z = 0, where the slope formula is 0/0: its limit
    sqrt(2 pi) is used. (A larger step: the runtimes' erfinv cancels digits near 0.)"""
    from gradbuilder.testing import gradcheck

    x = rng.uniform(-0.5, 0.5, (3, 4)).astype(f32)
    x[1] = 0.0
    attrs = {"coefficients": [c * 0.5 for c in COEF], "intercepts": [0.5, 0.45, 0.5], "post_transform": "PROBIT",
             "classlabels_ints": [4, 5, 6]}
    model, weights, feeds = ml_model("LinearClassifier", [("x", x)], attrs)
    report = gradcheck(model, weights, "loss", feeds, eps=1e-4)
    assert report.passed, str(report)
    _, got = ort_grad_session(model, weights, feeds)
    np.testing.assert_allclose(got["x_grad"], report.gradients["x"], rtol=2e-3, atol=2e-4)
