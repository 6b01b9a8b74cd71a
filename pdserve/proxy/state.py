"""What the request handlers share: configuration, pools, the pair chooser, metrics and the one pooled HTTP
session."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp

from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.conversations import ConversationHistory
from pdserve.proxy.health import HealthChecker
from pdserve.proxy.kv_fleet import KVFleet
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.pairing import PairChooser
from pdserve.proxy.pool import Pool
from pdserve.proxy.prompt_tokens import PromptTokenizer
from pdserve.proxy.readiness import Readiness
from pdserve.proxy.retry import RetryBudget
from pdserve.proxy.upstream import InFlight

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
    requests: InFlight = field(default_factory=InFlight)  # what an abort can reach (the tokens-only route's)
    checker: HealthChecker | None = None
    readiness: Readiness = field(default_factory=Readiness)
    fleet: KVFleet | None = None  # routing by cached prefix (None: --no-kv-routing)
    prompt_tokenizer: PromptTokenizer | None = None
    history: ConversationHistory = field(init=False)
    pairing: PairChooser = field(init=False)  # every leg's instance is chosen there
    retry_budget: RetryBudget = field(init=False)
    prefill_timeout: aiohttp.ClientTimeout = field(init=False)
    decode_timeout: aiohttp.ClientTimeout = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.config
        self.history = ConversationHistory(cfg.kv_history_max_entries)
        self.retry_budget = RetryBudget(cfg.retry_budget_ratio, cfg.retry_budget_min_per_s, cfg.retry_budget_burst)
        self.metrics.retry_budget_tokens.set_function(lambda: self.retry_budget.tokens)
        self.prefill_timeout = aiohttp.ClientTimeout(
            total=cfg.prefill_timeout, sock_connect=cfg.connect_timeout
        )
        # Decode: no total limit (long generations), but at most decode_timeout without a byte.
        self.decode_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=cfg.connect_timeout, sock_read=cfg.decode_timeout
        )
        if cfg.kv_routing:
            self.fleet = KVFleet(self.pools, self.http, info_timeout=cfg.health_timeout,
                                 on_disconnect=self.nudge_health)
            self.prompt_tokenizer = PromptTokenizer(cfg.tokenizer, cfg.health_timeout)
            self.metrics.register_kv(self.fleet)
        self.pairing = PairChooser(cfg, self.prefill, self.decode, self.metrics, self.readiness, self.nudge_health,
                                   self.fleet)

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

    def nudge_health(self) -> None:
        if self.checker is not None:
            self.checker.nudge()

    def spend_retry(self) -> bool:
        """Take one retry from the proxy's budget (counted as an error of kind retry_budget when refused)."""
        if self.retry_budget.try_spend():
            return True
        self.metrics.error("retry_budget")
        return False

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
