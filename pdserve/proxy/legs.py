"""The two legs of a request: the prefill call (with retries on other instances) and the decode call, up to its
response headers (relay.py relays its body). Each leg takes the request's `Upstream` (upstream.py): its id and
headers, and the record of the instances its legs are on, which an abort reads."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from pdserve.api.pd import prefill_kv_params
from pdserve.proxy.errors import error_response
from pdserve.proxy.history_decision import HistoryDecision
from pdserve.proxy.instance_info import learn_from_params
from pdserve.proxy.kv_routing import CachedPrefix
from pdserve.proxy.peer_pull import with_peer_prefix
from pdserve.proxy.pool import Instance
from pdserve.proxy.readiness import no_instance_response, retry_after_s
from pdserve.proxy.retry import parse_retry_after, retry_after_header
from pdserve.proxy.state import ProxyState
from pdserve.proxy.upstream import Upstream

T = TypeVar("T")

logger = logging.getLogger("pdserve.proxy")

# Called with the decode response's kv_transfer_params (a held history, for multi-turn) once they are seen.
KVParamsSink = Callable[[dict[str, Any]], None]

# Upstream statuses that mean "try elsewhere" rather than "the client's request is wrong".
_RETRYABLE_4XX = (408, 429)
# Statuses whose Retry-After the proxy honours (the instance is passed over until then).
_BACKOFF_STATUSES = (429, 503)
_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _leg_failure(leg: str, exc: BaseException) -> tuple[str, str]:
    """(error kind, reason) of a leg's exchange that raised: it never connected, timed out, or broke."""
    if isinstance(exc, _CONNECT_ERRORS):
        return f"{leg}_connect", describe(exc)
    if isinstance(exc, TimeoutError):
        return f"{leg}_timeout", describe(exc) or "timeout"
    return f"{leg}_io", describe(exc)


@dataclass
class PrefillResult:
    """Outcome of the prefill leg: params (success), a client error to relay verbatim, or a failure.

    On failure: `unavailable` when no prefill instance was available at all, `reached` when the failed
    leg reached an instance (so retrying may repeat prefill work), `retry_after` when the instance (or
    the lack of one) says when to come back.
    """

    kv_params: dict[str, Any] | None = None
    response: dict[str, Any] | None = None
    instance: Instance | None = None
    passthrough: web.Response | None = None
    error: str | None = None
    unavailable: bool = False
    reached: bool = False
    retry_after: float | None = None


def backoff(inst: Instance, status: int, headers: Any) -> float | None:
    """Honour an upstream Retry-After on 429/503: the instance is passed over until then."""
    if status not in _BACKOFF_STATUSES:
        return None
    seconds = parse_retry_after(headers.get("Retry-After"))
    if seconds is not None and seconds > 0:
        inst.back_off(seconds)
    return seconds


class InstanceEjected(aiohttp.ClientError):
    """The instance was ejected (its health probes failed) while a leg waited on it."""


class EjectionWatch:
    """While entered, an ejection of `inst` (its health probes failed) runs `stop` once and keeps the reason: a
    leg to a host that stopped answering (a cut link, a frozen machine) ends after the probes' bound, not the
    leg's long read timeout. `stop` cancels what the leg awaits, or closes the response it reads."""

    def __init__(self, inst: Instance, stop: Callable[[], Any]) -> None:
        self._inst, self._stop = inst, stop
        self.reason: str | None = None
        self._unwatch: Callable[[], None] | None = None

    def _on_ejection(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self._stop()

    def __enter__(self) -> EjectionWatch:
        self._unwatch = self._inst.watch_ejection(self._on_ejection)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._unwatch is not None:
            self._unwatch()


async def unless_ejected(inst: Instance, aw: Awaitable[T]) -> T:
    """`aw`, cancelled with `InstanceEjected` if `inst` is ejected meanwhile (`EjectionWatch`)."""
    task = asyncio.ensure_future(aw)
    with EjectionWatch(inst, task.cancel) as watch:
        try:
            return await task
        except asyncio.CancelledError:
            if watch.reason is not None and not _cancelling():
                raise InstanceEjected(watch.reason) from None
            raise


def _cancelling() -> bool:
    """Whether the running task itself is being cancelled (not only the leg it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def prefill_once(
    state: ProxyState, inst: Instance, api_path: str, payload: bytes, up: Upstream, tokens: int
) -> PrefillResult:
    started = time.perf_counter()
    kind: str | None = None
    reason = ""
    status = 0
    data = b""
    ctype = "application/json"
    retry_after: float | None = None
    up.hold(inst, tokens)

    async def exchange() -> tuple[int, str, float | None, bytes]:
        async with state.http().post(
            inst.endpoint(api_path), data=payload, headers=up.headers, timeout=state.prefill_timeout
        ) as resp:
            return (resp.status, resp.headers.get("Content-Type", ctype), backoff(inst, resp.status, resp.headers),
                    await resp.read())

    try:
        status, ctype, retry_after, data = await unless_ejected(inst, exchange())
    except (TimeoutError, aiohttp.ClientError) as exc:
        kind, reason = _leg_failure("prefill", exc)
    finally:
        up.release(inst, tokens)

    if up.aborted:  # the client aborted it meanwhile (app.py): its answer as it is, nothing blamed or retried
        return PrefillResult(instance=inst, passthrough=up.aborted_response(status, ctype, data))
    counts_against_instance = True
    parsed: Any = None
    if kind is None:
        if 400 <= status < 500 and status not in _RETRYABLE_4XX:
            # The client's request is wrong (bad params, prompt too long, ...): say so verbatim.
            inst.record_success()
            headers_out = {"Content-Type": ctype, "X-Request-Id": up.rid}
            return PrefillResult(
                instance=inst, passthrough=web.Response(status=status, body=data, headers=headers_out)
            )
        if status != 200:
            kind, reason = "prefill_status", f"status {status}: {data[:200]!r}"
            # An instance that asked for a pause (Retry-After) is busy, not broken: no ejection.
            counts_against_instance = status >= 500 and retry_after is None
        else:
            try:
                parsed = json.loads(data)
            except ValueError:
                kind, reason = "prefill_no_params", "response is not JSON"
    if kind is None:
        kv_params = prefill_kv_params(parsed)
        if kv_params is not None:
            learn_from_params(inst, kv_params)  # vLLM's answers say its transfer mode (vllm#50620)
            inst.record_success()
            state.metrics.prefill_seconds.observe(time.perf_counter() - started)
            return PrefillResult(kv_params=kv_params, response=parsed, instance=inst)
        kind, reason = "prefill_no_params", "response has no kv_transfer_params"
    state.metrics.error(kind)
    if counts_against_instance:
        inst.record_failure(reason, state.config.eject_after)
    logger.warning("prefill leg of request %s failed on %s: %s", up.rid, inst.url, reason)
    return PrefillResult(
        instance=inst, error=f"{inst.url}: {reason}", reached=kind != "prefill_connect", retry_after=retry_after
    )


async def run_prefill(
    state: ProxyState,
    api_path: str,
    payload: bytes,
    up: Upstream,
    tokens: int,
    affinity: str | None,
    prefix: CachedPrefix | None = None,
    peer_pull: bool = False,
    first: tuple[Instance | None] | None = None,
) -> PrefillResult:
    """The prefill leg on the chosen instance, then on other instances while retries are allowed
    (none under --on-prefill-failure fail) and the retry budget has room. With `prefix`, the instance is
    chosen by cached prefix and load, and the leg counts as the prompt tokens not cached there.

    With no prefill instance available, the first attempt waits (bounded) for one, except under
    --on-prefill-failure decode-local, which serves such a request locally at once instead. `first`: the first
    attempt's instance, chosen already (None in it: none was available); retries stay in its transfer mode.
    """
    cfg = state.config
    attempts = 1 if cfg.on_prefill_failure == "fail" else 1 + cfg.prefill_retries
    wait = cfg.on_prefill_failure != "decode-local"
    tried: list[Instance] = []
    last = PrefillResult(error="no prefill instance available", unavailable=True)
    like = first[0] if first is not None else None
    for attempt in range(attempts):
        if up.aborted:
            return PrefillResult(passthrough=up.aborted_response())
        if attempt == 0 and first is not None:
            inst = first[0]
        else:
            inst = await state.pairing.prefill(tried, wait=wait and attempt == 0, affinity=affinity, prefix=prefix,
                                               like=like)
        if inst is None:
            break
        if attempt:
            if last.reached and not state.spend_retry():
                break
            state.metrics.retries["prefill"].inc()
        tried.append(inst)
        work = tokens if prefix is None else tokens - prefix.cached_tokens(inst)
        # `peer_pull`: a peer caching more of the prompt may pin it for this instance to read (peer_pull.py)
        body = await with_peer_prefix(state, inst, payload, prefix, up) if peer_pull else payload
        result = await prefill_once(state, inst, api_path, body, up, work)
        if result.kv_params is not None or result.passthrough is not None:
            return result
        last = result
    if last.unavailable:
        last.retry_after = retry_after_s(state.prefill, cfg.health_interval)
    return last


@dataclass
class DecodeLeg:
    """A decode leg whose response headers arrived: the caller reads `resp`, then calls `done()`."""

    instance: Instance
    resp: aiohttp.ClientResponse
    started: float
    tokens: int
    up: Upstream  # the request's, which holds the leg on `instance` until `done`
    on_kv_params: KVParamsSink | None = None  # gets the response's kv_transfer_params (multi-turn history)
    history_decision: HistoryDecision | None = None  # told to the client with the answer (history_decision.py)

    def done(self) -> None:
        self.up.release(self.instance, self.tokens)


async def send_decode(
    state: ProxyState,
    api_path: str,
    payload: bytes,
    up: Upstream,
    *,
    tokens: int,
    kv_claimed: bool,
    prefix: CachedPrefix | None = None,
    role: str = "decode",
    pair_with: Instance | None = None,
) -> DecodeLeg | web.Response:
    """Send the decode leg; returns it once an instance answered (any status but a retried 5xx), or the
    error response for the client. A leg that never reached an instance (connect failure) is retried on
    another one; other failures are retried only when `kv_claimed` is False: a P/D decode leg that reached
    its instance may have claimed the prefill's KV lease. Retries after a leg that reached an instance are
    paid from the retry budget; with no decode instance available the first attempt waits (bounded) for
    one, then the answer is 503 with Retry-After. `prefix`: the decode instance computes the prompt itself
    (not a P/D decode leg): chosen by cached prefix and load, counted as its uncached tokens. `role`
    "prefill": the whole request is served by a prefill instance instead (a prompt-scoring request,
    pdserve.api.pd.scores_prompt), with the same retries. `pair_with`: the prefill instance whose KV the leg
    loads (only a decode instance that pairs with it is chosen: pairing.py)."""
    cfg = state.config
    rid = up.rid
    tried: list[Instance] = []
    last_kind: str | None = None
    last_reason = ""
    last_retry_after: float | None = None
    for attempt in range(1 + cfg.decode_retries):
        if up.aborted:  # the client aborted the request (app.py): no decode leg after it
            return up.aborted_response()
        inst = await state.pairing.decode(tried, wait=attempt == 0, prefix=prefix, computes_prompt=not kv_claimed,
                                          role=role, pair_with=pair_with)
        if inst is None:
            break
        if attempt:
            if last_kind != "decode_connect" and not state.spend_retry():
                break
            state.metrics.retries["decode"].inc()
        tried.append(inst)
        may_retry = attempt < cfg.decode_retries
        last_retry_after = None
        work = tokens if prefix is None else tokens - prefix.cached_tokens(inst)
        up.hold(inst, work)
        handed_over = False
        try:
            started = time.perf_counter()
            try:
                resp = await unless_ejected(inst, state.http().post(
                    inst.endpoint(api_path), data=payload, headers=up.headers, timeout=state.decode_timeout
                ))
            except (TimeoutError, aiohttp.ClientError) as exc:
                last_kind, last_reason = _leg_failure("decode", exc)
            else:
                if resp.status >= 500 and not kv_claimed and may_retry:
                    last_retry_after = backoff(inst, resp.status, resp.headers)
                    body = await _read_quietly(resp)
                    last_kind, last_reason = "decode_status", f"status {resp.status}: {body[:200]!r}"
                else:
                    handed_over = True
                    return DecodeLeg(inst, resp, started, work, up)
            state.metrics.error(last_kind)
            if last_retry_after is None:
                inst.record_failure(last_reason, cfg.eject_after)
            logger.warning("decode leg of request %s failed on %s: %s", rid, inst.url, last_reason)
            if kv_claimed and last_kind != "decode_connect":
                break
        finally:
            if not handed_over:
                up.release(inst, work)
    if last_kind is None:
        return no_instance_response(state, role, rid)
    if last_retry_after is not None:
        return error_response(
            503,
            f"decode instance busy: {last_reason}",
            "ServiceUnavailableError",
            request_id=rid,
            headers={"Retry-After": retry_after_header(last_retry_after)},
        )
    status = 504 if last_kind == "decode_timeout" else 502
    return error_response(status, f"decode leg failed: {last_reason}", "BadGatewayError", request_id=rid)


async def _read_quietly(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.read()
    except (TimeoutError, aiohttp.ClientError):
        return b""
    finally:
        resp.release()
