"""Manifold-constrained hyper-connections (mHC; DeepSeek-V4): the residual stream kept as N
parallel streams, collapsed into one input before each attention or FFN block and expanded
back after it, the streams mixed by a doubly-stochastic matrix (Sinkhorn-Knopp), all three
weightings computed per token from the streams themselves.

    post, comb, collapsed = mix_weights(streams, weights)     # before the block
    streams = expand(post, comb, block(collapsed), streams)   # after it
    hidden = collapse_head(streams, head)                     # after the last layer

T: tokens, N: streams (hc_mult), E: hidden size. Everything runs in float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MixWeights:
    """One hyper-connection's parameters (HF: attn_hc / ffn_hc)."""

    fn: jax.Array  # f32[(2 + N) * N, N * E], pre, post and comb logits from the streams
    base: jax.Array  # f32[(2 + N) * N]
    scale: jax.Array  # f32[3], the pre, post and comb logits' scales


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadWeights:
    """The final collapse's parameters (HF: hc_head)."""

    fn: jax.Array  # f32[N, N * E]
    base: jax.Array  # f32[N]
    scale: jax.Array  # f32[1]


def unweighted_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def mix_weights(
    streams: jax.Array,  # f32[T, N, E]
    weights: MixWeights,
    *,
    sinkhorn_iters: int,
    eps: float,  # hc_eps, the weights' floor
    norm_eps: float,  # rms_norm_eps
) -> tuple[jax.Array, jax.Array, jax.Array]:  # post f32[T, N], comb f32[T, N, N], [T, E]
    """The block's input (the streams collapsed by `pre`), and the `post` and `comb`
    weightings that expand() applies after it."""
    num_tokens, num, _ = streams.shape
    flat = unweighted_rms_norm(streams.reshape(num_tokens, -1), norm_eps)
    logits = flat @ weights.fn.T  # [T, (2 + N) * N]
    pre_logits, post_logits, comb_logits = jnp.split(logits, [num, 2 * num], axis=-1)
    pre_base, post_base, comb_base = jnp.split(weights.base, [num, 2 * num])
    pre_scale, post_scale, comb_scale = weights.scale
    pre = jax.nn.sigmoid(pre_logits * pre_scale + pre_base) + eps
    post = 2 * jax.nn.sigmoid(post_logits * post_scale + post_base)
    comb = comb_logits.reshape(num_tokens, num, num) * comb_scale + comb_base.reshape(num, num)
    comb = jax.nn.softmax(comb, axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)

    def normalize(_, comb):  # rows, then columns, to sum to 1
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        return comb / (comb.sum(axis=-2, keepdims=True) + eps)

    comb = jax.lax.fori_loop(0, sinkhorn_iters - 1, normalize, comb)
    collapsed = jnp.einsum("tn,tne->te", pre, streams)
    return post, comb, collapsed


def expand(
    post: jax.Array,  # f32[T, N]
    comb: jax.Array,  # f32[T, N, N]
    block_output: jax.Array,  # f32[T, E]
    streams: jax.Array,  # f32[T, N, E], the block's input streams
) -> jax.Array:  # f32[T, N, E]
    """The block's output expanded onto the streams, plus the input streams mixed by comb
    (stream k gains sum_j comb[j, k] * streams[j])."""
    return post[..., None] * block_output[:, None] + jnp.einsum("tjk,tje->tke", comb, streams)


def collapse_head(
    streams: jax.Array,  # f32[T, N, E]
    head: HeadWeights,
    *,
    eps: float,
    norm_eps: float,
) -> jax.Array:  # f32[T, E]
    """The streams collapsed into the hidden state the final norm and LM head read."""
    flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1), norm_eps)
    pre = jax.nn.sigmoid(flat @ head.fn.T * head.scale + head.base) + eps
    return jnp.einsum("tn,tne->te", pre, streams)
