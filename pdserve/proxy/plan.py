"""The proxy's request path as a plan: what a request becomes is decided up front (`decide`), then done
(`execute`), as SGLang's router picks the pair before it sends a leg.

The plans:

- `Local`: one instance serves the request whole: collocated (no prefill pool), prompt scoring on a prefill
  instance, conditional disaggregation (few uncached prompt tokens), or a request one lease cannot serve
  (`pdserve.api.pd.local_only_reason`). relay.relay_decode, with its retries.
- `Split`: a completions request with several prompts: one `Pair` per prompt, merged (split.py).
- `Pair`: one P/D pair, its prefill instance chosen first (its transfer mode decides the pair's shape and which
  decode instances pair with it), then what rides on it: the held history the prefill reads back (pull, multi-turn,
  turn_history.py) or else a peer's prefix (peer_pull.py, looked at when the prefill leg goes out), push
  (push_pair.py: both legs at once) or pull (pull_pair.py: the prefill with retries, the decode leg sent with it
  when an instance takes its params later, the failure policy), and whether a chat prefill returns the prompt ids.
- `Refused`: no pair can load KV (push instances only on one side, or push across engines): 502.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.api.pd import chat_prompt_ids_allowed, is_batch_prompt, local_only_reason, scores_prompt
from pdserve.proxy.errors import error_response
from pdserve.proxy.history_decision import HistoryDecision
from pdserve.proxy.legs import DecodeLeg
from pdserve.proxy.pool import Instance
from pdserve.proxy.protocol import affinity_key
from pdserve.proxy.pull_pair import open_pull_pair
from pdserve.proxy.push_pair import start_push_pair
from pdserve.proxy.relay import relay_decode, relay_leg
from pdserve.proxy.request import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    ClientRequest,
    client_request,
    splittable_generate,
)
from pdserve.proxy.split import merge, split_bodies
from pdserve.proxy.state import ProxyState
from pdserve.proxy.turn_history import history_for, keep_history

logger = logging.getLogger("pdserve.proxy")


@dataclass(frozen=True)
class Local:
    """Served whole by one instance of `role`; `path` is the metrics label, `reason` why not disaggregated."""

    path: str
    role: str = "decode"
    reason: str | None = None


@dataclass(frozen=True)
class Split:
    """Several prompts: one pair each, merged into one response."""


@dataclass(frozen=True)
class Refused:
    response: web.Response


@dataclass(frozen=True)
class Pair:
    """One P/D pair. `prefill`: the first prefill instance (None: none was available; the leg waits or the failure
    policy answers); `push`: both legs at once, the prefill WRITEs; `early`: the decode instance the pull pair's
    decode leg goes to with the prefill leg (None: after it); `history`: the held history the prefill reads back
    (None: none, or not worth it; then a peer's prefix may be); `decision`: what the client is told of it."""

    prefill: Instance | None
    push: bool
    early: Instance | None
    history: dict[str, Any] | None
    decision: HistoryDecision | None
    chat_token_ids: bool
    affinity: str | None
    count_path: bool = True


Plan = Local | Split | Pair | Refused


async def serve(state: ProxyState, request: web.Request, req: ClientRequest) -> web.StreamResponse:
    """The request read, planned (`decide`) and done (`execute`): the client's response."""
    return await execute(state, request, req, await decide(state, req))


async def decide(state: ProxyState, req: ClientRequest) -> Plan:
    cfg = state.config
    body = req.view
    if len(state.prefill) == 0:
        return Local("collocated", reason="no prefill pool")
    if req.generate and not splittable_generate(req.body):
        return Local("conditional_local", reason="a generate body the instance judges (no token_ids list, or "
                                                 "sampling_params not an object)")
    if scores_prompt(body):
        # prompt logprobs with at most one token out: a prefill and nothing else, served whole where prefills run
        # (ARCHITECTURE.md, "Prompt logprobs over P/D")
        return Local("prefill_local", "prefill", "prompt scoring (prompt logprobs, max_tokens <= 1)")
    if (local_work := _local_prefill_work(state, req)) < cfg.disagg_threshold_tokens:
        return Local("conditional_local",
                     reason=f"~{local_work} uncached prompt tokens on a decode instance < --disagg-threshold-tokens")
    if req.api_path == COMPLETIONS and is_batch_prompt(body) \
            and local_only_reason({**body, "prompt": body["prompt"][0]}, fork_n=cfg.disagg_n) is None:
        return Split()
    if (reason := local_only_reason(body, fork_n=cfg.disagg_n)) is not None:
        return Local("conditional_local", reason=reason)
    return await decide_pair(state, req)


def _local_prefill_work(state: ProxyState, req: ClientRequest) -> int:
    """Conditional disaggregation's measure: the prompt tokens a decode instance would compute itself, i.e. those
    not cached on the decode instance holding the most of this prompt."""
    if req.prefix is None:
        return req.tokens
    return req.tokens - req.prefix.best_cached(state.decode.instances)


async def decide_pair(state: ProxyState, req: ClientRequest, count_path: bool = True) -> Pair | Refused:
    cfg = state.config
    mismatch = state.pairing.mismatch()
    if mismatch is not None:  # push and pull instances only (or push across engines): no pair can load KV
        state.metrics.error("no_pair")
        return Refused(error_response(502, mismatch, "BadGatewayError", request_id=req.rid))
    view = req.view
    affinity = affinity_key(view, cfg.prefix_affinity_chars) if cfg.prefix_affinity else None
    # the prefill instance first: its transfer mode decides the pair's shape (and which decode instances pair)
    first = await state.pairing.prefill(wait=cfg.on_prefill_failure != "decode-local", affinity=affinity,
                                        prefix=req.prefix)
    history, decision = history_for(state, req, first)
    if first is not None and state.pairing.concurrent_push(first):
        return Pair(first, True, None, history, decision, False, affinity, count_path)
    early = await state.pairing.early_decode(view, first)
    body = req.body
    token_ids = (early is None and cfg.chat_token_ids and req.api_path == CHAT_COMPLETIONS
                 and chat_prompt_ids_allowed(body.get("messages"), body.get("echo")))
    return Pair(first, False, early, history, decision, token_ids, affinity, count_path)


async def open_pair(state: ProxyState, req: ClientRequest, pair: Pair) -> DecodeLeg | web.Response:
    """The pair up to the decode leg's response headers, or the client's error response."""
    if not pair.push:
        return await open_pull_pair(state, req, pair)
    assert pair.prefill is not None
    if pair.count_path:
        state.metrics.path["disagg"].inc()
    # with a held history, the prefill reads it back (pull) and pushes the request's KV on
    leg, prefill_response = await start_push_pair(state, req, pair.prefill, pair.history)
    return keep_history(state, leg, req, prefill_response, pair.decision) if isinstance(leg, DecodeLeg) else leg


async def _open_prompt(state: ProxyState, req: ClientRequest, k: int, body: dict[str, Any]) -> DecodeLeg | web.Response:
    """Prompt k of a split batch, as a request of its own (id `{rid}-{k}`), up to its decode leg's headers."""
    sub = await client_request(state, req.api_path, body, json.dumps(body).encode(), req.up.prompt(k))
    pair = await decide_pair(state, sub, count_path=False)
    return pair.response if isinstance(pair, Refused) else await open_pair(state, sub, pair)


async def execute(state: ProxyState, request: web.Request, req: ClientRequest, plan: Plan) -> web.StreamResponse:
    """The plan done: the client's response, relayed as it comes."""
    if isinstance(plan, Refused):
        return plan.response
    if isinstance(plan, Local):
        state.metrics.path[plan.path].inc()
        logger.debug("request %s: %s (%s)", req.rid, plan.path, plan.reason)
        return await relay_decode(state, request, req.api_path, req.raw, req.up, tokens=req.decode_tokens,
                                  kv_claimed=False, prefix=req.prefix, role=plan.role)
    if isinstance(plan, Split):
        state.metrics.path["disagg_split"].inc()
        legs = await asyncio.gather(*(_open_prompt(state, req, k, body)
                                      for k, body in enumerate(split_bodies(req.body))))
        return await merge(request, req.body, req.rid, list(legs))
    leg = await open_pair(state, req, plan)
    if isinstance(leg, web.Response):
        return leg
    try:
        return await relay_leg(state, request, leg)
    finally:
        leg.done()
