"""Converts a llama.cpp GGUF file into a Hugging Face-style folder.

Writes config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json and
generation_config.json. Quantized tensors (Q4_1, Q8_0, ...) are dequantized with the `gguf`
package, and llama.cpp's row permutation of the Q and K projections is undone.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# Control tokens that llama.cpp also treats as end of generation when the vocabulary has them.
END_OF_GENERATION_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
    "</s>",
)

# llama.cpp pre-tokenizer names -> the equivalent `tokenizers` pre-tokenizer.
_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}

_TOKEN_TYPE_CONTROL = 3

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class _Fields:
    def __init__(self, reader: gguf.GGUFReader, path: Path):
        self._reader, self._path = reader, path

    def get(self, key: str, default=None):
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self._path}: GGUF metadata has no {key!r}")
        return value


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of each head's rotary halves (rows of [out, in])."""
    out_dim = weight.shape[0]
    return (
        weight.reshape(num_heads, out_dim // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _dequantize(tensor) -> np.ndarray:
    """float32 [rows, cols] in Hugging Face's [out, in] order (GGUF lists dims fastest first)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape(shape)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Writes the Hugging Face-style folder for `gguf_path` into `out_dir` (which must exist)."""
    gguf_path = Path(gguf_path)
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:
        raise ValueError(f"{gguf_path}: not a readable GGUF file ({e})") from None
    fields = _Fields(reader, gguf_path)
    arch = fields.require("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (llama)")

    num_heads = int(fields.require("llama.attention.head_count"))
    num_kv_heads = int(fields.get("llama.attention.head_count_kv", num_heads))
    hidden = int(fields.require("llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{gguf_path}: GGUF rope frequency factors are not supported")

    tensors = {}
    for tensor in reader.tensors:
        hf_name = _hf_tensor_name(tensor.name, gguf_path)
        weight = _dequantize(tensor)
        if tensor.name.endswith("attn_q.weight"):
            weight = unpermute_qk(weight, num_heads)
        elif tensor.name.endswith("attn_k.weight"):
            weight = unpermute_qk(weight, num_kv_heads)
        tensors[hf_name] = np.ascontiguousarray(weight)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    tokens = fields.require("tokenizer.ggml.tokens")
    token_types = fields.require("tokenizer.ggml.token_type")
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    eos_id = fields.get("tokenizer.ggml.eos_token_id")
    eog_ids = _end_of_generation_ids(fields, tokens, token_types, eos_id)

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": int(fields.require("llama.feed_forward_length")),
        "num_hidden_layers": int(fields.require("llama.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": int(fields.get("llama.rope.dimension_count", hidden // num_heads)),
        "rms_norm_eps": float(fields.require("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(fields.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(fields.require("llama.context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eog_ids}
    )

    tokenizer = _build_tokenizer(fields, tokens, token_types, gguf_path)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tokens[bos_id] if bos_id is not None else None,
            "eos_token": tokens[eos_id] if eos_id is not None else None,
            "add_bos_token": bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": bool(fields.get("tokenizer.ggml.add_eos_token", False)),
            "chat_template": fields.get("tokenizer.chat_template"),
            "model_max_length": config["max_position_embeddings"],
        },
    )


def _hf_tensor_name(name: str, path: Path) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise ValueError(f"{path}: unexpected GGUF tensor {name!r}")


def _end_of_generation_ids(fields, tokens, token_types, eos_id) -> list[int]:
    ids = [] if eos_id is None else [int(eos_id)]
    eot = fields.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        ids.append(int(eot))
    for i, (text, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind == _TOKEN_TYPE_CONTROL and text in END_OF_GENERATION_TOKENS:
            ids.append(i)
    return sorted(set(ids))


def _build_tokenizer(fields, tokens, token_types, path: Path) -> Tokenizer:
    kind = fields.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported (gpt2 byte-level BPE)")
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"{path}: pre-tokenizer {pre!r} is not supported ({', '.join(_PRE_TOKENIZERS)})"
        )
    vocab = {text: i for i, text in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in fields.require("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens(
        [
            AddedToken(text, special=True, normalized=False)
            for text, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_TYPE_CONTROL
        ]
    )
    return tokenizer


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
