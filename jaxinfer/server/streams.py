"""Reading a request's engine streams: the final outputs (non-streamed answers) or every
output as it comes, merged over the streams of its prompts and samples; what an HTTP request
holds (Held) and the streamed response that releases it however it ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from jaxinfer.outputs import RequestOutput
from jaxinfer.server.admission import Ticket
from jaxinfer.server.async_engine import EngineDeadError, RequestStream
from jaxinfer.server.errors import APIError
from jaxinfer.server.formatting import sse


async def finals(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream (FINAL_ONLY requests report only that one)."""
    try:
        return list(await asyncio.gather(*(anext(stream) for stream in streams)))
    except EngineDeadError as error:
        raise APIError(503, str(error), "engine_dead") from None


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from every stream as they come."""
    # Bounded: while the reader is slow, each request's outputs wait merged in its channel.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(index, stream):
        try:
            async for output in stream:
                await queue.put((index, output))
            await queue.put((index, done))
        except EngineDeadError as error:
            await queue.put((index, error))

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


class EngineStreamingResponse(StreamingResponse):
    """Server-sent events whose engine requests end with the response, however it ends:
    finished, failed, or abandoned by a client that stopped reading."""

    def __init__(
        self,
        chunks: AsyncIterator[dict],
        on_close: Callable[[], None],
        encode: Callable[[AsyncIterator[dict]], AsyncIterator[str]] = sse,
    ):
        """`encode`: the chunks as server-sent events (OpenAI's by default)."""
        super().__init__(encode(chunks), media_type="text/event-stream")
        self._chunks = chunks
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            for generator in (self.body_iterator, self._chunks):
                # (RuntimeError: still running in its own task, which ends it)
                with contextlib.suppress(RuntimeError):
                    await generator.aclose()


class Held:
    """What one HTTP request holds: its ticket and its engine streams."""

    def __init__(self, ticket: Ticket):
        self.ticket = ticket
        self.streams: list[RequestStream] = []

    def release(self) -> None:
        for stream in self.streams:
            stream.close()
        self.ticket.release()


async def answer(engine, start, events, encode, build):
    """The response of a started single-choice chat request (OpenAIServing.start_chat) in
    another API's shape: `events` (an async iterator, or None) streamed through `encode`, else
    the final output made a response by `build(final)` on the AsyncEngine `engine`'s worker
    thread. What the request holds is released however the response ends."""
    held = start.held
    try:
        if events is not None:
            response, held = EngineStreamingResponse(events, held.release, encode), None
            return response
        (final,) = await finals(start.held.streams)
        return await engine.run_in_worker(build, final)
    finally:
        if held is not None:
            held.release()
