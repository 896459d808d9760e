"""DeepSeek-V4's decoder (DeepseekV4ForCausalLM) over a flattened ragged batch and its cache
(jaxinfer.layers.compressed_cache.CompressedCache).

Each layer: the residual stream as hc_mult streams, collapsed before each block and expanded
after it (jaxinfer.layers.hyper_connections); attention with one shared K=V head over the
last sliding_window positions and, in a compressed layer, its compressed entries (all closed
ones: HCA; the Lightning Indexer's top-k: CSA), a sink logit per head; a MoE FFN. Queries go
through a low-rank path (q_a_proj, a norm, q_b_proj, an unweighted norm per head); the
output is turned back by the RoPE at the query's position (K=V carries RoPE into the output)
and projected per head group to a low rank, then mixed (o_a_proj, o_b_proj). RoPE turns each
head's trailing rotary_dim dims in interleaved pairs, with rope_theta in sliding layers and
compress_rope_theta in compressed ones (their entries too, at their window's first position).

The layers after the first few (the hash-routed ones and what precedes the pattern) repeat a
period of kinds (V4's: CSA then HCA): they run as a scan over the periods, each kind's
parameters indexed by the layer's place among its kind's, so compile time grows with the
prefix and the period, not the depth. A layout that never repeats runs layer by layer.
Parameters: jaxinfer.model_loader.deepseek_v4_weights.

T: tokens, E: hidden size, N: streams, H: heads, D: head dim, Rq: q rank, G: output groups,
Ro: their rank, Hi / Di: indexer heads and dim, k: experts per token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.arch_config import (
    HASH_MOE,
    SLIDING_ATTENTION,
    LlamaConfig,
)
from jaxinfer.layers.compressed_cache import (
    KIND_KEYS,
    CompressedCache,
    write_entries,
    write_window,
)
from jaxinfer.layers.hyper_connections import (
    HeadWeights,
    MixWeights,
    collapse_head,
    expand,
    mix_weights,
    unweighted_rms_norm,
)
from jaxinfer.layers.invariant import rms_norm
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.layers.linear import swiglu
from jaxinfer.layers.moe.experts import routed_experts
from jaxinfer.layers.moe.routing import route
from jaxinfer.layers.rotary import apply_interleaved_rotary
from jaxinfer.layers.weights import Dense, is_weight
from jaxinfer.models.inputs import BatchInputs
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.parallel.sharding import Partitioner
from pallas_kernels.compressor.reference import CompressorBatch
from pallas_kernels.ragged_paged_attention.reference import token_request_index


class DeepseekV4ForCausalLM(LlamaForCausalLM):
    """The Llama model's parameters and LM head; its own layers and cache."""

    def _layers(self, cache, batch, kernels, partitioner, collect: bool, lora=None):
        if lora is not None:
            raise ValueError("LoRA adapters are not supported on DeepSeek-V4")
        params = nnx.to_pure_dict(nnx.state(self))
        cache, streams, collected = deepseek_v4_layers(
            self.config, params, cache, batch, kernels, partitioner, collect
        )
        if cache.mtp:  # (kept for the MTP layer, which runs over the step's tokens after it)
            kept = cache.mtp["streams"].at[: streams.shape[0]].set(streams.astype(jnp.float32))
            cache = dataclasses.replace(cache, mtp={**cache.mtp, "streams": kept})
        return cache, final_collapse(self.config, params, streams), collected

    def streams(
        self,
        cache: CompressedCache,
        batch: BatchInputs,
        *,
        kernels: ModelKernels,
        partitioner: Partitioner | None = None,
    ) -> tuple[CompressedCache, jax.Array]:  # (cache, f32[T, N, E])
        """The residual streams after the last layer, before the final collapse (what the
        MTP layer takes, jaxinfer.models.deepseek_v4_mtp)."""
        params = nnx.to_pure_dict(nnx.state(self))
        cache, streams, _ = deepseek_v4_layers(
            self.config, params, cache, batch, kernels, partitioner, False
        )
        return cache, streams


def final_collapse(config: LlamaConfig, params: dict, streams: jax.Array) -> jax.Array:
    """The streams f32[T, N, E] collapsed by the model's hc_head into the hidden state
    f32[T, E] that the final norm and LM head read."""
    head = HeadWeights(**params["hc_head"])
    return collapse_head(streams, head, eps=config.compressed.hc_eps, norm_eps=config.rms_norm_eps)


def embed_rows(embed, tokens: jax.Array) -> jax.Array:  # f32[T, E]
    """The tokens' rows of the embedding (a weight of blocks, or an array [V, E])."""
    return embed.rows(tokens, jnp.float32) if is_weight(embed) else embed[tokens]


def _array(w) -> jax.Array:
    return w.w if isinstance(w, Dense) else w


def _take(tree, index: int):
    return jax.tree.map(lambda a: _array(a)[index], tree, is_leaf=is_weight)


def deepseek_v4_layers(
    config: LlamaConfig,
    params: dict,
    cache: CompressedCache,
    batch: BatchInputs,
    kernels: ModelKernels,
    partitioner: Partitioner | None,
    collect: bool,
) -> tuple[CompressedCache, jax.Array, jax.Array | None]:  # (cache, [T, N, E], [L, T, E])
    """Every layer: (the cache, the streams after the last layer, and with `collect` the
    streams after each layer collapsed by the final head)."""
    v4 = config.compressed
    layers = params["layers"]
    embed = params["embed"]
    hidden = embed_rows(embed, batch.token_ids)
    streams = jnp.broadcast_to(hidden[:, None], (hidden.shape[0], v4.hc_mult, hidden.shape[1]))
    hashed_layers = [i for i, t in enumerate(v4.mlp_layer_types) if t == HASH_MOE]
    shared = {k: v for k, v in layers.items() if k not in ("csa", "hca", "hash")}
    kind_of = v4.layer_types

    def layer_step(streams, cache, layer, kind, index, hashed_index):
        return decoder_layer(
            config, _take(shared, layer), layers, streams, cache, layer=layer, index=index,
            hashed_index=hashed_index, kind=kind, batch=batch, kernels=kernels,
            partitioner=partitioner,
        )  # fmt: skip

    def head_of(streams):
        return final_collapse(config, params, streams)

    prefix, period = layer_periods(v4)
    collected = []
    for layer in range(prefix):  # the layers before the period, one by one
        hashed_index = hashed_layers.index(layer) if layer in hashed_layers else -1
        streams, cache = layer_step(
            streams, cache, layer, kind_of[layer], v4.index(layer), hashed_index
        )
        if collect:
            collected.append(head_of(streams))

    def one_period(carry, start):  # `start`: the period's first layer
        streams, cache = carry
        outs = []
        for offset in range(period):
            kind = kind_of[prefix + offset]
            # its place among its kind's: those before the periods, then per period
            before = kind_of[:prefix].count(kind) + kind_of[prefix : prefix + offset].count(kind)
            per_period = kind_of[prefix : prefix + period].count(kind)
            index = before + (start - prefix) // period * per_period
            streams, cache = layer_step(streams, cache, start + offset, kind, index, -1)
            outs.append(head_of(streams) if collect else None)
        return (streams, cache), jnp.stack(outs) if collect else None

    if period:
        repeats = (len(kind_of) - prefix) // period
        starts = prefix + period * jnp.arange(repeats, dtype=jnp.int32)
        (streams, cache), per_period = jax.lax.scan(one_period, (streams, cache), starts)
        if collect:  # [repeats, period, T, E] -> one per layer
            collected += list(per_period.reshape(-1, *per_period.shape[2:]))
    return cache, streams, jnp.stack(collected) if collect else None


def decoder_layer(
    config: LlamaConfig,
    p: dict,  # the layer's own parameters (one layer of layers' shared ones)
    layers: dict,  # every layer's: the compressed kinds' and hash-routed layers' stacks
    streams: jax.Array,  # f32[T, N, E]
    cache: CompressedCache,
    *,
    layer: int | jax.Array,  # its layer in the cache's window store
    index: int | jax.Array,  # its index among its kind's layers
    hashed_index: int,  # its index among the hash-routed layers (-1: scored routing)
    kind: str,
    batch: BatchInputs,
    kernels: ModelKernels,
    partitioner: Partitioner | None,
) -> tuple[jax.Array, CompressedCache]:  # (streams f32[T, N, E], cache)
    """One decoder layer on the streams: attention, then the MoE, each between a
    hyper-connection's collapse and expansion."""
    v4, moe = config.compressed, config.moe
    eps, norm_eps = v4.hc_eps, config.rms_norm_eps
    post, comb, x = mix_weights(
        streams, MixWeights(**p["attn_hc"]), sinkhorn_iters=v4.hc_sinkhorn_iters,
        eps=eps, norm_eps=norm_eps,
    )  # fmt: skip
    x = rms_norm(x, p["input_norm"], norm_eps)
    out, cache = attention(
        config, p, layers, x, cache, layer, index, kind=kind, batch=batch, kernels=kernels
    )
    streams = expand(post, comb, out, streams)
    post, comb, x = mix_weights(
        streams, MixWeights(**p["ffn_hc"]), sinkhorn_iters=v4.hc_sinkhorn_iters,
        eps=eps, norm_eps=norm_eps,
    )  # fmt: skip
    x = rms_norm(x, p["post_attention_norm"], norm_eps)
    logits = x @ p["router"]
    if hashed_index >= 0:  # experts by token id
        table = layers["hash"]["tid2eid"][hashed_index]
        weights, experts = route(logits, moe.router, None, table[batch.token_ids])
    else:
        weights, experts = route(logits, moe.router, p["router_bias"])
    y = routed_experts(
        x, weights, experts, Dense(p["experts_gate_up"], -3), Dense(p["experts_down"], -2),
        kernels, partitioner, limit=moe.swiglu_limit,
    )  # fmt: skip
    h = jnp.einsum("te,eci->tci", x, p["gate_up_proj"])  # the shared expert
    y = y + swiglu(h[:, 0], h[:, 1], moe.swiglu_limit) @ p["down_proj"]
    return expand(post, comb, y, streams), cache


def layer_periods(v4) -> tuple[int, int]:
    """(prefix, period): the layers after the first `prefix` (hash-routed ones among them)
    repeat a period of `period` kinds; the shortest prefix + period (all layers one by one
    when nothing repeats)."""
    keys = [(kind, mlp) for kind, mlp in zip(v4.layer_types, v4.mlp_layer_types, strict=True)]
    count = len(keys)
    best = (count, 0)
    for prefix in range(count):
        if HASH_MOE in v4.mlp_layer_types[prefix:]:
            continue
        rest = keys[prefix:]
        for size in range(1, len(rest) + 1):
            if len(rest) % size == 0 and rest == rest[:size] * (len(rest) // size):
                if prefix + size < sum(best):
                    best = (prefix, size)
                break
    return best


def attention(
    config: LlamaConfig,
    p: dict,  # the layer's shared parameters
    layers: dict,  # every layer's (the compressed kinds' stacks)
    x: jax.Array,  # f32[T, E], normed
    cache: CompressedCache,
    layer: jax.Array,  # i32[], the layer's index
    index: jax.Array,  # i32[], its index among its kind's layers
    *,
    kind: str,
    batch: BatchInputs,
    kernels: ModelKernels,
) -> tuple[jax.Array, CompressedCache]:  # ([T, E], cache)
    v4 = config.compressed
    tokens, heads, dim, rotary = (
        x.shape[0],
        config.num_attention_heads,
        config.head_dim,
        v4.rotary_dim,
    )
    positions = batch.positions
    sliding = kind == SLIDING_ATTENTION
    theta = config.rope_theta if sliding else v4.compress_rope_theta
    scaling = None if sliding else v4.compress_rope_scaling

    def rope(a, at=positions, inverse=False):
        return apply_interleaved_rotary(a, at, theta, rotary, scaling, inverse=inverse)

    q_residual = rms_norm(x @ p["q_a_proj"], p["q_a_norm"], config.rms_norm_eps)  # [T, Rq]
    q = (q_residual @ p["q_b_proj"]).reshape(tokens, heads, dim)
    q = rope(unweighted_rms_norm(q, config.rms_norm_eps))
    kv = rope(rms_norm(x @ p["kv_proj"], p["kv_norm"], config.rms_norm_eps))  # [T, D]
    window = write_window(cache.window, layer, kv, batch.slot_mapping)
    entries, states = dict(cache.entries), dict(cache.states)
    store = table = picks = store_layer = None
    ratio = 1
    if kind != SLIDING_ATTENTION:
        key = KIND_KEYS[kind]
        ratio = v4.ratio(kind)
        c = _take(layers[key], index)
        table = cache.entry_table(batch.block_tables, key)
        request = jnp.minimum(
            token_request_index(batch.query_start_loc, tokens), table.shape[0] - 1
        )
        step = CompressorBatch(batch.query_start_loc, positions, batch.state_rows, batch.num_seqs)

        def pooled(prefix, store_key, state_key):
            """The step's closed windows pooled, normed, RoPE'd and written to the store;
            returns the store of every layer of the kind (the kernels read layer `index` of
            it in place)."""
            new, closes, states[state_key] = kernels.compressor(
                x @ c[prefix + "kv_proj"], x @ c[prefix + "gate_proj"],
                c[prefix + "position_bias"], states[state_key], step,
                overlap=key == "csa", layer=index,
            )  # fmt: skip
            new = rms_norm(new, c[prefix + "kv_norm"], config.rms_norm_eps)
            new = rope(new, at=((positions + 1) // ratio - 1) * ratio)  # the window's start
            entries[store_key] = write_entries(
                entries[store_key], index, new, closes, table, request, positions, ratio
            )
            return entries[store_key]

        store, store_layer = pooled("", key, key), index
        if key == "csa":
            keys = pooled("index_", "index", "index")
            iq = (q_residual @ c["index_q_b_proj"]).reshape(tokens, v4.index_heads, -1)
            scores = (x @ c["index_weights_proj"]) * v4.index_heads**-0.5  # [T, Hi]
            picks = kernels.lightning_indexer(
                rope(iq), scores, keys, table, batch.query_start_loc, positions,
                ratio=ratio, topk=v4.index_topk, scale=v4.index_head_dim**-0.5, layer=index,
            )  # fmt: skip
    attn = kernels.compressed_attention(
        q, window, batch.block_tables, store, table, picks, p["sinks"],
        batch.query_start_loc, positions,
        window=config.sliding_window, ratio=ratio, scale=dim**-0.5,
        kv_layer=layer, entry_layer=store_layer,
    )  # fmt: skip
    attn = rope(attn, inverse=True)  # [T, H, D]
    grouped = attn.reshape(tokens, v4.o_groups, -1)
    low = jnp.einsum("tgi,gio->tgo", grouped, p["o_a_proj"]).reshape(tokens, -1)
    out = low @ p["o_b_proj"]
    return out, dataclasses.replace(cache, window=window, entries=entries, states=states)
