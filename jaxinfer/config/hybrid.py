"""What a hybrid model (linear-attention layers beside attention ones; jaxinfer.models
.qwen3_5) runs with, settled for jaxinfer.config.resolve: the options it cannot run with are
errors, and how prefix caching works for it is said.

Its linear layers keep one recurrent state per request rather than K/V per token, so:
- a cached prefix needs the states at the prefix's end: they are checkpointed at block
  boundaries (jaxinfer.engine.scheduling.state_checkpoints), for which a prompt's steps end
  at the boundaries a hit can use;
- proposals a step rejects would have moved the state past the accepted tokens (no rollback
  of the state yet): speculative decoding is refused.
Under tensor parallelism every device holds whole heads: of the attention layers' KV heads
and of the linear layers' key-head groups (no copies of KV heads).
"""

from __future__ import annotations

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.config.options import EngineOptions, refuse_options

PREFIX_CACHING_CHECKPOINTS = (
    "the linear-attention layers' states are checkpointed where prompt steps end at block "
    "boundaries (steps are cut at a prompt's last full block and where the blocks it shares "
    "with earlier prompts end); a hit restores them"
)


def check_hybrid(options: EngineOptions, arch: LlamaConfig) -> None:
    """A ValueError naming the first option a hybrid model cannot run with."""
    if arch.hybrid is None:
        return
    refused = {
        "speculative_method": options.speculative_method != "none",
        "enable_lora": options.enable_lora,
        "kv_cache_dtype": options.kv_cache_dtype != "auto",
        "layer_execution": options.layer_execution == "per_layer",
        "load_format": options.load_format == "dummy",
    }
    refuse_options(
        options, refused, f"a hybrid model ({arch.architecture}, linear-attention layers)"
    )
    tp, linear = options.tensor_parallel_size, arch.hybrid.linear
    if arch.num_key_value_heads % tp or linear.num_k_heads % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} must divide a hybrid model's KV heads "
            f"({arch.num_key_value_heads}) and its linear layers' key heads "
            f"({linear.num_k_heads}): each device holds whole heads"
        )


def prefix_caching(options: EngineOptions, arch: LlamaConfig, reasons: dict[str, str]) -> bool:
    if arch.hybrid is not None and options.enable_prefix_caching:
        reasons["prefix_caching"] = PREFIX_CACHING_CHECKPOINTS
    return options.enable_prefix_caching
