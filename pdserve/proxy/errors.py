"""OpenAI-shaped error bodies, as JSON responses and as SSE events."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

SSE_DONE = b"data: [DONE]\n\n"


def error_payload(message: str, err_type: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(
    status: int,
    message: str,
    err_type: str,
    *,
    request_id: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    out_headers = {"Content-Type": "application/json"}
    if request_id:
        out_headers["X-Request-Id"] = request_id
    if headers:
        out_headers.update(headers)
    body = json.dumps(error_payload(message, err_type, status)).encode()
    return web.Response(status=status, body=body, headers=out_headers)


def sse_error_event(message: str, err_type: str, status: int) -> bytes:
    """One SSE event carrying an error, the way vLLM ends a stream that failed (then `[DONE]`)."""
    return b"data: " + json.dumps(error_payload(message, err_type, status)).encode() + b"\n\n"


def is_openai_error_body(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict | str)
