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

# Hugging Face architecture -> (llama.cpp's GGUF architecture, whether its converter permutes
# Q and K), as llama.cpp's convert_hf_to_gguf.py writes each family.
GGUF_ARCHITECTURES = {
    "LlamaForCausalLM": (gguf.MODEL_ARCH.LLAMA, True),
    "MistralForCausalLM": (gguf.MODEL_ARCH.LLAMA, True),
    "MixtralForCausalLM": (gguf.MODEL_ARCH.LLAMA, True),
    "Qwen2ForCausalLM": (gguf.MODEL_ARCH.QWEN2, False),
    "Qwen3ForCausalLM": (gguf.MODEL_ARCH.QWEN3, False),
    "Qwen2MoeForCausalLM": (gguf.MODEL_ARCH.QWEN2MOE, False),
    "Qwen3MoeForCausalLM": (gguf.MODEL_ARCH.QWEN3MOE, False),
    "OlmoeForCausalLM": (gguf.MODEL_ARCH.OLMOE, False),
    "Gemma3ForCausalLM": (gguf.MODEL_ARCH.GEMMA3, False),
}


def write_gguf(hf_folder, path, quantized=None) -> dict[str, np.ndarray]:
    """Writes hf_folder (any family of GGUF_ARCHITECTURES) as a GGUF file, with the names,
    metadata keys and Q/K permutation of llama.cpp's converter and gguf's own tensor-name map;
    returns the weights a faithful converter must recover (by Hugging Face name; experts as
    written). quantized: {name suffix: GGML type} of the tensors stored quantized (default:
    Q8_0 for Q8_TENSORS); the rest stay F32."""
    if quantized is None:
        quantized = dict.fromkeys(Q8_TENSORS, gguf.GGMLQuantizationType.Q8_0)
    config = json.loads((hf_folder / "config.json").read_text())
    arch, permuted = GGUF_ARCHITECTURES[config["architectures"][0]]
    weights = load_file(str(hf_folder / "model.safetensors"))
    tokenizer = json.loads((hf_folder / "tokenizer.json").read_text())
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    theta = (
        config.get("rope_theta") or rope.get("rope_theta") or rope["full_attention"]["rope_theta"]
    )
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(head_dim)
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if config.get("clip_qkv"):
        writer.add_clamp_kqv(config["clip_qkv"])
    if arch == gguf.MODEL_ARCH.GEMMA3 and config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
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
    names = gguf.get_tensor_name_map(arch, layers)
    expected = {}
    for name, weight in _with_packed_experts(weights).items():
        stored = weight
        if permuted and name.endswith("q_proj.weight"):
            stored = llama_cpp_permute(weight, heads)
        elif permuted and name.endswith("k_proj.weight"):
            stored = llama_cpp_permute(weight, kv_heads)
        qtype = next((t for suffix, t in quantized.items() if name.endswith(suffix)), None)
        target = gguf_name(names, name)
        if name.endswith("shared_expert_gate.weight"):
            stored = stored.reshape(-1)  # llama.cpp's [E]
        if arch == gguf.MODEL_ARCH.GEMMA3 and name.endswith("norm.weight"):
            stored = stored + np.float32(1)  # llama.cpp stores Gemma's norms as 1 + w
        if qtype is not None:
            if qtype == gguf.GGMLQuantizationType.Q4_K:  # gguf cannot quantize it
                rows = quantize_q4_k(stored.reshape(-1, stored.shape[-1]))  # experts [X, ...]
                packed = rows.reshape(*stored.shape[:-1], rows.shape[-1])
            elif qtype == gguf.GGMLQuantizationType.Q8_1:  # nor read it: zero blocks
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                packed = np.zeros((stored.shape[0], stored.shape[1] // block * size), np.uint8)
                writer.add_tensor(target, packed, raw_shape=packed.shape, raw_dtype=qtype)
                continue
            else:
                packed = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(target, packed, raw_shape=packed.shape, raw_dtype=qtype)
            roundtrip = gguf.quants.dequantize(packed, qtype).reshape(weight.shape)
            if permuted and ("q_proj" in name or "k_proj" in name):
                roundtrip = unpermute_qk(roundtrip, heads if "q_proj" in name else kv_heads)
            expected[name] = roundtrip
        else:
            writer.add_tensor(target, stored)
            expected[name] = weight
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _with_packed_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The experts of each layer as llama.cpp stores them, packed [X, ...] by projection
    ("mlp.experts.gate_proj" [X, I, E], "up_proj", "down_proj" [X, E, I]), from either layout
    transformers writes (packed gate_up [X, 2I, E]; or one tensor per expert, Mixtral's
    block_sparse_moe.experts.e.w1/w3/w2)."""
    out, per_expert = {}, {}
    for name, w in weights.items():
        parts = name.split(".")
        if "experts" in parts and name.endswith("gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = np.split(w, 2, 1)
        elif "experts" in parts and name.endswith("experts.down_proj"):
            out[name + ".weight"] = w
        elif "experts" in parts:  # model.layers.i.<block>.experts.e.<proj>.weight
            e = parts.index("experts")
            proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(
                parts[e + 2], parts[e + 2]
            )
            key = ".".join(["model", "layers", parts[2], "mlp", "experts", proj, "weight"])
            per_expert.setdefault(key, {})[int(parts[e + 1])] = w
        else:
            out[name.replace("block_sparse_moe.", "mlp.")] = w
    for key, ws in per_expert.items():
        out[key] = np.stack([ws[e] for e in sorted(ws)])
    return out


Q8_TENSORS = ("mlp.gate_proj.weight", "self_attn.q_proj.weight")  # quantized; the rest stay F32


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert script: interleave the rotary halves of each head's rows."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(names: gguf.TensorNameMap, hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face tensor (gguf's own map; packed experts by hand)."""
    base, _, kind = hf_name.rpartition(".")
    packed = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
    if ".experts." in base and base.rpartition(".")[2] in packed:
        layer = base.split(".")[2]
        return f"blk.{layer}.{packed[base.rpartition('.')[2]]}.{kind}"
    name = names.get_name(base)
    if name is None:
        raise KeyError(f"gguf has no name for {hf_name}")
    return f"{name}.{kind}"
