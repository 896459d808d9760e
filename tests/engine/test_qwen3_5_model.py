"""Qwen3.5's hybrid decoder (jaxinfer.models.qwen3_5) against HF transformers' own
Qwen3_5ForCausalLM with the same random weights (float32): every position's logits of a
prompt in one step, and the prompt in two steps beside another request, the second step
continuing from the KV cache and the linear layers' state slots the first left (both forms
of the delta rule)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxinfer.layers.kv_cache import KVCache
from jaxinfer.models.inputs import BatchInputs
from jaxinfer.models.qwen3_5 import HybridConfig, forward, params_from_hf
from pallas_kernels.gated_delta.reference import StateBatch

pytestmark = pytest.mark.engine

BLOCK, BLOCKS, SLOTS = 8, 16, 4


@pytest.fixture(scope="module")
def hf_model():
    config = transformers.Qwen3_5TextConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,  # two periods of three linear layers and one full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn_like(param) * 0.1)
            elif "A_log" not in name and "dt_bias" not in name:
                param.mul_(4.0)  # far from uniform logits
    return model


def _ours(model):
    config = HybridConfig.from_hf(model.config.to_dict())
    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return config, params_from_hf(config, tensors, jnp.float32)


def _batch(requests, tables):
    """BatchInputs and StateBatch of requests [(tokens, first position, slot, table row)]."""
    tokens = np.concatenate([np.asarray(t) for t, *_ in requests]).astype(np.int32)
    positions = np.concatenate([p + np.arange(len(t)) for t, p, *_ in requests]).astype(np.int32)
    rows = [r for *_, r in requests]
    slot_mapping = np.concatenate(
        [tables[r][(p + np.arange(len(t))) // BLOCK] * BLOCK + (p + np.arange(len(t))) % BLOCK
         for t, p, _, r in requests]
    ).astype(np.int32)  # fmt: skip
    starts = np.concatenate([[0], np.cumsum([len(t) for t, *_ in requests])]).astype(np.int32)
    batch = BatchInputs(
        token_ids=tokens,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=np.asarray([tables[r] for r in rows], np.int32),
        seq_lens=np.asarray([p + len(t) for t, p, *_ in requests], np.int32),
        query_start_loc=starts,
        logits_indices=np.arange(len(tokens), dtype=np.int32),
        num_seqs=np.asarray([len(requests)], np.int32),
    )
    states = StateBatch(
        starts,
        np.asarray([s for _, _, s, _ in requests], np.int32),
        np.asarray([p == 0 for _, p, *_ in requests]),
        np.asarray([len(requests)], np.int32),
    )
    return batch, states


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "recurrent"])
def test_logits_match_hf_in_one_step_and_across_steps(hf_model, chunked):
    config, params = _ours(hf_model)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 320, 21).tolist()
    other = rng.integers(3, 320, 6).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0].numpy()
        expected_other = hf_model(torch.tensor([other])).logits[0].numpy()
    la, ll = config.count("full_attention"), config.count("linear_attention")
    heads, dim = config.num_kv_heads, config.head_dim
    tables = np.arange(1, 1 + 2 * 6).reshape(2, 6)  # two requests' blocks

    def empty():
        return (
            KVCache(jnp.zeros((la, 2, BLOCKS, BLOCK, heads, dim))),
            jnp.zeros((ll, SLOTS, config.conv_channels, config.linear.conv_kernel - 1)),
            jnp.zeros((ll, SLOTS, config.linear.num_v_heads, config.linear.k_head_dim,
                       config.linear.v_head_dim)),
        )  # fmt: skip

    step = jax.jit(functools.partial(forward, config, chunked=chunked))
    batch, states = _batch([(prompt, 0, 2, 0)], tables)
    logits, *_ = step(params, *empty(), batch, states)
    np.testing.assert_allclose(logits, expected, rtol=2e-4, atol=2e-3)
    # 13 tokens, then the other 8 beside a fresh request in another slot and blocks
    batch, states = _batch([(prompt[:13], 0, 1, 0)], tables)
    first, kv, conv, delta = step(params, *empty(), batch, states)
    batch, states = _batch([(other, 0, 3, 1), (prompt[13:], 13, 1, 0)], tables)
    second, *_ = step(params, kv, conv, delta, batch, states)
    second = np.asarray(second)
    np.testing.assert_allclose(np.concatenate([first, second[6:]]), expected, rtol=2e-4, atol=2e-3)
    np.testing.assert_allclose(second[:6], expected_other, rtol=2e-4, atol=2e-3)
