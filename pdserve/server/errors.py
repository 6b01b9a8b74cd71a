"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, with vLLM's type names."""

from __future__ import annotations

import json
from http import HTTPStatus

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


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


def error_body(message: str, status: int, param: str | None = None, err_type: str | None = None) -> dict:
    err_type = err_type or _TYPES.get(status) or "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.status, err.param, err.err_type), err.status, headers=headers)


def sse_error_frame(message: str, status: int = 500, param: str | None = None) -> str:
    """An error inside an SSE stream that already answered 200: one data frame, then [DONE]."""
    return f"data: {json.dumps(error_body(message, status, param))}\n\n"
