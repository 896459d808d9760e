"""Anthropic's Messages API (/v1/messages) with the official anthropic client, against the same
requests through the chat completions endpoint: text, streams and their events, stop
sequences, thinking, a tool round trip, x-api-key, errors in Anthropic's shape. The server is
the tiny model with <think> tokens behind the qwen3 reasoning parser (its template opens a
block unless thinking is disabled)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from jaxinfer.server.anthropic_protocol import MessagesRequest
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve
from tests.support.engines import PRESETS, build_engine
from tests.support.models import make_thinking_model

pytestmark = pytest.mark.engine

KEY = "sk-anthropic-test"
OFF = {"type": "disabled"}
GREEDY = {"temperature": 0}  # (the client no longer takes sampling parameters by name)
SYSTEM = "Answer briefly."
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_thinking_model(tmp_path_factory.mktemp("anthropic"))
    options = {**PRESETS["served"], "reasoning_parser": "qwen3"}
    options.update(max_model_len=1200, num_kv_blocks=320)  # (thinking: max_tokens > 1024)
    engine = AsyncEngine(build_engine(folder, None, **options))
    url, uvicorn_server = serve(build_app(engine, ServerConfig("tiny", api_key=KEY)))
    yield url
    uvicorn_server.should_exit = True


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0).chat.completions


def same_chat(chat, thinking: bool, **extra):
    """The chat completions answer to the same request (greedy)."""
    return chat.create(
        model="tiny",
        messages=[{"role": "system", "content": SYSTEM}, *ASK],
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
        **extra,
    ).choices[0]


def test_a_message_is_the_chat_answer_as_content_blocks(client, chat):
    message = client.messages.create(
        model="tiny", system=SYSTEM, messages=ASK, max_tokens=8, thinking=OFF, extra_body=GREEDY
    )
    expected = same_chat(chat, False, max_tokens=8)
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == expected.message.content
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 8 and message.usage.input_tokens > 10
    # a JSON schema (output_config) shapes the text; a stop sequence in it ends it there
    schema = {"type": "object", "properties": {"answer": {"const": "hello world"}}}
    schema.update(required=["answer"], additionalProperties=False)
    kwargs = dict(model="tiny", system=SYSTEM, messages=ASK, max_tokens=24, thinking=OFF)
    kwargs["output_config"] = {"format": {"type": "json_schema", "schema": schema}}
    whole = client.messages.create(**kwargs)
    assert json.loads(whole.content[0].text) == {"answer": "hello world"}
    assert whole.stop_reason == "end_turn"
    stopped = client.messages.create(stop_sequences=["wor"], **kwargs)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "wor")
    assert stopped.content[0].text == '{"answer":"hello '


def test_a_stream_is_the_same_message_in_anthropics_events(client):
    kwargs = dict(
        model="tiny", system=SYSTEM, messages=ASK, max_tokens=8, thinking=OFF, extra_body=GREEDY
    )
    whole = client.messages.create(**kwargs)
    events = [event.type for event in client.messages.create(stream=True, **kwargs)]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events[1] == "content_block_start" and events[-3] == "content_block_stop"
    assert set(events[2:-3]) == {"content_block_delta"}
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 8)


def test_thinking_comes_as_a_thinking_block(client, chat):
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = client.messages.create(
        model="tiny", system=SYSTEM, messages=ASK, max_tokens=1100, extra_body=GREEDY,
        thinking=thinking,
    )  # fmt: skip
    expected = same_chat(chat, True, max_tokens=1100)
    assert message.content[0].type == "thinking"
    assert message.content[0].thinking == expected.message.reasoning_content
    with client.messages.stream(
        model="tiny", system=SYSTEM, messages=ASK, max_tokens=1100, extra_body=GREEDY,
        thinking=thinking,
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.content[0].thinking == message.content[0].thinking


def test_a_tool_round_trip(client):
    """The model is random: a seed under which its required call finishes in 200 tokens."""
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    kwargs = dict(model="tiny", tools=[WEATHER], max_tokens=200, thinking=OFF)
    choice = {"type": "any", "disable_parallel_tool_use": True}
    first = client.messages.create(
        messages=ask, tool_choice=choice, extra_body={"seed": 0}, **kwargs
    )
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    follow_up = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "12 C, rain"}],
        },
    ]
    second = client.messages.create(messages=follow_up, **{**kwargs, "max_tokens": 5})
    assert second.usage.input_tokens > first.usage.input_tokens + 5  # the call and its result
    assert second.content and second.stop_reason in ("max_tokens", "end_turn", "tool_use")
    named = {"type": "tool", "name": "get_weather"}
    with client.messages.stream(
        messages=ask, tool_choice=named, extra_body={"seed": 0}, **kwargs
    ) as stream:
        streamed = stream.get_final_message()
    (block,) = streamed.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert streamed.stop_reason in ("end_turn", "tool_use")
    jsonschema.validate(block.input, WEATHER["input_schema"])


def test_errors_in_anthropics_shape(server, client):
    with pytest.raises(anthropic.NotFoundError, match="not found"):
        client.messages.create(model="nope", messages=ASK, max_tokens=4)
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model="tiny", messages=ASK, max_tokens=0)
    assert error.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        image = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
        client.messages.create(
            model="tiny", messages=[{"role": "user", "content": [image]}], max_tokens=4
        )
    wrong = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="tiny", messages=ASK, max_tokens=4)
    raw = httpx.post(f"{server}/v1/messages", json={"messages": ASK}, headers={"x-api-key": KEY})
    assert raw.status_code == 400 and raw.json()["type"] == "error"
    assert raw.json()["error"]["type"] == "invalid_request_error"


def test_thinking_needs_a_reasoning_parser():
    body = MessagesRequest(
        max_tokens=2048, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    with pytest.raises(ValueError, match="reasoning_parser"):
        body.chat_request(reasoning=False)
    assert body.chat_request(reasoning=True).chat_template_kwargs == {"enable_thinking": True}
