"""Helpers for tests that drive a server: requests, waiting, OpenAI error bodies, slow steps."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import httpx

from jaxinfer.server.async_engine import AsyncEngine


@dataclasses.dataclass(frozen=True)
class Server:
    url: str
    app: object
    engine: AsyncEngine

    @property
    def limiter(self):
        return self.app.state.serving.limiter


def post(url, path, body, timeout=60, **kwargs):
    return httpx.post(f"{url}{path}", json=body, timeout=timeout, **kwargs)


def wait_until(condition, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def assert_error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error["message"]


@contextlib.contextmanager
def slow_steps(async_engine, seconds):
    """Each engine step takes at least `seconds` (commands queue up meanwhile)."""
    engine = async_engine.engine
    real = engine.step

    def step():
        time.sleep(seconds)
        return real()

    engine.step = step
    try:
        yield
    finally:
        del engine.step
