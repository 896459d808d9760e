"""LoRA adapters over the server, with the official openai client: the request's `model`
chooses the adapter (completions, chat, streams), /v1/models lists them, adapters loaded and
unloaded at run time behind the API key, and the errors of each."""

from __future__ import annotations

import httpx
import openai
import pytest

from jaxinfer import LoRARequest, SamplingParams
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve
from tests.support.engines import build_engine, build_llm
from tests.support.lora import make_adapter

pytestmark = pytest.mark.engine

KEY = "sk-lora-test"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("server_adapters")
    return {
        "sql": make_adapter(tiny_model_dir, root / "sql", rank=8, seed=11),
        "poet": make_adapter(tiny_model_dir, root / "poet", rank=16, targets=["q_proj"], seed=12),
    }


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters):
    engine = AsyncEngine(build_engine(tiny_model_dir, "served", enable_lora=True, max_loras=2))
    config = ServerConfig(
        "tiny",
        api_key=KEY,
        lora_modules=(("sql", str(adapters["sql"])),),
        enable_lora_runtime_updates=True,
    )
    url, uvicorn_server = serve(build_app(engine, config))
    yield url
    uvicorn_server.should_exit = True


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model_dir, adapters):
    """The same adapters through LLM.generate (the tokens the server must give)."""
    llm = build_llm(tiny_model_dir, "served", enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def text(name):
        lora = (
            None
            if name is None
            else LoRARequest(name, 1 + list(adapters).index(name), str(adapters[name]))
        )
        return llm.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text

    return text


def _complete(client, model, **extra):
    response = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
        **extra,
    )
    return response.choices[0].text


def test_the_model_field_chooses_the_adapter(client, offline):
    assert _complete(client, "sql") == offline("sql")
    assert _complete(client, "tiny") == offline(None)
    assert offline("sql") != offline(None)
    stream = client.completions.create(
        model="sql",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == offline("sql")
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.NotFoundError):
        _complete(client, "nope")


def test_adapters_loaded_and_unloaded_at_run_time(server, client, adapters, offline):
    assert [m.id for m in client.models.list().data] == ["tiny", "sql"]
    headers = {"Authorization": f"Bearer {KEY}"}
    load = {"lora_name": "poet", "lora_path": str(adapters["poet"])}
    assert httpx.post(f"{server}/v1/load_lora_adapter", json=load).status_code == 401
    response = httpx.post(f"{server}/v1/load_lora_adapter", json=load, headers=headers)
    assert response.status_code == 200, response.text
    assert [m.id for m in client.models.list().data] == ["tiny", "poet", "sql"]
    assert _complete(client, "poet") == offline("poet")
    again = httpx.post(f"{server}/v1/load_lora_adapter", json=load, headers=headers)
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
    missing = {"lora_name": "gone", "lora_path": "/nonexistent"}
    response = httpx.post(f"{server}/v1/load_lora_adapter", json=missing, headers=headers)
    assert response.status_code == 400 and "adapter_config.json" in response.text
    unload = {"lora_name": "poet"}
    response = httpx.post(f"{server}/v1/unload_lora_adapter", json=unload, headers=headers)
    assert response.status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "poet")
    response = httpx.post(f"{server}/v1/unload_lora_adapter", json=unload, headers=headers)
    assert response.status_code == 404
    # loaded again under the same name: served again, with its own weights
    response = httpx.post(f"{server}/v1/load_lora_adapter", json=load, headers=headers)
    assert response.status_code == 200 and _complete(client, "poet") == offline("poet")


def test_runtime_updates_are_off_unless_asked(tiny_model_dir, adapters):
    engine = AsyncEngine(build_engine(tiny_model_dir, "served", enable_lora=True))
    url, uvicorn_server = serve(build_app(engine, ServerConfig("tiny")))
    try:
        load = {"lora_name": "poet", "lora_path": str(adapters["poet"])}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 404
    finally:
        uvicorn_server.should_exit = True
