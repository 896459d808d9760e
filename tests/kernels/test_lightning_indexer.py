"""DeepSeek-V4's Lightning Indexer (pallas_kernels/lightning_indexer/reference.py): each query
token's top-k compressed entries of its own request, read from a paged store, are the ones
HF transformers' DeepseekV4Indexer picks (its compressed keys pooled by numpy,
tests/kernels/test_compressor), for two requests side by side in one flattened batch; the
Pallas kernel's too (interpreted), and it lowers for CUDA."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from pallas_kernels import gpu_lowering
from pallas_kernels.lightning_indexer import kernel
from pallas_kernels.lightning_indexer.reference import indexer_topk
from tests.support.deepseek_v4 import hf_config, norm_and_rope, pool_sequence, rope

IMPLEMENTATIONS = {
    "reference": indexer_topk,
    "pallas": functools.partial(kernel.indexer_topk, interpret=True),
}


def implementation_of(name: str, request):
    """The implementation `name`: the C++ kernel ("cpu", built once per session) or one of
    IMPLEMENTATIONS."""
    if name == "cpu":
        return request.getfixturevalue("cpu_compressed").lightning_indexer
    return IMPLEMENTATIONS[name]


@pytest.mark.parametrize("implementation", [*IMPLEMENTATIONS, "cpu"])
def test_picks_are_hugging_faces_indexers(implementation, request):
    import jax.numpy as jnp
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config = hf_config()
    heads, dim, topk = config.index_n_heads, config.index_head_dim, config.index_topk
    ratio = config.compress_rates["compressed_sparse_attention"]
    torch.manual_seed(0)
    indexer = hf.DeepseekV4Indexer(config)
    with torch.no_grad():
        for parameter in indexer.parameters():
            parameter.normal_(0, 0.5)
    lengths = [29, 18]
    block, num_blocks, blocks_per_request = 2, 12, 4
    store = np.zeros((num_blocks, block, dim))
    table = np.asarray([[7, 2, 9, 4], [11, 0, 5, 3]], np.int32)  # shuffled blocks
    q_all, weights_all, positions_all, expected = [], [], [], []
    for index, length in enumerate(lengths):
        hidden = torch.randn(1, length, config.hidden_size)
        q_residual = torch.randn(1, length, config.q_lora_rank)
        positions = torch.arange(length)[None]
        with torch.no_grad():
            picks = indexer(hidden, q_residual, positions, None, 0)[0].numpy()  # [S, k']
            kv = indexer.kv_proj(hidden)[0].double().numpy()
            gate = indexer.gate_proj(hidden)[0].double().numpy()
            q = indexer.q_b_proj(q_residual)[0].double().numpy().reshape(length, heads, dim)
            weights = indexer.scorer.weights_proj(hidden)[0].double().numpy() * heads**-0.5
        bias = indexer.position_bias.detach().double().numpy()
        keys = norm_and_rope(
            pool_sequence(kv, gate, bias, True), indexer.kv_norm, ratio, config, dim
        )
        for entry, key in enumerate(keys):
            store[table[index, entry // block], entry % block] = key
        q_all.append(rope(q, np.arange(length), config, dim))
        weights_all.append(weights)
        positions_all.append(np.arange(length))
        expected += [{int(e) for e in row if e >= 0} for row in picks]
    pick = jax.jit(
        implementation_of(implementation, request), static_argnames=("ratio", "topk", "scale")
    )
    got = pick(
        jnp.asarray(np.concatenate(q_all), jnp.float32),
        jnp.asarray(np.concatenate(weights_all), jnp.float32),
        jnp.asarray(store, jnp.float32),
        jnp.asarray(table),
        jnp.asarray([0, lengths[0], sum(lengths)], jnp.int32),
        jnp.asarray(np.concatenate(positions_all), jnp.int32),
        ratio=ratio,
        topk=topk,
        scale=dim**-0.5,
    )
    got = [{int(e) for e in row if e >= 0} for row in np.asarray(got)]
    assert got == expected
    # Queries before the first window closes pick nothing; later ones as many as they see.
    assert got[0] == set() and len(got[lengths[0] - 1]) == min(topk, lengths[0] // ratio)
    assert blocks_per_request * block >= max(lengths) // ratio


def test_pallas_kernel_lowers_for_cuda():
    import jax.numpy as jnp

    args = [
        jnp.zeros((5, 3, 16)),
        jnp.zeros((5, 3)),
        jnp.zeros((12, 4, 16)),
        jnp.zeros((2, 4), jnp.int32),
        jnp.asarray([0, 4, 5], jnp.int32),
        jnp.zeros(5, jnp.int32),
    ]

    def indexer(*arrays):
        return kernel.indexer_topk(*arrays, ratio=4, topk=4, scale=0.25)

    text = gpu_lowering.lower_for_gpu(indexer, *args)
    assert gpu_lowering.custom_calls(text).count(gpu_lowering.triton_custom_call()) == 1
