"""The engine's step loop on its own thread, feeding per-request asyncio queues.

The loop blocks on its command queue while idle (no polling sleep) and, while requests run,
takes new commands between steps, so every concurrent stream shares each step. Outputs cross
to the event loop with call_soon_threadsafe. If the loop dies, every open stream gets the
error and `alive` turns False (the server's /health answers 503 then).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable

from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    add_special_tokens: bool
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    admitted: concurrent.futures.Future


@dataclasses.dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, on_finished: Callable[[RequestOutput], None] | None = None
    ):
        self.engine = engine
        self._on_finished = on_finished
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        add_special_tokens: bool = True,
    ) -> RequestStream:
        """Admits a request on the engine thread (ValueError if it could never be served) and
        returns the stream of its outputs."""
        if not self.alive:
            raise EngineDeadError("the engine loop has stopped")
        outputs: asyncio.Queue = asyncio.Queue()
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        loop = asyncio.get_running_loop()
        self._commands.put(
            _Add(request_id, prompt, params, add_special_tokens, outputs, loop, admitted)
        )
        await asyncio.wrap_future(admitted)
        return RequestStream(request_id, outputs, self)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                # Idle: block until something arrives; busy: take what is there and step.
                block = not engine.has_unfinished_requests()
                while True:
                    try:
                        command = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    self._handle(command)
                    block = False
                for output in engine.step():
                    stream = self._streams.get(output.request_id)
                    if stream is None:
                        continue
                    outputs, loop = stream
                    loop.call_soon_threadsafe(outputs.put_nowait, output)
                    if output.finished:
                        del self._streams[output.request_id]
                        if self._on_finished is not None:
                            self._on_finished(output)
        except BaseException as error:  # every stream must hear of it
            logger.exception("the engine loop failed")
            self.error = error
            for outputs, loop in self._streams.values():
                loop.call_soon_threadsafe(outputs.put_nowait, error)
            self._streams.clear()

    def _handle(self, command: _Add | _Abort) -> None:
        engine = self.engine
        if isinstance(command, _Abort):
            engine.abort_request(command.request_id)
            self._streams.pop(command.request_id, None)
            return
        try:
            engine.add_request(
                command.prompt,
                command.params,
                request_id=command.request_id,
                add_special_tokens=command.add_special_tokens,
            )
        except (ValueError, TypeError) as error:
            command.admitted.set_exception(error)
            return
        self._streams[command.request_id] = (command.outputs, command.loop)
        command.admitted.set_result(None)


class RequestStream:
    """A request's outputs as the steps produce them; closing it early aborts the request."""

    def __init__(self, request_id: str, outputs: asyncio.Queue, engine: AsyncEngine):
        self.request_id = request_id
        self._outputs = outputs
        self._engine = engine
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._outputs.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise EngineDeadError(f"the engine loop failed: {item!r}") from item
        self.finished = item.finished
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)
