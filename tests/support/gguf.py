"""GGUF files for tests: a tiny Hugging Face model written as GGUF (llama.cpp's tensor names
and Q/K permutation), some tensors quantized."""

from __future__ import annotations

import json

import gguf
import numpy as np
from safetensors.numpy import load_file

from jaxinfer.model_loader.gguf_convert import unpermute_qk
from tests.support.gguf_q4_k import quantize_q4_k

NUM_HEADS, NUM_KV_HEADS = 4, 2


def write_gguf(hf_folder, path, quantized=None) -> dict[str, np.ndarray]:
    """Writes hf_folder as a GGUF file; returns the weights a faithful converter must recover.
    quantized: {name suffix: GGML type} of the tensors stored quantized (default: Q8_0 for
    Q8_TENSORS); the rest stay F32."""
    if quantized is None:
        quantized = dict.fromkeys(Q8_TENSORS, gguf.GGMLQuantizationType.Q8_0)
    config = json.loads((hf_folder / "config.json").read_text())
    weights = load_file(str(hf_folder / "model.safetensors"))
    tokenizer = json.loads((hf_folder / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["hidden_size"] // NUM_HEADS)
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([text for text, _ in vocab])
    writer.add_token_types([3 if text in special else 1 for text, _ in vocab])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    expected = {}
    for name, weight in weights.items():
        stored = weight
        if name.endswith("q_proj.weight"):
            stored = llama_cpp_permute(weight, NUM_HEADS)
        elif name.endswith("k_proj.weight"):
            stored = llama_cpp_permute(weight, NUM_KV_HEADS)
        qtype = next((t for suffix, t in quantized.items() if name.endswith(suffix)), None)
        if qtype is not None:
            if qtype == gguf.GGMLQuantizationType.Q4_K:  # gguf cannot quantize it
                packed = quantize_q4_k(stored)
            else:
                packed = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(gguf_name(name), packed, raw_shape=packed.shape, raw_dtype=qtype)
            roundtrip = gguf.quants.dequantize(packed, qtype).reshape(weight.shape)
            if "q_proj" in name or "k_proj" in name:
                roundtrip = unpermute_qk(roundtrip, NUM_HEADS if "q_proj" in name else NUM_KV_HEADS)
            expected[name] = roundtrip
        else:
            writer.add_tensor(gguf_name(name), stored)
            expected[name] = weight
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


Q8_TENSORS = ("mlp.gate_proj.weight", "self_attn.q_proj.weight")  # quantized; the rest stay F32


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert script: interleave the rotary halves of each head's rows."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}.weight"


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
}
