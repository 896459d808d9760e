"""The OpenAI-compatible server on a tiny model, driven by the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from jaxinfer import SamplingParams
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import free_port, serve
from jaxinfer.server.metrics import ServerMetrics
from tests.support.engines import PRESETS, build_engine

pytestmark = pytest.mark.engine

OPTIONS = PRESETS["served"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = build_engine(tiny_model_dir, None, **OPTIONS)
    metrics = ServerMetrics(engine)
    return AsyncEngine(engine, metrics.observe_finished), metrics


@pytest.fixture(scope="module")
def server(engine):
    async_engine, metrics = engine
    url, server = serve(build_app(async_engine, ServerConfig(served_model_name="tiny"), metrics))
    yield url
    server.should_exit = True


@pytest.fixture(scope="module")
def guarded(engine):
    """The same engine behind an API key, a 2-request queue and a 2 kB body limit."""
    config = ServerConfig(
        served_model_name="tiny", api_key="s3cret", max_queued_requests=2, max_body_bytes=2000
    )
    url, server = serve(build_app(engine[0], config))
    yield url
    server.should_exit = True


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


@pytest.fixture(scope="module")
def offline(make_llm):
    return make_llm("served")


PROMPT = "The quick brown fox"


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/version").json()["version"]
    described = httpx.get(f"{server}/v1/engine").json()
    assert described["resolved"]["dtype"]["value"] == "float32"
    assert "reason" in described["resolved"]["layer_execution"]


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
    assert choice.finish_reason == "stop", choice  # the grammar ended it, within max_tokens
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


def metric(server: str, name: str) -> float:
    for line in httpx.get(f"{server}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_metrics_tokenize_detokenize(server, client):
    # (The compile counter is process-wide; other engines of this test process compile too.)
    compiles = metric(server, "jaxinfer:compilations_after_warmup_total")
    client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.5, logprobs=2, top_p=0.9
    )
    assert metric(server, "jaxinfer:compilations_after_warmup_total") == compiles
    assert metric(server, "jaxinfer:generation_tokens_total") >= 4
    assert metric(server, "jaxinfer:time_to_first_token_seconds_count") >= 1
    assert metric(server, "jaxinfer:num_requests_running") == 0
    capacity = (OPTIONS["num_kv_blocks"] - 1) * OPTIONS["block_size"]  # the null block aside
    assert metric(server, 'jaxinfer:kv_cache_capacity_tokens{kv_cache_dtype="auto"}') == capacity
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == PROMPT
    bad = httpx.post(f"{server}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["message"]


def test_error_shapes(server, guarded):
    def post(url, body, **kwargs):
        return httpx.post(f"{url}/v1/completions", timeout=30, **kwargs, **body)

    cases = [
        (post(server, {"content": b"[1, 2"}, headers={"content-type": "application/json"}), 400),
        (post(server, {"json": [1, 2]}), 400),
        (post(server, {"json": {"prompt": PROMPT, "max_tokens": "many"}}), 400),
        (post(server, {"json": {"prompt": ""}}), 400),
        (post(server, {"json": {"prompt": [10**9]}}), 400),
        (post(server, {"json": {"prompt": PROMPT, "max_tokens": 500}}), 400),
        (post(server, {"json": {"prompt": PROMPT, "model": "nope"}}), 404),
        (post(guarded, {"json": {"prompt": PROMPT}}), 401),
        (post(guarded, {"json": {"prompt": PROMPT}}, headers={"authorization": "Bearer x"}), 401),
        (
            post(
                guarded,
                {"json": {"prompt": PROMPT * 200}},
                headers={"authorization": "Bearer s3cret"},
            ),
            413,
        ),
        (
            post(
                guarded,
                {"json": {"prompt": [PROMPT] * 3}},
                headers={"authorization": "Bearer s3cret"},
            ),
            503,
        ),
    ]
    chat = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}
    cases.append((httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=30), 400))
    for response, status in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert httpx.get(f"{guarded}/health").status_code == 200  # stays open
    ok = post(
        guarded,
        {"json": {"prompt": PROMPT, "max_tokens": 2}},
        headers={"authorization": "Bearer s3cret"},
    )
    assert ok.status_code == 200


def test_disconnect_mid_stream_frees_the_request(server, engine):
    idle = metric(server, "jaxinfer:kv_cache_usage_perc")
    with httpx.stream(
        "POST",
        f"{server}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 100, "stream": True, "ignore_eos": True},
        timeout=30,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    for _ in range(100):
        if engine[0].num_unfinished == 0 and metric(server, "jaxinfer:kv_cache_usage_perc") == idle:
            break
        time.sleep(0.1)
    assert engine[0].num_unfinished == 0
    assert metric(server, "jaxinfer:kv_cache_usage_perc") == idle


def _results(url, bodies, timeout=30):
    """POSTs every (path, body) at once; streams are read to their end. Returns per body
    (status, json body or the stream's data lines)."""

    async def one(client, path, body):
        if body.get("stream"):
            async with client.stream("POST", f"{url}{path}", json=body, timeout=timeout) as r:
                return r.status_code, [x async for x in r.aiter_lines() if x.startswith("data:")]
        response = await client.post(f"{url}{path}", json=body, timeout=timeout)
        return response.status_code, response.json()

    async def run():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, p, b) for p, b in bodies))

    return asyncio.run(run())


def _assert_error_shape(body):
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]


def test_a_failing_step_ends_every_request_in_flight_or_queued(tiny_model_dir):
    """Fault injection: a step raises while a stream, a non-streamed request and requests
    still queued for admission are in flight; each ends with an error (none hangs), /health
    turns 503 and the server reports the dead engine."""
    engine = build_engine(tiny_model_dir, None, **OPTIONS)
    async_engine = AsyncEngine(engine)
    reported = []
    app = build_app(
        async_engine,
        ServerConfig(served_model_name="tiny"),
        on_engine_dead=lambda: reported.append(1),
    )
    url, server = serve(app)
    stuck, go = threading.Event(), threading.Event()
    real_step, steps = engine.step, 0

    def failing_step():
        nonlocal steps
        steps += 1
        if steps < 4:
            return real_step()
        stuck.set()
        go.wait(30)
        raise RuntimeError("device lost")

    try:
        engine.step = failing_step
        long = {"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True}
        in_flight = threading.Thread(
            target=lambda: results.extend(
                _results(
                    url, [("/v1/completions", {**long, "stream": True}), ("/v1/completions", long)]
                )
            )
        )
        results: list = []
        in_flight.start()
        assert stuck.wait(30)
        queued: list = []
        later = threading.Thread(
            target=lambda: queued.extend(
                _results(
                    url,
                    [("/v1/completions", {"prompt": f"{PROMPT} {i}", "n": 2}) for i in range(3)]
                    + [("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})],
                )
            )
        )
        later.start()
        deadline = time.monotonic() + 30
        while async_engine._commands.qsize() < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        # the 4 admissions wait behind the step (with any command a client's going sent)
        assert async_engine._commands.qsize() >= 4
        go.set()
        in_flight.join(40)
        later.join(40)
        assert not in_flight.is_alive() and not later.is_alive()  # nothing hangs

        (stream_status, events), (status, body) = results
        assert stream_status == 200 and events[-1] == "data: [DONE]"
        _assert_error_shape(json.loads(events[-2][len("data: ") :]))
        assert status == 503
        _assert_error_shape(body)
        assert [status for status, _ in queued] == [503] * 4
        for _, body in queued:
            _assert_error_shape(body)
        assert httpx.get(f"{url}/health").status_code == 503
        after = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT}, timeout=30)
        assert after.status_code == 503 and after.json()["error"]["message"]
        deadline = time.monotonic() + 10
        while not reported and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reported == [1]  # the server's --exit_on_engine_failure hook, called once
    finally:
        go.set()
        server.should_exit = True


def test_a_stalled_step_fails_requests_and_turns_health_503(tiny_model_dir):
    """A step that never returns cannot be stopped, but nobody may wait on it: past
    engine_step_timeout the requests in flight get errors and /health 503."""
    engine = build_engine(tiny_model_dir, None, **OPTIONS)
    async_engine = AsyncEngine(engine)
    reported = []
    config = ServerConfig(served_model_name="tiny", engine_step_timeout=1.0)
    url, server = serve(build_app(async_engine, config, on_engine_dead=lambda: reported.append(1)))
    release = threading.Event()
    real_step, steps_with_both = engine.step, 0

    def stalling_step():
        # Stalls the second step that holds both requests, however late (under load) the
        # second one reaches the engine: both are in flight when the step stops returning.
        nonlocal steps_with_both
        if len(engine.requests) == 2:
            steps_with_both += 1
            if steps_with_both == 2:
                release.wait(60)
        return real_step()

    try:
        assert httpx.get(f"{url}/health").status_code == 200
        engine.step = stalling_step
        long = {"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True}
        start = time.monotonic()
        (stream_status, events), (status, body) = _results(
            url, [("/v1/completions", {**long, "stream": True}), ("/v1/completions", long)]
        )
        assert time.monotonic() - start < 20
        assert stream_status == 200 and events[-1] == "data: [DONE]"
        assert "step has run" in json.loads(events[-2][len("data: ") :])["error"]["message"]
        assert status == 503 and "step has run" in body["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "step has run" in health.json()["error"]["message"]
        assert reported == [1]
        assert httpx.post(f"{url}/v1/completions", json=long, timeout=30).status_code == 503
    finally:
        release.set()
        server.should_exit = True


@contextlib.contextmanager
def server_process(model_dir, *flags: str):
    """`python -m jaxinfer.serve` on the tiny model with `flags`, once it answers; yields
    (process, url) and kills what is left at the end."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "jaxinfer.serve",
        f"--model={model_dir}",
        f"--port={port}",
        "--max_model_len=128",
        "--max_num_seqs=4",
        "--block_size=8",
        "--num_kv_blocks=64",
        "--max_num_batched_tokens=32",
        *flags,
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                httpx.get(f"{url}/health")
                break
            except httpx.TransportError:
                time.sleep(0.2)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()


def test_sigterm_lets_in_flight_requests_finish(tiny_model_dir, tmp_path):
    """The real entry point: on SIGTERM it stops accepting, finishes the stream in flight
    and exits. Its API key comes from a file, out of sight of `ps`."""
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-from-a-file\n")
    flags = ("--served_model_name=tiny", f"--api_key_file={key_file}")
    with server_process(tiny_model_dir, *flags) as (process, url):
        body = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "stream": True}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        headers = {"authorization": "Bearer s3cret-from-a-file"}
        evil = httpx.get(f"{url}/v1/models", headers={**headers, "host": "evil.example"})
        assert evil.status_code == 400  # DNS rebinding: only loopback names by default
        chunks, finish = 0, None
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 1:
                        process.send_signal(signal.SIGTERM)
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
                if line == "data: [DONE]":
                    break
        # the stream went on to its end after the signal (its chunk count varies: a loaded
        # machine merges the deltas a slow reader has not taken yet)
        assert chunks > 1 and finish == "length"
        # uvicorn shuts down gracefully, then re-raises the signal it caught: exit by SIGTERM.
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert b"Traceback" not in process.stdout.read()


def test_the_server_exits_non_zero_when_its_engine_fails(tiny_model_dir):
    """--exit_on_engine_failure, for a supervisor to restart the server: a step timeout far
    below a step's time (a tiny model's step takes about 0.3 ms here) declares the engine
    stalled at a step the watchdog finds running."""
    flags = ("--engine_step_timeout=0.0001", "--exit_on_engine_failure")
    with server_process(tiny_model_dir, *flags) as (process, url):
        body = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "n": 4}
        statuses = []
        with contextlib.suppress(httpx.TransportError):  # until the server has gone
            for _ in range(100):
                statuses.append(httpx.post(f"{url}/v1/completions", json=body).status_code)
        assert set(statuses) <= {200, 503} and 503 in statuses
        assert process.wait(timeout=60) == 1
        assert b"shutting down (--exit_on_engine_failure)" in process.stdout.read()


def test_x_request_id_labels_the_response(server, client):
    """The header becomes the response's id and comes back as a header; the engine's ids
    are the server's own (tests/server/test_isolation.py); a header that cannot be an id is
    refused."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0}

    def sample(name):
        response = httpx.post(
            f"{server}/v1/completions", json=body, headers={"X-Request-Id": name}, timeout=60
        )
        assert response.status_code == 200, response.text
        assert response.json()["id"] == f"cmpl-{name}"
        assert response.headers["x-request-id"] == name

    sample("line-7")
    sample("line-7")  # the same label again, at once or later: answered
    chat = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_headers={"X-Request-Id": "my-chat"},
    )
    assert chat.parse().id == "chatcmpl-my-chat"
    refused = httpx.post(
        f"{server}/v1/completions", json=body, headers={"X-Request-Id": "x" * 129}, timeout=60
    )
    assert refused.status_code == 400 and "X-Request-Id" in refused.text
