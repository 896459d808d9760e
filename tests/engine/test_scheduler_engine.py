"""Scheduling depth on a tiny real model: the same greedy tokens whatever the memory pressure,
token budget or prefix caching, cache hits on shared prefixes, and aborts that leak nothing."""

from __future__ import annotations

import pytest

from jaxinfer import LLM, SamplingParams
from tests.support.compiles import counting_compiles
from tests.support.engines import build_llm
from tests.support.prompts import SHARED_PREFIX, prompts

pytestmark = pytest.mark.engine

# steps padded to 2, 8 or the budget
COMMON = dict(block_size=8, max_model_len=128, max_num_seqs=8, token_buckets=(2, 8))


PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    model = str(tiny_model_dir)
    return {
        "roomy": build_llm(model, None, num_kv_blocks=256, max_num_batched_tokens=128, **COMMON),
        "tiny_pool": build_llm(model, None, num_kv_blocks=24, max_num_batched_tokens=128, **COMMON),
        "tiny_budget": build_llm(
            model, None, num_kv_blocks=256, max_num_batched_tokens=8, **COMMON
        ),
        "tiny_budget_async": build_llm(
            model,
            None,
            num_kv_blocks=256,
            max_num_batched_tokens=8,
            async_scheduling=True,
            **COMMON,
        ),
        "no_cache": build_llm(
            model,
            None,
            num_kv_blocks=256,
            max_num_batched_tokens=128,
            enable_prefix_caching=False,
            **COMMON,
        ),
    }


def tokens(llm: LLM, batch, params=PARAMS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def assert_pool_empty(llm: LLM) -> None:
    engine = llm.engine
    pool = engine.kv_cache_manager.pool
    assert not engine.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert all(count == 0 for count in pool.ref_counts)


def test_same_tokens_under_preemption_chunking_and_caching(engines):
    batch = prompts(8)
    reference = tokens(engines["roomy"], batch)
    assert all(len(t) == PARAMS.max_tokens for t in reference)

    tiny_pool = engines["tiny_pool"]
    before = tiny_pool.engine.stats().num_preemptions
    assert tokens(tiny_pool, batch) == reference
    assert tiny_pool.engine.stats().num_preemptions > before, "the small pool must preempt"

    tiny_budget = engines["tiny_budget"]
    assert all(len(p) > 8 for p in batch)  # every prompt is chunked
    assert tokens(tiny_budget, batch) == reference
    assert tokens(engines["no_cache"], batch) == reference
    for llm in engines.values():
        assert_pool_empty(llm)


def test_second_wave_hits_the_prefix_cache(engines):
    roomy, no_cache = engines["roomy"], engines["no_cache"]
    first, second = prompts(4, SHARED_PREFIX), prompts(8, SHARED_PREFIX)[4:]
    tokens(roomy, first)
    stats = roomy.engine.stats()
    queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    assert tokens(roomy, second) == tokens(no_cache, second)
    stats = roomy.engine.stats()
    new_queries, new_hits = stats.prefix_cache_queries - queries, stats.prefix_cache_hits - hits
    # Every request of the second wave finds the 48-token prefix (6 blocks of 8).
    assert new_hits >= 4 * len(SHARED_PREFIX), (new_queries, new_hits)
    assert no_cache.engine.stats().prefix_cache_hits == 0
    assert_pool_empty(roomy)


def test_cache_salt_isolates_tenants(engines):
    engine = engines["roomy"].engine
    prompt = [*SHARED_PREFIX, 9, 9, 9]
    params = SamplingParams(temperature=0, max_tokens=2)

    def hits_for(salt):
        before = engine.stats().prefix_cache_hits
        engine.add_request(prompt, params, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        return engine.stats().prefix_cache_hits - before

    hits_for("tenant-a")
    assert hits_for("tenant-a") == len(SHARED_PREFIX)
    assert hits_for("tenant-b") == 0
    assert hits_for("tenant-b") == len(SHARED_PREFIX)


@pytest.mark.parametrize("engine_name", ["tiny_budget", "tiny_budget_async"])
@pytest.mark.parametrize("stage", ["waiting", "mid_prefill", "decoding"])
def test_abort_at_any_stage_frees_everything(engines, stage, engine_name):
    llm = engines[engine_name]  # 8-token budget: prompts take several steps
    engine = llm.engine
    long_params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    victims = [engine.add_request(p, long_params) for p in prompts(10, SHARED_PREFIX)]
    target = victims[-1] if stage == "waiting" else victims[0]
    for _ in range(200):
        if stage == "waiting" and target in engine.scheduler.waiting:
            break
        if stage == "mid_prefill" and 0 < target.num_computed_tokens < target.num_prompt_tokens:
            break
        if stage == "decoding" and target.num_output_tokens >= 2:
            break
        engine.step()
    else:
        pytest.fail(f"never reached stage {stage}")
    held = list(target.block_ids)
    if stage != "waiting":
        assert held
    engine.abort_request(target.request_id)
    assert target.status.value == "abort" and target.block_ids == []
    for request in victims:
        engine.abort_request(request.request_id)
    assert_pool_empty(llm)
    # The engine goes on serving.
    assert tokens(llm, prompts(1))[0]


def test_request_metrics_and_stats(engines):
    llm = engines["roomy"]
    output = llm.generate(
        prompts(1), SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0]
    metrics = output.metrics
    assert metrics.queue_time >= 0 and metrics.time_to_first_token >= metrics.queue_time
    assert len(metrics.inter_token_latencies) == 4 and min(metrics.inter_token_latencies) >= 0
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


def test_async_scheduling_gives_the_same_results_as_sync(tiny_model_dir):
    """Async scheduling (step N+1 scheduled while step N runs, its decode inputs read on the
    device) against one step at a time, under preemption and chunking, with greedy, seeded and
    logprob requests and early stops."""
    options = dict(num_kv_blocks=20, max_num_batched_tokens=16, **COMMON)
    sync = build_llm(tiny_model_dir, None, async_scheduling=False, **options)
    pipelined = build_llm(tiny_model_dir, None, async_scheduling=True, **options)
    batch = prompts(8)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = tokens(sync, batch, greedy)
    params = []
    for i, output in enumerate(reference):
        kind = i % 4
        if kind == 0:
            params.append(greedy)
        elif kind == 1:  # stops early on a token it will generate
            params.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[output[5]]))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.9, seed=i, max_tokens=20, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=7 + i, logprobs=3))

    most_placeholders = []
    schedule = pipelined.engine.scheduler.schedule

    def watched_schedule():
        output = schedule()
        running = pipelined.engine.scheduler.running
        most_placeholders.append(max((r.num_output_placeholders for r in running), default=0))
        return output

    pipelined.engine.scheduler.schedule = watched_schedule
    preemptions = [llm.engine.stats().num_preemptions for llm in (sync, pipelined)]
    expected = sync.generate(batch, params, use_tqdm=False)
    with counting_compiles() as compiles:
        got = pipelined.generate(batch, params, use_tqdm=False)
    assert not compiles, "async scheduling compiled after warm-up"
    for want, have in zip(expected, got, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].finish_reason == want.outputs[0].finish_reason
        assert have.outputs[0].text == want.outputs[0].text
        if want.outputs[0].logprobs is not None:
            for a, b in zip(have.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
                assert a.keys() == b.keys()
                assert all(abs(a[k] - b[k]) < 1e-5 for k in a)
    stopped = [len(o.outputs[0].token_ids) for o in got[1::4]]
    assert stopped == [r.index(r[5]) + 1 for r in reference[1::4]]  # at the first stop token
    for llm, before in zip((sync, pipelined), preemptions, strict=True):
        assert llm.engine.stats().num_preemptions > before, "the small pool must preempt"
        assert_pool_empty(llm)
    assert max(most_placeholders) == 2, "no step was scheduled while another was in flight"


def test_reset_prefix_cache(engines):
    llm = engines["roomy"]
    engine = llm.engine
    prompt = [*SHARED_PREFIX, 4, 4]
    params = SamplingParams(temperature=0, max_tokens=3)

    def hits():
        before = engine.stats().prefix_cache_hits
        llm.generate([prompt], params, use_tqdm=False)
        return engine.stats().prefix_cache_hits - before

    hits()
    assert hits() == len(SHARED_PREFIX)
    engine.add_request(prompt, params, request_id="busy")
    assert not engine.reset_prefix_cache()  # refused while a request is unfinished
    engine.abort_request("busy")
    assert engine.reset_prefix_cache()
    assert hits() == 0
