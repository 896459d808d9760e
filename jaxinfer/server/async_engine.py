"""The engine's step loop on its own thread, fed from the server's event loop.

Requests are prepared (tokenized, grammars compiled, checked) on worker threads, so the step
loop only admits them. The loop blocks on its command queue while idle (no polling sleep) and,
while requests run, takes new commands between steps, so every concurrent stream shares each
step. Outputs cross to the event loop with call_soon_threadsafe into one OutputChannel per
request, which keeps only what its reader has not taken.

Whatever happens to one request (a client that leaves at any point, a bad admission) ends only
that request. If the loop itself dies, or is declared dead because a step stalls, every
request in flight and every command still queued ends with EngineDeadError; `alive` turns
False and stays so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from jaxinfer.engine.input_processor import PreparedRequest
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.lora_request import LoRARequest
from jaxinfer.outputs import RequestOutput, merge_deltas
from jaxinfer.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class OutputChannel:
    """The outputs of one request that its reader has not taken yet, on the event loop.

    DELTA outputs accumulate until taken (then merged into one); a newer cumulative or final
    output replaces an older one. So a slow reader costs at most the request's own output in
    memory, never one copy per step.
    """

    def __init__(self, kind: RequestOutputKind):
        self._kind = kind
        self._pending: list[RequestOutput] = []
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self._kind is not RequestOutputKind.DELTA:
            self._pending.clear()
        self._pending.append(output)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        if self._pending:
            pending, self._pending = self._pending, []
            if self._error is None:
                self._ready.clear()
            return merge_deltas(pending) if len(pending) > 1 else pending[0]
        raise EngineDeadError(f"the engine loop failed: {self._error!r}") from self._error


@dataclasses.dataclass
class _Add:
    request_id: str
    prepared: PreparedRequest
    channel: OutputChannel
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future  # resolved on `loop`: None, or the error that refused it


@dataclasses.dataclass
class _Abort:
    """Ends the admission whose channel is `channel` (if it is still running): an abort acts on
    the admission it belongs to, never on whatever else holds the id by then."""

    request_id: str
    channel: OutputChannel


def _deliver(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """Runs callback(*args) on `loop`; a loop that has closed meanwhile is no one's concern."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # its awaiter was cancelled: it aborts the request itself
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class AsyncEngine:
    """Args:
    engine: the engine, driven from now on by this object's thread only.
    on_finished: called on the engine thread with each finished request's last output.
    grammar_timeout: seconds a structured-output grammar may take to compile (queueing
        included) before its request is refused.
    prepare_workers: threads that prepare requests (tokenizing releases the GIL).
    """

    def __init__(
        self,
        engine: LLMEngine,
        on_finished: Callable[[RequestOutput], None] | None = None,
        grammar_timeout: float = 10.0,
        prepare_workers: int = 2,
    ):
        self.engine = engine
        self._on_finished = on_finished
        self.grammar_timeout = grammar_timeout
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards error, _channels and putting commands
        self._channels: dict[str, tuple[OutputChannel, asyncio.AbstractEventLoop]] = {}
        self.error: BaseException | None = None
        self._step_started: float | None = None  # time.monotonic() of the running step
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(
            prepare_workers, thread_name_prefix="prepare"
        )
        # One thread: a flood of heavy grammars takes one core, not all of them.
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_unfinished(self) -> int:
        return len(self._channels)

    def step_seconds(self) -> float:
        """How long the step now running has run (0 between steps)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    # -- the event loop's side -------------------------------------------------------------

    async def run_in_worker(self, function, *args):
        """function(*args) on a preparation thread (work too big for the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, function, *args)

    async def prepare(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> PreparedRequest:
        """LLMEngine.prepare_request on a worker thread; its grammar, if any, compiled first
        within grammar_timeout (a ValueError beyond)."""
        if self.error is not None:
            raise EngineDeadError("the engine loop has stopped")
        if params.structured_outputs is not None:
            compiling = asyncio.get_running_loop().run_in_executor(
                self._grammar_pool,
                self.engine.input_processor.compile_grammar,
                params.structured_outputs,
            )
            try:
                await asyncio.wait_for(compiling, self.grammar_timeout)
            except TimeoutError:
                raise ValueError(
                    f"the structured-output spec did not compile within {self.grammar_timeout} s"
                ) from None
        return await self.run_in_worker(
            self.engine.prepare_request, prompt, params, add_special_tokens, lora_request
        )

    async def add(self, request_id: str, prepared: PreparedRequest) -> RequestStream:
        """Admits a prepared request on the engine thread (its ValueError if it is refused
        there) and returns the stream of its outputs. Cancelled while waiting, it leaves
        nothing running.

        request_id: the engine's id for it, unique among the requests in flight (the server
        makes its own; a client's X-Request-Id only labels its response)."""
        loop = asyncio.get_running_loop()
        channel = OutputChannel(prepared.params.output_kind)
        admitted = loop.create_future()
        with self._lock:
            if self.error is not None:
                raise EngineDeadError("the engine loop has stopped")
            self._commands.put(_Add(request_id, prepared, channel, loop, admitted))
        try:
            await admitted
        except asyncio.CancelledError:
            self.abort(request_id, channel)  # queued after the _Add: ends it if admitted
            raise
        return RequestStream(request_id, channel, self)

    def abort(self, request_id: str, channel: OutputChannel) -> None:
        """Ends the admission of `request_id` that streams into `channel`, if it still runs."""
        self._commands.put(_Abort(request_id, channel))

    def declare_dead(self, error: BaseException) -> None:
        """Fails everything in flight and refuses what comes (a stalled step: the loop
        cannot be stopped, but nobody waits on it any more)."""
        self._die(error)

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while self.error is None:
                # Idle: block until something arrives; busy: take what is there and step.
                block = not engine.has_unfinished_requests()
                while True:
                    try:
                        command = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    self._handle(command)
                    block = False
                self._step_started = time.monotonic()
                outputs = engine.step()
                self._step_started = None
                for output in outputs:
                    self._publish(output)
        except BaseException as error:  # every request must hear of it
            logger.exception("the engine loop failed")
            self._die(error)

    def _publish(self, output: RequestOutput) -> None:
        with self._lock:
            if output.finished:
                entry = self._channels.pop(output.request_id, None)
            else:
                entry = self._channels.get(output.request_id)
        if entry is None:
            return  # aborted meanwhile
        channel, loop = entry
        _deliver(loop, channel.put, output)
        if output.finished and self._on_finished is not None:
            self._on_finished(output)

    def _handle(self, command: _Add | _Abort) -> None:
        engine = self.engine
        if isinstance(command, _Abort):
            with self._lock:
                entry = self._channels.get(command.request_id)
                if entry is None or entry[0] is not command.channel:
                    return  # finished, never admitted, or not this admission's
                del self._channels[command.request_id]
            engine.abort_request(command.request_id)
            return
        if command.admitted.done():  # cancelled before its turn: never admitted
            return
        try:
            engine.add_prepared(command.prepared, request_id=command.request_id)
        except Exception as error:  # refuses this request only
            if not isinstance(error, ValueError | TypeError):
                logger.exception("admitting request %s failed", command.request_id)
            _deliver(command.loop, _resolve, command.admitted, error)
            return
        with self._lock:
            dead = self.error is not None  # declared dead while this was admitted
            if not dead:
                self._channels[command.request_id] = (command.channel, command.loop)
        error = EngineDeadError(f"the engine loop failed: {self.error!r}") if dead else None
        _deliver(command.loop, _resolve, command.admitted, error)

    def _die(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            channels, self._channels = list(self._channels.values()), {}
            commands = []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        dead = EngineDeadError(f"the engine loop failed: {error!r}")
        for channel, loop in channels:
            _deliver(loop, channel.fail, error)
        for command in commands:
            if isinstance(command, _Add):
                _deliver(command.loop, _resolve, command.admitted, dead)


class RequestStream:
    """A request's outputs as the steps produce them; closing it early aborts the request."""

    def __init__(self, request_id: str, channel: OutputChannel, engine: AsyncEngine):
        self.request_id = request_id
        self._channel = channel
        self._engine = engine
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            output = await self._channel.get()
        except EngineDeadError:
            self.finished = True
            raise
        except BaseException:
            self.close()
            raise
        self.finished = output.finished
        return output

    def close(self) -> None:
        """Aborts the request unless it has finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id, self._channel)
