"""HTTP client for tokens-only engines (`/inference/v1/generate`), with SSE parsing and abort."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.api.openai.errors import APIError
from pdserve.api.scale_out_routes import ABORT_PATH, GENERATE_PATH
from pdserve.routing.choice import LoadBalancer

log = logging.getLogger("pdserve.render")

MAX_SSE_EVENT_BYTES = 64 * 1024 * 1024


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


class EngineHTTPError(APIError):
    """The engine answered with an error: its status and OpenAI error body are passed on as they are."""

    def __init__(self, status: int, body: Any):
        message = "engine error"
        param = err_type = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            message = str(body["error"].get("message") or message)
            param = body["error"].get("param")
            err_type = body["error"].get("type")
        super().__init__(message, status, param, err_type)


@dataclass(eq=False)
class Engine:
    """One engine and the legs the orchestrator has in flight there (what the choice weighs)."""

    url: str
    in_flight: int = 0
    outstanding_tokens: int = 0


class EngineLease:
    """A leg's hold on its engine, counted in the engine's load until released (releasing twice is harmless)."""

    def __init__(self, engine: Engine, tokens: int) -> None:
        self.engine, self.tokens = engine, tokens
        self.url = engine.url
        engine.in_flight += 1
        engine.outstanding_tokens += tokens
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.engine.in_flight -= 1
            self.engine.outstanding_tokens -= self.tokens


class EnginePool:
    """Engines of one role behind one long-lived aiohttp session. Each leg's engine is chosen by the policy the
    proxy chooses its instances by (pdserve/routing/choice.py): the least loaded by the legs this process has in
    flight there, ties rotated (so round-robin while all are idle)."""

    def __init__(self, urls: list[str], api_key: str | None = None):
        if not urls:
            raise ValueError("an engine pool needs at least one URL")
        self.engines = [Engine(normalize_url(u)) for u in urls]
        self._balancer = LoadBalancer()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    def acquire(self, tokens: int) -> EngineLease:
        """The engine for a leg of `tokens` prompt tokens, held (counted busy) until the lease is released."""
        engine = self._balancer.choose(self.engines)
        assert engine is not None  # a pool has at least one engine
        return EngineLease(engine, tokens)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
            timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, url: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        try:
            # the request's id as its header too: a proxy in between (P/D) then names both legs by it, so the
            # engine answers with the id it would give without one
            rid = body.get("request_id")
            headers = {**self._headers, "X-Request-Id": rid} if isinstance(rid, str) else self._headers
            return await self.session.post(url + GENERATE_PATH, json=body, headers=headers)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise APIError(f"the engine at {url} is unreachable: {e}", 502) from e

    @staticmethod
    async def _raise_for(resp: aiohttp.ClientResponse) -> None:
        if resp.status == 200:
            return
        try:
            body = await resp.json(content_type=None)
        except (ValueError, aiohttp.ClientError):
            body = None
        finally:
            resp.release()
        raise EngineHTTPError(resp.status if 400 <= resp.status < 600 else 502, body)

    async def generate(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = await self._post(url, {**body, "stream": False})
        await self._raise_for(resp)
        try:
            data = await resp.json(content_type=None)
        except (ValueError, aiohttp.ClientError) as e:
            raise APIError(f"the engine at {url} sent an invalid response: {e}", 502) from e
        finally:
            resp.release()
        if not isinstance(data, dict):
            raise APIError(f"the engine at {url} sent an invalid response", 502)
        return data

    async def open_stream(self, url: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """Starts a streamed generate; engine errors before the first byte raise here (so they can still
        become the client's HTTP status)."""
        resp = await self._post(url, {**body, "stream": True})
        await self._raise_for(resp)
        return resp

    @staticmethod
    async def events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
        """The JSON objects of an SSE stream, until `[DONE]`. An error frame raises APIError."""
        buf = b""
        try:
            async for piece in resp.content.iter_any():
                buf += piece
                if len(buf) > MAX_SSE_EVENT_BYTES:
                    raise APIError("the engine sent an oversized stream event", 502)
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    data = b"\n".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))
                    if not data:
                        continue
                    if data == b"[DONE]":
                        return
                    try:
                        obj = json.loads(data)
                    except ValueError as e:
                        raise APIError(f"the engine sent invalid stream data: {e}", 502) from e
                    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
                        raise EngineHTTPError(int(obj["error"].get("code") or 500), obj)
                    yield obj
        except (TimeoutError, aiohttp.ClientError) as e:
            raise APIError(f"the engine stream broke: {e}", 502) from e
        finally:
            resp.release()
        raise APIError("the engine stream ended without [DONE]", 502)

    async def abort(self, url: str, request_ids: list[str]) -> None:
        """Best effort (closing the stream aborts too; this is for when the connection is kept alive)."""
        with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
            async with self.session.post(url + ABORT_PATH, json={"request_ids": request_ids}, headers=self._headers,
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                await resp.read()
