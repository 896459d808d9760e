"""ASGI middleware that adds what every response carries: `X-Content-Type-Options: nosniff`,
and the client's own `X-Request-Id` echoed back (a label: the engine never sees it)."""

from __future__ import annotations

from jaxinfer.server.request_ids import valid_client_id


class ResponseHeaders:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        extra = [(b"x-content-type-options", b"nosniff")]
        for name, value in scope.get("headers") or ():
            if name == b"x-request-id":
                label = value.decode("latin-1")
                if valid_client_id(label) and label.isascii():
                    extra.append((b"x-request-id", value))
                break

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
