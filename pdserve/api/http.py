"""HTTP plumbing: bounded JSON bodies, pydantic errors as 400s, disconnect watching, SSE (and the merging of several
streams into one), ids and auth."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.api.openai.errors import APIError, error_body

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

SSE_DONE = "data: [DONE]\n\n"
_AUTH_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


# The status a route answers once its client went away (nginx's convention; nobody reads it).
CLIENT_CLOSED = 499


async def read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(f"Request body too large: {length} bytes (limit {limit}).", 413)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(f"Request body too large (limit {limit} bytes).", 413)
            chunks.append(chunk)
    except ClientDisconnect as e:
        raise ClientGone() from e
    body = b"".join(chunks)
    if not body:
        raise APIError("The request body is empty; expected a JSON object.", 400)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise APIError(f"Invalid JSON in the request body: {e}", 400) from e
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object.", 400)
    return data


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """A readable message and the offending top-level field (OpenAI's `param`)."""
    first = err.errors(include_url=False)[0]
    parts = [str(p) for p in first.get("loc", ())]
    where = ".".join(parts) or "body"
    return f"{err.error_count()} validation error(s); {where}: {first.get('msg', 'invalid value')}", (
        parts[0] if parts else None
    )


def parse_model(cls: type[M], data: Any) -> M:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(message, 400, param) from e
    except (RecursionError, OverflowError) as e:
        raise APIError(f"Invalid request: {e}", 400) from e


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`; if the client disconnects first, cancels it and raises ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        raise
    if task.done():
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


def base_request_id(request: Request, body_request_id: str | None) -> str:
    """X-Request-Id, else the body's request_id, else a random id (vLLM's order); echoed in the response."""
    rid = request.headers.get("x-request-id") or body_request_id or uuid.uuid4().hex
    request.state.request_id = rid
    return rid


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of `streams` in the order they come (several choices or prompts answered in one stream), until
    every one has ended; the first error one raises is raised here. Close it (contextlib.aclosing) when stopping
    early: closing cancels the streams still running."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(e)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def header_safe(text: str) -> bytes:
    """`text` as an HTTP header value: visible ASCII and inner spaces only (a body's request_id may hold
    control characters or non-Latin text, which uvicorn refuses to send, dropping the connection)."""
    return "".join(c for c in text if " " <= c <= "~").strip().encode("ascii")


class RequestIdAuthMiddleware:
    """Pure ASGI (no buffering of streams): `--api-key` on the API prefixes, X-Request-Id echo."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        incoming = headers.get(b"x-request-id")
        if (
            self.expected is not None
            and scope.get("method") != "OPTIONS"
            and scope.get("path", "").startswith(_AUTH_PREFIXES)
            and headers.get(b"authorization") != self.expected
        ):
            body = json.dumps(error_body("Unauthorized", 401)).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        state = scope.setdefault("state", {})

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                rid = state.get("request_id")
                value = header_safe(rid) if isinstance(rid, str) else incoming
                if value:
                    message.setdefault("headers", [])
                    message["headers"] = [*message["headers"], (b"x-request-id", value)]
            await send(message)

        await self.app(scope, receive, send_with_id)
