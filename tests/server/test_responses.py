"""OpenAI's Responses API (/v1/responses) with the official openai client's responses.create
and responses.stream, against the same requests through chat completions: text, JSON
schemas, reasoning items, function calls and their outputs, previous_response_id and the
bounded store. The server is the tiny model with <think> tokens behind the qwen3 parser."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve
from tests.support.engines import PRESETS, build_engine
from tests.support.models import make_thinking_model

pytestmark = pytest.mark.engine

OFF = {"effort": "none"}  # thinking turned off through the template
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"const": "hello world"}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = make_thinking_model(tmp_path_factory.mktemp("responses"))
    options = {**PRESETS["served"], "reasoning_parser": "qwen3", "max_model_len": 1024}
    options["num_kv_blocks"] = 256
    engine = AsyncEngine(build_engine(folder, None, **options))
    app = build_app(engine, ServerConfig("tiny"))
    url, server = serve(app)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    server.should_exit = True


def test_text_and_json_schema(client):
    response = client.responses.create(
        model="tiny",
        instructions="Answer briefly.",
        input="Why is the sky blue?",
        max_output_tokens=8,
        temperature=0,
        reasoning=OFF,
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 8
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    shaped = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
        max_output_tokens=40,
        reasoning=OFF,
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
    )
    assert shaped.status == "completed"
    assert json.loads(shaped.output_text) == {"answer": "hello world"}


def test_a_stream_gives_the_same_response(client):
    kwargs = dict(
        model="tiny",
        input="Say hello.",
        max_output_tokens=40,
        reasoning=OFF,
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
    )
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert events[:2] == ["response.created", "response.in_progress"]
    assert events[-1] == "response.completed"
    assert "response.output_text.delta" in events
    assert events.index("response.output_item.added") < events.index("response.output_text.delta")
    raw = client.responses.create(stream=True, **kwargs)
    numbers = [event.sequence_number for event in raw]
    assert numbers == list(range(len(numbers)))


def test_reasoning_comes_as_a_reasoning_item(client):
    """The template opens a <think> block the random model never closes: all reasoning."""
    kwargs = dict(model="tiny", input="Why?", max_output_tokens=12, temperature=0)
    response = client.responses.create(reasoning={"effort": "high"}, **kwargs)
    (item,) = response.output
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text"
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Why?"}], max_tokens=12, temperature=0
    )
    assert item.content[0].text == chat.choices[0].message.reasoning_content
    assert response.usage.output_tokens_details.reasoning_tokens == 12
    events = list(client.responses.create(stream=True, reasoning={"effort": "high"}, **kwargs))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == item.content[0].text
    assert events[-1].type == "response.incomplete"


def test_function_calls_and_previous_response_id(client):
    """The model is random: a seed under which its required call finishes."""
    first = client.responses.create(
        model="tiny",
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        reasoning=OFF,
        extra_body={"seed": 0},
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}],
        tools=[WEATHER],
        max_output_tokens=4,
        reasoning=OFF,
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + len(call.arguments) // 2
    named = {"type": "function", "name": "get_weather"}
    with client.responses.stream(
        model="tiny", input="Weather in Oslo?", tools=[WEATHER], tool_choice=named,
        max_output_tokens=200, reasoning=OFF, extra_body={"seed": 0},
    ) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (streamed,) = final.output
    assert streamed.type == "function_call" and "".join(deltas) == streamed.arguments
    jsonschema.validate(json.loads(streamed.arguments), WEATHER["parameters"])
    assert client.responses.retrieve(first.id).id == first.id


def test_store_false_and_unknown_ids_are_404s(client):
    kept = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, reasoning=OFF)
    unkept = client.responses.create(
        model="tiny", input="Hi", max_output_tokens=2, reasoning=OFF, store=False
    )
    assert client.responses.retrieve(kept.id).id == kept.id
    for missing in (unkept.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError, match="not found"):
            client.responses.create(
                model="tiny", input="Hi", max_output_tokens=2, previous_response_id=missing
            )
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.responses.create(
            model="tiny", input=[{"type": "web_search_call", "id": "x"}], max_output_tokens=2
        )


def test_the_store_evicts_the_oldest():
    from jaxinfer.server.errors import APIError
    from jaxinfer.server.responses import ResponseStore, Stored

    store = ResponseStore(max_entries=2)
    for name in ("a", "b", "c"):
        store.put(name, Stored({"id": name}, []))
    assert store.get("c").body == {"id": "c"} and store.get("b").body == {"id": "b"}
    with pytest.raises(APIError, match="evicted"):
        store.get("a")
