"""A completions request with several prompts, served as one P/D pair per prompt, merged into the one
response vLLM would give: choice `index` = prompt index * n + choice index, usage summed (cached tokens
too), one id. Streams are merged as their events arrive; each pair's own usage chunk and `[DONE]` are
held back and one combined usage chunk (when asked for) and one `[DONE]` end the merged stream.

A pair that fails before its response starts fails the request with that pair's error (the other pairs'
legs are closed, which aborts them on their decode instances); a stream that breaks later ends the merged
stream with its error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.proxy.errors import SSE_DONE, error_response, sse_error_event
from pdserve.proxy.legs import DecodeLeg

logger = logging.getLogger("pdserve.proxy")


def split_bodies(body: dict[str, Any]) -> list[dict[str, Any]]:
    """One single-prompt body per prompt of a batch body."""
    return [{**body, "prompt": prompt} for prompt in body["prompt"]]


def _add_usage(total: dict[str, Any], usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        if isinstance(usage.get(key), int):
            total[key] = total.get(key, 0) + usage[key]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if isinstance(cached, int):
        details = total.setdefault("prompt_tokens_details", {"cached_tokens": 0})
        details["cached_tokens"] += cached


def _reindex(choices: Any, prompt_index: int, n: int) -> list[Any]:
    out = []
    for choice in choices if isinstance(choices, list) else []:
        if isinstance(choice, dict):
            choice = {**choice, "index": prompt_index * n + int(choice.get("index", 0))}
        out.append(choice)
    return out


async def merge(request: web.Request, body: dict[str, Any], rid: str,
                legs: list[DecodeLeg | web.Response]) -> web.StreamResponse:
    """The prompts' pairs (`legs`, in prompt order, as plan.py opened them) as one response; every leg is done
    afterwards."""
    n = body.get("n") if type(body.get("n")) is int else 1
    try:
        failed = next((leg for leg in legs if isinstance(leg, web.Response)), None)
        if failed is None:
            failed = next((leg for leg in legs if leg.resp.status != 200), None)
            if failed is not None:
                data = await failed.resp.read()
                failed = web.Response(status=failed.resp.status, body=data, headers={
                    "Content-Type": failed.resp.headers.get("Content-Type", "application/json"), "X-Request-Id": rid})
        if failed is not None:
            return failed
        if body.get("stream"):
            return await _merge_streams(request, body, legs, rid, n)
        return await _merge_whole(legs, rid, n)
    finally:
        for leg in legs:
            if isinstance(leg, DecodeLeg):
                leg.resp.close()  # a leg not read to its end is aborted on its decode instance
                leg.done()


async def _merge_whole(legs: list[Any], rid: str, n: int) -> web.Response:
    parts = []
    for leg in legs:
        try:
            parts.append(json.loads(await leg.resp.read()))
        except (ValueError, aiohttp.ClientError, TimeoutError) as exc:
            return error_response(502, f"decode leg failed while reading its response: {exc}", "BadGatewayError",
                                  request_id=rid)
    merged = dict(parts[0])
    merged["choices"] = [c for k, part in enumerate(parts) for c in _reindex(part.get("choices"), k, n)]
    usage: dict[str, Any] = {}
    for part in parts:
        _add_usage(usage, part.get("usage"))
    merged["usage"] = usage
    merged["id"] = f"cmpl-{rid}"
    merged["kv_transfer_params"] = None
    return web.json_response(merged, headers={"X-Request-Id": rid})


async def _events(leg: DecodeLeg):
    """A decode leg's SSE `data:` payloads, as text."""
    buffer = b""
    async for chunk in leg.resp.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode()


async def _merge_streams(request: web.Request, body: dict[str, Any], legs: list[Any], rid: str,
                         n: int) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                      "X-Request-Id": rid})
    await out.prepare(request)
    queue: asyncio.Queue = asyncio.Queue()
    stream_id = f"cmpl-{rid}"

    async def pump(k: int, leg: DecodeLeg) -> None:
        done = False
        try:
            async for data in _events(leg):
                if data == "[DONE]":
                    done = True
                    break
                await queue.put((k, data))
        except (aiohttp.ClientError, TimeoutError) as exc:
            await queue.put((k, ("error", str(exc) or "timeout")))
            return
        if not done:
            await queue.put((k, ("error", "stream ended without [DONE]")))
        await queue.put((k, None))

    tasks = [asyncio.ensure_future(pump(k, leg)) for k, leg in enumerate(legs)]
    usage: dict[str, Any] = {}
    model = None
    remaining = len(legs)
    try:
        while remaining:
            k, data = await queue.get()
            if data is None:
                remaining -= 1
                continue
            if isinstance(data, tuple):
                logger.warning("request %s: prompt %d's decode stream broke: %s", rid, k, data[1])
                await out.write(sse_error_event(f"decode instance failed mid-stream: {data[1]}", "BadGatewayError",
                                                502) + SSE_DONE)
                return out
            event = json.loads(data)
            if "error" in event:  # an error frame of the pair's server: passed on, the merged stream ends
                await out.write(f"data: {data}\n\n".encode() + SSE_DONE)
                return out
            model = event.get("model", model)
            if not event.get("choices") and event.get("usage") is not None:
                _add_usage(usage, event["usage"])  # the pair's final usage chunk: summed, sent once at the end
                continue
            event["id"] = stream_id
            event["choices"] = _reindex(event.get("choices"), k, n)
            await out.write(f"data: {json.dumps(event)}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            final = {"id": stream_id, "object": "text_completion", "model": model, "choices": [], "usage": usage}
            await out.write(f"data: {json.dumps(final)}\n\n".encode())
        await out.write(SSE_DONE)
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out
    except ConnectionResetError:
        return out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
