"""The proxy's aiohttp application: client routes, admin routes, health and metrics."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.api.pd import (
    build_decode_body,
    build_prefill_body,
    chat_prompt_ids_allowed,
    is_batch_prompt,
    local_only_reason,
    prefill_prompt_token_ids,
    scores_prompt,
)
from pdserve.preflight.plan import parse_bandwidth
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.conversations import HeldHistory
from pdserve.proxy.early_leg import EarlyDecodeLeg
from pdserve.proxy.errors import error_response
from pdserve.proxy.health import HealthChecker, probe
from pdserve.proxy.history_decision import (
    HistoryDecision,
    fleet_recompute_info,
    new_turn_tokens,
    price_history,
)
from pdserve.proxy.kv_routing import CachedPrefix, lookup
from pdserve.proxy.legs import (
    DecodeLeg,
    no_instance_response,
    relay_decode,
    relay_leg,
    run_prefill,
    send_decode,
)
from pdserve.proxy.pool import ROLES, Instance
from pdserve.proxy.prompt_tokens import given_token_ids
from pdserve.proxy.protocol import affinity_key, estimate_prompt_tokens, max_output_tokens
from pdserve.proxy.push_pair import start_push_pair
from pdserve.proxy.retry import retry_after_header
from pdserve.proxy.split import serve_batch
from pdserve.proxy.state import ProxyState

logger = logging.getLogger("pdserve.proxy")

STATE_KEY = web.AppKey("pdserve_proxy_state", ProxyState)
MAX_BODY_BYTES = 64 * 1024 * 1024
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
# Longer prompts are tokenized (for routing by cached prefix) in a worker thread: ~2-3 us of CPU per token
# would stall the relays of every other request, and the HF tokenizer releases the GIL while it encodes.
INLINE_TOKENIZE_TOKENS = 256


def _bearer_ok(request: web.Request, key: str | None) -> bool:
    if key is None:
        return True
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())


class ProxyHandlers:
    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.config = state.config
        self.metrics = state.metrics

    # -- helpers ------------------------------------------------------------------------------

    def _unauthorized(self, request: web.Request, key: str | None) -> web.Response | None:
        if _bearer_ok(request, key):
            return None
        self.metrics.error("unauthorized")
        return error_response(
            401,
            "missing or wrong API key (expected 'Authorization: Bearer <key>')",
            "AuthenticationError",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def _upstream_headers(self, request: web.Request, rid: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": rid}
        if self.config.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.config.upstream_api_key}"
        elif self.config.api_key is None and "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    # -- generation routes ---------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT_COMPLETIONS)

    async def _generate(self, request: web.Request, api_path: str) -> web.StreamResponse:
        denied = self._unauthorized(request, self.config.api_key)
        if denied is not None:
            return denied
        state = self.state
        if state.in_flight >= self.config.max_inflight:
            self.metrics.error("overload")
            return error_response(
                503,
                f"proxy overloaded: {state.in_flight} requests in flight (--max-inflight)",
                "ServiceUnavailableError",
                headers={"Retry-After": "1"},
            )
        started = time.perf_counter()
        state.retry_budget.deposit()
        state.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            return await self._route(request, api_path)
        except asyncio.CancelledError:
            self.metrics.error("client_disconnect")
            raise
        finally:
            state.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.request_seconds.observe(time.perf_counter() - started)

    async def _route(self, request: web.Request, api_path: str) -> web.StreamResponse:
        cfg = self.config
        state = self.state
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            self.metrics.error("bad_request")
            return error_response(400, f"request body is not valid JSON: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            self.metrics.error("bad_request")
            return error_response(400, "request body must be a JSON object", "BadRequestError")
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = self._upstream_headers(request, rid)
        batch = api_path == COMPLETIONS and is_batch_prompt(body)
        prefix = None if batch else await self.cached_prefix(api_path, body, headers)
        # exact when the prompt token ids are known, else the characters / 4 estimate
        tokens = prefix.prompt_tokens if prefix is not None else estimate_prompt_tokens(body)
        decode_tokens = tokens + max_output_tokens(body)

        reason = None
        role = "decode"
        if len(state.prefill) == 0:
            path = "collocated"
        elif scores_prompt(body):
            # prompt logprobs with at most one token out: a prefill and nothing else, served whole where
            # prefills run (ARCHITECTURE.md, "Prompt logprobs over P/D")
            path, role, reason = "prefill_local", "prefill", "prompt scoring (prompt logprobs, max_tokens <= 1)"
        elif (local_work := self._local_prefill_work(tokens, prefix)) < cfg.disagg_threshold_tokens:
            path = "conditional_local"
            reason = f"~{local_work} uncached prompt tokens on a decode instance < --disagg-threshold-tokens"
        elif batch and local_only_reason({**body, "prompt": body["prompt"][0]}, fork_n=cfg.disagg_n) is None:
            # several prompts: one P/D pair each, merged into one response
            self.metrics.path["disagg_split"].inc()

            async def pair(sub: dict[str, Any], sub_headers: dict[str, str]) -> DecodeLeg | web.Response:
                sub_prefix = await self.cached_prefix(api_path, sub, sub_headers)
                sub_tokens = sub_prefix.prompt_tokens if sub_prefix is not None else estimate_prompt_tokens(sub)
                return await self.start_pair(api_path, sub, json.dumps(sub).encode(), sub_headers, sub_tokens,
                                             sub_tokens + max_output_tokens(sub), count_path=False, prefix=sub_prefix)

            return await serve_batch(request, body, headers, pair)
        elif (reason := local_only_reason(body, fork_n=cfg.disagg_n)) is not None:
            path = "conditional_local"
        else:
            leg = await self.start_pair(api_path, body, raw, headers, tokens, decode_tokens, prefix=prefix)
            if isinstance(leg, web.Response):
                return leg
            try:
                return await relay_leg(self.state, request, leg, rid)
            finally:
                leg.done()
        self.metrics.path[path].inc()
        logger.debug("request %s: %s (%s)", rid, path, reason or "no prefill pool")
        return await relay_decode(
            state, request, api_path, raw, headers, tokens=decode_tokens, kv_claimed=False, prefix=prefix, role=role
        )

    def _local_prefill_work(self, tokens: int, prefix: CachedPrefix | None) -> int:
        """Conditional disaggregation's measure: the prompt tokens a decode instance would compute itself,
        i.e. those not cached on the decode instance holding the most of this prompt."""
        if prefix is None:
            return tokens
        return tokens - prefix.best_cached(self.state.decode.instances)

    async def cached_prefix(self, api_path: str, body: dict[str, Any], headers: dict[str, str]) -> CachedPrefix | None:
        """What each publishing instance holds of this request's prompt; None when routing by cached prefix
        is off, nobody publishes KV events, or the prompt token ids cannot be known exactly."""
        state = self.state
        fleet, tokenizer = state.fleet, state.prompt_tokenizer
        if fleet is None or tokenizer is None or fleet.publishers() == 0:
            return None
        try:
            ids = given_token_ids(body)
            if ids is None and tokenizer.local is not None:
                if estimate_prompt_tokens(body) > INLINE_TOKENIZE_TOKENS:
                    ids = await asyncio.to_thread(tokenizer.local_ids, api_path, body)
                else:
                    ids = tokenizer.local_ids(api_path, body)
            elif ids is None:
                inst = next((i for pool in (state.decode, state.prefill) for i in pool.instances if i.healthy), None)
                if inst is not None:
                    ids = await tokenizer.remote_ids(state.http(), inst.url, self._tokenize_headers(headers),
                                                     api_path, body)
            if not ids:
                return None
            sizes = {inst.url: size for pool in state.pools() for inst in pool.instances
                     if (size := fleet.block_size(inst.url)) is not None}
            return lookup(fleet.index, ids, sizes, self.config.kv_overlap_weight)
        except Exception as exc:  # noqa: BLE001 - whatever the body holds, the instance judges it, not this hint
            logger.debug("no cached-prefix lookup for this request: %s: %s", type(exc).__name__, exc)
            return None

    @staticmethod
    def _tokenize_headers(headers: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in headers.items() if k in ("Authorization", "Content-Type")}

    async def start_pair(
        self,
        api_path: str,
        body: dict[str, Any],
        raw: bytes,
        headers: dict[str, str],
        tokens: int,
        decode_tokens: int,
        count_path: bool = True,
        prefix: CachedPrefix | None = None,
    ) -> DecodeLeg | web.Response:
        """One P/D pair up to the decode leg's response headers (or the client's error response): the
        prefill leg, its failure policy, then the decode leg with the prefill's kv_transfer_params."""
        cfg = self.config
        state = self.state
        rid = headers["X-Request-Id"]
        mismatch = state.pairing.mismatch()
        if mismatch is not None:  # push and pull instances only (or push across engines): no pair can load KV
            self.metrics.error("no_pair")
            return error_response(502, mismatch, "BadGatewayError", request_id=rid)
        affinity = affinity_key(body, cfg.prefix_affinity_chars) if cfg.prefix_affinity else None
        # the prefill instance first: its transfer mode decides the pair's shape (and which decode instances pair)
        first = await state.pairing.prefill(wait=cfg.on_prefill_failure != "decode-local", affinity=affinity,
                                            prefix=prefix)
        history, decision = self._history_for(api_path, body, rid, prefix, first)
        if first is not None and state.pairing.concurrent_push(first):
            if count_path:
                self.metrics.path["disagg"].inc()
            # with a held history, the prefill reads it back (pull) and pushes the request's KV on
            leg, prefill_response = await start_push_pair(state, api_path, body, raw, headers, tokens,
                                                          decode_tokens, first, history)
            return self._keep_history(leg, api_path, body, prefill_response, decision)
        early_inst = await state.pairing.early_decode(body, first)
        token_ids = (early_inst is None and cfg.chat_token_ids and api_path == CHAT_COMPLETIONS
                     and chat_prompt_ids_allowed(body.get("messages"), body.get("echo")))
        prefill_payload = json.dumps(build_prefill_body(body, chat_token_ids=token_ids,
                                                        history_params=history)).encode()
        prefill = asyncio.ensure_future(
            run_prefill(state, api_path, prefill_payload, headers, tokens, affinity, prefix,
                        peer_pull=history is None, first=(first,)))
        # the prefill leg's task runs first (to its first wait on the network), then the decode leg's
        early = None if early_inst is None else EarlyDecodeLeg.send(state, early_inst, api_path, body, headers,
                                                                      decode_tokens)
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
                if count_path:
                    self.metrics.path["disagg"].inc()
                leg = await early.finish(result.kv_params)
                if leg is not None:
                    return self._keep_history(leg, api_path, body, result.response, decision)
                # the early leg never reached its instance: the ordinary decode leg (the lease is unclaimed)
                early = None
            else:
                await early.cancel()  # closing its connection aborts it on the decode instance
        if result.passthrough is not None:
            return result.passthrough
        if result.kv_params is None:
            # A fallback after a prefill that did work repeats it: paid from the retry budget.
            if cfg.on_prefill_failure == "decode-local" and (not result.reached or state.spend_retry()):
                logger.warning(
                    "request %s: prefill failed (%s); decode instance prefills locally "
                    "(--on-prefill-failure decode-local)",
                    rid,
                    result.error,
                )
                if count_path:
                    self.metrics.path["decode_local_fallback"].inc()
                return await send_decode(state, api_path, raw, headers, tokens=decode_tokens, kv_claimed=False,
                                         prefix=prefix)
            if result.unavailable:
                return no_instance_response(state, "prefill", rid, result.retry_after)
            self.metrics.error("prefill_failed")
            if result.retry_after is not None:  # the prefill instance asked for a pause: pass it on
                return error_response(
                    503,
                    f"prefill instance busy: {result.error}",
                    "ServiceUnavailableError",
                    request_id=rid,
                    headers={"Retry-After": retry_after_header(result.retry_after)},
                )
            logger.warning(
                "request %s: prefill failed (%s); answering 502 (--on-prefill-failure %s)",
                rid,
                result.error,
                cfg.on_prefill_failure,
            )
            return error_response(
                502, f"prefill leg failed: {result.error}", "BadGatewayError", request_id=rid
            )
        assert result.response is not None and result.instance is not None
        prompt_ids = prefill_prompt_token_ids(result.response) if token_ids else None
        remote_host = result.instance.host if cfg.rewrite_remote_host else None
        decode_body = build_decode_body(
            body, result.kv_params, prompt_token_ids=prompt_ids, remote_host=remote_host
        )
        if count_path:
            self.metrics.path["disagg"].inc()
        logger.debug("request %s: disagg via %s", rid, result.instance.url)
        leg = await send_decode(
            state, api_path, json.dumps(decode_body).encode(), headers, tokens=decode_tokens, kv_claimed=True,
            pair_with=result.instance,
        )
        return self._keep_history(leg, api_path, body, result.response, decision)

    # -- multi-turn: a conversation's history held by a decode instance ----------------------------

    def _keep_history(self, leg: DecodeLeg | web.Response, api_path: str, body: dict[str, Any],
                      prefill_response: dict[str, Any] | None,
                      decision: HistoryDecision | None = None) -> DecodeLeg | web.Response:
        """Have the decode leg's response tell the conversation map what the decode instance holds, and the
        client what was decided for this turn's history (`history_decision.py`)."""
        if not isinstance(leg, DecodeLeg) or not self.config.kv_history:
            return leg
        if decision is not None:
            decision.note_prefill(prefill_response)
            leg.history_decision = decision
        usage = (prefill_response or {}).get("usage")
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        decode_url = leg.instance.url

        def remember(params: dict[str, Any]) -> None:
            if self.state.history.remember(api_path, body, params, decode_url,
                                           prompt_tokens if type(prompt_tokens) is int else None):
                self.metrics.kv_history["remembered"].inc()

        leg.on_kv_params = remember
        return leg

    def _history_for(self, api_path: str, body: dict[str, Any], rid: str, prefix: CachedPrefix | None = None,
                     prefill: Instance | None = None) -> tuple[dict[str, Any] | None, HistoryDecision | None]:
        """The held-history params the prefill leg should read back (None: none held, or recomputing is
        cheaper by `pdserve plan`'s arithmetic, or the prefill's own prefix cache should hold it), and the
        decision as the client is told it (None without --kv-history)."""
        if not self.config.kv_history:
            return None, None
        held = self.state.history.take(api_path, body)
        holder = self.state.decode.get(held.decode_url) if held is not None else None
        if held is not None and prefill is not None and holder is not None \
                and not self.state.pairing.pairs(prefill, holder):
            held = None  # the chosen prefill's mode differs from the holder's: their handshake would be refused
        if held is None:
            self.metrics.kv_history["none"].inc()
            return None, HistoryDecision("none", "no_history")
        # what the prefill instances already hold of this prompt: the fleet index's answer when instances
        # publish KV events, else the previous turn's prompt (its prefill cached it)
        if prefix is not None:
            p_cached = prefix.best_cached(self.state.prefill.instances)
        else:  # a prefix cache holds whole blocks only: the previous prompt's, in the holder's block size
            block = held.block_size
            p_cached = (held.prompt_tokens or 0) // block * block if block else (held.prompt_tokens or 0)
        prompt_tokens = prefix.prompt_tokens if prefix is not None else None
        decision = self._pull_choice(held, p_cached, new_turn_tokens(body, held.num_tokens, prompt_tokens))
        self.metrics.kv_history[decision.decision].inc()
        logger.info("request %s: held history of %d tokens on %s: %s (%s)", rid, held.num_tokens, held.decode_url,
                    decision.decision, decision.header())
        return (held.params if decision.decision == "pull" else None), decision

    def _pull_choice(self, held: HeldHistory, p_cached: int, new_tokens: int) -> HistoryDecision:
        """pull / p_cache / recompute. The tokens in question are the held ones a prefill instance lacks
        (`p_cached`: what it holds; it reads only blocks it lacks), priced by `price_history` with the prefill
        fleet's advertised roofline and kv_recompute_threshold. A holder that does not say its block size in
        bytes is read from (vLLM's decode instances)."""
        tokens = held.num_tokens - p_cached
        if tokens <= 0:
            return HistoryDecision("p_cache", "prefill_cache", held.num_tokens, 0)
        nblocks = held.num_blocks
        if held.block_bytes is None or nblocks == 0 or held.num_tokens == 0:
            return HistoryDecision("pull", "size_unknown", held.num_tokens, tokens)
        fleet = fleet_recompute_info(self.state.prefill.instances)
        cfg = self.config
        return price_history(held.num_tokens, tokens, new_tokens, held.block_bytes * nblocks / held.num_tokens,
                             parse_bandwidth(cfg.kv_history_bandwidth), cfg.kv_history_overhead_s,
                             cfg.kv_history_prefill_tps, fleet.roofline, fleet.threshold, cfg.kv_history_choice)

    # -- pass-through routes (served by a decode instance) ---------------------------------------

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        denied = self._unauthorized(request, self.config.api_key)
        if denied is not None:
            return denied
        state = self.state
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = self._upstream_headers(request, rid)
        data = await request.read() if request.can_read_body else None
        tried: list[Instance] = []
        last = "no decode instance available"
        for attempt in range(1 + self.config.decode_retries):
            inst = await state.pairing.decode(tried, wait=attempt == 0)
            if inst is None:
                break
            tried.append(inst)
            try:
                async with state.http().request(
                    request.method,
                    inst.endpoint(request.path),
                    data=data,
                    headers=headers,
                    timeout=state.prefill_timeout,
                ) as resp:
                    body = await resp.read()
                    ctype = resp.headers.get("Content-Type", "application/json")
                    status = resp.status
            except (TimeoutError, aiohttp.ClientError) as exc:
                last = f"{inst.url}: {type(exc).__name__}: {exc}"
                inst.record_failure(last, self.config.eject_after)
                continue
            return web.Response(status=status, body=body, headers={"Content-Type": ctype})
        if not tried:
            return no_instance_response(state, "decode", rid)
        return error_response(502, last, "BadGatewayError")

    # -- operational routes -----------------------------------------------------------------------

    def _serving_state(self) -> tuple[bool, dict[str, Any]]:
        state = self.state
        decode_ok = state.decode.healthy_count() > 0
        prefill_ok = (
            len(state.prefill) == 0
            or state.prefill.healthy_count() > 0
            or self.config.on_prefill_failure == "decode-local"
        )
        info = {
            "prefill_instances": len(state.prefill),
            "prefill_healthy": state.prefill.healthy_count(),
            "decode_instances": len(state.decode),
            "decode_healthy": state.decode.healthy_count(),
            "in_flight": state.in_flight,
        }
        return decode_ok and prefill_ok, info

    async def health(self, request: web.Request) -> web.Response:
        ok, info = self._serving_state()
        return web.json_response({"status": "ok" if ok else "unavailable", **info}, status=200 if ok else 503)

    async def healthcheck(self, request: web.Request) -> web.Response:
        """vLLM toy proxy's route, for tools that probe it."""
        _, info = self._serving_state()
        return web.json_response(
            {
                "status": "ok",
                "prefill_instances": info["prefill_instances"],
                "decode_instances": info["decode_instances"],
            }
        )

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _listing(self) -> dict[str, list[dict[str, Any]]]:
        return {pool.role: [self._instance_json(inst) for inst in pool.instances] for pool in self.state.pools()}

    def _instance_json(self, inst: Instance) -> dict[str, Any]:
        out = inst.to_json()
        fleet = self.state.fleet
        if fleet is not None:
            # subscribed: the proxy follows its KV events; blocks: what the fleet-wide index holds of it
            out["kv_events"] = {"subscribed": fleet.publishing(inst.url), "connected": fleet.connected(inst.url),
                                "blocks": fleet.index.instance_blocks(inst.url)}
        return out

    async def list_instances(self, request: web.Request) -> web.Response:
        """Read-only, open like /health and /metrics (which carry the same URLs and health states)."""
        return web.json_response(self._listing())

    async def change_instances(self, request: web.Request) -> web.Response:
        """POST {"action": "add"|"remove", "role": "prefill"|"decode", "url": "host:port"}; off without
        --admin-key."""
        if self.config.admin_key is None:
            self.metrics.error("unauthorized")
            return error_response(
                403,
                "the admin route is off: start the proxy with --admin-key KEY (or env PDSERVE_ADMIN_KEY) to "
                "add or remove instances",
                "PermissionDeniedError",
            )
        denied = self._unauthorized(request, self.config.admin_key)
        if denied is not None:
            return denied
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "body must be JSON", "BadRequestError")
        if not isinstance(body, dict):
            return error_response(400, "body must be a JSON object", "BadRequestError")
        action, role, url = body.get("action"), body.get("role"), body.get("url")
        if action not in ("add", "remove") or role not in ROLES or not isinstance(url, str):
            return error_response(
                400,
                'expected {"action": "add"|"remove", "role": "prefill"|"decode", "url": "http://host:port"}',
                "BadRequestError",
            )
        pool = self.state.pool(role)
        try:
            if action == "add":
                inst = pool.add(url, healthy=False)
                # Admitted at once when it answers /health; otherwise the health loop admits it later.
                reason = await probe(self.state.http(), inst, self.config.health_timeout)
                if reason is None:
                    inst.record_success()
                    self.state.readiness.notify()
                else:
                    inst.last_error = reason
                logger.warning("admin: added %s instance %s (healthy: %s)", role, inst.url, inst.healthy)
            else:
                target = pool.get(url)
                if target is None:
                    return error_response(404, f"no {role} instance {url}", "NotFoundError")
                if role == "decode" and len(pool) == 1:
                    return error_response(409, "cannot remove the last decode instance", "ConflictError")
                pool.remove(url)
                logger.warning(
                    "admin: removed %s instance %s (%d legs in flight finish)",
                    role,
                    target.url,
                    target.in_flight,
                )
        except ValueError as exc:
            status = 409 if "already registered" in str(exc) else 400
            return error_response(status, str(exc), "ConflictError" if status == 409 else "BadRequestError")
        return web.json_response(self._listing())


def create_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application (serve it with handler_cancellation=True so that a client
    disconnect cancels the handler and so closes the upstream connection)."""
    config.validate()
    state = ProxyState.from_config(config)
    handlers = ProxyHandlers(state)
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[STATE_KEY] = state

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await state.open()
        checker = HealthChecker(
            state.http(),
            state.pools,
            interval=config.health_interval,
            timeout=config.health_timeout,
            eject_after=config.eject_after,
            on_admit=state.readiness.notify,
        )
        state.checker = checker
        checker.start()
        if state.fleet is not None:
            state.fleet.start()
        yield
        if state.fleet is not None:
            await state.fleet.stop()
        state.checker = None
        await checker.stop()
        await state.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post(COMPLETIONS, handlers.completions)
    app.router.add_post(CHAT_COMPLETIONS, handlers.chat_completions)
    app.router.add_get("/v1/models", handlers.passthrough)
    app.router.add_post("/tokenize", handlers.passthrough)
    app.router.add_post("/detokenize", handlers.passthrough)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/healthcheck", handlers.healthcheck)
    app.router.add_get("/metrics", handlers.metrics_route)
    app.router.add_get("/pdserve/instances", handlers.list_instances)
    app.router.add_post("/pdserve/instances", handlers.change_instances)
    return app
