"""Tiny randomly initialised causal LMs of transformers' own classes (no downloads): one config
per architecture, sized so that a training step takes milliseconds."""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, head_dim=8, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])

# architecture -> (config class, what differs from COMMON)
ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2": ("Qwen2Config", {}),
    "qwen2_moe": ("Qwen2MoeConfig", {**MOE, "shared_expert_intermediate_size": 32}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", MOE),
    "phi3": ("Phi3Config", {}),
    "gemma2": ("Gemma2Config", {"query_pre_attn_scalar": 8, "sliding_window": 4}),
    "gemma3": ("Gemma3TextConfig", {"query_pre_attn_scalar": 8, "sliding_window": 4}),
    "deepseek_v3": ("DeepseekV3Config", {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                                         "qk_nope_head_dim": 4, "v_head_dim": 8, "head_dim": 4, "n_routed_experts": 4,
                                         "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                                         "first_k_dense_replace": 1, "moe_intermediate_size": 32,
                                         "n_shared_experts": 1, "num_key_value_heads": 4}),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "olmo": ("OlmoConfig", {}),
    "falcon": ("FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "starcoder2": ("Starcoder2Config", {}),
}
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def causal_lm(architecture: str, attn_implementation: str | None = None, seed: int = 0, **overrides):
    """transformers' causal-LM model of ``architecture``, randomly initialised with ``seed``;
    ``attn_implementation`` None leaves transformers' default (``sdpa``)."""
    import transformers

    name, extra = ARCHITECTURES[architecture]
    config_class = getattr(transformers, name)
    kwargs = {**COMMON, **extra, **overrides}
    if isinstance(getattr(config_class, "head_dim", None), property):  # derived (GPT-NeoX, Falcon)
        kwargs.pop("head_dim")
    torch.manual_seed(seed)
    options = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    return transformers.AutoModelForCausalLM.from_config(config_class(**kwargs), **options)


def batch(padded: bool, size: int = 2, length: int = 8, seed: int = 1) -> dict:
    """``input_ids`` and ``labels`` (the same ids, as a causal LM is trained), and with
    ``padded`` an ``attention_mask`` whose second row is right-padded (its labels -100 there)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, COMMON["vocab_size"], (size, length), generator=g)
    if not padded:
        return {"input_ids": ids, "labels": ids.clone()}
    mask = torch.ones(size, length, dtype=torch.int64)
    mask[1, length - 2:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, COMMON["pad_token_id"]), "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}
