"""Ragged paged attention as a Pallas kernel: one launch for any mix of prefill chunks and
decodes in a flattened batch, reading K/V through the block table (no contiguous copy).

T: tokens, R: requests, H: query heads, K: kv heads, G = H // K, Gp: G rounded up to a power
of two, D: head dim, NB: blocks, BS: block size, MB: blocks per request, BQ: query tokens per
program, BM = BQ * Gp: query rows per program, NQB: query blocks, S: kv splits.

Work split. A program owns BQ consecutive query tokens of one request and one KV head, with
all Gp query heads of that head stacked as rows (GQA: each K/V block is read once for the
whole group). It walks the request's blocks from the block table in order, stopping at the
last position its rows may see (causal) and starting at the sliding window's first, with an
online softmax (FlashAttention). The schedule (which request and tokens each program owns) is
computed in the wrapper from query_start_loc, so a padding program sees an empty range and
costs a launch only. With S > 1 kv splits (Flash-Decoding), each program covers a slice of the
blocks and the wrapper merges the S partial results by log-sum-exp.

Batch invariance (`batch_invariant=True`). A row's result must not depend on the other rows:
the default picks BQ and S from the number of tokens (S splits the context by a count, so a
long context reduces in another order beside few tokens than beside many). Invariant: one BQ
for every batch and no splits, so every row walks its positions in iterations of P blocks
from the same block, in one order whether its token is a decode or part of a prefill chunk.
Iterations always start at a multiple of P blocks (a sliding window's first block rounded
down): where a program's rows start does not move a row's iteration boundaries, and an
iteration with nothing visible to a row leaves its sums exactly as they were.

Quantized cache (kv_quant). int8 values come with a scale per position and kv head: the key
scales multiply the scores, the value scales the probabilities before the PV product, so a
block is converted once and never materialized dequantized. fp8 values come with one scale
per kv head: folded into sm_scale (keys) and the output (values).

Layouts. Queries are regrouped once to [K, (T + BQ) * Gp, D] so a program's rows are one
contiguous tile (the BQ padding tokens keep the last tile in bounds). Each program writes its
own private output tile [BM, D], so no two programs store to the same rows and no masked
stores are needed; the wrapper gathers each token's rows back.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import gpu_lowering
from pallas_kernels.ragged_paged_attention.kv_quant import check_scale_layout
from pallas_kernels.ragged_paged_attention.reference import MASK_VALUE, token_request_index
from pallas_kernels.tiles import next_power_of_two

LOG2E = math.log2(math.e)


def default_block_q(num_tokens: int, group: int) -> int:
    """Query tokens per program: 16 rows (Triton's smallest dot) for decode-sized batches, 64
    rows for large ones, which are mostly prefill."""
    rows = 64 if num_tokens >= 512 else 16
    return max(1, rows // next_power_of_two(group))


def default_num_kv_splits(num_tokens: int, num_kv_heads: int, max_blocks: int) -> int:
    """Flash-Decoding splits: enough programs to fill a GPU's ~132 SMs when a small batch has
    long contexts (many blocks per request), else 1."""
    programs = num_tokens * num_kv_heads
    if programs >= 256 or max_blocks < 16:
        return 1
    return int(min(16, max_blocks // 8, max(1, 512 // max(programs, 1))))


def _schedule(query_start_loc, seq_lens, num_seqs, num_tokens: int, block_q: int):
    """(sched i32[NQB, 4], token_rows i32[T], token_valid bool[T]).

    sched[j] = (request, first token, end token of the request, context length) of query
    block j; a padding block owns no token (first = end = T) and an empty kv range.
    """
    num_reqs = seq_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [R]
    real = jnp.arange(num_reqs) < num_seqs[0]
    blocks_per_req = jnp.where(real, (q_lens + block_q - 1) // block_q, 0)  # [R]
    ends = jnp.cumsum(blocks_per_req)  # [R], exclusive end of each request's q blocks
    starts = ends - blocks_per_req
    num_q_blocks = -(-num_tokens // block_q) + num_reqs
    j = jnp.arange(num_q_blocks)
    req = jnp.minimum(jnp.searchsorted(ends, j, side="right"), num_reqs - 1)  # [NQB]
    used = j < ends[-1]
    first = query_start_loc[req] + (j - starts[req]) * block_q
    end = query_start_loc[req + 1]
    sched = jnp.stack(
        [
            req,
            jnp.where(used, first, num_tokens),
            jnp.where(used, end, num_tokens),
            jnp.where(used, seq_lens[req], 0),
        ],
        axis=1,
    ).astype(jnp.int32)
    tok_req = token_request_index(query_start_loc, num_tokens)  # [T]
    token_valid = tok_req < num_seqs[0]
    tok_req = jnp.minimum(tok_req, num_reqs - 1)
    offset = jnp.arange(num_tokens) - query_start_loc[tok_req]
    token_rows = (starts[tok_req] + offset // block_q) * block_q + offset % block_q
    return sched, token_rows, token_valid


def _attention_kernel(
    sched_ref,  # i32[NQB, 4]
    block_tables_ref,  # i32[R, MB + P]
    layer_ref,  # i32[1]
    q_ref,  # [K, (T + BQ) * Gp, D]
    kv_ref,  # [L, 2, NB, BS, K, D]
    scales_ref,  # f32[L, 2, NB, BS, K] ("token"), f32[L, 2, K] ("head"), unused (None)
    out_ref,  # f32[S, K, NQB, BM, D]
    lse_ref,  # f32[S, K, NQB, BM]
    *,
    block_q: int,
    group_p: int,
    blocks_per_iter: int,
    num_splits: int,
    sm_scale: float,
    sliding_window: int | None,
    scale_mode: str | None,
):
    j, kvh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_size, head_dim = kv_ref.shape[3], kv_ref.shape[5]
    rows = block_q * group_p
    span = blocks_per_iter * block_size
    req, first, end, context = (sched_ref[j, c] for c in range(4))
    layer = layer_ref[0]
    # float32 inputs get full-precision dots (a GPU's default for them is TF32)
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    q = q_ref[kvh, pl.ds(first * group_p, rows), :]  # [BM, D]
    score_scale = sm_scale
    if scale_mode == "head":
        score_scale = sm_scale * scales_ref[layer, 0, kvh]
    row_token = first + jnp.arange(rows) // group_p  # [BM]
    row_pos = context - (end - row_token)  # absolute position of each row's token
    row_ok = row_token < end
    # kv positions any row may see: [lo, hi)
    last_token = jnp.minimum(first + block_q, end) - 1
    hi = context - (end - last_token) + 1
    lo = (
        0
        if sliding_window is None
        else jnp.maximum(0, context - (end - first) - sliding_window + 1)
    )
    hi = jnp.maximum(hi, lo)
    # iterations aligned to multiples of P blocks (see the module docstring)
    first_block = lo // block_size // blocks_per_iter * blocks_per_iter
    end_block = (hi + block_size - 1) // block_size
    iters_total = (end_block - first_block + blocks_per_iter - 1) // blocks_per_iter
    per_split = (iters_total + num_splits - 1) // num_splits
    it_lo = jnp.minimum(split * per_split, iters_total)
    it_hi = jnp.minimum(it_lo + per_split, iters_total)

    def body(it, carry):
        acc, running_max, denom = carry
        block0 = first_block + it * blocks_per_iter
        blocks = block_tables_ref[req, pl.ds(block0, blocks_per_iter)]  # i32[P]
        k = kv_ref[layer, 0, blocks, :, kvh, :].reshape(span, head_dim).astype(q.dtype)  # [N, D]
        v = kv_ref[layer, 1, blocks, :, kvh, :].reshape(span, head_dim).astype(q.dtype)
        scores = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32)
        scores = scores * score_scale  # [BM, N]
        if scale_mode == "token":
            scores = scores * scales_ref[layer, 0, blocks, :, kvh].reshape(1, span)
        kv_pos = block0 * block_size + jnp.arange(span)  # [N]
        visible = (kv_pos[None, :] <= row_pos[:, None]) & row_ok[:, None]
        if sliding_window is not None:
            visible &= kv_pos[None, :] > row_pos[:, None] - sliding_window
        scores = jnp.where(visible, scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, scores.max(axis=1))
        correction = jnp.exp2((running_max - new_max) * LOG2E)
        probs = jnp.where(visible, jnp.exp2((scores - new_max[:, None]) * LOG2E), 0.0)
        denom = denom * correction + probs.sum(axis=1)
        if scale_mode == "token":
            probs = probs * scales_ref[layer, 1, blocks, :, kvh].reshape(1, span)
        acc = acc * correction[:, None] + jnp.dot(
            probs.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32
        )
        return acc, new_max, denom

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, running_max, denom = jax.lax.fori_loop(it_lo, it_hi, body, init)
    if scale_mode == "head":
        acc = acc * scales_ref[layer, 1, kvh]
    seen = denom > 0
    out_ref[split, kvh, j, :, :] = acc / jnp.where(seen, denom, 1.0)[:, None]
    lse_ref[split, kvh, j, :] = jnp.where(
        seen, running_max + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf
    )


def ragged_paged_attention(
    q: jax.Array,  # [T, H, D]
    kv_cache: jax.Array,  # [2, NB, BS, K, D] (or [L, 2, NB, BS, K, D] with `layer`)
    block_tables: jax.Array,  # i32[R, MB]
    seq_lens: jax.Array,  # i32[R], context length including this step's tokens
    query_start_loc: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    kv_blocks_per_iter: int | None = None,
    num_kv_splits: int | None = None,
    batch_invariant: bool = False,
    launch: gpu_lowering.LaunchConfig = gpu_lowering.LaunchConfig(),  # noqa: B008 (frozen)
    kv_scales: jax.Array | None = None,  # int8: f32[(L,) 2, NB, BS, K]; fp8: f32[(L,) 2, K]
    kv_scale_layout: str | None = None,  # "token" (int8), "head" (fp8)
) -> jax.Array:  # [T, H, D]; zeros for padding tokens
    """The Pallas kernel with the reference's signature (see the module docstring).
    `batch_invariant`: each row's result independent of the other rows (one BQ, no splits)."""
    num_tokens, num_heads, head_dim = q.shape
    check_scale_layout(kv_scale_layout, kv_scales, kv_cache)
    scale_mode = kv_scale_layout
    if layer is None:
        kv_cache, layer = kv_cache[None], 0
        kv_scales = None if kv_scales is None else kv_scales[None]
    if kv_scales is None:
        kv_scales = jnp.zeros((1,), jnp.float32)
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    max_blocks = block_tables.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split over {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    group_p = next_power_of_two(group)
    if batch_invariant:
        if num_kv_splits not in (None, 1):
            raise ValueError("batch_invariant attention takes no kv splits (they split by count)")
        block_q = block_q or default_block_q(0, group)
        num_kv_splits = 1
    block_q = block_q or default_block_q(num_tokens, group)
    rows = block_q * group_p
    blocks_per_iter = kv_blocks_per_iter or max(1, 64 // block_size)
    num_splits = num_kv_splits or default_num_kv_splits(num_tokens, num_kv_heads, max_blocks)

    sched, token_rows, token_valid = _schedule(
        query_start_loc, seq_lens, num_seqs, num_tokens, block_q
    )
    num_q_blocks = sched.shape[0]
    # [T, H, D] -> [K, (T + BQ) * Gp, D]: a program's rows are one contiguous tile.
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, block_q), (0, 0), (0, group_p - group), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, (num_tokens + block_q) * group_p, head_dim)
    # A block-table read may run up to one iteration past a request's last block.
    tables = jnp.pad(block_tables, ((0, 0), (0, blocks_per_iter)))
    layer_index = jnp.asarray(layer, jnp.int32).reshape(1)

    kernel = functools.partial(
        _attention_kernel,
        block_q=block_q,
        group_p=group_p,
        blocks_per_iter=blocks_per_iter,
        num_splits=num_splits,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        scale_mode=scale_mode,
    )
    out, lse = gpu_lowering.call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(
                (num_splits, num_kv_heads, num_q_blocks, rows, head_dim), jnp.float32
            ),
            jax.ShapeDtypeStruct((num_splits, num_kv_heads, num_q_blocks, rows), jnp.float32),
        ),
        grid=(num_q_blocks, num_kv_heads, num_splits),
        launch=launch,
        interpret=interpret,
        name="ragged_paged_attention",
    )(sched, tables, layer_index, qg, kv_cache, kv_scales.astype(jnp.float32))

    if num_splits > 1:  # merge the splits' partial softmaxes by log-sum-exp
        total = jax.nn.logsumexp(lse, axis=0)  # [K, NQB, BM]
        weights = jnp.where(
            jnp.isfinite(lse), jnp.exp(lse - jnp.where(jnp.isfinite(total), total, 0.0)), 0.0
        )
        out = (out * weights[..., None]).sum(axis=0)
    else:
        out = out[0]
    # [K, NQB, BM, D] -> each token's rows -> [T, H, D]
    out = out.reshape(num_kv_heads, num_q_blocks * block_q, group_p, head_dim)
    out = out[:, token_rows, :group, :]  # [K, T, G, D]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim)
    return jnp.where(token_valid[:, None, None], out, 0.0).astype(q.dtype)
