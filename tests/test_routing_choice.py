"""The instance-choice policy shared by the proxy and the render tier (pdserve/routing/choice.py), as the render
tier's engine pool uses it (the proxy's use is covered through Pool.choose in test_proxy_units.py)."""

from __future__ import annotations

import asyncio

from pdserve.render.engine_client import EnginePool


def test_render_engines_round_robin_while_idle_then_least_loaded() -> None:
    pool = EnginePool(["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"])
    try:
        picks = []
        for _ in range(6):
            lease = pool.acquire(10)
            picks.append(lease.url)
            lease.release()
        assert picks == pool.urls * 2  # the order the old round-robin had
        busy = pool.acquire(100)  # one leg in flight on the next engine in rotation
        later = []
        for _ in range(4):  # round-robin would come back to the busy engine; the least loaded choice does not
            lease = pool.acquire(1)
            later.append(lease.url)
            lease.release()
        assert busy.url not in later and len(set(later)) == 2
        busy.release()
        busy.release()  # a second release changes nothing
        assert [e.in_flight for e in pool.engines if e.url == busy.url] == [0]
    finally:
        asyncio.run(pool.close())
