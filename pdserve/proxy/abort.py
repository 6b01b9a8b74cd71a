"""`POST /inference/v1/abort_requests` through the proxy: vLLM's tokens-only abort (its disaggregated-everything API,
vllm/entrypoints/serve/disagg/api_router.py `abort_requests`: `{"request_ids": [...]}`, 400 without them), which
the render tier sends its P/D proxy when it stops a request early. The requests it names are marked aborted (no leg
of theirs is retried or sent from then on: upstream.py) and the abort goes on, with each request's own upstream
headers, to the instances its legs are on now; each instance aborts it in its engine (pdserve/server/tokens_only.py
`abort`). A request's id is the one its instances answer with, `generate-tokens-{id}`, or the bare id."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from pdserve.api.scale_out_routes import ABORT_PATH, GENERATE_ID_PREFIX
from pdserve.proxy.pool import Instance
from pdserve.proxy.state import ProxyState
from pdserve.proxy.upstream import Upstream

logger = logging.getLogger("pdserve.proxy")

FORWARD_TIMEOUT_S = 5.0  # an instance that does not answer an abort in time is left to its own lease/stream end


async def abort_requests(state: ProxyState, request_ids: list[str]) -> int:
    """Marks the requests `request_ids` name aborted and tells the instances their legs are on; how many requests
    the proxy had in flight under those ids."""
    found: dict[int, Upstream] = {}
    for rid in request_ids:
        for up in state.requests.abort(rid):
            found[id(up)] = up
    await asyncio.gather(*(_forward(state, inst, up) for up in found.values() for inst in up.instances))
    return len(found)


async def _forward(state: ProxyState, inst: Instance, up: Upstream) -> None:
    body = {"request_ids": [GENERATE_ID_PREFIX + up.rid]}
    try:
        async with state.http().post(inst.endpoint(ABORT_PATH), json=body, headers=up.headers,
                                     timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S)) as resp:
            await resp.read()
            if resp.status != 200:
                logger.warning("request %s: %s answered the abort with %d", up.rid, inst.url, resp.status)
    except (TimeoutError, aiohttp.ClientError) as exc:
        logger.warning("request %s: the abort did not reach %s: %s: %s", up.rid, inst.url, type(exc).__name__, exc)
