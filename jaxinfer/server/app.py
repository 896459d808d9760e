"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

Every request runs as engine requests on the shared step loop; a malformed or unservable
request gets an OpenAI-style error (400, 404) and touches nothing else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import importlib.metadata
import json
import time
import uuid
from collections.abc import AsyncIterator

import fastapi
import pydantic
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2.exceptions import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST

from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

VERSION = importlib.metadata.version("jaxinfer")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Args:
    served_model_name: the model id clients name (and /v1/models lists).
    api_key: when set, /v1, /tokenize and /detokenize need `Authorization: Bearer <key>`.
    max_queued_requests: unfinished requests beyond which new ones get 503.
    max_body_bytes: larger request bodies get 413.
    allow_request_chat_template: accept a `chat_template` in chat requests (rendered in the
        sandboxed jinja2 environment); refused otherwise.
    """

    served_model_name: str
    api_key: str | None = None
    max_queued_requests: int | None = None
    max_body_bytes: int = 4 << 20
    allow_request_chat_template: bool = False


class _Guard:
    """ASGI middleware: the body-size limit (413) and the API key (401), before any parsing."""

    PROTECTED = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app, config: ServerConfig):
        self.app = app
        self.config = config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.config.api_key is not None and scope["path"].startswith(self.PROTECTED):
            given = headers.get(b"authorization", b"").decode("latin-1")
            expected = f"Bearer {self.config.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return await error_response(401, "invalid or missing API key", "auth_error")(
                    scope, receive, send
                )
        limit = self.config.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await error_response(413, f"body over {limit} bytes", "request_too_large")(
                scope, receive, send
            )
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await error_response(413, f"body over {limit} bytes", "request_too_large")(
                scope, receive, send
            )


class _BodyTooLarge(Exception):
    pass


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def build_app(
    engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics | None = None
) -> fastapi.FastAPI:
    app = fastapi.FastAPI(title="jaxinfer", version=VERSION)
    app.add_middleware(_Guard, config=config)
    api = _Api(engine, config)

    @app.exception_handler(APIError)
    async def _api_error(request, error: APIError):
        return error_response(error.status, error.message, error.kind)

    @app.exception_handler(fastapi.exceptions.RequestValidationError)
    async def _validation_error(request, error):
        return error_response(400, _describe(error.errors()), "invalid_request_error")

    @app.get("/health")
    async def health():
        if not engine.alive:
            return error_response(503, "the engine loop has stopped", "engine_dead")
        return fastapi.Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

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
                    "max_model_len": engine.engine.config.model.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    async def prometheus_metrics():
        if metrics is None:
            raise APIError(404, "metrics are off", "not_found_error")
        return fastapi.Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        api.check_model(body.model)
        try:
            tokens = body.token_ids(api.tokenizer)
        except (ValueError, TypeError, TemplateError) as error:
            raise APIError(400, str(error)) from None
        return {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": engine.engine.config.model.max_model_len,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        api.check_model(body.model)
        vocab = engine.engine.config.model.arch.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})")
        return {"prompt": api.tokenizer.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: fastapi.Request):
        return await api.until_disconnect(request, api.completions(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: fastapi.Request):
        return await api.until_disconnect(request, api.chat(body))

    return app


def _describe(errors: list[dict]) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}"
        for e in errors
    )


class _Api:
    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = engine.engine.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"model {model!r} not found", "not_found_error")

    async def until_disconnect(self, request: fastapi.Request, work):
        """Runs an endpoint; if the client goes away first, cancels it (which aborts its
        engine requests). Streams are cancelled by the response itself."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
            gone.cancel()
        if task.cancelled():
            return fastapi.Response(status_code=499)
        return task.result()

    # -- endpoints -------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest):
        self.check_model(body.model)
        try:
            params = body.sampling_params()
            prompts = body.prompts()
        except (ValueError, TypeError, pydantic.ValidationError, TemplateError) as error:
            raise APIError(400, str(error)) from None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._start(request_id, [(p, True) for p in prompts], params)
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._completion_chunks(
                request_id, created, streams, params, include_usage, len(prompts)
            )
            return StreamingResponse(_sse(chunks), media_type="text/event-stream")
        finals = await _collect_or_500(streams)
        choices = [
            self._completion_choice(p * params.n + c.index, c, params.logprobs is not None)
            for p, final in enumerate(finals)
            for c in final.outputs
        ]
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.config.served_model_name,
            "choices": choices,
            "usage": _usage(finals),
        }

    async def chat(self, body: ChatCompletionRequest):
        self.check_model(body.model)
        if body.chat_template is not None and not self.config.allow_request_chat_template:
            raise APIError(400, "chat_template in a request is not allowed on this server")
        try:
            text = self.tokenizer.apply_chat_template(
                body.conversation(),
                add_generation_prompt=body.add_generation_prompt,
                chat_template=body.chat_template,
            )
            prompt = self.tokenizer.encode(text, add_special_tokens=False)
            max_model_len = self.engine.engine.config.model.max_model_len
            params = body.sampling_params(max_model_len, len(prompt))
        except (ValueError, TypeError, pydantic.ValidationError, TemplateError) as error:
            raise APIError(400, str(error)) from None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._start(request_id, [(prompt, False)], params)
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._chat_chunks(request_id, created, streams[0], params, include_usage)
            return StreamingResponse(_sse(chunks), media_type="text/event-stream")
        (final,) = await _collect_or_500(streams)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": self._chat_logprobs(c.token_ids, c.logprobs)}
                if params.logprobs is not None
                else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in final.outputs
        ]
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.config.served_model_name,
            "choices": choices,
            "usage": _usage([final]),
        }

    # -- engine ----------------------------------------------------------------------------

    async def _start(self, request_id, prompts, params) -> list[RequestStream]:
        """Admits every prompt (all or none) and returns their output streams."""
        limit = self.config.max_queued_requests
        if limit is not None and self.engine.num_unfinished + len(prompts) > limit:
            raise APIError(503, f"the server holds {limit} requests; retry later", "overloaded")
        token_lists = [
            self.tokenizer.encode(p, add_special_tokens) if isinstance(p, str) else p
            for p, add_special_tokens in prompts
        ]
        max_model_len = self.engine.engine.config.model.max_model_len
        for tokens in token_lists:
            if params.max_tokens is not None and len(tokens) + params.max_tokens > max_model_len:
                raise APIError(
                    400,
                    f"the prompt has {len(tokens)} tokens and max_tokens is {params.max_tokens}: "
                    f"more than max_model_len ({max_model_len})",
                )
        streams = []
        try:
            for index, tokens in enumerate(token_lists):
                streams.append(
                    await self.engine.add_request(f"{request_id}-{index}", tokens, params)
                )
        except ValueError as error:
            for stream in streams:
                await stream.aclose()
            raise APIError(400, str(error)) from None
        except EngineDeadError as error:
            raise APIError(503, str(error), "engine_dead") from None
        return streams

    # -- formatting ------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(self, token_ids, logprobs) -> dict:
        return {
            "tokens": [self._token_text(t) for t in token_ids],
            "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs, strict=True)],
            "top_logprobs": [{self._token_text(k): v for k, v in lp.items()} for lp in logprobs],
        }

    def _chat_logprobs(self, token_ids, logprobs) -> list[dict]:
        def entry(token_id, value):
            text = self._token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return [
            {
                **entry(t, lp[t]),
                "top_logprobs": [entry(k, v) for k, v in sorted(lp.items(), key=lambda kv: -kv[1])],
            }
            for t, lp in zip(token_ids, logprobs, strict=True)
        ]

    def _completion_choice(self, index: int, c: CompletionOutput, with_logprobs: bool) -> dict:
        return {
            "index": index,
            "text": c.text,
            "logprobs": self._completion_logprobs(c.token_ids, c.logprobs)
            if with_logprobs
            else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    async def _completion_chunks(self, request_id, created, streams, params, usage, num):
        deltas = _Deltas(params)
        finals: list[RequestOutput | None] = [None] * num
        async for prompt_index, output in _merge(streams):
            finals[prompt_index] = output
            for c in output.outputs:
                text, token_ids, logprobs = deltas.take((prompt_index, c.index), c)
                if not text and c.finish_reason is None:
                    continue
                yield {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": self.config.served_model_name,
                    "choices": [
                        {
                            "index": prompt_index * params.n + c.index,
                            "text": text,
                            "logprobs": self._completion_logprobs(token_ids, logprobs)
                            if params.logprobs is not None
                            else None,
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                    ],
                }
        if usage:
            yield {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": self.config.served_model_name,
                "choices": [],
                "usage": _usage(finals),
            }

    async def _chat_chunks(self, request_id, created, stream, params, usage):
        def chunk(choices, **extra):
            return {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.config.served_model_name,
                "choices": choices,
                **extra,
            }

        yield chunk(
            [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for i in range(params.n)
            ]
        )
        deltas = _Deltas(params)
        final = None
        async for output in stream:
            final = output
            for c in output.outputs:
                text, token_ids, logprobs = deltas.take(c.index, c)
                if not text and c.finish_reason is None:
                    continue
                yield chunk(
                    [
                        {
                            "index": c.index,
                            "delta": {"content": text} if text else {},
                            "logprobs": {"content": self._chat_logprobs(token_ids, logprobs)}
                            if params.logprobs is not None
                            else None,
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                    ]
                )
        if usage:
            yield chunk([], usage=_usage([final]))


class _Deltas:
    """What each choice has not yet streamed. While a choice runs, the last characters that
    could still begin a stop string are held back, so streamed text never includes text the
    final answer trims."""

    def __init__(self, params):
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.sent: dict = {}  # key -> (characters, tokens)

    def take(self, key, c: CompletionOutput):
        chars, tokens = self.sent.get(key, (0, 0))
        end = len(c.text) if c.finish_reason is not None else max(len(c.text) - self.hold, chars)
        new_tokens = len(c.token_ids)
        self.sent[key] = (end, new_tokens)
        logprobs = c.logprobs[tokens:new_tokens] if c.logprobs is not None else None
        return c.text[chars:end], c.token_ids[tokens:new_tokens], logprobs


def _usage(finals) -> dict:
    prompt = sum(len(f.prompt_token_ids) for f in finals if f is not None)
    completion = sum(len(c.token_ids) for f in finals if f is not None for c in f.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _disconnected(request: fastapi.Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_or_500(streams) -> list[RequestOutput]:
    try:
        return await _collect(streams)
    except EngineDeadError as error:
        raise APIError(500, str(error), "engine_error") from None


async def _collect(streams) -> list[RequestOutput]:
    async def last(stream):
        final = None
        async for output in stream:
            final = output
        return final

    return list(await asyncio.gather(*(last(s) for s in streams)))


async def _merge(streams):
    """(stream index, output) from every stream as they come."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index, stream):
        try:
            async for output in stream:
                await queue.put((index, output))
        except EngineDeadError as error:
            await queue.put((index, error))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
                continue
            if isinstance(item, EngineDeadError):
                raise item
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _sse(chunks) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except EngineDeadError as error:
        yield f"data: {json.dumps({'error': {'message': str(error), 'type': 'engine_dead'}})}\n\n"
    yield "data: [DONE]\n\n"
