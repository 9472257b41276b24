"""What a new user trips on: the input model never overwritten, errors that name what the
caller can do where they are (the command line has no base_dir=), the package's top-level
names, a loss that is not a scalar refused when the session is made, and dim names that
exporters write for "unknown" on every such axis."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientGraphBuilder, InvalidArgumentError, TrainingParameters, TrainingSession
from gradbuilder.cli import main

from .helpers import linear_model, make_model, tensor, vi


def test_generate_artifacts_and_the_inference_export_are_top_level_names():
    import gradbuilder
    from gradbuilder.training import artifacts

    assert gradbuilder.generate_artifacts is artifacts.generate_artifacts
    assert gradbuilder.export_model_for_inferencing is artifacts.export_model_for_inferencing
    assert {"generate_artifacts", "export_model_for_inferencing"} <= set(gradbuilder.__all__)


def test_the_input_model_is_never_written_over(tmp_path, capsys):
    from gradbuilder import export_model_for_inferencing, generate_artifacts

    path = tmp_path / "model.onnx"
    onnx.save(linear_model(), path)
    before = path.read_bytes()
    data = tmp_path / "d.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.standard_normal((8, 3)).astype(np.float32), t=rng.standard_normal((8, 2)).astype(np.float32))
    assert main(["build", str(path), "--loss", "loss", "-o", str(path)]) == 2
    assert "the model and -o name the same file" in capsys.readouterr().err
    assert main(["train", str(path), "--data", str(data), "--steps", "1", "-o", str(path), "-q"]) == 2
    assert "the model and -o name the same file" in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match="is the input model"):
        GradientGraphBuilder(str(path), ["W"], ["loss"], "loss").build().save(path)
    with pytest.raises(InvalidArgumentError, match="is the input model"):
        export_model_for_inferencing(str(path), path, ["loss"])
    inside = tmp_path / "art" / "training_model.onnx"
    inside.parent.mkdir()
    inside.write_bytes(before)
    with pytest.raises(InvalidArgumentError, match="artifact .*training_model.onnx' is the input model"):
        generate_artifacts(str(inside), artifact_directory=inside.parent)
    assert path.read_bytes() == before and inside.read_bytes() == before


def test_a_missing_external_data_file_says_where_to_put_it_on_the_command_line(tmp_path, capsys):
    model = linear_model()
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.onnx.data", size_threshold=0)
    (tmp_path / "m.onnx.data").unlink()
    assert main(["build", str(tmp_path / "m.onnx"), "--loss", "loss", "-o", str(tmp_path / "g.onnx")]) == 2
    err = capsys.readouterr().err
    assert "put 'm.onnx.data' there (beside the model" in err and "\n" not in err.strip()


def test_a_session_refuses_a_loss_that_is_not_a_scalar_when_it_is_made():
    """A per-sample loss ([batch]) is refused before any run, as the command line refuses it."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("ReduceMean", ["y"], ["loss"], axes=[1],
                                                                              keepdims=0)]
    model = make_model(nodes, [vi("x", ["n", 3])], [vi("loss", None)], [tensor("W", rng.standard_normal((3, 2)).astype(np.float32))])
    with pytest.raises(InvalidArgumentError, match=r"loss 'loss' has shape \['n'\]; the loss must be a scalar"):
        TrainingSession(model, TrainingParameters(loss_output_name="loss", training_optimizer_name="sgd"))


def _unknown_dims_model() -> onnx.ModelProto:
    """x [-1, 3, '?', '?'] (paddle2onnx's way) -> Conv 3x3 -> ReduceMean over H, W -> MatMul ->
    mean squared error against t [-1, 2]."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "K"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("ReduceMean", ["c"], ["p"], axes=[2, 3], keepdims=0),
             helper.make_node("MatMul", ["p", "W"], ["y"]), helper.make_node("Sub", ["y", "t"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, "?", "?"])
    t = helper.make_tensor_value_info("t", TensorProto.FLOAT, [-1, 2])
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.2, "K"),
             numpy_helper.from_array(rng.standard_normal((4, 2)).astype(np.float32), "W")]
    return make_model(nodes, [x, t], [vi("loss", [])], inits)


def test_a_dim_named_unknown_is_not_one_size_shared_by_its_axes(tmp_path):
    """[N, 3, 48, 192] fed to an input declared [-1, 3, '?', '?'] trains, and its gradients are
    those of the same model declared [-1, 3, 'h', 'w'] (H and W are not made one size)."""
    model = _unknown_dims_model()
    named = onnx.ModelProto.FromString(model.SerializeToString())
    dims = named.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "h", "w"
    rng = np.random.default_rng(1)
    batch = {"x": rng.standard_normal((2, 3, 48, 192)).astype(np.float32), "t": rng.standard_normal((2, 2)).astype(np.float32)}
    losses = {}
    for name, m in (("unknown", model), ("named", named)):
        s = TrainingSession(m, TrainingParameters(loss_output_name="loss", training_optimizer_name="sgd"),
                            providers=["CPUExecutionProvider"])
        losses[name] = [float(s.run(["loss"], batch)[0]) for _ in range(3)]
    np.testing.assert_allclose(losses["unknown"], losses["named"], rtol=1e-6)
    path, data = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(model, path)
    np.savez(data, x=np.repeat(batch["x"], 4, axis=0), t=np.repeat(batch["t"], 4, axis=0))
    assert main(["train", str(path), "--data", str(data), "--steps", "2", "--batch-size", "4",
                 "-o", str(tmp_path / "trained.onnx"), "-q"]) == 0


def test_a_recurrent_export_whose_squeeze_is_an_if_builds_a_valid_graph_and_trains_as_pytorch():
    """torch's TorchScript export writes ``squeeze(dim)`` of a size it cannot see as If(size ==
    1, Squeeze, Identity), the If declared squeezed: the Identity branch disagrees with that
    declaration, and the gradient graph built from it failed onnx.checker. It passes now, and
    the gradients are autograd's."""
    import torch

    from .torch_models import ort_gradients

    class Last(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.rnn, self.fc = torch.nn.GRU(4, 6, batch_first=True), torch.nn.Linear(6, 2)

        def forward(self, x, t):
            out, _ = self.rnn(x)
            return torch.nn.functional.mse_loss(self.fc(out[:, -1:, :].squeeze(1)), t)

    import io
    import warnings

    module, args = Last(), (torch.randn(3, 5, 4), torch.randn(3, 2))
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, f, dynamo=False, opset_version=17, input_names=["x", "t"],
                          output_names=["loss"], training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          dynamic_axes={"x": {0: "batch", 1: "steps"}, "t": {0: "batch"}})
    model = onnx.load_from_string(f.getvalue())
    assert "If" in [n.op_type for n in model.graph.node]
    weights = [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT]
    loss, grads = ort_gradients(model, weights, {"x": args[0].numpy(), "t": args[1].numpy()})  # checks the model
    module(*args).backward()
    params = dict(module.named_parameters())
    assert set(weights) == set(params)
    np.testing.assert_allclose(loss, float(module(*args)), rtol=1e-5)
    for w in weights:
        np.testing.assert_allclose(grads[w], params[w].grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=w)
