"""Hybrid models (Qwen3.5, Qwen3-Next: Gated DeltaNet layers beside attention layers) through
the whole engine, against HF transformers' generate on tiny random models: chunked prefill
(each request's states carried across its chunks), preemption (recomputed from zeros or a
checkpoint), prefix hits (the states restored from a checkpoint at a block boundary), n = 3
(the samples start from their parent's checkpoint, then keep their own states), a pool that
holds few requests' blocks; and what the engine says and refuses for them. The layer-by-layer
parity is in test_model_families."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.config.hybrid import PREFIX_CACHING_CHECKPOINTS
from tests.engine.test_model_families import hf_greedy
from tests.support.engines import build_llm
from tests.support.models import make_family_model

pytestmark = pytest.mark.engine

PROMPTS = [list(np.random.default_rng(i).integers(3, 320, size=n)) for i, n in
           enumerate([23, 37, 9, 30, 41, 17])]  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def hybrid(request, tmp_path_factory):
    folder = make_family_model(tmp_path_factory.mktemp(request.param), request.param)
    return folder, hf_greedy(folder, PROMPTS, 12)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_generates_hugging_faces_tokens_under_chunking_and_preemption(
    hybrid, async_scheduling
):
    folder, expected = hybrid
    # 16 tokens a step (every prompt chunked); 15 blocks of 8 tokens for 4 running requests
    # of up to 53 tokens: requests are preempted and recomputed
    llm = build_llm(folder, "tiny", num_kv_blocks=16, async_scheduling=async_scheduling)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert llm.engine.stats().num_preemptions > 0, "the small pool must preempt"
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["checkpoints", "recompute"])
def test_n_samples_each_keep_their_own_state(hybrid, prefix_caching):
    """n = 3 greedy samples of two prompts at once: every sample HF's tokens (a sample that
    read another's state, or its parent's after it moved on, would differ). With prefix
    caching the samples wait for the first one's checkpoint and start from it."""
    folder, expected = hybrid
    llm = build_llm(folder, "tiny", max_num_seqs=8, enable_prefix_caching=prefix_caching)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for output, tokens in zip(outputs, expected[:2], strict=True):
        assert [list(c.token_ids) for c in output.outputs] == [tokens] * 3
    # 2 samples of each prompt hit its blocks up to the last full one (8-token blocks)
    hits = 2 * sum((len(p) - 1) // 8 * 8 for p in PROMPTS[:2]) if prefix_caching else 0
    assert llm.engine.stats().prefix_cache_hits == hits


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prefix_hits_restore_the_checkpointed_states(hybrid, async_scheduling):
    """Prompts that share a cached prefix (the same prompt again, a prompt extending one, a
    prompt extending another's first block) start from the states checkpointed at the hit's
    end and give HF's tokens; a hit without its checkpoint is never taken."""
    folder, expected = hybrid
    llm = build_llm(folder, "tiny", max_num_seqs=8, async_scheduling=async_scheduling)
    engine = llm.engine
    assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:3], GREEDY)] == (
        expected[:3]
    )
    later = [
        PROMPTS[0],  # the same: a hit up to its last full block (16 of 23)
        PROMPTS[1] + [7, 8, 9, 10, 11, 12, 13],  # 44: its checkpoint at 32 (of 37)
        PROMPTS[0][:11] + [5] * 20,  # its first block in common: no checkpoint at 8
        PROMPTS[2] * 2,  # 9 tokens: its checkpoint at 8
    ]
    before = engine.stats().prefix_cache_hits
    outputs = llm.generate(later, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(folder, later, 12)
    assert engine.stats().prefix_cache_hits - before == 16 + 32 + 0 + 8
    usage = engine.stats().cache_usage
    assert 0 < usage["state_checkpoints"] <= 1


def test_describe_reports_states_and_how_prefix_caching_works(hybrid):
    folder, _ = hybrid
    llm = build_llm(folder, "tiny")
    description = llm.engine.describe()
    assert description["kv_cache_layers"] == 2  # of 4 layers, 2 are attention layers
    groups = description["cache_groups"]
    assert [(g["kind"], g["layers"]) for g in groups] == [
        ("recurrent_state", [0, 2]),
        ("full_attention", [1, 3]),
    ]
    assert groups[0]["bytes_per_request"] > 0 and groups[1]["sliding_window"] is None
    assert groups[1]["bytes_per_token"] > 0
    states = description["recurrent_states"]
    assert states["slots"] == 4 and states["layers"] == 2 and states["prefix_checkpoints"] == 4
    # conv [C, K - 1] in float32 and delta f32[Hv, Dk, Dv], per layer
    conv, delta = (2 * 2 * 16 + 4 * 8) * 3 * 4, 4 * 16 * 8 * 4
    assert states["bytes_per_request"] == 2 * (conv + delta)
    prefix = description["resolved"]["prefix_caching"]
    assert prefix == {"value": True, "reason": PREFIX_CACHING_CHECKPOINTS}
    assert description["resolved"]["gated_delta"]["value"] == "cpu"  # the C++ kernel
    # The manager holds a state slot per running request, beside the blocks, and says so.
    engine = llm.engine
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=3), "a")
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3), "b")
    engine.step()
    stats = engine.stats()
    assert stats.cache_capacity["recurrent_states"] == stats.cache_capacity["state_checkpoints"]
    assert stats.cache_usage["recurrent_states"] == 0.5 and stats.cache_usage["kv_blocks"] > 0
    while engine.has_unfinished_requests():
        engine.step()
    usage = engine.stats().cache_usage
    assert usage["kv_blocks"] == 0.0 and usage["recurrent_states"] == 0.0
    assert usage["state_checkpoints"] == 0.0  # (the prompts are shorter than one block)


@pytest.mark.parametrize(
    "option",
    [
        dict(speculative_method="ngram", num_speculative_tokens=2),
        dict(enable_lora=True),
        dict(kv_cache_dtype="int8"),
        dict(layer_execution="per_layer"),
        dict(batch_invariant=True, gated_delta_impl="reference"),
    ],
    ids=lambda o: next(iter(o)),
)
def test_options_a_hybrid_cannot_run_with_are_refused(hybrid, option):
    folder, _ = hybrid
    name = next(iter(option))
    message = (
        "batch_invariant: the reference delta rule"
        if name == "batch_invariant"
        else f"{name} .* not supported on a hybrid model"
    )
    with pytest.raises(ValueError, match=message):
        build_llm(folder, "tiny", **option)


def test_gated_delta_impl_is_refused_for_a_model_without_linear_layers(tmp_path):
    folder = make_family_model(tmp_path, "qwen3")
    with pytest.raises(ValueError, match="gated_delta_impl applies to hybrid models"):
        build_llm(folder, "tiny", gated_delta_impl="cpu")


def test_batch_invariant_alone_among_others_and_under_preemption(hybrid):
    """batch_invariant: a request's tokens and logprobs are bit-identical alone, among others
    (its prompt chunked at other points, its decodes beside prefills), and preempted."""
    from tests.engine.test_batch_invariant import FIXED_PROMPT, among, record, traffic

    folder, _ = hybrid
    options = dict(max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(1, 16))
    llm = build_llm(folder, "tiny", **options, num_kv_blocks=256, batch_invariant=True)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3)
    alone = record(llm.generate([FIXED_PROMPT], params, use_tqdm=False)[0])
    for count in (3, 7):
        assert among(llm, random.Random(count), count, params=params) == alone
    small = build_llm(folder, "tiny", **options, num_kv_blocks=20, batch_invariant=True)
    prompts, _ = traffic(random.Random(2), 7)
    others = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in prompts]
    outputs = small.generate([*prompts, FIXED_PROMPT], [*others, params], use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0, "the small pool must preempt"
    assert record(outputs[-1]) == alone


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_tensor_parallel_splits_the_heads_and_gives_one_devices_tokens(family, tmp_path):
    """Over 2 devices: each holds half of every layer's heads (the linear layers' key-head
    groups, their states, the attention heads and the KV cache) and the greedy tokens are
    HF's, as on one device."""
    from tests.support.parity import Harness

    folder = make_family_model(tmp_path, family)
    harness = Harness(folder, "scan", tensor_parallel_size=2)
    linear = harness.state["layers"]["linear"]["in_proj_qkv"].get_value().w  # [Ll, E, C]
    assert linear.addressable_shards[0].data.shape[-1] * 2 == linear.shape[-1]
    delta = harness.runner.kv_cache.delta  # [Ll, S, Hv, Dk, Dv]
    assert delta.addressable_shards[0].data.shape[2] * 2 == delta.shape[2]
    kv = harness.runner.kv_cache.kv.values  # [La, 2, NB, BS, K, D]
    assert kv.addressable_shards[0].data.shape[4] * 2 == kv.shape[4]
    prompts = {str(i): p for i, p in enumerate(PROMPTS[:3])}
    assert list(harness.greedy(prompts, 8).values()) == hf_greedy(folder, PROMPTS[:3], 8)


def test_tensor_parallel_needs_whole_heads_on_each_device(hybrid):
    folder, _ = hybrid
    with pytest.raises(ValueError, match="tensor_parallel_size 4 must divide"):
        build_llm(folder, "tiny", tensor_parallel_size=4)
