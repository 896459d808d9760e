"""The vectorized sampler: one jitted call over the logits of every request in the step.

R: requests, V: vocabulary, K: logprobs returned per row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxinfer.engine.batch import SamplingMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # i32[R]
    sampled_logprobs: jax.Array | None  # f32[R], log-probability of the sampled token
    top_ids: jax.Array | None  # i32[R, K]
    top_logprobs: jax.Array | None  # f32[R, K]


def request_keys(seeds: jax.Array, output_positions: jax.Array) -> jax.Array:
    """One PRNG key per row that depends only on the request's seed and output position."""

    def key(seed, position):
        base = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
        return jax.random.fold_in(base, position)

    return jax.vmap(key)(seeds, output_positions)


@functools.partial(jax.jit, static_argnames=("all_greedy", "num_logprobs"))
def sample(
    logits: jax.Array,  # f32[R, V]
    metadata: SamplingMetadata,
    *,
    all_greedy: bool,
    num_logprobs: int,
) -> SamplerOutput:
    """Greedy argmax first, taken before any temperature scaling; then, unless every row is
    greedy, a Gumbel-max draw (argmax of logits / T - log E, E ~ Exp(1)) with per-request keys."""
    logits = logits.astype(jnp.float32)
    token_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not all_greedy:
        temperature = metadata.temperature
        is_greedy = temperature == 0
        scaled = logits / jnp.where(is_greedy, 1.0, temperature)[:, None]
        keys = request_keys(metadata.seeds, metadata.output_positions)
        exponential = jax.vmap(lambda k: jax.random.exponential(k, logits.shape[-1:]))(keys)
        drawn = jnp.argmax(scaled - jnp.log(exponential), axis=-1).astype(jnp.int32)
        token_ids = jnp.where(is_greedy, token_ids, drawn)
    if not num_logprobs:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = jax.nn.log_softmax(logits, axis=-1)  # of the model's own distribution
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    sampled = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    return SamplerOutput(token_ids, sampled, top_ids.astype(jnp.int32), top_logprobs)
