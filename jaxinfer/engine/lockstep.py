"""One schedule for every process of a job: process 0 leads, the others follow.

Every process holds a whole engine (scheduler, KV block tables, request state) and runs each
step's program on its own shards of the mesh. The engines stay identical because they see the
same calls in the same order: process 0's `Leader` records each call that changes the engine
(a request admitted, with the id process 0 gave it; an abort; a prefix-cache reset) and sends
the calls made since the last step, with that step, over a control channel
(jaxinfer.parallel.channel: a TCP connection from each follower to process 0, both sides
proving a key broadcast at start-up; plain frames, lockstep_messages). `follow` replays them
on the other processes. What the server or a batch run would otherwise decide per process is
so decided once, on process 0: admission order (the order of the calls), the requests' ids
(the server's own) and so the seeds of unseeded requests (derived from the ids and the seed
root process 0 broadcasts, jaxinfer.parallel.distributed.seed_root), client disconnects
(aborts), and which lines of a resumed batch still run (only process 0 reads the files).

Failure: a follower that dies closes its connection; process 0's watcher reports it to
`on_failure` (the server declares its engine dead: in-flight requests fail, /health is 503),
and a step in flight fails too, its collectives finding the peer gone. A follower whose
leader goes away (its connection closes) stops with an error. `Leader.close` stops the
followers cleanly.

EngineOptions.check_schedule compares each step's schedule across processes before it runs
(jaxinfer.engine.schedule_check).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.schedule_check import DistributedError
from jaxinfer.parallel.channel import (
    KEY_BYTES,
    Channel,
    ChannelError,
    ControlListener,
    connect_to_leader,
    facing_address,
    new_key,
)
from jaxinfer.parallel.distributed import DistributedConfig, broadcast_from_leader
from jaxinfer.parallel.lockstep_messages import (
    AbortRequest,
    AddRequest,
    FollowerFailed,
    Message,
    ResetPrefixCache,
    Step,
    Stop,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

JOIN_SECONDS = 300.0  # for every follower to connect once process 0 listens


# -- the control channel ---------------------------------------------------------------------


def open_channel(config: DistributedConfig) -> list[Channel] | Channel:
    """Process 0: a channel to each follower (in process order). Other processes: their
    channel to process 0. Every process calls this once, after jax.distributed joined them
    (it broadcasts process 0's port and a fresh key; jaxinfer.parallel.channel)."""
    leader = jax.process_index() == 0
    announced = np.zeros(1 + KEY_BYTES, np.int32)
    listener = None
    if leader:
        key = new_key()
        listener = ControlListener(control_bind_host(config), key, jax.process_count() - 1)
        announced[0] = listener.port
        announced[1:] = np.frombuffer(key, np.uint8)
    announced = broadcast_from_leader(announced)
    if not leader:
        port, key = int(announced[0]), announced[1:].astype(np.uint8).tobytes()
        try:
            return connect_to_leader(config.control_connect_host, port, key, jax.process_index())
        except (OSError, EOFError) as error:
            raise DistributedError(f"could not join process 0's control channel: {error}") from None
    try:
        return listener.accept_followers(JOIN_SECONDS)
    except ChannelError as error:
        raise DistributedError(str(error)) from None


def control_bind_host(config: DistributedConfig) -> str:
    """Where process 0 listens: DistributedConfig.control_host, or the local address of the
    interface its coordinator address routes over (its address family too)."""
    if config.control_host is not None:
        return config.control_host
    return facing_address(config.coordinator_host, config.coordinator_port)[1]


def send(channel: Channel, message: Message) -> None:
    channel.send(*encode(message))


def receive(channel: Channel) -> Message:
    """The next message; EOFError once the peer has gone, ValueError for a malformed one."""
    return decode(*channel.recv())


# -- process 0 -------------------------------------------------------------------------------


class Leader:
    """Process 0's engine: the LLMEngine API (what it does not define passes through to the
    engine), with every call that changes the engine recorded and sent to the followers with
    the next step.

    Args:
        engine: this process's engine.
        followers: the channels open_channel returned.
    """

    def __init__(self, engine: LLMEngine, followers: list[Channel]):
        self.engine = engine
        self._followers = followers
        self._calls: list = []
        self._send_lock = threading.Lock()
        self._closed = False
        self.failure: DistributedError | None = None
        self._on_failure: Callable[[DistributedError], None] | None = None
        self._watchers = [
            threading.Thread(
                target=self._watch,
                args=(index + 1, connection),
                name=f"follower-{index + 1}",
                daemon=True,
            )
            for index, connection in enumerate(followers)
        ]
        for watcher in self._watchers:
            watcher.start()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def set_on_failure(self, on_failure: Callable[[DistributedError], None]) -> None:
        """on_failure(error) is called (on a watcher thread) when a follower fails or leaves
        (at once if one already has); a step in flight meanwhile fails on its own."""
        self._on_failure = on_failure
        if self.failure is not None:
            on_failure(self.failure)

    # The calls that change the engine. (add_request is the engine's own, over the
    # add_prepared below.)

    add_request = LLMEngine.add_request

    def add_prepared(self, prepared, request_id=None, priority=0, cache_salt=None):
        added = self.engine.add_prepared(prepared, request_id, priority, cache_salt)
        call = AddRequest(
            tuple(prepared.prompt_token_ids),
            prepared.params,
            added.request_id,
            priority,
            cache_salt,
        )
        self._calls.append(call)
        return added

    def abort_request(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._calls.append(AbortRequest(request_id))

    def reset_prefix_cache(self) -> bool:
        reset = self.engine.reset_prefix_cache()
        if reset:
            self._calls.append(ResetPrefixCache())
        return reset

    def step(self):
        if self.failure is not None:
            raise self.failure
        calls, self._calls = tuple(self._calls), []
        self._send(Step(calls))
        return self.engine.step()

    def close(self, timeout: float = 60.0) -> None:
        """Stops the followers and waits (up to `timeout` seconds) until each has left the job
        (JAX's coordination service, which lives in this process, must outlast their
        shutdown); idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(DistributedError):  # a follower gone has nothing to stop
            self._send(Stop())
        deadline = time.monotonic() + timeout
        for watcher in self._watchers:  # each returns when its follower closes the connection
            watcher.join(max(0.0, deadline - time.monotonic()))
        for connection in self._followers:
            connection.close()

    def _send(self, message) -> None:
        with self._send_lock:
            for index, connection in enumerate(self._followers):
                try:
                    send(connection, message)
                except OSError as error:
                    raise self._failed(index + 1, f"its connection broke ({error})") from None

    def _watch(self, process_id: int, connection: Channel) -> None:
        """A follower only ever sends FollowerFailed; its connection closing means it exited."""
        try:
            message = receive(connection)
            reason = message.error if isinstance(message, FollowerFailed) else repr(message)
        except ValueError as error:
            reason = f"it sent a malformed message ({error})"
        except (EOFError, OSError):
            if self._closed:
                return
            reason = "it exited"
        self._failed(process_id, reason)

    def _failed(self, process_id: int, reason: str) -> DistributedError:
        error = DistributedError(f"process {process_id} of the job failed: {reason}")
        if self.failure is None and not self._closed:
            self.failure = error
            logger.error("%s", error)
            if self._on_failure is not None:
                self._on_failure(error)
        return self.failure or error


# -- the other processes ---------------------------------------------------------------------


def follow(engine: LLMEngine, leader: Channel) -> None:
    """Replays process 0's calls and steps on this process's engine until process 0 says stop
    (returns; the caller closes the connection once it has left the job) or goes away
    (DistributedError). An error here is sent to process 0 first, and closes the connection."""
    process_id = jax.process_index()
    try:
        while True:
            try:
                message = receive(leader)
            except (EOFError, OSError):
                raise DistributedError("process 0 went away without stopping the job") from None
            if not isinstance(message, Step | Stop):
                raise DistributedError(f"process 0 sent {message!r}")
            if isinstance(message, Stop):
                return
            for call in message.calls:
                apply_call(engine, call)
            engine.step()
    except BaseException as error:
        with contextlib.suppress(OSError):
            send(leader, FollowerFailed(process_id, f"{type(error).__name__}: {error}"))
        leader.close()
        raise


def apply_call(engine: LLMEngine, call) -> None:
    if isinstance(call, AddRequest):
        prepared = engine.prepare_request(list(call.prompt_token_ids), call.params)
        engine.add_prepared(prepared, call.request_id, call.priority, call.cache_salt)
    elif isinstance(call, AbortRequest):
        engine.abort_request(call.request_id)
    elif isinstance(call, ResetPrefixCache):
        engine.reset_prefix_cache()
    else:
        raise TypeError(f"unknown call {call!r}")


def lead_or_follow(engine: LLMEngine, config: DistributedConfig) -> LLMEngine | Leader | None:
    """What an entry point drives: the engine itself in a job of one process; process 0's
    Leader in a job of several; None on the other processes, once they have followed process
    0 until it stopped the job (a DistributedError if it failed or went away)."""
    if jax.process_count() == 1:
        return engine
    channel = open_channel(config)
    if jax.process_index() == 0:
        return Leader(engine, channel)
    logger.info("process %d follows process 0's schedule", jax.process_index())
    follow(engine, channel)
    logger.info("process 0 stopped the job")
    jax.distributed.shutdown()  # before process 0, whose coordination service it leaves
    channel.close()  # tells process 0 this one has left
    return None
