"""Routing: which experts each token goes to and with what weights.

One implementation of what the supported families do (and DeepSeek-V3's and V4's routers):

- scores: softmax (Mixtral, Qwen-MoE, OLMoE), sigmoid (DeepSeek-V3) or sqrt(softplus)
  (DeepSeek-V4) of the router logits, in float32;
- choice: the top k scores, plus a correction bias used for the choice only
  (e_score_correction_bias), optionally within the best `topk_groups` of `num_groups` groups of
  experts ranked by the sum of their top 2 biased scores (grouped top-k); or, in a hash-routed
  layer (DeepSeek-V4's first layers), experts fixed by the token id (tid2eid), given;
- weights: the chosen experts' unbiased scores, renormalized to sum to 1 when `renormalize`
  (norm_topk_prob; Mixtral always), then times `scaling_factor` (routed_scaling_factor).

Sums are fixed trees (jaxinfer.layers.invariant), so a token's routing does not depend on the
tokens beside it (batch_invariant). Ties go to the lower expert index (jax.lax.top_k); torch.topk, which Hugging Face uses, leaves
the order of tied values unspecified, so on an exact tie either choice is the model's.

T: tokens, X: experts, k: experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.arch_config import RouterConfig
from jaxinfer.layers.invariant import tree_sum


def route(
    logits: jax.Array,  # f32[T, X], the router's
    config: RouterConfig,
    correction_bias: jax.Array | None = None,  # f32[X]
    hashed_experts: jax.Array | None = None,  # i32[T, k], a hash-routed layer's choice
) -> tuple[jax.Array, jax.Array]:  # (weights f32[T, k], experts i32[T, k])
    """The k experts of each token, best first (as given, when hashed), and their weights."""
    logits = logits.astype(jnp.float32)
    if config.scoring == "softmax":
        exp = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        scores = exp / tree_sum(exp)[..., None]
    elif config.scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jnp.sqrt(jax.nn.softplus(logits))
    if hashed_experts is not None:
        return _weights(scores, hashed_experts, config), hashed_experts.astype(jnp.int32)
    choice = scores
    if config.correction_bias:
        if correction_bias is None:
            raise ValueError("this router needs its correction bias")
        choice = scores + correction_bias.astype(jnp.float32)
    if config.num_groups > 1:
        choice = _within_best_groups(choice, config.num_groups, config.topk_groups)
    _, experts = jax.lax.top_k(choice, config.top_k)  # [T, k]
    return _weights(scores, experts, config), experts.astype(jnp.int32)


def _weights(scores: jax.Array, experts: jax.Array, config: RouterConfig) -> jax.Array:
    """The chosen experts' scores, renormalized and scaled as the config says: f32[T, k]."""
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if config.renormalize:
        denominator = tree_sum(weights)[..., None]
        if config.scoring != "softmax":
            denominator = denominator + 1e-20  # as DeepSeek (softmax scores are positive)
        weights = weights / denominator
    if config.scaling_factor != 1.0:
        weights = weights * config.scaling_factor
    return weights


def _within_best_groups(choice: jax.Array, num_groups: int, topk_groups: int) -> jax.Array:
    """choice [T, X] with the experts outside each token's best `topk_groups` groups (ranked by
    the sum of their top 2 scores) set to -inf."""
    tokens, experts = choice.shape
    grouped = choice.reshape(tokens, num_groups, experts // num_groups)
    top2 = jax.lax.top_k(grouped, min(2, experts // num_groups))[0]
    group_scores = jnp.sum(top2, axis=-1)  # [T, groups]
    _, best = jax.lax.top_k(group_scores, topk_groups)  # [T, topk_groups]
    keep = jnp.zeros((tokens, num_groups), bool).at[jnp.arange(tokens)[:, None], best].set(True)
    keep = jnp.repeat(keep, experts // num_groups, axis=-1)  # [T, X]
    return jnp.where(keep, choice, -jnp.inf)
