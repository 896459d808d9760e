"""A Gated DeltaNet layer (jaxinfer.layers.gated_deltanet) against HF transformers' own
Qwen3NextGatedDeltaNet with the same random weights: a fresh prompt in one step, and the same
prompt in three steps, each continuing from the states the one before left in its slots,
beside another request (both delta-rule forms, and the choice between them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from jaxinfer.arch_config import LinearAttentionShape
from jaxinfer.layers.gated_deltanet import gated_deltanet as deltanet_layer
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.layers.weights import Dense
from jaxinfer.model_loader.hybrid_weights import linear_layer
from jaxinfer.models.params import HYBRID_PROJECTIONS
from pallas_kernels.gated_delta.reference import StateBatch

E, HK, HV, DK, DV, K = 32, 2, 4, 8, 16, 4
SHAPE = LinearAttentionShape(HK, HV, DK, DV, K, 1e-6)


@pytest.fixture(scope="module")
def hf_layer():
    config = transformers.Qwen3NextConfig(
        hidden_size=E,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=K,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    layer = Qwen3NextGatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    return layer


def _params(layer) -> dict:
    """The layer's weights as the loader puts them (grouped by key head, "in_out")."""
    tensors = {name: t.detach().numpy() for name, t in layer.state_dict().items()}

    def get(name, shape):
        assert tensors[name].shape == shape, name
        return tensors[name]

    params = linear_layer(get, "", SHAPE, E, "interleaved")
    return {n: Dense(jnp.asarray(w)) if n in HYBRID_PROJECTIONS else w for n, w in params.items()}


KERNELS = ModelKernels()
# (jitted: run op by op, the chunked form's loops would compile again at every call)
gated_deltanet = jax.jit(deltanet_layer, static_argnums=(5, 6), static_argnames="form")


def _batch(lengths, slots, fresh) -> StateBatch:
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return StateBatch(
        jnp.asarray(starts),
        jnp.asarray(slots, jnp.int32),
        jnp.asarray(fresh),
        jnp.asarray([len(lengths)], jnp.int32),
    )


# The fast lane takes "auto" (chunked for the prefill, recurrent for the decodes).
@pytest.mark.parametrize(
    "form", [pytest.param(f, marks=pytest.mark.slow) for f in ("chunked", "recurrent")] + ["auto"]
)
def test_layer_matches_hf_in_one_step_and_across_steps(hf_layer, form):
    rng = np.random.default_rng(1)
    prompt = rng.standard_normal((23, E)).astype(np.float32)
    other = rng.standard_normal((5, E)).astype(np.float32)
    with torch.no_grad():
        expected = hf_layer(torch.tensor(prompt[None]))[0].numpy()
        expected_other = hf_layer(torch.tensor(other[None]))[0].numpy()
    params = _params(hf_layer)
    conv = jnp.zeros((3, HK * DK * 2 + HV * DV, K - 1))
    delta = jnp.zeros((3, HV, DK, DV))
    # one step
    y, _, _ = gated_deltanet(
        params, prompt, conv, delta, _batch([23], [1], [True]), SHAPE, KERNELS, form=form
    )
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
    # three steps: 15 tokens; then 7 beside a fresh request in another slot; then the last
    # one alone (a decode step: "auto" takes the recurrent form)
    y1, conv, delta = gated_deltanet(
        params, prompt[:15], conv, delta, _batch([15], [2], [True]), SHAPE, KERNELS, form=form
    )
    step2 = np.concatenate([other, prompt[15:22]])
    y2, conv, delta = gated_deltanet(
        params, step2, conv, delta, _batch([5, 7], [0, 2], [True, False]), SHAPE, KERNELS,
        form=form,
    )  # fmt: skip
    y3, conv, delta = gated_deltanet(
        params, prompt[22:], conv, delta, _batch([1], [2], [False]), SHAPE, KERNELS, form=form
    )
    np.testing.assert_allclose(np.concatenate([y1, y2[5:], y3]), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(y2[:5], expected_other, rtol=1e-4, atol=1e-4)
