"""Tiny decoders as onnxruntime-genai model folders, made here with no download: random weights
from a transformers config of each architecture, a byte-level BPE tokenizer trained on the test
text with the ``tokenizers`` library, then onnxruntime-genai's own model builder (float32 or
int4). ``genai_folder(tmp, arch, precision)`` returns the folder (genai_config.json,
tokenizer.json, model.onnx)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TEXT = "the quick brown fox jumps over the lazy dog and runs far away into the green hills"
OTHER = ["hello world from onnx", "a small model trains on the device", "seven sleepy cats sit on a warm mat"]
ARCHITECTURES = ("llama", "qwen2", "phi3", "gemma")


def _tokenizer(vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4 + OTHER * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def _config(arch: str, vocab: int, sizes: dict):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    common.update(sizes)
    if arch == "llama":
        return tf.LlamaConfig(**common), tf.LlamaForCausalLM
    if arch == "qwen2":
        return tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    if arch == "phi3":
        return tf.Phi3Config(**common, original_max_position_embeddings=common["max_position_embeddings"]), \
            tf.Phi3ForCausalLM
    if arch == "gemma":
        return tf.GemmaConfig(**common, head_dim=common["hidden_size"] // common["num_attention_heads"]), \
            tf.GemmaForCausalLM
    raise ValueError(arch)


def hf_folder(directory: Path, arch: str, seed: int = 0, **sizes) -> Path:
    """A transformers checkpoint of ``arch`` with random weights and the test tokenizer;
    ``sizes`` override the config's (hidden_size, num_hidden_layers, vocab_size, ...)."""
    import torch
    from transformers import PreTrainedTokenizerFast

    out = Path(directory) / f"{arch}-hf"
    if (out / "config.json").is_file():
        return out
    tok = _tokenizer()
    config, cls = _config(arch, tok.get_vocab_size(), sizes)
    torch.manual_seed(seed)
    cls(config).save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(out)
    return out


def genai_folder(directory: Path, arch: str, precision: str = "fp32", **sizes) -> Path:
    """onnxruntime-genai's model folder of ``arch`` (its builder run on :func:`hf_folder`)."""
    out = Path(directory) / f"{arch}-{precision}"
    if (out / "genai_config.json").is_file():
        return out
    hf = hf_folder(directory, arch, **sizes)
    run = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                          "-p", precision, "-e", "cpu", "-c", str(Path(directory) / "cache")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def onnx_lora_name(peft_name: str) -> str:
    """The LoRA input ``add_lora`` names for a PEFT parameter of these models
    (``...layers.3.self_attn.q_proj.lora_A.default.weight`` -> ``model.layers.3.attn.q_proj.lora_A.weight``)."""
    layer = int(peft_name.split(".layers.")[1].split(".")[0])
    target = peft_name.split(".self_attn.")[1].split(".")[0]
    which = "lora_A" if ".lora_A." in peft_name else "lora_B"
    return f"model.layers.{layer}.attn.{target}.{which}.weight"


def peft_model(hf: Path, a_values: dict, targets, rank: int, alpha: float, **from_pretrained):
    """transformers' model of the checkpoint ``hf`` with PEFT's LoRA on ``targets``, each A the
    ONNX model's (``a_values``: {its LoRA input: [K, r]}; PEFT keeps A as [r, K]), B zero, as
    both start."""
    import numpy as np
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf, **from_pretrained)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                                       lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name:
                p.copy_(torch.from_numpy(np.array(a_values[onnx_lora_name(name)].T)))
            elif ".lora_B." in name:
                p.zero_()
    return model
