"""Loads a Hugging Face Llama-family folder (config.json + *.safetensors) into jaxinfer's layout.

Checkpoints are read tensor by tensor through safetensors' memory map; the fused and stacked
parameter arrays are assembled on the host in the target dtype.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.layers.weights import mapped
from jaxinfer.model_loader.deepseek_v4_weights import load_deepseek_v4, load_deepseek_v4_mtp
from jaxinfer.model_loader.hybrid_weights import load_hybrid_layers
from jaxinfer.model_loader.quantized_checkpoint import read_linear
from jaxinfer.models.families import family_for_architecture


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: from the shard index if there is one."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid shard index ({e})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights found")
    return files


class _TensorReader:
    """name -> array over several memory-mapped safetensors files, checking shapes."""

    def __init__(self, files: list[Path], stack: contextlib.ExitStack):
        self._handles = {}
        for path in files:
            try:
                handle = stack.enter_context(safe_open(str(path), framework="numpy"))
            except Exception as e:
                raise ValueError(f"{path}: cannot read safetensors file ({e})") from None
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                self._handles[name] = (path, handle)

    def has(self, name: str) -> bool:
        return name in self._handles

    def tensor(self, name: str) -> np.ndarray:
        return self._handles[name][1].get_tensor(name)

    def get(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        if name not in self._handles:
            raise ValueError(f"checkpoint has no tensor {name!r} (expected shape {shape})")
        path, handle = self._handles[name]
        array = handle.get_tensor(name)
        if tuple(array.shape) != shape:
            raise ValueError(
                f"{path}: tensor {name!r} has shape {tuple(array.shape)}, expected {shape}"
            )
        return array.astype(dtype, copy=False)


def fuse_qkv(q, k, v, num_kv_heads: int, head_dim: int):
    """[.., H*D], [.., K*D], [.., K*D] (input features first) -> [.., K, H/K + 2, D]: each KV
    head's query heads, then its key, then its value, so splitting the K axis keeps every
    head's Q, K and V together (tensor parallelism)."""
    lead = q.shape[:-1]
    q = q.reshape(*lead, num_kv_heads, -1, head_dim)
    k = k.reshape(*lead, num_kv_heads, 1, head_dim)
    v = v.reshape(*lead, num_kv_heads, 1, head_dim)
    return np.concatenate([q, k, v], axis=-2)


def gate_up_in_out(gate, up):
    """A gated FFN's gate and up weights ([I, E] each, as checkpoints store them) as the fused
    "in_out" weight [E, 2, I]."""
    return np.stack([gate.T, up.T], axis=1)


def replicate_kv(qkv, replicas: int, xp=np):
    """[.., K, G + 2, D] -> [.., K * r, G / r + 2, D]: each KV head copied r times, each copy
    serving G / r of its query heads (for more tensor-parallel devices than KV heads)."""
    if replicas == 1:
        return qkv
    *lead, kv_heads, width, head_dim = qkv.shape
    group = width - 2
    q = qkv[..., :group, :].reshape(*lead, kv_heads * replicas, group // replicas, head_dim)
    kv = xp.repeat(qkv[..., group:, :], replicas, axis=-3)  # [.., K * r, 2, D]
    return xp.concatenate([q, kv], axis=-2)


def load_llama_params(folder: Path, config: LlamaConfig, dtype, kv_replicas: int = 1) -> dict:
    """Returns the nested dict of numpy arrays that LlamaForCausalLM's parameters take, from a
    folder of safetensors files (params_from_reader)."""
    with contextlib.ExitStack() as stack:
        reader = _TensorReader(checkpoint_files(folder), stack)
        return params_from_reader(reader, config, dtype, kv_replicas)


def load_mtp_params(folder: Path, config: LlamaConfig, dtype) -> dict | None:
    """A DeepSeek-V4 checkpoint's multi-token-prediction layer (load_deepseek_v4_mtp), or
    None where it has none."""
    with contextlib.ExitStack() as stack:
        reader = _TensorReader(checkpoint_files(folder), stack)
        return load_deepseek_v4_mtp(reader, config, dtype)


def params_from_reader(
    reader, config: LlamaConfig, dtype, kv_replicas: int = 1, skip: frozenset[str] = frozenset()
) -> dict:
    """The parameter tree from `reader` (tensors by Hugging Face name: has, tensor, get), but
    for the parameters named in `skip` (projections, "embed", "lm_head"), which the caller
    has in another form (a GGUF file's blocks, jaxinfer.model_loader.gguf_weights).

    Projections are stored as [in, out] (x @ W). Q, K and V are fused grouped by KV head,
    [E, K, H/K + 2, D], and gate and up stacked, [E, 2, I]: splitting K (or I) over devices
    gives each device whole heads (whole columns). `config` is the model's: with
    kv_replicas = r > 1 it has r times the checkpoint's KV heads (see replicate_kv). A
    quantized checkpoint's (AWQ, GPTQ) projections come as jaxinfer.layers.weights.Int4Parts,
    assembled the same way (jaxinfer.model_loader.quantized_checkpoint).
    """
    cfg = config
    if cfg.compressed is not None:  # DeepSeek-V4's own names and tree
        if skip or kv_replicas != 1:
            raise ValueError("DeepSeek-V4 loads from safetensors only, its one K=V head whole")
        return load_deepseek_v4(reader, cfg, dtype)
    E, I, V, D = cfg.hidden_size, cfg.dense_intermediate_size, cfg.vocab_size, cfg.head_dim  # noqa: E741
    K = cfg.num_key_value_heads // kv_replicas  # the checkpoint's
    q, kv = cfg.q_size, K * D

    def get(name, shape):
        return reader.get(name, shape, dtype)

    def linear(prefix, shape):  # [out, in]: a float weight, or a quantized one's Int4Parts
        if cfg.quantization is not None and reader.has(prefix + "qweight"):
            return read_linear(reader, prefix, shape, cfg.quantization)
        return get(prefix + "weight", shape)

    def stacked(fn):
        layers = [fn(f"model.layers.{i}.") for i in range(cfg.num_hidden_layers)]
        return mapped(lambda *a: np.stack(a), *layers)

    def transposed(w):
        return mapped(lambda a: a.T, w)

    def fused_qkv(q_, k_, v_):
        return mapped(lambda *a: replicate_kv(fuse_qkv(*a, K, D), kv_replicas), q_, k_, v_)

    def qkv_bias(p):
        names = [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        return fused_qkv(*(get(n, s) for n, s in zip(names, [(q,), (kv,), (kv,)], strict=True)))

    def qkv(p):
        shapes = {"q": (q, E), "k": (kv, E), "v": (kv, E)}
        return fused_qkv(
            *(transposed(linear(p + f"self_attn.{x}_proj.", shapes[x])) for x in "qkv")
        )

    def norm(name, shape):  # as the model multiplies by it (jaxinfer.arch_config)
        w = get(name, shape)
        return w + np.asarray(cfg.norm_offset, dtype) if cfg.norm_offset else w

    layers = {
        ours: stacked(lambda p, theirs=theirs: norm(p + theirs + ".weight", (E,)))
        for ours, theirs in family_for_architecture(cfg.architecture).layer_norms.items()
    }
    if cfg.hybrid is not None:  # its attention and linear-attention layers
        layers.update(load_hybrid_layers(reader, cfg, dtype))
    if "qkv_proj" not in skip and cfg.hybrid is None:
        layers["qkv_proj"] = stacked(qkv)
    if "o_proj" not in skip and cfg.hybrid is None:
        layers["o_proj"] = stacked(lambda p: transposed(linear(p + "self_attn.o_proj.", (E, q))))
    # the dense FFN, or a MoE layer's shared expert
    mlp = "mlp.shared_expert." if cfg.moe is not None else "mlp."
    if I and "gate_up_proj" not in skip:
        layers["gate_up_proj"] = stacked(
            lambda p: mapped(
                gate_up_in_out,
                linear(p + mlp + "gate_proj.", (I, E)),
                linear(p + mlp + "up_proj.", (I, E)),
            )
        )
    if I and "down_proj" not in skip:
        layers["down_proj"] = stacked(lambda p: transposed(linear(p + mlp + "down_proj.", (E, I))))
    if cfg.qk_norm is not None and cfg.hybrid is None:
        k_heads = K if cfg.qk_norm == "all" else 1
        q_width = q if cfg.qk_norm == "all" else D

        def k_norm(p):  # each KV head's part copied with the head
            w = norm(p + "self_attn.k_norm.weight", (k_heads * D,)).reshape(k_heads, D)
            return np.repeat(w, kv_replicas if k_heads > 1 else 1, axis=0).reshape(-1)

        layers["q_norm"] = stacked(lambda p: norm(p + "self_attn.q_norm.weight", (q_width,)))
        layers["k_norm"] = stacked(k_norm)
    if cfg.moe is not None:
        layers.update(load_moe_layers(reader, cfg, dtype, skip))
    if cfg.attention_bias:
        layers["qkv_bias"] = stacked(qkv_bias)
    params = {"layers": layers, "norm": norm("model.norm.weight", (E,))}
    if "embed" not in skip:
        params["embed"] = get("model.embed_tokens.weight", (V, E))
    if not cfg.tie_word_embeddings and "lm_head" not in skip:
        params["lm_head"] = get("lm_head.weight", (V, E)).T
    return {
        k: np.ascontiguousarray(v) if isinstance(v, np.ndarray) else v for k, v in params.items()
    }


def load_moe_layers(
    reader: _TensorReader, config: LlamaConfig, dtype, skip: frozenset[str] = frozenset()
) -> dict:
    """The router and the experts of every layer, stacked ("in_out"): router [L, E, X],
    experts_gate_up [L, X, E, 2, I], experts_down [L, X, I, E], and Qwen2-MoE's shared
    expert gate [L, E, 1]; but for the experts named in `skip` (kept in a GGUF file's
    blocks). Experts are read from either layout transformers writes: one tensor per expert
    (`experts.{e}.gate_proj.weight`, ...; Mixtral's `w1`/`w3`/`w2`) or all experts packed
    (`experts.gate_up_proj` [X, 2I, E] and `experts.down_proj` [X, E, I], with Mixtral's
    `block_sparse_moe.` renamed `mlp.`)."""
    cfg, moe = config, config.moe
    E, X, I = cfg.hidden_size, moe.num_experts, moe.intermediate_size  # noqa: E741
    block, (gate, up, down) = family_for_architecture(cfg.architecture).expert_names

    def get(name, shape):
        return reader.get(name, shape, dtype)

    def layer_prefix(i: int) -> str:
        prefix = f"model.layers.{i}."
        packed = prefix + "mlp.experts.gate_up_proj"
        return prefix + ("mlp." if reader.has(packed) else block)

    def gate_up(i: int) -> np.ndarray:  # [X, E, 2, I]
        p = layer_prefix(i)
        if reader.has(p + "experts.gate_up_proj"):
            packed = get(p + "experts.gate_up_proj", (X, 2 * I, E))
            return packed.reshape(X, 2, I, E).transpose(0, 3, 1, 2)
        return np.stack(
            [
                gate_up_in_out(
                    get(f"{p}experts.{e}.{gate}.weight", (I, E)),
                    get(f"{p}experts.{e}.{up}.weight", (I, E)),
                )
                for e in range(X)
            ]
        )

    def downs(i: int) -> np.ndarray:  # [X, I, E]
        p = layer_prefix(i)
        if reader.has(p + "experts.gate_up_proj"):
            return get(p + "experts.down_proj", (X, E, I)).transpose(0, 2, 1)
        return np.stack([get(f"{p}experts.{e}.{down}.weight", (E, I)).T for e in range(X)])

    layers = range(cfg.num_hidden_layers)
    out = {"router": np.stack([get(layer_prefix(i) + "gate.weight", (X, E)).T for i in layers])}
    if "experts_gate_up" not in skip:
        out["experts_gate_up"] = np.stack([gate_up(i) for i in layers])
    if "experts_down" not in skip:
        out["experts_down"] = np.stack([downs(i) for i in layers])
    if moe.shared_expert_gate:
        out["shared_expert_gate"] = np.stack(
            [get(f"model.layers.{i}.mlp.shared_expert_gate.weight", (1, E)).T for i in layers]
        )
    return out


def load_kv_scales(folder: Path, config: LlamaConfig, kv_replicas: int = 1) -> np.ndarray | None:
    """f32[L, 2, K]: the fp8 KV-cache scales a checkpoint carries (`self_attn.k_scale` and
    `v_scale` of every layer: one per layer, or one per KV head), or None without them.
    A dequantized value is its fp8 value times the scale."""
    cfg = config
    K = cfg.num_key_value_heads // kv_replicas  # the checkpoint's
    with contextlib.ExitStack() as stack:
        reader = _TensorReader(checkpoint_files(folder), stack)
        names = [
            f"model.layers.{i}.self_attn.{part}_scale"
            for i in range(cfg.num_hidden_layers)
            for part in "kv"
        ]
        present = [reader.has(name) for name in names]
        if not any(present):
            return None
        if not all(present):
            raise ValueError(f"{folder}: k_scale / v_scale are given for some layers only")
        scales = []
        for name in names:
            value = np.asarray(reader.tensor(name), np.float32).reshape(-1)
            if value.size not in (1, K) or not (np.isfinite(value).all() and (value > 0).all()):
                raise ValueError(
                    f"{folder}: {name} must be 1 or {K} positive values, got {value.tolist()}"
                )
            scales.append(np.broadcast_to(value, (K,)))
    scales = np.stack(scales).reshape(cfg.num_hidden_layers, 2, K)
    return np.repeat(scales, kv_replicas, axis=-1)  # each KV head's copies share its scale
