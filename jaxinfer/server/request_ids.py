"""Request ids: the engine's are the server's own (random, per admission); a client's
X-Request-Id only labels its response."""

from __future__ import annotations

import secrets
import uuid

from jaxinfer.server.errors import APIError

MAX_CLIENT_ID = 128


def engine_id() -> str:
    """A new admission's engine id: 128 random bits, never a client's choice. Under several
    processes process 0 makes it and the others replay it (jaxinfer.engine.lockstep)."""
    return secrets.token_hex(16)


def response_id(prefix: str, client_id: str | None) -> str:
    """The "id" of a response: the client's X-Request-Id when given (a label it chose: two
    clients may send the same one at once; the engine never sees it), else a fresh one."""
    if client_id is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not valid_client_id(client_id):
        raise APIError(400, f"X-Request-Id must be 1 to {MAX_CLIENT_ID} printable characters")
    return f"{prefix}-{client_id}"


def valid_client_id(client_id: str) -> bool:
    return 0 < len(client_id) <= MAX_CLIENT_ID and client_id.isprintable()
