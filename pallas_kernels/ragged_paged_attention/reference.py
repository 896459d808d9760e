"""Ragged paged attention in pure JAX: the reference for the Pallas kernel and the CPU path.

One flattened batch mixes prefill chunks and decodes. Request r owns the query tokens
query_start_loc[r] : query_start_loc[r + 1]; these are the last tokens of its context, whose
K/V (already written to the cache) live in the blocks block_tables[r]. Attention is causal.

T: tokens, R: requests, H: query heads, K: kv heads, G = H // K, D: head dim,
NB: blocks in the pool, BS: block size, MB: blocks per request, C: kv positions per chunk.

Memory: the KV context is walked in chunks of C positions with an online softmax, so nothing of
size T x max_model_len is materialized, and the loop stops at the longest context in the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.kv_quant import check_scale_layout

MASK_VALUE = -1e30  # finite, so a fully masked row gives zeros rather than NaN


def default_kv_chunk_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks per kv chunk: about 4096 token x position pairs per chunk, between 1 and 4 blocks.

    Every token gathers the whole chunk and the last chunk is mostly masked, so short chunks
    waste less; long ones run the loop fewer times (on the default model, large prefill
    steps ran best with 1-block chunks and decode batches with 4).
    """
    return max(1, min(4, 4096 // (num_tokens * block_size)))


def token_request_index(query_start_loc: jax.Array, num_tokens: int) -> jax.Array:
    """i32[T]: the request each token belongs to (R or more for padding tokens)."""
    return jnp.searchsorted(query_start_loc[1:], jnp.arange(num_tokens), side="right")


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, H, D]
    kv_cache: jax.Array,  # [2, NB, BS, K, D], one layer's cache (or [L, 2, ...] with `layer`)
    block_tables: jax.Array,  # i32[R, MB]
    seq_lens: jax.Array,  # i32[R], context length including this step's tokens
    query_start_loc: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1], requests that are real (the rest are padding)
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,
    kv_chunk_blocks: int | None = None,
    kv_scales: jax.Array | None = None,
    kv_scale_layout: str | None = None,
) -> jax.Array:  # [T, H, D]; zeros for padding tokens
    """Causal attention of each request's new tokens over its paged context.

    With `layer`, kv_cache is the whole [L, 2, NB, BS, K, D] cache and only that layer's blocks
    are gathered, so no per-layer copy of the cache is ever made.

    A quantized cache (kv_quant) comes with `kv_scales` and their `kv_scale_layout`: "token",
    f32[(L,) 2, NB, BS, K] beside int8 values, each gathered chunk dequantized as it is read;
    or "head", f32[(L,) 2, K] beside fp8 values, the key scales folded into the queries and
    the value scales into the output.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[-3], kv_cache.shape[-2]
    check_scale_layout(kv_scale_layout, kv_scales, kv_cache)
    per_token = kv_scale_layout == "token"
    if layer is None:
        kv_cache, layer = kv_cache[None], 0
        kv_scales = None if kv_scales is None else kv_scales[None]
    num_reqs, max_blocks = block_tables.shape
    group = num_heads // num_kv_heads
    if kv_chunk_blocks is None:
        kv_chunk_blocks = default_kv_chunk_blocks(num_tokens, block_size)
    chunk_len = kv_chunk_blocks * block_size

    # Each token's request, absolute position, and how many kv positions it may see.
    req = token_request_index(query_start_loc, num_tokens)  # [T]
    valid = req < num_seqs[0]
    req = jnp.minimum(req, num_reqs - 1)
    query_end = query_start_loc[req + 1]
    position = seq_lens[req] - (query_end - jnp.arange(num_tokens))  # [T]
    visible = jnp.where(valid, position + 1, 0)  # [T]
    first_visible = (
        jnp.zeros_like(position) if sliding_window is None else position - sliding_window + 1
    )

    pad = (-max_blocks) % kv_chunk_blocks
    block_tables = jnp.pad(block_tables, ((0, 0), (0, pad)))  # i32[R, MB'], MB' % chunk == 0

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * sm_scale
    if kv_scales is not None and not per_token:
        qg = qg * kv_scales[layer, 0][:, None, None]  # the key scale of each head
    num_chunks = (jnp.max(visible) + chunk_len - 1) // chunk_len

    def chunk_step(chunk, carry):
        running_max, denom, acc = carry  # [T, K, G], [T, K, G], [T, K, G, D]
        blocks = jax.lax.dynamic_slice_in_dim(
            block_tables, chunk * kv_chunk_blocks, kv_chunk_blocks, axis=1
        )[req]  # i32[T, kv_chunk_blocks]
        k = kv_cache[layer, 0, blocks].reshape(num_tokens, chunk_len, num_kv_heads, head_dim)
        v = kv_cache[layer, 1, blocks].reshape(num_tokens, chunk_len, num_kv_heads, head_dim)
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        if per_token:  # [T, C, K] scales of the chunk's positions
            k = k * kv_scales[layer, 0, blocks].reshape(num_tokens, chunk_len, -1)[..., None]
            v = v * kv_scales[layer, 1, blocks].reshape(num_tokens, chunk_len, -1)[..., None]
        scores = jnp.einsum("tkgd,tckd->tkgc", qg, k)  # [T, K, G, C]
        kv_pos = chunk * chunk_len + jnp.arange(chunk_len)  # [C]
        mask = (kv_pos[None, :] < visible[:, None]) & (kv_pos[None, :] >= first_visible[:, None])
        scores = jnp.where(mask[:, None, None, :], scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        correction = jnp.exp(running_max - new_max)
        probs = jnp.exp(scores - new_max[..., None])
        probs = jnp.where(mask[:, None, None, :], probs, 0.0)
        denom = denom * correction + probs.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("tkgc,tckd->tkgd", probs, v)
        return new_max, denom, acc

    init = (
        jnp.full((num_tokens, num_kv_heads, group), MASK_VALUE, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_chunks, chunk_step, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    if kv_scales is not None and not per_token:
        out = out * kv_scales[layer, 1][:, None, None]  # the value scale of each head
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def write_kv_reference(
    kv_cache: jax.Array,  # [L, 2, NB, BS, K, D]
    layer: jax.Array,  # i32[]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    slot_mapping: jax.Array,  # i32[T]; padding tokens point into the null block 0
) -> jax.Array:
    """Scatters this step's K/V into one layer of the cache, in place when the cache is donated."""
    block_size = kv_cache.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_cache = kv_cache.at[layer, 0, blocks, offsets].set(k.astype(kv_cache.dtype))
    return kv_cache.at[layer, 1, blocks, offsets].set(v.astype(kv_cache.dtype))
