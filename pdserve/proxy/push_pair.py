"""One P/D pair in push mode between pdserve instances (`kv_connector: NixlPushConnector`; chosen when the
prefill instance's /pdserve/info says `kv_transfer_mode: push`, or under `pdserve proxy --kv-transfer-mode push`).

Both legs go out at once: the decode leg names the chosen prefill instance's side channel (its /pdserve/info
`engine_id`, `side_channel_host`, `side_channel_port`) and both carry one random push key
(pdserve/api/pd.py `push_prefill_params`, `push_decode_params`). The decode instance allocates the blocks it
lacks on admission and registers them with the prefill, which WRITEs the KV as it computes it; the decode
starts when the push completes. So the prefill leg is one attempt (no retry elsewhere: the decode registered
with that instance); when it fails, the decode leg is dropped (closing its connection aborts it, which cancels
the push) and the prefill's error is answered, or, under `--on-prefill-failure decode-local` (which `pdserve up`
sets), the request goes to a decode instance whole, as in pull mode.

vLLM's push instances are not driven here: they get the legs one after the other (the ordinary
order, pull_pair.py), the decode leg naming the coordinates from the prefill's answer, as vLLM's own push router does.
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

from pdserve.api.pd import PUSH, build_decode_body, push_decode_params
from pdserve.proxy.errors import error_response
from pdserve.proxy.instance_info import read_instance_info
from pdserve.proxy.legs import DecodeLeg, prefill_once, send_decode
from pdserve.proxy.pool import Instance
from pdserve.proxy.readiness import no_instance_response
from pdserve.proxy.request import ClientRequest, prefill_body
from pdserve.proxy.state import ProxyState

logger = logging.getLogger("pdserve.proxy")


async def push_coordinates(state: ProxyState, inst: Instance) -> dict[str, Any] | str:
    """The prefill instance's side channel from its /pdserve/info (read on admission, or now when it was
    forgotten after a failed leg), or why it cannot take push legs."""
    if inst.push_info is None and not await read_instance_info(state.http(), inst, state.config.health_timeout):
        return "its /pdserve/info could not be read"
    if inst.pdserve is False:
        return "it has no /pdserve/info (not a pdserve instance)"
    if inst.transfer_mode != PUSH:
        return (f"it uses transfer_mode {inst.transfer_mode!r}; push needs kv_connector NixlPushConnector on both "
                "prefill and decode instances")
    if inst.push_info is None:
        return "its /pdserve/info names no KV side channel"
    return inst.push_info


async def start_push_pair(state: ProxyState, req: ClientRequest, prefill: Instance,
                          history: dict[str, Any] | None = None
                          ) -> tuple[DecodeLeg | web.Response, dict[str, Any] | None]:
    """The pair with `prefill` (chosen by pairing.py, a pdserve push instance) up to the decode leg's response
    headers, or the client's error response; and the prefill's answer (None without one). `history`: a decode
    instance's held history of this conversation, which the prefill reads back before pushing (multi-turn)."""
    up, api_path, decode_tokens = req.up, req.api_path, req.decode_tokens
    rid = up.rid
    local = state.config.on_prefill_failure == "decode-local"

    async def decode_locally(why: str) -> DecodeLeg | web.Response:
        logger.warning("request %s: %s; decode instance prefills locally (--on-prefill-failure decode-local)",
                       rid, why)
        return await send_decode(state, api_path, req.raw, up, tokens=decode_tokens, kv_claimed=False)

    coords = await push_coordinates(state, prefill)
    if isinstance(coords, str):
        state.metrics.error("prefill_failed")
        return error_response(502, f"prefill instance {prefill.url} cannot take push legs: {coords}",
                              "BadGatewayError", request_id=rid), None
    decode = await state.pairing.decode(wait=True, pair_with=prefill)
    if decode is None:
        return no_instance_response(state, "decode", rid), None
    if up.aborted:  # the client aborted the request (app.py): no leg after it
        return up.aborted_response(), None
    key = uuid.uuid4().hex
    decode_payload = json.dumps(build_decode_body(req.body, push_decode_params(key, **coords))).encode()
    prefill_payload = json.dumps(prefill_body(api_path, req.body, rid, history=history, push_key=key)).encode()
    up.hold(decode, decode_tokens)
    started = time.perf_counter()
    decode_task = asyncio.ensure_future(state.http().post(decode.endpoint(api_path), data=decode_payload,
                                                          headers=up.headers, timeout=state.decode_timeout))

    async def drop_decode() -> None:
        decode_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError, aiohttp.ClientError):
            (await decode_task).close()  # closing the connection aborts the leg, which cancels the push
        up.release(decode, decode_tokens)

    try:
        result = await prefill_once(state, prefill, api_path, prefill_payload, up, req.tokens)
    except BaseException:
        await drop_decode()
        raise
    if result.kv_params is None:
        await drop_decode()
        prefill.push_info = None  # it may have restarted (a new engine id or port): read it again next time
        if result.passthrough is not None:
            return result.passthrough, None
        if local and (not result.reached or state.spend_retry()):
            return await decode_locally(f"prefill failed ({result.error})"), None
        state.metrics.error("prefill_failed")
        return error_response(502, f"prefill leg failed: {result.error}", "BadGatewayError", request_id=rid), None
    try:
        resp = await decode_task
    except (TimeoutError, aiohttp.ClientError) as exc:
        up.release(decode, decode_tokens)
        state.metrics.error("decode_io")
        decode.record_failure(f"{type(exc).__name__}: {exc}", state.config.eject_after)
        return error_response(502, f"decode leg failed: {type(exc).__name__}: {exc}", "BadGatewayError",
                              request_id=rid), None
    return DecodeLeg(decode, resp, started, decode_tokens, up), result.response
