"""Reasoning output through the server (EngineOptions.reasoning_parser), with the openai client,
on a tiny model whose tokenizer has `<think>` and `</think>` tokens and whose template opens the
block unless `enable_thinking` is false (as Qwen3's thinking templates do). The model is
random: a logit bias on `</think>` makes it close the block a few tokens in, and the same
request through /v1/completions (the raw text) is what the split must agree with."""

from __future__ import annotations

import openai
import pytest

from jaxinfer.reasoning import ReasoningParser
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve
from tests.support.engines import PRESETS, build_engine
from tests.support.models import THINK_END_ID, make_thinking_model

pytestmark = pytest.mark.engine

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
PROMPT = "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n<think>\n"
END_ID = THINK_END_ID


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_thinking_model(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def client(folder):
    options = {**PRESETS["served"], "max_model_len": 256, "reasoning_parser": "qwen3"}
    engine = AsyncEngine(build_engine(folder, None, **options))
    url, server = serve(build_app(engine, ServerConfig(served_model_name="tiny")))
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    server.should_exit = True


@pytest.fixture(scope="module")
def bias(client) -> dict:
    """A logit bias on </think> under which the greedy output closes the block after at
    least two tokens of reasoning (the smallest of a few that does)."""
    for value in (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20):
        bias = {str(END_ID): value}
        tokens = raw(client, bias, logprobs=1).logprobs.tokens
        if "</think>" in tokens[2:10]:
            return bias
    pytest.fail("no bias closes the block a few tokens in")


def raw(client, bias, **extra):
    """The same request's raw output through /v1/completions."""
    return client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, logit_bias=bias, **extra
    ).choices[0]


def chat(client, bias, max_tokens=16, **extra):
    return client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=max_tokens,
        temperature=0,
        logit_bias=bias,
        **extra,
    )


def test_reasoning_and_content_split_as_the_raw_text(client, bias):
    text = raw(client, bias).text
    reasoning, content = ReasoningParser("qwen3").split(PROMPT, text)
    assert reasoning and content is not None and "</think>" not in reasoning
    answer = chat(client, bias)
    message = answer.choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, content)
    tokens = raw(client, bias, logprobs=1).logprobs.tokens
    details = answer.usage.completion_tokens_details
    assert details.reasoning_tokens == tokens.index("</think>") + 1
    # streamed: the same parts, reasoning deltas first, the same count
    stream = chat(client, bias, stream=True, stream_options={"include_usage": True})
    thought, said, order, usage = "", "", [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            if delta.get("reasoning_content"):
                thought += delta["reasoning_content"]
                order.append("r")
            if delta.get("content"):
                said += delta["content"]
                order.append("c")
    assert (thought, said) == (reasoning, content)
    assert order == sorted(order, reverse=True)  # every reasoning delta before any content
    assert usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


def test_a_block_that_never_closes_is_all_reasoning(client):
    answer = chat(client, {str(END_ID): -100}, max_tokens=6)
    message = answer.choices[0].message
    assert message.content is None and message.reasoning_content
    assert answer.usage.completion_tokens_details.reasoning_tokens == 6


def test_thinking_turned_off_through_the_template_kwargs(client, bias):
    answer = chat(client, bias, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = answer.choices[0].message
    assert message.reasoning_content is None and message.content
    assert answer.usage.completion_tokens_details.reasoning_tokens == 0
    with pytest.raises(openai.BadRequestError, match="may not set"):
        chat(client, bias, extra_body={"chat_template_kwargs": {"messages": []}})


def test_structured_output_applies_after_the_reasoning(client, bias):
    """The grammar waits for </think>: the reasoning is the model's own, the content obeys."""
    text = raw(client, bias).text
    reasoning, _ = ReasoningParser("qwen3").split(PROMPT, text)
    extra = {"structured_outputs": {"choice": ["sunlight scatters", "no idea"]}}
    message = chat(client, bias, max_tokens=40, extra_body=extra).choices[0].message
    assert message.reasoning_content == reasoning
    assert message.content in ("sunlight scatters", "no idea")
