"""PyTorch exports whose exporter merged parameters of equal value (layers cloned from one
instance) warn at every entry point; ties the PyTorch model itself has do not."""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from gradbuilder import GradientGraphBuilder, TrainingParameters, TrainingSession
from gradbuilder.cli import main
from gradbuilder.compiler.tied_exports import EXPORT_CALL, merged_parameters
from gradbuilder.training.artifacts import generate_artifacts

MERGED = "merged parameters of equal value"
FOR_TRAINING = dict(training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)


class Encoder(torch.nn.Module):
    """Two TransformerEncoder layers cloned from one (equal at the start) and a loss."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.enc(x)).pow(2).mean()


class Clones(torch.nn.Module):
    def __init__(self):
        super().__init__()
        linear = torch.nn.Linear(4, 4)
        self.net = torch.nn.Sequential(linear, torch.nn.ReLU(), copy.deepcopy(linear), torch.nn.ReLU(),
                                       copy.deepcopy(linear))

    def forward(self, x):
        return self.net(x).pow(2).mean()


class TiedEmbedding(torch.nn.Module):
    """GPT-2's tie: the token embedding is also the output projection."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(10, 4)
        self.mlp = torch.nn.Linear(4, 4)
        self.lm_head = torch.nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.mlp(self.wte(ids)))).pow(2).mean()


class Looped(torch.nn.Module):
    """One module applied three times."""

    def __init__(self):
        super().__init__()
        self.block = torch.nn.Linear(4, 4)

    def forward(self, x):
        for _ in range(3):
            x = torch.relu(self.block(x))
        return x.pow(2).mean()


class Block(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.linear(x)) * self.scale


class SharedAttribute(torch.nn.Module):
    """One parameter assigned to parallel blocks (read in /blocks.0 and /blocks.1)."""

    def __init__(self):
        super().__init__()
        scale = torch.nn.Parameter(torch.randn(4))
        self.blocks = torch.nn.ModuleList([Block(scale), Block(scale)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def export(module: torch.nn.Module, x: torch.Tensor, **kw) -> onnx.ModelProto:
    torch.manual_seed(0)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), f, dynamo=False, input_names=["x"], output_names=["loss"],
                          opset_version=17, dynamic_axes={"x": {0: "batch"}}, **kw)
    return onnx.load_from_string(f.getvalue())


def encoder_x() -> torch.Tensor:
    return torch.randn(2, 5, 8)


@pytest.fixture(scope="module")
def encoder() -> onnx.ModelProto:
    torch.manual_seed(0)
    return export(Encoder(), encoder_x())


def build(model: onnx.ModelProto) -> GradientGraphBuilder:
    weights = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    return GradientGraphBuilder(model, weights, ["loss"], "loss").build()


def merged_warnings(record) -> list[str]:
    return [str(r.message) for r in record if MERGED in str(r.message)]


def test_cloned_transformer_layers_warn_naming_the_initializer_and_the_scopes(encoder):
    assert merged_parameters(encoder)["enc.layers.0.linear1.bias"] == ["enc.layers.1.linear1.bias"]
    with pytest.warns(UserWarning, match=MERGED) as record:
        build(encoder)
    [message] = merged_warnings(record)
    assert "'enc.layers.0.linear1.bias' also stands for enc.layers.1.linear1.bias (read in /enc/layers.0/linear1, " \
           "/enc/layers.1/linear1)" in message
    assert EXPORT_CALL in message
    assert [r.filename for r in record if MERGED in str(r.message)] == [__file__]


def test_the_recommended_export_keeps_the_layers_apart_and_does_not_warn():
    torch.manual_seed(0)
    model = export(Encoder(), encoder_x(), **FOR_TRAINING)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert len(inits) == 26  # 12 parameters in each layer and the head's 2
    np.testing.assert_array_equal(inits["enc.layers.0.linear1.weight"], inits["enc.layers.1.linear1.weight"])
    assert merged_parameters(model) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build(model)


def test_deepcopied_linears_in_a_sequential_warn():
    model = export(Clones(), torch.randn(2, 4))
    with pytest.warns(UserWarning, match=MERGED) as record:
        build(model)
    [message] = merged_warnings(record)
    assert "'net.0.weight' also stands for net.2.weight, net.4.weight (read in /net/net.0, /net/net.2, " \
           "/net/net.4)" in message


# the tied embedding in training mode only: eval mode's constant folding writes the output
# projection's transpose of it as an initializer of its own, and the tie is gone
@pytest.mark.parametrize("module,x,kw", [
    (TiedEmbedding, torch.tensor([[1, 2, 3], [4, 5, 6]]), FOR_TRAINING),
    (Looped, torch.randn(2, 4), {}),
    (Looped, torch.randn(2, 4), FOR_TRAINING),
    (SharedAttribute, torch.randn(2, 4), {}),
    (SharedAttribute, torch.randn(2, 4), FOR_TRAINING),
], ids=["tied-embedding", "looped-eval", "looped-training", "shared-attribute-eval", "shared-attribute-training"])
def test_ties_of_the_pytorch_model_do_not_warn(module, x, kw):
    torch.manual_seed(0)
    model = export(module(), x, **kw)
    readers = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.name.rsplit("/", 1)[0])
    assert max(len(readers.get(t.name, ())) for t in model.graph.initializer) >= 2  # a tie is in the model
    assert merged_parameters(model) == {}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        build(model)
    assert merged_warnings(record) == []


def hand_made(producer: str) -> onnx.ModelProto:
    """What a merge looks like, written with onnx.helper: W read directly and through an
    unscoped Identity as 'W2'."""
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    nodes = [helper.make_node("Identity", ["W"], ["W2"], name="Identity_0"),
             helper.make_node("MatMul", ["x", "W"], ["h"], name="/a/MatMul"),
             helper.make_node("MatMul", ["h", "W2"], ["y"], name="/b/MatMul"),
             helper.make_node("ReduceSum", ["y"], ["loss"], name="/ReduceSum", keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name=producer)


def test_a_model_not_exported_by_pytorch_does_not_warn():
    assert merged_parameters(hand_made("pytorch")) == {"W": ["W2"]}
    model = hand_made("onnx.helper")
    assert merged_parameters(model) == {}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        build(model)
    assert merged_warnings(record) == []


def test_training_session_warns_once(encoder):
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw")
    with pytest.warns(UserWarning, match=MERGED) as record:
        session = TrainingSession(encoder, params, providers=["CPUExecutionProvider"])
        session.train_step({"x": encoder_x().numpy()})
    assert [r.filename for r in record if MERGED in str(r.message)] == [__file__]


def test_generate_artifacts_warns_once(encoder, tmp_path):
    with pytest.warns(UserWarning, match=MERGED) as record:
        generate_artifacts(encoder, artifact_directory=tmp_path)
    assert [r.filename for r in record if MERGED in str(r.message)] == [__file__]
    assert (tmp_path / "training_model.onnx").is_file()


def test_cli_artifacts_warns_once(encoder, tmp_path, capsys):
    path = tmp_path / "encoder.onnx"
    onnx.save(encoder, path)
    assert main(["artifacts", str(path), "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert err.count(f"gradbuilder: warning: the model is a PyTorch export that {MERGED}") == 1
    assert "'enc.layers.0.linear1.bias' also stands for enc.layers.1.linear1.bias" in err
