"""No request takes the server down (issue 19): each way one request or client could kill,
freeze or swell the engine shared by everyone, reproduced against a tiny model, ends as a
per-request 4xx (OpenAI's error shape) or a bounded cost, and afterwards the server still
answers a normal request with the KV cache back at idle."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest

from jaxinfer.sampling_params import RequestOutputKind, SamplingParams
from jaxinfer.server.guard import HostPolicy
from tests.support.server import assert_error, post, slow_steps, wait_until

pytestmark = pytest.mark.engine

PROMPT = "The quick brown fox"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture
def server(guarded_server):
    return guarded_server


@pytest.fixture
def engine(guarded_engine):
    return guarded_engine


# -- 1. clients that leave while their request waits for admission -------------------------


def test_clients_that_give_up_while_queued_for_admission(server, healthy_after):
    """Their admissions were cancelled while queued behind a slow step: the engine thread must
    skip them (it died on InvalidStateError), and an n > 1 or multi-prompt request cancelled
    part-way must leave nothing generating."""

    async def give_up(client, body):
        with contextlib.suppress(httpx.TimeoutException):
            await client.post(f"{server.url}/v1/completions", json=body, timeout=0.3)

    async def burst():
        async with httpx.AsyncClient() as client:
            bodies = [
                {"prompt": f"{PROMPT} {i}", "max_tokens": 40, "ignore_eos": True, "n": 1 + i % 3}
                for i in range(8)
            ] + [
                {"prompt": [PROMPT, "Over the lazy dog"], "max_tokens": 40, "stream": True},
                {"prompt": PROMPT, "max_tokens": 40, "stream": True, "n": 2},
            ]
            await asyncio.gather(*(give_up(client, b) for b in bodies))

    with slow_steps(server.engine, 1.0):  # each step outlasts the clients' patience
        runner = threading.Thread(  # keeps a step running while the others queue
            target=post,
            args=(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3}),
        )
        runner.start()
        time.sleep(0.2)
        asyncio.run(burst())
        runner.join()
    assert server.engine.alive


def test_a_non_streamed_chat_abandoned_by_its_client(server, healthy_after):
    """until_disconnect read the cancelled work's result too early (a 500 and a traceback)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "ignore_eos": True}
    with slow_steps(server.engine, 0.05):
        for _ in range(3):
            with pytest.raises(httpx.TimeoutException):
                post(server.url, "/v1/chat/completions", body, timeout=0.4)
            wait_until(lambda: server.engine.num_unfinished == 0)


# -- 2, 3. values that overflow or poison the step's arrays -------------------------------


@pytest.mark.parametrize("top_k", [2**31, 2**63, 10**30])
def test_top_k_beyond_the_vocabulary_means_all(server, healthy_after, top_k):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    large = post(server.url, "/v1/completions", {**body, "top_k": top_k})
    assert large.status_code == 200, large.text
    everything = post(server.url, "/v1/completions", {**body, "top_k": -1})
    assert large.json()["choices"][0]["text"] == everything.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    ("raw", "name"),
    [
        ('"temperature": Infinity', "temperature"),
        ('"temperature": NaN', "temperature"),
        ('"temperature": 1e-50', "temperature"),
        ('"temperature": 1e400', "temperature"),
        ('"repetition_penalty": 1e-50', "repetition_penalty"),
        ('"top_p": -Infinity', "top_p"),
        ('"logit_bias": {"5": Infinity}', "logit_bias"),
        ('"presence_penalty": 1e39', "presence_penalty"),
    ],
)
def test_non_finite_and_extreme_floats_are_refused(server, healthy_after, raw, name):
    content = '{"prompt": "hi", "max_tokens": 2, ' + raw + "}"
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert name in assert_error(response, 400)


# -- 4, 5. work that grew with the request on the engine thread ----------------------------


def test_bad_words_are_bounded_and_prepared_off_the_engine_thread(
    server, healthy_after, monkeypatch
):
    threads = []
    processor = server.engine.engine.input_processor
    real = processor.bad_word_sequences

    def recording(words):
        threads.append(threading.current_thread().name)
        return real(words)

    monkeypatch.setattr(processor, "bad_word_sequences", recording)
    huge = {"prompt": PROMPT, "max_tokens": 2, "bad_words": [f"w{i}x" for i in range(200_000)]}
    assert "bad_words takes at most 1024" in assert_error(
        post(server.url, "/v1/completions", huge), 400
    )
    words = [f"word{i} and more" for i in range(1024)]
    body = {"prompt": PROMPT, "max_tokens": 8, "bad_words": words, "n": 3}
    assert post(server.url, "/v1/completions", body).status_code == 200
    assert threads and "engine-loop" not in threads


def test_a_grammar_is_compiled_once_off_the_engine_thread_and_shared(server, healthy_after):
    compiler = server.engine.engine.input_processor.grammar_compiler
    schema = {  # bounded, so that a sample can finish within max_tokens
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 4},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "nonce": {"const": "n1"},
        },
        "required": ["name", "age", "nonce"],
        "additionalProperties": False,
    }
    before = compiler.num_compiled
    body = {
        "messages": [{"role": "user", "content": "JSON please"}],
        "max_tokens": 64,
        "temperature": 1.0,
        "n": 8,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }
    first = post(server.url, "/v1/chat/completions", body)
    assert first.status_code == 200 and len(first.json()["choices"]) == 8
    assert compiler.num_compiled == before + 1  # 8 samples, one compile (it was 16)
    assert post(server.url, "/v1/chat/completions", body).status_code == 200
    assert compiler.num_compiled == before + 1  # cached by spec
    stopped = [c for c in first.json()["choices"] if c["finish_reason"] == "stop"]
    assert stopped, "no sample finished its JSON within max_tokens: nothing was checked"
    for choice in stopped:
        assert set(json.loads(choice["message"]["content"])) >= {"name", "age"}


def test_a_grammar_that_compiles_too_long_is_refused(server, healthy_after, monkeypatch):
    processor = server.engine.engine.input_processor
    real = processor.compile_grammar

    def slow(spec):
        time.sleep(1.5)
        return real(spec)

    monkeypatch.setattr(processor, "compile_grammar", slow)
    monkeypatch.setattr(server.engine, "grammar_timeout", 0.3)
    body = {"prompt": PROMPT, "max_tokens": 4, "structured_outputs": {"regex": "[ab]{1,9}"}}
    assert "did not compile within 0.3 s" in assert_error(
        post(server.url, "/v1/completions", body), 400
    )
    time.sleep(1.5)  # the compile ends on its own thread


# -- 6. large inputs stay off the event loop -----------------------------------------------


def test_tokenizing_templates_and_detokenizing_run_off_the_event_loop(
    server, healthy_after, monkeypatch
):
    tokenizer = server.engine.engine.tokenizer
    on_loop = []

    def watch(name):
        real = getattr(tokenizer, name)

        def wrapper(*args, **kwargs):
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop()
                on_loop.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(tokenizer, name, wrapper)

    for name in ("encode", "encode_many", "apply_chat_template", "decode"):
        watch(name)
    text = "The quick brown fox jumps over the lazy dog. " * 20_000  # 900 kB
    assert post(server.url, "/tokenize", {"prompt": text}).json()["count"] > 10_000
    tokens = post(server.url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert post(server.url, "/detokenize", {"tokens": tokens.json()["tokens"]}).status_code == 200
    assert_error(post(server.url, "/detokenize", {"tokens": [0] * 100_000 + [10**6]}), 400)
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
    assert "max_model_len" in assert_error(post(server.url, "/v1/chat/completions", chat), 400)
    assert post(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).is_success
    assert not on_loop


# -- 7. one request amplified into host memory ---------------------------------------------


def test_the_sequence_limit_counts_n_and_prompts_and_holds_under_a_burst(server, healthy_after):
    """A burst of concurrent requests must not all pass the check before any is counted."""
    assert server.limiter.limit == 16
    assert "adds 20" in assert_error(
        post(server.url, "/v1/completions", {"prompt": [PROMPT] * 10, "n": 2}), 503
    )
    peak = 0

    async def one(client, i):
        nonlocal peak
        response = await client.post(
            f"{server.url}/v1/completions",
            json={"prompt": f"{PROMPT} {i}", "max_tokens": 6, "n": 2},
            timeout=60,
        )
        peak = max(peak, server.limiter.held)
        return response.status_code

    async def burst():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, i) for i in range(40)))

    with slow_steps(server.engine, 0.05):
        statuses = asyncio.run(burst())
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 8
    assert statuses.count(503) >= 40 - 16  # at most 8 requests of 2 held at any time
    assert peak <= 16


def test_prompts_per_request_are_capped(server, healthy_after):
    body = {"prompt": [[5, 6, 7]] * 129, "max_tokens": 1}
    assert "at most 128 prompts" in assert_error(post(server.url, "/v1/completions", body), 400)


def test_samples_share_what_their_request_prepared(tiny_llm):
    """n samples held n vocabulary-sized bias rows and n compiled grammars; now one of each
    (a grammar's state is each sample's own copy), and only the first computes prompt
    logprobs (the others may start from the prefix cache)."""
    engine = tiny_llm.engine  # driven by this test alone: add, look, abort
    params = SamplingParams(
        n=4,
        logit_bias={7: 5.0},
        min_tokens=2,
        bad_words=["fox jumps"],
        prompt_logprobs=1,
        structured_outputs={"regex": "[a-z ]{1,20}"},
    )
    parent = engine.add_request(PROMPT, params, request_id="shared")
    try:
        first, *others = parent.children
        assert not first.bias.flags.writeable
        for child in others:
            assert child.bias is first.bias
            assert child.prompt_token_ids is first.prompt_token_ids
            assert child.constraints.bad_words is first.constraints.bad_words
            assert child.constraints.stop_mask is first.constraints.stop_mask
            assert child.constraints.matcher is not first.constraints.matcher
        assert [c.sampling_params.prompt_logprobs for c in parent.children] == [1, None, None, None]
    finally:
        engine.abort_request("shared")
    assert not engine.has_unfinished_requests()


def test_prompt_logprobs_are_returned_and_refused_in_streams(server, healthy_after, tiny_llm):
    body = {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0}
    response = post(server.url, "/v1/completions", body)
    assert response.status_code == 200, response.text
    returned = response.json()["choices"][0]["prompt_logprobs"]
    expected = tiny_llm.generate(
        [PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=2, temperature=0), use_tqdm=False
    )[0].prompt_logprobs
    assert returned[0] is None and len(returned) == len(expected)
    for got, want in zip(returned[1:], expected[1:], strict=True):
        assert {int(k) for k in got} == set(want)
        for token, value in want.items():
            assert got[str(token)]["logprob"] == pytest.approx(value, abs=1e-4)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 1}
    assert post(server.url, "/v1/chat/completions", chat).json()["prompt_logprobs"][0] is None
    streamed = {**body, "stream": True}
    assert "stream" in assert_error(post(server.url, "/v1/completions", streamed), 400)


# -- 8. streams: deltas, and what a slow or vanished reader costs ---------------------------


def test_a_slow_reader_holds_each_token_once(engine):
    """The engine reports deltas; what the reader has not taken is kept merged, not as one
    cumulative copy per step (which cost O(L^2) memory)."""
    async_engine = engine[0]

    async def run():
        params = SamplingParams(
            max_tokens=60, ignore_eos=True, temperature=0, output_kind=RequestOutputKind.DELTA
        )
        prepared = await async_engine.prepare(PROMPT, params)
        stream = await async_engine.add("slow-reader", prepared)
        channel = stream._channel
        while async_engine.num_unfinished:  # generate everything without reading
            await asyncio.sleep(0.02)
        held = sum(len(c.token_ids) for o in channel._pending for c in o.outputs)
        steps = len(channel._pending)
        (output,) = [o async for o in stream]
        return held, steps, output

    held, steps, output = asyncio.run(run())
    assert held == 60 and steps > 1  # every step's delta, each token once
    assert len(output.outputs[0].token_ids) == 60 and output.finished


def test_a_stream_abandoned_at_a_blocked_send_stops_generating(server, healthy_after):
    """The client stops reading (the send blocks) and then goes away: the request must end
    then, not run to its last token."""
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 100,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()

    async def run():
        gone = asyncio.Event()
        sent_once = asyncio.Event()
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                sent_once.set()
                await asyncio.Event().wait()  # the client reads no more: blocked forever

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        task = asyncio.create_task(server.app(scope, receive, send))
        await asyncio.wait_for(sent_once.wait(), 30)
        assert server.engine.num_unfinished == 1
        gone.set()
        await asyncio.wait_for(task, 30)
        started = time.monotonic()
        while server.engine.num_unfinished:
            await asyncio.sleep(0.02)
        return time.monotonic() - started

    with slow_steps(server.engine, 0.05):  # 100 tokens would take over 5 s
        assert asyncio.run(run()) < 2.0


# -- 10. chat templates a request brings ----------------------------------------------------


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "2.0 s",
        ),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "more than"),
        ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{{ 'x' * 2000000000 }}", "the chat template"),
        ("{% for m in messages %}", "TemplateSyntaxError"),
    ],
)
def test_a_requests_chat_template_is_bounded(server, healthy_after, template, message):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "chat_template": template,
    }
    assert message in assert_error(post(server.url, "/v1/chat/completions", body), 400)


def test_a_requests_chat_template_renders(server, healthy_after, tiny_llm):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    body = {
        "messages": [{"role": "user", "content": "Tell me about the fox."}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "chat_template": template,
    }
    response = post(server.url, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    tokens = tiny_llm.tokenizer.encode("[user] Tell me about the fox.\n", add_special_tokens=False)
    expected = tiny_llm.generate(
        [tokens], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    assert response.json()["choices"][0]["message"]["content"] == expected.outputs[0].text


# -- 12. requests the API defines as invalid, and the edges of HTTP --------------------------


def raw_post(url, path, content: bytes, **headers):
    headers = {"content-type": "application/json", **headers}
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=30)


def test_invalid_requests_are_400s_in_openais_shape(server, healthy_after):
    chat = "/v1/chat/completions"
    user = {"role": "user", "content": "hi"}
    cases = [
        (chat, {"messages": []}, "messages"),
        (chat, {"messages": [{"role": "user"}]}, "needs content"),
        (chat, {"messages": [{"role": "", "content": "x"}]}, "role"),
        (chat, {"messages": [user], "max_completion_tokens": 0}, "max_tokens"),
        (chat, {"messages": [user], "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 65}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": ["x" * 600]}, "stop"),
    ]
    for path, body, message in cases:
        assert message in assert_error(post(server.url, path, body), 400), body
    surrogate = raw_post(server.url, "/v1/completions", b'{"prompt": "\\ud800 fox"}')
    assert "surrogate" in assert_error(surrogate, 400)
    lone_in_chat = b'{"messages": [{"role": "user", "content": "\\udfff"}]}'
    assert "surrogate" in assert_error(raw_post(server.url, chat, lone_in_chat), 400)
    nested = b"[" * 100_000 + b"]" * 100_000
    assert_error(raw_post(server.url, "/v1/completions", nested), 400)
    assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    assert_error(httpx.get(f"{server.url}/v1/completions"), 405)


def test_a_chunked_body_over_the_limit_is_a_413(server, healthy_after):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(600):
            yield b"x" * 8192  # 4.9 MB in all, with no content-length
        yield b'"}'

    response = httpx.post(
        f"{server.url}/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert_error(response, 413)


def test_only_the_served_host_names_are_answered(server, healthy_after):
    port = server.url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert httpx.get(f"{server.url}/v1/models", headers={"host": host}).status_code == 200
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}"):
        response = httpx.get(f"{server.url}/v1/models", headers={"host": host})
        assert "not served here" in assert_error(response, 400)


def test_host_policy():
    loopback = HostPolicy.for_server("127.0.0.1", None)
    assert loopback.allows("localhost:8000") and loopback.allows("[::1]:8000")
    assert not loopback.allows("10.0.0.2:8000") and not loopback.allows("")
    everywhere = HostPolicy.for_server("0.0.0.0", ["gpu-box.lan"])
    assert everywhere.allows("10.0.0.2:8000") and everywhere.allows("[fe80::1]:80")
    assert everywhere.allows("GPU-box.lan:8000") and not everywhere.allows("attacker.example")
    assert HostPolicy.for_server("127.0.0.1", ["*"]) is None


def test_invalid_messages_are_400s_in_anthropics_shape(server, healthy_after):
    """/v1/messages answers in Anthropic's error shape, its limits those of chat."""
    path, user = "/v1/messages", {"role": "user", "content": "hi"}

    def anthropic_error(response, status: int) -> str:
        assert response.status_code == status, response.text
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]["message"]

    cases = [
        ({"messages": [user]}, "max_tokens"),
        ({"messages": [], "max_tokens": 4}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 4}, "role"),
        ({"messages": [user], "max_tokens": 4, "temperature": 1.5}, "temperature"),
        ({"messages": [user], "max_tokens": 4, "stop_sequences": ["x"] * 65}, "stop"),
        ({"messages": [user], "max_tokens": 100_000}, "max_model_len"),
        ({"messages": [user], "max_tokens": 4, "unknown": 1}, "unknown"),
        (
            {"messages": [{"role": "user", "content": [{"type": "audio"}]}], "max_tokens": 4},
            "audio",
        ),
    ]
    for body, message in cases:
        assert message in anthropic_error(post(server.url, path, body), 400), body
    assert anthropic_error(post(server.url, path, {**cases[0][0], "max_tokens": 4,
                                                  "model": "nope"}), 404)  # fmt: skip
    nested = b"[" * 100_000 + b"]" * 100_000
    anthropic_error(raw_post(server.url, path, nested), 400)
    good = post(server.url, path, {"messages": [user], "max_tokens": 3})
    assert good.status_code == 200 and good.json()["type"] == "message"


def test_invalid_responses_requests_are_400s(server, healthy_after):
    path = "/v1/responses"
    cases = [
        ({}, "input"),
        ({"input": []}, "input must not be empty"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "image_generation_call"}]}, "not supported"),
        ({"input": [{"role": "tool", "content": "x"}]}, "role"),
        ({"input": "hi", "tool_choice": "required"}, "needs tools"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "schema"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "hi", "max_output_tokens": 100_000}, "max_model_len"),
        ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ]
    for body, message in cases:
        assert message in assert_error(post(server.url, path, body), 400), body
    assert "not found" in assert_error(
        post(server.url, path, {"input": "hi", "previous_response_id": "resp_x"}), 404
    )
    good = post(server.url, path, {"input": "hi", "max_output_tokens": 3})
    assert good.status_code == 200 and good.json()["object"] == "response"


def test_invalid_embedding_requests_are_400s(server, healthy_after):
    path = "/v1/embeddings"
    cases = [
        ({}, "input"),
        ({"input": []}, "must not be empty"),
        ({"input": ["a", ""]}, "must not be empty"),
        ({"input": ["x"] * 1000}, "at most"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 100_000}, "exceeds"),
        ({"input": "x " * 200}, "max_model_len"),
        ({"input": [10**9]}, "token"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "model": "nope"}, "not found"),
    ]
    for body, message in cases:
        status = 404 if "model" in body else 400
        assert message in assert_error(post(server.url, path, body), status), body
    good = post(server.url, path, {"input": ["a fox", "a dog"]})
    assert good.status_code == 200 and len(good.json()["data"]) == 2
