"""Every node of a training step has a kernel in onnxruntime's CUDA provider
(``runtime.providers.nodes_without_cuda_kernel``, from onnxruntime's documented kernel table),
and the class losses, which have none there, are written as operators that do
(``compiler.passes.standard_losses``)."""

import io
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder.compiler import pipeline
from gradbuilder.compiler.passes.standard_losses import class_losses_as_standard_ops
from gradbuilder.runtime.providers import kernel_table_source, nodes_without_cuda_kernel
from gradbuilder.training.graph import TrainingGraphBuilder
from gradbuilder.training.stages import flat

from .helpers import make_model, tensor, vi

CPU = ["CPUExecutionProvider"]


def encoder_export() -> bytes:
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 24)
            layer = torch.nn.TransformerEncoderLayer(24, 4, 48, dropout=0.0, batch_first=True)
            self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = torch.nn.Linear(24, 5)

        def forward(self, x, y):
            return F.cross_entropy(self.head(self.enc(self.emb(x)).mean(dim=1)), y)

    torch.manual_seed(0)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Encoder().train(), (torch.zeros(2, 6, dtype=torch.long), torch.zeros(2, dtype=torch.long)), f,
                          input_names=["x", "y"], output_names=["loss"], dynamo=False, opset_version=17,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    return f.getvalue()


@pytest.mark.parametrize("precision", [None, "float16", "bfloat16"])
def test_the_encoders_step_has_a_cuda_kernel_for_every_node(precision):
    """The step graph a session builds (flat state, AdamW, clipping, loss scaling under
    float16) in float32, float16 and bfloat16."""
    model = encoder_export()
    proto = onnx.load_from_string(model)
    values = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer if t.data_type == TensorProto.FLOAT}
    b = TrainingGraphBuilder(model, list(values), "loss", optimizer="adamw", max_grad_norm=1.0,
                             mixed_precision=precision)
    b.flat_layout = flat.layout(values, b.options_of, "adamw")
    step = b.build().model_proto
    ops = {n.op_type for n in step.graph.node}
    assert "SoftmaxCrossEntropyLoss" not in ops and "If" not in ops
    assert nodes_without_cuda_kernel(step) == []
    assert "OperatorKernels.md at commit" in kernel_table_source()


def test_nodes_without_a_cuda_kernel_are_named_with_the_reason():
    nodes = [helper.make_node("Unique", ["x"], ["u"], name="unique"),
             helper.make_node("Round", ["d"], ["r"], name="round"),
             helper.make_node("Hardmax", ["x"], ["h"], name="hardmax", axis=-1),
             helper.make_node("Relu", ["x"], ["ok"], name="relu")]
    model = make_model(nodes, [vi("x", [4]), vi("d", [4], TensorProto.INT32)],
                       [vi("u", None), vi("r", None), vi("h", None), vi("ok", None)])
    found = nodes_without_cuda_kernel(model.SerializeToString())
    assert len(found) == 3
    assert found[0].startswith("node 'unique' (Unique, domain ai.onnx") and "no kernel for this op" in found[0]
    assert "node 'round' (Round" in found[1] and "input 0 'd' is int32" in found[1] and "float16" in found[1]
    assert "node 'hardmax'" in found[2]


def _loss_model(op: str, reduction: str, ignore=None, weights=False, spatial=False) -> onnx.ModelProto:
    shape, target = ([3, 4, 5], [3, 5]) if spatial else ([6, 4], [6])
    rng = np.random.default_rng(0)
    inputs = ["scores", "target"] + (["w"] if weights else [])
    attrs = {"reduction": reduction, **({"ignore_index": ignore} if ignore is not None else {})}
    outputs = ["loss", "log_prob"] if op == "SoftmaxCrossEntropyLoss" else ["loss"]
    inits = [tensor("w", rng.uniform(0.5, 2.0, 4).astype(np.float32))] if weights else []
    node = helper.make_node(op, inputs, outputs, **attrs)
    declared = {"loss": target if reduction == "none" else [], "log_prob": shape}
    return make_model([node], [vi("scores", shape), vi("target", target, TensorProto.INT64)],
                      [vi(o, declared[o]) for o in outputs], inits)


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("variant", [{}, {"ignore": 2}, {"weights": True}, {"ignore": 1, "weights": True, "spatial": True}])
def test_class_losses_as_standard_ops_compute_what_the_loss_kernels_do(op, reduction, variant):
    model = _loss_model(op, reduction, **variant)
    rewritten = ir.from_proto(model)
    pipeline.run((class_losses_as_standard_ops,), rewritten, pipeline.Context.of(rewritten))
    rewritten = ir.to_proto(rewritten)
    assert op not in {n.op_type for n in rewritten.graph.node}
    onnx.checker.check_model(rewritten, full_check=True)
    rng = np.random.default_rng(1)
    shape = [3, 4, 5] if variant.get("spatial") else [6, 4]
    scores = rng.standard_normal(shape).astype(np.float32)
    if op == "NegativeLogLikelihoodLoss":
        scores = np.log(np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True)).astype(np.float32)
    feeds = {"scores": scores, "target": rng.integers(0, 4, [3, 5] if variant.get("spatial") else [6])}
    want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, feeds)
    got = ort.InferenceSession(rewritten.SerializeToString(), providers=CPU).run(None, feeds)
    for a, b in zip(want, got):
        assert a.shape == b.shape and np.allclose(a, b, rtol=1e-6, atol=1e-7), (a, b)


def test_the_eval_graph_writes_its_loss_in_standard_ops_too():
    """eval_step's graph (the inference form) has no class-loss node either, and gives the loss
    onnxruntime's own kernel gives on the original model."""
    from gradbuilder import TrainingParameters, TrainingSession

    model = encoder_export()
    session = TrainingSession(model, TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw"),
                              providers=CPU)
    graph = onnx.ModelProto.FromString(session.graphs.serialized("eval"))
    assert "SoftmaxCrossEntropyLoss" not in {n.op_type for n in graph.graph.node}
    assert nodes_without_cuda_kernel(graph) == []
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 50, (2, 6)), rng.integers(0, 5, 2)
    want = ort.InferenceSession(model, providers=CPU).run(["loss"], {"x": x, "y": y})[0]
    np.testing.assert_allclose(session.eval_step(x, y), want, rtol=1e-6)
