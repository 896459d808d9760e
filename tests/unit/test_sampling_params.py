"""SamplingParams: vLLM/OpenAI ranges, clear errors, nothing unknown accepted."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer import SamplingParams
from jaxinfer.sampling_params import StructuredOutputsParams


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=1e-50), "temperature"),
        (dict(temperature=101), "temperature"),
        (dict(repetition_penalty=1e-50), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(min_p=float("-inf")), "min_p"),
        (dict(presence_penalty=float("inf")), "presence_penalty"),
        (dict(logit_bias={5: float("inf")}), "logit_bias"),
        (dict(stop=["x"] * 65), "stop takes at most 64"),
        (dict(stop=["x" * 513]), "stop strings must be at most 512"),
        (dict(bad_words=[f"w{i}" for i in range(1025)]), "bad_words takes at most 1024"),
        (dict(bad_words=["w" * 257]), "bad_words strings"),
        (dict(output_kind="delta"), "output_kind"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(seed=-3), "seed"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(n=0), "n must"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.2), "min_p"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(logit_bias={5: 101}), "logit_bias"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(min_tokens=5, max_tokens=3), "min_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(best_of=2), "best_of"),
        (dict(structured_outputs=dict(regex="a+", choice=["a"])), "exactly one"),
        (dict(structured_outputs=dict()), "exactly one"),
        (dict(structured_outputs=dict(json="{not json")), "not valid JSON"),
        (dict(structured_outputs=dict(choice=[])), "choice"),
    ],
)
def test_out_of_range_values_are_clear_errors(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_unknown_parameter_is_an_error():
    with pytest.raises(TypeError):
        SamplingParams(typical_p=0.5)  # not a parameter: refused, never ignored


def test_normalization():
    params = SamplingParams(
        stop="###",
        logit_bias={"7": 3},
        structured_outputs={"choice": ["yes", "no"]},
        top_k=-1,
    )
    assert params.stop == ("###",)
    assert params.logit_bias == {7: 3.0}
    assert params.structured_outputs == StructuredOutputsParams(choice=("yes", "no"))
    assert params.top_k_or_all(100) == 0
    assert SamplingParams(top_k=2**40).top_k_or_all(100) == 0  # beyond the vocabulary: all
    assert SamplingParams(top_k=99).top_k_or_all(100) == 99
    assert not params.uses_penalties and SamplingParams(presence_penalty=0.1).uses_penalties


def test_for_sample_is_the_validated_parameters_of_one_sample():
    params = SamplingParams(n=3, seed=2**64 - 2, prompt_logprobs=2, allowed_token_ids=[1, 2])
    for index in range(3):
        expected = dataclasses.replace(
            params,
            n=1,
            seed=(params.seed + index) % 2**64,
            prompt_logprobs=2 if index == 0 else None,
        )
        assert params.for_sample(index) == expected
    assert SamplingParams(n=2).for_sample(1).seed is None
