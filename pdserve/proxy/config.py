"""Proxy configuration: one dataclass, filled from the command line and an optional YAML/TOML file."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.proxy.pool import normalize_url

PREFILL_FAILURE_POLICIES = ("retry", "fail", "decode-local")


@dataclass
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8192
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    # Client-facing auth: `Authorization: Bearer <api_key>` on /v1 routes.
    api_key: str | None = None
    # Admin auth: `Authorization: Bearer <admin_key>` on POST /pdserve/instances. Without a key the
    # admin (mutating) route is off: anyone reaching the proxy could otherwise add or remove instances.
    admin_key: str | None = None
    # Upstream auth: sent as `Authorization: Bearer <key>` to instances. When unset, the client's
    # Authorization header is forwarded unless the proxy checks its own --api-key.
    upstream_api_key: str | None = None
    on_prefill_failure: str = "retry"
    prefill_retries: int = 1
    decode_retries: int = 1
    disagg_threshold_tokens: int = 0
    prefix_affinity: bool = False
    prefix_affinity_chars: int = 1024
    prefix_affinity_slack: int = 4
    # Routing by cached prefix (pdserve/proxy/kv_routing.py): on whenever instances publish KV events.
    kv_routing: bool = True
    kv_overlap_weight: float = 1.0  # tokens of prefill work saved per token of load (Dynamo's overlap weight)
    kv_hit_fraction: float = 0.9  # a routing "hit": the chosen instance holds this share of the best prefix
    # A local tokenizer (HF folder or tokenizer.json) for the prompt token ids; without one the proxy asks
    # an instance's /tokenize.
    tokenizer: str | None = None
    rewrite_remote_host: bool = False
    chat_token_ids: bool = True
    # send the decode leg with the prefill leg (to decode instances that take their params later), so that
    # its HTTP, parsing and admission overlap the prefill; the params follow (pdserve.api.pd.KV_PARAMS_PATH)
    early_decode_leg: bool = True
    # Each instance's transfer mode is learnt (proxy/instance_info.py: /pdserve/info, or the `transfer_mode` of
    # vLLM's prefill answers) and pairs go push with push, pull with pull. Set, it overrides what was learnt for
    # every instance: "push" (NixlPushConnector: a pdserve pair's legs go out at once and the prefill WRITEs the
    # KV into blocks the decode registered, proxy/push_pair.py; vLLM's get sequential legs), "pull" (the decode
    # READs after the prefill).
    kv_transfer_mode: str | None = None
    # n > 1 as one P/D pair: pdserve decode instances fork the one KV load into the n choices (vLLM's
    # cannot: --no-disagg-n serves such requests locally)
    disagg_n: bool = True
    # Multi-turn (decode instances with bidirectional_kv_xfer): remember each conversation's held history
    # and have the next turn's prefill read it back when `pdserve plan`'s arithmetic says that is cheaper
    # than recomputing it (link bandwidth and prefill throughput as below).
    kv_history: bool = True
    kv_history_max_entries: int = 4096
    kv_history_bandwidth: str = "cpu-dram"  # a `pdserve plan --bandwidth` value or preset
    kv_history_prefill_tps: float = 2000.0  # prefill tokens/s of one instance
    # fixed cost of one read: side-channel claim, transfer setup, release (measured 6-8 ms on the 2-core CPU box,
    # BENCHMARKS.md "Multi-turn over P/D: the choice per turn"; the per-token wire time is small beside it)
    kv_history_overhead_s: float = 0.007
    # cost: the arithmetic above decides each turn (history_decision.price_history); pull / recompute: always that
    # (benchmarks measure both sides with it; the predictions are still computed and reported)
    kv_history_choice: str = "cost"
    # Pulling a prefix from a peer (issue 18 part 4): when the fleet index says another instance that pins on
    # demand (`kv_peer_pin` in its /pdserve/info) caches at least this many more prompt tokens than the chosen
    # prefill, that peer pins them and the prefill leg reads them (same arithmetic as above decides).
    kv_peer_pull: bool = True
    kv_peer_pull_min_tokens: int = 64
    max_inflight: int = 4096
    connect_timeout: float = 10.0
    prefill_timeout: float = 300.0
    decode_timeout: float = 600.0
    health_interval: float = 5.0
    health_timeout: float = 2.0
    eject_after: int = 3
    # A request finding no available instance waits this long for one to be admitted, then gets 503.
    instance_wait_timeout: float = 15.0
    # Retry budget (see pdserve/proxy/retry.py): retries <= burst + ratio x requests + min_per_s x seconds.
    retry_budget_ratio: float = 0.05
    retry_budget_min_per_s: float = 1.0
    retry_budget_burst: float = 10.0
    log_level: str = "info"

    def validate(self) -> ProxyConfig:
        """Normalises URLs and checks ranges; raises ValueError with a readable message."""
        if self.kv_transfer_mode not in (None, "pull", "push"):
            raise ValueError(f"kv_transfer_mode must be pull or push (or unset: learnt), got {self.kv_transfer_mode!r}")
        self.prefill = [normalize_url(u) for u in self.prefill]
        self.decode = [normalize_url(u) for u in self.decode]
        for role, urls in (("prefill", self.prefill), ("decode", self.decode)):
            if len(set(urls)) != len(urls):
                raise ValueError(f"duplicate {role} instance URL in {urls}")
        if not self.decode:
            raise ValueError("at least one decode instance is required (--decode URL)")
        if self.on_prefill_failure not in PREFILL_FAILURE_POLICIES:
            raise ValueError(
                f"on_prefill_failure must be one of {PREFILL_FAILURE_POLICIES}, got {self.on_prefill_failure!r}"
            )
        for name in ("prefill_retries", "decode_retries", "disagg_threshold_tokens", "prefix_affinity_slack"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        from pdserve.preflight.plan import parse_bandwidth

        parse_bandwidth(self.kv_history_bandwidth)  # ValueError names what is wrong
        if self.kv_history_prefill_tps <= 0:
            raise ValueError("kv_history_prefill_tps must be > 0")
        if self.kv_history_overhead_s < 0:
            raise ValueError("kv_history_overhead_s must be >= 0")
        if self.kv_history_choice not in ("cost", "pull", "recompute"):
            raise ValueError(f"kv_history_choice must be cost, pull or recompute, got {self.kv_history_choice!r}")
        for name in ("prefix_affinity_chars", "max_inflight", "eject_after", "kv_history_max_entries",
                     "kv_peer_pull_min_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in (
            "connect_timeout",
            "prefill_timeout",
            "decode_timeout",
            "health_interval",
            "health_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("instance_wait_timeout", "retry_budget_ratio", "retry_budget_min_per_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.tokenizer is not None and not Path(self.tokenizer).exists():
            raise ValueError(f"tokenizer {self.tokenizer!r} does not exist (give a model folder or tokenizer.json)")
        if self.kv_overlap_weight < 0:
            raise ValueError("kv_overlap_weight must be >= 0")
        if not 0 < self.kv_hit_fraction <= 1:
            raise ValueError("kv_hit_fraction must be in (0, 1]")
        if self.retry_budget_burst < 1:
            raise ValueError("retry_budget_burst must be >= 1")
        return self


FIELD_NAMES = {f.name for f in dataclasses.fields(ProxyConfig)}


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a YAML (.yaml/.yml) or TOML (.toml) mapping of ProxyConfig fields (`-` or `_` in keys)."""
    file = Path(path)
    text = file.read_text()
    if file.suffix == ".toml":
        import tomllib

        data = tomllib.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a mapping at the top level")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELD_NAMES:
            raise ValueError(f"{file}: unknown key {key!r}")
        if name in ("prefill", "decode") and isinstance(value, str):
            value = [value]
        out[name] = value
    return out
