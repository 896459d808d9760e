"""A Gated DeltaNet layer (the linear-attention layers of Qwen3-Next) over a flattened mixed
batch: the input projections, the short causal convolution, the gated delta rule and the
gated RMSNorm, each request's convolution inputs and delta-rule state in its state slots
(pallas_kernels.gated_delta).

Parameters (Hugging Face's names, "in_out": x @ W), Qwen3-Next's input projections
(project_interleaved) or Qwen3.5's (project_split: in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a):
    in_proj_qkvz [E, Hk * (2 Dk + 2 G Dv)]  per key head: q, k, then its G value heads' v, z
    in_proj_ba   [E, Hk * 2 G]              per key head: its value heads' b, then a
    conv1d       [C, K]                      depthwise over C = 2 Hk Dk + Hv Dv channels
    dt_bias, A_log [Hv];  norm [Dv];  out_proj [Hv Dv, E]

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


def project_interleaved(p: dict, x: jax.Array, shape: LinearAttentionShape, kernels):
    """Qwen3-Next's input projections (per key head: q, k, its value heads' v and z; then b
    and a) -> (mixed [T, C] = q, k, v flat, the convolution's input; z [T, Hv, Dv]; b and a
    [T, Hv])."""
    tokens = x.shape[0]
    hk, hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim
    group = hv // hk
    qkvz = dense(x, p["in_proj_qkvz"], kernels).reshape(tokens, hk, 2 * dk + 2 * group * dv)
    ba = dense(x, p["in_proj_ba"], kernels).reshape(tokens, hk, 2 * group)
    q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]  # [T, Hk, Dk]
    v = qkvz[..., 2 * dk : 2 * dk + group * dv].reshape(tokens, hv * dv)
    z = qkvz[..., 2 * dk + group * dv :].reshape(tokens, hv, dv)
    b, a = ba[..., :group].reshape(tokens, hv), ba[..., group:].reshape(tokens, hv)
    mixed = jnp.concatenate([q.reshape(tokens, -1), k.reshape(tokens, -1), v], axis=-1)
    return mixed, z, b, a


def project_split(p: dict, x: jax.Array, shape: LinearAttentionShape, kernels):
    """Qwen3.5's input projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), as
    project_interleaved returns them."""
    z = dense(x, p["in_proj_z"], kernels).reshape(x.shape[0], shape.num_v_heads, shape.v_head_dim)
    qkv, b, a = (dense(x, p[name], kernels) for name in ("in_proj_qkv", "in_proj_b", "in_proj_a"))
    return qkv, z, b, a


PROJECTIONS = {"split": project_split, "interleaved": project_interleaved}


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
    projections: str = "interleaved",
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (y [T, E], conv_states, delta_states)
    """The layer. `form`: the delta rule's "chunked" form (prefill chunks), its "recurrent"
    one (a token per request), or "auto": the recurrent form where every request of the
    batch has one token (a decode step), else the chunked one (both compiled, one runs).
    `projections`: the family's input projections (PROJECTIONS). Under batch_invariant the
    recurrent form always: each token's arithmetic then depends on its request alone, not on
    how the step's tokens are chunked."""
    tokens = x.shape[0]
    hk, hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim
    mixed, z, b, a = PROJECTIONS[projections](p, x, shape, kernels)
    mixed, conv_states = causal_conv1d(mixed, p["conv1d"], conv_states, batch)
    q = mixed[:, : hk * dk].reshape(tokens, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].reshape(tokens, hk, dk)
    v = mixed[:, 2 * hk * dk :].reshape(tokens, hv, dv)
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
