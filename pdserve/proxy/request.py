"""A client's generation request as the proxy reads it once, before deciding its plan (plan.py): the body, the
upstream headers, what the fleet caches of its prompt, and its size in tokens.

Two APIs come in: OpenAI's completions and chat, and the tokens-only `/inference/v1/generate` that the render
tier sends (`pdserve render` hands its P/D to a proxy). The routing rules (pdserve/api/pd.py's, protocol.py's)
read OpenAI fields; a generate body is read through `routing_view`, the same fields under their OpenAI names,
so one rule serves both. Only the prefill leg's body differs (`prefill_body`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.api.pd import (
    build_prefill_body,
    build_prefill_generate_body,
    is_batch_prompt,
    push_prefill_params,
)
from pdserve.api.scale_out_routes import GENERATE_PATH
from pdserve.proxy.errors import error_response
from pdserve.proxy.kv_routing import CachedPrefix, lookup
from pdserve.proxy.prompt_tokens import given_token_ids
from pdserve.proxy.protocol import estimate_prompt_tokens, max_output_tokens
from pdserve.proxy.state import ProxyState
from pdserve.proxy.upstream import Upstream, request_id

logger = logging.getLogger("pdserve.proxy")

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
# Longer prompts are tokenized (for routing by cached prefix) in a worker thread: ~2-3 us of CPU per token
# would stall the relays of every other request, and the HF tokenizer releases the GIL while it encodes.
INLINE_TOKENIZE_TOKENS = 256


def routing_view(api_path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The fields the routing rules read, under OpenAI's names: the body itself, or a generate body's prompt ids
    and sampling parameters."""
    if api_path != GENERATE_PATH:
        return body
    sp = body.get("sampling_params")
    sp = sp if isinstance(sp, dict) else {}
    view = {"prompt": body.get("token_ids")}
    view.update((key, sp[key]) for key in ("max_tokens", "n", "prompt_logprobs") if key in sp)
    return view


def splittable_generate(body: dict[str, Any]) -> bool:
    """A generate body the proxy can make a prefill leg of (anything else goes to one instance, which judges it)."""
    ids = body.get("token_ids")
    return isinstance(ids, list) and bool(ids) and isinstance(body.get("sampling_params", {}), dict)


def prefill_body(api_path: str, body: dict[str, Any], rid: str, *, chat_token_ids: bool = False,
                 history: dict[str, Any] | None = None, push_key: str | None = None) -> dict[str, Any]:
    """The prefill leg's body for this API (`pdserve.api.pd`'s builders). A generate body carries no held
    history (the proxy follows conversations of the OpenAI routes only)."""
    if api_path != GENERATE_PATH:
        return build_prefill_body(body, chat_token_ids=chat_token_ids, history_params=history, push_key=push_key)
    assert history is None, "held histories are followed on the OpenAI routes only"
    prefill = build_prefill_generate_body({"request_id": rid, "sampling_params": {}, **body})
    if push_key is not None:
        prefill["kv_transfer_params"] = push_prefill_params(push_key)
    return prefill


@dataclass
class ClientRequest:
    """One generation request, read: `up` its id and upstream headers (derived once), `tokens` is exact when the
    prompt token ids are known (else the characters / 4 estimate), `decode_tokens` adds the output asked for."""

    api_path: str
    body: dict[str, Any]
    raw: bytes
    up: Upstream
    prefix: CachedPrefix | None
    tokens: int
    decode_tokens: int

    @property
    def rid(self) -> str:
        return self.up.rid

    @property
    def view(self) -> dict[str, Any]:
        return routing_view(self.api_path, self.body)

    @property
    def generate(self) -> bool:
        return self.api_path == GENERATE_PATH


def upstream(state: ProxyState, request: web.Request, rid: str) -> Upstream:
    """What the request's legs send: its id, and the instances' key (--upstream-api-key, else the client's own
    Authorization when the proxy checks none)."""
    cfg = state.config
    auth = None
    if cfg.upstream_api_key:
        auth = f"Bearer {cfg.upstream_api_key}"
    elif cfg.api_key is None and "Authorization" in request.headers:
        auth = request.headers["Authorization"]
    return Upstream.of(rid, auth)


async def read_request(state: ProxyState, request: web.Request, api_path: str) -> ClientRequest | web.Response:
    """The request read (or the client's 400)."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        state.metrics.error("bad_request")
        return error_response(400, f"request body is not valid JSON: {exc}", "BadRequestError")
    if not isinstance(body, dict):
        state.metrics.error("bad_request")
        return error_response(400, "request body must be a JSON object", "BadRequestError")
    rid = request_id(request.headers.get("X-Request-Id"), api_path, body, GENERATE_PATH)
    return await client_request(state, api_path, body, raw, upstream(state, request, rid))


async def client_request(state: ProxyState, api_path: str, body: dict[str, Any], raw: bytes,
                         up: Upstream) -> ClientRequest:
    """`body` read for routing (several prompts: their prefixes are looked up per prompt, when split)."""
    view = routing_view(api_path, body)
    batch = api_path == COMPLETIONS and is_batch_prompt(body)
    prefix = None if batch else await cached_prefix(state, api_path, body, up.headers)
    tokens = prefix.prompt_tokens if prefix is not None else estimate_prompt_tokens(view)
    return ClientRequest(api_path, body, raw, up, prefix, tokens, tokens + max_output_tokens(view))


async def cached_prefix(state: ProxyState, api_path: str, body: dict[str, Any],
                        headers: dict[str, str]) -> CachedPrefix | None:
    """What each publishing instance holds of this request's prompt; None when routing by cached prefix is off,
    nobody publishes KV events, or the prompt token ids cannot be known exactly."""
    fleet, tokenizer = state.fleet, state.prompt_tokenizer
    if fleet is None or tokenizer is None or fleet.publishers() == 0:
        return None
    try:
        ids = given_token_ids(routing_view(api_path, body))
        if ids is None and api_path == GENERATE_PATH:
            return None
        if ids is None and tokenizer.local is not None:
            if estimate_prompt_tokens(body) > INLINE_TOKENIZE_TOKENS:
                ids = await asyncio.to_thread(tokenizer.local_ids, api_path, body)
            else:
                ids = tokenizer.local_ids(api_path, body)
        elif ids is None:
            inst = next((i for pool in (state.decode, state.prefill) for i in pool.instances if i.healthy), None)
            if inst is not None:
                auth = {k: v for k, v in headers.items() if k in ("Authorization", "Content-Type")}
                ids = await tokenizer.remote_ids(state.http(), inst.url, auth, api_path, body)
        if not ids:
            return None
        sizes = {inst.url: size for pool in state.pools() for inst in pool.instances
                 if (size := fleet.block_size(inst.url)) is not None}
        return lookup(fleet.index, ids, sizes, state.config.kv_overlap_weight)
    except Exception as exc:  # noqa: BLE001 - whatever the body holds, the instance judges it, not this hint
        logger.debug("no cached-prefix lookup for this request: %s: %s", type(exc).__name__, exc)
        return None
