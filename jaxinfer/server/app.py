"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

Every request runs as engine requests on the shared step loop; a malformed or unservable
request gets an OpenAI-style error (400, 404, 413, 503) and touches nothing else. A
watchdog (while the app runs under a server) declares the engine dead when a step runs
longer than `engine_step_timeout`, so no request waits on a stalled loop. GET / is a chat page
(static/chat.html) that uses the API from a browser.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import logging
from collections.abc import Callable

import fastapi
from fastapi.responses import HTMLResponse
from prometheus_client import CONTENT_TYPE_LATEST

from jaxinfer.server.anthropic import AnthropicServing
from jaxinfer.server.anthropic_protocol import MessagesRequest
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.embeddings import EmbeddingRequest, EmbeddingsServing
from jaxinfer.server.errors import APIError, error_response, install_error_handlers
from jaxinfer.server.guard import Guard, HostPolicy, check_api_key
from jaxinfer.server.headers import ResponseHeaders
from jaxinfer.server.lora_routes import LoraModels, install_lora_routes
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.page import CHAT_PAGE, PAGE_HEADERS
from jaxinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from jaxinfer.server.responses import ResponsesServing
from jaxinfer.server.responses_protocol import ResponsesRequest
from jaxinfer.server.serving import OpenAIServing

VERSION = importlib.metadata.version("jaxinfer")
logger = logging.getLogger(__name__)


class EngineStalledError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Args:
    served_model_name: the model id clients name (and /v1/models lists).
    api_key: when set, /v1, /tokenize, /detokenize and the API's description
        (/openapi.json, /docs) need `Authorization: Bearer <key>`; visible ASCII only (what
        a header carries as typed).
    max_queued_requests: sequences (prompts x n) held at once, beyond which new requests get
        503; None: no limit (batch runs, which bound themselves by their file).
    max_body_bytes: larger request bodies get 413.
    allow_request_chat_template: accept a `chat_template` in chat requests (rendered in a
        sandboxed child process with chat_template_timeout); refused otherwise.
    chat_template_timeout: seconds a request's own chat template may take to render.
    host_policy: which Host headers are answered (None: any).
    engine_step_timeout: a step running longer makes /health 503 and the engine dead.
    enable_docs: serve the API's interactive page at /docs (Swagger UI, whose scripts come
        from a CDN); off by default. /openapi.json is always there.
    lora_modules: LoRA adapters served as models of their own, by name (the engine reads
        them at start); enable_lora_runtime_updates: POST /v1/load_lora_adapter and
        /v1/unload_lora_adapter change them while serving.
    """

    served_model_name: str
    api_key: str | None = None
    max_queued_requests: int | None = None
    max_body_bytes: int = 4 << 20
    allow_request_chat_template: bool = False
    chat_template_timeout: float = 5.0
    host_policy: HostPolicy | None = None
    engine_step_timeout: float = 60.0
    enable_docs: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder)
    enable_lora_runtime_updates: bool = False

    def __post_init__(self):
        check_api_key(self.api_key)
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError("max_queued_requests must be at least 1")
        if self.max_body_bytes < 1 or self.engine_step_timeout <= 0:
            raise ValueError("max_body_bytes and engine_step_timeout must be positive")


def build_app(
    engine: AsyncEngine,
    config: ServerConfig,
    metrics: ServerMetrics | None = None,
    on_engine_dead: Callable[[], None] | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> fastapi.FastAPI:
    """`on_engine_dead`: called once, on the event loop, when the watchdog finds the engine
    dead or stalled (the server's --exit_on_engine_failure). `on_shutdown`: called (on a
    worker thread) when the server shuts down, after the requests in flight have finished
    (the server stops the other processes of its job)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        watchdog = asyncio.create_task(_watch(engine, config, on_engine_dead))
        try:
            yield
        finally:
            watchdog.cancel()
            if on_shutdown is not None:
                await asyncio.to_thread(on_shutdown)

    app = fastapi.FastAPI(
        title="jaxinfer",
        version=VERSION,
        lifespan=lifespan,
        docs_url="/docs" if config.enable_docs else None,
        redoc_url=None,
    )
    app.add_middleware(
        Guard,
        api_key=config.api_key,
        max_body_bytes=config.max_body_bytes,
        host_policy=config.host_policy,
    )
    app.add_middleware(ResponseHeaders)  # (outermost: on the Guard's refusals too)
    install_error_handlers(app)
    serving = OpenAIServing(
        engine,
        config.served_model_name,
        config.max_queued_requests,
        config.allow_request_chat_template,
        config.chat_template_timeout,
        max_rendered_chars=2 * config.max_body_bytes,
    )
    app.state.serving = serving
    lora_models = LoraModels(serving)
    for name, path in config.lora_modules:
        lora_models.add(name, path)  # (a ValueError: the server does not start)
    if config.enable_lora_runtime_updates:
        install_lora_routes(app, lora_models)

    @app.get("/", include_in_schema=False)
    async def chat_page():
        """The chat page (jaxinfer/server/static/chat.html)."""
        return HTMLResponse(CHAT_PAGE, headers=PAGE_HEADERS)

    @app.get("/health")
    async def health():
        problem = engine_problem(engine, config)
        if problem is not None:
            return error_response(503, problem, "engine_dead")
        return fastapi.Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    description = engine.engine.describe()  # fixed for the engine's life

    @app.get("/v1/engine")
    async def engine_description():
        """The model, its sizes and every engine option as resolved (with why, where "auto"
        chose)."""
        return description

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": config.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "jaxinfer",
                    "max_model_len": serving.max_model_len,
                },
                *lora_models.cards(),
            ],
        }

    @app.get("/metrics")
    async def prometheus_metrics():
        if metrics is None:
            raise APIError(404, "metrics are off", "not_found_error")
        return fastapi.Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await serving.detokenize(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: fastapi.Request):
        client_id = request.headers.get("x-request-id")
        return await until_disconnect(request, serving.completions(body, client_id))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: fastapi.Request):
        client_id = request.headers.get("x-request-id")
        return await until_disconnect(request, serving.chat(body, client_id))

    anthropic = AnthropicServing(serving)
    responses = ResponsesServing(serving)
    embeddings = EmbeddingsServing(serving)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: fastapi.Request):
        """Anthropic's Messages API (jaxinfer.server.anthropic)."""
        return await until_disconnect(request, anthropic.messages(body))

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: fastapi.Request):
        """OpenAI's Responses API (jaxinfer.server.responses)."""
        return await until_disconnect(request, responses.create(body))

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: fastapi.Request):
        """Embeddings (jaxinfer.server.embeddings)."""
        return await until_disconnect(request, embeddings.create(body))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        """A stored response (404 once evicted, or when it was not stored)."""
        return responses.retrieve(response_id)

    return app


def engine_problem(engine: AsyncEngine, config: ServerConfig) -> str | None:
    """Why the engine cannot serve, or None."""
    if not engine.alive:
        return f"the engine loop has stopped ({engine.error!r})"
    seconds = engine.step_seconds()
    if seconds > config.engine_step_timeout:
        return f"an engine step has run for {seconds:.0f} s (limit {config.engine_step_timeout} s)"
    return None


async def _watch(
    engine: AsyncEngine, config: ServerConfig, on_engine_dead: Callable[[], None] | None
) -> None:
    """Declares a stalled engine dead (failing every request in flight) and reports a dead
    one, once."""
    interval = min(1.0, max(0.01, config.engine_step_timeout / 4))
    while True:
        await asyncio.sleep(interval)
        problem = engine_problem(engine, config)
        if problem is None:
            continue
        if engine.alive:  # stalled, not dead
            logger.error("%s: declaring the engine dead", problem)
            engine.declare_dead(EngineStalledError(problem))
        if on_engine_dead is not None:
            on_engine_dead()
        return


async def until_disconnect(request: fastapi.Request, work):
    """Runs an endpoint; if the client goes away first, cancels it (which ends its engine
    requests) and waits until it has ended. Streams are ended by the response itself."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        return fastapi.Response(status_code=499)
    return task.result()


async def _disconnected(request: fastapi.Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
