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


def _tiny(family: str):
    """A model of one of transformers' other families and a batch for it (ids or pixels or
    audio features, and labels)."""
    import transformers as tf

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, 6:] = 0
    text = dict(vocab_size=96, max_position_embeddings=64, pad_token_id=0)
    ids5 = ids[:, :5].clone()  # decoder labels
    seq2seq = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=0,
                   decoder_start_token_id=1, eos_token_id=2, bos_token_id=1)
    encoder = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # no random draws to compare
    if family == "bert":
        return tf.BertForSequenceClassification(tf.BertConfig(**text, **encoder, num_labels=3)), \
            {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2])}
    if family == "roberta":
        return tf.RobertaForSequenceClassification(tf.RobertaConfig(**{**text, "pad_token_id": 1}, **encoder,
                                                                    num_labels=3)), \
            {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([1, 0])}
    if family == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                                embd_pdrop=0.0, attn_pdrop=0.0)), \
            {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    if family == "t5":
        config = tf.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                             decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
        return tf.T5ForConditionalGeneration(config), {"input_ids": ids, "attention_mask": mask, "labels": ids5}
    if family == "bart":
        return tf.BartForConditionalGeneration(tf.BartConfig(**seq2seq, max_position_embeddings=64)), \
            {"input_ids": ids, "attention_mask": mask, "labels": ids5}
    if family == "whisper":
        config = tf.WhisperConfig(**seq2seq, num_mel_bins=8, max_source_positions=16, max_target_positions=16)
        features = torch.randn(2, 8, 32, generator=g)
        return tf.WhisperForConditionalGeneration(config), {"input_features": features, "labels": ids5}
    if family == "vit":
        config = tf.ViTConfig(**encoder, image_size=16, patch_size=4, num_labels=3)
        return tf.ViTForImageClassification(config), \
            {"pixel_values": torch.randn(2, 3, 16, 16, generator=g), "labels": torch.tensor([0, 2])}
    if family == "convnext":
        config = tf.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, image_size=32)
        return tf.ConvNextForImageClassification(config), \
            {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.tensor([0, 2])}
    raise KeyError(family)


OTHER_FAMILIES = ("bert", "roberta", "gpt2", "t5", "bart", "whisper", "vit", "convnext")


def other_model(family: str, seed: int = 0):
    """(model randomly initialised with ``seed``, its batch)."""
    torch.manual_seed(seed)
    return _tiny(family)
