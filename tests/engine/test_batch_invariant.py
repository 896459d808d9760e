"""batch_invariant: a fixed request's tokens, logprobs and prompt logprobs are bit-identical
alone, among 1 to 63 random other requests, under other token budgets (chunked prefill at
other points), after preemption and recompute, and with its prefix from the cache; on the
tiny model and the default model."""

from __future__ import annotations

import random

import pytest

from jaxinfer import LLM, SamplingParams
from tests.support.engines import build_llm

pytestmark = [pytest.mark.engine, pytest.mark.invariance]

# max_num_seqs 64: batches of up to 64 requests; 128 tokens a step, so 64 prompts arrive in
# chunks and the fixed request's prompt shares steps with decodes and other chunks. Steps of
# 1, 16 and 128 tokens (1, 16 and 64 requests): a request alone decodes one token at a time.
WIDE = dict(
    max_num_seqs=64,
    max_num_batched_tokens=128,
    token_buckets=(1, 16),
    block_size=8,
    num_kv_blocks=1024,
    max_model_len=96,
)
FIXED_PROMPT = [7, 3, *range(40, 80)]  # 42 tokens
FIXED = SamplingParams(temperature=0, max_tokens=16, logprobs=3, prompt_logprobs=3)


def record(output) -> tuple:
    """Everything the request returned, floats compared exactly."""
    completion = output.outputs[0]
    return (
        tuple(completion.token_ids),
        tuple(tuple(sorted(step.items())) for step in completion.logprobs or ()),
        tuple(
            None if step is None else tuple(sorted(step.items()))
            for step in output.prompt_logprobs or ()
        ),
    )


def traffic(rng: random.Random, count: int, vocab: int = 300) -> tuple[list, list]:
    """Random other requests: prompts of 1-60 tokens, greedy or seeded sampling, 1-30 tokens."""
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 61))] for _ in range(count)]
    params = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.8]),
            top_p=rng.choice([1.0, 0.9]),
            seed=rng.randrange(10**6),
            max_tokens=rng.randrange(1, 31),
            logprobs=rng.choice([None, 2]),
        )
        for _ in range(count)
    ]
    return prompts, params


def among(llm: LLM, rng: random.Random, count: int, prompt=FIXED_PROMPT, params=FIXED) -> tuple:
    """The fixed request's record when it runs at a random place among `count` others."""
    prompts, others = traffic(rng, count)
    where = rng.randrange(count + 1)
    outputs = llm.generate(
        [*prompts[:where], prompt, *prompts[where:]],
        [*others[:where], params, *others[where:]],
        use_tqdm=False,
    )
    return record(outputs[where])


@pytest.fixture(scope="module")
def wide(make_llm):
    return make_llm("tiny", **{**WIDE, "batch_invariant": True})


@pytest.fixture(scope="module")
def alone(wide) -> tuple:
    return record(wide.generate([FIXED_PROMPT], FIXED, use_tqdm=False)[0])


def test_the_mode_is_described(wide):
    resolved = wide.engine.describe()["resolved"]
    assert resolved["batch_invariant"]["value"] is True
    assert resolved["matmul"]["value"] == "cpu" and resolved["attention"]["value"] == "cpu"
    assert resolved["norm"]["value"] == "invariant" and resolved["gguf_blocks"]["value"] is False


@pytest.mark.parametrize("count", [1, 3, 7, 15, 31, 63])
def test_alone_or_among_others_bit_identical(wide, alone, count):
    assert among(wide, random.Random(count), count) == alone


def test_another_budget_and_preemption_bit_identical(make_llm, alone):
    # 16 tokens a step (the prompt in three chunks, the buckets all different) and a pool of
    # 20 blocks, which the fixed request among 7 others that run long must preempt.
    small = make_llm("tiny", batch_invariant=True, num_kv_blocks=20, max_num_seqs=8)
    assert record(small.generate([FIXED_PROMPT], FIXED, use_tqdm=False)[0]) == alone
    assert among(small, random.Random(1), 3) == alone
    before = small.engine.stats().num_preemptions
    prompts, _ = traffic(random.Random(2), 7)
    others = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in prompts]
    outputs = small.generate([*prompts, FIXED_PROMPT], [*others, FIXED], use_tqdm=False)
    assert small.engine.stats().num_preemptions > before, "the small pool must preempt"
    assert record(outputs[-1]) == alone


def test_prefix_cache_hits_bit_identical(wide, alone):
    # A request with the same first 32 tokens runs first (in a batch of others), so the fixed
    # request finds 4 blocks of its prompt computed in another step, beside other rows.
    before = wide.engine.stats().prefix_cache_hits
    rng = random.Random(3)
    among(wide, rng, 5, prompt=[*FIXED_PROMPT[:32], 9, 9, 9], params=SamplingParams(max_tokens=2))
    fixed = wide.generate([FIXED_PROMPT], FIXED, use_tqdm=False)[0]
    assert wide.engine.stats().prefix_cache_hits - before >= 32
    assert record(fixed) == alone


def test_two_hundred_identical_requests_one_completion(wide, make_llm):
    """200 runs of one temperature-0 request among 100 random others: one distinct completion
    (tokens and logprobs). With the mode off the count is reported, not asserted."""
    rng = random.Random(4)
    prompts, others = traffic(rng, 100)
    jobs = [(FIXED_PROMPT, FIXED)] * 200 + list(zip(prompts, others, strict=True))
    rng.shuffle(jobs)
    counts = {}
    # (the default mode on the server tests' engine: 8 requests a step, 64 tokens)
    for name, llm in [("invariant", wide), ("default", make_llm("served"))]:
        outputs = llm.generate([j[0] for j in jobs], [j[1] for j in jobs], use_tqdm=False)
        distinct = {record(o) for o, j in zip(outputs, jobs, strict=True) if j[1] is FIXED}
        counts[name] = len(distinct)
    print(f"distinct completions of 200: {counts}")
    assert counts["invariant"] == 1


@pytest.mark.default_model
def test_default_model_bit_identical(model_cache_dir):
    llm = build_llm(
        None,
        None,
        cache_dir=str(model_cache_dir),
        max_model_len=256,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        token_buckets=(1, 16),
        batch_invariant=True,
    )
    prompt = "Explain in one sentence why the sky is blue."
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=2)
    alone = record(llm.generate([prompt], params, use_tqdm=False)[0])
    rng = random.Random(5)
    words = ["sea", "tree", "count", "why", "blue", "code", "list", "the", "prime", "stone"]
    for count in (3, 15):
        prompts = [" ".join(rng.choices(words, k=rng.randrange(2, 40))) for _ in range(count)]
        others = [
            SamplingParams(temperature=0.7, seed=i, max_tokens=rng.randrange(1, 16))
            for i in range(count)
        ]
        where = rng.randrange(count + 1)
        outputs = llm.generate(
            [*prompts[:where], prompt, *prompts[where:]],
            [*others[:where], params, *others[where:]],
            use_tqdm=False,
        )
        assert record(outputs[where]) == alone, f"among {count}"


def test_moe_model_bit_identical(tmp_path_factory):
    """A mixture-of-experts model (Qwen3-MoE, 8 experts, top 2): the router and the experts'
    grouped products through the C++ kernels in their fixed order, whatever rows share the
    experts."""
    from tests.support.models import make_family_model

    folder = make_family_model(tmp_path_factory.mktemp("moe_invariant"), "qwen3_moe")
    options = dict(max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=512)
    llm = build_llm(folder, None, **{**WIDE, **options, "batch_invariant": True})
    alone = record(llm.generate([FIXED_PROMPT], FIXED, use_tqdm=False)[0])
    for count in (5, 15):
        assert among(llm, random.Random(10 + count), count) == alone


def test_pallas_kernels_bit_identical(make_llm):
    """The GPU form of the mode: projections through the Pallas matmul kernel, attention and
    norms through their Pallas kernels in fixed order (compiled on a GPU, interpreted here)."""
    import jax

    impl = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"
    kernels = {f"{kind}_impl": impl for kind in ("matmul", "attention", "norm")}
    options = dict(max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(1, 16))
    llm = make_llm("tiny", **{**WIDE, **options, **kernels, "batch_invariant": True})
    resolved = llm.engine.describe()["resolved"]
    assert [resolved[k]["value"] for k in ("matmul", "attention", "norm", "ffn")] == [
        impl,
        impl,
        impl,
        "reference",
    ]
    alone = record(llm.generate([FIXED_PROMPT], FIXED, use_tqdm=False)[0])
    for count in (2, 7):
        assert among(llm, random.Random(20 + count), count) == alone
