"""Weight formats as pytrees: both layouts and every format compute the same projections
(numpy is the reference), and each format declares the axes of its arrays."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.layers.linear import IN_OUT, OUT_IN, gated_ffn_out_in, lm_logits
from jaxinfer.layers.weights import Dense, Int8, dense
from jaxinfer.models.params import as_weights, quantize_weights, to_layout, weight_axes
from jaxinfer.models.shapes import shape

E, I, V, K, G, D, L = 24, 40, 2048, 2, 3, 8, 3  # noqa: E741 (V: two int8 LM-head chunks)


def config(tied: bool):
    import dataclasses

    return dataclasses.replace(
        shape("smollm2"),
        vocab_size=V,
        hidden_size=E,
        intermediate_size=I,
        num_hidden_layers=L,
        num_attention_heads=K * G,
        num_key_value_heads=K,
        head_dim=D,
        tie_word_embeddings=tied,
    )


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


def layer(weight, i):
    return jax.tree.map(lambda a: a[i], weight)


def project(x, weight, layout):
    return jax.jit(dense, static_argnums=2)(x, weight, ModelKernels(weight_layout=layout))


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_out_in_projections_match_numpy(rows):
    rng = np.random.default_rng(rows)
    params = loader_params(rng)
    tree = as_weights(config(tied=False), params)
    moved = to_layout(tree, OUT_IN)
    x = rng.standard_normal((rows, E)).astype(np.float32)
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        w = params["layers"][name][1]
        inputs = x if w.shape[0] == E else rng.standard_normal((rows, w.shape[0]), np.float32)
        expected = np.tensordot(inputs, w, axes=1)
        for layout, weights in ((IN_OUT, tree), (OUT_IN, moved)):
            got = project(inputs, layer(weights["layers"][name], 1), layout)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4, err_msg=name)

    gate_up, down = params["layers"]["gate_up_proj"][0], params["layers"]["down_proj"][0]
    h = np.einsum("te,eci->tci", x, gate_up)
    expected = (h[:, 0] / (1 + np.exp(-h[:, 0])) * h[:, 1]) @ down
    got = jax.jit(gated_ffn_out_in)(
        x, layer(moved["layers"]["gate_up_proj"], 0), layer(moved["layers"]["down_proj"], 0)
    )
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3)

    for tied, head in ((True, params["embed"].T), (False, params["lm_head"])):
        weights = as_weights(config(tied), params)
        expected = x @ head
        for layout, tree_in_layout in ((IN_OUT, weights), (OUT_IN, to_layout(weights, OUT_IN))):
            w = tree_in_layout["embed"] if tied else tree_in_layout["lm_head"]
            got = jax.jit(lm_logits, static_argnums=(2, 3))(
                x, w, tied, ModelKernels(weight_layout=layout)
            )
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("quantized", [False, True])
def test_axes_follow_the_format_and_layout(quantized):
    cfg = config(tied=True)
    tree = as_weights(cfg, loader_params(np.random.default_rng(0)))
    if quantized:
        tree = quantize_weights(cfg, tree)
    axes = to_layout(weight_axes(tree), OUT_IN)
    tree = to_layout(tree, OUT_IN)
    sizes = {"embed": E, "vocab": V, "kv_heads": K, "qkv": G + 2, "head_dim": D, "mlp": I}
    sizes.update(layers=L, gate_up=2, q_heads_x_dim=K * G * D)
    pairs = jax.tree.map(lambda a, names: (a.shape, tuple(sizes[n] for n in names)), tree, axes)
    for path, (actual, declared) in jax.tree_util.tree_leaves_with_path(
        pairs, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
    ):
        assert actual == declared, path
    qkv_axes = axes["layers"]["qkv_proj"]
    expected = ("layers", "kv_heads", "qkv", "head_dim", "embed")
    if quantized:
        assert isinstance(qkv_axes, Int8) and qkv_axes.q == expected
        assert qkv_axes.scale == expected[:-1]
    else:
        assert isinstance(qkv_axes, Dense) and qkv_axes.w == expected


@pytest.mark.parametrize("rows", [1, 6])
def test_int8_projections_match_their_dequantized_weights(rows):
    """Every int8 path (one row, several rows, the chunked LM head) against numpy on Q * s."""
    rng = np.random.default_rng(10 + rows)
    cfg = config(tied=True)
    tree = quantize_weights(cfg, as_weights(cfg, loader_params(rng)))
    moved = to_layout(tree, OUT_IN)
    layers, moved_layers = tree["layers"], moved["layers"]
    x = rng.standard_normal((rows, E)).astype(np.float32)

    def weight(name):  # the float weight the int8 one stands for, "in_out", layer 0
        return np.asarray(layer(layers[name], 0).dequantized(np.float32))

    for name in ("qkv_proj", "gate_up_proj"):
        expected = np.tensordot(x, weight(name), axes=1)
        for layout, weights in ((IN_OUT, layers), (OUT_IN, moved_layers)):
            got = project(x, layer(weights[name], 0), layout)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4, err_msg=name)
    h = x @ weight("gate_up_proj").reshape(E, 2 * I)
    h = h.reshape(rows, 2, I)
    expected = (h[:, 0] / (1 + np.exp(-h[:, 0])) * h[:, 1]) @ weight("down_proj")
    got = jax.jit(gated_ffn_out_in)(
        x, layer(moved_layers["gate_up_proj"], 0), layer(moved_layers["down_proj"], 0)
    )
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3)
    embed = tree["embed"]
    dequantized = embed.q * embed.scale[:, None]
    for layout, tree_in_layout in ((IN_OUT, tree), (OUT_IN, moved)):
        got = jax.jit(lm_logits, static_argnums=(2, 3))(
            x, tree_in_layout["embed"], True, ModelKernels(weight_layout=layout)
        )
        np.testing.assert_allclose(got, x @ dequantized.T, rtol=1e-5, atol=1e-4)
    ids = np.array([3, 0, V - 1])
    np.testing.assert_allclose(embed.rows(ids, np.float32), dequantized[ids], rtol=1e-6)
