"""A decode leg's response relayed to the client byte for byte, as it comes (whole or SSE): the kv_transfer_params
it carries handed to the leg's sink (multi-turn history), the turn's history decision told, an instance ejected
meanwhile (its health probes failed) ending the relay at once, a stream that breaks ended with an error event."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.api.pd import KV_HISTORY
from pdserve.proxy.errors import (
    SSE_DONE,
    error_payload,
    error_response,
    is_openai_error_body,
    sse_error_event,
)
from pdserve.proxy.history_decision import HEADER as HISTORY_HEADER
from pdserve.proxy.history_decision import HistoryDecision
from pdserve.proxy.kv_routing import CachedPrefix
from pdserve.proxy.legs import DecodeLeg, EjectionWatch, KVParamsSink, backoff, describe, send_decode
from pdserve.proxy.pool import Instance
from pdserve.proxy.state import ProxyState
from pdserve.proxy.upstream import Upstream

logger = logging.getLogger("pdserve.proxy")

_KV_PARAMS_MARK = b'"kv_transfer_params"'


async def relay_decode(
    state: ProxyState,
    request: web.Request,
    api_path: str,
    payload: bytes,
    up: Upstream,
    *,
    tokens: int,
    kv_claimed: bool,
    prefix: CachedPrefix | None = None,
    role: str = "decode",
) -> web.StreamResponse:
    """Send the decode leg (`legs.send_decode`) and relay its response to the client."""
    leg = await send_decode(state, api_path, payload, up, tokens=tokens, kv_claimed=kv_claimed, prefix=prefix,
                            role=role)
    if isinstance(leg, web.Response):
        return leg
    try:
        return await relay_leg(state, request, leg)
    finally:
        leg.done()


async def relay_leg(state: ProxyState, request: web.Request, leg: DecodeLeg) -> web.StreamResponse:
    """A decode leg's response relayed to the client as it comes (whole or SSE); the leg's `on_kv_params` gets the
    response's kv_transfer_params (the final chunk's, when streamed), as vLLM's decode instances return them."""
    return await _relay_response(state, request, leg.instance, leg.resp, leg.started, leg.up.rid, leg.on_kv_params,
                                 leg.history_decision)


def _kv_params_of(data: bytes) -> dict[str, Any] | None:
    """The non-null kv_transfer_params of a JSON response body or SSE event, or None."""
    if _KV_PARAMS_MARK not in data:
        return None
    text = data.strip()
    if text.startswith(b"data:"):
        text = text[5:].strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    return params if isinstance(params, dict) else None


class _EventScanner:
    """Finds kv_transfer_params in an SSE stream relayed chunk by chunk (events may split across chunks);
    only events that carry them are parsed."""

    def __init__(self, sink: KVParamsSink) -> None:
        self._sink = sink
        self._pending = b""

    def feed(self, chunk: bytes) -> None:
        data = self._pending + chunk
        *events, self._pending = data.split(b"\n\n")
        if len(self._pending) > 4 * 1024 * 1024:  # no event is that long: not SSE we understand
            self._pending = b""
        for event in events:
            params = _kv_params_of(event)
            if params is not None:
                self._sink(params)


def _with_history_decision(data: bytes, history: HistoryDecision) -> bytes:
    """A whole JSON answer with `kv_transfer_params.kv_history` set (anything else: unchanged)."""
    try:
        parsed = json.loads(data)
    except ValueError:
        return data
    if not isinstance(parsed, dict):
        return data
    params = parsed.get("kv_transfer_params")
    parsed["kv_transfer_params"] = {**(params if isinstance(params, dict) else {}), KV_HISTORY: history.as_dict()}
    return json.dumps(parsed).encode()


async def _relay_response(
    state: ProxyState,
    request: web.Request,
    inst: Instance,
    resp: aiohttp.ClientResponse,
    started: float,
    rid: str,
    on_kv_params: KVParamsSink | None = None,
    history: HistoryDecision | None = None,
) -> web.StreamResponse:
    metrics = state.metrics
    status = resp.status
    ctype = resp.headers.get("Content-Type", "application/json")
    retry_after = backoff(inst, status, resp.headers)
    finished = False
    # On an ejection, closing the upstream response makes the pending read fail now; the failure paths below
    # answer the client (an error status, or an SSE error frame) naming the ejection.
    with EjectionWatch(inst, resp.close) as watch:
        try:
            if status >= 400 or not ctype.startswith("text/event-stream"):
                try:
                    data = await resp.read()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    kind = "decode_timeout" if isinstance(exc, asyncio.TimeoutError) else "decode_io"
                    metrics.error(kind)
                    reason = watch.reason or describe(exc)
                    if watch.reason is None:
                        inst.record_failure(reason, state.config.eject_after)
                    return error_response(
                        504 if kind == "decode_timeout" else 502,
                        f"decode leg failed while reading its response: {reason}",
                        "BadGatewayError",
                        request_id=rid,
                    )
                finished = True
                metrics.decode_ttfb_seconds.observe(time.perf_counter() - started)
                if status >= 500:
                    metrics.error("decode_status")
                    if retry_after is None:
                        inst.record_failure(f"status {status}", state.config.eject_after)
                    if not is_openai_error_body(data):
                        data = json.dumps(
                            error_payload(
                                f"decode instance error: {data[:500].decode(errors='replace')}",
                                "BadGatewayError",
                                status,
                            )
                        ).encode()
                        ctype = "application/json"
                else:
                    inst.record_success()
                    if on_kv_params is not None and status == 200:
                        params = _kv_params_of(data)
                        if params is not None:
                            on_kv_params(params)
                    if history is not None and history.decision != "none" and status == 200:
                        data = _with_history_decision(data, history)
                out_headers = {"Content-Type": ctype, "X-Request-Id": rid}
                if history is not None:
                    out_headers[HISTORY_HEADER] = history.header()
                if "Retry-After" in resp.headers:
                    out_headers["Retry-After"] = resp.headers["Retry-After"]
                return web.Response(status=status, body=data, headers=out_headers)
            scanner = _EventScanner(on_kv_params) if on_kv_params is not None and status == 200 else None
            extra = {HISTORY_HEADER: history.header()} if history is not None else {}
            out, finished = await _relay_stream(state, request, inst, resp, started, rid, ctype, scanner, watch, extra)
            return out
        finally:
            if finished:
                resp.release()
            else:
                resp.close()  # closing the connection aborts the request on the decode instance


async def _relay_stream(
    state: ProxyState,
    request: web.Request,
    inst: Instance,
    resp: aiohttp.ClientResponse,
    started: float,
    rid: str,
    ctype: str,
    scanner: _EventScanner | None = None,
    watch: EjectionWatch | None = None,
    extra_headers: dict[str, str] | None = None,
) -> tuple[web.StreamResponse, bool]:
    """Relays SSE bytes as they come; returns the response and whether the upstream body was read
    to its end (so its connection can go back to the pool)."""
    metrics = state.metrics
    out = web.StreamResponse(
        status=resp.status,
        headers={"Content-Type": ctype, "Cache-Control": "no-cache", "X-Request-Id": rid, **(extra_headers or {})},
    )
    await out.prepare(request)
    tail = b""
    first = True
    failure: str | None = None
    try:
        async for chunk in resp.content.iter_any():
            if first:
                metrics.decode_ttfb_seconds.observe(time.perf_counter() - started)
                first = False
            await out.write(chunk)
            if scanner is not None:
                scanner.feed(chunk)
            tail = chunk[-16:] if len(chunk) >= 16 else (tail + chunk)[-16:]
    except (TimeoutError, aiohttp.ClientError) as exc:
        if isinstance(exc, ConnectionResetError):  # our write to a client that went away
            metrics.error("client_disconnect")
            return out, False
        failure = describe(exc) or "timeout"
    except ConnectionResetError:
        metrics.error("client_disconnect")
        return out, False
    ejected = watch.reason if watch is not None else None
    if ejected is not None:  # the read ended (raised, or found the closed body's end) because the instance was ejected
        failure = ejected
    elif failure is None and not tail.rstrip().endswith(b"[DONE]"):
        failure = "stream ended without [DONE]"
    if failure is None:
        inst.record_success()
    else:
        metrics.error("decode_stream")
        if ejected is None:
            inst.record_failure(failure, state.config.eject_after)
        logger.warning("decode stream of request %s from %s broke: %s", rid, inst.url, failure)
        separator = b"" if not tail or tail.endswith(b"\n\n") else b"\n\n"
        try:
            await out.write(
                separator
                + sse_error_event(f"decode instance failed mid-stream: {failure}", "BadGatewayError", 502)
                + SSE_DONE
            )
        except ConnectionResetError:
            metrics.error("client_disconnect")
            return out, False
    try:
        await out.write_eof()
    except ConnectionResetError:
        metrics.error("client_disconnect")
    return out, failure is None
