"""The engine end to end on a tiny random model: buckets, stops, seeds, validation, text."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxinfer import SamplingParams
from jaxinfer.config import EngineOptions
from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from tests.support.compiles import counting_compiles
from tests.support.engines import build_llm

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return build_llm(
        tiny_model_dir,
        None,
        max_num_batched_tokens=32,
        token_buckets=(2, 8),
        max_num_seqs=8,
        block_size=8,
        num_kv_blocks=96,
        max_model_len=128,
    )


def prompts_of(lengths: list[int], vocab: int = 320) -> list[list[int]]:
    return [[(7 * i + 3 * j) % (vocab - 3) + 3 for j in range(n)] for i, n in enumerate(lengths)]


def test_no_compilation_after_warmup(llm):
    with counting_compiles() as compiles:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7))  # the listener does see a compilation
        assert compiles
        compiles.clear()
        prompts = prompts_of([1, 5, 31, 33, 70, 12, 9, 2, 17, 45])  # chunked and mixed
        params = [
            SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0.8, max_tokens=20, seed=1, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=3, logprobs=4, ignore_eos=True),
        ] * 3 + [SamplingParams(temperature=0, max_tokens=40, logprobs=0, ignore_eos=True)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert compiles == [], f"{len(compiles)} compilations after warm-up"


def test_continuous_batching_finishes_everything(llm):
    prompts = prompts_of([3, 40, 8, 8, 25, 1, 60, 14, 5, 33, 2, 19])  # more than max_num_seqs
    params = [
        SamplingParams(temperature=0, max_tokens=1 + (i * 5) % 17, ignore_eos=True)
        for i in range(12)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, p, prompt in zip(outputs, params, prompts, strict=True):
        assert output.finished and output.prompt_token_ids == prompt
        assert len(output.outputs[0].token_ids) == p.max_tokens
        assert output.outputs[0].finish_reason == "length"
        metrics = output.metrics
        assert metrics.arrival_time <= metrics.first_token_time <= metrics.finished_time
    assert (
        llm.engine.kv_cache_manager.pool.num_free_blocks == llm.engine.config.cache.num_blocks - 1
    )


def test_stop_token_ids_and_eos(llm):
    prompt = prompts_of([10])[0]
    free = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    tokens = free[0].outputs[0].token_ids
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    stopped = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0]
    completion = stopped.outputs[0]
    assert completion.token_ids == tokens[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_at

    # The same token as the model's EOS: stops unless ignore_eos.
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset([stop_at])
    try:
        eos_stop = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
        )[0]
        ignored = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )[0]
    finally:
        engine.eos_token_ids = saved
    assert eos_stop.outputs[0].token_ids == tokens[: first + 1]
    assert eos_stop.outputs[0].finish_reason == "stop" and eos_stop.outputs[0].stop_reason is None
    assert ignored.outputs[0].token_ids == tokens


def test_max_model_len_ends_with_length(llm):
    prompt = prompts_of([120])[0]
    output = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(output.outputs[0].token_ids) == 128 - 120
    assert output.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    prompt = prompts_of([6])[0]
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [*prompts_of([30, 2, 50]), prompt]
    params = [SamplingParams(temperature=0.7, max_tokens=5)] * 3 + [seeded]
    in_batch = llm.generate(crowd, params, use_tqdm=False)[-1].outputs[0].token_ids
    assert alone == in_batch
    other_seed = SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = {
        tuple(llm.generate([prompt], unseeded, use_tqdm=False)[0].outputs[0].token_ids)
        for _ in range(3)
    }
    assert len(runs) > 1, "requests without a seed must draw fresh randomness"


def test_logprobs_hold_top_n_and_sampled_token(llm):
    output = llm.generate(
        prompts_of([12]),
        SamplingParams(temperature=1.0, max_tokens=6, logprobs=3, seed=5),
        use_tqdm=False,
    )[0]
    completion = output.outputs[0]
    assert len(completion.logprobs) == 6
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token in entry and 3 <= len(entry) <= 4
        assert all(v <= 0 for v in entry.values())
        top = sorted(entry.values(), reverse=True)[:3]
        assert top == sorted(top, reverse=True)
    none = llm.generate(prompts_of([12]), SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert none.outputs[0].logprobs is None


def test_text_and_chat(llm):
    text_out = llm.generate(
        "The quick brown fox", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )[0]
    completion = text_out.outputs[0]
    assert text_out.prompt == "The quick brown fox"
    assert text_out.prompt_token_ids == llm.tokenizer.encode("The quick brown fox")
    assert completion.text == llm.tokenizer.decode(completion.token_ids)
    chat = llm.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams(temperature=0, max_tokens=4),
        use_tqdm=False,
    )[0]
    assert chat.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bad_requests_are_refused_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(3, 131))], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 100000]], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="3 SamplingParams for 2 prompts"):
        llm.generate(prompts_of([3, 4]), [SamplingParams()] * 3, use_tqdm=False)
    # A batch with one bad prompt admits none of it, and nothing leaks.
    with pytest.raises(ValueError):
        llm.generate(
            [*prompts_of([4]), list(range(3, 200))], SamplingParams(max_tokens=2), use_tqdm=False
        )
    assert not llm.engine.has_unfinished_requests()
    assert (
        llm.engine.kv_cache_manager.pool.num_free_blocks == llm.engine.config.cache.num_blocks - 1
    )
    assert llm.generate(prompts_of([4]), SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_request_larger_than_pool_is_refused(tiny_model_dir):
    small = build_llm(
        tiny_model_dir,
        None,
        num_kv_blocks=5,
        block_size=8,
        max_num_batched_tokens=16,
        token_buckets=(2,),
        max_num_seqs=4,
        max_model_len=256,
    )
    with pytest.raises(ValueError, match="whole pool"):
        small.generate(prompts_of([20]), SamplingParams(max_tokens=40), use_tqdm=False)
    assert small.generate(prompts_of([20]), SamplingParams(max_tokens=10), use_tqdm=False)[
        0
    ].finished


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(block_size=12), "block_size"),
        (dict(num_kv_blocks=1), "num_kv_blocks"),
        (dict(dtype="int4"), "dtype"),
        (dict(max_model_len=-5), "max_model_len"),
        (dict(kv_cache_memory_gb=0), "kv_cache_memory_gb"),
        (dict(async_scheduling="yes"), "async_scheduling"),
    ],
)
def test_engine_options_validation(options, message):
    with pytest.raises(ValueError, match=message):
        EngineOptions(**options)


def test_engine_option_unknown_or_too_long(tiny_model_dir):
    with pytest.raises(TypeError):
        EngineOptions(max_num_sequences=3)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        build_llm(tiny_model_dir, None, max_model_len=100000)


def test_incremental_detokenizer_never_splits_utf8(llm):
    tokenizer = llm.tokenizer.tokenizer
    text = "東京は日本の首都です。 Zwölf 🚀 ✓"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text) / 2  # byte-level pieces, some inside characters
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == text
    assert detok.finish() == "" and detok.text == text

    # Bytes that never become valid UTF-8 are flushed at the end, as a one-shot decode has them.
    partial = tokenizer.encode("🦀", add_special_tokens=False).ids[:-1]
    assert partial  # an unseen emoji is several byte tokens
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    held = "".join(detok.add(i) for i in partial)
    assert "\ufffd" not in held
    assert held + detok.finish() == detok.text == tokenizer.decode(partial)


def test_kv_cache_is_donated(llm):
    runner = llm.engine.runner
    before = runner.kv_cache.values
    llm.generate(prompts_of([4]), SamplingParams(max_tokens=2), use_tqdm=False)
    assert before.is_deleted() and not runner.kv_cache.values.is_deleted()
    assert isinstance(runner.kv_cache.values, jax.Array) and runner.kv_cache.scales is None


def test_scan_and_per_layer_execution_agree(llm, tiny_model_dir):
    # "auto" on CPU: the layers under a scan where the C++ matmul kernel reads their weights
    # in place, else one program per layer; and one step at a time
    default = llm.engine.runner.layer_execution
    assert default == ("scan" if llm.engine.runner.kernels.matmul is not None else "per_layer")
    assert not llm.engine.config.async_scheduling
    # the other execution, with async scheduling (as on accelerators)
    scan = build_llm(
        tiny_model_dir,
        None,
        layer_execution="per_layer" if default == "scan" else "scan",
        async_scheduling=True,
        max_num_batched_tokens=32,
        token_buckets=(2, 8),
        max_num_seqs=8,
        block_size=8,
        num_kv_blocks=96,
        max_model_len=128,
    )
    assert scan.engine.runner.layer_execution != default
    prompts = prompts_of([3, 40, 17, 1])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ours = llm.generate(prompts, params, use_tqdm=False)
    theirs = scan.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, theirs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert max(abs(x[k] - y[k]) for k in x) < 1e-4


def test_request_ids_unique_and_user_ids_respected(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=1)
    mine = engine.add_request([5, 6], params, request_id=str(engine._next_id))
    auto = engine.add_request([5, 6], params)
    assert auto.request_id != mine.request_id
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6], params, request_id=mine.request_id)
    for request_id in (mine.request_id, auto.request_id):
        engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()


def test_block_table_rows_move_only_when_they_change(llm):
    """The device keeps the block table; a step sends a request's row only when it gained a
    block (or the request took a row), not on every decode step."""
    engine = llm.engine
    build = engine.batch_builder.build
    sent = []

    def watched_build(scheduler_output):
        step = build(scheduler_output)
        update = step.updates.block_table
        sent.append(
            0 if update is None else int((update.rows != engine.batch_builder.padding_row).sum())
        )
        return step

    engine.batch_builder.build = watched_build
    try:
        # block_size 8: a 5-token prompt and 20 outputs use positions 0..23, blocks 0..2.
        output = llm.generate(
            prompts_of([5]),
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
            use_tqdm=False,
        )[0]
    finally:
        engine.batch_builder.build = build
    assert len(output.outputs[0].token_ids) == 20
    assert len(sent) == 20
    # The admission step sends the row with block 0; blocks 1 and 2 are sent when positions 8
    # and 16 are first computed (steps 4 and 12); the other 17 steps send nothing.
    assert [i for i, n in enumerate(sent) if n] == [0, 4, 12] and sum(sent) == 3


def test_second_start_loads_every_program_from_the_compilation_cache(tiny_model_dir, tmp_path):
    """Each start in its own process (JAX's cache directory is set once per process)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from jaxinfer.config import EngineOptions\n"
        "from jaxinfer.engine.llm_engine import LLMEngine\n"
        "e = LLMEngine(EngineOptions(model=sys.argv[1], compilation_cache_dir=sys.argv[2],"
        " max_num_batched_tokens=16, token_buckets=(2,), max_num_seqs=4, block_size=8,"
        " num_kv_blocks=64, max_model_len=96))\n"
        "print('COUNTS', e.warmup_programs, e.warmup_cache_hits)\n"
    )

    def start() -> tuple[int, int]:
        result = subprocess.run(
            [sys.executable, "-c", script, str(tiny_model_dir), str(tmp_path / "xla")],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        line = next(x for x in result.stdout.splitlines() if x.startswith("COUNTS"))
        programs, hits = map(int, line.split()[1:])
        return programs, hits

    programs, hits = start()
    assert programs > 10 and hits == 0
    assert start() == (programs, programs)  # nothing compiled the second time
