"""A sliding-window model's blocks: those wholly before every position a request will still
attend to go back to the pool, its block list keeping the null block in their place; freed
blocks stay prefix-cache hits until evicted, and a prefix is only ever found from its first
block on."""

from __future__ import annotations

from jaxinfer.config.cache_specs import AttentionSpec
from jaxinfer.engine.scheduling.block_pool import NULL_BLOCK
from jaxinfer.engine.scheduling.kv_cache_manager import KVCacheManager
from jaxinfer.engine.scheduling.request import Request
from jaxinfer.outputs import RequestMetrics
from jaxinfer.sampling_params import SamplingParams


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(temperature=0),
        eos_token_ids=frozenset(),
        seed=0,
        metrics=RequestMetrics(arrival_time=0.0),
    )


def _prefill(kv: KVCacheManager, request: Request) -> None:
    assert kv.allocate_blocks(request, request.num_tokens)
    kv.cache_full_blocks(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens


def test_blocks_behind_the_window_are_freed_and_stay_cached():
    kv = KVCacheManager(block_size=4, num_blocks=16, specs=(AttentionSpec((0,), 6),))
    prompt = list(range(3, 23))  # 20 tokens: blocks 0-4
    request = _request("a", prompt)
    _prefill(kv, request)
    free = kv.pool.num_free_blocks
    held = list(request.block_ids)
    # the next token (position 20) sees positions 15..20: blocks 0-2 (positions 0..11) are dead
    assert kv.allocate_blocks(request, 1)
    assert request.block_ids[:3] == [NULL_BLOCK] * 3 and request.block_ids[3:5] == held[3:5]
    assert kv.pool.num_free_blocks == free + 3 - 1  # three freed, one new block for position 20
    # the freed blocks are still found: the same prompt hits its first 4 full blocks
    other = _request("b", prompt)
    assert kv.get_computed_blocks(other) == held[:4]
    # freeing the request never touches the null block
    kv.free(request)
    assert kv.pool.ref_counts[NULL_BLOCK] == 0


def test_an_evicted_first_block_ends_the_prefix():
    kv = KVCacheManager(block_size=4, num_blocks=8, specs=(AttentionSpec((0,), 6),))
    prompt = list(range(3, 23))
    request = _request("a", prompt)
    _prefill(kv, request)
    first = request.block_ids[0]
    assert kv.allocate_blocks(request, 1)  # frees blocks 0-2
    # take every free block: the least recently freed go first, block 0's among them
    taker = _request("c", list(range(100, 100 + 4 * kv.pool.num_free_blocks)))
    assert kv.allocate_blocks(taker, taker.num_tokens)
    assert kv.pool.block_hash[first] is None, "block 0's contents were not evicted"
    assert kv.get_computed_blocks(_request("b", prompt)) == []  # nothing: the chain starts there


def test_without_a_window_or_before_it_nothing_is_freed():
    for window in (None, 64):
        kv = KVCacheManager(block_size=4, num_blocks=16, specs=(AttentionSpec((0,), window),))
        request = _request("a", list(range(3, 23)))
        _prefill(kv, request)
        assert kv.allocate_blocks(request, 1)
        assert NULL_BLOCK not in request.block_ids
