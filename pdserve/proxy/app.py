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

from pdserve.api.scale_out_routes import ABORT_PATH, GENERATE_PATH
from pdserve.proxy.abort import abort_requests
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.errors import error_response
from pdserve.proxy.health import HealthChecker, probe
from pdserve.proxy.plan import serve
from pdserve.proxy.pool import ROLES, Instance
from pdserve.proxy.readiness import no_instance_response
from pdserve.proxy.request import CHAT_COMPLETIONS, COMPLETIONS, read_request, upstream
from pdserve.proxy.state import ProxyState

logger = logging.getLogger("pdserve.proxy")

STATE_KEY = web.AppKey("pdserve_proxy_state", ProxyState)
MAX_BODY_BYTES = 64 * 1024 * 1024


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

    # -- generation routes ---------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT_COMPLETIONS)

    async def tokens_generate(self, request: web.Request) -> web.StreamResponse:
        """The tokens-only route the render tier sends (`pdserve render` hands its P/D to a proxy)."""
        return await self._generate(request, GENERATE_PATH)

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
        req = await read_request(self.state, request, api_path)
        if isinstance(req, web.Response):
            return req
        if api_path != GENERATE_PATH:
            return await serve(self.state, request, req)
        with self.state.requests.track(req.up):  # the tokens-only route's requests can be aborted by id
            return await serve(self.state, request, req)

    async def abort(self, request: web.Request) -> web.Response:
        """`POST /inference/v1/abort_requests` `{"request_ids": [...]}`: abort.py."""
        denied = self._unauthorized(request, self.config.api_key)
        if denied is not None:
            return denied
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            return error_response(400, f"request body is not valid JSON: {exc}", "BadRequestError")
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            return error_response(400, "the body must be {\"request_ids\": [string, ...]}", "BadRequestError")
        return web.json_response({"request_ids": ids, "num_aborted": await abort_requests(self.state, ids)})

    # -- pass-through routes (served by a decode instance) ---------------------------------------

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        denied = self._unauthorized(request, self.config.api_key)
        if denied is not None:
            return denied
        state = self.state
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = upstream(state, request, rid).headers
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
    app.router.add_post(GENERATE_PATH, handlers.tokens_generate)
    app.router.add_post(ABORT_PATH, handlers.abort)
    app.router.add_get("/v1/models", handlers.passthrough)
    app.router.add_post("/tokenize", handlers.passthrough)
    app.router.add_post("/detokenize", handlers.passthrough)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/healthcheck", handlers.healthcheck)
    app.router.add_get("/metrics", handlers.metrics_route)
    app.router.add_get("/pdserve/instances", handlers.list_instances)
    app.router.add_post("/pdserve/instances", handlers.change_instances)
    return app
