"""The OpenAI-compatible server on a tiny model, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import EngineOptions
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine

OPTIONS = dict(
    max_num_batched_tokens=64, max_num_seqs=8, block_size=8, num_kv_blocks=128, max_model_len=128
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = LLMEngine(EngineOptions(model=str(tiny_model_dir), **OPTIONS))
    app = build_app(AsyncEngine(engine), ServerConfig(served_model_name="tiny"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), **OPTIONS)


PROMPT = "The quick brown fox"


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/version").json()["version"]


def test_completion_matches_offline_greedy(client, offline):
    response = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    expected = offline.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    choice = response.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streams_equal_their_non_streamed_answers(client):
    common = dict(model="tiny", max_tokens=16, temperature=0.8, seed=3, n=2, stop=["e t", "zz"])
    whole = client.completions.create(prompt=PROMPT, **common)
    texts = {0: "", 1: ""}
    finish = {}
    usage = None
    for chunk in client.completions.create(
        prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **common
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert finish[choice.index] == choice.finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens

    messages = [{"role": "user", "content": "Tell me about the lazy dog."}]
    chat = dict(model="tiny", messages=messages, max_tokens=20, temperature=0)
    reply = client.chat.completions.create(**chat)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(stream=True, **chat)
        if chunk.choices
    )
    assert streamed == reply.choices[0].message.content
    assert reply.choices[0].message.role == "assistant"


def test_logprobs_and_json_response_format(client):
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(c.top_logprobs) >= 3 and c.logprob <= 0 for c in content)
    structured = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=60,
        temperature=0.7,
        seed=1,
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "answer",
                "schema": {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}},
                    "required": ["ok"],
                    "additionalProperties": False,
                },
            },
        },
    )
    choice = structured.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content)["ok"], bool)


def test_bad_requests_get_clear_errors_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        client.completions.create(model="tiny", prompt=PROMPT, extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny", prompt="fox " * 300, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="tiny", prompt=PROMPT, best_of=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3).choices


def test_concurrent_streams_share_the_engine(server):
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused")

    async def one(i):
        text = ""
        stream = await client.completions.create(
            model="tiny",
            prompt=f"{PROMPT} {i}",
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    async def run_all():
        return await asyncio.gather(*(one(i) for i in range(12)))

    texts = asyncio.run(run_all())
    assert len(texts) == 12 and all(texts)
