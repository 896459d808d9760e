"""What each group of a model's layers keeps in the cache per request, declared once from the
architecture (vLLM's KV-cache specs): the KV-cache manager allocates, shares and frees by
these (jaxinfer.engine.scheduling.kv_cache_manager), the memory budget pays for them
(jaxinfer.config.engine_config) and describe() reports them.

- AttentionSpec: K/V per token, in blocks; with a sliding window, the blocks behind it are no
  longer read. Every attention group shares the one block pool and block table (their tokens
  sit at the same positions).
- StateSpec: one fixed-size state per request in each layer (a linear-attention layer's
  convolution and delta-rule states, a compressor's open window), in a slot per request row;
  with prefix caching also checkpointed at block boundaries.
- CompressedSpec: one entry per `ratio` tokens of context (DeepSeek-V4's compressed
  attention), in blocks of block_size entries from a pool of the kind's own, each request
  with its own table of them (jaxinfer.layers.compressed_cache).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxinfer.arch_config import LINEAR_ATTENTION, LlamaConfig
from jaxinfer.layers.compressed_cache import KIND_KEYS, compressor_bytes_per_slot
from jaxinfer.layers.state_cache import state_bytes_per_slot


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    layers: tuple[int, ...]  # the model's layer indices
    sliding_window: int | None = None  # each token sees the last W positions (None: all)
    shared_kv: bool = False  # one entry per position serves as K and V (DeepSeek-V4)

    @property
    def kind(self) -> str:
        return "full_attention" if self.sliding_window is None else "sliding_window"


@dataclasses.dataclass(frozen=True)
class StateSpec:
    layers: tuple[int, ...]
    bytes_per_slot: int  # one request's states over the group's layers

    kind = "recurrent_state"


@dataclasses.dataclass(frozen=True)
class CompressedSpec:
    layers: tuple[int, ...]
    key: str  # the store's name ("csa", "hca"; jaxinfer.layers.compressed_cache)
    ratio: int  # tokens per entry
    bytes_per_entry: int  # over the group's layers (CSA's: its entries and the indexer's keys)

    kind = "compressed_entries"


CacheSpec = AttentionSpec | StateSpec | CompressedSpec


def layer_specs(arch: LlamaConfig, dtype, num_speculative_tokens: int = 0) -> tuple[CacheSpec, ...]:
    """The model's layer groups, each with its spec, in the order their first layers come
    (`dtype`: the model's, which a hybrid's convolution states keep; DeepSeek-V4's compressor
    rings hold room for the most proposals a step verifies)."""
    if arch.compressed is not None:
        return compressed_specs(arch, dtype, num_speculative_tokens)
    groups: dict[tuple, list[int]] = {}
    for layer in range(arch.num_hidden_layers):
        if arch.hybrid is not None and arch.hybrid.layer_types[layer] == LINEAR_ATTENTION:
            key = ("state",)
        elif arch.sliding_window is not None and (
            arch.sliding_layers is None or arch.sliding_layers[layer]
        ):
            key = ("attention", arch.sliding_window)
        else:
            key = ("attention", None)
        groups.setdefault(key, []).append(layer)
    return tuple(
        StateSpec(tuple(layers), state_bytes_per_slot(arch, dtype))
        if key[0] == "state"
        else AttentionSpec(tuple(layers), key[1])
        for key, layers in groups.items()
    )


def compressed_specs(
    arch: LlamaConfig, dtype, num_speculative_tokens: int = 0
) -> tuple[CacheSpec, ...]:
    """DeepSeek-V4's: every layer's shared K=V entries in the sliding window, each compressed
    kind's entries, and the compressed layers' compressor states."""
    v4, itemsize = arch.compressed, jnp.dtype(dtype).itemsize
    specs: list[CacheSpec] = [
        AttentionSpec(tuple(range(arch.num_hidden_layers)), arch.sliding_window, shared_kv=True)
    ]
    for kind, key in KIND_KEYS.items():
        layers = tuple(i for i, t in enumerate(v4.layer_types) if t == kind)
        if layers:
            dim = arch.head_dim + (v4.index_head_dim if key == "csa" else 0)
            specs.append(CompressedSpec(layers, key, v4.ratio(kind), len(layers) * dim * itemsize))
    layers = tuple(i for i, t in enumerate(v4.layer_types) if t in KIND_KEYS)
    if layers:
        specs.append(StateSpec(layers, compressor_bytes_per_slot(arch, num_speculative_tokens)))
    return tuple(specs)


def released_window(specs: tuple[CacheSpec, ...]) -> int | None:
    """The window behind which a request's blocks go back to the pool: the attention groups'
    when every one slides by the same window, else None (some layer reads every block)."""
    windows = {s.sliding_window for s in specs if isinstance(s, AttentionSpec)}
    return windows.pop() if len(windows) == 1 else None


def num_attention_layers(specs: tuple[CacheSpec, ...]) -> int:
    return sum(len(s.layers) for s in specs if isinstance(s, AttentionSpec))


def state_bytes_per_request(specs: tuple[CacheSpec, ...]) -> int:
    return sum(s.bytes_per_slot for s in specs if isinstance(s, StateSpec))


def describe_spec(spec: CacheSpec, arch: LlamaConfig, kv_format, entry_blocks: dict) -> dict:
    """A group as describe() reports it: its kind and layers, and what it keeps: bytes per
    token of context (attention: per position, up to the window when it slides; compressed:
    the entries' bytes over the tokens each pools), or per request (states)."""
    out = {"kind": spec.kind, "layers": list(spec.layers)}
    if isinstance(spec, AttentionSpec):
        heads, dim = arch.num_key_value_heads, arch.head_dim
        per_token = kv_format.bytes_per_token(len(spec.layers), heads, dim)
        out["bytes_per_token"] = per_token // 2 if spec.shared_kv else per_token
        out["sliding_window"] = spec.sliding_window
    elif isinstance(spec, CompressedSpec):
        out["bytes_per_token"] = spec.bytes_per_entry / spec.ratio
        out["ratio"] = spec.ratio
        out["entry_blocks"] = entry_blocks[spec.key]
    else:
        out["bytes_per_request"] = spec.bytes_per_slot
    return out


def compressed_specs_of(specs: tuple[CacheSpec, ...]) -> tuple[CompressedSpec, ...]:
    return tuple(s for s in specs if isinstance(s, CompressedSpec))
