"""A GGUF file's 4-bit blocks (Q4_0, Q4_1, Q4_K) of a Llama model's projections as int4
groups of 32 (pallas_kernels.int4_matmul.reference), in the engine's parameter order ("out_in"
rows: QKV fused by KV head, gate then up): under `quantization=int4` the engine takes them as
its int4 weights, the file's values bit for bit rather than quantized again.

The float32 weights the engine loads were dequantized from these very blocks
(jaxinfer.model_loader.gguf_convert); `verified_blocks` keeps a weight's blocks only if they
dequantize to the loaded weight bit for bit, so the two are interchangeable. (Weights read in
the file's own formats, every type: jaxinfer.model_loader.gguf_weights.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.model_loader.gguf_convert import unpermute_qk
from jaxinfer.model_loader.gguf_tensors import GGUFTensor, read_tensors
from jaxinfer.model_loader.safetensors_loader import fuse_qkv
from jaxinfer.models.families import family_for_architecture
from jaxinfer.models.params import LAYER_PROJECTIONS
from pallas_kernels.gguf_matmul.reference import FOUR_BIT, to_planes
from pallas_kernels.int4_matmul.reference import dequantize as int4_dequantize

BLOCK = 32


@dataclasses.dataclass(frozen=True)
class BlockWeight:
    fmt: str  # "int4": a Q4_0 / Q4_1 / Q4_K tensor as int4 groups of 32
    qs: np.ndarray  # u8[*lead, N, K / 2]
    scales: np.ndarray  # f32[*lead, N, K / 32, 2] (scale, bias)

    def dequantized(self) -> np.ndarray:  # f32[*lead, N, K]
        return int4_dequantize(self.qs, self.scales[..., 0], self.scales[..., 1])


def _blocks(tensor: GGUFTensor) -> BlockWeight | None:
    """One GGUF tensor's blocks as int4 groups of 32, rows in the file's order; None for
    other formats."""
    if tensor.type_name not in INT4_TYPES:
        return None
    qs, scale, bias = int4_from_gguf(tensor.type_name, tensor.data)
    scales = np.stack([scale.astype(np.float32), bias.astype(np.float32)], axis=-1)
    return BlockWeight("int4", qs, scales)


INT4_TYPES = FOUR_BIT  # GGUF types that are int4 groups of 32 as they are


def int4_from_gguf(fmt: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0, Q4_1 or Q4_K tensor's raw blocks (u8[N, bytes per row]) as int4 groups of 32
    (pallas_kernels.int4_matmul.reference): qs u8[N, K / 2], scale and bias [N, K / 32],
    the same values (pallas_kernels.gguf_matmul.reference, the planes of every format)."""
    if fmt not in INT4_TYPES:
        raise ValueError(f"{fmt} is not a 4-bit format ({', '.join(INT4_TYPES)})")
    return to_planes(fmt, raw)


def _one_format(weights: list[BlockWeight | None]) -> bool:
    """Whether every weight has blocks, all in the same format."""
    return all(w is not None for w in weights) and len({w.fmt for w in weights}) == 1


def _rows(weights: list[BlockWeight], order: np.ndarray | None = None) -> BlockWeight | None:
    """The weights' rows concatenated (then taken in `order`); None unless one format."""
    if not _one_format(weights):
        return None
    qs = np.concatenate([w.qs for w in weights])
    scales = np.concatenate([w.scales for w in weights])
    if order is not None:
        qs, scales = qs[order], scales[order]
    return BlockWeight(weights[0].fmt, qs, scales)


def _stack(layers: list[BlockWeight | None]) -> BlockWeight | None:
    if not _one_format(layers):
        return None
    return BlockWeight(
        layers[0].fmt, np.stack([w.qs for w in layers]), np.stack([w.scales for w in layers])
    )


def _qkv_order(config: LlamaConfig) -> np.ndarray:
    """Rows of [q; k; v] in the fused "out_in" QKV order [K, G + 2, D] (fuse_qkv applied to
    row numbers)."""
    q, kv = config.q_size, config.num_key_value_heads * config.head_dim
    numbers = np.arange(q + 2 * kv)[None]
    fused = fuse_qkv(
        numbers[:, :q],
        numbers[:, q : q + kv],
        numbers[:, q + kv :],
        config.num_key_value_heads,
        config.head_dim,
    )
    return fused.reshape(-1)


def load_gguf_blocks(path: Path, config: LlamaConfig) -> dict:
    """{"layers": {name: BlockWeight [L, N, ...]}} for the projections whose tensors are int4
    groups of 32 in every layer (INT4_TYPES; a weight may mix them across layers)."""
    tensors = read_tensors(path)
    permuted = family_for_architecture(config.architecture).gguf_qk_permuted

    def get(name: str) -> BlockWeight | None:
        return _blocks(tensors[name]) if name in tensors else None

    def q_rows(layer: int, part: str, heads: int) -> BlockWeight | None:
        w = get(f"blk.{layer}.attn_{part}.weight")
        if w is None or not permuted:
            return w
        return BlockWeight(w.fmt, unpermute_qk(w.qs, heads), unpermute_qk(w.scales, heads))

    qkv_order = _qkv_order(config)
    per_layer: dict[str, list] = {name: [] for name in LAYER_PROJECTIONS}
    for i in range(config.num_hidden_layers):
        q = q_rows(i, "q", config.num_attention_heads)
        k = q_rows(i, "k", config.num_key_value_heads)
        per_layer["qkv_proj"].append(_rows([q, k, get(f"blk.{i}.attn_v.weight")], qkv_order))
        per_layer["o_proj"].append(get(f"blk.{i}.attn_output.weight"))
        gate, up = get(f"blk.{i}.ffn_gate.weight"), get(f"blk.{i}.ffn_up.weight")
        per_layer["gate_up_proj"].append(_rows([gate, up]))
        per_layer["down_proj"].append(get(f"blk.{i}.ffn_down.weight"))
    layers = {name: _stack(ws) for name, ws in per_layer.items()}
    return {"layers": {name: w for name, w in layers.items() if w is not None}}


def verified_blocks(blocks: dict, params: dict) -> tuple[dict, list[str]]:
    """(the blocks that dequantize bit for bit to their weight in `params`, the names of those
    that do not). `params`: the "out_in" tree of weights (projections [L, *out, K];
    jaxinfer.layers.weights.Dense)."""
    kept: dict = {"layers": {}}
    rejected = []
    for name, w in blocks["layers"].items():
        weight = params["layers"][name].w  # [L, *out, K]
        exact = weight.shape[0] == w.qs.shape[0] and all(
            _same_values(w_layer.dequantized(), np.asarray(weight[i]).reshape(-1, weight.shape[-1]))
            for i, w_layer in enumerate(_layers(w))
        )
        if exact:
            kept["layers"][name] = w
        else:
            rejected.append(name)
    return kept, rejected


def _layers(w: BlockWeight):
    for i in range(w.qs.shape[0]):
        yield BlockWeight(w.fmt, w.qs[i], w.scales[i])


def _same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values in float32, bit for bit but for the sign of zero: Q4_0's d (q - 8) is -0.0
    where d < 0 and q = 8, its int4 form q d + (-8 d) is +0.0 (equal in every product)."""
    return a.shape == b.shape and b.dtype == np.float32 and np.array_equal(a, b)
