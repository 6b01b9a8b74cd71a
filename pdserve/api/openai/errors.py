"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, with vLLM's type names."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from http import HTTPStatus

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    410: "GoneError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


RETRY_AFTER_S = "1"  # Retry-After of this server's 503s


class APIError(Exception):
    """Raised anywhere in a request's handling; becomes an OpenAI error response."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param)


def not_supported(field: str, detail: str = "") -> APIError:
    return APIError(f"{field} is not supported by this server{detail}.", 400, field)


def check_served_model(name: str | None, served_names: Sequence[str]) -> str:
    """The model name a response reports. An empty or missing name means the default (first) served model,
    as vLLM serves its one model; a name not served is a 404 that lists the served ones."""
    if not name:
        return served_names[0]
    if name in served_names:
        return name
    raise APIError(f"The model `{name}` does not exist. Served models: {', '.join(served_names)}.", 404, "model")


def error_body(message: str, status: int, param: str | None = None, err_type: str | None = None) -> dict:
    err_type = err_type or _TYPES.get(status) or "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.status, err.param, err.err_type), err.status, headers=headers)


def sse_error_frame(message: str, status: int = 500, param: str | None = None) -> str:
    """An error inside an SSE stream that already answered 200: one data frame, then [DONE]."""
    return f"data: {json.dumps(error_body(message, status, param))}\n\n"


def add_error_handlers(app: FastAPI, log: logging.Logger) -> None:
    """`APIError` -> its OpenAI error, an HTTP error keeps its status, anything else is a logged 500 (request
    validation errors are left to each app)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        # A 503 here is temporary (queue full, shutting down): say when to come back, which a proxy in front
        # honours by passing this instance over meanwhile.
        return error_response(exc, {"Retry-After": RETRY_AFTER_S} if exc.status == 503 else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"Internal server error: {exc}", 500), 500)
