"""ASGI middleware in front of everything: the Host check, the API key and the body limit,
each decided before any handler runs or any body is parsed."""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress

from jaxinfer.server.errors import error_response

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclasses.dataclass(frozen=True)
class HostPolicy:
    """Which Host headers the server answers: a DNS-rebinding page on another site reaches a
    server on 127.0.0.1 only under its own host name, which is refused.

    Args:
        names: host names (or addresses) allowed, lower case, without ports.
        any_address: also allow any IP address (a server bound to all interfaces, reached
            by address; rebinding needs a name).
    """

    names: frozenset[str]
    any_address: bool = False

    @classmethod
    def for_server(cls, bind_host: str, allowed: list[str] | None) -> HostPolicy | None:
        """The policy of a server bound to bind_host: `allowed` names (["*"]: any host, no
        check), or by default the loopback names, the bound address, and any address when
        bound to all interfaces."""
        if allowed and "*" in allowed:
            return None
        names = {name.lower().strip("[]") for name in allowed or ()}
        names.update(LOOPBACK_NAMES)
        names.add(bind_host.lower().strip("[]"))
        return cls(frozenset(names), any_address=bind_host in ("0.0.0.0", "::", ""))

    def allows(self, host_header: str | None) -> bool:
        if not host_header:
            return False
        host = host_header.strip().lower()
        if host.startswith("["):  # [v6]:port
            host = host[1 : host.find("]")] if "]" in host else host[1:]
        elif host.count(":") == 1:
            host = host.split(":", 1)[0]
        if host in self.names:
            return True
        if self.any_address:
            try:
                ipaddress.ip_address(host)
            except ValueError:
                return False
            return True
        return False


def check_api_key(key: str | None) -> None:
    """ValueError for a key no client could send as typed: HTTP header values are visible
    ASCII (the Bearer scheme's token68), and a key outside that would never match."""
    if key is not None and not (key and all("!" <= c <= "~" for c in key)):
        raise ValueError(
            "the API key must be visible ASCII characters, without spaces (what an HTTP "
            "header carries as typed)"
        )


class Guard:
    """Args:
    app: the ASGI app it guards.
    api_key: when set, paths under PROTECTED (the API and its description) need
        `Authorization: Bearer <key>` (or `x-api-key: <key>`, as Anthropic's clients send it).
    max_body_bytes: a larger body (declared or streamed in chunks) gets 413.
    host_policy: Host headers answered (None: any).
    """

    PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/openapi.json", "/docs", "/redoc")

    def __init__(
        self,
        app,
        api_key: str | None,
        max_body_bytes: int,
        host_policy: HostPolicy | None,
    ):
        self.app = app
        # Compared as bytes, as the header arrives (ServerConfig refuses keys that are not
        # visible ASCII, which no header could carry as typed).
        self.key = None if api_key is None else api_key.encode("ascii")
        self.max_body_bytes = max_body_bytes
        self.host_policy = host_policy

    def _keyed(self, headers: dict) -> bool:
        """The key as `Authorization: Bearer <key>` or (Anthropic's clients) `x-api-key`."""
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), b"Bearer " + self.key)
        return bearer | hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path = scope["path"]
        if self.host_policy is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            if not self.host_policy.allows(host):
                message = f"host {host!r} is not served here (see --allowed_hosts)"
                return await error_response(400, message, "invalid_request_error", path)(
                    scope, receive, send
                )
        if self.key is not None and path.startswith(self.PROTECTED) and not self._keyed(headers):
            return await error_response(401, "invalid or missing API key", "auth_error", path)(
                scope, receive, send
            )
        limit = self.max_body_bytes
        too_large = error_response(413, f"body over {limit} bytes", "request_too_large", path)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await too_large(scope, receive, send)
        # Read the whole body here (bounded), so a chunked body over the limit is a 413 too,
        # and hand it on as one message.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
