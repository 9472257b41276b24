"""What torch's TorchScript exporter cannot export, traced as what it can, with the same values
and gradients (``converting``, around each trace):

- ``scaled_dot_product_attention(..., enable_gqa=True)`` (grouped-query attention; transformers'
  default ``sdpa`` attention calls it so when no attention mask is given): each key and value
  head repeated for the query heads that share it, as ``enable_gqa`` defines it
  (``repeat_interleave`` along the heads), then the plain call.
- transformers' mixture-of-experts layers (classes made with ``use_experts_implementation``:
  Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, ...): their default implementations count tokens
  per expert with ``histc`` and run a loop whose length depends on the routing (``grouped_mm``,
  ``eager``), which one graph cannot follow. They are traced with transformers'
  ``batched_mm`` implementation instead: each token's chosen experts' weights gathered, one
  batched matmul, the weighted sum of the top-k results. The routing (top-k, gathers, sums)
  stays in the graph, for any batch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

GRAPH_EXPERTS = "batched_mm"  # transformers' experts implementation that one graph can hold


@contextlib.contextmanager
def converting(module: torch.nn.Module):
    """While the trace of ``module`` runs: the conversions above."""
    with _experts_in_one_graph(module), _Conversions():
        yield


class _Conversions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        # one line runs every call (see export._GradientStops: the exporter needs it so)
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


@contextlib.contextmanager
def _experts_in_one_graph(module: torch.nn.Module):
    """The configs of ``module``'s transformers experts layers set to ``GRAPH_EXPERTS`` while
    it is traced, and put back after."""
    configs = {id(m.config): m.config for m in module.modules()
               if hasattr(type(m), "_apply_gate") and hasattr(getattr(m, "config", None),
                                                                "_experts_implementation_internal")}
    saved = {key: config._experts_implementation_internal for key, config in configs.items()}
    try:
        for config in configs.values():
            config._experts_implementation_internal = GRAPH_EXPERTS
        yield
    finally:
        for key, config in configs.items():
            config._experts_implementation_internal = saved[key]
