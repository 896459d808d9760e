"""DeepSeek-V4's manifold-constrained hyper-connections (jaxinfer/layers/hyper_connections.py)
against HF transformers' modules on the same parameters: the mixing weights (Sinkhorn-Knopp
comb), the collapsed block input, the expanded streams and the final head's collapse."""

from __future__ import annotations

import numpy as np

from jaxinfer.layers.hyper_connections import (
    HeadWeights,
    MixWeights,
    collapse_head,
    expand,
    mix_weights,
)
from tests.support.deepseek_v4 import hf_config


def test_mixing_expanding_and_the_head_are_hugging_faces():
    import jax.numpy as jnp
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config = hf_config()
    num, hidden = config.hc_mult, config.hidden_size
    torch.manual_seed(0)
    connection, head = hf.DeepseekV4HyperConnection(config), hf.DeepseekV4HyperHead(config)
    with torch.no_grad():
        for parameter in [*connection.parameters(), *head.parameters()]:
            parameter.normal_(0, 0.5)
    streams = torch.randn(1, 7, num, hidden)
    block_output = torch.randn(1, 7, hidden)
    with torch.no_grad():
        post, comb, collapsed = connection(streams)
        expanded = post.unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(
            comb.transpose(-1, -2), streams
        )  # (DeepseekV4DecoderLayer's)
        final = head(streams)

    def array(tensor):
        return jnp.asarray(tensor.detach().numpy(), jnp.float32)

    weights = MixWeights(array(connection.fn), array(connection.base), array(connection.scale))
    got_post, got_comb, got_collapsed = mix_weights(
        array(streams[0]),
        weights,
        sinkhorn_iters=config.hc_sinkhorn_iters,
        eps=config.hc_eps,
        norm_eps=config.rms_norm_eps,
    )
    for got, want in [(got_post, post), (got_comb, comb), (got_collapsed, collapsed)]:
        np.testing.assert_allclose(np.asarray(got), want[0].numpy(), rtol=1e-5, atol=1e-6)
    # comb is doubly stochastic: its columns (normalized last) sum to 1, its rows nearly
    # (after hc_sinkhorn_iters iterations)
    np.testing.assert_allclose(np.asarray(got_comb).sum(-2), 1, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got_comb).sum(-1), 1, atol=0.05)
    got = expand(got_post, got_comb, array(block_output[0]), array(streams[0]))
    np.testing.assert_allclose(np.asarray(got), expanded[0].numpy(), rtol=1e-5, atol=1e-6)
    head_weights = HeadWeights(array(head.hc_fn), array(head.hc_base), array(head.hc_scale))
    got = collapse_head(
        array(streams[0]), head_weights, eps=config.hc_eps, norm_eps=config.rms_norm_eps
    )
    np.testing.assert_allclose(np.asarray(got), final[0].numpy(), rtol=1e-5, atol=1e-6)
