"""The router against Hugging Face's own routers on random inputs: Qwen2-MoE, Qwen3-MoE,
OLMoE (norm_topk_prob both ways), Mixtral (always renormalized), DeepSeek-V3's sigmoid
router with its correction bias, grouped top-k and routed scaling factor, and DeepSeek-V4's
sqrt(softplus) router and its hash-routed layers' (experts fixed by the token id). Exact ties (experts
with identical router rows) are checked by what a tie leaves undetermined: torch.topk may
return either of two tied experts, jaxinfer takes the lower index."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from jaxinfer.arch_config import RouterConfig
from jaxinfer.layers.moe.routing import route
from jaxinfer.models.families.hf_config import config_from_dict

HIDDEN, EXPERTS, TOP_K, TOKENS = 32, 16, 4, 96
BASE = dict(
    vocab_size=64,
    hidden_size=HIDDEN,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=TOP_K,
)


def _families():
    for norm in (False, True):
        kw = dict(BASE, num_experts=EXPERTS, moe_intermediate_size=8, norm_topk_prob=norm)
        yield f"qwen3_moe-norm_{norm}", transformers.Qwen3MoeConfig(**kw), Qwen3MoeTopKRouter
        yield (
            f"qwen2_moe-norm_{norm}",
            transformers.Qwen2MoeConfig(**kw, shared_expert_intermediate_size=8),
            Qwen2MoeTopKRouter,
        )
        kw = dict(BASE, num_experts=EXPERTS, norm_topk_prob=norm)
        yield f"olmoe-norm_{norm}", transformers.OlmoeConfig(**kw), OlmoeTopKRouter
    config = transformers.MixtralConfig(**BASE, num_local_experts=EXPERTS)
    yield "mixtral", config, MixtralTopKRouter


FAMILIES = list(_families())


def _deepseek_config(norm: bool):
    return transformers.DeepseekV3Config(
        hidden_size=HIDDEN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=norm,
    )


def _router_config(config) -> RouterConfig:
    """jaxinfer's router for a HF config: parsed from its config.json fields (DeepSeek-V3,
    whose attention jaxinfer does not run, from its router fields)."""
    if isinstance(config, transformers.DeepseekV3Config):
        return RouterConfig(
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            scoring="sigmoid",
            renormalize=config.norm_topk_prob,
            scaling_factor=config.routed_scaling_factor,
            correction_bias=True,
            num_groups=config.n_group,
            topk_groups=config.topk_group,
        )
    fields = dict(config.to_dict(), architectures=[ARCHITECTURES[type(config)]])
    return config_from_dict(fields).moe.router


ARCHITECTURES = {
    transformers.Qwen3MoeConfig: "Qwen3MoeForCausalLM",
    transformers.Qwen2MoeConfig: "Qwen2MoeForCausalLM",
    transformers.OlmoeConfig: "OlmoeForCausalLM",
    transformers.MixtralConfig: "MixtralForCausalLM",
}


def _inputs(seed: int, ties: bool):
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32)
    if ties:  # experts 9 and 13 copy 2 and 5: their logits tie exactly with them
        weight[9], weight[13] = weight[2], weight[5]
    hidden = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    return hidden, weight


def _hf_route(router, hidden, weight, bias=None):
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(weight))
        if bias is not None:
            router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, weights, experts = router(torch.from_numpy(hidden))
    return weights.float().numpy(), experts.numpy()


def _ours(hidden, weight, config: RouterConfig, bias=None):
    logits = hidden @ weight.T  # [T, X]
    weights, experts = jax.jit(route, static_argnums=1)(logits, config, bias)
    return np.asarray(weights), np.asarray(experts)


def _by_expert(weights, experts):
    order = np.argsort(experts, axis=-1, kind="stable")
    return np.take_along_axis(weights, order, -1), np.take_along_axis(experts, order, -1)


TWINS = {2: 9, 9: 2, 5: 13, 13: 5}  # the tied experts of _inputs(ties=True)


def _check(ours, theirs, ties: bool):
    (w, e), (hw, he) = _by_expert(*ours), _by_expert(*theirs)
    np.testing.assert_allclose(np.sort(w, -1), np.sort(hw, -1), rtol=1e-5, atol=1e-7)
    if not ties:
        np.testing.assert_array_equal(e, he)
        np.testing.assert_allclose(w, hw, rtol=1e-5, atol=1e-7)
        return
    decided = 0  # tokens whose top k takes one of a tied pair and not the other
    for t in range(len(e)):
        mine, hf = set(e[t].tolist()), set(he[t].tolist())
        # any difference is one tied expert for its twin
        assert all(TWINS.get(a) in hf - mine for a in mine - hf), (t, e[t], he[t])
        for a in mine:
            if a in TWINS and TWINS[a] not in mine:
                decided += 1
                assert a < TWINS[a], f"token {t}: the tie went to {a}, not {TWINS[a]}"
    assert decided, "no tie fell on the top-k boundary: the tie case tests nothing"


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("name,config,router_class", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_router_matches_hugging_face(name, config, router_class, ties):
    hidden, weight = _inputs(0, ties)
    ours_config = _router_config(config)
    ours = _ours(hidden, weight, ours_config)
    theirs = _hf_route(router_class(config).eval(), hidden, weight)
    _check(ours, theirs, ties)


@pytest.mark.parametrize("norm", [False, True], ids=["norm_off", "norm_on"])
def test_deepseek_v3_router(norm):
    """Sigmoid scores, the correction bias in the choice only, the best 2 of 4 groups by their
    top-2 sums, renormalized or not, times routed_scaling_factor."""
    config = _deepseek_config(norm)
    hidden, weight = _inputs(1, ties=False)
    bias = np.random.default_rng(2).standard_normal(EXPERTS).astype(np.float32) * 0.1
    ours_config = _router_config(config)
    ours = _ours(hidden, weight, ours_config, bias)
    theirs = _hf_route(DeepseekV3TopkRouter(config).eval(), hidden, weight, bias)
    _check(ours, theirs, ties=False)
    # the groups matter: without them some tokens choose otherwise
    ungrouped = RouterConfig(**{**vars(ours_config), "num_groups": 1, "topk_groups": 1})
    assert np.any(_by_expert(*_ours(hidden, weight, ungrouped, bias))[1] != _by_expert(*ours)[1])


def _deepseek_v4_router_config(config) -> RouterConfig:
    return RouterConfig(
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        scoring=config.scoring_func,
        renormalize=config.norm_topk_prob,
        scaling_factor=config.routed_scaling_factor,
        correction_bias=True,
    )


def test_deepseek_v4_routers():
    """sqrt(softplus) scores, the correction bias in the choice only, renormalized, times
    routed_scaling_factor; a hash-routed layer's experts come from tid2eid[token id], weighted
    by the same scores."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4HashRouter,
        DeepseekV4TopKRouter,
    )

    config = transformers.DeepseekV4Config(
        vocab_size=64,
        hidden_size=HIDDEN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        num_hidden_layers=2,
    )
    assert config.scoring_func == "sqrtsoftplus"
    hidden, weight = _inputs(3, ties=False)
    bias = np.random.default_rng(4).standard_normal(EXPERTS).astype(np.float32) * 0.1
    ours_config = _deepseek_v4_router_config(config)
    theirs = _hf_route(DeepseekV4TopKRouter(config).eval(), hidden, weight, bias)
    _check(_ours(hidden, weight, ours_config, bias), theirs, ties=False)

    router = DeepseekV4HashRouter(config).eval()
    rng = np.random.default_rng(5)
    table = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(config.vocab_size)])
    token_ids = rng.integers(0, config.vocab_size, TOKENS)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(weight))
        router.tid2eid.copy_(torch.from_numpy(table))
        _, want_weights, want_experts = router(
            torch.from_numpy(hidden), torch.from_numpy(token_ids)
        )
    weights, experts = route(hidden @ weight.T, ours_config, bias, table[token_ids])
    np.testing.assert_array_equal(np.asarray(experts), want_experts.numpy())
    np.testing.assert_allclose(np.asarray(weights), want_weights.numpy(), rtol=1e-5, atol=1e-7)


def test_ties_go_to_the_lower_index():
    logits = np.array([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]], np.float32)
    weights, experts = _ours_logits(logits, RouterConfig(num_experts=6, top_k=2))
    assert experts.tolist() == [[1, 3]]
    np.testing.assert_allclose(weights[0, 0], weights[0, 1])


def _ours_logits(logits, config):
    weights, experts = route(logits, config)
    return np.asarray(weights), np.asarray(experts)


def test_renormalize_off_returns_probabilities_not_logits():
    """The shipped bug this guards against: with norm_topk_prob off, the weights are the
    softmax probabilities of the chosen experts (summing to less than 1), not raw logits."""
    logits = np.array([[3.0, 1.0, 0.5, -2.0]], np.float32)
    weights, experts = _ours_logits(logits, RouterConfig(num_experts=4, top_k=2))
    assert experts.tolist() == [[0, 1]]
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(weights[0], p[[0, 1]], rtol=1e-6)
    scaled, _ = _ours_logits(
        logits, RouterConfig(num_experts=4, top_k=2, renormalize=True, scaling_factor=2.5)
    )
    np.testing.assert_allclose(scaled[0], 2.5 * p[[0, 1]] / p[[0, 1]].sum(), rtol=1e-6)
