"""Chat templates rendered in jinja2's immutable sandbox, as transformers renders them.

A model's own template is trusted code over untrusted messages, so its cost follows the
(bounded) request. A template that a request brings (off unless the server allows it) is
untrusted code: it renders in a child process (`python -m jaxinfer.chat_template`, which
imports only jinja2; jaxinfer.server.isolated_render starts, bounds and kills it), under
limits it sets on itself before it reads the template: address space, CPU seconds, no new
processes, no files written, few descriptors.

This module must not import jax or the engine: the child process imports it.
"""

from __future__ import annotations

import json
import math
import resource
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


# The child's answer on stdout: one status byte, then UTF-8 text (the rendered prompt, or an
# error of at most ERROR_CHARS characters).
OK, FAILED = b"0", b"1"
ERROR_CHARS = 1000


def _limit(kind: int, value: int) -> None:
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def _render_one_request() -> None:
    """The child process: one JSON request on stdin ({"template", "variables", "max_chars",
    "cpu_seconds"}), its answer on stdout."""
    _limit(resource.RLIMIT_AS, CHILD_MEMORY_BYTES)
    _limit(resource.RLIMIT_NPROC, 0)  # (not enforced for root)
    _limit(resource.RLIMIT_FSIZE, 0)
    _limit(resource.RLIMIT_CORE, 0)
    request = json.loads(sys.stdin.buffer.read())
    _limit(resource.RLIMIT_CPU, max(1, math.ceil(request["cpu_seconds"])))
    _limit(resource.RLIMIT_NOFILE, 16)
    try:
        template = environment().from_string(request["template"])
        text = render_bounded(template, request["variables"], request["max_chars"])
        answer = OK + text.encode("utf-8")
    except BaseException as error:  # anything the template does is its own error
        message = str(error)
        answer = FAILED + f"{type(error).__name__}: {message[:ERROR_CHARS]}".encode(
            "utf-8", "replace"
        )
    sys.stdout.buffer.write(answer)
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    _render_one_request()
