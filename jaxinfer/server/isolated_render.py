"""A request's own chat template, rendered in a child process that is bounded for real.

At most `max_children` children live at once: a slot is taken before a child starts and given
back only once it has exited and been reaped, whether it answered, failed, ran out of time
(killed), or its request was cancelled (its client left: killed at once). What is read back
is bounded too: the rendered text up to the server's limit, an error up to about 1 KB. A
child starts with an empty environment, in a session of its own (its whole process group is
killed), and limits itself (jaxinfer.chat_template).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

from jaxinfer.chat_template import ERROR_CHARS, FAILED, OK

_COMMAND = (sys.executable, "-I", "-m", "jaxinfer.chat_template")
_ERROR_BYTES = 4 * ERROR_CHARS + 64  # what is read of a failed render's message


class IsolatedRenderer:
    """Args:
    timeout: seconds a child may take (its start included) before it is killed.
    max_chars: the longest text a template may produce.
    max_children: children alive at once; more renders wait for a slot.
    """

    def __init__(self, timeout: float, max_chars: int, max_children: int = 2):
        self.timeout = timeout
        self.max_chars = max_chars
        self._slots = asyncio.Semaphore(max_children)
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_children, thread_name_prefix="template-child"
        )

    async def render(self, source: str, variables: dict) -> str:
        """The template's text; ValueError if it fails, runs past the timeout, exceeds the
        child's limits or produces more than max_chars. Cancelled, it kills the child and
        returns (re-raising the cancel) once the child has exited."""
        request = json.dumps(
            {
                "template": source,
                "variables": variables,
                "max_chars": self.max_chars,
                "cpu_seconds": self.timeout + 1,
            }
        ).encode()
        async with self._slots:
            child = _Child(request, self.timeout, 1 + 4 * self.max_chars)
            done = asyncio.get_running_loop().run_in_executor(self._threads, child.run)
            try:
                return await asyncio.shield(done)
            except asyncio.CancelledError:
                child.kill()
                while not done.done():  # the slot is free only once the child is gone
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait({done})
                if not done.cancelled():
                    done.exception()  # (retrieved: nobody waits for it now)
                raise


class _Child:
    """One render: start the child, feed it, read its answer (bounded), reap it."""

    def __init__(self, request: bytes, timeout: float, max_bytes: int):
        self._request = request
        self._timeout = timeout
        self._max_bytes = max_bytes
        self._lock = threading.Lock()  # guards _process, _killed and _reaped
        self._process: subprocess.Popen | None = None
        self._killed = False
        self._reaped = False

    def kill(self) -> None:
        """Kills the child's process group (from any thread; idempotent)."""
        with self._lock:
            self._killed = True
            if self._process is not None and not self._reaped:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._process.pid, signal.SIGKILL)

    def run(self) -> str:
        deadline = time.monotonic() + self._timeout
        with self._lock:
            if self._killed:
                raise ValueError("the render was cancelled")
            self._process = subprocess.Popen(
                _COMMAND,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env={},
                start_new_session=True,
            )
        try:
            answer = self._exchange(deadline)
        finally:
            self.kill()  # (an exited child's group may still hold a grandchild)
            self._process.wait()
            with self._lock:
                self._reaped = True
            self._process.stdin.close()
            self._process.stdout.close()
        return _decode(answer)

    def _exchange(self, deadline: float) -> bytes:
        """Writes the request, reads the answer until the child closes its stdout; ValueError
        past the deadline or the size bound."""
        stdin, stdout = self._process.stdin.fileno(), self._process.stdout.fileno()
        os.set_blocking(stdin, False)
        os.set_blocking(stdout, False)
        pending = memoryview(self._request)
        chunks, size, limit = [], 0, self._max_bytes
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            selector.register(stdin, selectors.EVENT_WRITE)
            writing = True
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ValueError(f"the chat template did not render within {self._timeout} s")
                for key, _ in selector.select(left):
                    if key.fd == stdin:
                        try:
                            pending = pending[os.write(stdin, pending[: 1 << 16]) :]
                        except BrokenPipeError:  # the child died: its answer says why
                            pending = pending[:0]
                        if not pending and writing:
                            selector.unregister(stdin)
                            self._process.stdin.close()
                            writing = False
                        continue
                    chunk = os.read(stdout, 1 << 16)
                    if not chunk:
                        return b"".join(chunks)
                    chunks.append(chunk)
                    size += len(chunk)
                    if chunks[0][:1] == FAILED:
                        limit = 1 + _ERROR_BYTES
                    if size > limit:
                        if chunks[0][:1] == FAILED:
                            return b"".join(chunks)[:limit]
                        raise ValueError(
                            "the chat template produced more than "
                            f"{(self._max_bytes - 1) // 4} characters"
                        )


def _decode(answer: bytes) -> str:
    status, body = answer[:1], answer[1:]
    if status == OK:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("the chat template produced text that is not valid UTF-8") from None
        return text
    if status == FAILED:
        message = body.decode("utf-8", "replace")[:ERROR_CHARS]
        raise ValueError(f"the chat template failed: {message}")
    raise ValueError("the chat template's renderer ended without a result (out of memory?)")
