"""What the request handlers share: configuration, pools, metrics and the one pooled HTTP session."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp

from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.pool import Pool

# Below uvicorn's (and so vLLM's) 5 s server keep-alive: the proxy drops an idle pooled connection
# before the server may close it under a request in flight.
UPSTREAM_KEEPALIVE_S = 4.0


@dataclass
class ProxyState:
    config: ProxyConfig
    prefill: Pool
    decode: Pool
    metrics: ProxyMetrics
    session: aiohttp.ClientSession | None = None
    in_flight: int = 0
    prefill_timeout: aiohttp.ClientTimeout = field(init=False)
    decode_timeout: aiohttp.ClientTimeout = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.config
        self.prefill_timeout = aiohttp.ClientTimeout(
            total=cfg.prefill_timeout, sock_connect=cfg.connect_timeout
        )
        # Decode: no total limit (long generations), but at most decode_timeout without a byte.
        self.decode_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=cfg.connect_timeout, sock_read=cfg.decode_timeout
        )

    @classmethod
    def from_config(cls, config: ProxyConfig) -> ProxyState:
        prefill = Pool("prefill", config.prefill)
        decode = Pool("decode", config.decode)
        return cls(config, prefill, decode, ProxyMetrics(lambda: [prefill, decode]))

    def pools(self) -> list[Pool]:
        return [self.prefill, self.decode]

    def pool(self, role: str) -> Pool:
        if role == "prefill":
            return self.prefill
        if role == "decode":
            return self.decode
        raise ValueError(f"unknown role {role!r}")

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,  # unlimited: the proxy's own --max-inflight bounds the load
            limit_per_host=0,
            keepalive_timeout=UPSTREAM_KEEPALIVE_S,
            ttl_dns_cache=300,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),
            cookie_jar=aiohttp.DummyCookieJar(),  # instances set no cookies; skip the jar on every leg
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def http(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("proxy session is not open")
        return self.session
