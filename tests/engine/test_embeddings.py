"""Embeddings (PoolingParams, LLM.embed, /v1/embeddings) against HF transformers' own hidden
states of the same weights (AutoModel's last_hidden_state, final norm included, pooled as
sentence-transformers pools): last, mean and CLS pooling, normalized, over chunked prefill,
beside generation in the same steps, through the prefix cache, with `dimensions`; the server
with the official openai client; the default model with mean pooling."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import openai
import pytest
import torch
import transformers

from jaxinfer import PoolingParams, SamplingParams
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve
from tests.support.engines import build_engine, build_llm

pytestmark = pytest.mark.engine

PROMPTS = [
    [5, 7, 9, 11, 13, *range(40, 70)],  # 35 tokens: three 16-token chunks
    [3, 4, 5],
    [100],
    [*range(200, 219)],
]


def hf_embedding(model, prompt: list[int], pooling: str, dimensions: int | None = None):
    with torch.no_grad():
        states = model(torch.tensor([prompt])).last_hidden_state[0].double().numpy()
    vector = {"mean": states.mean(0), "last": states[-1], "cls": states[0]}[pooling]
    vector = vector[:dimensions]
    return vector / np.linalg.norm(vector)


def assert_close(got, expected):
    cosine = float(np.dot(got, expected) / np.linalg.norm(got) / np.linalg.norm(expected))
    assert 1 - cosine < 1e-5 and np.abs(got - expected).max() < 1e-5, (cosine, got[:4])


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return transformers.AutoModel.from_pretrained(tiny_model_dir).eval()


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_each_pooling_equals_hf(make_llm, hf_model, pooling):
    llm = make_llm("tiny")
    outputs = llm.embed(PROMPTS, PoolingParams(pooling), use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.embedding.dtype == np.float32 and output.embedding.shape == (64,)
        assert_close(output.embedding, hf_embedding(hf_model, prompt, pooling))
    # dimensions: the first values, normalized after
    (short,) = llm.embed(PROMPTS[:1], PoolingParams(pooling, dimensions=16), use_tqdm=False)
    assert_close(short.embedding, hf_embedding(hf_model, PROMPTS[0], pooling, 16))


def embed(engine, prompt, pooling: str) -> str:
    """Admits an embedding request on the engine; its id."""
    params = PoolingParams(pooling)
    prepared = engine.prepare_request(prompt, params.sampling_params())
    return engine.add_prepared(dataclasses.replace(prepared, pooling=params)).request_id


def test_beside_generation_and_through_the_prefix_cache(tiny_model_dir, hf_model):
    """Embedding requests share steps with generating ones; a mean-pooled prompt whose prefix
    is cached is computed again (every state is pooled), a last-pooled one may take the hits."""
    engine = build_engine(tiny_model_dir, "tiny", num_kv_blocks=128)
    generating = [engine.add_request([9, 8, 7, 6, 5], SamplingParams(max_tokens=12, temperature=0))]
    ids = {}
    for pooling in ("mean", "last"):
        for index, prompt in enumerate(PROMPTS[:2]):
            ids[embed(engine, prompt, pooling)] = (pooling, index)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.request_id in ids:
                results[ids[output.request_id]] = output.embedding
    assert len(generating[0].output_token_ids) == 12
    for (pooling, index), vector in results.items():
        assert_close(vector, hf_embedding(hf_model, PROMPTS[index], pooling))
    hits = engine.stats().prefix_cache_hits
    request_id = embed(engine, PROMPTS[0], "mean")
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                assert_close(output.embedding, hf_embedding(hf_model, PROMPTS[0], "mean"))
    assert engine.stats().prefix_cache_hits == hits  # mean pooling took no cached block


def test_the_embeddings_endpoint(tiny_model_dir, hf_model):
    engine = AsyncEngine(build_engine(tiny_model_dir, "served", pooling_type="mean"))
    url, server = serve(build_app(engine, ServerConfig("tiny")))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        response = client.embeddings.create(model="tiny", input=PROMPTS)  # (base64 on the wire)
        assert [d.index for d in response.data] == list(range(len(PROMPTS)))
        for prompt, item in zip(PROMPTS, response.data, strict=True):
            assert_close(np.asarray(item.embedding), hf_embedding(hf_model, prompt, "mean"))
        assert response.usage.prompt_tokens == sum(map(len, PROMPTS))
        floats = client.embeddings.create(
            model="tiny", input="The quick brown fox", encoding_format="float", dimensions=8
        )
        assert len(floats.data[0].embedding) == 8
        assert abs(np.linalg.norm(floats.data[0].embedding) - 1) < 1e-6
        for bad, message in [
            ({"input": []}, "must not be empty"),
            ({"input": "x", "dimensions": 65}, "exceeds"),
            ({"input": [[]]}, "must not be empty"),
            ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ]:
            with pytest.raises(openai.BadRequestError, match=message):
                client.embeddings.create(model="tiny", **bad)
    finally:
        server.should_exit = True


def test_the_pooling_type_comes_from_a_sentence_transformers_folder(tmp_path):
    from jaxinfer.config.engine_config import pooling_type

    assert pooling_type("auto", tmp_path) == "last"
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [{"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        )
    )
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True})
    )
    assert pooling_type("auto", tmp_path) == "mean" and pooling_type("cls", tmp_path) == "cls"


@pytest.mark.default_model
def test_default_model_mean_pooling_equals_hf(model_cache_dir):
    llm = build_llm(None, "default", pooling_type="mean")
    folder = llm.engine.config.model.path
    model = transformers.AutoModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    texts = ["Why is the sky blue?", "Embeddings map text to vectors of numbers that ..." * 3]
    outputs = llm.embed(texts, use_tqdm=False)
    assert len(outputs) == len(texts)
    for output in outputs:
        assert_close(output.embedding, hf_embedding(model, list(output.prompt_token_ids), "mean"))


def test_an_embedding_only_server_refuses_generation(tiny_model_dir):
    engine = AsyncEngine(build_engine(tiny_model_dir, "served", runner="pooling"))
    url, server = serve(build_app(engine, ServerConfig("tiny")))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert len(client.embeddings.create(model="tiny", input="a fox").data) == 1
        with pytest.raises(openai.BadRequestError, match="embeddings only"):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        with pytest.raises(openai.BadRequestError, match="embeddings only"):
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    finally:
        server.should_exit = True
