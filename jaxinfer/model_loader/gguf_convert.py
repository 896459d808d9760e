"""Converts a llama.cpp GGUF file into a Hugging Face-style folder, for any family the registry
(jaxinfer.models.families) finds by the file's `general.architecture`.

Writes config.json, the weights as float32 safetensors (in shards of at most 2 GiB, with an
index, past that), tokenizer.json, tokenizer_config.json (the file's chat template) and
generation_config.json (its stop tokens). Quantized tensors are dequantized with the `gguf`
package; llama.cpp's row permutation of Q and K is undone where the family's converter made
it; experts stored packed are joined as transformers packs them.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file

from jaxinfer.model_loader.gguf_tensors import read_tensors
from jaxinfer.model_loader.gguf_tokenizer import generation_fields, write_json, write_tokenizer
from jaxinfer.models.families import family_for_gguf
from jaxinfer.models.families.family import GGUFMetadata, ModelFamily

SHARD_BYTES = 2 << 30


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of each head's rotary halves (rows of [out, in])."""
    out_dim = weight.shape[0]
    return (
        weight.reshape(num_heads, out_dim // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def read_metadata(reader: gguf.GGUFReader, path: Path) -> GGUFMetadata:
    return GGUFMetadata({k: f.contents() for k, f in reader.fields.items()}, str(path))


def _dequantize(tensor, path: Path) -> np.ndarray:
    """float32 [rows, cols] in Hugging Face's [out, in] order (GGUF lists dims fastest first)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, a block "
            "type that cannot be read"
        ) from None
    return np.asarray(data, dtype=np.float32).reshape(shape)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Writes the Hugging Face-style folder for `gguf_path` into `out_dir` (which must exist)."""
    gguf_path = Path(gguf_path)
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:
        raise ValueError(f"{gguf_path}: not a readable GGUF file ({e})") from None
    meta = read_metadata(reader, gguf_path)
    family = family_for_gguf(meta)
    kind = meta.require("tokenizer.ggml.model")
    if kind not in family.gguf_tokenizers:
        raise ValueError(
            f"{gguf_path}: a {family.name} file with a {kind!r} tokenizer is not supported "
            f"({', '.join(family.gguf_tokenizers)})"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{gguf_path}: GGUF rope frequency factors are not supported")
    if "token_embd.weight" not in names:
        raise ValueError(f"{gguf_path}: the file has no token_embd.weight")
    config = family.hf_config_from_gguf(meta)
    tokens = generation_fields(meta)
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config.update(
        vocab_size=int(embed.shape[-1]),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=tokens["bos_token_id"],
        eos_token_id=tokens["eos_token_id"],
    )
    _write_weights(_hf_tensors(reader, family, config, gguf_path), out_dir)
    write_json(out_dir / "config.json", config)
    write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": tokens["bos_token_id"], "eos_token_id": tokens["stop_token_ids"]},
    )
    write_tokenizer(meta, out_dir, config["max_position_embeddings"])


def hf_value(family: ModelFamily, name: str, value: np.ndarray, heads: int, kv_heads: int):
    """A dequantized GGUF tensor as Hugging Face stores the tensor `name`: the family's own
    change (Gemma's norms), Q and K rows unpermuted where llama.cpp permuted them."""
    value = family.hf_tensor_from_gguf(name, value)
    if family.gguf_qk_permuted and name.endswith("q_proj.weight"):
        value = unpermute_qk(value, heads)
    elif family.gguf_qk_permuted and name.endswith("k_proj.weight"):
        value = unpermute_qk(value, kv_heads)
    if name.endswith("mlp.shared_expert_gate.weight"):
        value = value.reshape(1, -1)  # [1, E]
    return value


class GGUFTensorReader:
    """A model's tensors in a GGUF file by Hugging Face name, dequantized to float32 when asked
    for (the interface of jaxinfer.model_loader.safetensors_loader's readers); packed experts
    joined as transformers packs them (`experts.gate_up_proj`, `experts.down_proj`)."""

    def __init__(self, path: Path, family: ModelFamily, heads: int, kv_heads: int):
        self.path, self.family, self.heads, self.kv_heads = path, family, heads, kv_heads
        self._tensors = {}
        for tensor in read_tensors(path).values():
            name = family.hf_tensor_name(tensor.name)
            if name is None:
                raise ValueError(
                    f"{path}: unexpected GGUF tensor {tensor.name!r} for {family.name}"
                )
            self._tensors[name] = tensor
        self._joined: dict[str, tuple[str, ...]] = {}  # name -> the tensors it joins (axis 1)
        for name in self._tensors:
            if name.endswith("experts.gate_proj.weight"):
                up = name.replace("gate_proj", "up_proj")
                if up in self._tensors:
                    self._joined[name.removesuffix("gate_proj.weight") + "gate_up_proj"] = (
                        name,
                        up,
                    )
            elif name.endswith("experts.down_proj.weight"):
                self._joined[name.removesuffix(".weight")] = (name,)

    def has(self, name: str) -> bool:
        return name in self._tensors or name in self._joined

    def tensor(self, name: str) -> np.ndarray:
        if name in self._joined:
            return np.concatenate([self.tensor(part) for part in self._joined[name]], axis=1)
        t = self._tensors[name]
        try:
            kind = gguf.GGMLQuantizationType[t.type_name]
            value = gguf.quants.dequantize(np.asarray(t.data), kind)
        except NotImplementedError:
            raise ValueError(
                f"{self.path}: tensor {t.name!r} is stored as {t.type_name}, a block type that "
                "cannot be read"
            ) from None
        value = np.asarray(value, np.float32).reshape(t.shape)
        return hf_value(self.family, name, value, self.heads, self.kv_heads)

    def get(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        if not self.has(name):
            raise ValueError(f"{self.path} has no tensor for {name!r} (expected shape {shape})")
        value = self.tensor(name)
        if tuple(value.shape) != shape:
            raise ValueError(
                f"{self.path}: tensor {name!r} has shape {tuple(value.shape)}, expected {shape}"
            )
        return value.astype(dtype, copy=False)


def _hf_tensors(reader, family: ModelFamily, config: dict, path: Path):
    """(Hugging Face name, float32 array) of every tensor, in the file's order; a packed
    expert gate waits for its up projection (and the other way round) to be joined."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    waiting: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = family.hf_tensor_name(tensor.name)
        if name is None:
            raise ValueError(f"{path}: unexpected GGUF tensor {tensor.name!r} for {family.name}")
        value = hf_value(family, name, _dequantize(tensor, path), heads, kv_heads)
        for part, other in (("gate_proj", "up_proj"), ("up_proj", "gate_proj")):
            if name.endswith(f"experts.{part}.weight"):  # [X, I, E] each
                pair = name.replace(part, other)
                if pair not in waiting:
                    waiting[name] = value
                    break
                gate_up = [value, waiting.pop(pair)][:: 1 if part == "gate_proj" else -1]
                yield name.replace(f"{part}.weight", "gate_up_proj"), np.concatenate(gate_up, 1)
                break
        else:
            if name.endswith("experts.down_proj.weight"):
                name = name.removesuffix(".weight")
            yield name, np.ascontiguousarray(value)
    if waiting:
        raise ValueError(f"{path}: expert tensors without their pair: {sorted(waiting)}")


def _write_weights(tensors, out_dir: Path) -> None:
    """model.safetensors, or shards of at most SHARD_BYTES and their index."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors:
        if size and size + value.nbytes > SHARD_BYTES:
            _save(shards[-1], out_dir / f"model-{len(shards):05d}.safetensors")
            shards[-1] = {k: None for k in shards[-1]}  # names kept for the index
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    if len(shards) == 1:
        _save(shards[0], out_dir / "model.safetensors")
        return
    _save(shards[-1], out_dir / f"model-{len(shards):05d}.safetensors")
    weight_map = {
        name: f"model-{i + 1:05d}.safetensors" for i, shard in enumerate(shards) for name in shard
    }
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def _save(tensors: dict[str, np.ndarray], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
