"""Export torch modules with their loss inside and compare our gradients with autograd."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import torch

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import run_onnxruntime


def export(module: torch.nn.Module, args: tuple, input_names: list[str], *, dynamo: bool, opset: int,
           dynamic_batch: bool = False) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            dyn = None
            if dynamic_batch:
                batch = torch.export.Dim("batch", min=2, max=64)
                dyn = {name: {0: batch} for name, a in zip(input_names, args) if a.dim() > 0}
            # optimize=False: the exporter's optimizer folds and deduplicates parameters and
            # fuses BatchNorm into Conv, which changes what would be trained.
            prog = torch.onnx.export(module, args, None, dynamo=True, opset_version=opset,
                                     input_names=input_names, output_names=["loss"], dynamic_shapes=dyn,
                                     verbose=False, report=False, optimize=False)
            return prog.model_proto
        f = io.BytesIO()
        axes = {name: {0: "batch"} for name, a in zip(input_names, args) if a.dim() > 0} if dynamic_batch else None
        torch.onnx.export(module, args, f, dynamo=False, opset_version=opset, input_names=input_names,
                          output_names=["loss"], training=torch.onnx.TrainingMode.PRESERVE,
                          do_constant_folding=False, dynamic_axes=axes)
        return onnx.load_from_string(f.getvalue())


def ort_gradients(model: onnx.ModelProto, weights: list[str], feeds: dict[str, np.ndarray]):
    built = GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build().get_model()
    out = run_onnxruntime(built, feeds)
    return out["loss"], {w: out[f"{w}_grad"] for w in weights}


def compare_with_torch(module: torch.nn.Module, args: tuple, input_names: list[str], *, dynamo: bool,
                       opset: int, rtol: float = 1e-3, dynamic_batch: bool = False,
                       feed_args: tuple | None = None) -> dict[str, float]:
    """Export, build gradients of every parameter, run on onnxruntime, compare with autograd.

    Returns the relative error per parameter: ||ours - torch|| / ||torch||.
    """
    torch.manual_seed(0)
    model = export(module, args, input_names, dynamo=dynamo, opset=opset, dynamic_batch=dynamic_batch)
    inits = {t.name for t in model.graph.initializer}
    params = {}  # initializer name -> parameter (tied parameters appear under one of their names)
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for name, p in module.named_parameters():
        found = [a for a in aliases[id(p)] if a in inits]
        assert found, f"parameter {name} not found as an initializer"
        params[found[0]] = p
    run_args = feed_args if feed_args is not None else args
    feeds = {name: a.detach().numpy() for name, a in zip(input_names, run_args)}
    module.zero_grad()
    loss = module(*run_args)
    loss.backward()
    our_loss, grads = ort_gradients(model, list(params), feeds)
    np.testing.assert_allclose(our_loss, loss.detach().numpy(), rtol=1e-4, atol=1e-5)
    refs = {name: p.grad.detach().numpy() if p.grad is not None else np.zeros(p.shape, np.float32)
            for name, p in params.items()}
    # relative error ||ours - torch|| / ||torch||, with a float32 noise floor for gradients that
    # are zero in exact arithmetic (a bias followed by BatchNorm, or by a softmax over the axis
    # it is broadcast along): 1e-3 of the largest parameter gradient's norm
    floor = 1e-3 * max(float(np.linalg.norm(r)) for r in refs.values())
    errors = {}
    for name, ref in refs.items():
        got = grads[name]
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        errors[name] = float(np.linalg.norm(got - ref)) / max(float(np.linalg.norm(ref)), floor)
    bad = {k: v for k, v in errors.items() if v > rtol}
    assert not bad, f"gradients differ from torch autograd (relative error > {rtol}): {bad}"
    return errors


class TinyEncoder(torch.nn.Module):
    """Embedding, a 2-layer transformer encoder (d 16, 2 heads, ff 32, dropout off), the mean
    over the sequence and a linear head; ``forward(tokens, labels)`` is the cross-entropy loss."""

    def __init__(self, vocab: int, classes: int = 5):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, 16)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, classes)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(self.enc(self.emb(x)).mean(1)), y)


def tiny_bert(vocab: int, positions: int, labels: int, intermediate: int):
    """A randomly initialised 2-layer BERT classifier (hidden 32, 4 heads), dropout off."""
    import transformers

    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=intermediate, max_position_embeddings=positions,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=labels)
    return transformers.BertForSequenceClassification(cfg)


def tiny_gpt2(vocab: int, positions: int, **config):
    """A randomly initialised 2-layer GPT-2 LM (embedding 32, 4 heads, tied), dropout off."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **config)
    return transformers.GPT2LMHeadModel(cfg)
