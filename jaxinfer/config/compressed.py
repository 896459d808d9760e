"""What a DeepSeek-V4 model (compressed attention; jaxinfer.models.deepseek_v4) runs with,
settled for jaxinfer.config.resolve and sized for jaxinfer.config.engine_config.

Under tensor parallelism its MoE experts are split (by expert with expert_parallel, else
within each), as are the shared expert's columns, the vocabulary and its attention's query
heads (their projection, their sinks and their groups' output projections: each device
attends with its heads, and the output projection's partial sums are added across devices);
its one K=V head, its compressors and its indexer run whole on every device.

Its compressed layers keep entries pooled from whole windows and, per request, the open
window's tokens (the compressor's state), so a cached prefix would need both at its end:
prefix caching is off for it, with that reason, rather than ever giving a wrong answer. Its
compressors keep their state as a function of positions alone (a ring of each request's last
tokens with room for a step's proposals), so speculative decoding needs no rollback there:
n-gram and suffix proposals run; a draft model is refused. Its layers take their weights as
the checkpoint lays them out ("in_out"), float.

The cache: the sliding window's pool holds what the running requests' windows need (their
blocks behind the window go back to it); each compressed kind's pool (one entry per `ratio`
tokens) gets the rest of the budget, split so that every kind holds the same number of
tokens of context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.config.cache_specs import CacheSpec, compressed_specs_of
from jaxinfer.config.native import native_kernel, native_reasons
from jaxinfer.config.options import EngineOptions, refuse_options

PREFIX_CACHING_OFF = (
    "DeepSeek-V4's compressed layers would need their entries and their compressors' open "
    "windows at the prefix's end, which are not checkpointed yet"
)


def check_compressed(options: EngineOptions, arch: LlamaConfig) -> None:
    """A ValueError naming the first option a DeepSeek-V4 model cannot run with."""
    if arch.compressed is None:
        return
    refused = {
        # (a draft model's KV cache is not in this cache's budget yet)
        "speculative_method": options.speculative_method == "draft",
        "enable_lora": options.enable_lora,
        "kv_cache_dtype": options.kv_cache_dtype != "auto",
        "layer_execution": options.layer_execution == "per_layer",
        "load_format": options.load_format == "dummy",
        "quantization": options.quantization is not None,
        "batch_invariant": options.batch_invariant,
        "weight_layout": options.weight_layout not in ("auto", "in_out"),
        "matmul_impl": options.matmul_impl not in ("auto", "xla"),
    }
    refuse_options(options, refused, f"DeepSeek-V4 ({arch.architecture}, compressed attention)")


NO_MTP_LAYER = (
    "speculative_method 'mtp': the checkpoint has no multi-token-prediction layer (no mtp.0.* "
    "tensors; transformers' save_pretrained drops them)"
)


def check_mtp(options: EngineOptions, arch: LlamaConfig) -> None:
    """A ValueError where speculative_method "mtp" cannot run: it needs a DeepSeek-V4 model
    (whose checkpoint has the layer: jaxinfer.engine.startup.start)."""
    if options.speculative_method != "mtp":
        return
    if arch.compressed is None:
        raise ValueError(
            "speculative_method 'mtp' runs a DeepSeek-V4 checkpoint's multi-token-prediction "
            f"layer; {arch.architecture} has none (use ngram, suffix or draft)"
        )


def compressed_attention_kernel(
    options: EngineOptions,
    platform,
    arch: LlamaConfig,
    dtype: str,
    registry,
    reasons: dict[str, str],
) -> tuple[str | None, dict[str, Callable]]:
    """(the kernels' name, the callables by kind: its attention, its Lightning Indexer and its
    compressors' pooling), or (None, {}) for another model: the C++ kernels on XLA:CPU where
    they run (cpu_kernels.compressed_attention), the Pallas kernels on a GPU, else the
    references."""
    name = options.compressed_attention_impl
    if arch.compressed is None:
        if name != "auto":
            raise ValueError("compressed_attention_impl applies to DeepSeek-V4 models")
        return None, {}
    cpu = platform.backend == "cpu"
    reasons["attention"] = "not used: DeepSeek-V4's layers attend through compressed_attention"
    if name in ("auto", "cpu"):
        why = native_reasons(platform, options.tensor_parallel_size, dtype)
        native, why_not = native_kernel(
            platform, "compressed_attention", "compressed_attention_impl", name, why
        )
        if native is not None:
            if name == "auto":
                reasons["compressed_attention"] = "the C++ kernels run here"
            return "cpu", native._asdict()
        if name == "auto":
            name = "reference" if cpu else "pallas"
            reasons["compressed_attention"] = (
                f"the reference: not the C++ kernels: {why_not}" if cpu else "the Pallas kernel"
            )
    if name == "pallas" and cpu:
        raise ValueError(
            "compressed_attention_impl 'pallas' runs on a GPU (pallas_interpret on CPU)"
        )
    kinds = ("compressed_attention", "lightning_indexer", "compressor")
    return name, {kind: registry.get(kind, name) for kind in kinds}


def prefix_caching(options: EngineOptions, arch: LlamaConfig, reasons: dict[str, str]) -> bool:
    if arch.compressed is not None:
        if options.enable_prefix_caching:
            reasons["prefix_caching"] = PREFIX_CACHING_OFF
        return False
    return options.enable_prefix_caching


@dataclasses.dataclass(frozen=True)
class CompressedPools:
    num_blocks: int  # the window's, the null block included
    entry_blocks: tuple[tuple[str, int], ...]  # (key, blocks), each with its null block 0


def size_pools(
    arch: LlamaConfig,
    specs: tuple[CacheSpec, ...],
    options: EngineOptions,
    budget: int,  # bytes for the pools
    dtype,
) -> CompressedPools:
    """The window's blocks: every running request's window and a full step's tokens, or
    options.num_kv_blocks; each compressed kind's: the rest of the budget, the same tokens of
    context for each kind (with num_kv_blocks: as many tokens as those blocks hold). With
    speculative_method "mtp" the MTP layer's window store counts as one window layer more,
    and the streams it reads (a full step's) come out of the budget first."""
    block = options.block_size
    mtp = options.speculative_method == "mtp"  # (its layer's window store, a step's streams)
    layers = arch.num_hidden_layers + mtp
    window_bytes = layers * block * arch.head_dim * jnp.dtype(dtype).itemsize
    if mtp:
        budget -= options.max_num_batched_tokens * arch.compressed.hc_mult * arch.hidden_size * 4
    compressed = compressed_specs_of(specs)
    if options.num_kv_blocks:
        num_blocks = options.num_kv_blocks
        tokens = (num_blocks - 1) * block
    else:
        per_request = -(-arch.sliding_window // block) + 2
        num_blocks = options.max_num_seqs * per_request + options.max_num_batched_tokens // block
        num_blocks += 2  # (the null block, and one for a step's last partial block)
        rest = budget - num_blocks * window_bytes
        per_token = sum(s.bytes_per_entry / s.ratio for s in compressed)
        if rest <= 0 or (
            compressed and rest / per_token < block * max(s.ratio for s in compressed)
        ):
            raise ValueError(
                f"kv_cache_memory_gb {options.kv_cache_memory_gb} does not hold the sliding "
                f"windows of {options.max_num_seqs} requests ({num_blocks * window_bytes} "
                "bytes) and compressed entries beside them; raise it or lower max_num_seqs"
            )
        tokens = int(rest / per_token) if compressed else 0
    entry_blocks = tuple(
        (s.key, -(-tokens // (s.ratio * block)) + 1) for s in compressed
    )  # fmt: skip
    return CompressedPools(num_blocks, entry_blocks)
