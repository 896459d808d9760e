"""Token buckets compiled on a background thread while the engine serves
(EngineOptions.warmup "background").

Before serving, warm-up compiles and runs only the smallest token bucket (a decode step of one
request) and the largest (any step fits it). The other buckets' programs are then compiled,
smallest first, on a thread of their own, without running them (warmup.compile_bucket): JAX
keeps what it compiled, so a later step of that bucket compiles nothing. Each bucket is
added to the batch builder's ready buckets once compiled; until then a step is padded to the
smallest ready bucket that holds it. Compilations on this thread are not counted as
compilations on a request's path (the server's compilations_after_warmup).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

from jaxinfer.engine.execution.batch_builder import BatchBuilder
from jaxinfer.engine.execution.model_runner import ModelRunner
from jaxinfer.engine.startup.warmup import compile_bucket, state_specs

logger = logging.getLogger(__name__)

THREAD_NAME = "jaxinfer-background-compile"


def first_buckets(buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The token buckets compiled before serving: the smallest and the largest."""
    return tuple(sorted({buckets[0], buckets[-1]}))


def on_background_thread() -> bool:
    """Whether the caller runs on a BackgroundCompiler's thread."""
    return threading.current_thread().name == THREAD_NAME


class BackgroundCompiler:
    """Compiles `buckets` in order on a thread, marking each ready in `builder` when done.
    The runner's state is read (as shapes) here, on the caller's thread."""

    def __init__(self, runner: ModelRunner, builder: BatchBuilder, buckets: tuple[int, ...]):
        self.buckets = buckets
        self.compiled: list[int] = []  # in the order they became ready
        self.seconds: float | None = None  # once every bucket is compiled
        self._specs = state_specs(runner)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(runner, builder), name=THREAD_NAME, daemon=True
        )
        # At exit, let the bucket being compiled finish (XLA compiling while the interpreter
        # tears down can crash it) and compile no more.
        atexit.register(_stop_at_exit, weakref.ref(self))
        self._thread.start()

    def _run(self, runner: ModelRunner, builder: BatchBuilder) -> None:
        start = time.perf_counter()
        for num_tokens in self.buckets:
            if self._stop.is_set():
                return
            try:
                compile_bucket(runner, builder, num_tokens, self._specs)
            except Exception:  # steps keep padding to the buckets compiled so far
                logger.exception("background compile of the %d-token bucket failed", num_tokens)
                return
            builder.add_ready_bucket(num_tokens)
            self.compiled.append(num_tokens)
        self.seconds = time.perf_counter() - start
        logger.info(
            "background compile: token buckets %s ready in %.1f s", self.buckets, self.seconds
        )

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for every bucket (or `timeout` seconds); whether they are all compiled."""
        self._thread.join(timeout)
        return len(self.compiled) == len(self.buckets)

    def stop(self) -> None:
        """Compiles no further bucket (the one under way finishes) and waits for the thread."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def _stop_at_exit(compiler: weakref.ref[BackgroundCompiler]) -> None:
    live = compiler()
    if live is not None:
        live.stop()
