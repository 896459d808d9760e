"""The sampler against numpy: each logits processor on fixed logits, the draws' distributions
(chi-square), and the bitmask rows of bad words and min_tokens."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxinfer import SamplingParams
from jaxinfer.engine.execution.batch import SamplingMetadata
from jaxinfer.engine.sampling import logits_processors
from jaxinfer.engine.sampling.constraints import (
    BadWords,
    RequestConstraints,
    bias_row,
    bitmask_width,
    clear_bits,
    stop_mask,
)
from jaxinfer.engine.sampling.logits_processors import unpack_bitmask
from jaxinfer.engine.sampling.sampler import SamplerState, sample, token_logprobs

RNG = np.random.default_rng(0)

# The processors jitted, as the sampler runs them (op by op, each of their conds and loops
# would compile on its own).
apply_min_p, apply_penalties, apply_top_k_top_p, first_argmax = (
    jax.jit(getattr(logits_processors, name))
    for name in ("apply_min_p", "apply_penalties", "apply_top_k_top_p", "first_argmax")
)


def numpy_penalties(logits, counts, prompt_mask, rep, pres, freq):
    out = logits.copy()
    for r in range(len(out)):
        seen = prompt_mask[r] | (counts[r] > 0)
        for v in np.nonzero(seen)[0]:
            out[r, v] = out[r, v] / rep[r] if out[r, v] > 0 else out[r, v] * rep[r]
        out[r] -= freq[r] * counts[r]
        out[r] -= pres[r] * (counts[r] > 0)
    return out


def numpy_top_k_top_p(logits, top_k, top_p):
    out = logits.copy()
    for r, row in enumerate(out):
        order = np.argsort(-row, kind="stable")
        if 0 < top_k[r] < len(row):
            kth = row[order[top_k[r] - 1]]
            row[row < kth] = -np.inf
        if top_p[r] < 1:
            probs = np.exp(row - row.max())
            probs /= probs.sum()
            order = np.argsort(-row, kind="stable")
            cumulative = np.cumsum(probs[order])
            last = np.argmax(cumulative >= top_p[r])
            row[row < row[order[last]]] = -np.inf
    return out


def numpy_min_p(logits, min_p):
    out = logits.copy()
    probs = np.exp(out - out.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for r in range(len(out)):
        if min_p[r] > 0:
            out[r, probs[r] < min_p[r] * probs[r].max()] = -np.inf
    return out


@pytest.mark.parametrize("vocab", [100, 300, 49152, 49155])
def test_first_argmax_is_numpys_argmax(vocab):
    """The chunked argmax (whole chunks, then a tail) picks numpy's index: the first maximum,
    across chunks, inside one, in the tail, and in rows that are all -inf."""
    rows = 6
    for trial in range(6):
        x = RNG.normal(size=(rows, vocab)).astype(np.float32)
        if trial % 2:
            x = np.round(x)  # many ties, in many chunks
        x[1, [7, vocab // 2, vocab - 1]] = 9.0  # a tie between chunks and the tail
        x[2, vocab - 1] = 9.0  # the maximum alone in the last values
        x[3, 130:132] = 9.0  # a tie inside one chunk
        x[4] = -np.inf
        np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x))), x.argmax(-1))


def test_penalties_match_numpy():
    rows, vocab = 5, 50
    logits = RNG.normal(size=(rows, vocab)).astype(np.float32) * 3
    counts = RNG.integers(0, 3, size=(rows, vocab)) * (RNG.random((rows, vocab)) < 0.2)
    prompt_mask = RNG.random((rows, vocab)) < 0.1
    rep = np.array([1.0, 1.3, 0.7, 1.0, 2.0], np.float32)
    pres = np.array([0.0, 0.5, -0.3, 1.5, 0.0], np.float32)
    freq = np.array([0.0, 0.2, 0.0, -1.0, 2.0], np.float32)
    got = apply_penalties(*map(jnp.asarray, (logits, counts, prompt_mask, rep, pres, freq)))
    want = numpy_penalties(logits, counts, prompt_mask, rep, pres, freq)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got)[0], logits[0])  # neutral row untouched


@pytest.mark.parametrize("vocab", [50, 1000])  # 1000 > 256 candidates: the exact fallback
def test_top_k_top_p_match_numpy(vocab):
    rows = 8
    logits = (RNG.normal(size=(rows, vocab)) * np.linspace(0.05, 4, rows)[:, None]).astype(
        np.float32
    )
    top_k = np.array([0, 1, 5, 40, 0, 700, 3, 0], np.int32) % vocab
    top_p = np.array([1.0, 1.0, 1.0, 0.9, 0.5, 0.95, 0.3, 0.999], np.float32)
    got = np.asarray(apply_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    want = numpy_top_k_top_p(logits, top_k, top_p)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_array_equal(got[~np.isinf(got)], want[~np.isinf(want)])
    assert np.array_equal(got[0], logits[0])  # neutral row untouched
    assert (~np.isinf(got[1])).sum() == 1  # top_k 1 keeps the argmax only


def test_min_p_matches_numpy():
    logits = RNG.normal(size=(4, 60)).astype(np.float32) * 2
    min_p = np.array([0.0, 0.05, 0.3, 1.0], np.float32)
    got = np.asarray(apply_min_p(jnp.asarray(logits), jnp.asarray(min_p)))
    want = numpy_min_p(logits, min_p)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))


def test_bitmask_unpack_and_clear_bits():
    vocab = 70
    row = np.full(bitmask_width(vocab), -1, np.int32)
    clear_bits(row, [0, 5, 31, 32, 63, 69])
    allowed = np.asarray(unpack_bitmask(jnp.asarray(row[None]), vocab))[0]
    assert allowed.shape == (vocab,)
    assert sorted(np.nonzero(~allowed)[0].tolist()) == [0, 5, 31, 32, 63, 69]


def test_bias_row_logit_bias_allowed_and_banned():
    params = SamplingParams(logit_bias={3: 5.0, 4: -2.0}, allowed_token_ids=[3, 4, 9])
    row = bias_row(params, 12, banned_ids=[9])
    expected = np.full(12, -np.inf, np.float32)
    expected[3], expected[4] = 5.0, -2.0
    np.testing.assert_array_equal(row, expected)
    assert bias_row(SamplingParams(), 12, []) is None


def test_bad_words_and_min_tokens_rows():
    vocab = 40
    constraints = RequestConstraints(
        matcher=None,
        bad_words=BadWords([[7], [4, 5, 6], [8, 5, 6], [9, 6]]),
        min_tokens=2,
        stop_mask=stop_mask([0, 2], vocab),
    )

    def allowed(outputs, position):
        mask = np.full((1, bitmask_width(vocab)), -1, np.int32)
        constraints.fill(mask, 0, outputs, position)
        return np.asarray(unpack_bitmask(jnp.asarray(mask), vocab))[0]

    early = allowed([1], 1)  # min_tokens not reached: EOS and stop tokens blocked
    assert not early[0] and not early[2] and early[6] and early[7]  # [7] is in the bias row
    after_prefix = allowed([1, 4, 5], 3)  # "4 5" seen: 6 would complete the bad word
    assert not after_prefix[6] and after_prefix[0] and after_prefix[2]
    assert allowed([4, 1], 2)[6]
    assert not allowed([3, 9], 2)[6] and allowed([3, 9], 2)[5]  # "9 6"
    assert not allowed([8, 5], 2)[6]  # two words share their last token


def metadata(rows: int, **values) -> SamplingMetadata:
    """Neutral rows, each sampling a different output position, with `values` set."""
    base = dataclasses.asdict(SamplingMetadata.neutral(rows))
    base["output_positions"] = np.arange(rows, dtype=np.int32)
    base["keeps"] = np.ones(rows, np.int32)
    for name, value in values.items():
        base[name] = np.broadcast_to(np.asarray(value, base[name].dtype), base[name].shape).copy()
    return SamplingMetadata(**base)


def empty_state(slots: int, vocab: int) -> SamplerState:
    return SamplerState(
        output_counts=jnp.zeros((slots, vocab), jnp.int32),
        prompt_mask=jnp.zeros((slots, vocab), bool),
        bias=jnp.zeros((slots, vocab), jnp.float32),
        bitmask=jnp.full((slots, bitmask_width(vocab)), -1, jnp.int32),
    )


def draws(logits_row: np.ndarray, count: int, **values) -> np.ndarray:
    """`count` samples of one distribution: one row per output position, one seed."""
    vocab = logits_row.shape[0]
    logits = jnp.asarray(np.tile(logits_row, (count, 1)))
    md = metadata(count, **values)
    out = sample(logits, md, empty_state(1, vocab), jnp.zeros(count, jnp.int32))
    return np.asarray(out.token_ids)


def chi_square_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    assert np.all(support[samples]), "a token outside the support was drawn"
    observed = np.bincount(samples, minlength=len(probs))[support]
    expected = probs[support].astype(np.float64)
    expected = expected / expected.sum() * len(samples)
    return stats.chisquare(observed, expected).pvalue


def test_temperature_draws_follow_softmax():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
    for temperature in (0.5, 1.0, 2.0):
        samples = draws(logits, 20000, temperature=temperature, seeds=[[11, 0]])
        probs = np.exp(logits / temperature)
        probs /= probs.sum()
        assert chi_square_pvalue(samples, probs) > 1e-3, temperature


def test_top_p_draws_follow_the_renormalized_nucleus():
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))
    samples = draws(logits, 20000, temperature=1.0, top_p=0.75, seeds=[[5, 0]])
    probs = np.array([0.4, 0.25, 0.15, 0, 0, 0])  # 0.4 + 0.25 < 0.75 <= 0.8
    assert chi_square_pvalue(samples, probs / probs.sum()) > 1e-3
    # A wrong distribution fails the same test: the statistic has power here.
    assert chi_square_pvalue(samples, np.array([0.5, 0.3, 0.2, 0, 0, 0])) < 1e-6


def test_greedy_takes_argmax_of_processed_logits_and_seeds_are_row_independent():
    vocab = 30
    logits = jnp.asarray(RNG.normal(size=(4, vocab)).astype(np.float32))
    state = empty_state(5, vocab)
    bias = np.zeros((5, vocab), np.float32)
    bias[2, 7] = 100.0
    state = SamplerState(state.output_counts, state.prompt_mask, jnp.asarray(bias), state.bitmask)
    md = metadata(4, has_bias=[0, 0, 1, 0])
    out = sample(logits, md, state, jnp.asarray([0, 1, 2, 3]))
    expected = np.argmax(np.asarray(logits), axis=-1)
    expected[2] = 7
    np.testing.assert_array_equal(np.asarray(out.token_ids), expected)

    # A seeded random row draws the same token whatever the other rows are.
    alone = sample(
        logits[:1],
        metadata(1, temperature=0.9, seeds=[[42, 0]], output_positions=[3]),
        state,
        jnp.asarray([0]),
    )
    mixed = sample(
        logits[jnp.asarray([0, 0, 0, 0])],
        metadata(
            4,
            temperature=[0.0, 0.9, 1.5, 0.9],
            seeds=[[1, 0], [42, 0], [2, 0], [7, 0]],
            output_positions=[0, 3, 9, 3],
            top_k=[0, 0, 5, 0],
        ),
        state,
        jnp.asarray([0, 1, 2, 3]),
    )
    assert int(alone.token_ids[0]) == int(mixed.token_ids[1])


@pytest.mark.parametrize(
    ("temperature", "repetition_penalty"),
    [(1e-6, 1.0), (100.0, 1.0), (1.0, 0.01), (1e-6, 0.01), (1e-6, 100.0), (0.0, 0.01)],
)
def test_the_extremes_of_the_ranges_keep_every_mask(temperature, repetition_penalty):
    """At the edges of what SamplingParams accepts, masked tokens stay impossible (a
    temperature of 1e-50 turned the -inf masks into NaN, and NaN into any token)."""
    vocab, rows = 64, 16
    logits = RNG.normal(scale=30.0, size=(rows, vocab)).astype(np.float32)
    allowed = np.zeros(vocab, bool)
    allowed[[3, 17, 40]] = True
    bias = np.where(allowed, 0.0, -np.inf).astype(np.float32)
    bitmask = np.full((rows, bitmask_width(vocab)), -1, np.int32)
    clear_bits(bitmask[0], [17])  # this step's grammar row forbids one of them too
    state = SamplerState(
        output_counts=jnp.asarray(np.tile((np.arange(vocab) % 2).astype(np.int32), (rows, 1))),
        prompt_mask=jnp.ones((rows, vocab), bool),
        bias=jnp.asarray(np.tile(bias, (rows, 1))),
        bitmask=jnp.asarray(np.tile(bitmask[0], (rows, 1))),
    )
    md = metadata(
        rows,
        temperature=temperature,
        repetition_penalty=repetition_penalty,
        has_bias=1,
        constrained=1,
        top_p=0.9,
        min_p=0.05,
        seeds=np.stack([np.arange(rows), np.zeros(rows)], axis=1),
    )
    out = sample(jnp.asarray(logits), md, state, jnp.arange(rows, dtype=jnp.int32))
    tokens = np.asarray(out.token_ids)
    assert set(tokens.tolist()) <= {3, 40}, tokens
    sampled_logprobs, _, _ = token_logprobs(jnp.asarray(logits), out.token_ids, 2)
    assert np.all(np.isfinite(np.asarray(sampled_logprobs)))


def test_a_grammar_waits_for_the_end_of_the_reasoning(tmp_path):
    """With reasoning_end set the grammar neither masks nor consumes until that token is
    accepted (a proposal of it in a step's drafts constrains the rows after it, and is undone
    with the drafts); then it masks as usual."""
    import types

    from tokenizers import Tokenizer

    from jaxinfer.engine.sampling.constraints import GrammarCompiler, step_bitmask
    from jaxinfer.sampling_params import StructuredOutputsParams
    from tools.tiny_tokenizer import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path, 320)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    end, a, z = 321, tokenizer.token_to_id("a"), tokenizer.token_to_id("z")
    compiler = GrammarCompiler(tmp_path / "tokenizer.json", 322, [2])
    matcher = compiler.template(StructuredOutputsParams(choice=["ab"])).deep_copy()
    constraints = RequestConstraints(matcher, None, 0, None, reasoning_end=end)
    request = types.SimpleNamespace(
        constraints=constraints, num_output_placeholders=0, output_token_ids=[z]
    )

    def allows(row, token):
        return bool((int(row.view(np.uint32)[token >> 5]) >> (token & 31)) & 1)

    rows = step_bitmask(request, 1, (z, end, a), 322)
    assert (rows[0] == -1).all() and (rows[1] == -1).all()  # still reasoning: free
    assert allows(rows[2], a) and not allows(rows[2], z)  # after the end tag: the grammar's
    assert constraints.reasoning_end == end  # the drafts were not accepted
    constraints.accept(z)
    assert constraints.reasoning_end == end and not matcher.is_stopped()
    constraints.accept(end)
    assert constraints.reasoning_end is None
    (row,) = step_bitmask(request, 3, (), 322)
    assert allows(row, a) and not allows(row, z) and not allows(row, end)
