"""The sampler's logits processors, pure functions over a batch of rows (vLLM's semantics).

R: requests, V: vocabulary, W = ceil(V / 32) bitmask words, C: top candidates per row.
Each function leaves a row unchanged when its parameter is at the neutral value (penalty 1 or
0, min_p 0, top_k 0, top_p 1), so one compiled sampler serves any mix of requests. With
`invariant` (the batch-invariant mode) the float sums are jaxinfer.layers.invariant's trees,
so a row's thresholds do not depend on the other rows; every other step is elementwise or a
max, min or top-k, exact in any order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.layers import invariant as fixed

NUM_CANDIDATES = 256  # top-k / top-p thresholds come from this many candidates when they can


ARGMAX_CHUNK = 128  # values per chunk of first_argmax's first level


def _masked_first_argmax(x: jax.Array) -> jax.Array:  # i32[...]
    """argmax over the last axis (the first index of the maximum) as a max and a masked min:
    XLA:CPU runs jnp.argmax's variadic reduction several times slower than plain reductions."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.where(x == top, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1])
    return jnp.minimum(jnp.min(index, axis=-1), x.shape[-1] - 1)


def first_argmax(x: jax.Array) -> jax.Array:  # i32[R]
    """argmax over the last axis (the first index of the maximum), in two levels: the max of
    each chunk of ARGMAX_CHUNK values, the first chunk holding the row's maximum, then the
    first index of the maximum inside it (values past the last whole chunk are compared on
    their own). Over a whole row the masked min of `_masked_first_argmax` runs far below
    XLA:CPU's plain max, and jnp.argmax slower still (tools/bench_sampler.py)."""
    size = x.shape[-1]
    whole = size // ARGMAX_CHUNK * ARGMAX_CHUNK
    if whole < 2 * ARGMAX_CHUNK:
        return _masked_first_argmax(x)
    blocks = x[..., :whole].reshape(*x.shape[:-1], whole // ARGMAX_CHUNK, ARGMAX_CHUNK)
    block_max = jnp.max(blocks, axis=-1)  # [R, whole / chunk]
    chunk = _masked_first_argmax(block_max)  # [R]: the first chunk holding the maximum
    inside = jnp.take_along_axis(blocks, chunk[..., None, None], axis=-2)[..., 0, :]  # [R, C]
    index = chunk * ARGMAX_CHUNK + _masked_first_argmax(inside)
    if whole == size:
        return index
    tail = x[..., whole:]  # [R, size - whole]: later indices, so they win only when larger
    best = jnp.take_along_axis(block_max, chunk[..., None], axis=-1)[..., 0]
    return jnp.where(tail.max(axis=-1) > best, whole + _masked_first_argmax(tail), index)


def apply_penalties(
    logits: jax.Array,  # f32[R, V]
    output_counts: jax.Array,  # i32[R, V], each token's count in the output so far
    prompt_mask: jax.Array,  # bool[R, V], tokens of the prompt
    repetition: jax.Array,  # f32[R]
    presence: jax.Array,  # f32[R]
    frequency: jax.Array,  # f32[R]
) -> jax.Array:
    """Repetition over prompt and output tokens (positive logits divided, negative multiplied),
    then frequency (times the count) and presence (once) over output tokens."""
    seen = prompt_mask | (output_counts > 0)
    penalty = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)
    logits = logits - frequency[:, None] * output_counts.astype(logits.dtype)
    return logits - presence[:, None] * (output_counts > 0).astype(logits.dtype)


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:  # bool[R, V]
    """llguidance's token bitmask i32[R, W] (bit j of word i allows token 32 i + j)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


def apply_min_p(
    logits: jax.Array,  # f32[R, V], temperature already applied
    min_p: jax.Array,  # f32[R]
) -> jax.Array:
    """Masks tokens whose probability is below min_p times the most likely token's."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
    threshold = top + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    keep = (logits >= threshold) | (min_p[:, None] <= 0)
    return jnp.where(keep, logits, -jnp.inf)


def _sortable(x: jax.Array) -> jax.Array:
    """uint32 keys whose order is the order of the float32 values."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    flipped = jnp.where(bits < 0, ~bits, bits | jnp.int32(-(2**31)))
    return jax.lax.bitcast_convert_type(flipped, jnp.uint32)


def _row_sums(invariant: bool):
    """(sum, logsumexp, cumsum) over the last axis: XLA's, or fixed trees."""
    if invariant:
        return fixed.tree_sum, functools.partial(fixed.logsumexp, keepdims=True), fixed.cumsum
    return (
        functools.partial(jnp.sum, axis=-1),
        functools.partial(jax.nn.logsumexp, axis=-1, keepdims=True),
        functools.partial(jnp.cumsum, axis=-1),
    )


def _largest_key_reaching(
    keys: jax.Array,  # u32[R, V]
    weights: jax.Array,  # f32[R, V]
    target: jax.Array,  # f32[R]
    invariant: bool = False,
) -> jax.Array:  # u32[R]
    """The largest t with sum(weights[keys >= t]) >= target, by bisection over the 32 key bits
    (exact, 32 passes over the row)."""
    row_sum = _row_sums(invariant)[0]

    def body(_, bounds):
        low, high = bounds  # invariant: low reaches the target; the answer is in [low, high]
        mid = low + (high - low) // 2 + ((high - low) & 1)
        mass = row_sum(jnp.where(keys >= mid[:, None], weights, 0.0))
        reaches = mass >= target
        return jnp.where(reaches, mid, low), jnp.where(reaches, high, mid - 1)

    rows = keys.shape[0]
    low = jnp.zeros(rows, jnp.uint32)
    high = jnp.full(rows, 0xFFFFFFFF, jnp.uint32)
    low, _ = jax.lax.fori_loop(0, 32, body, (low, high))
    return low


def apply_top_k_top_p(
    logits: jax.Array,  # f32[R, V], temperature already applied
    top_k: jax.Array,  # i32[R], 0 for all
    top_p: jax.Array,  # f32[R], 1 for all
    invariant: bool = False,
) -> jax.Array:
    """Keeps the top_k largest logits (ties at the boundary kept), then the smallest set of
    those whose renormalized probability reaches top_p.

    No full sort (a [64, 49152] sort takes most of a second on the CPU): thresholds come from
    the NUM_CANDIDATES largest values of each row, and only rows whose top_k or nucleus
    reaches past them take an exact 32-pass bisection.
    """
    _, logsumexp, cumsum = _row_sums(invariant)
    vocab = logits.shape[-1]
    num_candidates = min(NUM_CANDIDATES, vocab)
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)

    candidates, _ = jax.lax.top_k(logits, num_candidates)  # [R, C], descending
    kth = jnp.take_along_axis(candidates, jnp.minimum(k, num_candidates)[:, None] - 1, axis=1)
    k_exact = k > num_candidates  # the k-th value is beyond the candidates

    def exact_kth(_):
        ones = jnp.ones_like(logits)
        key = _largest_key_reaching(_sortable(logits), ones, k.astype(jnp.float32), invariant)
        return jnp.where(k_exact[:, None], _value_of_key(logits, key)[:, None], kth)

    kth = jax.lax.cond(jnp.any(k_exact & (k < vocab)), exact_kth, lambda _: kth, None)
    keep_k = (k >= vocab)[:, None] | (logits >= kth)
    logits = jnp.where(keep_k, logits, -jnp.inf)

    # top-p over the top-k survivors, renormalized.
    log_norm = logsumexp(logits)
    candidates = jnp.where(jnp.arange(num_candidates) < k[:, None], candidates, -jnp.inf)
    cumulative = cumsum(jnp.exp(candidates - log_norm))  # [R, C]
    # The nucleus ends at the first candidate where the cumulative mass reaches top_p.
    reached = cumulative >= top_p[:, None]
    last = jnp.argmax(reached, axis=-1)
    threshold = jnp.take_along_axis(candidates, last[:, None], axis=1)
    p_exact = (top_p < 1.0) & ~jnp.any(reached, axis=-1)

    def exact_p(_):
        probs = jnp.exp(logits - log_norm)
        key = _largest_key_reaching(_sortable(logits), probs, top_p, invariant)
        return jnp.where(p_exact[:, None], _value_of_key(logits, key)[:, None], threshold)

    threshold = jax.lax.cond(jnp.any(p_exact), exact_p, lambda _: threshold, None)
    keep_p = (top_p >= 1.0)[:, None] | (logits >= threshold)
    return jnp.where(keep_p, logits, -jnp.inf)


def _value_of_key(logits: jax.Array, key: jax.Array) -> jax.Array:  # f32[R]
    """The smallest logit of each row whose key is >= key (the threshold value itself)."""
    keys = _sortable(logits)
    return jnp.min(jnp.where(keys >= key[:, None], logits, jnp.inf), axis=-1)
