"""No client can touch another's request (issue 40): request ids are the server's, unseeded
samples are random whatever the client's id, a request's own chat template costs a bounded
amount and its child dies with its client, and the response headers close the page's
origin. Each against the shared tiny server, which must be healthy afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.background import serve
from jaxinfer.server.guard import check_api_key
from tests.support.server import assert_error, post, slow_steps, wait_until
from tools.processes import template_children

pytestmark = pytest.mark.engine

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture
def server(guarded_server):
    return guarded_server


# -- request ids ---------------------------------------------------------------------------


async def stream_tokens(client, url, body, headers) -> tuple[int, bool, list[str]]:
    """(completion tokens in the usage chunk, whether [DONE] came, error events)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    tokens, done, errors = None, False, []
    async with client.stream("POST", f"{url}{COMPLETIONS}", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"]["message"])
                elif chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens, done, errors


async def drop_soon(client, url, body, headers, seconds) -> None:
    """Sends a request and leaves before it can finish."""
    with contextlib.suppress(httpx.TimeoutException):
        await client.post(f"{url}{COMPLETIONS}", json=body, headers=headers, timeout=seconds)


def test_a_client_cannot_end_another_clients_request_by_its_id(server, healthy_after):
    """Client B sends A's X-Request-Id many times and drops each connection within
    milliseconds while A streams: B's cancelled admissions once queued aborts for that id,
    which ended A's stream without [DONE] (9 trials in 10). A must get every token."""
    victim = {"prompt": "The fox", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    header = {"X-Request-Id": "shared-id"}

    async def trial(client):
        streaming = asyncio.create_task(stream_tokens(client, server.url, victim, header))
        await asyncio.sleep(0.05)
        await asyncio.gather(
            *(
                drop_soon(client, server.url, {**victim, "max_tokens": 4}, header, 0.002 * i)
                for i in range(1, 16)
            )
        )
        return await streaming

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return [await trial(client) for _ in range(10)]

    with slow_steps(server.engine, 0.01):  # admissions queue behind each step
        results = asyncio.run(run())
    for tokens, done, errors in results:
        assert (tokens, done, errors) == (40, True, [])


def test_a_non_streamed_request_is_not_ended_by_another_client_either(server, healthy_after):
    body = {"prompt": "The fox", "max_tokens": 30, "ignore_eos": True, "temperature": 0}
    header = {"X-Request-Id": "mine"}

    async def trial(client):
        victim = asyncio.create_task(
            client.post(f"{server.url}{COMPLETIONS}", json=body, headers=header)
        )
        await asyncio.sleep(0.05)
        await asyncio.gather(
            *(drop_soon(client, server.url, body, header, 0.002 * i) for i in range(1, 16))
        )
        return await victim

    async def run():
        async with httpx.AsyncClient(timeout=30) as client:
            return [await trial(client) for _ in range(5)]

    with slow_steps(server.engine, 0.01):
        responses = asyncio.run(run())
    for response in responses:
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 30


def test_two_clients_with_one_id_are_both_answered_in_full(server, healthy_after):
    """The id labels each response (the body's id, the X-Request-Id header); it was once
    refused as "already in use" for the second client, telling it the first one's was live."""
    body = {"prompt": "The fox", "max_tokens": 24, "ignore_eos": True}
    header = {"X-Request-Id": "twins"}

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(f"{server.url}{COMPLETIONS}", json=body, headers=header)
                    for _ in range(2)
                )
            )

    with slow_steps(server.engine, 0.01):  # both in flight together
        responses = asyncio.run(run())
    for response in responses:
        assert response.status_code == 200, response.text
        assert response.json()["id"] == "cmpl-twins"
        assert response.headers["x-request-id"] == "twins"
        assert response.json()["usage"]["completion_tokens"] == 24


def test_unseeded_samples_are_random_whatever_the_id(server, healthy_after):
    """An unseeded request's seed came from its id: a constant id gave the same "random"
    sample every time. A seed still repeats."""
    body = {"prompt": "A fox", "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    header = {"X-Request-Id": "same-every-time"}
    texts = {
        post(server.url, COMPLETIONS, body, headers=header).json()["choices"][0]["text"]
        for _ in range(4)
    }
    assert len(texts) > 1
    seeded = {
        post(server.url, COMPLETIONS, {**body, "seed": 11}).json()["choices"][0]["text"]
        for _ in range(2)
    }
    assert len(seeded) == 1


# -- a request's own chat template -----------------------------------------------------------


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_templates_huge_error_is_capped(server, healthy_after):
    """raise_exception('x' * 150_000_000) was a 150 MB 400 body and about 900 MB more in
    the server for that one request (4 MB here: 30 MB took more than the 2 s render timeout
    on a loaded CI machine; the cap is what is tested, not the size)."""
    peak, done = [rss_mb()], threading.Event()

    def sample():
        while not done.is_set():
            peak.append(rss_mb())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "chat_template": "{{ raise_exception('x' * 4000000) }}",
    }
    try:
        response = post(server.url, CHAT, body)
    finally:
        done.set()
        sampler.join()
    assert "TemplateError: xxxx" in assert_error(response, 400)
    assert len(response.content) < 2000
    assert max(peak) - peak[0] < 40  # MB


def test_a_cancelled_render_kills_its_child_and_holds_its_slot_until_then(server, healthy_after):
    """Clients that left 150 ms after sending a spinning template left their children
    running to their timeout, 6 at once under a bound of 2."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template": SPIN}
    seen, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            seen.append(template_children(os.getpid()))
            time.sleep(0.01)

    async def leave_early(client):
        with contextlib.suppress(httpx.TimeoutException):
            await client.post(f"{server.url}{CHAT}", json=body, timeout=0.15)

    async def run():
        async with httpx.AsyncClient() as client:
            for _ in range(3):
                await asyncio.gather(*(leave_early(client) for _ in range(6)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        asyncio.run(run())
        wait_until(lambda: template_children(os.getpid()) == 0, seconds=5)
    finally:
        done.set()
        watcher.join()
    assert max(seen) <= 2, max(seen)
    ok = {**body, "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    assert post(server.url, CHAT, ok).status_code == 200


# -- headers and the API's description ---------------------------------------------------------


def test_every_response_says_nosniff_and_the_page_has_a_strict_policy(server):
    for response in (
        httpx.get(f"{server.url}/health"),
        httpx.get(f"{server.url}/no/such/route"),
        post(server.url, COMPLETIONS, {"prompt": 5}),
    ):
        assert response.headers["x-content-type-options"] == "nosniff"
    page = httpx.get(server.url)
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
    assert "'unsafe-inline'" not in policy and "connect-src 'self'" in policy
    assert page.headers["x-frame-options"] == "DENY"


def test_the_api_description_is_behind_the_key_and_docs_are_off(guarded_engine):
    async_engine, _ = guarded_engine
    keyed = ServerConfig(served_model_name="tiny", api_key="k3y")
    url, uvicorn_server = serve(build_app(async_engine, keyed))
    try:
        assert httpx.get(f"{url}/openapi.json").status_code == 401
        ok = httpx.get(f"{url}/openapi.json", headers={"Authorization": "Bearer k3y"})
        assert ok.status_code == 200 and ok.json()["info"]["title"] == "jaxinfer"
        assert httpx.get(f"{url}/docs", headers={"Authorization": "Bearer k3y"}).status_code == 404
        # A header of bytes no key is made of: refused, not an error.
        raw = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k\u00e9y".encode()})
        assert raw.status_code == 401
        assert httpx.get(url).status_code == 200  # the page asks for the key itself
    finally:
        uvicorn_server.should_exit = True
    with_docs = ServerConfig(served_model_name="tiny", api_key="k3y", enable_docs=True)
    url, uvicorn_server = serve(build_app(async_engine, with_docs))
    try:
        assert httpx.get(f"{url}/docs").status_code == 401
        assert httpx.get(f"{url}/docs", headers={"Authorization": "Bearer k3y"}).status_code == 200
    finally:
        uvicorn_server.should_exit = True


@pytest.mark.parametrize("key", ["clé", "with space", "", "tab\tkey"])
def test_a_key_no_header_can_carry_is_refused_at_start(key):
    with pytest.raises(ValueError, match="visible ASCII"):
        check_api_key(key)
    with pytest.raises(ValueError, match="visible ASCII"):
        ServerConfig(served_model_name="tiny", api_key=key)
