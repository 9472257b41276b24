"""passes.attention_layout: torch's multi-head attention (TorchScript export) rewritten with one
Transpose each way between tokens and heads, for every layout and mask torch writes: the
rewrite happens (the Gathers, Squeezes and per-head Reshapes are gone), and the gradients equal
PyTorch's autograd and the unrewritten graph's."""

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradbuilder.compiler import pipeline

from .torch_models import compare_with_torch, export, ort_gradients

D, HEADS = 16, 4


class Encoder(nn.Module):
    def __init__(self, batch_first=True, norm_first=False, mask=None, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(30, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, 32, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(D, 3)
        self.batch_first, self.mask = batch_first, mask

    def forward(self, tokens, y):
        h = self.emb(tokens)
        s = tokens.shape[1]
        kwargs = {}
        if self.mask == "causal":
            kwargs["mask"] = torch.triu(torch.full((s, s), float("-inf")), diagonal=1)
        elif self.mask == "padding":
            kwargs["src_key_padding_mask"] = tokens == 0
        if not self.batch_first:
            h = h.transpose(0, 1)
        h = self.enc(h, **kwargs)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return F.cross_entropy(self.head(h.mean(1)), y)


class Decoder(nn.Module):
    """Self-attention (packed q, k, v: rewritten) and cross-attention (q apart from k, v: its
    heads are left as they are, its output goes back in one Transpose)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(30, D)
        self.layer = nn.TransformerDecoderLayer(D, HEADS, 32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(D, 30)

    def forward(self, tokens, memory, target):
        h = self.layer(self.emb(tokens), memory)
        return F.cross_entropy(self.out(h).reshape(-1, 30), target.reshape(-1))


def _ops(model: onnx.ModelProto, rewrite: bool) -> list[str]:
    """The op types of the forward after PREPARE, with or without the rewrite."""
    from gradbuilder.compiler.passes.context import Context

    passes = pipeline.PREPARE if rewrite else tuple(p for p in pipeline.PREPARE
                                                   if p.__name__ != "attention_heads_in_one_transpose")
    ir_model = pipeline.load(model, [])
    pipeline.run(passes, ir_model, Context.of(ir_model, wrt=[]))
    return [n.op_type for n in ir_model.graph]


def _without_rewrite(monkeypatch):
    monkeypatch.setattr(pipeline, "PREPARE", tuple(p for p in pipeline.PREPARE
                                                   if p.__name__ != "attention_heads_in_one_transpose"))


CASES = {
    "batch first": dict(),
    "sequence first": dict(batch_first=False),
    "norm first": dict(norm_first=True),
    "causal mask": dict(mask="causal"),
    "padding mask": dict(mask="padding"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_encoder_layers_are_rewritten_and_train_as_pytorch(case, monkeypatch):
    module = Encoder(**CASES[case])
    tokens = torch.randint(1, 30, (3, 7))
    tokens[0, 5:] = 0  # padding, where the mask reads it
    args = (tokens, torch.randint(0, 3, (3,)))
    model = export(module, args, ["tokens", "y"], dynamo=False, opset=17)
    before, after = _ops(model, False), _ops(model, True)
    assert "Squeeze" in before and "Squeeze" not in after
    layers = 2
    assert before.count("Transpose") - after.count("Transpose") >= 2 * layers, (before.count("Transpose"),
                                                                                  after.count("Transpose"))
    assert after.count("Split") >= layers and after.count("Gather") < before.count("Gather")
    compare_with_torch(Encoder(**CASES[case]), args, ["tokens", "y"], dynamo=False, opset=17, rtol=1e-4)
    feeds = {"tokens": tokens.numpy(), "y": args[1].numpy()}
    weights = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims)]
    loss, grads = ort_gradients(model, weights, feeds)
    _without_rewrite(monkeypatch)
    plain_loss, plain = ort_gradients(model, weights, feeds)
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
    for w in weights:
        np.testing.assert_allclose(grads[w], plain[w], rtol=1e-4, atol=1e-6, err_msg=w)


def test_a_decoder_layer_rewrites_its_self_attention_and_trains_as_pytorch():
    args = (torch.randint(0, 30, (2, 6)), torch.randn(2, 5, D), torch.randint(0, 30, (2, 6)))
    model = export(Decoder(), args, ["tokens", "memory", "target"], dynamo=False, opset=17)
    before, after = _ops(model, False), _ops(model, True)
    assert before.count("Transpose") - after.count("Transpose") >= 3  # self-attention's in and out, cross's out
    compare_with_torch(Decoder(), args, ["tokens", "memory", "target"], dynamo=False, opset=17, rtol=1e-4)


def test_a_layer_with_dynamic_sizes_is_left_as_it_is():
    """Sizes known only at run time (a dynamic batch): nothing to rewrite by, the graph stays."""
    module = Encoder()
    args = (torch.randint(1, 30, (3, 7)), torch.randint(0, 3, (3,)))
    model = export(module, args, ["tokens", "y"], dynamo=False, opset=17, dynamic_batch=True)
    assert _ops(model, True) == _ops(model, False)
    compare_with_torch(Encoder(), args, ["tokens", "y"], dynamo=False, opset=17, rtol=1e-4, dynamic_batch=True)


def test_an_eval_mode_export_with_folded_constants_is_rewritten_too(monkeypatch):
    """Exported in eval mode with constant folding (the exporter's default), the attention's
    shape reads are constants and their Shape nodes dead: they do not keep the rewrite away."""
    import io
    import warnings

    module = Encoder().eval()
    with torch.no_grad():  # the layers start as copies of one: make each weight its own
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    args = (torch.randint(1, 30, (3, 7)), torch.randint(0, 3, (3,)))
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, f, input_names=["tokens", "y"], output_names=["loss"], dynamo=False,
                          opset_version=17, keep_initializers_as_inputs=True)
    model = onnx.load_from_string(f.getvalue())
    weights = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims)]
    inputs = [i for i in model.graph.input if i.name not in set(weights)]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    before, after = _ops(model, False), _ops(model, True)
    assert before.count("Transpose") - after.count("Transpose") >= 4 and after.count("Split") >= 2
    feeds = {"tokens": args[0].numpy(), "y": args[1].numpy()}
    loss, grads = ort_gradients(model, weights, feeds)
    module.zero_grad()
    module(*args).backward()
    # constant folding wrote each Linear weight the product reads as its transpose, a new initializer
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    torch_grads = {}
    for name, p in module.named_parameters():
        if name in values:
            torch_grads[name] = p.grad.numpy()
        else:
            (folded,) = [w for w in weights if values[w].shape == p.shape[::-1] and np.array_equal(values[w], p.detach().numpy().T)]
            torch_grads[folded] = p.grad.numpy().T
    assert len(torch_grads) == len(list(module.parameters()))  # every parameter compared with autograd
    np.testing.assert_allclose(loss, float(module(*args)), rtol=1e-5)
    _without_rewrite(monkeypatch)
    plain_loss, plain = ort_gradients(model, weights, feeds)
    for w in weights:
        np.testing.assert_allclose(grads[w], plain[w], rtol=1e-4, atol=1e-6, err_msg=w)
        if w in torch_grads:
            np.testing.assert_allclose(grads[w], torch_grads[w], rtol=1e-3, atol=1e-5, err_msg=w)


@pytest.mark.parametrize("threads", [1, 2, 16])
def test_a_session_trains_the_rewritten_encoder_as_pytorch_does(threads, tmp_path):
    """The whole workflow on a rewritten encoder: six SGD steps of a TrainingSession against
    torch.optim.SGD on the module (losses, then every weight), and the exported inference model
    against the trained module's eval output. (SGD: the key bias's true gradient is zero, and
    Adam turns either run's round-off there into steps of lr.)"""
    import onnxruntime as ort

    from gradbuilder import TrainingParameters, TrainingSession

    module = Encoder()
    torch_module = Encoder()
    tokens, y = torch.randint(1, 30, (3, 7)), torch.randint(0, 3, (3,))
    model = export(module, (tokens, y), ["tokens", "y"], dynamo=False, opset=17)
    assert "Squeeze" in _ops(model, False) and "Squeeze" not in _ops(model, True)  # the rewrite applies
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="sgd", enable_grad_norm_clip=False)
    session = TrainingSession(model, params, sess_options=so, providers=["CPUExecutionProvider"])
    session.set_learning_rate(0.1)
    optimizer = torch.optim.SGD(torch_module.parameters(), lr=0.1)
    feeds = {"tokens": tokens.numpy(), "y": y.numpy()}
    for step in range(6):
        optimizer.zero_grad()
        want = torch_module(tokens, y)
        want.backward()
        optimizer.step()
        got = float(session.run(["loss"], feeds)[0])
        np.testing.assert_allclose(got, float(want), rtol=2e-5, err_msg=f"step {step}")
    trained = session.get_model_state()["full_precision"]
    for name, p in torch_module.named_parameters():
        np.testing.assert_allclose(trained[name], p.detach().numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
    session.export_model_for_inferencing(tmp_path / "encoder.onnx", ["loss"])
    exported = ort.InferenceSession(str(tmp_path / "encoder.onnx"), providers=["CPUExecutionProvider"])
    torch_module.eval()
    with torch.no_grad():
        np.testing.assert_allclose(exported.run(None, feeds)[0], float(torch_module(tokens, y)), rtol=1e-5)
