"""A Gated DeltaNet layer (the linear-attention layers of Qwen3.5 and Qwen3-Next) over a
flattened mixed batch: the input projections, the short causal convolution, the gated delta
rule and the gated RMSNorm, each request's convolution inputs and delta-rule state in its
state slots (pallas_kernels.gated_delta).

Parameters ("in_out": x @ W; both checkpoint forms are read into this layout by
jaxinfer.model_loader.hybrid_weights), grouped by key head so that splitting the heads over
devices keeps each group whole:
    in_proj_qkv [E, C]       C = Hk * (2 Dk + G Dv): per key head its q, its k, its G value
                             heads' v
    in_proj_z [E, Hv * Dv];  in_proj_b, in_proj_a [E, Hv]
    conv1d [C, K]            depthwise, channels as in_proj_qkv's
    dt_bias, A_log [Hv];  norm [Dv];  out_proj [Hv * Dv, E]

T: tokens, E: hidden size, Hk / Hv: key / value heads (G = Hv / Hk), Dk / Dv: head dims,
K: the convolution's width, S: state slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.arch_config import LinearAttentionShape
from jaxinfer.layers import invariant
from jaxinfer.layers.weights import dense
from pallas_kernels.gated_delta.conv import causal_conv1d
from pallas_kernels.gated_delta.reference import (
    StateBatch,
    gated_delta_chunked,
    gated_delta_recurrent,
)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of x [..., Dv] times weight, times silu(gate), in float32 (as HF's; the mean
    of squares a fixed tree, so each row's its own: batch_invariant)."""
    out = invariant.rms_norm(x, weight, eps)
    return (out * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def gated_deltanet(
    p: dict,
    x: jax.Array,  # [T, E]
    conv_states: jax.Array,  # [S, C, K - 1]
    delta_states: jax.Array,  # f32[S, Hv, Dk, Dv]
    batch: StateBatch,
    shape: LinearAttentionShape,
    kernels,  # jaxinfer.layers.kernel_registry.ModelKernels
    *,
    form: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (y [T, E], conv_states, delta_states)
    """The layer. `form`: "auto", the model's delta-rule kernel (kernels.gated_delta: the
    reference, the C++ and the Pallas kernels take the recurrent form for a decode step, else
    the chunked one); or the reference's "chunked" or "recurrent"
    form alone."""
    tokens = x.shape[0]
    hk, hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim
    mixed = dense(x, p["in_proj_qkv"], kernels)  # [T, C], grouped by key head
    z = dense(x, p["in_proj_z"], kernels).reshape(tokens, hv, dv)
    b, a = dense(x, p["in_proj_b"], kernels), dense(x, p["in_proj_a"], kernels)  # [T, Hv]
    mixed, conv_states = causal_conv1d(mixed, p["conv1d"], conv_states, batch)
    mixed = mixed.reshape(tokens, hk, -1)  # [T, Hk, 2 Dk + G Dv]
    q, k = mixed[..., :dk], mixed[..., dk : 2 * dk]  # [T, Hk, Dk]
    v = mixed[..., 2 * dk :].reshape(tokens, hv, dv)
    beta = jax.nn.sigmoid(b)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p["dt_bias"]
    )
    args = (q, k, v, g, beta, delta_states, batch)
    if form == "auto":
        core, delta_states = kernels.gated_delta(*args)
    elif form in ("chunked", "recurrent"):
        rule = gated_delta_chunked if form == "chunked" else gated_delta_recurrent
        core, delta_states = rule(*args)  # [T, Hv, Dv]
    else:
        raise ValueError(f"form must be auto, chunked or recurrent, got {form!r}")
    core = gated_rms_norm(core, z, p["norm"], shape.rms_norm_eps).reshape(tokens, hv * dv)
    return dense(core, p["out_proj"], kernels), conv_states, delta_states
