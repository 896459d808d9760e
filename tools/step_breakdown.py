"""Where a decode step's device time goes, part by part, against the machine's roofline.

Times the engine's own compiled pieces on a decode batch of B requests with `context` tokens
each (random token ids; the KV cache as it is): the embedding, the decoder layers (one program
per layer, as per-layer execution runs them), attention alone inside those layers (the same
attention kernel, jitted on its own, on the same shapes), the LM head and the sampler (greedy).
Each part's roofline is the larger of the bytes it must read over the memory bandwidth and its
FLOPs over the matmul rate, both measured here (tools/device_rates.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer import LLM
from jaxinfer.engine.execution.batch import SamplingMetadata
from jaxinfer.engine.sampling.sampler import sample
from jaxinfer.layers.weights import is_weight
from jaxinfer.models.params import head_name
from tools.decode import decode_batch, read_bytes
from tools.device_rates import matmul_rate, memory_bandwidth, timed


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    seconds: float
    bytes_read: float
    flops: float

    def roofline(self, bandwidth: float, flop_rate: float) -> float:
        return max(self.bytes_read / bandwidth, self.flops / flop_rate)

    def bound(self, bandwidth: float, flop_rate: float) -> str:
        return "memory" if self.bytes_read / bandwidth >= self.flops / flop_rate else "compute"


def measure(llm: LLM, batch: int, context: int, repeats: int = 10) -> list[Part]:
    runner = llm.engine.runner
    if runner.layer_execution != "per_layer":
        raise ValueError("the breakdown times per-layer execution (the CPU default)")
    config = llm.engine.config
    arch = config.model.arch
    if 1 + batch * -(-context // config.cache.block_size) > config.cache.num_blocks:
        raise ValueError("the KV cache is too small for this batch and context")
    inputs = jax.device_put(
        decode_batch(
            batch, context, config.cache.block_size, arch.vocab_size, config.max_blocks_per_request
        )
    )
    kernels = runner.kernels
    layers = runner.layer_params
    itemsize = jnp.dtype(llm.engine.config.model.dtype).itemsize
    head_dim, kv_heads = arch.head_dim, arch.num_key_value_heads

    def embed():
        return runner.run_embedding(inputs)

    hidden, residual, cos_sin = embed()

    def all_layers():
        h, r = hidden, residual
        for index in range(len(layers)):
            h, r = runner.run_layer(index, h, r, inputs, cos_sin)
        return runner.run_final_add(h, r)

    q = jax.random.normal(jax.random.key(0), (batch, arch.num_attention_heads, head_dim))
    attention = jax.jit(
        lambda q, kv, layer: kernels.attention(
            q,
            kv.values,
            inputs.block_tables,
            inputs.seq_lens,
            inputs.query_start_loc,
            inputs.num_seqs,
            sm_scale=head_dim**-0.5,
            layer=layer,
            **kv.attention_kwargs(),
        )
    )

    def all_attention():
        return [attention(q, runner.kv_cache, layer) for layer in runner.layer_ids]

    final = all_layers()

    def logits():
        return runner.run_logits(final, inputs)

    row_logits = logits()
    sampling = jax.device_put(SamplingMetadata.neutral(batch))
    slots = jnp.arange(batch, dtype=jnp.int32)
    sampler = jax.jit(lambda x: sample(x, sampling, runner.sampler_state, slots))

    layer_weights = sum(read_bytes(p) for p in layers)
    matmul_params = sum(
        w.size for p in layers for w in p.values() if is_weight(w)
    )  # per token: 2 FLOPs each
    head_bytes = read_bytes(runner.top_params[head_name(arch)])
    kv_bytes = batch * context * arch.num_hidden_layers * 2 * kv_heads * head_dim * itemsize
    attn_flops = 4 * batch * context * arch.num_attention_heads * head_dim * arch.num_hidden_layers
    layers_time = timed(all_layers, repeats=repeats)
    attention_time = timed(all_attention, repeats=repeats)
    return [
        Part("embedding", timed(embed, repeats=repeats), batch * arch.hidden_size * itemsize, 0),
        Part(
            "layers without attention",
            max(layers_time - attention_time, 0.0),
            layer_weights,
            2 * batch * matmul_params,
        ),
        Part("attention", attention_time, kv_bytes, attn_flops),
        Part(
            "LM head",
            timed(logits, repeats=repeats),
            head_bytes,
            2 * batch * arch.vocab_size * arch.hidden_size,
        ),
        Part(
            "sampler (greedy)",
            timed(sampler, row_logits, repeats=repeats),
            row_logits.nbytes,
            0,
        ),
    ]


def table(llm: LLM, batch: int, context: int, host_seconds: float) -> str:
    """Markdown rows: each part's time, roofline, share of it reached and what bounds it."""
    bandwidth, flop_rate = memory_bandwidth(), matmul_rate(1024, jnp.float32)
    parts = measure(llm, batch, context)
    lines = [
        f"batch {batch}, context {context}: memory bandwidth {bandwidth / 1e9:.0f} GB/s, "
        f"matmul rate {flop_rate / 1e9:.0f} GFLOP/s (float32, 1024^3)",
        "",
        "| part | time | roofline | reached | bound by |",
        "| --- | --- | --- | --- | --- |",
    ]
    total = total_roof = 0.0
    for part in parts:
        roof = part.roofline(bandwidth, flop_rate)
        total, total_roof = total + part.seconds, total_roof + roof
        lines.append(
            f"| {part.name} | {part.seconds * 1e3:.2f} ms | {roof * 1e3:.2f} ms | "
            f"{100 * roof / part.seconds:.0f}% | {part.bound(bandwidth, flop_rate)} |"
        )
    lines.append(f"| host (Python, measured per step) | {host_seconds * 1e3:.2f} ms | | | |")
    lines.append(
        f"| **device total** | {total * 1e3:.2f} ms | {total_roof * 1e3:.2f} ms | "
        f"{100 * total_roof / total:.0f}% | |"
    )
    return "\n".join(lines)
