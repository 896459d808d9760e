"""The fast lane's engine, server and batch tests: one engine of four token buckets (the
"quick" preset) on the tiny model, driven offline, through the server with the official
openai client, and through a batch file; the three must give the same greedy tokens. The
engine-marked tests cover each of these in depth."""

from __future__ import annotations

import json

import openai
import pytest

from jaxinfer import SamplingParams
from jaxinfer.batch.job import BatchJobConfig, run_job
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve
from tests.support.batch import line, read_records

PROMPTS = ["The quick brown fox", "Once upon a time, in"]


@pytest.fixture(scope="module")
def quick(make_llm):
    return make_llm("quick")


@pytest.fixture(scope="module")
def offline(quick):
    """Greedy token ids of each prompt, offline, before any server shares the engine."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in quick.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def async_engine(quick, offline):
    return AsyncEngine(quick.engine)


def test_offline_generation_is_chunked_and_complete(quick, offline):
    assert quick.engine.config.scheduler.token_buckets == (2, 6)
    assert [len(tokens) for tokens in offline] == [10, 10]
    prompt_len = len(quick.tokenizer.encode(PROMPTS[1]))
    assert prompt_len > 6  # chunked over more than one step


def test_the_server_answers_with_the_offline_tokens(async_engine, quick, offline):
    url, server = serve(build_app(async_engine, ServerConfig(served_model_name="quick")))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        for prompt, tokens in zip(PROMPTS, offline, strict=True):
            answer = client.completions.create(
                model="quick",
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert answer.choices[0].text == quick.tokenizer.decode(tokens)
            assert answer.usage.completion_tokens == 10
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model="quick", prompt="x", temperature=-1)
    finally:
        server.should_exit = True


def test_a_batch_file_gets_the_offline_tokens(async_engine, quick, offline, tmp_path):
    body = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    lines = [line(f"p{i}", "/v1/completions", {"prompt": p, **body}) for i, p in enumerate(PROMPTS)]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join([*lines, "{not json"]) + "\n")
    summary = run_job(
        BatchJobConfig(output=output, input=source, show_progress=False), async_engine, "quick"
    )
    records = {r["custom_id"]: r for r in read_records(output)}
    for i, tokens in enumerate(offline):
        text = records[f"p{i}"]["response"]["body"]["choices"][0]["text"]
        assert text == quick.tokenizer.decode(tokens)
    assert (summary.succeeded, summary.failed) == (2, 1)
    assert json.loads((tmp_path / "out.jsonl.summary.json").read_text())["succeeded"] == 2
