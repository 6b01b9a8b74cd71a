"""The early decode leg's params delivery (pdserve/proxy/early_leg.py) when the decode instance breaks the
connection after the params were sent: it may have handed them to its engine, which claims the prefill's
lease before it answers, so the proxy must not send a second decode leg with the same params (seen in CI: a
decode instance SIGKILLed in that instant, and the second leg was refused the lease with a 409 blaming the
client's kv_transfer_params). A real proxy app and stand-in instances (aiohttp) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from pdserve.api.pd import KV_PARAMS_PATH
from pdserve.proxy.app import STATE_KEY, create_app
from pdserve.proxy.config import ProxyConfig

PARAMS = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "p0",
          "remote_request_id": "r0", "remote_block_ids": [0], "remote_host": "127.0.0.1", "remote_port": 1}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _serve(routes: dict[tuple[str, str], Handler], app: web.Application | None = None
                 ) -> tuple[web.AppRunner, str]:
    app = web.Application() if app is None else app
    for (method, path), handler in routes.items():
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


@pytest.mark.timeout(60)
def test_broken_params_delivery_fails_the_request_without_a_second_decode_leg() -> None:
    decode_legs: list[dict] = []
    deliveries: list[dict] = []
    done = asyncio.Event()  # the stand-ins' held handlers end when the test does

    async def hold() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 30)

    async def prefill(request: web.Request) -> web.Response:
        await request.json()
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": "m",
                                  "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                                  "kv_transfer_params": PARAMS})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"kv_params_later": True})

    async def decode_leg(request: web.Request) -> web.Response:
        decode_legs.append(await request.json())
        await hold()  # waits for the params this instance "died" taking
        return web.json_response({"choices": []})

    async def deliver(request: web.Request) -> web.Response:
        deliveries.append(await request.json())
        # the params are in (an engine would be claiming the lease now), then the instance dies: no answer
        assert request.transport is not None
        request.transport.abort()
        await hold()
        return web.json_response({})

    async def main() -> None:
        runners: list[web.AppRunner] = []
        try:
            p_runner, p_url = await _serve({("GET", "/health"): _health, ("POST", "/v1/completions"): prefill})
            d_runner, d_url = await _serve({("GET", "/health"): _health, ("GET", "/pdserve/info"): info,
                                            ("POST", "/v1/completions"): decode_leg,
                                            ("POST", KV_PARAMS_PATH): deliver})
            runners += [p_runner, d_runner]
            app = create_app(ProxyConfig(prefill=[p_url], decode=[d_url], health_interval=0.2).validate())
            proxy_runner, proxy = await _serve({}, app)
            runners.append(proxy_runner)
            state = app[STATE_KEY]
            async with aiohttp.ClientSession() as http:
                for _ in range(200):  # bounded: the instances are admitted after their first probes
                    instances = [*state.prefill.instances, *state.decode.instances]
                    if all(i.healthy for i in instances) and state.decode.instances[0].params_later:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the stand-in instances were not admitted")
                body = {"model": "m", "prompt": "hello", "max_tokens": 4}
                async with http.post(proxy + "/v1/completions", json=body,
                                     timeout=aiohttp.ClientTimeout(total=20)) as r:
                    status, answer = r.status, await r.json()
        finally:
            done.set()
            for runner in reversed(runners):
                await runner.cleanup()
        assert status == 502, answer
        assert answer["error"]["type"] == "BadGatewayError"
        assert "kv_transfer_params were delivered" in answer["error"]["message"]
        assert len(deliveries) == 1 and deliveries[0]["kv_transfer_params"] == PARAMS
        # the early leg only: no second decode leg carries the params the dead instance may have claimed with
        assert len(decode_legs) == 1, decode_legs

    asyncio.run(main())
