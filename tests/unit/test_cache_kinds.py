"""The KV-cache manager's second kind of entry: a hybrid model's recurrent-state slot per
request, held with the request's blocks and freed with them, its usage and capacity reported
beside the blocks'."""

from __future__ import annotations

from jaxinfer.engine.scheduling.kv_cache_manager import KVCacheManager
from jaxinfer.engine.scheduling.request import Request
from jaxinfer.outputs import RequestMetrics
from jaxinfer.sampling_params import SamplingParams


def _request(name: str) -> Request:
    return Request(
        request_id=name,
        prompt_token_ids=list(range(3, 9)),
        sampling_params=SamplingParams(temperature=0),
        eos_token_ids=frozenset(),
        seed=0,
        metrics=RequestMetrics(arrival_time=0.0),
    )


def test_a_state_slot_is_held_with_the_blocks_and_freed_with_them():
    kv = KVCacheManager(block_size=4, num_blocks=9, enable_prefix_caching=False, state_slots=2)
    first, second, third = _request("a"), _request("b"), _request("c")
    assert kv.capacity() == {"kv_blocks": 8, "recurrent_states": 2}
    assert kv.allocate_blocks(first, 6) and kv.allocate_blocks(second, 6)
    assert kv.usage() == {"kv_blocks": 0.5, "recurrent_states": 1.0}
    assert kv.allocate_blocks(first, 4)  # growing keeps its one slot
    # No slot left: refused, and nothing changed (the blocks are free enough).
    assert not kv.allocate_blocks(third, 6)
    assert third.block_ids == [] and not kv.holds_state(third)
    kv.free(first)  # finished, aborted or preempted
    assert not kv.holds_state(first) and kv.usage()["recurrent_states"] == 0.5
    assert kv.allocate_blocks(third, 6) and kv.holds_state(third)


def test_a_model_without_recurrent_layers_reports_blocks_only():
    kv = KVCacheManager(block_size=4, num_blocks=9)
    assert kv.allocate_blocks(_request("a"), 6)
    assert kv.usage() == {"kv_blocks": 0.25} and kv.capacity() == {"kv_blocks": 8}
