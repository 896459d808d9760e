"""DeepSeek-V4's multi-token-prediction (MTP) layer, the checkpoint's `mtp.0.*`
(jaxinfer.model_loader.deepseek_v4_weights.load_deepseek_v4_mtp): from the model's streams
at position i, taken before its final collapse (hc_head), and the token at i + 1, the
streams from which the token at i + 2 is predicted.

Transformers does not implement it (DeepseekV4ForCausalLM drops `mtp.*` on load), so this
follows vLLM's DeepSeekV4MultiTokenPredictorLayer: the token's embedding (zero at position 0)
normed by enorm and projected by e_proj, added to each stream of the model's normed by hnorm
and projected by h_proj; one decoder layer (a sliding-attention one with scored MoE routing,
jaxinfer.models.deepseek_v4.decoder_layer) over them, its K=V entries in a window store of
its own (addressed by the model's block tables and slots, as a draft model's cache is);
then its own collapse (hc_head), its own final norm and the model's LM head. Its output
streams are what a further proposal step takes in place of the model's.

T: tokens, N: streams, E: hidden size, V: vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.arch_config import SLIDING_ATTENTION, LlamaConfig
from jaxinfer.layers.compressed_cache import CompressedCache
from jaxinfer.layers.hyper_connections import HeadWeights, collapse_head
from jaxinfer.layers.invariant import rms_norm
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.models.deepseek_v4 import decoder_layer, embed_rows
from jaxinfer.models.inputs import BatchInputs
from jaxinfer.models.llama import lm_head
from jaxinfer.models.params import head_name
from jaxinfer.parallel.sharding import Partitioner


def mtp_streams(
    config: LlamaConfig,
    mtp: dict,  # the MTP layer's parameters
    embed,  # [V, E], the model's embedding
    cache: CompressedCache,  # the MTP's: a window store of one layer
    batch: BatchInputs,  # token_ids: the token after each position (i + 1's at i)
    previous: jax.Array,  # f32[T, N, E], the streams at each position (the model's, or this
    # layer's own from the step before)
    *,
    kernels: ModelKernels,
    partitioner: Partitioner | None = None,
) -> tuple[CompressedCache, jax.Array]:  # (cache, streams f32[T, N, E])
    eps = config.rms_norm_eps
    embedded = embed_rows(embed, batch.token_ids)
    embedded = jnp.where(batch.positions[:, None] == 0, 0.0, embedded)  # [T, E]
    embedded = rms_norm(embedded, mtp["enorm"], eps) @ mtp["e_proj"]
    streams = rms_norm(previous, mtp["hnorm"], eps) @ mtp["h_proj"] + embedded[:, None]
    streams, cache = decoder_layer(
        config, mtp["layer"], {}, streams, cache, layer=0, index=0, hashed_index=-1,
        kind=SLIDING_ATTENTION, batch=batch, kernels=kernels, partitioner=partitioner,
    )  # fmt: skip
    return cache, streams


def mtp_logits(
    config: LlamaConfig,
    mtp: dict,
    params: dict,  # the model's: its LM head ("lm_head", or "embed" where tied)
    streams: jax.Array,  # f32[T, N, E], mtp_streams' (the rows that propose)
    kernels: ModelKernels,
) -> jax.Array:  # f32[T, V]
    """The next token's logits from the MTP layer's streams: its own collapse and final
    norm, the model's LM head."""
    v4 = config.compressed
    hidden = collapse_head(
        streams, HeadWeights(**mtp["hc_head"]), eps=v4.hc_eps, norm_eps=config.rms_norm_eps
    )
    name = head_name(config)
    return lm_head(config, {"norm": mtp["norm"], name: params[name]}, hidden, kernels)
