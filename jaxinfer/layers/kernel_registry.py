"""Named kernel implementations the model can run, chosen by the engine config.

The kinds, each with the signature of its pure-JAX reference:

- "attention": ragged_paged_attention_reference(q, kv_cache, block_tables, seq_lens,
  query_start_loc, num_seqs, *, sm_scale, sliding_window=None, layer=None) -> [T, H, D]
- "ffn": fused_ffn_reference(x, gate_up [E, 2, I], down [I, E]) -> [T, E]
- "norm": add_rms_norm_reference(x, residual, weight, *, eps) -> (normed, x + residual)
- "grouped_matmul": grouped_matmul_reference(x [M, K], w [G, K, N], group_sizes [G]) -> [M, N]
  (a MoE layer's experts, rows sorted by expert; "in_out" weights)
- "int4_matmul": int4_matmul_reference(x [T, K], qs u8[*out, K / 2], scale, bias [*out, K / G])
  -> [T, *out] (4-bit weights in groups, pallas_kernels.int4_matmul; off the C++ matmul kernel)
- "lora": lora_reference(x [T, I], a [L, S, R, I], b [L, S, R, O], slots [T], *, layer)
  -> [T, O] (each row times its LoRA adapter's pair, pallas_kernels.lora; the C++ kernel is
  loaded by the engine, cpu_kernels.lora)
- "gated_delta": gated_delta_reference(q, k, v, g, beta, states, StateBatch) -> (o, states)
  (a hybrid model's delta rule over a mixed batch, each request's state in its slot,
  pallas_kernels.gated_delta; the C++ kernel is loaded by the engine, cpu_kernels.gated_delta)
- "compressed_attention": compressed_attention(q, kv, block_table, entries, entry_table,
  picks, sinks, query_start_loc, positions, *, window, ratio, scale, kv_layer, entry_layer)
  -> [T, H, D] (DeepSeek-V4's attention over its window and compressed entries, the stores
  given as stacks over layers and the layer of each, pallas_kernels.compressed_attention; the
  C++ kernels, cpu_kernels.compressed_attention, are loaded by the engine)
- "lightning_indexer": indexer_topk(q, weights, keys, block_table, query_start_loc,
  positions, *, ratio, topk, scale, layer) -> i32[T, k] (DeepSeek-V4's picks of compressed
  entries, its keys a stack over layers, pallas_kernels.lightning_indexer)
- "compressor": compress(kv, gate, bias, CompressorState, CompressorBatch, *, overlap, layer)
  -> (entries [T, D], closes [T], state) (DeepSeek-V4's windows pooled into compressed
  entries, the state a stack over layers and the layer to update, pallas_kernels.compressor)

Built in: "reference" (pure JAX), "pallas" (the Pallas kernels, lowered for the GPU),
"pallas_interpret" (the same kernels through Pallas' interpreter: slow, for tests on CPU) and,
for attention, "cpu" (the C++ kernel of cpu_kernels.paged_attention, which the engine builds
and registers before use); for norm, "invariant" (the reference with one row per reduction,
jaxinfer.layers.invariant). What "auto" picks is settled in jaxinfer.config.resolve. Research
code registers its own
function under a new name on a registry it passes to the engine (`LLM(kernels=registry,
attention_impl="mine")`); the model calls whatever is selected inside the same jitted step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax.numpy as jnp

from cpu_kernels.paged_attention.kernel import paged_attention
from jaxinfer.layers import invariant
from jaxinfer.layers.linear import IN_OUT
from pallas_kernels.add_rms_norm.kernel import add_rms_norm
from pallas_kernels.add_rms_norm.reference import add_rms_norm_reference, rms_norm
from pallas_kernels.compressed_attention.kernel import compressed_attention
from pallas_kernels.compressed_attention.reference import (
    compressed_attention as compressed_attention_reference,
)
from pallas_kernels.compressor.kernel import compress
from pallas_kernels.compressor.reference import compress as compress_reference
from pallas_kernels.fused_ffn.kernel import fused_ffn
from pallas_kernels.fused_ffn.reference import fused_ffn_reference
from pallas_kernels.gated_delta.kernel import gated_delta
from pallas_kernels.gated_delta.reference import gated_delta_reference
from pallas_kernels.grouped_matmul.kernel import grouped_matmul
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference
from pallas_kernels.int4_matmul.kernel import int4_matmul
from pallas_kernels.int4_matmul.reference import int4_matmul_reference
from pallas_kernels.lightning_indexer.kernel import indexer_topk
from pallas_kernels.lightning_indexer.reference import indexer_topk as indexer_topk_reference
from pallas_kernels.lora.kernel import lora
from pallas_kernels.lora.reference import lora_reference
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

KINDS = (
    "attention", "ffn", "norm", "grouped_matmul", "int4_matmul", "lora", "gated_delta",
    "compressed_attention", "lightning_indexer", "compressor",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelKernels:
    """The implementations one model instance runs (static under jit)."""

    attention: Callable = ragged_paged_attention_reference
    ffn: Callable = fused_ffn_reference  # used in the "in_out" weight layout only
    add_rms_norm: Callable = add_rms_norm_reference
    # How projection weights are laid out and multiplied (jaxinfer.layers.linear). In "out_in"
    # the FFN is the reference computed feature-major (linear.gated_ffn_out_in).
    weight_layout: str = IN_OUT
    # Computes the "out_in" projections and LM head instead of XLA: x [T, K] times w [*out, K]
    # (float, or int8 with scale [*out]) -> [T, *out]; under a layer scan w is a
    # linear.StackedWeight, to be read in place. None: XLA (jaxinfer.layers.native_kernels).
    matmul: Callable | None = None
    # The routed experts' products (jaxinfer.layers.moe.experts) in the "in_out" layout:
    # grouped_matmul_reference(x [M, K], w [G, K, N], group_sizes [G]) -> [M, N]. In "out_in"
    # the matmul kernel's grouped product (C++), else the reference, computes them.
    grouped_matmul: Callable = grouped_matmul_reference
    # Int4 weights' products where the C++ matmul kernel does not take them (jaxinfer.layers
    # .weights.Int4): int4_matmul_reference(x [T, K], qs, scale, bias) -> [T, *out].
    int4_matmul: Callable = int4_matmul_reference
    # LoRA adapters' products (jaxinfer.layers.lora), where the engine serves them:
    # lora_reference(x [T, I], a [L, S, R, I], b [L, S, R, O], slots i32[T], *, layer).
    lora: Callable = lora_reference
    # A hybrid model's delta rule (jaxinfer.layers.gated_deltanet), one call over a mixed
    # batch: gated_delta_reference(q, k, v, g, beta, states, StateBatch) -> (o, states).
    gated_delta: Callable = gated_delta_reference
    # DeepSeek-V4's attention (jaxinfer.models.deepseek_v4) over the sliding window and the
    # compressed entries: compressed_attention_reference(q, kv, block_table, ...) -> [T, H, D].
    compressed_attention: Callable = compressed_attention_reference
    # Its Lightning Indexer's picks: indexer_topk_reference(q, weights, keys, ...) -> i32[T, k].
    lightning_indexer: Callable = indexer_topk_reference
    # Its compressors' pooling: compress_reference(kv, gate, bias, state, batch, *, overlap,
    # layer) -> (entries [T, D], closes [T], state).
    compressor: Callable = compress_reference
    # Every reduction of the step in an order fixed per row (EngineOptions.batch_invariant):
    # the final norm through `add_rms_norm`, the sampler's sums as trees (layers.invariant).
    batch_invariant: bool = False

    def for_tokens(self, count) -> ModelKernels:
        """These kernels for a step whose first `count` tokens (i32[], traced) are real, the
        rest padding: the C++ block kernel skips the padding rows (KernelMatmul.for_tokens);
        every other kernel computes them as before."""
        if not hasattr(self.matmul, "for_tokens"):
            return self
        return dataclasses.replace(self, matmul=self.matmul.for_tokens(count))

    def rms_norm(self, x, weight, eps: float):  # [N, E], the final norm
        """RMSNorm alone: the reference's, or under batch_invariant through the selected norm
        kernel (adding zeros is exact)."""
        if not self.batch_invariant:
            return rms_norm(x, weight, eps)
        return self.add_rms_norm(x, jnp.zeros_like(x), weight, eps=eps)[0]


class KernelRegistry:
    """Implementations by kind and name."""

    def __init__(self):
        self._impls: dict[str, dict[str, Callable]] = {kind: {} for kind in KINDS}

    def register(self, kind: str, name: str, fn: Callable) -> None:
        if kind not in KINDS:
            raise ValueError(f"kernel kind must be one of {KINDS}, got {kind!r}")
        if name == "auto" or not name:
            raise ValueError(f"{name!r} cannot name a kernel: 'auto' chooses one")
        if not callable(fn):
            raise TypeError(f"a {kind} kernel must be callable, got {type(fn).__name__}")
        self._impls[kind][name] = fn

    def names(self, kind: str) -> list[str]:
        return sorted(self._impls[kind])

    def get(self, kind: str, name: str) -> Callable:
        impls = self._impls[kind]
        if name not in impls:
            raise ValueError(
                f"no {kind} kernel named {name!r}; registered: {['auto', *sorted(impls)]}"
            )
        return impls[name]


def default_registry() -> KernelRegistry:
    """A fresh registry holding the built-in implementations."""
    registry = KernelRegistry()
    builtins = {
        "attention": (ragged_paged_attention_reference, ragged_paged_attention),
        "ffn": (fused_ffn_reference, fused_ffn),
        "norm": (add_rms_norm_reference, add_rms_norm),
        "grouped_matmul": (grouped_matmul_reference, grouped_matmul),
        "int4_matmul": (int4_matmul_reference, int4_matmul),
        "lora": (lora_reference, lora),
        "gated_delta": (gated_delta_reference, gated_delta),
        "compressed_attention": (compressed_attention_reference, compressed_attention),
        "lightning_indexer": (indexer_topk_reference, indexer_topk),
        "compressor": (compress_reference, compress),
    }
    registry.register("attention", "cpu", paged_attention)
    registry.register("norm", "invariant", invariant.add_rms_norm)
    for kind, (reference, kernel) in builtins.items():
        registry.register(kind, "reference", reference)
        registry.register(kind, "pallas", kernel)
        registry.register(kind, "pallas_interpret", functools.partial(kernel, interpret=True))
    return registry
