"""Qwen3.5's hybrid decoder (Qwen3_5ForCausalLM, text): Gated DeltaNet layers beside gated
full-attention layers, over a flattened ragged batch, the attention layers' K/V in the paged
cache and the linear layers' states in per-request slots.

Layers follow config.layer_types, a period repeated (Qwen3.5: three linear_attention, then
one full_attention); the layers run as a scan over the periods, so compile time does not grow
with depth. A period's linear layers read their states from the slots (conv [Ll, S, C, K - 1],
delta rule [Ll, S, Hv, Dk, Dv]: jaxinfer.layers.gated_deltanet), its attention layer its K/V
from the paged cache ([La, 2, NB, BS, K, D]).

Besides the Llama decoder: every RMSNorm multiplies by (1 + w); q and k are normalized per
head; q_proj also gives a per-head output gate (the attention's output times sigmoid(gate));
RoPE turns only the first partial_rotary_factor of each head's dims.

T: tokens, E: hidden size, H / K: query / kv heads, D: head dim, L: layers (Ll linear, La
attention), P: layers a period, V: vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.layers.gated_deltanet import LinearAttentionShape, gated_deltanet, project_split
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.layers.kv_cache import KVCache
from jaxinfer.layers.rotary import apply_rotary, cos_sin_cache
from jaxinfer.models.inputs import BatchInputs
from pallas_kernels.gated_delta.reference import StateBatch

LINEAR, FULL = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int  # the dims of each head RoPE turns (head_dim * partial_rotary_factor)
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    linear: LinearAttentionShape
    max_position_embeddings: int = 4096

    @classmethod
    def from_hf(cls, config: dict) -> HybridConfig:
        """From a Qwen3.5 config.json (its text_config when it has one)."""
        config = config.get("text_config", config)
        rope = config.get("rope_parameters") or {}
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config["num_key_value_heads"],
            head_dim=head_dim,
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            rotary_dim=int(head_dim * partial),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            layer_types=tuple(config["layer_types"]),
            linear=LinearAttentionShape(
                config["linear_num_key_heads"],
                config["linear_num_value_heads"],
                config["linear_key_head_dim"],
                config["linear_value_head_dim"],
                config["linear_conv_kernel_dim"],
                config["rms_norm_eps"],
            ),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
        )

    @property
    def period(self) -> tuple[str, ...]:
        """The layer kinds of one period; a ValueError unless layer_types repeats it."""
        types = self.layer_types
        for size in range(1, len(types) + 1):
            if len(types) % size == 0 and types == types[:size] * (len(types) // size):
                return types[:size]
        raise AssertionError("unreachable: the whole list is a period of itself")

    def count(self, kind: str) -> int:
        return sum(t == kind for t in self.layer_types)

    @property
    def conv_channels(self) -> int:
        s = self.linear
        return 2 * s.num_k_heads * s.k_head_dim + s.num_v_heads * s.v_head_dim


LINEAR_NAMES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "dt_bias")
LINEAR_NAMES += ("A_log", "norm", "out_proj")
ATTENTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def params_from_hf(config: HybridConfig, tensors: dict[str, np.ndarray], dtype) -> dict:
    """The model's parameters from a Hugging Face state dict (numpy): projections "in_out"
    (x @ W), every layer's stacked by kind ([Ll, ...], [La, ...], [L, ...])."""

    def get(name):
        return np.asarray(tensors[name], np.float32)

    def stack(indices, part, names, transform):
        return {
            n: jnp.asarray(
                np.stack(
                    [transform(n, get(f"model.layers.{i}.{part}.{n}.weight")) for i in indices]
                )
                if n not in ("dt_bias", "A_log")
                else np.stack([get(f"model.layers.{i}.{part}.{n}") for i in indices]),
                dtype,
            )
            for n in names
        }

    def linear_weight(name, w):
        if name == "conv1d":
            return w[:, 0]  # [C, K]
        return w.T if w.ndim == 2 else w

    def plain(name, w):
        return w.T if w.ndim == 2 else w

    layers = range(len(config.layer_types))
    linear = [i for i in layers if config.layer_types[i] == LINEAR]
    full = [i for i in layers if config.layer_types[i] == FULL]
    embed = get("model.embed_tokens.weight")
    return {
        "embed": jnp.asarray(embed, dtype),
        "lm_head": jnp.asarray(
            embed if config.tie_word_embeddings else get("lm_head.weight"), dtype
        ),
        "norm": jnp.asarray(get("model.norm.weight"), dtype),
        "input_norm": jnp.asarray(
            np.stack([get(f"model.layers.{i}.input_layernorm.weight") for i in layers]), dtype
        ),
        "post_norm": jnp.asarray(
            np.stack([get(f"model.layers.{i}.post_attention_layernorm.weight") for i in layers]),
            dtype,
        ),
        "linear": stack(linear, "linear_attn", LINEAR_NAMES, linear_weight),
        "attention": stack(full, "self_attn", ATTENTION_NAMES, plain),
        "mlp": stack(layers, "mlp", MLP_NAMES, plain),
        "rope_cache": jnp.asarray(
            cos_sin_cache(
                config.max_position_embeddings, config.rotary_dim, config.rope_theta, None
            )
        ),
    }


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3.5's RMSNorm: in float32, times (1 + w)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _rotate(x: jax.Array, cos_sin: jax.Array, rotary_dim: int) -> jax.Array:
    """RoPE on the first rotary_dim dims of each head of x [T, N, D]."""
    turned = apply_rotary(x[..., :rotary_dim], cos_sin)
    return jnp.concatenate([turned, x[..., rotary_dim:]], axis=-1)


def gated_attention(config, p, x, kv_cache, layer, batch, cos_sin, kernels):
    """The full-attention layer (-> [T, E], kv_cache): q with its output gate, q/k norms,
    partial RoPE, the paged cache."""
    tokens, d = x.shape[0], config.head_dim
    qg = (x @ p["q_proj"]).reshape(tokens, config.num_heads, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(tokens, -1)
    q = _rotate(rms_norm(q, p["q_norm"], config.rms_norm_eps), cos_sin, config.rotary_dim)
    k = (x @ p["k_proj"]).reshape(tokens, config.num_kv_heads, d)
    k = _rotate(rms_norm(k, p["k_norm"], config.rms_norm_eps), cos_sin, config.rotary_dim)
    v = (x @ p["v_proj"]).reshape(tokens, config.num_kv_heads, d)
    kv_cache = kv_cache.write(layer, k, v, batch.slot_mapping)
    attn = kernels.attention(
        kv_cache.queries(q, layer),
        kv_cache.values,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.num_seqs,
        sm_scale=d**-0.5,
        layer=layer,
        **kv_cache.attention_kwargs(),
    )  # [T, H, D]
    attn = attn.reshape(tokens, -1) * jax.nn.sigmoid(gate)
    return attn @ p["o_proj"], kv_cache


def forward(
    config: HybridConfig,
    params: dict,
    kv_cache: KVCache,  # [La, 2, NB, BS, K, D]
    conv_states: jax.Array,  # [Ll, S, C, K - 1]
    delta_states: jax.Array,  # f32[Ll, S, Hv, Dk, Dv]
    batch: BatchInputs,
    states: StateBatch,  # each request's state slot (and whether it starts fresh)
    kernels: ModelKernels = ModelKernels(),  # noqa: B008 (frozen)
    *,
    chunked: bool = True,  # the delta rule's chunked form (else the recurrent one)
) -> tuple[jax.Array, KVCache, jax.Array, jax.Array]:  # (logits f32[P, V], caches...)
    """The step: the layers as a scan over periods, then the final norm and the LM head on
    the rows batch.logits_indices names."""
    period = config.period
    per_linear, per_full = period.count(LINEAR), period.count(FULL)
    hidden = params["embed"][batch.token_ids]
    cos_sin = params["rope_cache"][batch.positions]
    eps = config.rms_norm_eps

    def take(tree, index):
        return jax.tree.map(lambda a: a[index], tree)

    def one_period(carry, index):
        hidden, kv_cache, conv, delta = carry
        linear_index, full_index = index * per_linear, index * per_full
        for j, kind in enumerate(period):
            layer = index * len(period) + j
            x = rms_norm(hidden, params["input_norm"][layer], eps)
            if kind == LINEAR:
                p = take(params["linear"], linear_index)
                out, c, d = gated_deltanet(
                    p, x, conv[linear_index], delta[linear_index], states, config.linear,
                    chunked=chunked, project=project_split,
                )  # fmt: skip
                conv, delta = conv.at[linear_index].set(c), delta.at[linear_index].set(d)
                linear_index += 1
            else:
                p = take(params["attention"], full_index)
                out, kv_cache = gated_attention(
                    config, p, x, kv_cache, full_index, batch, cos_sin, kernels
                )
                full_index += 1
            hidden = hidden + out
            x = rms_norm(hidden, params["post_norm"][layer], eps)
            mlp = take(params["mlp"], layer)
            act = jax.nn.silu(x @ mlp["gate_proj"]) * (x @ mlp["up_proj"])
            hidden = hidden + act @ mlp["down_proj"]
        return (hidden, kv_cache, conv, delta), None

    num_periods = len(config.layer_types) // len(period)
    (hidden, kv_cache, conv_states, delta_states), _ = jax.lax.scan(
        one_period,
        (hidden, kv_cache, conv_states, delta_states),
        jnp.arange(num_periods, dtype=jnp.int32),
    )
    rows = rms_norm(hidden[batch.logits_indices], params["norm"], eps)
    head = params["lm_head"]
    logits = rows @ head.T  # [V, E] either way
    return logits.astype(jnp.float32), kv_cache, conv_states, delta_states
