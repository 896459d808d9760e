"""Chat templates rendered in jinja2's immutable sandbox, as transformers renders them.

A model's own template is trusted code over untrusted messages, so its cost follows the
(bounded) request. A template that a request brings (off unless the server allows it) is
untrusted code: `render_isolated` renders it in a child process (`python -m
jaxinfer.chat_template`, which imports only jinja2) with a wall-clock limit, an address-space
limit and a limit on the characters it may produce, so a template that loops, allocates or
escapes the sandbox costs at most that and never the server.

This module must not import jax or the engine: the child process imports it.
"""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import sys
from datetime import datetime

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHILD_MEMORY_BYTES = 1 << 30  # address space of a child render


def environment() -> ImmutableSandboxedEnvironment:
    """The sandbox chat templates render in, with the helpers HF templates use."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
    """As transformers renders chat templates: plain JSON, no HTML escaping."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def render_bounded(template, variables: dict, max_chars: int) -> str:
    """Renders piece by piece, refusing output beyond max_chars (ValueError)."""
    pieces, size = [], 0
    for piece in template.generate(**variables):
        size += len(piece)
        if size > max_chars:
            raise ValueError(f"the chat template produced more than {max_chars} characters")
        pieces.append(piece)
    return "".join(pieces)


async def render_isolated(source: str, variables: dict, *, timeout: float, max_chars: int) -> str:
    """Renders an untrusted template in a child process; ValueError if it fails, runs past
    `timeout` seconds, exceeds the memory limit or produces more than max_chars."""
    request = json.dumps({"template": source, "variables": variables, "max_chars": max_chars})
    # subprocess (a thread waits on it) rather than the event loop's own child processes:
    # uvloop forks with the interpreter's fork hooks, which JAX warns about.
    command = [sys.executable, "-I", "-m", "jaxinfer.chat_template"]
    try:
        finished = await asyncio.to_thread(
            subprocess.run,
            command,
            input=request.encode(),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(f"the chat template did not render within {timeout} s") from None
    try:
        status, value = json.loads(finished.stdout)
    except ValueError:
        raise ValueError(
            "the chat template's renderer ended without a result (out of memory?)"
        ) from None
    if status != "ok":
        raise ValueError(f"the chat template failed: {value}")
    return value


def _render_one_request() -> None:
    """The child process: one JSON request on stdin, ["ok" | "error", text] on stdout."""
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
    try:
        request = json.loads(sys.stdin.buffer.read())
        template = environment().from_string(request["template"])
        result = ["ok", render_bounded(template, request["variables"], request["max_chars"])]
    except BaseException as error:  # anything the template does is its own error
        result = ["error", f"{type(error).__name__}: {error}"]
    sys.stdout.write(json.dumps(result))


if __name__ == "__main__":
    _render_one_request()
