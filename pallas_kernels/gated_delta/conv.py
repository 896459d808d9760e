"""The short causal convolution before a Gated DeltaNet layer's delta rule (depthwise, width
K, then SiLU), in pure JAX over a flattened mixed batch: each request keeps its last K - 1
inputs in a state slot, so a prefill's next chunk and each decode continue the sequence.

    y[t] = silu(sum_j w[:, j] * x[t - (K - 1) + j])   (inputs before the request's first: 0)

T: tokens, C: channels, K: kernel width, R: requests, S: state slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.reference import StateBatch
from pallas_kernels.ragged_paged_attention.reference import token_request_index


def causal_conv1d(
    x: jax.Array,  # [T, C]
    weight: jax.Array,  # [C, K]
    states: jax.Array,  # [S, C, K - 1], each request's last inputs, oldest first
    batch: StateBatch,  # (a fresh request's slot content is ignored)
    *,
    activation: bool = True,
) -> tuple[jax.Array, jax.Array]:  # (y [T, C], states with each real request's updated)
    x, weight, states = jnp.asarray(x), jnp.asarray(weight), jnp.asarray(states)
    query_start_loc, state_slots, fresh, num_seqs = batch.arrays()
    num_tokens, width = x.shape[0], weight.shape[1]
    num_reqs = state_slots.shape[0]
    request = token_request_index(query_start_loc, num_tokens)
    real = request < jnp.minimum(num_seqs[0], num_reqs)
    safe = jnp.minimum(request, num_reqs - 1)
    start = query_start_loc[safe]
    slot_states = jnp.where(fresh[:, None, None], 0, states[state_slots])  # [R, C, K - 1]

    def inputs(owner, first, rel):  # rel [..., K'] positions relative to the request's start
        from_tokens = x[jnp.clip(first[..., None] + rel, 0, num_tokens - 1)]  # [..., K', C]
        history = slot_states[owner]  # [..., C, K - 1]
        back = jnp.clip(width - 1 + rel, 0, width - 2)
        from_state = jnp.take_along_axis(history, back[..., None, :], axis=-1)  # [..., C, K']
        return jnp.where((rel >= 0)[..., None], from_tokens, jnp.swapaxes(from_state, -1, -2))

    offsets = jnp.arange(num_tokens) - start
    rel = offsets[:, None] - (width - 1) + jnp.arange(width)  # [T, K]
    window = inputs(safe, start, rel)  # [T, K, C]
    window, weight32 = window.astype(jnp.float32), weight.astype(jnp.float32)
    y = window[:, 0] * weight32[:, 0]  # [T, C]; the taps added in order (each row its own)
    for j in range(1, width):
        y = y + window[:, j] * weight32[:, j]
    if activation:
        y = jax.nn.silu(y)
    y = jnp.where(real[:, None], y, 0).astype(x.dtype)
    lengths = query_start_loc[1:] - query_start_loc[:-1]  # [R]
    rel = lengths[:, None] - (width - 1) + jnp.arange(width - 1)  # [R, K - 1]
    last = jnp.swapaxes(inputs(jnp.arange(num_reqs), query_start_loc[:-1], rel), -1, -2)
    slots = jnp.where(jnp.arange(num_reqs) < num_seqs[0], state_slots, states.shape[0])
    return y, states.at[slots].set(last.astype(states.dtype), mode="drop")
