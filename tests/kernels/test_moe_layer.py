"""The MoE FFN (jaxinfer.layers.moe.experts): permuting a batch's tokens permutes its output
rows bit for bit, through each grouped-matmul implementation, with the router, a shared expert
and int8 experts; and the layer against a dense numpy evaluation of the same experts."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxinfer.arch_config import LlamaConfig, MoeConfig, RouterConfig
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.layers.linear import IN_OUT, OUT_IN
from jaxinfer.layers.moe.experts import moe_ffn
from jaxinfer.layers.weights import Int4
from jaxinfer.models.params import as_weights, quantize_weights, random_params, to_layout
from pallas_kernels.grouped_matmul.kernel import grouped_matmul as pallas_grouped

CONFIG = LlamaConfig(
    architecture="Qwen2MoeForCausalLM",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=0,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    attention_bias=True,
    moe=MoeConfig(
        router=RouterConfig(num_experts=8, top_k=3, renormalize=True),
        intermediate_size=32,
        shared_intermediate_size=64,  # a multiple of 32: int4 groups
        shared_expert_gate=True,
    ),
)


def _layer(layout: str, quantization: str | None = None) -> dict:
    """Layer 0's parameters in `layout` (random, scaled so that routing is far from uniform)."""
    params = random_params(CONFIG, np.float32, seed=3)
    params["layers"] = {k: v * 10 if v.ndim > 2 else v for k, v in params["layers"].items()}
    weights = as_weights(CONFIG, params)
    if quantization:
        weights = quantize_weights(CONFIG, weights, quantization)
    layers = to_layout(weights, layout)["layers"]
    return jax.tree.map(lambda a: a[0], layers)


def _kernels(name: str, request) -> ModelKernels:
    if name == "reference":
        return ModelKernels(weight_layout=IN_OUT)
    if name == "pallas_interpret":
        return ModelKernels(
            weight_layout=IN_OUT,
            grouped_matmul=functools.partial(
                pallas_grouped, interpret=True, block_n=16, block_k=16
            ),
        )
    from jaxinfer.layers.native_kernels import KernelMatmul

    matmul = KernelMatmul(request.getfixturevalue("cpu_matmul"))
    return ModelKernels(weight_layout=OUT_IN, matmul=matmul)


@pytest.mark.parametrize("quantization", [None, "int8", "int4"], ids=["float32", "int8", "int4"])
@pytest.mark.parametrize("name", ["reference", "pallas_interpret", "cpu"])
def test_permuted_tokens_give_bit_identical_rows(name, quantization, request):
    kernels = _kernels(name, request)
    layer = _layer(kernels.weight_layout, quantization)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((29, CONFIG.hidden_size)).astype(np.float32)
    perm = rng.permutation(len(x))
    run = jax.jit(lambda x: moe_ffn(CONFIG, layer, x, kernels))
    y, y_perm = np.asarray(run(x)), np.asarray(run(x[perm]))
    np.testing.assert_array_equal(y_perm, y[perm])


def test_layer_matches_a_dense_evaluation():
    """Every token through its chosen experts one by one (numpy, float64), the shared expert
    gated by its sigmoid."""
    layer = _layer(IN_OUT)
    x = np.random.default_rng(1).standard_normal((11, CONFIG.hidden_size)).astype(np.float32)
    y = np.asarray(jax.jit(lambda x: moe_ffn(CONFIG, layer, x, ModelKernels()))(x))
    p = {k: np.asarray(getattr(v, "w", v), np.float64) for k, v in layer.items()}
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)

    def silu(a):
        return a / (1 + np.exp(-a))

    expected = np.zeros_like(y, dtype=np.float64)
    for t in range(len(x)):
        chosen = np.argsort(-probs[t], kind="stable")[:3]
        weights = probs[t, chosen] / probs[t, chosen].sum()
        for e, w in zip(chosen, weights, strict=True):
            h = x[t] @ p["experts_gate_up"][e].reshape(CONFIG.hidden_size, 2, -1).transpose(1, 0, 2)
            expected[t] += w * (silu(h[0]) * h[1]) @ p["experts_down"][e]
        h = np.einsum("e,ecj->cj", x[t], p["gate_up_proj"])
        gate = 1 / (1 + np.exp(-(x[t] @ p["shared_expert_gate"])))
        expected[t] += gate * (silu(h[0]) * h[1]) @ p["down_proj"]
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_int4_experts_through_the_cpu_kernel_match_the_reference(request):
    """int4 experts (and shared expert): the C++ grouped int4 product, streamed (few rows per
    expert) and through dequantized tiles (many), against the dequantize-then-matmul reference
    on the same routing."""
    cpu = _kernels("cpu", request)
    reference_layer, cpu_layer = _layer(IN_OUT, "int4"), _layer(OUT_IN, "int4")
    assert isinstance(cpu_layer["experts_down"], Int4)
    assert cpu_layer["experts_gate_up"].qs.shape == (8, 2, 32, CONFIG.hidden_size // 2)
    rng = np.random.default_rng(2)
    for tokens in (2, 40):  # about 1 and 15 rows per expert
        x = rng.standard_normal((tokens, CONFIG.hidden_size)).astype(np.float32)
        want = jax.jit(lambda x: moe_ffn(CONFIG, reference_layer, x, ModelKernels()))(x)
        got = jax.jit(lambda x: moe_ffn(CONFIG, cpu_layer, x, cpu))(x)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_int8_experts_are_quantized():
    layer = _layer(IN_OUT, "int8")
    assert layer["experts_gate_up"].q.dtype == np.int8
    assert layer["experts_down"].scale.shape == (8, CONFIG.hidden_size)
    assert dataclasses.is_dataclass(layer["experts_gate_up"])
