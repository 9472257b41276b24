"""Inference export: trained weights in, chosen outputs only, nothing the outputs do not need."""

import numpy as np
import onnx
import pytest
from safetensors.numpy import load_file
from onnx import helper

from gradbuilder import InvalidArgumentError
from gradbuilder.training.artifacts import export_model_for_inferencing, generate_artifacts
from gradbuilder.testing import run_onnxruntime

from .helpers import linear_model, make_model, tensor, vi


def two_head_model():
    """h = tanh(x W); logits = h V; loss = sum(logits^2) (a training-only output)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Tanh", ["xw"], ["h"]),
             helper.make_node("MatMul", ["h", "V"], ["logits"]), helper.make_node("Mul", ["logits", "logits"], ["sq"]),
             helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    return make_model(nodes, [vi("x", [2, 3])], [vi("loss", [])],
                      [tensor("W", rng.standard_normal((3, 4)).astype(np.float32)),
                       tensor("V", rng.standard_normal((4, 2)).astype(np.float32))])


def test_export_keeps_chosen_outputs_with_trained_weights(tmp_path):
    model = two_head_model()
    before = model.SerializeToString()
    trained = {"W": np.full((3, 4), 0.1, np.float32), "V": np.full((4, 2), -0.2, np.float32)}
    path = export_model_for_inferencing(model, tmp_path / "infer.onnx", ["logits"], trained)
    out = onnx.load(path)
    assert model.SerializeToString() == before  # the caller's model is untouched
    assert [o.name for o in out.graph.output] == ["logits"]
    assert "ReduceSum" not in [n.op_type for n in out.graph.node]  # the loss part is gone
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    got = run_onnxruntime(out, {"x": x})["logits"]
    np.testing.assert_allclose(got, np.tanh(x @ trained["W"]) @ trained["V"], rtol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    ({"output_names": ["nope"]}, "no values named"),
    ({"output_names": []}, "empty"),
    ({"output_names": ["logits"], "weights": {"Z": np.zeros(1)}}, "no initializer named 'Z'"),
    ({"output_names": ["logits"], "weights": {"W": np.zeros((2, 2))}}, "shape"),
])
def test_export_errors_leave_no_file(tmp_path, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        export_model_for_inferencing(two_head_model(), tmp_path / "x.onnx", **kwargs)
    assert list(tmp_path.iterdir()) == []


def classifier():
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["logits"])]
    return make_model(nodes, [vi("x", [4, 3])], [vi("logits", [4, 5])],
                      [tensor("W", rng.standard_normal((3, 5)).astype(np.float32)),
                       tensor("B", rng.standard_normal(5).astype(np.float32))])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_generate_artifacts_train_on_stock_onnxruntime(tmp_path, optimizer):
    """The four artifacts load in onnxruntime; a step of training_model then optimizer_model
    equals the same step of the one-graph TrainingGraphBuilder."""
    from gradbuilder.training.artifacts import generate_artifacts
    from gradbuilder.training.loss import append_loss
    from gradbuilder.training.graph import TrainingGraphBuilder

    paths = generate_artifacts(classifier(), loss="crossentropy", optimizer=optimizer, artifact_directory=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint.safetensors"])
    ckpt = load_file(paths["checkpoint.safetensors"])
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((4, 3)).astype(np.float32), "target": np.array([0, 3, 1, 4], np.int64)}
    lr = np.array(0.1, np.float32)
    train = run_onnxruntime(onnx.load(paths["training_model.onnx"]), {**feeds, "W": ckpt["W"], "B": ckpt["B"]})
    evaluated = run_onnxruntime(onnx.load(paths["eval_model.onnx"]), {**feeds, "W": ckpt["W"], "B": ckpt["B"]})
    np.testing.assert_allclose(train["loss"], evaluated["loss"], rtol=1e-6)
    opt_feeds = {k: v for k, v in ckpt.items()}
    opt_feeds.update({"Learning_Rate": lr, "W_grad": train["W_grad"], "B_grad": train["B_grad"]})
    stepped = run_onnxruntime(onnx.load(paths["optimizer_model.onnx"]), opt_feeds)

    whole = TrainingGraphBuilder(append_loss(classifier(), "crossentropy", "logits"), ["W", "B"], "loss",
                                 optimizer=optimizer).build()
    one = run_onnxruntime(whole.get_model(), {**feeds, **whole.initial_state(), "Learning_Rate": lr})
    for name in ("W.updated", "B.updated", "Step.updated"):
        np.testing.assert_allclose(stepped[name], one[name], rtol=1e-6)


def test_artifacts_command(tmp_path):
    from gradbuilder.cli import main

    model_path = tmp_path / "model.onnx"
    onnx.save(classifier(), model_path)
    out = tmp_path / "artifacts"
    assert main(["artifacts", str(model_path), "--loss", "crossentropy", "--optimizer", "adamw", "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint.safetensors"])
    assert main(["artifacts", str(model_path), "--loss", "nope", "-o", str(tmp_path / "bad")]) == 2


@pytest.mark.parametrize("name, plain", [("AdamW", "adamw"), ("SGD", "sgd"), ("AdamOptimizer", "adam"),
                                         ("lamboptimizer", "lamb")])
def test_optimizer_names_are_read_as_training_parameters_reads_them(tmp_path, name, plain):
    from gradbuilder.training.stages.optimizer import state_names, resolve

    written = generate_artifacts(linear_model(), optimizer=name, artifact_directory=tmp_path)
    states = {f.split(".", 1)[1] for f in load_file(written["checkpoint.safetensors"]) if f.startswith("W.")}
    assert states == set(state_names(plain, resolve(plain, {})))
    with pytest.raises(InvalidArgumentError, match="unknown optimizer 'adamz'"):
        generate_artifacts(linear_model(), optimizer="adamz", artifact_directory=tmp_path / "other")


def test_the_artifacts_loop_trains_and_evaluates_as_a_training_session_does(tmp_path, capfd):
    """examples/artifacts_loop.py on stock onnxruntime: 40 AdamW steps give TrainingSession's
    losses and weights, the eval model evaluates the trained weights (the same accuracy as the
    session's eval_step), and no model makes onnxruntime warn when it loads."""
    import importlib.util
    import os

    from gradbuilder import TrainingParameters, TrainingSession
    from gradbuilder.training.loss import append_loss

    spec = importlib.util.spec_from_file_location(
        "artifacts_loop", os.path.join(os.path.dirname(__file__), "..", "examples", "artifacts_loop.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 3)).astype(np.float32)
    y = np.argmax(x @ rng.standard_normal((3, 5)), axis=1).astype(np.int64)
    batches = [{"x": x[i:i + 4], "target": y[i:i + 4]} for i in range(0, 64, 4)] * 3

    generate_artifacts(classifier(), loss="crossentropy", optimizer="adamw", artifact_directory=tmp_path)
    capfd.readouterr()
    loop = example.ArtifactsLoop(str(tmp_path))
    assert capfd.readouterr().err == ""  # no "Initializer ... appears in graph inputs" on load
    assert {"W", "B"} <= {i.name for i in loop.eval.get_inputs()}  # the eval model takes the trained weights
    untrained = float(np.mean(np.concatenate([np.argmax(loop.evaluate(b)["logits"], axis=1) == b["target"]
                                              for b in batches[:16]])))
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", enable_grad_norm_clip=False)
    session = TrainingSession(append_loss(classifier(), "crossentropy", "logits"), params,
                              providers=["CPUExecutionProvider"])
    for step, batch in enumerate(batches, 1):
        session.set_learning_rate(0.05)
        want = float(session.run(["loss"], batch)[0])
        got = loop.train_step(batch, lr=0.05)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"step {step}")
    state = session.get_state()["model"]["full_precision"]
    for w in ("W", "B"):
        np.testing.assert_allclose(loop.state[w], state[w], rtol=1e-5, atol=1e-7)
    assert int(loop.state["Step"]) == session.step == len(batches)
    session.eval()
    accuracy = {}
    for name, logits in (("loop", [loop.evaluate(b)["logits"] for b in batches[:16]]),
                         ("session", [session.eval_step(b["x"], b["target"])[0] for b in batches[:16]])):
        accuracy[name] = float(np.mean(np.argmax(np.concatenate(logits), axis=1) == y))
    assert accuracy["loop"] == accuracy["session"] >= untrained + 0.3, (accuracy, untrained)


def test_artifacts_carry_the_lowest_ir_version_that_holds_them(tmp_path):
    """A model made with the newest onnx (its IR version past what onnxruntime-node or an older
    onnxruntime reads) gives artifacts stamped with the lowest IR version their opsets and
    types need: for opset 17 and float32, IR 8."""
    model = classifier()
    model.ir_version = onnx.IR_VERSION
    written = generate_artifacts(model, loss="crossentropy", artifact_directory=tmp_path)
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        assert onnx.load(written[name]).ir_version == 8, name
    assert model.ir_version == onnx.IR_VERSION  # the caller's model is left as it was
