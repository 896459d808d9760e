"""The vectorized sampler: one jitted call over the logits of every request in the step.

R: sample rows (one per request, plus one per proposed token it verifies under speculative
decoding), V: vocabulary, K: logprobs returned per row, S: rows of the per-request state the
device keeps, W = ceil(V / 32), D: most proposals per request (num_speculative).

A request's sample rows are consecutive, for consecutive output positions; a row after
proposals sees them as accepted output (the penalties count them, the bitmask row is the
grammar's state after them), exactly as the step that would sample there without speculation.

Order, as in the seeds: logit bias (with allowed_token_ids and bad words), penalties and the
token bitmask (structured outputs, min_tokens) change the logits; greedy rows take the argmax
there, before any temperature; the others are scaled by their temperature, truncated by min_p,
top-k and top-p, and drawn by Gumbel-max (argmax of logits - log E, E ~ Exp(1)) with a key
that depends only on the request's seed and output position. Which stages run is decided at
run time by `lax.cond` on the rows' parameters, so one program per request bucket serves every
mix of parameters and a stage nobody uses costs nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxinfer.engine.execution.batch import SamplingMetadata
from jaxinfer.engine.sampling.logits_processors import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    first_argmax,
    unpack_bitmask,
)
from jaxinfer.layers import invariant


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerState:
    """Per-request state the device keeps between steps (rows are set when a request takes
    a row, counts grow with each kept sample)."""

    output_counts: jax.Array  # i32[S, V], each token's count in the request's output
    prompt_mask: jax.Array  # bool[S, V], tokens of the request's prompt
    bias: jax.Array  # f32[S, V], logit_bias, allowed_token_ids and single-token bad words
    bitmask: jax.Array  # i32[S * (1 + D), W], allowed tokens of each sample row of a request


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftProbs:
    """A draft model's q of the proposals a step's rows verify, gathered only where a random
    row reads them (a gather of R rows of V floats on every step costs as much as the rest of
    the sampler)."""

    probs: jax.Array  # f32[N, V], q of every request row's proposals
    rows: jax.Array  # i32[R], the one each sample row verifies (rows without one: any)

    def gather(self) -> jax.Array:  # f32[R, V]
        return self.probs[self.rows]


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


def process_logits(
    logits: jax.Array,  # f32[R, V]
    metadata: SamplingMetadata,
    state: SamplerState,
    rows: jax.Array,  # i32[R]
    num_speculative: int = 0,
) -> jax.Array:
    """Bias, penalties and the bitmask: what greedy and random rows both see."""
    vocab = logits.shape[-1]
    index = jnp.arange(logits.shape[0], dtype=jnp.int32)
    position = index - metadata.first_rows  # [R], the row's place among its request's rows

    def output_counts():
        counts = state.output_counts[rows]  # [R, V]
        if not num_speculative:
            return counts
        # The proposals before the row, as if accepted: drafts[first .. row - 1].
        earlier = metadata.first_rows[:, None] + jnp.arange(num_speculative)[None, :]  # [R, D]
        valid = earlier < index[:, None]
        tokens = metadata.drafts[jnp.minimum(earlier, logits.shape[0] - 1)]
        valid &= tokens >= 0
        row_ids = jnp.broadcast_to(index[:, None], tokens.shape)
        return counts.at[row_ids, jnp.maximum(tokens, 0)].add(valid.astype(counts.dtype))

    def bias(x):
        bias_rows = state.bias[rows]
        return x + jnp.where(metadata.has_bias[:, None] > 0, bias_rows, 0.0)

    def penalties(x):
        return apply_penalties(
            x,
            output_counts(),
            state.prompt_mask[rows],
            metadata.repetition_penalty,
            metadata.presence_penalty,
            metadata.frequency_penalty,
        )

    def bitmask(x):
        mask_rows = rows * (1 + num_speculative) + jnp.clip(position, 0, num_speculative)
        allowed = unpack_bitmask(state.bitmask[mask_rows], vocab)
        return jnp.where((metadata.constrained[:, None] > 0) & ~allowed, -jnp.inf, x)

    uses_bias, uses_penalties, uses_bitmask = _stages_used(metadata)
    logits = jax.lax.cond(uses_bias, bias, lambda x: x, logits)
    logits = jax.lax.cond(uses_penalties, penalties, lambda x: x, logits)
    return jax.lax.cond(uses_bitmask, bitmask, lambda x: x, logits)


def _stages_used(metadata: SamplingMetadata) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Whether any row uses the bias, the penalties, the bitmask (bool[] each)."""
    uses_penalties = jnp.any(
        (metadata.repetition_penalty != 1)
        | (metadata.presence_penalty != 0)
        | (metadata.frequency_penalty != 0)
    )
    return jnp.any(metadata.has_bias > 0), uses_penalties, jnp.any(metadata.constrained > 0)


def draw(
    logits: jax.Array,
    metadata: SamplingMetadata,
    batch_invariant: bool = False,
    draft_probs: DraftProbs | None = None,
) -> jax.Array:  # i32[R]
    """Temperature, min_p, top-k, top-p, then the Gumbel-max draw; with `draft_probs`, rows
    verifying a draft model's proposal take rejection_sample's token instead."""
    scaled = truncated(logits, metadata, batch_invariant)
    keys = request_keys(metadata.seeds, metadata.output_positions)
    exponential = jax.vmap(lambda k: jax.random.exponential(k, logits.shape[-1:]))(keys)
    sampled = first_argmax(scaled - jnp.log(exponential))
    if draft_probs is None:
        return sampled
    q = draft_probs.gather()
    verified = rejection_sample(scaled, q, metadata.drafts, keys, batch_invariant)
    return jnp.where(metadata.drafts >= 0, verified, sampled)


def rejection_sample(
    scaled: jax.Array,  # f32[R, V], the target's logits as drawn from (temperature, truncation)
    draft_probs: jax.Array,  # f32[R, V], q: the distribution each proposal was drawn from
    drafts: jax.Array,  # i32[R], the proposal each row verifies (rows without one: any)
    keys: jax.Array,  # [R], each row's key (the request's seed and output position)
    batch_invariant: bool = False,
) -> jax.Array:  # i32[R]
    """Speculative sampling (Leviathan et al., Chen et al.): the proposal d is kept with
    probability min(1, p(d) / q(d)); otherwise the token is drawn from the normalized
    max(p - q, 0). Either way the token is distributed as p. A rejected row never returns d
    (where p(d) < q(d) the residual is 0 at d; elsewhere d is always kept), so a row's token
    equals its proposal exactly when the proposal was accepted. The uniform and the residual's
    Gumbel noise come from the row's key folded with streams of their own."""
    log_softmax = invariant.log_softmax if batch_invariant else jax.nn.log_softmax
    p = jnp.exp(log_softmax(scaled))  # [R, V]
    index = jnp.maximum(drafts, 0)[:, None]
    p_d = jnp.take_along_axis(p, index, axis=-1)[:, 0]
    q_d = jnp.take_along_axis(draft_probs, index, axis=-1)[:, 0]
    uniform = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
    accepted = uniform * q_d < p_d
    residual = jnp.maximum(p - draft_probs, 0.0)
    gumbel_keys = jax.vmap(lambda k: jax.random.fold_in(k, 2))(keys)
    exponential = jax.vmap(lambda k: jax.random.exponential(k, scaled.shape[-1:]))(gumbel_keys)
    # argmax of log(r) - log(E): a draw from r / sum(r) (zero entries never win).
    corrected = first_argmax(
        jnp.where(residual > 0, jnp.log(residual), -jnp.inf) - jnp.log(exponential)
    )
    return jnp.where(accepted, drafts, corrected)


def truncated(
    logits: jax.Array, metadata: SamplingMetadata, batch_invariant: bool = False
) -> jax.Array:  # f32[R, V]
    """The logits a random row draws from: temperature, then min_p, top-k and top-p."""
    temperature = metadata.temperature
    scaled = logits / jnp.where(temperature == 0, 1.0, temperature)[:, None]
    scaled = jax.lax.cond(
        jnp.any(metadata.min_p > 0), lambda x: apply_min_p(x, metadata.min_p), lambda x: x, scaled
    )
    truncates = jnp.any((metadata.top_k > 0) | (metadata.top_p < 1))
    scaled = jax.lax.cond(
        truncates,
        lambda x: apply_top_k_top_p(x, metadata.top_k, metadata.top_p, batch_invariant),
        lambda x: x,
        scaled,
    )
    return scaled


@functools.partial(jax.jit, static_argnames=("batch_invariant", "num_speculative"))
def sample(
    logits: jax.Array,  # f32[R, V]
    metadata: SamplingMetadata,
    state: SamplerState,
    rows: jax.Array,  # i32[R], each row's request row in `state`
    *,
    batch_invariant: bool = False,
    num_speculative: int = 0,
    draft_probs: DraftProbs | None = None,
) -> SamplerOutput:
    """The rows' tokens (their logprobs, where asked for, are token_logprobs' program of its
    own, so the sampler compiles once per row count). `batch_invariant`: every float sum over a row as a fixed tree (jaxinfer.layers.invariant),
    so a row's result does not depend on the other rows. `num_speculative`: the most proposals
    a request verifies in a step (D). `draft_probs`: the distributions a draft model drew the
    rows' proposals from; random rows then verify them by rejection sampling.
    Without it a proposal is one-hot (n-gram): the row's own draw is the verification."""
    logits = logits.astype(jnp.float32)
    is_greedy = metadata.temperature == 0

    def processed_ids(logits):
        processed = process_logits(logits, metadata, state, rows, num_speculative)
        greedy_ids = first_argmax(processed)
        return jax.lax.cond(
            jnp.all(is_greedy),
            lambda: greedy_ids,
            lambda: jnp.where(
                is_greedy, greedy_ids, draw(processed, metadata, batch_invariant, draft_probs)
            ),
        )

    # Every row greedy with nothing to apply: the argmax of the logits as they are. Without
    # this branch the processing's conds and the draw's cond, both decided at run time, cost
    # XLA:CPU several times the plain argmax even when neither does anything.
    uses_bias, uses_penalties, uses_bitmask = _stages_used(metadata)
    plain = jnp.all(is_greedy) & ~(uses_bias | uses_penalties | uses_bitmask)
    token_ids = jax.lax.cond(plain, first_argmax, processed_ids, logits)
    return SamplerOutput(token_ids, None, None, None)


def token_logprobs(
    logits: jax.Array,  # f32[N, V], the model's own (before any processing)
    token_ids: jax.Array,  # i32[N]
    num_top: int,
    batch_invariant: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # f32[N], i32[N, K], f32[N, K]
    """Log-probabilities of the given tokens, and the num_top most likely tokens with theirs."""
    log_softmax = invariant.log_softmax if batch_invariant else jax.nn.log_softmax
    logprobs = log_softmax(logits.astype(jnp.float32))
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top)
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    return chosen, top_ids.astype(jnp.int32), top_logprobs
