"""The decode leg sent together with the prefill leg, its kv_transfer_params delivered once the prefill
answered (pdserve/api/pd.py `early_decode_params`, `KV_PARAMS_PATH`).

Sent after the prefill, the decode leg's own HTTP, JSON parsing, validation and admission (a few ms for an
8k-token prompt, paid on top of the prefill's) come between the prefill's answer and the first token; sent
with the prefill leg, they overlap the prefill and only the small params delivery is left. Only for decode
instances that say they take it (pdserve's /pdserve/info `kv_params_later`; vLLM's get the ordinary order).

The leg cannot claim the prefill's lease before its params are delivered, so until then it may be dropped
(closing its connection aborts it on the decode instance) and the request continues the ordinary way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.api.pd import KV_PARAMS_PATH, build_decode_body, early_decode_params, params_delivery
from pdserve.proxy.errors import error_response, is_openai_error_body
from pdserve.proxy.legs import DecodeLeg, unless_ejected
from pdserve.proxy.pool import Instance
from pdserve.proxy.state import ProxyState
from pdserve.proxy.upstream import Upstream

logger = logging.getLogger("pdserve.proxy")

_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


class EarlyDecodeLeg:
    """A decode leg in flight before its params: `finish` delivers them and waits for its response headers,
    `cancel` drops it."""

    def __init__(self, state: ProxyState, inst: Instance, key: str, up: Upstream, tokens: int,
                 task: asyncio.Future[aiohttp.ClientResponse], started: float) -> None:
        self.state, self.inst, self.key, self.up, self.tokens = state, inst, key, up, tokens
        self.rid = up.rid
        self.task, self.started = task, started
        self._released = False

    @classmethod
    def send(cls, state: ProxyState, inst: Instance, api_path: str, body: dict[str, Any], up: Upstream,
             tokens: int) -> EarlyDecodeLeg:
        key = f"{up.rid}-{uuid.uuid4().hex[:12]}"  # unique even when clients reuse request ids

        async def post() -> aiohttp.ClientResponse:
            # serialised in the task, so that a prefill leg started just before goes out first
            payload = json.dumps(build_decode_body(body, early_decode_params(key))).encode()
            return await unless_ejected(inst, state.http().post(inst.endpoint(api_path), data=payload,
                                                                 headers=up.headers, timeout=state.decode_timeout))

        up.hold(inst, tokens)
        return cls(state, inst, key, up, tokens, asyncio.ensure_future(post()), time.perf_counter())

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.up.release(self.inst, self.tokens)

    async def cancel(self) -> None:
        """Drop the leg (the prefill failed): its connection closes, which aborts it on the instance."""
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError, aiohttp.ClientError):
            resp = await self.task
            resp.close()
        self._release()

    async def finish(self, kv_params: dict[str, Any]) -> DecodeLeg | web.Response | None:
        """Deliver the prefill's params, then wait for the leg's response headers: the leg to relay, the
        client's error response, or None when the leg never got to its instance (the lease is unclaimed:
        the caller sends the ordinary decode leg instead)."""
        state, inst = self.state, self.inst
        async def deliver() -> tuple[int, bytes]:
            async with state.http().post(
                inst.endpoint(KV_PARAMS_PATH), data=json.dumps(params_delivery(self.key, kv_params)).encode(),
                headers=self.up.headers, timeout=state.decode_timeout,
            ) as resp:
                return resp.status, await resp.read()

        try:
            status, data = await unless_ejected(inst, deliver())
        except _CONNECT_ERRORS as exc:
            # never reached the instance, so nothing claimed the lease: the ordinary leg (maybe elsewhere) can
            logger.warning("request %s: kv_transfer_params not delivered to %s: %s", self.rid, inst.url, exc)
            inst.record_failure(f"params delivery: {type(exc).__name__}", state.config.eject_after)
            await self.cancel()
            return None
        except (TimeoutError, aiohttp.ClientError) as exc:
            # Sent, but no answer (the instance died or hung): it may have handed the params to its engine,
            # which claims the lease at once, before the answer goes out. A second decode leg would then be
            # refused the lease (409 already_claimed, blaming the client's params) or, worse, race the first:
            # the request fails here, as a decode leg that broke after reaching its instance does.
            logger.warning("request %s: kv_transfer_params delivery to %s broke: %s", self.rid, inst.url, exc)
            state.metrics.error("decode_io")
            inst.record_failure(f"params delivery: {type(exc).__name__}", state.config.eject_after)
            await self.cancel()
            return error_response(502, f"decode leg failed while its kv_transfer_params were delivered: "
                                  f"{type(exc).__name__}: {exc}", "BadGatewayError", request_id=self.rid)
        if status != 200:
            # refused (the leg ends with the same 400) or not served: the leg is dropped, the answer relayed
            await self.cancel()
            logger.warning("request %s: %s refused the kv_transfer_params: %s %r", self.rid, inst.url, status,
                           data[:200])
            if 400 <= status < 500 and is_openai_error_body(data):
                return web.Response(status=status, body=data,
                                    headers={"Content-Type": "application/json", "X-Request-Id": self.rid})
            return error_response(502, f"decode instance refused the kv_transfer_params: status {status}",
                                  "BadGatewayError", request_id=self.rid)
        try:
            leg = await self.task
        except _CONNECT_ERRORS:
            self._release()
            return None
        except (TimeoutError, aiohttp.ClientError) as exc:
            # it reached the instance, which may have claimed the lease: no second decode leg
            self._release()
            state.metrics.error("decode_io")
            inst.record_failure(f"{type(exc).__name__}: {exc}", state.config.eject_after)
            return error_response(502, f"decode leg failed: {type(exc).__name__}: {exc}", "BadGatewayError",
                                  request_id=self.rid)
        self._released = True  # DecodeLeg.done() releases from here on
        state.metrics.early_decode_legs.inc()
        return DecodeLeg(inst, leg, self.started, self.tokens, self.up)
