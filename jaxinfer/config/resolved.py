"""What start-up settled: every choice EngineOptions left to the engine (ResolvedOptions, with
the reason for each made from "auto") and the kernels the model runs (jaxinfer.config.resolve
makes them)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxinfer.layers.kernel_registry import ModelKernels

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ResolvedOptions:
    """Every choice EngineOptions left to the engine, settled."""

    dtype: str
    attention: str  # a KernelRegistry name ("cpu": the C++ kernel)
    ffn: str
    norm: str
    grouped_matmul: str  # the MoE experts' product: "cpu" (C++, "out_in") or a registry name
    weight_layout: str  # "in_out" or "out_in"
    weight_format: str  # the projections' format: "dense" (in dtype) or the quantization
    int4_matmul: str  # int4 weights' product: "cpu" (C++, "out_in") or a registry name
    matmul: str  # "cpu" (the C++ kernel) or "xla"
    gguf_blocks: bool  # read the source GGUF file's weights in place, in its own blocks
    gguf_blocks_required: bool  # gguf_weights "on": finding none is an error
    gguf_interleaved: bool  # its blocks interleaved at load for the VNNI int8 path
    layer_execution: str  # "scan" or "per_layer"
    async_scheduling: bool
    batch_invariant: bool  # every kernel reduces in an order fixed per token
    speculative_free_tokens: int  # proposals may grow a step up to this many tokens
    speculative_adaptive: bool  # proposals planned by measured step times (SpecControl)
    warmup: str  # "all" or "background" (token buckets compiled while serving)
    compilation_cache_dir: str | None  # None: no persistent compilation cache
    lora: str | None = None  # LoRA's kernel ("cpu": C++, or a registry name); None: off
    gated_delta: str | None = None  # a hybrid model's delta-rule kernel; None: no such layers
    compressed_attention: str | None = None  # DeepSeek-V4's attention kernel; None: another
    prefix_caching: bool = True  # off where asked, or where the model cannot (a hybrid's)
    reasons: tuple[tuple[str, str], ...] = ()  # (choice, why), for choices made from "auto"

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    def describe(self) -> dict:
        """{choice: {"value": ..., "reason": ...}} (a reason only where "auto" chose)."""
        reasons = dict(self.reasons)
        out = {}
        for field in dataclasses.fields(self):
            if field.name in ("reasons", "gguf_blocks_required"):
                continue
            entry = {"value": getattr(self, field.name)}
            if field.name in reasons:
                entry["reason"] = reasons[field.name]
            out[field.name] = entry
        return out


@dataclasses.dataclass(frozen=True)
class Resolution:
    options: ResolvedOptions
    kernels: ModelKernels  # the callables the model runs (static under jit)
