"""Multi-turn over P/D: a conversation's history held by a decode instance. Before a turn, `history_for` decides
whether its prefill reads that history back (pull), finds it in its own prefix cache, or recomputes it
(`history_decision.py`'s arithmetic); after it, `keep_history` has the decode answer tell the conversation map
(conversations.py) what the decode instance now holds. The OpenAI routes only (generate bodies carry no
conversation)."""

from __future__ import annotations

import logging
from typing import Any

from pdserve.api.pd import with_min_read_tokens
from pdserve.preflight.plan import parse_bandwidth
from pdserve.proxy.conversations import HeldHistory
from pdserve.proxy.history_decision import (
    HistoryDecision,
    HistoryPricing,
    fleet_prefill_costs,
    new_turn_tokens,
    price_history,
)
from pdserve.proxy.legs import DecodeLeg
from pdserve.proxy.pool import Instance
from pdserve.proxy.request import ClientRequest
from pdserve.proxy.state import ProxyState

logger = logging.getLogger("pdserve.proxy")


def history_for(state: ProxyState, req: ClientRequest, prefill: Instance | None = None
                ) -> tuple[dict[str, Any] | None, HistoryDecision | None]:
    """The held-history params the prefill leg should read back, with the cost model's `min_read_tokens` (None:
    none held, or recomputing is cheaper by `pdserve plan`'s arithmetic, or the prefill's own prefix cache should
    hold it), and the decision as the client is told it (None without --kv-history)."""
    if not state.config.kv_history or req.generate:
        return None, None
    held = state.history.take(req.api_path, req.body)
    holder = state.decode.get(held.decode_url) if held is not None else None
    if held is not None and prefill is not None and holder is not None and not state.pairing.pairs(prefill, holder):
        held = None  # the chosen prefill's mode differs from the holder's: their handshake would be refused
    if held is None:
        state.metrics.kv_history["none"].inc()
        return None, HistoryDecision("none", "no_history")
    # what the prefill instances already hold of this prompt: the fleet index's answer when instances publish KV
    # events, else the previous turn's prompt (its prefill cached it)
    prefix = req.prefix
    if prefix is not None:
        p_cached = prefix.best_cached(state.prefill.instances)
    else:  # a prefix cache holds whole blocks only: the previous prompt's, in the holder's block size
        block = held.block_size
        p_cached = (held.prompt_tokens or 0) // block * block if block else (held.prompt_tokens or 0)
    prompt_tokens = prefix.prompt_tokens if prefix is not None else None
    decision = _pull_choice(state, held, p_cached, new_turn_tokens(req.body, held.num_tokens, prompt_tokens))
    state.metrics.kv_history[decision.decision].inc()
    logger.info("request %s: held history of %d tokens on %s: %s (%s)", req.rid, held.num_tokens, held.decode_url,
                decision.decision, decision.header())
    if decision.decision != "pull":
        return None, decision
    return with_min_read_tokens(held.params, decision.min_read_tokens), decision


def _pull_choice(state: ProxyState, held: HeldHistory, p_cached: int, new_tokens: int) -> HistoryDecision:
    """pull / p_cache / recompute. The tokens in question are the held ones a prefill instance lacks (`p_cached`:
    what it holds; it reads only blocks it lacks), priced by `price_history` with the prefill instances'
    advertised prefill costs. A holder that does not say its block size in bytes is read from (vLLM's decode
    instances), under the prefill instance's own threshold."""
    tokens = held.num_tokens - p_cached
    if tokens <= 0:
        return HistoryDecision("p_cache", "prefill_cache", held.num_tokens, 0)
    nblocks = held.num_blocks
    if held.block_bytes is None or nblocks == 0 or held.num_tokens == 0:
        return HistoryDecision("pull", "size_unknown", held.num_tokens, tokens)
    cfg = state.config
    pricing = HistoryPricing(new_tokens, held.block_bytes * nblocks / held.num_tokens,
                             parse_bandwidth(cfg.kv_history_bandwidth), cfg.kv_history_overhead_s,
                             cfg.kv_history_prefill_tps, fleet_prefill_costs(state.prefill.instances))
    return price_history(held.num_tokens, tokens, pricing, cfg.kv_history_choice)


def keep_history(state: ProxyState, leg: DecodeLeg, req: ClientRequest, prefill_response: dict[str, Any] | None,
                 decision: HistoryDecision | None = None) -> DecodeLeg:
    """Have the decode leg's response tell the conversation map what the decode instance holds, and the client
    what was decided for this turn's history (`history_decision.py`)."""
    if not state.config.kv_history or req.generate:
        return leg
    if decision is not None:
        decision.note_prefill(prefill_response)
        leg.history_decision = decision
    usage = (prefill_response or {}).get("usage")
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    decode_url = leg.instance.url

    def remember(params: dict[str, Any]) -> None:
        if state.history.remember(req.api_path, req.body, params, decode_url,
                                  prompt_tokens if type(prompt_tokens) is int else None):
            state.metrics.kv_history["remembered"].inc()

    leg.on_kv_params = remember
    return leg
