"""BatchNormalization running statistics in training: buffers, not weights.

A CNN with BatchNorm exported from torch in training mode (TorchScript exporter, as the README
advises) is trained with TrainingSession and with PyTorch from the same weights on the same
batches; losses, weights and running statistics must agree. Exports and evaluation use the
running statistics (inference mode), so an output depends on its own sample only.
"""

from __future__ import annotations

import functools
import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.numpy import load_file

from gradbuilder import TrainingParameters
from gradbuilder.training.artifacts import generate_artifacts
from gradbuilder.errors import InvalidArgumentError, ProviderError
from gradbuilder.compiler.passes.running_stats import buffers_of
from gradbuilder.runtime.session import TrainingSession

CPU = ["CPUExecutionProvider"]
BATCH, CLASSES = 8, 5
BUFFERS = ["bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var"]


class CNN(torch.nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        # no bias before a BatchNorm: its true gradient is zero, and Adam would turn round-off
        # into +-lr steps in either run
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(4, momentum=0.2)
        self.fc1 = torch.nn.Linear(4 * 6 * 6, 16, bias=False)
        self.bn2 = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(dropout)
        self.fc2 = torch.nn.Linear(16, CLASSES)

    def forward(self, x, y):
        h = torch.relu(self.bn1(self.conv(x))).flatten(1)
        logits = self.fc2(self.drop(torch.relu(self.bn2(self.fc1(h)))))
        return torch.nn.functional.cross_entropy(logits, y), logits


def new_cnn(dropout: float = 0.0, opset: int = 17, dynamo: bool = False) -> CNN:
    """The module as exported: tracing in training mode runs it once, so its running
    statistics (and the exported initializers) already hold one update."""
    torch.manual_seed(0)
    module = CNN(dropout)
    module.load_state_dict(_exported(dropout, opset, dynamo)[1])
    return module


def cnn_bytes(dropout: float = 0.0, opset: int = 17, dynamo: bool = False) -> bytes:
    return _exported(dropout, opset, dynamo)[0]


@functools.lru_cache(maxsize=None)
def _exported(dropout: float, opset: int, dynamo: bool):
    torch.manual_seed(0)
    module = CNN(dropout)
    f = io.BytesIO()
    x, y = batch_at(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:  # it writes the BatchNorms in inference form; the builder puts them back
            batch = torch.export.Dim("batch", min=2, max=64)
            prog = torch.onnx.export(module, (torch.from_numpy(x), torch.from_numpy(y)), None, dynamo=True,
                                     opset_version=opset, input_names=["x", "y"], output_names=["loss", "logits"],
                                     dynamic_shapes={"x": {0: batch}, "y": {0: batch}}, optimize=False,
                                     verbose=False, report=False)
            return prog.model_proto.SerializeToString(), {k: v.clone() for k, v in module.state_dict().items()}
        torch.onnx.export(module, (torch.from_numpy(x), torch.from_numpy(y)), f, dynamo=False,
                          opset_version=opset, input_names=["x", "y"], output_names=["loss", "logits"],
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return f.getvalue(), {k: v.clone() for k, v in module.state_dict().items()}


def batch_at(i: int, n: int = BATCH):
    rng = np.random.default_rng(100 + i)
    return (rng.standard_normal((n, 3, 6, 6)).astype(np.float32) * 2 + 0.5,
            rng.integers(0, CLASSES, n).astype(np.int64))


def session(optimizer="adamw", opset=17, dynamo=False, **options) -> TrainingSession:
    p = TrainingParameters(loss_output_name="loss", training_optimizer_name=optimizer, enable_grad_norm_clip=False,
                           **options)
    s = TrainingSession(cnn_bytes(opset=opset, dynamo=dynamo), p, providers=CPU)
    s.set_learning_rate(0.01)
    return s


def stats(s: TrainingSession) -> dict[str, np.ndarray]:
    return {b: v for b, v in s.get_model_state()["full_precision"].items() if b in BUFFERS}


def torch_stats(module) -> dict[str, np.ndarray]:
    return {b: t.detach().numpy() for b, t in module.state_dict().items() if b in BUFFERS}


def test_running_statistics_are_buffers_not_weights():
    assert buffers_of(onnx.load_from_string(cnn_bytes())) == BUFFERS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "do not reach the loss" warning
        s = session()
        s.run(["loss"], dict(zip(["x", "y"], batch_at(0))))
    assert not set(BUFFERS) & set(s.weights)
    assert s.buffers == BUFFERS
    assert not set(BUFFERS) & set(s.get_optimizer_state())
    assert s.get_parameters_size() == sum(p.numel() for p in new_cnn().parameters())
    p = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", weights_to_train=["bn1.running_mean"])
    with pytest.raises(InvalidArgumentError, match="running statistics"):
        TrainingSession(cnn_bytes(), p, providers=CPU)


@pytest.mark.parametrize("api, opset, dynamo", [("run", 17, False), ("train_step", 17, False), ("run", 13, False),
                                                pytest.param("run", 18, True, marks=pytest.mark.slow)])  # dynamo
def test_twenty_steps_match_torch_losses_weights_and_running_statistics(api, opset, dynamo):
    """opset 13: BatchNormalization-9, in training mode by its five outputs; dynamo: torch's
    other exporter, which writes the BatchNorms in inference form."""
    s = session(opset=opset, dynamo=dynamo)
    module = new_cnn(opset=opset, dynamo=dynamo)
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    for i in range(20):
        x, y = batch_at(i)
        if api == "run":
            (loss,) = s.run(["loss"], {"x": x, "y": y})
        else:
            loss, _ = s.train_step(x, y)
            s.optimizer_step()
            s.lazy_reset_grad()
        opt.zero_grad()
        ref, _ = module(torch.from_numpy(x), torch.from_numpy(y))
        ref.backward()
        opt.step()
        np.testing.assert_allclose(loss, ref.item(), rtol=1e-4, err_msg=f"step {i}")
    state = s.get_model_state()["full_precision"]
    for name, value in module.state_dict().items():
        if name.endswith("num_batches_tracked"):
            continue
        np.testing.assert_allclose(state[name], value.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def test_eval_and_export_use_running_statistics_like_torch_eval(tmp_path):
    s = session()
    module = new_cnn()
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    for i in range(3):
        x, y = batch_at(i)
        s.run(["loss"], {"x": x, "y": y})
        opt.zero_grad()
        module(torch.from_numpy(x), torch.from_numpy(y))[0].backward()
        opt.step()
    module.eval()
    x, y = batch_at(50, n=16)
    with torch.no_grad():
        ref_loss, ref_logits = module(torch.from_numpy(x), torch.from_numpy(y))
    before = stats(s)
    loss, logits = s.eval_step(x, y)
    np.testing.assert_allclose(logits, ref_logits.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(loss, ref_loss.item(), rtol=1e-4)
    for b, v in stats(s).items():
        np.testing.assert_array_equal(v, before[b], err_msg=f"eval_step changed {b}")

    path = tmp_path / "trained.onnx"
    s.export_model_for_inferencing(path, ["logits"])
    exported = onnx.load(path)
    assert all(not any(a.name == "training_mode" and a.i for a in n.attribute) for n in exported.graph.node)
    infer = ort.InferenceSession(str(path), providers=CPU)
    (batch,) = infer.run(None, {"x": x})
    np.testing.assert_allclose(batch, ref_logits.numpy(), rtol=1e-4, atol=1e-5)
    one_by_one = np.concatenate([infer.run(None, {"x": x[i: i + 1]})[0] for i in range(len(x))])
    np.testing.assert_allclose(one_by_one, batch, rtol=1e-5, atol=1e-6)


def test_dropout_is_identity_in_exports(tmp_path):
    p = TrainingParameters(loss_output_name="loss", training_optimizer_name="sgd", enable_grad_norm_clip=False)
    s = TrainingSession(cnn_bytes(dropout=0.5), p, providers=CPU)
    path = tmp_path / "trained.onnx"
    s.export_model_for_inferencing(path, ["logits"])
    assert "Dropout" not in {n.op_type for n in onnx.load(path).graph.node}
    module = new_cnn(dropout=0.5).eval()
    x, y = batch_at(7)
    with torch.no_grad():
        ref = module(torch.from_numpy(x), torch.from_numpy(y))[1].numpy()
    out = ort.InferenceSession(str(path), providers=CPU).run(None, {"x": x})[0]
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_failed_run_leaves_running_statistics_bit_identical():
    s = session()
    x, y = batch_at(0)
    s.run(["loss"], {"x": x, "y": y})
    before = stats(s)
    options = ort.RunOptions()
    options.terminate = True  # onnxruntime stops the run: a failure inside it
    with pytest.raises(ProviderError):
        s.run(["loss"], {"x": x, "y": y}, options)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        s.run(["loss"], {"x": x, "y": np.full_like(y, CLASSES)})
    for b, v in stats(s).items():
        np.testing.assert_array_equal(v, before[b], err_msg=b)
    s.disable_fallback()


def test_running_statistics_in_checkpoint_and_resume(tmp_path):
    a = session()
    for i in range(3):
        a.run(["loss"], dict(zip(["x", "y"], batch_at(i))))
    a.save_checkpoint(tmp_path / "ckpt.safetensors")
    b = session()
    b.load_checkpoint(tmp_path / "ckpt.safetensors")
    for name, v in stats(a).items():
        np.testing.assert_array_equal(stats(b)[name], v)
    la = a.run(["loss"], dict(zip(["x", "y"], batch_at(3))))
    lb = b.run(["loss"], dict(zip(["x", "y"], batch_at(3))))
    np.testing.assert_array_equal(la, lb)


def test_artifacts_training_model_updates_buffers_and_eval_model_is_inference(tmp_path):
    written = generate_artifacts(cnn_bytes(), loss=None, optimizer="sgd", artifact_directory=tmp_path)
    training = onnx.load(written["training_model.onnx"])
    names = [o.name for o in training.graph.output]
    assert [n for n in names if n.endswith(".updated")] == [f"{b}.updated" for b in BUFFERS]
    assert not any(n.startswith(tuple(BUFFERS)) and n.endswith("_grad") for n in names)
    eval_model = onnx.load(written["eval_model.onnx"])
    assert all(not any(a.name == "training_mode" and a.i for a in n.attribute) for n in eval_model.graph.node)
    ckpt = load_file(written["checkpoint.safetensors"])
    assert set(BUFFERS) <= set(ckpt)
    assert not any(f.startswith(tuple(b + "." for b in BUFFERS)) for f in ckpt)
    # one training run with the checkpoint's values: the new statistics are torch's
    x, y = batch_at(0)
    feeds = {n: v for n, v in load_file(written["checkpoint.safetensors"]).items()
             if n in {i.name for i in training.graph.input}}
    out = dict(zip(names, ort.InferenceSession(written["training_model.onnx"], providers=CPU).run(
        None, {**feeds, "x": x, "y": y})))
    module = new_cnn()
    module(torch.from_numpy(x), torch.from_numpy(y))
    for b, v in torch_stats(module).items():
        np.testing.assert_allclose(out[f"{b}.updated"], v, rtol=1e-5, atol=1e-6, err_msg=b)


@pytest.mark.parametrize("producer", ["", "pytorch"])
def test_running_variance_follows_onnx_or_pytorch(producer):
    """ONNX (and onnxruntime) blend the batch's population variance into the running variance;
    PyTorch blends the unbiased one. A model exported by PyTorch gets PyTorch's rule."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    mean0, var0 = rng.standard_normal(3).astype(np.float32), rng.uniform(0.5, 2, 3).astype(np.float32)
    inits = [numpy_helper.from_array(v, n) for n, v in [("scale", np.ones(3, np.float32)), ("bias", np.zeros(3, np.float32)),
                                                         ("mean", mean0), ("var", var0)]]
    nodes = [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y", "rm", "rv"],
                              training_mode=1, momentum=0.7),
             helper.make_node("Mul", ["y", "y"], ["y2"]), helper.make_node("ReduceMean", ["y2"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 5])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name=producer, ir_version=8)
    s = TrainingSession(model.SerializeToString(), TrainingParameters(loss_output_name="loss",
                                                                      training_optimizer_name="sgd"), providers=CPU)
    x = rng.standard_normal((4, 3, 5)).astype(np.float32)
    s.run(["loss"], {"x": x})
    state = s.get_model_state()["full_precision"]
    batch_var = x.var(axis=(0, 2), ddof=1 if producer == "pytorch" else 0)
    np.testing.assert_allclose(state["mean"], 0.7 * mean0 + 0.3 * x.mean(axis=(0, 2)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["var"], 0.7 * var0 + 0.3 * batch_var, rtol=1e-5)
    assert s.weights == ["scale", "bias"]
