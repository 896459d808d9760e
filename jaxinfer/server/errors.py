"""OpenAI's error shape for every error the server answers, and the handlers that make it so.

`{"error": {"message", "type", "param", "code"}}`: 400 for an invalid request (body parse and
validation errors included), 401 without the API key, 404 for an unknown model or route, 405,
413 for a body over the limit, 503 when the server is full or the engine has stopped.
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


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind), status_code=status)


_KINDS = {401: "auth_error", 404: "not_found_error", 405: "invalid_request_error"}


def install_error_handlers(app: fastapi.FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request, error: APIError):
        return error_response(error.status, error.message, error.kind)

    @app.exception_handler(fastapi.exceptions.RequestValidationError)
    async def _validation_error(request, error):
        return error_response(400, describe(error.errors()), "invalid_request_error")

    @app.exception_handler(HTTPException)
    async def _http_error(request, error: HTTPException):
        kind = _KINDS.get(error.status_code, "invalid_request_error")
        return JSONResponse(
            error_body(error.status_code, str(error.detail), kind),
            status_code=error.status_code,
            headers=error.headers,
        )


def describe(errors) -> str:
    """pydantic's validation errors as one line."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}"
        for e in errors
    )
