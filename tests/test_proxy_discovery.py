"""The proxy's pools following a registry (pdserve/proxy/discovery.py): joins, drains, restarts at a new
address, unanswered rounds, a failing source; and the discovery loop inside a running proxy app whose
instances are real stand-in servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
from aiohttp import web

from pdserve.proxy.app import STATE_KEY, create_app
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.discovery import Discovery, Member, Reconciler
from pdserve.proxy.state import ProxyState

P1, D1, D2, D3 = "http://10.0.0.1:8100", "http://10.0.0.2:8200", "http://10.0.0.3:8200", "http://10.0.0.2:8300"


def _state(prefill: list[str], decode: list[str]) -> ProxyState:
    return ProxyState.from_config(ProxyConfig(prefill=prefill, decode=decode).validate())


def _urls(state: ProxyState) -> dict[str, list[str]]:
    return {p.role: sorted(i.url for i in p.instances) for p in state.pools()}


def test_joins_drains_and_leaves() -> None:
    state = _state([P1], [D1])
    rec = Reconciler(state)
    base = [Member("a/inst-0", "prefill", P1), Member("a/inst-1", "decode", D1)]
    assert rec.apply(base) == []
    changes = rec.apply([*base, Member("a/inst-2", "decode", D2, "starting")])  # scale-up: starting joins
    assert changes == [f"added decode {D2} (a/inst-2)"]
    assert _urls(state) == {"prefill": [P1], "decode": [D1, D2]}
    assert not state.decode.get(D2).healthy  # admitted only by its first successful /health probe
    state.decode.get(D1).acquire(10)
    changes = rec.apply([base[0], Member("a/inst-1", "decode", D1, "draining"), Member("a/inst-2", "decode", D2)])
    assert changes == [f"removed decode {D1} (1 legs in flight finish)"]
    rec.apply([base[0]])  # inst-2 gone for good
    assert _urls(state) == {"prefill": [P1], "decode": []}


def test_restart_at_new_address_and_unanswered_rounds() -> None:
    state = _state([P1], [D1])
    rec = Reconciler(state, unresponsive_after=2)
    rec.apply([Member("a/inst-0", "prefill", P1), Member("a/inst-1", "decode", D1)])
    restarting = [Member("a/inst-0", "prefill", P1), Member("a/inst-1", "unknown", None, "unknown")]
    assert rec.apply(restarting) == []  # one unanswered round: keep the last URL (health probes decide)
    assert rec.apply(restarting) == [f"removed decode {D1} (0 legs in flight finish)"]
    changes = rec.apply([Member("a/inst-0", "prefill", P1), Member("a/inst-1", "decode", D3, "starting")])
    assert changes == [f"added decode {D3} (a/inst-1)"]
    # answered again at yet another address before the old one was dropped: replaced at once
    changes = rec.apply([Member("a/inst-0", "prefill", P1), Member("a/inst-1", "decode", D2)])
    assert sorted(changes) == sorted([f"removed decode {D3} (0 legs in flight finish)", f"added decode {D2} (a/inst-1)"])


def test_role_switch_and_collocated() -> None:
    state = _state([P1], [D1])
    rec = Reconciler(state)
    rec.apply([Member("a/inst-0", "prefill", P1), Member("a/inst-1", "decode", D1)])
    # inst-1's placement now runs a prefill instance (a new actor at a new address)
    rec.apply([Member("a/inst-0", "prefill", P1), Member("a/inst-2", "prefill", D2)])
    assert _urls(state) == {"prefill": [P1, D2], "decode": []}
    rec.apply([Member("b/inst-0", "collocated", D3)])
    assert _urls(state) == {"prefill": [], "decode": [D3]}


def test_failed_and_stopped_members_leave() -> None:
    state = _state([P1], [D1])
    rec = Reconciler(state)
    rec.apply([Member("a/inst-0", "prefill", P1, "failed"), Member("a/inst-1", "decode", D1, "stopping")])
    assert _urls(state) == {"prefill": [], "decode": []}


async def _standin(port_box: list[int], stop: asyncio.Event) -> None:
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port_box.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    await stop.wait()
    await runner.cleanup()


@pytest.mark.timeout(60)
def test_discovery_loop_in_a_running_proxy() -> None:
    """A proxy app started with one decode URL follows a source that adds a second one and then reports
    a failing registry: the new instance is probed and admitted, a failing source changes nothing."""

    async def main() -> None:
        stop = asyncio.Event()
        ports: list[int] = []
        servers = [asyncio.create_task(_standin(ports, stop)) for _ in range(2)]
        while len(ports) < 2:
            await asyncio.sleep(0.01)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        members = [Member("x/inst-0", "decode", urls[0])]
        broken = threading.Event()

        def source() -> list[Member]:
            if broken.is_set():
                raise ConnectionError("GCS unreachable")
            return list(members)

        app = create_app(ProxyConfig(decode=[urls[0]], health_interval=0.2))
        state = app[STATE_KEY]
        discovery = Discovery(state, source, interval=0.1)
        app.cleanup_ctx.append(discovery.cleanup_ctx())
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        proxy = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            members.append(Member("x/inst-1", "decode", urls[1], "starting"))
            async with aiohttp.ClientSession() as http:
                for _ in range(100):
                    async with http.get(proxy + "/pdserve/instances") as r:
                        listing = await r.json()
                    if sorted(i["url"] for i in listing["decode"] if i["healthy"]) == sorted(urls):
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError(f"second instance not admitted: {listing}")
                broken.set()
                rounds = discovery.rounds
                await asyncio.sleep(0.4)
                assert discovery.rounds == rounds  # failing rounds do not count, and change nothing
                assert len(state.decode) == 2
        finally:
            await runner.cleanup()
            stop.set()
            await asyncio.gather(*servers)

    asyncio.run(main())
