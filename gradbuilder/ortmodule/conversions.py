"""What torch's TorchScript exporter cannot export, traced as what it can, with the same values
and gradients (``converting``, around each trace):

- ``scaled_dot_product_attention(..., enable_gqa=True)`` (grouped-query attention; transformers'
  default ``sdpa`` attention calls it so when no attention mask is given): each key and value
  head repeated for the query heads that share it, as ``enable_gqa`` defines it
  (``repeat_interleave`` along the heads), then the plain call.
- transformers' mixture-of-experts layers (classes made with ``use_experts_implementation``:
  Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, ...): their default implementations count tokens
  per expert with ``histc`` and run a loop whose length depends on the routing (``grouped_mm``,
  ``eager``), which one graph cannot follow. They are traced with ``per_expert`` instead: a
  loop over every expert (their number is fixed), each taking the tokens routed to it (a
  NonZero, of any count, none included), its projections on those rows only, and adding its
  weighted result into theirs. The routing stays in the graph for any batch, with PyTorch's
  arithmetic and memory: no expert runs on tokens not routed to it, and no weight is copied
  per token (as transformers' ``batched_mm`` does, at tokens x top-k x an expert's size).
- ``index_add`` (``Tensor.index_add``/``index_add_``), which torch's exporter writes as a
  scatter where the last of repeated indices wins (it warns that the model is then wrong): as
  ScatterElements with ``reduction="add"``, every row added, repeated or not.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

GRAPH_EXPERTS = "gradbuilder_per_expert"  # the experts implementation one graph holds (``per_expert``)


@contextlib.contextmanager
def converting(module: torch.nn.Module):
    """While the trace of ``module`` runs: the conversions above."""
    with experts_in_one_graph(module), _symbolics(), _Conversions():
        yield


@contextlib.contextmanager
def _symbolics():
    """Our ONNX symbolics for the trace, in place of torch's (its own again after)."""
    torch.onnx.register_custom_op_symbolic("aten::index_add", _index_add, SCATTER_ADD_OPSET)
    try:
        yield
    finally:
        torch.onnx.unregister_custom_op_symbolic("aten::index_add", SCATTER_ADD_OPSET)


SCATTER_ADD_OPSET = 16  # ScatterElements' reduction="add"


def _index_add(g, self, dim, index, source, alpha=None):
    """``self.index_add(dim, index, source, alpha=alpha)``: ``source`` (its axis ``dim`` as long
    as ``index``) times ``alpha``, scatter-added into ``self`` along ``dim`` at ``index``."""
    from torch.onnx import symbolic_helper as sh

    dim = sh._get_const(dim, "i", "dim")
    rank = sh._get_tensor_rank(self)
    if not rank:  # unknown, or a 0-d tensor (torch requires ``source`` of the same rank)
        return sh._unimplemented("index_add", "a tensor of unknown rank or rank 0", self)
    dim = dim % rank
    if alpha is not None and not sh._is_none(alpha):
        source = g.op("Mul", source, g.op("CastLike", alpha, source))
    # the index along ``dim``, broadcast over the other axes of ``source``
    shape = [1] * rank
    shape[dim] = -1
    index = g.op("Reshape", index, g.op("Constant", value_t=torch.tensor(shape, dtype=torch.int64)))
    index = g.op("Expand", index, g.op("Shape", source))
    return g.op("ScatterElements", self, index, source, axis_i=dim, reduction_s="add")


class _Conversions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        # one line runs every call (see stops.GradientStops: the exporter needs it so)
        return _CONVERTED.get(func, func)(*args, **(kwargs or {}))


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` with ``enable_gqa``'s key and value heads repeated."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = (_repeat_heads(t, repeats) for t in (key, value))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale)


_CONVERTED = {F.scaled_dot_product_attention: _attention}


def _repeat_heads(t: torch.Tensor, repeats: int) -> torch.Tensor:
    """``t.repeat_interleave(repeats, dim=-3)`` as unsqueeze, expand and flatten (what the
    exporter writes as Unsqueeze, Expand and Reshape, for any sizes of the other axes)."""
    return t.unsqueeze(-3).expand(*([-1] * (t.dim() - 2)), repeats, -1, -1).flatten(-4, -3)


def per_expert(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts layer's forward (``hidden_states`` [tokens, hidden], the chosen
    experts and their weights [tokens, top-k]) as a fixed loop over the experts, each on the
    tokens routed to it; the layouts transformers' own implementations take (gated or not,
    concatenated or transposed weights, biases, a norm after each expert)."""
    out = torch.zeros_like(hidden_states)
    for expert in range(self.num_experts):
        token, slot = torch.where(top_k_index == expert)
        x = hidden_states[token]
        if self.has_gate:
            x = _linear(self, x, self.gate_up_proj[expert], self.gate_up_proj_bias[expert] if self.has_bias else None)
            x = self._apply_gate(x)
        else:
            x = self.act_fn(_linear(self, x, self.up_proj[expert], self.up_proj_bias[expert] if self.has_bias else None))
        x = _linear(self, x, self.down_proj[expert], self.down_proj_bias[expert] if self.has_bias else None)
        if self.has_post_expert_norm:
            x = self.post_expert_norm(x)
        out = out.index_add(0, token, (x * top_k_weights[token, slot].unsqueeze(-1)).to(out.dtype))
    return out


def _linear(layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` times an expert's weight, stored [out, in] or, transposed, [in, out]."""
    y = x @ weight if layer.is_transposed else F.linear(x, weight)
    return y if bias is None else y + bias


@contextlib.contextmanager
def experts_in_one_graph(module: torch.nn.Module):
    """The configs of ``module``'s transformers experts layers set to ``GRAPH_EXPERTS`` while
    it is traced, and put back after."""
    configs = {id(m.config): m.config for m in module.modules()
               if hasattr(type(m), "_apply_gate") and hasattr(getattr(m, "config", None),
                                                                "_experts_implementation_internal")}
    if not configs:
        yield
        return
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(GRAPH_EXPERTS, per_expert)
    saved = {key: config._experts_implementation_internal for key, config in configs.items()}
    try:
        for config in configs.values():
            config._experts_implementation_internal = GRAPH_EXPERTS
        yield
    finally:
        for key, config in configs.items():
            config._experts_implementation_internal = saved[key]
