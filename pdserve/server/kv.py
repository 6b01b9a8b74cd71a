"""Wiring `--kv-transfer-config` into the engine: its P/D half over the connector, and what /pdserve/info reports."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry


def parse_kv_transfer_config(raw: str | None, side_channel_host: str | None, side_channel_port: int | None,
                             insecure_side_channel: bool = False, http_host: str | None = None) -> Any:
    """KVTransferConfig or None; raises ValueError with a readable message for a bad config.

    Without --side-channel-host or VLLM_NIXL_SIDE_CHANNEL_HOST, a server given a specific `--host` (not a
    wildcard) binds and advertises its side channel on that address: it is the one this host is reached at, and
    a decode instance on another host could never dial the loopback default."""
    if raw is None:
        return None
    import os

    from pdserve.kv_transfer.config import ENV_HOST, KVTransferConfig

    if side_channel_host is None and not os.environ.get(ENV_HOST) and http_host not in (None, "", "0.0.0.0", "::",
                                                                                          "*", "localhost"):
        side_channel_host = http_host
    return KVTransferConfig.from_json(raw, side_channel_host=side_channel_host, side_channel_port=side_channel_port,
                                      insecure_side_channel=insecure_side_channel)


def pd_extension_factory(kv_config: Any, registry: CollectorRegistry, model_name: str) -> Callable[[Any], Any]:
    """`factory(engine) -> EnginePD`, the engine's P/D half (its extension, pdserve/engine/extension.py), called by
    LLMEngine once its KV pool exists: over a KVConnector when `kv_config` is set, else with none (every request
    plain, its kv_transfer_params ignored, as vLLM does without a connector)."""

    def build(engine: Any) -> Any:
        from pdserve.engine.pd.engine_pd import EnginePD

        connector = _connector(engine, kv_config, registry, model_name) if kv_config is not None else None
        try:
            return EnginePD(connector, engine.blocks, engine.scheduler.loading, vocab_size=engine.model_cfg.vocab_size,
                            eos_token_ids=engine.eos_token_ids, max_model_len=engine.max_model_len)
        except BaseException:
            if connector is not None:
                connector.shutdown()
            raise

    return build


def _connector(engine: Any, kv_config: Any, registry: CollectorRegistry, model_name: str) -> Any:
    from pdserve.kv_transfer import KVConnector, make_compat

    runner = engine.runner
    cfg = engine.model_cfg
    compat = make_compat(
        model=model_identity(engine.model_dir),
        dtype=str(runner.dtype),
        block_size=runner.block_size,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        kv_layout=runner.layout,
        kv_cache_dtype=runner.kv_cache_dtype,
        kv_scales=runner.kv_scales,
    )
    workers = runner.workers  # tensor parallelism: ranks 1..N-1 register their own pool shards
    return KVConnector(kv_config, runner.kv_pool, compat, runner.block_size, registry=registry,
                       model_name=model_name, tp_size=engine.config.tensor_parallel_size,
                       rank_agents=workers.kv_agents if workers is not None else None)


def model_identity(model_dir: Path | str | None) -> str:
    """What both sides of a transfer must agree on besides the shapes: the model folder's name."""
    return Path(model_dir).name if model_dir else "unknown"
