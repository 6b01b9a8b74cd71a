"""One P/D pair in push mode (`pdserve proxy --kv-transfer-mode push`, instances with `NixlPushConnector`).

Both legs go out at once: the decode leg names the chosen prefill instance's side channel (its /pdserve/info
`engine_id`, `side_channel_host`, `side_channel_port`) and both carry one random push key
(pdserve/api/pd.py `push_prefill_params`, `push_decode_params`). The decode instance allocates the blocks it
lacks on admission and registers them with the prefill, which WRITEs the KV as it computes it; the decode
starts when the push completes. So the prefill leg is one attempt (no retry elsewhere: the decode registered
with that instance); when it fails, the decode leg is dropped (closing its connection aborts it, which cancels
the push) and the prefill's error is answered, or, under `--on-prefill-failure decode-local` (which `pdserve up`
sets), the request goes to a decode instance whole, as in pull mode.
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

from pdserve.api.pd import PUSH, build_decode_body, build_prefill_body, push_decode_params
from pdserve.proxy.errors import error_response
from pdserve.proxy.legs import DecodeLeg, _prefill_once, no_instance_response, send_decode
from pdserve.proxy.pool import Instance
from pdserve.proxy.state import ProxyState

logger = logging.getLogger("pdserve.proxy")


async def push_coordinates(state: ProxyState, inst: Instance) -> dict[str, Any] | str:
    """The prefill instance's side channel from its /pdserve/info (cached until a leg to it fails), or why
    it cannot take push legs."""
    if inst.push_info is not None:
        return inst.push_info
    try:
        async with state.http().get(inst.endpoint("/pdserve/info"), timeout=state.prefill_timeout) as resp:
            info = await resp.json() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return f"its /pdserve/info could not be read: {type(exc).__name__}: {exc}"
    if not isinstance(info, dict):
        return "it has no /pdserve/info (not a pdserve instance)"
    if info.get("kv_transfer_mode") != PUSH:
        return (f"it uses transfer_mode {info.get('kv_transfer_mode')!r}; push needs kv_connector "
                "NixlPushConnector on both prefill and decode instances")
    port = info.get("side_channel_port")
    if not isinstance(info.get("engine_id"), str) or not isinstance(port, int):
        return "its /pdserve/info names no KV side channel"
    # push_decode_params' arguments
    inst.push_info = dict(engine_id=info["engine_id"], host=info.get("side_channel_host") or inst.host, port=port,
                          tp_size=int(info.get("tensor_parallel_size") or 1))
    return inst.push_info


async def start_push_pair(state: ProxyState, api_path: str, body: dict[str, Any], raw: bytes,
                          headers: dict[str, str], tokens: int, decode_tokens: int) -> DecodeLeg | web.Response:
    rid = headers["X-Request-Id"]
    local = state.config.on_prefill_failure == "decode-local"

    async def decode_locally(why: str) -> DecodeLeg | web.Response:
        logger.warning("request %s: %s; decode instance prefills locally (--on-prefill-failure decode-local)",
                       rid, why)
        return await send_decode(state, api_path, raw, headers, tokens=decode_tokens, kv_claimed=False)

    prefill = await state.pairing.prefill(wait=not local)
    if prefill is None:
        return await decode_locally("no prefill instance") if local else no_instance_response(state, "prefill", rid)
    coords = await push_coordinates(state, prefill)
    if isinstance(coords, str):
        state.metrics.error("prefill_failed")
        return error_response(502, f"prefill instance {prefill.url} cannot take push legs: {coords}",
                              "BadGatewayError", request_id=rid)
    decode = await state.pairing.decode(wait=True)
    if decode is None:
        return no_instance_response(state, "decode", rid)
    key = uuid.uuid4().hex
    decode_payload = json.dumps(build_decode_body(body, push_decode_params(key, **coords))).encode()
    prefill_payload = json.dumps(build_prefill_body(body, push_key=key)).encode()
    decode.acquire(decode_tokens)
    started = time.perf_counter()
    decode_task = asyncio.ensure_future(state.http().post(decode.endpoint(api_path), data=decode_payload,
                                                          headers=headers, timeout=state.decode_timeout))

    async def drop_decode() -> None:
        decode_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError, aiohttp.ClientError):
            (await decode_task).close()  # closing the connection aborts the leg, which cancels the push
        decode.release(decode_tokens)

    try:
        result = await _prefill_once(state, prefill, api_path, prefill_payload, headers, tokens)
    except BaseException:
        await drop_decode()
        raise
    if result.kv_params is None:
        await drop_decode()
        prefill.push_info = None  # it may have restarted (a new engine id or port): read it again next time
        if result.passthrough is not None:
            return result.passthrough
        if local and (not result.reached or state.spend_retry()):
            return await decode_locally(f"prefill failed ({result.error})")
        state.metrics.error("prefill_failed")
        return error_response(502, f"prefill leg failed: {result.error}", "BadGatewayError", request_id=rid)
    try:
        resp = await decode_task
    except (TimeoutError, aiohttp.ClientError) as exc:
        decode.release(decode_tokens)
        state.metrics.error("decode_io")
        decode.record_failure(f"{type(exc).__name__}: {exc}", state.config.eject_after)
        return error_response(502, f"decode leg failed: {type(exc).__name__}: {exc}", "BadGatewayError",
                              request_id=rid)
    return DecodeLeg(decode, resp, started, decode_tokens)
