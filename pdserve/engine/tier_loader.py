"""Before each schedule: loads prompt prefixes back from the offload tiers into the KV pool, so that the
scheduler's ordinary prefix-cache lookup finds them (pdserve.kv_offload; ARCHITECTURE.md "KV offload tiers").

For each request at the head of the waiting queue (once per admission attempt), it takes the pool's own
leading hits, asks the tiers how far the prompt's block hashes continue, and
- copies a leading run of host-tier hits into pool blocks right away (registered as evictable cached
  blocks, most recently used, so the request's admission in this same step revives them);
- for a run of disk-tier hits, parks the request (out of the waiting queue, so the others keep being
  scheduled) while the reader thread verifies and reads the files, then copies them in the same way and
  puts the request back at the front of the queue.
Loaded blocks are plain pool blocks from then on: a pool too small to keep them until admission only costs
a recompute, never a wrong token.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.kv_events.events import MEDIUM_DISK, MEDIUM_HOST
from pdserve.kv_offload.manager import GIB, KVTierManager
from pdserve.kv_transfer.config import digests_enabled
from pdserve.kv_transfer.digest import cpu_block_digest
from pdserve.types.engine_config import EngineConfig


class TierLoader:
    def __init__(self, blocks: BlockManager, scheduler: Scheduler, tiers: KVTierManager):
        self.blocks = blocks
        self.scheduler = scheduler
        self.tiers = tiers
        self.parked: dict[str, Request] = {}  # requests whose disk-tier blocks are being read

    @classmethod
    def start(cls, config: EngineConfig, runner: Any, blocks: BlockManager, scheduler: Scheduler,
              events: bool) -> TierLoader:
        """The tiers of `config` behind the runner's pool (their reader and writer threads started), wired to the
        pool's evictions and the scheduler's external-hit counters. `events`: they publish KV events. The host
        tier keeps a digest per block when the KV transfer's digests are on (`enable_kv_digest`)."""
        tiers = KVTierManager(
            runner.kv_pool, config.block_size, int(config.kv_offloading_size * GIB),
            config.kv_offloading_disk_path, int((config.kv_offloading_disk_size or 0) * GIB), events=events,
            kv_encoding=runner.layout if runner.kv_format is None else f"{runner.kv_cache_dtype}/{runner.kv_scales}",
            digest=cpu_block_digest if digests_enabled(config.kv_transfer_config) else None)
        blocks.on_evict = tiers.on_device_evict
        scheduler.count_external = True
        return cls(blocks, scheduler, tiers)

    def forget(self, request_id: str) -> bool:
        """An aborted request: True when it was parked (its read's result is then ignored)."""
        return self.parked.pop(request_id, None) is not None

    def before_schedule(self) -> None:
        self._finish_reads()
        s = self.scheduler
        room = max(s.max_num_seqs - len(s.running) - len(s.loading), 1)
        for req in list(islice(s.waiting, room)):
            if (req.tier_scan != req.metrics.num_preemptions and req.num_computed_tokens == 0
                    and req.params.prompt_logprobs is None):  # prompt logprobs: the whole prompt is computed
                req.tier_scan = req.metrics.num_preemptions
                self._load_prefix(req)

    def _load_prefix(self, req: Request) -> None:
        blocks, tiers, bs = self.blocks, self.tiers, self.blocks.block_size
        device_hits = blocks.find_cached_prefix(req)  # also extends req.block_hashes to the prompt's last block
        wanted = req.block_hashes[len(device_hits): (req.num_tokens - 1) // bs]
        if not wanted:
            return
        media = tiers.lookup(wanted)
        # per tier, the tokens asked of it: the host tier past the pool's hits, the disk tier past those of
        # the host tier's leading run
        host_hits = next((i for i, m in enumerate(media) if m != MEDIUM_HOST), len(media))
        tiers.record_query(MEDIUM_HOST, len(wanted) * bs)
        if tiers.disk is not None:
            tiers.record_query(MEDIUM_DISK, (len(wanted) - host_hits) * bs)
        if not media:
            return
        blocks.touch(device_hits)  # keep the pool's own hits out of reach of the evictions below
        room = blocks.num_free_blocks - sum(1 for b in device_hits if blocks.ref_cnt[b] == 0)
        host_run = wanted[:host_hits][:room]
        # each promotion may evict a pool block into the host tier: pin the run so that cannot push it out
        tiers.host.pinned.update(host_run)
        loaded = 0
        try:
            for h in host_run:
                if not tiers.host_intact(h):  # its bytes changed in the tier (digests on): recomputed instead
                    break
                bid = blocks.promote(h, tiers.host_meta(h))
                if bid is None:
                    break
                tiers.load_from_host(h, bid)
                loaded += 1
        finally:
            tiers.host.pinned.difference_update(host_run)
        req.num_tier_hit_tokens += loaded * bs
        disk_run: list[bytes] = []
        for h, medium in zip(wanted[loaded:], media[loaded:], strict=False):
            if medium != MEDIUM_DISK or loaded + len(disk_run) >= room:
                break
            disk_run.append(h)
        if disk_run and tiers.start_disk_read(req.request_id, disk_run) is not None:
            self.scheduler.waiting.remove(req)
            self.parked[req.request_id] = req

    def _finish_reads(self) -> None:
        for read in self.tiers.poll_reads():
            req = self.parked.pop(read.request_id, None)
            if req is None:
                continue  # aborted meanwhile
            device_hits = self.blocks.find_cached_prefix(req)
            self.blocks.touch(device_hits)
            room = self.blocks.num_free_blocks - sum(1 for b in device_hits if self.blocks.ref_cnt[b] == 0)
            loaded = 0
            for i in range(min(read.num_ok, room)):
                bid = self.blocks.promote(read.hashes[i], read.metas[i])
                if bid is None:
                    break
                self.tiers.load_from_read(read, i, bid)
                loaded += 1
            req.num_tier_hit_tokens += loaded * self.blocks.block_size
            if loaded:
                req.tier_scan = -1  # look again: the prefix may continue in the host tier
            self.scheduler.waiting.appendleft(req)
