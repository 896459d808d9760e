"""Tiny random models saved by transformers (Llama, and each family this engine runs), with a
byte-level tokenizer, for tests against HF's own outputs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from tools.tiny_tokenizer import write_tiny_tokenizer


def make_tiny_model(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random LlamaForCausalLM (or Qwen2) saved by transformers, with a byte-level tokenizer."""
    import torch
    import transformers

    arch = overrides.pop("architecture", "llama")
    config_kwargs = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    config_kwargs.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config_kwargs))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config_kwargs))
    # Random init is small; scale weights up so logits are far from uniform and bugs show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(4.0)
    model.eval().save_pretrained(folder, safe_serialization=True)
    write_tiny_tokenizer(folder, config_kwargs["vocab_size"])
    return folder


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
THINK_END_ID = 321


def make_thinking_model(folder: Path) -> Path:
    """The tiny model with `<think>` and `</think>` tokens (320, 321; not special, so kept in
    the text) and a template that opens the block unless enable_thinking is false (as Qwen3's
    thinking templates do): a reasoning model's shape of output, for the reasoning parser."""
    from tokenizers import Tokenizer

    make_tiny_model(folder, vocab_size=322, max_position_embeddings=2048)
    write_tiny_tokenizer(folder, 320)  # 320 tokens, then the two tags
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.add_tokens(["<think>", "</think>"]) == 2
    assert tokenizer.token_to_id("</think>") == THINK_END_ID
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def make_family_model(folder, family: str, seed: int = 0, **overrides):
    """A random model of `family` saved by transformers, with a byte-level tokenizer; weights
    scaled up (norms aside) so that logits are far from uniform and bugs show."""
    model_class, config_class, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**BASE, **kwargs, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):  # a linear layer's decay, as initialized
                continue
            if "norm" not in name:
                param.mul_(4.0)
            elif family in NOISY_NORMS:  # initialized to zeros: (1 + w) would hide w
                param.add_(0.2 * torch.randn_like(param))
    model.eval().save_pretrained(folder, safe_serialization=True)
    write_tiny_tokenizer(folder, BASE["vocab_size"])
    return folder


BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


MOE = dict(num_experts_per_tok=2)
NOISY_NORMS = ("gemma3", "qwen3_5", "qwen3_5_moe", "qwen3_next")
# Hybrids: two periods of a linear-attention layer and a full-attention one; partial RoPE.
HYBRID = dict(
    head_dim=16,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention"] * 2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
HYBRID_MOE = dict(
    HYBRID, **MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48
)


FAMILIES = {
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, dict(head_dim=16)),
    "qwen3_moe": (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig,
        dict(MOE, head_dim=16, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeForCausalLM,
        transformers.Qwen2MoeConfig,
        dict(MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    ),
    "mixtral": (
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig,
        dict(MOE, num_local_experts=6, intermediate_size=48),
    ),
    "olmoe": (
        transformers.OlmoeForCausalLM,
        transformers.OlmoeConfig,
        dict(MOE, num_experts=8, intermediate_size=32, clip_qkv=4.0),
    ),
    # local and global layers (the window crossed in the tests), q.k scaled by its own scalar
    "gemma3": (
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig,
        dict(
            head_dim=32,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=16,
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            tie_word_embeddings=True,
            pad_token_id=0,
        ),
    ),
    "qwen3_5": (transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig, HYBRID),
    "qwen3_5_moe": (
        transformers.Qwen3_5MoeForCausalLM,
        transformers.Qwen3_5MoeTextConfig,
        HYBRID_MOE,
    ),
    "qwen3_next": (
        transformers.Qwen3NextForCausalLM,
        transformers.Qwen3NextConfig,
        dict(HYBRID_MOE, norm_topk_prob=True),
    ),
    "mistral_sliding_window": (
        transformers.MistralForCausalLM,
        transformers.MistralConfig,
        dict(sliding_window=16),
    ),
}
