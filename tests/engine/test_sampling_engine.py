"""Sampling parameters through the engine on a tiny random model: seeds in any batch, biases,
allowed and bad words, min_tokens, the penalties' device state, stop strings, and
structured outputs with llguidance."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.sampling_params import StructuredOutputsParams
from tests.support.engines import build_llm

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return build_llm(
        tiny_model_dir,
        None,
        max_num_batched_tokens=64,
        token_buckets=(2, 16),
        max_num_seqs=16,
        block_size=8,
        num_kv_blocks=160,
        max_model_len=160,
    )


def prompt(i: int, length: int = 12) -> list[int]:
    return [(7 * i + 3 * j) % 300 + 3 for j in range(length)]


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_seeded_request_is_the_same_alone_and_in_a_mixed_batch(llm):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=20)
    alone = run(llm, [prompt(0)], seeded)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=1.2, seed=i, max_tokens=5 + i, presence_penalty=0.5)
        if i % 3 == 0
        else SamplingParams(temperature=0, max_tokens=9, logit_bias={5: 3.0})
        if i % 3 == 1
        else SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.3, max_tokens=12)
        for i in range(15)
    ]
    batch = run(llm, [prompt(i + 1) for i in range(15)] + [prompt(0)], [*others, seeded])
    assert batch[-1].outputs[0].token_ids == alone
    # Unseeded random requests get fresh randomness.
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    draws = {tuple(o.outputs[0].token_ids) for o in run(llm, [prompt(0)] * 4, unseeded)}
    assert len(draws) > 1


def test_logit_bias_allowed_tokens_and_bad_words(llm):
    forced = run(
        llm, [prompt(1)], SamplingParams(temperature=0, max_tokens=6, logit_bias={42: 100})
    )
    assert forced[0].outputs[0].token_ids == [42] * 6

    allowed = [11, 12, 13]
    outputs = run(
        llm,
        [prompt(2)],
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, allowed_token_ids=allowed),
    )
    assert set(outputs[0].outputs[0].token_ids) <= set(allowed)

    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = run(llm, [prompt(3)], greedy)[0].outputs[0].token_ids

    def occurs(sequence, tokens):
        n = len(sequence)
        return any(tokens[i : i + n] == sequence for i in range(len(tokens) - n + 1))

    # A word the greedy output spells with the engine's own tokenization of it.
    decode = llm.tokenizer.tokenizer.decode
    candidates = [decode(reference[i : i + n]) for n in (1, 2, 3) for i in range(len(reference))]
    word, sequences = next(
        (w, seqs)
        for w in candidates
        if w.strip()
        for seqs in [llm.engine.input_processor.bad_word_sequences((w,))]
        if any(occurs(s, reference) for s in seqs)
    )
    blocked = (
        run(
            llm,
            [prompt(3)],
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=[word]),
        )[0]
        .outputs[0]
        .token_ids
    )
    assert not any(occurs(s, blocked) for s in sequences), (word, sequences, blocked)
    assert blocked != reference


def test_min_tokens_holds_back_stop_tokens(llm):
    greedy = run(llm, [prompt(4)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    first = greedy[0].outputs[0].token_ids[0]
    stopped = run(llm, [prompt(4)], SamplingParams(temperature=0, stop_token_ids=[first]))
    assert stopped[0].outputs[0].token_ids == [first]
    held = run(
        llm,
        [prompt(4)],
        SamplingParams(temperature=0, stop_token_ids=[first], min_tokens=4, max_tokens=12),
    )[0].outputs[0]
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]


def test_penalty_counts_on_the_device_follow_the_outputs(tiny_model_dir):
    """The device's per-slot output counts equal each running request's token counts after
    every step, through preemptions (a small pool) and chunked prompts."""
    llm = build_llm(
        tiny_model_dir,
        None,
        max_num_batched_tokens=16,
        token_buckets=(2,),
        max_num_seqs=8,
        block_size=8,
        num_kv_blocks=24,
        max_model_len=128,
    )
    engine = llm.engine
    params = SamplingParams(
        temperature=0.9, seed=5, max_tokens=24, ignore_eos=True, frequency_penalty=1.5
    )
    for i in range(6):
        engine.add_request(prompt(i, 10 + 3 * i), params)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        counts = np.asarray(engine.runner.sampler_state.output_counts)
        prompt_mask = np.asarray(engine.runner.sampler_state.prompt_mask)
        for request in engine.scheduler.running:  # each ran in the step that admitted it
            row = engine.batch_builder.rows.row(request.request_id)
            expected = np.bincount(request.output_token_ids, minlength=counts.shape[1])
            np.testing.assert_array_equal(counts[row], expected)
            in_prompt = np.zeros(counts.shape[1], bool)
            in_prompt[request.prompt_token_ids] = True
            np.testing.assert_array_equal(prompt_mask[row], in_prompt)
            checked += 1
    assert checked > 20 and engine.stats().num_preemptions > 0


def test_stop_strings_across_token_boundaries(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = run(llm, [prompt(5)], greedy)[0].outputs[0]
    tokenizer = llm.tokenizer.tokenizer
    # A stop string made of the end of token 4's text and the start of token 5's.
    before = tokenizer.decode(reference.token_ids[:4])
    upto5 = tokenizer.decode(reference.token_ids[:5])
    upto6 = tokenizer.decode(reference.token_ids[:6])
    assert len(upto5) > len(before) and len(upto6) > len(upto5)
    start = len(upto5) - 1
    stop = upto6[start : len(upto5) + 1]
    assert reference.text.find(stop) == start, "pick a stop string that occurs first there"
    out = run(llm, [prompt(5)], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == reference.text[:start]
    assert completion.token_ids == reference.token_ids[:6]
    kept = run(
        llm,
        [prompt(5)],
        SamplingParams(
            temperature=0, max_tokens=20, stop=["zzz-never", stop], include_stop_str_in_output=True
        ),
    )[0].outputs[0]
    assert kept.text == reference.text[: start + len(stop)]


def test_structured_choice_and_regex_with_a_bad_grammar_alongside(llm):
    choices = ["quick brown", "lazy dog", "emoji"]
    good = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(choice=choices),
        )
        for i in range(3)
    ] + [
        SamplingParams(
            temperature=0.8,
            seed=9,
            max_tokens=12,  # the pattern ends within 9 characters: the grammar stops it
            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{1,5}"),
        ),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),  # unconstrained
    ]
    engine = llm.engine
    requests = [engine.add_request(prompt(i), p) for i, p in enumerate(good)]
    with pytest.raises(ValueError, match="structured-output"):
        engine.add_request(
            prompt(9),
            SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: ( ")),
        )
    with pytest.raises(ValueError, match=r"structured-output|regex"):
        engine.add_request(
            prompt(9), SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a"))
        )
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.outputs[0]
    texts = [finals[r.request_id].text for r in requests]
    for text in texts[:3]:
        assert text in choices
    assert re.fullmatch(r"[0-9]{3}-[a-z]{1,5}", texts[3]), texts[3]
    assert finals[requests[3].request_id].finish_reason == "stop"
    assert len(finals[requests[4].request_id].token_ids) == 8


def test_n_samples_share_the_prompt_and_match_separate_requests(llm):
    engine = llm.engine
    long_prompt = prompt(7, 40)  # 5 full blocks of 8
    params = SamplingParams(n=3, temperature=0.9, seed=77, max_tokens=10, ignore_eos=True)
    engine.reset_prefix_cache()
    before = engine.stats()
    out = run(llm, [long_prompt], params)[0]
    stats = engine.stats()
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    # The 2nd and 3rd samples were admitted with the 1st and found its 4 full prompt blocks
    # (the block holding the last prompt token is always recomputed).
    assert stats.prefix_cache_hits - before.prefix_cache_hits == 2 * 4 * 8
    engine.reset_prefix_cache()
    for completion in out.outputs:
        alone = SamplingParams(
            temperature=0.9, seed=77 + completion.index, max_tokens=10, ignore_eos=True
        )
        assert run(llm, [long_prompt], alone)[0].outputs[0].token_ids == completion.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1

    # Aborting the parent id aborts every sample and frees their blocks.
    parent = engine.add_request(long_prompt, dataclasses.replace(params, max_tokens=40))
    engine.step()
    engine.abort_request(parent.request_id)
    assert all(child.status.value == "abort" for child in parent.children)
    assert not engine.has_unfinished_requests()
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_prompt_logprobs_match_hf_across_chunks(llm, tiny_model_dir):
    import torch
    import transformers

    long_prompt = prompt(11, 100)  # the 64-token budget chunks it
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5)
    first = run(llm, [long_prompt], params)[0]
    again = run(llm, [long_prompt], params)[0]  # no prefix-cache shortcut for these
    assert again.prompt_logprobs == first.prompt_logprobs
    result = first.prompt_logprobs
    assert len(result) == len(long_prompt) and result[0] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([long_prompt])).logits[0]
    reference = torch.log_softmax(logits.double(), dim=-1).numpy()
    for position in range(1, len(long_prompt)):
        got = result[position]
        expected = reference[position - 1]
        token = long_prompt[position]
        assert token in got
        assert abs(got[token] - expected[token]) < 1e-4
        top = sorted(got.items(), key=lambda kv: -kv[1])
        for token_id, value in top:
            assert abs(value - expected[token_id]) < 1e-4
        assert len(got) in (5, 6)  # the top 5, and the token itself when outside them
        assert min(v for t, v in got.items() if t != token or len(got) == 5) >= (
            np.sort(expected)[-5] - 1e-4
        )
    assert run(llm, [long_prompt], SamplingParams(max_tokens=2))[0].prompt_logprobs is None


def test_hostile_spec_is_refused_and_a_failing_grammar_ends_its_request(llm):
    engine = llm.engine
    # A regex whose lexer explodes: llguidance's limits end it (at admission or on a later
    # mask) and the request beside it is served as usual.
    hostile_params = SamplingParams(
        temperature=0,
        max_tokens=12,
        structured_outputs=StructuredOutputsParams(regex="(a{1000}){1000}"),
    )
    beside = engine.add_request(
        prompt(4), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    try:
        hostile = engine.add_request(prompt(1), hostile_params)
    except ValueError as error:
        assert "structured-output" in str(error)
        hostile = None
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert len(done[beside.request_id].token_ids) == 5
    if hostile is not None:
        text = done[hostile.request_id].text
        assert set(text) <= {"a"}, text  # whatever it produced obeyed the grammar

    request = engine.add_request(
        prompt(2),
        SamplingParams(
            temperature=0,
            max_tokens=10,
            structured_outputs=StructuredOutputsParams(regex="[a-z ]+"),
        ),
    )
    other = engine.add_request(prompt(3), SamplingParams(temperature=0, max_tokens=6))

    class Failing:  # the grammar hits a limit on a later mask
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        error = "structured output failed: limit reached"

    engine.step()
    tokens_before = list(request.output_token_ids)
    request.constraints = Failing(request.constraints)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    failed = finals[request.request_id].outputs[0]
    assert failed.finish_reason == "abort" and failed.stop_reason.startswith("structured output")
    assert failed.token_ids == tokens_before  # the unconstrained token was dropped
    assert finals[other.request_id].outputs[0].finish_reason in ("stop", "length")
