"""What a simulated deployment runs, by the names `pdserve up`, `pdserve serve`'s `kv_connector_extra_config` and
`pdserve proxy` give them (their defaults too), so that a simulated deployment is described as a real one is."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.proxy.config import ProxyConfig
from pdserve.types.push_pipeline import DEFAULT_PUSH_LAYERWISE_MIN_TOKENS, PUSH_PIPELINES


@dataclass
class SimOptions:
    # pdserve up --kv-transfer-mode: pull (the decode READs the prompt's KV) or push (the prefill WRITEs it
    # into blocks the decode registered; both legs go out at once, proxy/push_pair.py)
    kv_transfer_mode: str = "pull"
    # kv_connector_extra_config push_pipeline / push_layerwise_min_tokens (pdserve/types/push_pipeline.py)
    push_pipeline: str = "auto"
    push_layerwise_min_tokens: int = DEFAULT_PUSH_LAYERWISE_MIN_TOKENS
    # pdserve up --kv-history: decode instances keep each conversation (bidirectional_kv_xfer,
    # decoder_kv_blocks_ttl), the proxy has the next turn's prefill read it back when that is cheaper
    kv_history: bool = False
    decoder_kv_blocks_ttl: float = 480.0
    kv_recompute_threshold: int = 64
    # pdserve up --kv-events / --no-kv-events: instances publish KV events and the proxy routes by cached prefix;
    # None: in each role of more than one instance (LaunchConfig.kv_events_in)
    kv_events: bool | None = None
    # the proxy's own settings (pdserve proxy's flags: the history decision's pricing, --kv-overlap-weight,
    # --disagg-threshold-tokens, --no-early-decode-leg, ...); kv_history and kv_transfer_mode follow the above
    proxy: ProxyConfig = field(default_factory=ProxyConfig)

    def validate(self) -> SimOptions:
        if self.kv_transfer_mode not in ("pull", "push"):
            raise ValueError(f"--kv-transfer-mode must be pull or push, got {self.kv_transfer_mode!r}")
        if self.push_pipeline not in PUSH_PIPELINES:
            raise ValueError(f"push_pipeline must be one of {', '.join(PUSH_PIPELINES)}, got {self.push_pipeline!r}")
        if self.decoder_kv_blocks_ttl <= 0 or self.kv_recompute_threshold < 0:
            raise ValueError("decoder_kv_blocks_ttl must be > 0 and kv_recompute_threshold >= 0")
        from pdserve.preflight.plan import parse_bandwidth

        cfg = self.proxy
        parse_bandwidth(cfg.kv_history_bandwidth)  # ValueError names what is wrong
        if cfg.kv_history_choice not in ("cost", "pull", "recompute"):
            raise ValueError(f"--kv-history-choice must be cost, pull or recompute, got {cfg.kv_history_choice!r}")
        if cfg.kv_history_prefill_tps <= 0 or cfg.kv_history_overhead_s < 0 or cfg.kv_overlap_weight < 0 \
                or cfg.disagg_threshold_tokens < 0:
            raise ValueError("--kv-history-prefill-tps must be > 0; --kv-history-overhead-s, --kv-overlap-weight "
                             "and --disagg-threshold-tokens >= 0")
        return self
