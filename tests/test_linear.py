"""The two weight layouts compute the same projections (numpy is the reference)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer.layers.linear import (
    IN_OUT,
    OUT_IN,
    axes_in_layout,
    dense,
    gated_ffn_out_in,
    lm_logits,
    to_layout,
)
from jaxinfer.layers.quantization import quantize_params
from jaxinfer.models.llama import PARAM_AXES, param_axes

E, I, V, K, G, D, L = 24, 40, 2048, 2, 3, 8, 3  # noqa: E741 (V: two int8 LM-head chunks)


def loader_params(rng) -> dict:
    """A parameter tree in the loader's ("in_out") layout, layers stacked."""

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "embed": normal(V, E),
        "lm_head": normal(E, V),
        "norm": normal(E),
        "layers": {
            "input_norm": normal(L, E),
            "post_attention_norm": normal(L, E),
            "qkv_proj": normal(L, E, K, G + 2, D),
            "o_proj": normal(L, K * G * D, E),
            "gate_up_proj": normal(L, E, 2, I),
            "down_proj": normal(L, I, E),
        },
    }


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_out_in_projections_match_numpy(rows):
    rng = np.random.default_rng(rows)
    params = loader_params(rng)
    moved = to_layout(params, OUT_IN)
    x = rng.standard_normal((rows, E)).astype(np.float32)
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        w = params["layers"][name][1]
        inputs = x if w.shape[0] == E else rng.standard_normal((rows, w.shape[0]), np.float32)
        expected = np.tensordot(inputs, w, axes=1)
        for layout, weight in ((IN_OUT, w), (OUT_IN, moved["layers"][name][1])):
            got = jax.jit(dense, static_argnums=2)(inputs, weight, layout)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4, err_msg=name)

    gate_up, down = params["layers"]["gate_up_proj"][0], params["layers"]["down_proj"][0]
    h = np.einsum("te,eci->tci", x, gate_up)
    expected = (h[:, 0] / (1 + np.exp(-h[:, 0])) * h[:, 1]) @ down
    got = jax.jit(gated_ffn_out_in)(
        x, moved["layers"]["gate_up_proj"][0], moved["layers"]["down_proj"][0]
    )
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3)

    for tied, head in ((True, params["embed"].T), (False, params["lm_head"])):
        expected = x @ head
        for layout, tree in ((IN_OUT, params), (OUT_IN, moved)):
            w = tree["embed"] if tied else tree["lm_head"]
            got = jax.jit(lm_logits, static_argnums=(2, 3))(x, w, layout, tied)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_axes_follow_the_layout():
    params = to_layout(loader_params(np.random.default_rng(0)), OUT_IN)
    axes = param_axes(params, axes_in_layout(PARAM_AXES, OUT_IN))
    sizes = {"embed": E, "vocab": V, "kv_heads": K, "qkv": G + 2, "head_dim": D, "mlp": I}
    sizes.update(layers=L, gate_up=2, q_heads_x_dim=K * G * D)
    for path, names in jax.tree_util.tree_leaves_with_path(
        axes, is_leaf=lambda x: isinstance(x, tuple)
    ):
        array = params[path[0].key] if len(path) == 1 else params["layers"][path[1].key]
        assert array.shape == tuple(sizes[n] for n in names), path
    assert axes["layers"]["qkv_proj"] == ("layers", "kv_heads", "qkv", "head_dim", "embed")
    with pytest.raises(ValueError, match="weight layout"):
        to_layout(params, "row_major")


@pytest.mark.parametrize("rows", [1, 6])
def test_int8_projections_match_their_dequantized_weights(rows):
    """Every int8 path (one row, several rows, the chunked LM head) against numpy on Q * s."""
    rng = np.random.default_rng(10 + rows)
    params = quantize_params(loader_params(rng), tied=True)
    moved = to_layout(params, OUT_IN)
    layers, moved_layers = params["layers"], moved["layers"]
    x = rng.standard_normal((rows, E)).astype(np.float32)

    def weight(name):  # the float weight the int8 one stands for, "in_out", layer 0
        return layers[name][0] * layers[name + "_scale"][0][None]

    for name in ("qkv_proj", "gate_up_proj"):
        expected = np.tensordot(x, weight(name), axes=1)
        scale = layers[name + "_scale"][0]
        for layout, w in ((IN_OUT, layers[name][0]), (OUT_IN, moved_layers[name][0])):
            got = jax.jit(dense, static_argnums=2)(x, w, layout, scale)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4, err_msg=name)
    h = x @ weight("gate_up_proj").reshape(E, 2 * I)
    h = h.reshape(rows, 2, I)
    expected = (h[:, 0] / (1 + np.exp(-h[:, 0])) * h[:, 1]) @ weight("down_proj")
    got = jax.jit(gated_ffn_out_in)(
        x,
        moved_layers["gate_up_proj"][0],
        moved_layers["down_proj"][0],
        layers["gate_up_proj_scale"][0],
        layers["down_proj_scale"][0],
    )
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3)
    embed = params["embed"] * params["embed_scale"][:, None]
    for layout in (IN_OUT, OUT_IN):
        got = jax.jit(lm_logits, static_argnums=(2, 3))(
            x, params["embed"], layout, True, params["embed_scale"]
        )
        np.testing.assert_allclose(got, x @ embed.T, rtol=1e-5, atol=1e-4)
