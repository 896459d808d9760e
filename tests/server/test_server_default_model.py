"""The server on the default model, through the official openai client."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def server(default_llm):
    engine = AsyncEngine(default_llm.engine)
    url, server = serve(build_app(engine, ServerConfig(served_model_name="smol")))
    yield url
    server.should_exit = True


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_chat_streamed_and_not_n2_logprobs_stop_seed(client):
    common = dict(model="smol", messages=ask("Name three colors."), max_tokens=24)
    reply = client.chat.completions.create(temperature=0, **common)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(temperature=0, stream=True, **common)
        if c.choices
    )
    assert streamed == reply.choices[0].message.content and streamed

    seeded = dict(temperature=0.9, seed=123, n=2, logprobs=True, top_logprobs=2, **common)
    first = client.chat.completions.create(**seeded)
    second = client.chat.completions.create(**seeded)
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert len(first.choices) == 2
    assert all(tok.top_logprobs for c in first.choices for tok in c.logprobs.content)

    text = reply.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = client.chat.completions.create(temperature=0, stop=[stop], **common)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]

    completion = client.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text


def test_json_schema_response_validates(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "year": {"type": "integer"}},
        "required": ["city", "year"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model="smol",
        messages=ask("Name a city and the year it was founded, as JSON."),
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_32_concurrent_streams_keep_their_own_tokens(server, client):
    questions = [f"Count from {i} to {i + 5}, separated by commas." for i in range(32)]
    params = dict(model="smol", max_tokens=20, temperature=0)
    expected = [
        client.chat.completions.create(messages=ask(q), **params).choices[0].message.content
        for q in questions[:8]
    ]
    aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused")

    async def stream(question):
        text = ""
        async for chunk in await aclient.chat.completions.create(
            messages=ask(question), stream=True, **params
        ):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text

    async def everything():
        return await asyncio.gather(*(stream(q) for q in questions))

    texts = asyncio.run(everything())
    assert len(texts) == 32 and all(texts)
    # Greedy: alone or among 31 others, each stream gets exactly its own answer.
    assert texts[:8] == expected
