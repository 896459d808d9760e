"""EngineOptions' checks on creation (jaxinfer.config.options): each value of the right kind
and range, and the options consistent with one another."""

from __future__ import annotations

import dataclasses

MAX_SPECULATIVE_TOKENS = 15


def check_options(options) -> None:
    """Raises ValueError for an option out of its range or options that contradict."""
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        choices = field.metadata["choices"]
        if choices is not None and value is not None and value not in choices:
            raise ValueError(f"{field.name} must be one of {choices}, got {value!r}")
    for name in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "tensor_parallel_size",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "suffix_max_depth",
        "suffix_cache_max_tokens",
        "max_loras",
    ):
        _positive(name, getattr(options, name))
    if options.prompt_lookup_min > options.prompt_lookup_max:
        raise ValueError(
            f"prompt_lookup_min ({options.prompt_lookup_min}) must not exceed "
            f"prompt_lookup_max ({options.prompt_lookup_max})"
        )
    _positive("num_speculative_tokens", options.num_speculative_tokens)
    if not 0.0 <= options.suffix_min_token_prob <= 1.0:
        raise ValueError(
            f"suffix_min_token_prob must be in [0, 1], got {options.suffix_min_token_prob!r}"
        )
    if not options.suffix_max_spec_factor > 0:
        raise ValueError(
            f"suffix_max_spec_factor must be positive, got {options.suffix_max_spec_factor!r}"
        )
    if (options.speculative_method == "draft") != (options.draft_model is not None):
        raise ValueError(
            "speculative_method draft needs a draft_model"
            if options.draft_model is None
            else "draft_model is only used with speculative_method draft"
        )
    if options.speculative_free_tokens is not None:
        _positive("speculative_free_tokens", options.speculative_free_tokens)
    if options.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
            f"got {options.num_speculative_tokens}"
        )
    if options.max_model_len is not None:
        _positive("max_model_len", options.max_model_len)
    if options.token_buckets is not None:
        _check_token_buckets(options)
    if options.num_kv_blocks is not None and (
        not isinstance(options.num_kv_blocks, int) or options.num_kv_blocks < 2
    ):
        raise ValueError(f"num_kv_blocks must be an integer >= 2, got {options.num_kv_blocks!r}")
    for name in ("speculative_adaptive", "async_scheduling"):
        if getattr(options, name) is not None and not isinstance(getattr(options, name), bool):
            raise ValueError(f"{name} must be true, false or unset, got {getattr(options, name)!r}")
    for name in (
        "batch_invariant",
        "expert_parallel",
        "quantization_symmetric",
        "int8_activations",
        "enable_lora",
    ):
        if not isinstance(getattr(options, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(options, name)!r}")
    if options.draft_int8_activations is not None and options.draft_model is None:
        raise ValueError("draft_int8_activations is only used with a draft_model")
    for name in (
        "attention_impl",
        "ffn_impl",
        "norm_impl",
        "grouped_matmul_impl",
        "int4_matmul_impl",
        "lora_impl",
        "gated_delta_impl",
    ):
        if not isinstance(getattr(options, name), str) or not getattr(options, name):
            raise ValueError(f"{name} must name a kernel, got {getattr(options, name)!r}")
    if not options.kv_cache_memory_gb > 0:
        raise ValueError(f"kv_cache_memory_gb must be > 0, got {options.kv_cache_memory_gb!r}")


def _check_token_buckets(options) -> None:
    """token_buckets as a sorted tuple of distinct sizes, each in [1, the step budget]
    (a TOML array or a flag's list arrives as a list, of strings from a flag)."""
    value = options.token_buckets
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"token_buckets must be a list of step sizes, got {value!r}")
    sizes = []
    for size in value:
        if isinstance(size, str) and size.strip().isdigit():
            size = int(size)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"token_buckets must be positive integers, got {size!r}")
        if size > options.max_num_batched_tokens:
            raise ValueError(
                f"token bucket {size} exceeds max_num_batched_tokens "
                f"({options.max_num_batched_tokens})"
            )
        sizes.append(size)
    object.__setattr__(options, "token_buckets", tuple(sorted(set(sizes))))


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
