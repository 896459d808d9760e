"""Reading a request's engine streams: the final outputs (non-streamed answers) or every
output as it comes, merged over the streams of its prompts and samples."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from jaxinfer.outputs import RequestOutput
from jaxinfer.server.async_engine import EngineDeadError, RequestStream
from jaxinfer.server.errors import APIError


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
