"""One P/D pair in pull mode, up to the decode leg's response headers: the prefill leg (retried on other instances,
legs.run_prefill), the decode leg sent with it when the plan chose one (early_leg.py), the failure policy
(--on-prefill-failure), then the decode leg carrying the prefill's kv_transfer_params (legs.send_decode), which
the multi-turn history's bookkeeping takes (turn_history.keep_history)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from pdserve.api.pd import build_decode_body, prefill_prompt_token_ids
from pdserve.proxy.early_leg import EarlyDecodeLeg
from pdserve.proxy.errors import error_response
from pdserve.proxy.legs import DecodeLeg, run_prefill, send_decode
from pdserve.proxy.readiness import no_instance_response
from pdserve.proxy.request import ClientRequest, prefill_body
from pdserve.proxy.retry import retry_after_header
from pdserve.proxy.state import ProxyState
from pdserve.proxy.turn_history import keep_history

if TYPE_CHECKING:
    from pdserve.proxy.plan import Pair

logger = logging.getLogger("pdserve.proxy")


async def open_pull_pair(state: ProxyState, req: ClientRequest, pair: Pair) -> DecodeLeg | web.Response:
    cfg = state.config
    up = req.up
    rid = up.rid
    payload = json.dumps(prefill_body(req.api_path, req.body, rid, chat_token_ids=pair.chat_token_ids,
                                      history=pair.history)).encode()
    prefill = asyncio.ensure_future(
        run_prefill(state, req.api_path, payload, up, req.tokens, pair.affinity, req.prefix,
                    peer_pull=pair.history is None, first=(pair.prefill,)))
    # the prefill leg's task runs first (to its first wait on the network), then the decode leg's
    early = None if pair.early is None else EarlyDecodeLeg.send(state, pair.early, req.api_path, req.body, up,
                                                                req.decode_tokens)
    try:
        result = await prefill  # cancelled with this request (client gone), which cancels the task too
    except BaseException:
        if early is not None:
            await early.cancel()
        raise
    if early is not None and result.instance is not None and not state.pairing.pairs(result.instance, early.inst):
        await early.cancel()  # the prefill's answer taught its mode (vllm#50620): that decode does not pair
        early = None
    if early is not None:
        if result.kv_params is not None:
            if pair.count_path:
                state.metrics.path["disagg"].inc()
            leg = await early.finish(result.kv_params)
            if isinstance(leg, DecodeLeg):
                return keep_history(state, leg, req, result.response, pair.decision)
            if leg is not None:
                return leg
            # the early leg never reached its instance: the ordinary decode leg (the lease is unclaimed)
        else:
            await early.cancel()  # closing its connection aborts it on the decode instance
    if result.passthrough is not None:
        return result.passthrough
    if result.kv_params is None:
        # A fallback after a prefill that did work repeats it: paid from the retry budget.
        if cfg.on_prefill_failure == "decode-local" and (not result.reached or state.spend_retry()):
            logger.warning("request %s: prefill failed (%s); decode instance prefills locally "
                           "(--on-prefill-failure decode-local)", rid, result.error)
            if pair.count_path:
                state.metrics.path["decode_local_fallback"].inc()
            return await send_decode(state, req.api_path, req.raw, up, tokens=req.decode_tokens,
                                     kv_claimed=False, prefix=req.prefix)
        if result.unavailable:
            return no_instance_response(state, "prefill", rid, result.retry_after)
        state.metrics.error("prefill_failed")
        if result.retry_after is not None:  # the prefill instance asked for a pause: pass it on
            return error_response(503, f"prefill instance busy: {result.error}", "ServiceUnavailableError",
                                  request_id=rid, headers={"Retry-After": retry_after_header(result.retry_after)})
        logger.warning("request %s: prefill failed (%s); answering 502 (--on-prefill-failure %s)", rid, result.error,
                       cfg.on_prefill_failure)
        return error_response(502, f"prefill leg failed: {result.error}", "BadGatewayError", request_id=rid)
    assert result.response is not None and result.instance is not None
    prompt_ids = prefill_prompt_token_ids(result.response) if pair.chat_token_ids else None
    remote_host = result.instance.host if cfg.rewrite_remote_host else None
    decode_body = build_decode_body(req.body, result.kv_params, prompt_token_ids=prompt_ids, remote_host=remote_host)
    if pair.count_path:
        state.metrics.path["disagg"].inc()
    logger.debug("request %s: disagg via %s", rid, result.instance.url)
    leg = await send_decode(state, req.api_path, json.dumps(decode_body).encode(), up,
                            tokens=req.decode_tokens, kv_claimed=True, pair_with=result.instance)
    return keep_history(state, leg, req, result.response, pair.decision) if isinstance(leg, DecodeLeg) else leg
