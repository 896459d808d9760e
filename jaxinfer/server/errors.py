"""The error shapes of the server's APIs, and the handlers that make every error take its
API's: OpenAI's `{"error": {"message", "type", "param", "code"}}` everywhere but under
ANTHROPIC_PATHS, which get Anthropic's `{"type": "error", "error": {"type", "message"}}`.
400 for an invalid request (body parse and validation errors included), 401 without the API
key, 404 for an unknown model or route, 405, 413 for a body over the limit, 503 when the
server is full or the engine has stopped.
"""

from __future__ import annotations

import logging

import fastapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_body(status: int, message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    kind = _ANTHROPIC_KINDS.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(
    status: int, message: str, kind: str, path: str = "", headers: dict | None = None
) -> JSONResponse:
    """The error in the shape of the API `path` belongs to."""
    if path.startswith(ANTHROPIC_PATHS):
        body = anthropic_error_body(status, message)
    else:
        body = error_body(status, message, kind)
    return JSONResponse(body, status_code=status, headers=headers)


_KINDS = {401: "auth_error", 404: "not_found_error", 405: "invalid_request_error"}


def install_error_handlers(app: fastapi.FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request, error: APIError):
        return error_response(error.status, error.message, error.kind, request.url.path)

    @app.exception_handler(fastapi.exceptions.RequestValidationError)
    async def _validation_error(request, error):
        message = describe(error.errors())
        return error_response(400, message, "invalid_request_error", request.url.path)

    @app.exception_handler(HTTPException)
    async def _http_error(request, error: HTTPException):
        kind = _KINDS.get(error.status_code, "invalid_request_error")
        return error_response(
            error.status_code, str(error.detail), kind, request.url.path, error.headers
        )


def describe(errors) -> str:
    """pydantic's validation errors as one line."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}"
        for e in errors
    )
