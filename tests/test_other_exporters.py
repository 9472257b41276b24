"""Models from exporters other than PyTorch's, built with onnx.helper as they write them:

- paddle2onnx and spox keep every weight in a Constant node and write no initializer;
- paddle2onnx declares a dynamic axis as ``dim_value: -1`` (some exporters write 0);
- skl2onnx keeps a linear model's parameters in attributes of ai.onnx.ml operators
  (LinearClassifier), and its classifiers output Softmax probabilities.

References are torch autograd and torch.optim.SGD on the same numbers (float64).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.numpy import load_file
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientGraphBuilder, TrainingParameters
from gradbuilder.cli import main
from gradbuilder.compiler import modelio
from gradbuilder.errors import InvalidArgumentError
from gradbuilder.runtime.session import TrainingSession
from gradbuilder.training.artifacts import export_model_for_inferencing, generate_artifacts
from gradbuilder.training.loss import append_loss

from .helpers import make_model, vi

CPU = ["CPUExecutionProvider"]
FEATURES, CLASSES = 4, 3
RNG = np.random.default_rng(7)
W0 = RNG.standard_normal((FEATURES, CLASSES)).astype(np.float32)
B0 = RNG.standard_normal(CLASSES).astype(np.float32)
SCALE = 0.5


def batch(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, FEATURES)).astype(np.float32),
            rng.standard_normal((n, CLASSES)).astype(np.float32))


# ------------------------------------------------------------------ weights in Constant nodes


def constant_weights_model() -> onnx.ModelProto:
    """loss = mean(((x @ W + B) * scale - y)^2), every tensor a Constant node as paddle2onnx and
    spox write them: W as a ``value`` tensor, B as ``value_floats``, the scalar scale as
    ``value_float``; no initializers."""
    nodes = [
        helper.make_node("Constant", [], ["W"], name="W_const", value=numpy_helper.from_array(W0, "W_value")),
        helper.make_node("Constant", [], ["B"], name="B_const", value_floats=B0.tolist()),
        helper.make_node("Constant", [], ["scale"], name="scale_const", value_float=SCALE),
        helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"),
        helper.make_node("Add", ["xw", "B"], ["z"], name="add"),
        helper.make_node("Mul", ["z", "scale"], ["out"], name="mul"),
        helper.make_node("Sub", ["out", "y"], ["diff"], name="sub"),
        helper.make_node("Mul", ["diff", "diff"], ["sq"], name="square"),
        helper.make_node("ReduceMean", ["sq"], ["loss"], name="mean", keepdims=0),
    ]
    return make_model(nodes, [vi("x", ["N", FEATURES]), vi("y", ["N", CLASSES])],
                      [vi("loss", []), vi("out", ["N", CLASSES])])


def torch_loss(x, y, w, b, s):
    out = (torch.from_numpy(x).double() @ w + b) * s
    return ((out - torch.from_numpy(y).double()) ** 2).mean()


def leaf(a) -> torch.Tensor:
    return torch.tensor(np.asarray(a, np.float64), requires_grad=True)


def test_constant_weights_have_gradients_and_other_constants_stay():
    x, y = batch(5)
    b = GradientGraphBuilder(constant_weights_model(), weights=["W", "B", "scale"], outputs=["loss"],
                             loss="loss").build()
    built = b.model_proto
    assert {"W", "B", "scale"} <= {i.name for i in built.graph.input}
    got = dict(zip(["loss", "W_grad", "B_grad", "scale_grad"],
                   ort.InferenceSession(built.SerializeToString(), providers=CPU).run(None, {"x": x, "y": y})))
    w, bias, s = leaf(W0), leaf(B0), leaf(SCALE)
    loss = torch_loss(x, y, w, bias, s)
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    for name, ref in (("W_grad", w), ("B_grad", bias), ("scale_grad", s)):
        assert got[name].shape == ref.shape
        np.testing.assert_allclose(got[name], ref.grad.numpy(), rtol=1e-4, atol=1e-6)

    only_w = GradientGraphBuilder(constant_weights_model(), weights=["W"], outputs=["loss"], loss="loss").build()
    graph = only_w.model_proto.graph
    constants = {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    assert {"B", "scale"} <= constants  # not chosen: still Constant nodes
    assert not {"B", "scale"} & ({t.name for t in graph.initializer} | {i.name for i in graph.input})


def sgd_session() -> TrainingSession:
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="sgd", enable_grad_norm_clip=False)
    s = TrainingSession(constant_weights_model().SerializeToString(), params, providers=CPU)
    s.set_learning_rate(0.1)
    return s


def test_session_trains_constant_weights_like_torch_sgd(tmp_path):
    s = sgd_session()
    assert sorted(s.weights) == ["B", "W"]  # the default: the Constant tensors; the scalar scale is not one
    w, bias = leaf(W0), leaf(B0)
    opt = torch.optim.SGD([w, bias], lr=0.1)
    losses = []
    for step in range(6):
        x, y = batch(8, seed=step)
        losses.append(float(s.run(["loss"], {"x": x, "y": y})[0]))
        opt.zero_grad()
        loss = torch_loss(x, y, w, bias, SCALE)
        loss.backward()
        opt.step()
        np.testing.assert_allclose(losses[-1], loss.item(), rtol=1e-5)
        trained = s.get_state()["model"]["full_precision"]
        np.testing.assert_allclose(trained["W"], w.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(trained["B"], bias.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]

    s.export_model_for_inferencing(tmp_path / "inference.onnx", ["out"])
    exported = onnx.load(tmp_path / "inference.onnx")
    inits = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    np.testing.assert_array_equal(inits["W"], trained["W"])
    np.testing.assert_array_equal(inits["B"], trained["B"])
    assert "scale" in {o for n in exported.graph.node if n.op_type == "Constant" for o in n.output}
    x, _ = batch(3, seed=99)
    out, = ort.InferenceSession(str(tmp_path / "inference.onnx"), providers=CPU).run(["out"], {"x": x})
    np.testing.assert_allclose(out, (x @ trained["W"] + trained["B"]) * SCALE, rtol=1e-5, atol=1e-6)

    s.save_checkpoint(tmp_path / "ckpt")
    resumed = sgd_session()
    resumed.load_checkpoint(tmp_path / "ckpt")
    for name in ("W", "B"):
        np.testing.assert_array_equal(resumed.get_state()["model"]["full_precision"][name], trained[name])
    x, y = batch(8, seed=42)
    np.testing.assert_array_equal(resumed.run(["loss"], {"x": x, "y": y})[0], s.run(["loss"], {"x": x, "y": y})[0])


def test_artifacts_and_inference_export_take_constant_weights(tmp_path):
    written = generate_artifacts(constant_weights_model(), requires_grad=["W", "B"], optimizer="sgd",
                                 artifact_directory=tmp_path)
    ckpt = load_file(written["checkpoint.safetensors"])
    np.testing.assert_array_equal(ckpt["W"], W0)
    np.testing.assert_array_equal(ckpt["B"], B0)
    x, y = batch(4)
    names = [o.name for o in onnx.load(written["training_model.onnx"]).graph.output]
    got = dict(zip(names, ort.InferenceSession(written["training_model.onnx"], providers=CPU).run(
        None, {"x": x, "y": y, "W": W0, "B": B0})))
    w, bias = leaf(W0), leaf(B0)
    torch_loss(x, y, w, bias, SCALE).backward()
    np.testing.assert_allclose(got["W_grad"], w.grad.numpy(), rtol=1e-4, atol=1e-6)

    new_w = W0 + 1
    export_model_for_inferencing(constant_weights_model(), tmp_path / "inference.onnx", ["out"], weights={"W": new_w})
    out, = ort.InferenceSession(str(tmp_path / "inference.onnx"), providers=CPU).run(["out"], {"x": x})
    np.testing.assert_allclose(out, (x @ new_w + B0) * SCALE, rtol=1e-5, atol=1e-6)


def test_cli_trains_constant_weights_by_default(tmp_path, capsys):
    onnx.save(constant_weights_model(), tmp_path / "model.onnx")
    x, y = batch(64)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    status = main(["train", str(tmp_path / "model.onnx"), "--data", str(tmp_path / "data.npz"), "--steps", "20",
                   "--batch-size", "16", "--optimizer", "sgd", "--lr", "0.1", "-o", str(tmp_path / "out.onnx")])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert ": 2 weights (15 values)" in captured.err
    first, last = (float(v) for v in captured.out.split("loss ")[1].split(" after")[0].split(" -> "))
    assert last < first
    trained = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "out.onnx").graph.initializer}
    assert set(trained) == {"W", "B"} and not np.allclose(trained["W"], W0)


# ------------------------------------------------------------------ dims declared -1 or 0


def dynamic_batch_model(dim: int) -> onnx.ModelProto:
    """A Linear + Softmax classifier whose batch axis is declared ``dim`` (-1 as paddle2onnx, or
    0) on the inputs, the outputs and a value_info; loss = -mean(y * log p). The bias reaches
    the logits through an empty initializer (a real 0-size axis, kept as it is)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Concat", ["B", "E"], ["bias"], axis=0),
        helper.make_node("Add", ["xw", "bias"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["p"], axis=-1),
        helper.make_node("Log", ["p"], ["logp"]),
        helper.make_node("Mul", ["logp", "y"], ["ylogp"]),
        helper.make_node("ReduceMean", ["ylogp"], ["mean"], keepdims=0),
        helper.make_node("Neg", ["mean"], ["loss"]),
    ]
    inits = [numpy_helper.from_array(W0, "W"), numpy_helper.from_array(B0, "B"),
             numpy_helper.from_array(np.zeros(0, np.float32), "E")]
    model = make_model(nodes, [vi("x", [dim, FEATURES]), vi("y", [dim, CLASSES])],
                       [vi("loss", []), vi("p", [dim, CLASSES])], inits)
    model.graph.value_info.append(vi("logits", [dim, CLASSES]))
    return model


@pytest.mark.parametrize("dim", [-1, 0])
def test_declared_dims_of_minus_one_and_zero_are_dynamic(dim):
    b = GradientGraphBuilder(dynamic_batch_model(dim), weights=["W", "B"], outputs=["loss", "p"], loss="loss").build()
    sess = ort.InferenceSession(b.get_model(), providers=CPU)
    for n in (3, 5):
        x, _ = batch(n, seed=n)
        y = np.eye(CLASSES, dtype=np.float32)[np.arange(n) % CLASSES]
        loss, p, w_grad, b_grad = sess.run(None, {"x": x, "y": y})
        w, bias = leaf(W0), leaf(B0)
        probs = torch.softmax(torch.from_numpy(x).double() @ w + bias, -1)
        ref = -(torch.from_numpy(y).double() * torch.log(probs)).mean()
        ref.backward()
        np.testing.assert_allclose(loss, ref.item(), rtol=1e-5)
        np.testing.assert_allclose(p, probs.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(w_grad, w.grad.numpy(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(b_grad, bias.grad.numpy(), rtol=1e-4, atol=1e-6)

    loaded = modelio.load_proto(dynamic_batch_model(dim))
    batched = [v for v in [*loaded.graph.input, *loaded.graph.output, *loaded.graph.value_info] if v.name != "loss"]
    assert [v.name for v in batched] == ["x", "y", "p", "logits"]
    for v in batched:
        assert not v.type.tensor_type.shape.dim[0].HasField("dim_value"), v.name
    assert [list(t.dims) for t in loaded.graph.initializer if t.name == "E"] == [[0]]


# ------------------------------------------------------------------ nothing to train


def linear_classifier_model() -> onnx.ModelProto:
    """What skl2onnx writes for a LogisticRegression (zipmap=False): the coefficients are
    attributes of an ai.onnx.ml LinearClassifier; no initializer."""
    nodes = [
        helper.make_node("LinearClassifier", ["X"], ["label", "probability_tensor"], name="LinearClassifier",
                         domain="ai.onnx.ml", coefficients=W0.T.ravel().tolist(), intercepts=B0.tolist(),
                         classlabels_ints=list(range(CLASSES)), multi_class=1, post_transform="SOFTMAX"),
        helper.make_node("Normalizer", ["probability_tensor"], ["probabilities"], name="Normalizer",
                         domain="ai.onnx.ml", norm="L1"),
    ]
    return make_model(nodes, [vi("X", [None, FEATURES])],
                      [vi("label", [None], TensorProto.INT64), vi("probabilities", [None, CLASSES])],
                      domains=["ai.onnx.ml"])


def test_nothing_to_train_says_where_the_parameters_are(tmp_path, capsys):
    with pytest.raises(InvalidArgumentError, match=r"weights is empty: .*ai.onnx.ml operators \(LinearClassifier "
                                                   r"'LinearClassifier'\).*float initializers"):
        GradientGraphBuilder(linear_classifier_model(), weights=[], loss="probabilities").build()
    params = TrainingParameters(loss_output_name="probabilities", training_optimizer_name="sgd")
    with pytest.raises(InvalidArgumentError, match=r"no weights to train: .*LinearClassifier 'LinearClassifier'"):
        TrainingSession(linear_classifier_model().SerializeToString(), params, providers=CPU)

    onnx.save(linear_classifier_model(), tmp_path / "skl.onnx")
    np.savez(tmp_path / "data.npz", X=batch(8)[0])
    assert main(["train", str(tmp_path / "skl.onnx"), "--data", str(tmp_path / "data.npz"), "--steps", "1",
                 "--batch-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "0 weights" not in err
    assert "no weights to train: the model has no float initializer or Constant node: its parameters are " \
           "attributes of ai.onnx.ml operators (LinearClassifier 'LinearClassifier')" in err
    assert main(["build", str(tmp_path / "skl.onnx"), "--loss", "probabilities", "-o", str(tmp_path / "g.onnx")]) == 2
    assert "weights is empty: the model has no float initializer or Constant node" in capsys.readouterr().err


def test_empty_weights_names_what_the_model_has():
    with pytest.raises(InvalidArgumentError, match="weights is empty: name at least one of the model's float "
                                                   "initializers and Constant outputs: W, B"):
        GradientGraphBuilder(constant_weights_model(), weights=[], loss="loss").build()


# ------------------------------------------------------------------ nll on probabilities


def classifier_model(last: str) -> onnx.ModelProto:
    """logits = x @ W + B, then ``last`` (Softmax or LogSoftmax), then Identity and Cast as
    skl2onnx's MLPClassifier writes its "probabilities"."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "B"], ["logits"]),
        helper.make_node(last, ["logits"], ["scores"], name="last", axis=-1),
        helper.make_node("Identity", ["scores"], ["same"]),
        helper.make_node("Cast", ["same"], ["probabilities"], to=TensorProto.FLOAT),
    ]
    inits = [numpy_helper.from_array(W0, "W"), numpy_helper.from_array(B0, "B")]
    return make_model(nodes, [vi("x", ["N", FEATURES])], [vi("probabilities", ["N", CLASSES])], inits)


def test_nll_on_softmax_probabilities_warns():
    with pytest.warns(UserWarning, match=r"loss 'nll' expects log-probabilities .* output 'probabilities' holds "
                                         r"the probabilities of Softmax node 'last'.* Use loss 'crossentropy' on "
                                         r"the Softmax's input 'logits'"):
        append_loss(classifier_model("Softmax"), "nll", "probabilities")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with_loss = append_loss(classifier_model("LogSoftmax"), "nll", "probabilities")
        assert with_loss.graph.output[-1].name == "loss"
        append_loss(classifier_model("Softmax"), "crossentropy", "logits")


def test_cli_nll_on_softmax_probabilities_warns(tmp_path, capsys):
    onnx.save(classifier_model("Softmax"), tmp_path / "model.onnx")
    np.savez(tmp_path / "data.npz", x=batch(8)[0], target=np.arange(8) % CLASSES)
    assert main(["train", str(tmp_path / "model.onnx"), "--data", str(tmp_path / "data.npz"), "--steps", "1",
                 "--batch-size", "4", "--loss", "nll", "--loss-output", "probabilities"]) == 0
    assert "loss 'nll' expects log-probabilities" in capsys.readouterr().err
