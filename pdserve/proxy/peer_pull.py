"""Pulling a prefix from a peer (issue 18 part 4): the chosen prefill instance lacks a prompt prefix that
another instance (prefill or decode) has in its prefix cache.

The fleet index says who caches how much. When a peer that pins on demand (`kv_peer_pin` in its
/pdserve/info) caches at least `--kv-peer-pull-min-tokens` more of the prompt than the chosen prefill, the
proxy asks it to pin them (`POST /pdserve/kv/pin`, pdserve/server/kv_pin.py): it answers the params of a held
conversation (multi-turn's shape), which the prefill leg then carries exactly as a held history's, so the
prefill reads the blocks it lacks with that machinery (hash-checked, claim / NIXL READ / release-with-verify;
anything expired, evicted or unreachable is recomputed there, never a wrong token). Multi-turn's cost model
(`history_decision.HistoryPricing`: the same link and per-read figures, recompute at the margin from the chosen
prefill's measured prefill cost, else the prefill rate) decides with the pinned size in bytes, and a pull carries
its break-even (`min_read_tokens`) as a held history's does; a pin not used is left to its short lease
(`peer_pin_ttl_s`) or given way under pool pressure. One log line and one
`pdserve_proxy_kv_peer_pulls_total{outcome}` count per question asked.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import aiohttp

from pdserve.api.pd import (
    PIN_PATH,
    held_block_bytes,
    held_num_blocks,
    held_num_tokens,
    pin_body,
    prefix_prefill_params,
    with_min_read_tokens,
)
from pdserve.preflight.plan import parse_bandwidth
from pdserve.proxy.history_decision import HistoryPricing, fleet_prefill_costs
from pdserve.proxy.kv_routing import CachedPrefix
from pdserve.proxy.pool import Instance

if TYPE_CHECKING:
    from pdserve.proxy.state import ProxyState
    from pdserve.proxy.upstream import Upstream

logger = logging.getLogger("pdserve.proxy")

PIN_TIMEOUT_S = 2.0


async def with_peer_prefix(state: ProxyState, chosen: Instance, payload: bytes, prefix: CachedPrefix | None,
                           up: Upstream) -> bytes:
    """The prefill leg's body, carrying a peer's pinned prefix when that is worth it; else `payload` as is."""
    if prefix is None or not state.config.kv_peer_pull:
        return payload
    peer = state.pairing.peer(chosen, prefix)
    if peer is None:
        return payload
    have = prefix.cached_tokens(chosen)
    rid = up.rid
    auth = {k: v for k, v in up.headers.items() if k == "Authorization"}  # the instances' --api-key, if any
    outcome, params = await _pin(state, peer, prefix, have + state.config.kv_peer_pull_min_tokens, auth)
    detail = ""
    min_read = None
    if params is not None:
        held_tokens = held_num_tokens(params)
        tokens = held_tokens - have
        block_bytes = held_block_bytes(params)
        nblocks = held_num_blocks(params)
        if block_bytes is not None and nblocks and tokens > 0:
            cfg = state.config
            pricing = HistoryPricing(max(prefix.prompt_tokens - held_tokens, 1), block_bytes * nblocks / held_tokens,
                                     parse_bandwidth(cfg.kv_history_bandwidth), cfg.kv_history_overhead_s,
                                     cfg.kv_history_prefill_tps, fleet_prefill_costs([chosen]))
            choice = pricing.at(tokens)
            min_read = pricing.break_even(tokens) if choice.pull else None
            outcome, detail = ("pull" if choice.pull else "recompute"), choice.describe()
        elif tokens <= 0:
            outcome = "uncached"
    state.metrics.kv_peer_pulls[outcome].inc()
    logger.info("request %s: prefill %s caches %d of %d prompt tokens, peer %s ~%d: %s%s", rid, chosen.url, have,
                prefix.prompt_tokens, peer.url, prefix.cached_tokens(peer), outcome, f" ({detail})" if detail else "")
    if outcome != "pull" or params is None:
        return payload
    body = json.loads(payload)
    body["kv_transfer_params"] = prefix_prefill_params(with_min_read_tokens(params, min_read))
    return json.dumps(body).encode()


async def _pin(state: ProxyState, peer: Instance, prefix: CachedPrefix,
               min_tokens: int, headers: dict[str, str]) -> tuple[str, dict[str, Any] | None]:
    """(outcome, params): the peer's pinned prefix, or why there is none."""
    try:
        async with state.http().post(peer.endpoint(PIN_PATH),
                                     json=pin_body(prefix.token_ids, min_tokens),
                                     headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=PIN_TIMEOUT_S)) as resp:
            if resp.status in (404, 503):
                return "refused", None
            if resp.status != 200:
                return "failed", None
            params = (await resp.json()).get("kv_transfer_params")
    except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError) as exc:
        logger.debug("pin on %s: %s", peer.url, exc)
        return "failed", None
    return ("uncached", None) if not isinstance(params, dict) else ("pull", params)
