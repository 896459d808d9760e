"""Property-based tests of the scheduler and KV-cache manager, with a stand-in for the model.

Random sequences of add, step and abort, with random lengths, budgets and pool sizes, with and
without speculative proposals (some right, some wrong); after every step the block accounting
and the scheduling limits must hold, and the outputs are the stand-in model's own.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.config import SchedulerConfig, token_buckets
from jaxinfer.config.cache_specs import AttentionSpec, StateSpec
from jaxinfer.engine.execution.row_table import RowTable
from jaxinfer.engine.execution.step import StepOutput
from jaxinfer.engine.scheduling.kv_cache_manager import KVCacheManager
from jaxinfer.engine.scheduling.request import Request, RequestStatus
from jaxinfer.engine.scheduling.scheduler import Scheduler
from jaxinfer.engine.speculation.state import SpecState
from jaxinfer.outputs import RequestMetrics
from jaxinfer.sampling_params import SamplingParams

PREFIXES = [[7] * 40, list(range(3, 43))]  # shared prompt starts, so the prefix cache is hit


def fake_next(tokens: list[int]) -> int:
    """Deterministic 'model': the next token depends only on the sequence so far."""
    return (sum(tokens) * 31 + len(tokens)) % 1000 + 3


def fake_token(request: Request) -> int:
    return fake_next(request.all_token_ids)


def process(scheduler: Scheduler, output) -> None:
    """The stand-in model's results of a step, computed when the step is processed: by then
    every earlier step is, so each request's tokens are those its sample is drawn after. A
    row after proposals samples as if they were accepted."""
    running = {r.request_id: r for r in scheduler.running}
    tokens = []
    for item in output.scheduled:
        if item.request_id not in running:
            tokens.append([0] * item.num_sample_rows)  # (dropped: it left the running set)
            continue
        known = running[item.request_id].all_token_ids
        drafts = list(item.draft_token_ids)
        tokens.append([fake_next(known + drafts[:j]) for j in range(item.num_sample_rows)])
    logprobs = [[None] * len(row) for row in tokens]
    scheduler.update_from_output(output, StepOutput(tokens, logprobs))


def propose(scheduler: Scheduler, rng, num_speculative: int) -> None:
    """Proposals for the requests caught up to their last token: the stand-in model's true
    continuation, corrupted at a random point (or not at all)."""
    for request in scheduler.running:
        if request.num_output_placeholders or request.num_tokens - request.num_computed_tokens != 1:
            continue
        count = min(rng.randrange(num_speculative + 1), 128 - 1 - request.num_tokens)
        tokens = list(request.all_token_ids)
        drafts = []
        for _ in range(max(count, 0)):
            drafts.append(fake_next(tokens + drafts))
        wrong = rng.randrange(len(drafts) + 2)
        if wrong < len(drafts):
            drafts[wrong] += 1
        request.spec_token_ids = drafts


def run_to_completion(scheduler: Scheduler, pipelined: bool) -> None:
    """Steps until done; pipelined schedules step N+1 before processing step N, as the
    engine's async scheduling does."""
    in_flight = []
    while scheduler.has_unfinished() or in_flight:
        output = scheduler.schedule()
        in_flight.append(output)
        while len(in_flight) > (1 if pipelined and output.scheduled else 0):
            process(scheduler, in_flight.pop(0))


def check_invariants(scheduler: Scheduler, requests: list[Request], output=None) -> None:
    kv, config = scheduler.kv, scheduler.config
    pool = kv.pool
    holders = Counter()
    proposed = {}  # proposals scheduled in `output`, by request id
    if output is not None:
        proposed = {item.request_id: len(item.draft_token_ids) for item in output.scheduled}
    window = kv.sliding_window
    for request in requests:
        blocks = [b for b in request.block_ids if b != 0]
        assert len(set(blocks)) == len(blocks), "a request holds a block twice"
        if request.status is not RequestStatus.RUNNING:
            assert not request.block_ids, f"{request.status} request holds blocks"
            continue
        # null blocks only where every position the request will still attend to is past them
        for index, block in enumerate(request.block_ids):
            if block == 0:
                assert window is not None, "the null block was handed out"
                last = (index + 1) * kv.block_size - 1
                assert last < request.num_computed_tokens - window + 1, "a visible block freed"
        in_flight = proposed.get(request.request_id, 0)
        assert request.num_computed_tokens <= request.num_tokens_with_placeholders + in_flight
        # Only tokens known on the host are in the prefix cache (never a proposal).
        assert request.num_cached_blocks * kv.block_size <= request.num_tokens
        for index in range(request.num_cached_blocks):  # (None: a twin block was cached)
            block = request.block_ids[index]
            if block != 0:
                assert pool.block_hash[block] in (None, kv.block_hashes(request)[index])
        assert request.num_tokens_with_placeholders <= config.max_model_len
        assert len(request.block_ids) * kv.block_size >= request.num_computed_tokens
        holders.update(blocks)
    for block in range(1, pool.num_blocks):
        assert pool.ref_counts[block] == holders[block], f"block {block}: refs != owners"
        if holders[block] > 1:
            assert pool.block_hash[block] is not None, "block shared outside the prefix cache"
    assert pool.num_free_blocks + len(holders) == pool.num_blocks - 1, "free + used != total"
    assert len(scheduler.running) <= config.max_num_seqs
    if output is not None:
        assert output.num_scheduled_tokens <= config.max_num_batched_tokens
        assert sum(item.num_new_tokens for item in output.scheduled) == output.num_scheduled_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        for item in output.scheduled if kv.state_slots else ():  # a hybrid model's
            hit = item.row_init is not None and item.num_computed_tokens > 0
            assert hit == (item.state_restore >= 0), "a prefix hit without its states"
            end = item.num_computed_tokens + item.num_new_tokens
            assert item.state_save < 0 or end % kv.block_size == 0, "states kept mid-block"
        assert all(item.num_new_tokens > 0 for item in output.scheduled)
        by_id = {r.request_id: r for r in requests}
        for item in output.scheduled:  # what the batch builder will read must be there
            request = by_id[item.request_id]
            assert request.status is RequestStatus.RUNNING, "a preempted request was scheduled"
            assert item.num_computed_tokens + item.num_new_tokens == request.num_computed_tokens
            needed = item.num_computed_tokens + item.num_new_tokens
            assert len(item.block_ids) * kv.block_size >= needed, "blocks missing"
            assert item.block_ids == tuple(request.block_ids)
            first_write = item.num_computed_tokens // kv.block_size
            assert 0 not in item.block_ids[first_write:], "the step writes to a freed block"
            if window is not None:  # the step's first query sees back to its window's start
                seen = item.num_computed_tokens - window + 1
                nulls = [i for i, b in enumerate(item.block_ids) if b == 0]
                assert all((i + 1) * kv.block_size - 1 < seen for i in nulls), "a seen block"
        ids = [item.request_id for item in output.scheduled]
        assert len(set(ids)) == len(ids)


def check_rows(rows: RowTable, output) -> None:
    """Device rows: every running request holds one, each a different one, and a request that
    starts running gets a fresh one (never more rows than max_num_seqs)."""
    for request_id in output.released:
        rows.release(request_id)
    held = set()
    for item in output.scheduled:
        row = rows.assign(item.request_id) if item.row_init else rows.row(item.request_id)
        assert row != rows.padding_row and row not in held
        held.add(row)


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(0, len(PREFIXES)),  # which shared prefix (or none)
            st.integers(1, 60),  # own prompt tokens
            st.integers(1, 30),  # max_tokens
            st.integers(-1, 1),  # priority
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    block_size=st.sampled_from([4, 8, 16]),
    num_blocks=st.integers(12, 64),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 96),
    prefix_caching=st.booleans(),
    pipelined=st.booleans(),
    num_speculative=st.sampled_from([0, 0, 3, 8]),
    spec_free_tokens=st.sampled_from([1, 8, 96]),
    spec_lookahead=st.sampled_from([0, 0, 5]),
    sliding_window=st.sampled_from([None, None, 6, 21]),
    checkpoints=st.sampled_from([None, None, 1, 3]),
    seed=st.integers(0, 2**16),
)
def test_random_add_step_abort_keeps_block_accounting(
    ops,
    block_size,
    num_blocks,
    max_num_seqs,
    budget,
    prefix_caching,
    pipelined,
    num_speculative,
    spec_free_tokens,
    spec_lookahead,
    sliding_window,
    checkpoints,
    seed,
):
    """checkpoints: a hybrid model's (a recurrent-state group beside attention, that many
    state checkpoints; None: attention only)."""
    max_model_len = 128
    if checkpoints is not None:  # (a hybrid has no sliding window, nor speculation)
        sliding_window, num_speculative = None, 0
    pipelined = pipelined and not num_speculative  # (proposals need the tokens on the host)
    rng = random.Random(seed)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        token_buckets=token_buckets(budget),
        num_speculative_tokens=num_speculative,
        spec_free_tokens=spec_free_tokens,
        spec_lookahead=spec_lookahead if num_speculative else 0,  # (a draft model's blocks)
    )
    if checkpoints is None:
        kv = KVCacheManager(
            block_size, num_blocks, prefix_caching, (AttentionSpec((0,), sliding_window),)
        )
    else:
        specs = (StateSpec((0,), 100), AttentionSpec((1,)))
        kv = KVCacheManager(
            block_size, num_blocks, prefix_caching, specs, max_num_seqs, checkpoints
        )
    scheduler = Scheduler(config, kv)
    requests: list[Request] = []

    in_flight = []

    rows = RowTable(max_num_seqs)  # the batch builder's, fed as the engine feeds it

    # A hybrid's checkpoint slots as the device fills them: the states at the end of which
    # block each holds (the builder copies a step's into them before the next step runs).
    checkpoint_slots: dict[int, bytes] = {}
    saves: list[tuple[int, bytes]] = []

    def step():
        nonlocal saves
        if num_speculative:
            propose(scheduler, rng, num_speculative)
        output = scheduler.schedule()
        check_invariants(scheduler, requests, output)
        if output.scheduled:  # (the engine builds only steps that schedule something)
            check_rows(rows, output)
            assert len(rows) == len(scheduler.running), "a row was never given back"
            checkpoint_slots.update(saves)
            saves = []
            by_id = {r.request_id: r for r in requests}
            for item in output.scheduled:
                hashes = kv.block_hashes(by_id[item.request_id])
                if item.state_restore >= 0:
                    block = item.num_computed_tokens // block_size - 1
                    assert checkpoint_slots.get(item.state_restore) == hashes[block]
                if item.state_save >= 0:
                    block = (item.num_computed_tokens + item.num_new_tokens) // block_size - 1
                    saves.append((item.state_save, hashes[block]))
        in_flight.append(output)
        while len(in_flight) > (1 if pipelined and output.scheduled else 0):
            process(scheduler, in_flight.pop(0))
            check_invariants(scheduler, requests)

    for op in ops:
        if op[0] == "add":
            _, prefix, own, max_tokens, priority = op
            prompt = (PREFIXES[prefix - 1] if prefix else []) + [
                (len(requests) * 13 + i) % 500 + 3 for i in range(own)
            ]
            request = Request(
                request_id=str(len(requests)),
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
                eos_token_ids=frozenset(),
                seed=0,
                metrics=RequestMetrics(arrival_time=0.0),
                priority=priority,
                spec=SpecState(limit=num_speculative) if num_speculative else None,
            )
            try:
                scheduler.add_request(request)
            except ValueError:
                continue  # can never fit: refused, nothing held
            requests.append(request)
        elif op[0] == "step":
            step()
        elif requests:
            scheduler.abort(requests[op[1] % len(requests)])
            check_invariants(scheduler, requests)

    for _ in range(2000):
        if not scheduler.has_unfinished() and not in_flight:
            break
        step()
    assert not scheduler.has_unfinished(), "requests left hanging"
    for request in requests:
        assert request.status.finished
        if request.status is not RequestStatus.FINISHED_ABORTED:
            expected = min(
                request.sampling_params.max_tokens, max_model_len - request.num_prompt_tokens
            )
            assert request.num_output_tokens == expected
            tokens = list(request.prompt_token_ids)
            for token in request.output_token_ids:  # the stand-in model's, proposals or not
                assert token == fake_next(tokens)
                tokens.append(token)
    assert all(count == 0 for count in kv.pool.ref_counts)
    assert all(value == 0 for kind, value in kv.usage().items() if kind != "state_checkpoints")
    if num_speculative:
        stats = scheduler.spec_stats
        assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert kv.pool.num_free_blocks == num_blocks - 1


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    block_size=st.sampled_from([4, 8, 16]),
    num_blocks=st.integers(24, 64),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(4, 96),
    pipelined=st.booleans(),
    checkpoints=st.sampled_from([1, 3, 8]),
    seed=st.integers(0, 2**16),
)
def test_hybrid_prefix_hits_restore_the_states_written_at_their_end(
    ops, block_size, num_blocks, max_num_seqs, budget, pipelined, checkpoints, seed
):
    """A hybrid model with prefix caching: every hit restores a checkpoint slot that holds
    the states at the hit's end, written by a step before (check_invariants, step())."""
    test_random_add_step_abort_keeps_block_accounting.hypothesis.inner_test(
        ops, block_size, num_blocks, max_num_seqs, budget, True, pipelined, 0, 1, 0, None,
        checkpoints, seed,
    )  # fmt: skip


@pytest.mark.parametrize("pipelined", [False, True])
def test_preempted_request_resumes_with_identical_tokens(pipelined):
    """A tiny pool forces preemption; the stand-in model's outputs must not change."""

    def run(num_blocks):
        config = SchedulerConfig(4, 64, 128, token_buckets(64))
        scheduler = Scheduler(config, KVCacheManager(4, num_blocks))
        requests = []
        for i in range(4):
            request = Request(
                request_id=str(i),
                prompt_token_ids=[(i * 7 + j) % 50 + 3 for j in range(10 + i)],
                sampling_params=SamplingParams(temperature=0, max_tokens=20),
                eos_token_ids=frozenset(),
                seed=0,
                metrics=RequestMetrics(arrival_time=0.0),
            )
            scheduler.add_request(request)
            requests.append(request)
        run_to_completion(scheduler, pipelined)
        return [r.output_token_ids for r in requests], scheduler.num_preemptions

    roomy, no_preemption = run(200)
    tight, preemptions = run(12)
    assert no_preemption == 0 and preemptions > 0
    assert roomy == tight


def test_priority_orders_admission_and_preemption():
    config = SchedulerConfig(1, 64, 128, token_buckets(64))
    scheduler = Scheduler(config, KVCacheManager(4, 100))
    made = {}
    for name, priority in [("late_low", 5), ("urgent", -1), ("normal_a", 0), ("normal_b", 0)]:
        made[name] = Request(
            request_id=name,
            prompt_token_ids=[5, 6, 7],
            sampling_params=SamplingParams(temperature=0, max_tokens=1),
            eos_token_ids=frozenset(),
            seed=0,
            metrics=RequestMetrics(arrival_time=0.0),
            priority=priority,
        )
        scheduler.add_request(made[name])
    order = []
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        order += [item.request_id for item in output.scheduled]
        process(scheduler, output)
    assert order == ["urgent", "normal_a", "normal_b", "late_low"]
