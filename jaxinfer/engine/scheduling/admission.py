"""Whether the engine could ever serve a request: checked when it is prepared (any thread)
and again when it is added."""

from __future__ import annotations

from jaxinfer.config import SchedulerConfig
from jaxinfer.engine.scheduling.kv_cache_manager import KVCacheManager
from jaxinfer.sampling_params import SamplingParams


def check_admissible(
    config: SchedulerConfig, kv: KVCacheManager, prompt_len: int, params: SamplingParams
) -> None:
    """Raises ValueError for a request that could never complete, or asks for what the
    engine cannot do (it reads only the configuration)."""
    max_tokens = params.max_tokens
    wanted = params.num_speculative_tokens
    if wanted and wanted > config.num_speculative_tokens:
        if not config.num_speculative_tokens:
            raise ValueError(
                "num_speculative_tokens: speculative decoding is off in this engine "
                "(its speculative_method is none)"
            )
        raise ValueError(
            f"num_speculative_tokens must be at most the engine's "
            f"{config.num_speculative_tokens}, got {wanted}"
        )
    if prompt_len == 0:
        raise ValueError("the prompt is empty")
    if prompt_len >= config.max_model_len:
        raise ValueError(
            f"the prompt has {prompt_len} tokens; max_model_len is "
            f"{config.max_model_len}, which leaves no room for output"
        )
    longest = config.max_model_len if max_tokens is None else prompt_len + max_tokens
    longest = min(longest, config.max_model_len)
    capacity = kv.pool.num_blocks - 1
    if kv.blocks_held(longest, config.max_num_batched_tokens) > capacity:
        raise ValueError(
            f"the request needs up to {longest} tokens of KV cache, more than the whole pool "
            f"({capacity} blocks of {kv.block_size})"
        )
    for key, pool in kv.entry_pools.items():
        ratio = next(s.ratio for s in kv.compressed if s.key == key)
        if kv.blocks_for(longest // ratio) > pool.num_blocks - 1:
            raise ValueError(
                f"the request needs up to {longest} tokens of context, more than the {key} "
                f"entries' pool holds ({pool.num_blocks - 1} blocks of {kv.block_size} entries, "
                f"one per {ratio} tokens)"
            )
