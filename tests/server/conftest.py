"""A server shared by the robustness and isolation tests: the tiny model behind the CLI's
defaults that matter there (a sequence limit, request chat templates allowed, the loopback
host check), and the check each of their tests ends with."""

from __future__ import annotations

import logging

import httpx
import pytest

from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve
from jaxinfer.server.guard import HostPolicy
from jaxinfer.server.metrics import ServerMetrics
from tests.support.engines import build_engine
from tests.support.server import Server, post, wait_until


@pytest.fixture(scope="session")
def guarded_engine(tiny_model_dir):
    """(AsyncEngine, ServerMetrics) on the tiny model's "served" options."""
    llm_engine = build_engine(tiny_model_dir, "served")
    metrics = ServerMetrics(llm_engine)
    return AsyncEngine(llm_engine, metrics.observe_finished), metrics


@pytest.fixture(scope="session")
def guarded_server(guarded_engine):
    async_engine, metrics = guarded_engine
    config = ServerConfig(
        served_model_name="tiny",
        max_queued_requests=16,
        allow_request_chat_template=True,
        chat_template_timeout=2.0,
        host_policy=HostPolicy.for_server("127.0.0.1", None),
    )
    app = build_app(async_engine, config, metrics)
    url, uvicorn_server = serve(app)
    yield Server(url, app, async_engine)
    uvicorn_server.should_exit = True


@pytest.fixture
def healthy_after(guarded_server):
    """Runs the test, then checks the server: /health 200, a normal request answered, nothing
    left running and the KV cache back at idle, no error logged."""
    server = guarded_server
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.ERROR)
    handler.emit = errors.append
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]  # uvicorn's do not propagate
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert httpx.get(f"{server.url}/health").status_code == 200
    ok = post(server.url, "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 3})
    assert ok.status_code == 200, ok.text
    engine = server.engine
    wait_until(lambda: engine.num_unfinished == 0 and server.limiter.held == 0)
    wait_until(lambda: engine.engine.stats().kv_cache_usage == 0)
    assert not engine.engine.has_unfinished_requests()
    assert not errors, [record.getMessage() for record in errors]
