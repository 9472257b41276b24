"""ORTModule trains today's decoder LLMs as PyTorch does: every causal-LM architecture of
``tests/llm_models.py`` (dense, grouped-query, mixture-of-experts, multi-head latent attention),
with transformers' default attention (``sdpa``, which asks for grouped-query attention when no
mask is given) and its eager one, without a mask and right-padded: the losses of several AdamW
steps to 1e-5 relative, the first step's gradients to 1e-4 of the largest."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

from gradbuilder.ortmodule import ORTModule

from .llm_models import ARCHITECTURES, MOE_ARCHITECTURES, OTHER_FAMILIES, batch, causal_lm, other_model

pytest.importorskip("transformers", minversion="5.0")

STEPS = 3
# transformers' default attention (sdpa) in the fast lane; the eager one with the slow tests
CASES = [pytest.param(a, attn, padded, id=f"{a}-{attn or 'sdpa'}-{'padded' if padded else 'no-mask'}",
                      marks=[pytest.mark.slow] if attn else [])
         for a in ARCHITECTURES for attn in (None, "eager") for padded in (False, True)]


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]


def train_both(model: torch.nn.Module, data: dict, steps: int = STEPS, **options):
    """The plain model and its ORTModule, each trained ``steps`` AdamW steps on ``data``: their
    losses, and their gradients of the first step."""
    plain, wrapped = copy.deepcopy(model).train(), ORTModule(copy.deepcopy(model).train(), **options)
    results = []
    for module in (plain, wrapped):
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        losses, first = [], None
        for step in range(steps):
            torch.manual_seed(100 + step)
            with _quiet():
                loss = module(**data).loss
            loss.backward()
            losses.append(loss.item())
            first = first if first is not None else [g.clone() for g in _grads(module)]
            optimizer.step()
            optimizer.zero_grad()
        results.append((losses, first))
    return results


def assert_trains_as_pytorch(model, data, **options):
    (want, want_grads), (got, got_grads) = train_both(model, data, **options)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    largest = max(g.abs().max().item() for g in want_grads)
    worst = max((a - b).abs().max().item() for a, b in zip(got_grads, want_grads))
    assert worst <= 1e-4 * largest, f"gradients differ by {worst:.2e} (largest {largest:.2e})"
    assert want[0] != want[-1]  # it trained


@pytest.mark.parametrize("architecture,attn,padded", CASES)
def test_a_causal_lm_trains_as_in_pytorch(architecture, attn, padded):
    with _quiet():
        model = causal_lm(architecture, attn)
    assert_trains_as_pytorch(model, batch(padded))


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_expert_routing_stays_in_one_graph_for_any_batch(architecture):
    """The experts run in the graph for every batch: one export serves batches whose tokens
    pick other experts (another size, other ids), with PyTorch's losses; the user's choice of
    experts implementation is put back after the export."""
    with _quiet():
        model = causal_lm(architecture)
    before = model.config._experts_implementation
    plain, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    for seed, size in ((1, 2), (2, 3), (3, 1)):
        data = batch(False, size=size, length=6 + seed, seed=seed)
        with _quiet():
            torch.testing.assert_close(wrapped(**data).loss, plain(**data).loss, rtol=1e-5, atol=0)
    (compiled,) = wrapped.compiled_graphs.values()  # one export, not one per batch size (a dict of them)
    assert not isinstance(compiled, (dict, str)), compiled
    assert model.config._experts_implementation == before
    assert wrapped.module.config._experts_implementation == before


def test_a_moe_model_with_graph_breaks_trains_as_in_pytorch(monkeypatch):
    """``graph_breaks=True`` on a mixture-of-experts model whose experts run transformers'
    grouped implementation (``histc``, a loop per expert): the operations the exporter lacks run
    in PyTorch between graphs, and the backward split takes the views read inside a subgraph
    (it used to fail with a KeyError there)."""
    from gradbuilder.ortmodule import conversions

    monkeypatch.setattr(conversions, "experts_in_one_graph", lambda module: contextlib.nullcontext())
    with _quiet():
        model = causal_lm("qwen2_moe", "eager")
    assert_trains_as_pytorch(model, batch(False), steps=2, graph_breaks=True)


@pytest.mark.parametrize("has_gate,has_bias,is_transposed", [(True, False, False), (True, True, True),
                                                              (False, True, False), (False, False, True)])
def test_the_per_expert_conversion_computes_what_transformers_experts_do(has_gate, has_bias, is_transposed):
    """``conversions.per_expert`` against transformers' ``batched_mm`` on each weight layout
    transformers' experts layers take: values and gradients (PyTorch only)."""
    import transformers
    from transformers.integrations.moe import batched_mm_experts_forward, use_experts_implementation

    from gradbuilder.ortmodule.conversions import per_expert

    experts, hidden, inner = 4, 6, 5

    class Experts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = experts
            up = 2 * inner if has_gate else inner
            shape = (lambda o, i: (experts, i, o)) if is_transposed else (lambda o, i: (experts, o, i))
            first = "gate_up_proj" if has_gate else "up_proj"
            setattr(self, first, torch.nn.Parameter(torch.randn(*shape(up, hidden))))
            self.down_proj = torch.nn.Parameter(torch.randn(*shape(hidden, inner)))
            if has_bias:
                setattr(self, f"{first}_bias", torch.nn.Parameter(torch.randn(experts, up)))
                self.down_proj_bias = torch.nn.Parameter(torch.randn(experts, hidden))
            self.act_fn = torch.nn.SiLU()

    Experts = use_experts_implementation(Experts, has_gate=has_gate, has_bias=has_bias, is_transposed=is_transposed)
    torch.manual_seed(0)
    layer = Experts(transformers.PretrainedConfig())
    x = torch.randn(7, hidden, requires_grad=True)
    routing = torch.randn(7, experts).softmax(-1).topk(2, dim=-1)
    results = []
    for forward in (batched_mm_experts_forward, per_expert):
        layer.zero_grad()
        x.grad = None
        out = forward(layer, x, routing.indices, routing.values)
        out.square().sum().backward()
        results.append((out, x.grad.clone(), [p.grad.clone() for p in layer.parameters()]))
    (want, want_x, want_p), (got, got_x, got_p) = results
    close = dict(rtol=1e-4, atol=1e-4)  # the same sums, added in another order
    torch.testing.assert_close(got, want, **close)
    torch.testing.assert_close(got_x, want_x, **close)
    for a, b in zip(got_p, want_p):
        torch.testing.assert_close(a, b, **close)


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_encoders_encoder_decoders_and_vision_and_speech_models_keep_training_as_in_pytorch(family):
    with _quiet():
        model, data = other_model(family)
    assert_trains_as_pytorch(model, data)
