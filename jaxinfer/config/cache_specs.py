"""What each group of a model's layers keeps in the cache per request, declared once from the
architecture (vLLM's KV-cache specs): the KV-cache manager allocates, shares and frees by
these (jaxinfer.engine.scheduling.kv_cache_manager), the memory budget pays for them
(jaxinfer.config.engine_config) and describe() reports them.

- AttentionSpec: K/V per token, in blocks; with a sliding window, the blocks behind it are no
  longer read. Every attention group shares the one block pool and block table (their tokens
  sit at the same positions).
- StateSpec: one fixed-size state per request in each layer (a linear-attention layer's
  convolution and delta-rule states), in a slot per request row; with prefix caching also
  checkpointed at block boundaries.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.arch_config import LINEAR_ATTENTION, LlamaConfig
from jaxinfer.layers.state_cache import state_bytes_per_slot


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    layers: tuple[int, ...]  # the model's layer indices
    sliding_window: int | None = None  # each token sees the last W positions (None: all)

    @property
    def kind(self) -> str:
        return "full_attention" if self.sliding_window is None else "sliding_window"


@dataclasses.dataclass(frozen=True)
class StateSpec:
    layers: tuple[int, ...]
    bytes_per_slot: int  # one request's states over the group's layers

    kind = "recurrent_state"


CacheSpec = AttentionSpec | StateSpec


def layer_specs(arch: LlamaConfig, dtype) -> tuple[CacheSpec, ...]:
    """The model's layer groups, each with its spec, in the order their first layers come
    (`dtype`: the model's, which a hybrid's convolution states keep)."""
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


def released_window(specs: tuple[CacheSpec, ...]) -> int | None:
    """The window behind which a request's blocks go back to the pool: the attention groups'
    when every one slides by the same window, else None (some layer reads every block)."""
    windows = {s.sliding_window for s in specs if isinstance(s, AttentionSpec)}
    return windows.pop() if len(windows) == 1 else None


def num_attention_layers(specs: tuple[CacheSpec, ...]) -> int:
    return sum(len(s.layers) for s in specs if isinstance(s, AttentionSpec))


def state_bytes_per_request(specs: tuple[CacheSpec, ...]) -> int:
    return sum(s.bytes_per_slot for s in specs if isinstance(s, StateSpec))
