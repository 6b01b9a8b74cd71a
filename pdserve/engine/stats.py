"""`EngineStats`: the engine's counts at one moment, one snapshot (`LLMEngine.stats`). The loop fills in its own
(scheduler, pool, prefix cache, offload tiers, speculation) and its extension the rest (`EngineExtension.contribute`:
the P/D half's loads, held leases, histories, legs awaiting their params); what no one fills in stays 0. The server's
metrics and the autoscaler read it (pdserve/server/metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.spec_decode.metrics import SpecDecodeStats


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0  # not running yet: queued, waiting for their KV (loads, disk-tier reads)
    num_loading: int = 0  # remote KV reads in flight
    num_held: int = 0  # finished prefill legs whose blocks are held for a consumer
    kv_cache_usage: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_history: int = 0  # finished decode legs whose conversation is held for the next turn
    # decode legs sent before their prefill finished, waiting for their params: not queued work of this
    # instance yet (its prefill runs elsewhere), so kept out of num_waiting, which autoscaling reads
    num_awaiting_params: int = 0
    external_prefix_cache_queries: int = 0  # tokens looked up in the offload tiers (vLLM's connector counters)
    external_prefix_cache_hits: int = 0
    kv_tiers: dict | None = None  # medium -> counters and usage of the offload tiers (None: no tiers)
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters (None: speculation off)
    num_queued: int = 0  # in the scheduler's waiting queue (the server's queue bound counts them)
