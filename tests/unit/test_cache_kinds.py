"""The KV-cache manager's other kinds of entry: a hybrid model's recurrent-state slot per
request, held with the request's blocks and freed with them, and its states checkpointed at
block boundaries for prefix hits; DeepSeek-V4's compressed entries in pools of their own;
usage and capacity reported beside the blocks'; and the layer groups' cache specs the manager
is built from."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from jaxinfer.arch_config import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    HybridLayers,
    LinearAttentionShape,
)
from jaxinfer.config.cache_specs import (
    AttentionSpec,
    CompressedSpec,
    StateSpec,
    layer_specs,
    released_window,
)
from jaxinfer.engine.scheduling.kv_cache_manager import KVCacheManager
from jaxinfer.engine.scheduling.request import Request
from jaxinfer.models.shapes import shape
from jaxinfer.outputs import RequestMetrics
from jaxinfer.sampling_params import SamplingParams

ARCH = dataclasses.replace(shape("smollm2"), num_hidden_layers=4)
HYBRID = (StateSpec((0, 1, 2), 1000), AttentionSpec((3,)))  # 3 linear layers, 1 attention


def _request(name: str, prompt: list[int] | None = None) -> Request:
    return Request(
        request_id=name,
        prompt_token_ids=list(range(3, 9)) if prompt is None else prompt,
        sampling_params=SamplingParams(temperature=0),
        eos_token_ids=frozenset(),
        seed=0,
        metrics=RequestMetrics(arrival_time=0.0),
    )


def test_a_state_slot_is_held_with_the_blocks_and_freed_with_them():
    kv = KVCacheManager(4, 9, enable_prefix_caching=False, specs=HYBRID, state_slots=2)
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


def _hybrid(num_blocks: int = 17, checkpoints: int = 2) -> KVCacheManager:
    return KVCacheManager(4, num_blocks, True, HYBRID, state_slots=4, state_checkpoints=checkpoints)


def _prefill(kv: KVCacheManager, request: Request, budget: int) -> list[tuple[int, int]]:
    """Schedules the request's prompt (admitted without hits) at `budget` tokens a step, as the
    scheduler does: each step's (end, checkpoint slot)."""
    steps = []
    while request.num_computed_tokens < request.num_tokens:
        kv.step_scheduled()
        start = request.num_computed_tokens
        num_new = kv.align_chunk(request, start, min(request.num_tokens - start, budget))
        assert kv.allocate_blocks(request, num_new)
        request.num_computed_tokens = start + num_new
        steps.append((start + num_new, kv.checkpoint_slot(request, start, start + num_new)))
    kv.cache_full_blocks(request)
    return steps


def test_prompt_steps_end_at_the_boundaries_whose_states_are_checkpointed():
    kv = _hybrid(checkpoints=8)
    # 11 tokens in one step: cut at the last boundary a hit can use (8 = (11 - 1) // 4 * 4)
    assert _prefill(kv, _request("a", list(range(11))), 16) == [(8, 0), (11, -1)]
    # a budget of 6: each chunk cut at a boundary below it (4, 8), then the last one (12)
    steps = _prefill(kv, _request("b", list(range(50, 64))), 6)
    assert steps == [(4, 1), (8, 2), (12, 3), (14, -1)]
    # 8 tokens: the last usable boundary is 4; the step to 8 ends at a boundary of the
    # prompt and is kept too (a longer prompt may share all of it)
    assert _prefill(kv, _request("c", list(range(80, 88))), 16) == [(4, 4), (8, 5)]
    # Decodes are never cut, nor checkpointed.
    request = _request("d", list(range(3)))
    _prefill(kv, request, 16)
    request.num_output_placeholders = 1  # (its first step sampled)
    request.append_output_token(9)
    assert kv.align_chunk(request, 3, 1) == 1 and kv.checkpoint_slot(request, 3, 4) == -1


def test_a_hit_ends_at_a_written_checkpoint():
    kv = _hybrid(checkpoints=8)
    first = _request("a", list(range(14)))
    assert kv.align_chunk(first, 0, 14) == 12 and kv.allocate_blocks(first, 12)
    first.num_computed_tokens = 12
    assert kv.checkpoint_slot(first, 0, 12) == 0
    kv.cache_full_blocks(first)  # (the scheduler registers them as the step is scheduled)
    same = _request("b", list(range(14)))
    assert kv.get_computed_blocks(same) == [] and same.state_restore == -1  # not written yet
    kv.step_scheduled()  # the next step: written before it runs
    hits = kv.get_computed_blocks(same)
    assert len(hits) == 3 and same.state_restore == 0
    # The blocks up to 8 are cached too, but no states were kept there: a prompt sharing
    # only them computes from the start.
    other = _request("c", [*range(8), 99, 99, 99, 99, 99])
    assert kv.get_computed_blocks(other) == [] and other.state_restore == -1


def test_a_prompt_that_shares_blocks_with_another_is_cut_where_they_end():
    """A prompt whose first blocks another prompt holds too (a system prompt), but without
    states kept at their end, has its step cut there: the prompts after it hit up to there."""
    kv = _hybrid(checkpoints=8)
    system = list(range(100, 108))  # two blocks
    assert _prefill(kv, _request("a", [*system, 1, 2, 3, 4, 5, 6]), 16) == [(12, 0), (14, -1)]
    kv.step_scheduled()
    second = _request("b", [*system, 7, 8, 9, 10, 11, 12])
    assert kv.get_computed_blocks(second) == []  # its blocks are cached, no states at 8
    assert _prefill(kv, second, 16) == [(8, 1), (12, 2), (14, -1)]
    kv.step_scheduled()
    third = _request("c", [*system, 13, 14, 15, 16, 17, 18])
    assert len(kv.get_computed_blocks(third)) == 2 and third.state_restore == 1


def test_a_request_waits_for_the_checkpoint_a_running_one_is_bound_to_write():
    kv = _hybrid(checkpoints=8)
    first, sample = _request("a", list(range(10))), _request("b", list(range(10)))
    assert not kv.awaits_checkpoint(first)
    kv.step_scheduled()
    assert kv.allocate_blocks(first, 8)  # admitted: it will write the checkpoint at 8
    assert kv.awaits_checkpoint(sample) and not kv.awaits_checkpoint(first)
    salted = _request("c", list(range(10)))
    salted.cache_salt = "another tenant"
    assert not kv.awaits_checkpoint(salted)  # never shares, so never waits
    first.num_computed_tokens = 8
    assert kv.checkpoint_slot(first, 0, 8) == 0
    kv.cache_full_blocks(first)
    assert kv.awaits_checkpoint(sample)  # reserved, not yet written
    kv.step_scheduled()
    assert not kv.awaits_checkpoint(sample)
    assert len(kv.get_computed_blocks(sample)) == 2 and sample.state_restore == 0
    # A producer that leaves before writing releases those waiting for it.
    third, fourth = _request("e", list(range(30, 40))), _request("f", list(range(30, 40)))
    assert kv.allocate_blocks(third, 4) and kv.awaits_checkpoint(fourth)
    kv.free(third)
    assert not kv.awaits_checkpoint(fourth)


def test_checkpoints_are_bounded_and_go_with_their_blocks():
    kv = _hybrid(num_blocks=9, checkpoints=2)
    assert kv.capacity()["state_checkpoints"] == 2
    requests = [_request(str(i), list(range(10 * i, 10 * i + 6))) for i in range(3)]
    for request in requests:  # each checkpoints at 4: the third evicts the first's
        assert _prefill(kv, request, 16)[0][1] >= 0
        kv.free(request)
    kv.step_scheduled()
    assert kv.usage()["state_checkpoints"] == 1.0
    found = [
        bool(kv.get_computed_blocks(_request("x", list(r.prompt_token_ids)))) for r in requests
    ]
    assert found == [False, True, True]
    # Evicting the third's first block (the pool reuses freed blocks oldest first) drops its
    # checkpoint with it.
    filler = _request("y", list(range(200, 232)))
    assert kv.allocate_blocks(filler, 32)
    assert kv.usage()["state_checkpoints"] == 0.0
    kv.free(filler)
    assert kv.reset_prefix_cache() and kv.pool.cached == {}


def test_each_layer_group_declares_its_cache_spec():
    """A model's layers grouped by what they keep: one group for every attention layer, a
    sliding one beside it where only some layers slide (blocks are then never released), and
    a hybrid's linear layers as a recurrent-state group of their states' size."""
    assert layer_specs(ARCH, jnp.float32) == (AttentionSpec((0, 1, 2, 3)),)
    sliding = dataclasses.replace(ARCH, sliding_window=6)
    assert layer_specs(sliding, jnp.float32) == (AttentionSpec((0, 1, 2, 3), 6),)
    assert released_window(layer_specs(sliding, jnp.float32)) == 6
    mixed = dataclasses.replace(sliding, sliding_layers=(True, True, True, False))
    specs = layer_specs(mixed, jnp.float32)
    assert specs == (AttentionSpec((0, 1, 2), 6), AttentionSpec((3,)))
    assert [s.kind for s in specs] == ["sliding_window", "full_attention"]
    assert released_window(specs) is None
    linear = LinearAttentionShape(2, 4, 8, 8, 4, 1e-6)
    types = (LINEAR_ATTENTION, FULL_ATTENTION) * 2
    hybrid = dataclasses.replace(ARCH, hybrid=HybridLayers(types, linear, 4))
    specs = layer_specs(hybrid, jnp.float32)
    conv, delta = (2 * 2 * 8 + 4 * 8) * 3 * 4, 4 * 8 * 8 * 4  # [C, K - 1], f32[Hv, Dk, Dv]
    assert specs == (StateSpec((0, 2), 2 * (conv + delta)), AttentionSpec((1, 3)))
    assert released_window(specs) is None


# DeepSeek-V4's groups: a sliding window of 8 positions over every layer, CSA entries (one
# per 4 tokens) and HCA entries (one per 16), the compressors' states
COMPRESSED = (
    AttentionSpec((0, 1, 2), 8, shared_kv=True),
    CompressedSpec((1,), "csa", 4, 100),
    CompressedSpec((2,), "hca", 16, 100),
    StateSpec((1, 2), 1000),
)


def test_compressed_entries_grow_with_the_context_from_their_own_pools():
    kv = KVCacheManager(
        4, 17, False, COMPRESSED, state_slots=2, entry_blocks=(("csa", 4), ("hca", 2))
    )
    assert kv.capacity() == {
        "kv_blocks": 16, "recurrent_states": 2, "csa_entry_blocks": 3, "hca_entry_blocks": 1,
    }  # fmt: skip
    first = _request("a", list(range(3, 40)))  # 37 tokens
    assert kv.allocate_blocks(first, 15)  # 15 tokens: 3 CSA entries, no HCA entry yet
    assert first.entry_block_ids == {"csa": [1], "hca": []}
    first.num_computed_tokens = 15
    assert kv.allocate_blocks(first, 17)  # 32 tokens: 8 CSA entries (2 blocks), 2 HCA
    assert [len(b) for b in first.entry_block_ids.values()] == [2, 1]
    first.num_computed_tokens = 32
    # the window's blocks behind position 32 - 8 + 1 went back (null in their place)
    assert kv.allocate_blocks(first, 1) and first.block_ids[:6] == [0] * 6
    second = _request("b", list(range(3, 40)))
    # HCA's one usable block is held: refused, and nothing taken from any pool
    free = [kv.pool.num_free_blocks, *(p.num_free_blocks for p in kv.entry_pools.values())]
    assert not kv.allocate_blocks(second, 20)
    assert second.block_ids == [] and second.entry_block_ids == {}
    assert free == [kv.pool.num_free_blocks, *(p.num_free_blocks for p in kv.entry_pools.values())]
    kv.free(first)  # finished, aborted or preempted: every pool gets its blocks back
    assert first.entry_block_ids == {} and kv.usage() == {
        "kv_blocks": 0.0, "recurrent_states": 0.0, "csa_entry_blocks": 0.0,
        "hca_entry_blocks": 0.0,
    }  # fmt: skip
    assert kv.allocate_blocks(second, 20)


def test_compressed_entries_refuse_prefix_caching_and_need_their_pools():
    with pytest.raises(ValueError, match="prefix caching is not supported"):
        KVCacheManager(4, 9, True, COMPRESSED, 2, entry_blocks=(("csa", 4), ("hca", 2)))
    with pytest.raises(ValueError, match="one pool each"):
        KVCacheManager(4, 9, False, COMPRESSED, 2, entry_blocks=(("csa", 4),))


def test_compressed_pools_split_the_budget_for_the_same_context_in_every_kind():
    from jaxinfer.config.compressed import size_pools
    from jaxinfer.config.options import EngineOptions
    from jaxinfer.models.families.hf_config import config_from_dict
    from tests.support.deepseek_v4 import LAYER_TYPES, hf_config

    cfg = hf_config(LAYER_TYPES).to_dict() | {"architectures": ["DeepseekV4ForCausalLM"]}
    arch = config_from_dict(cfg)
    specs = layer_specs(arch, jnp.float32)
    options = EngineOptions(
        kv_cache_memory_gb=0.01, block_size=8, max_num_seqs=4, max_num_batched_tokens=32
    )
    pools = size_pools(arch, specs, options, int(0.01 * (1 << 30)), jnp.float32)
    # the window: 4 requests' windows (8 positions: 1 block, + 2) and a step's 32 tokens
    assert pools.num_blocks == 4 * 3 + 4 + 2
    blocks = dict(pools.entry_blocks)
    # the same tokens of context in each kind (blocks of 8 entries of 4 or 8 tokens each)
    assert abs((blocks["csa"] - 1) * 8 * 4 - (blocks["hca"] - 1) * 8 * 8) <= 8 * 8
    window = pools.num_blocks * 6 * 8 * 16 * 4  # layers, positions, head dim, float32
    entries = (blocks["csa"] * 2 * (16 + 8) + blocks["hca"] * 2 * 16) * 8 * 4
    assert 0.98 * (1 << 30) * 0.01 < window + entries <= 1.001 * (1 << 30) * 0.01
    with_blocks = size_pools(
        arch, specs, dataclasses.replace(options, num_kv_blocks=11), 0, jnp.float32
    )  # num_kv_blocks: the window's, and every kind sized for the 80 tokens they hold
    assert with_blocks.num_blocks == 11
    assert dict(with_blocks.entry_blocks) == {"csa": 80 // 32 + 1 + 1, "hca": 80 // 64 + 1 + 1}
    # speculative_method mtp: the MTP layer's window store (a window layer more) and the
    # streams of a step (32 tokens of 4 streams of 32 floats) are paid for first
    mtp = size_pools(
        arch, specs, dataclasses.replace(options, speculative_method="mtp"),
        int(0.01 * (1 << 30)), jnp.float32,
    )  # fmt: skip
    blocks = dict(mtp.entry_blocks)
    window = mtp.num_blocks * 7 * 8 * 16 * 4
    entries = (blocks["csa"] * 2 * (16 + 8) + blocks["hca"] * 2 * 16) * 8 * 4
    streams = 32 * 4 * 32 * 4
    assert 0.98 * (1 << 30) * 0.01 < window + entries + streams <= 1.001 * (1 << 30) * 0.01
