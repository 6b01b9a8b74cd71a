"""Ties the host and disk tiers to the engine's KV pool.

- Offload: the block manager calls `on_device_evict` just before it reuses a cached block; its KV is copied
  into the host tier (whose LRU victim, if any, goes to the disk tier's writer thread).
- Load: the engine asks `lookup` how far a prompt's block hashes continue past the pool's own hits. Host hits
  are copied into freshly registered pool blocks at once (a memcpy / one DMA per block); a run of disk hits
  is read by the reader thread into a staging buffer, verified, and copied in when `poll_reads` returns it,
  while other requests keep stepping.
- Events: every block a tier gains or loses is queued as a KV event with the tier's medium ("CPU", "DISK").

All calls are from the engine thread except the disk writer's and reader's own work.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.kv_events.block_hash import external_block_hash
from pdserve.kv_events.events import MEDIUM_DISK, MEDIUM_HOST, BlockRemoved, BlockStored, KVCacheEvent
from pdserve.kv_offload.block_meta import BlockMeta
from pdserve.kv_offload.disk_tier import DiskTier
from pdserve.kv_offload.host_tier import HostTier

log = logging.getLogger("pdserve.kv_offload")

GIB = 1024**3


@dataclass
class TierCounters:
    """Per medium: tokens queried/hit by prompt lookups, bytes and seconds moved in (offload) and out (load)."""

    query_tokens: int = 0
    hit_tokens: int = 0
    offload_bytes: int = 0
    offload_seconds: float = 0.0
    load_bytes: int = 0
    load_seconds: float = 0.0


@dataclass
class DiskRead:
    """A run of disk-tier blocks being read for one request."""

    request_id: str
    hashes: list[bytes]
    metas: list[BlockMeta]
    staging: torch.Tensor
    num_ok: int = 0  # leading blocks read and verified
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class KVTierManager:
    def __init__(self, pool: torch.Tensor, block_size: int, host_bytes: int, disk_path: str | None = None,
                 disk_bytes: int = 0, events: bool = False, kv_encoding: str | None = None,
                 digest: Callable[[torch.Tensor, int], str] | None = None):
        """kv_encoding: what the pool's bytes mean (a quantized pool's format, e.g.
        `fp8_e4m3/<fp8_kv.SCALE_SCHEME>`; a float pool's memory order, `kv_transfer.compat`'s layout names),
        part of the disk files' fingerprint: dtype and shape alone do not tell fp8 formats or block layouts
        apart (a head-major and a token-major block with as many heads as tokens have the same shape), and a
        disk tier written under another one must read as a miss, not as garbage KV. digest(blocks, i) (CPU pools):
        the host tier keeps each block's digest and a block whose bytes changed there is dropped, never loaded (`host_intact`); the
        disk tier's files carry their own CRC32, checked on every read."""
        self.pool = pool
        self.block_size = block_size
        self.block_shape = tuple(pool.shape[1:])
        self.block_nbytes = pool[0].numel() * pool.element_size()
        self.pin = pool.device.type == "cuda"
        self.host = HostTier(int(host_bytes // self.block_nbytes), self.block_shape, pool.dtype, self.pin,
                             digest=digest if pool.device.type == "cpu" else None)
        self.num_host_digest_mismatches = 0
        self._events: list[KVCacheEvent] | None = [] if events else None
        self._events_lock = threading.Lock()
        self.counters: dict[str, TierCounters] = defaultdict(TierCounters)
        self.disk: DiskTier | None = None
        if disk_path is not None:
            fingerprint = f"{str(pool.dtype).removeprefix('torch.')}:{list(self.block_shape)}"
            if kv_encoding is not None:
                fingerprint += f":{kv_encoding}"
            self.disk = DiskTier(disk_path, disk_bytes, self.block_nbytes, fingerprint, on_change=self._disk_changed)
        self._reads: queue.Queue[DiskRead | None] = queue.Queue()
        self._done: queue.Queue[DiskRead] = queue.Queue()
        self._reader = None
        if self.disk is not None:
            self._reader = threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True)
            self._reader.start()

    # ---- events --------------------------------------------------------------------------------
    def _event(self, e: KVCacheEvent) -> None:
        if self._events is not None:
            with self._events_lock:
                self._events.append(e)

    def _stored(self, h: bytes, meta: BlockMeta, medium: str) -> None:
        if self._events is not None:
            self._event(BlockStored([external_block_hash(h)],
                                    None if meta.parent is None else external_block_hash(meta.parent),
                                    list(meta.tokens), self.block_size, medium=medium))

    def _removed(self, h: bytes, medium: str) -> None:
        if self._events is not None:
            self._event(BlockRemoved([external_block_hash(h)], medium))

    def _disk_changed(self, what: str, h: bytes, meta: BlockMeta | None) -> None:
        if what == "stored" and meta is not None:
            self._stored(h, meta, MEDIUM_DISK)
        elif what == "removed":
            self._removed(h, MEDIUM_DISK)

    def take_events(self) -> list[KVCacheEvent]:
        if not self._events:
            return []
        with self._events_lock:
            out, self._events = self._events, []
        return out

    # ---- offload ---------------------------------------------------------------------------------
    def on_device_evict(self, bid: int, h: bytes, meta: BlockMeta) -> None:
        """The pool is about to reuse block `bid`, cached as `h`: keep its KV in the host tier."""
        if h in self.host:
            self.host.touch(h)
            return
        t0 = time.perf_counter()
        evicted = self.host.store(h, meta, self.pool[bid], keep_evicted=self.disk is not None)
        if h not in self.host:
            return  # every slot is pinned by loads in progress: this block is simply dropped
        c = self.counters[MEDIUM_HOST]
        c.offload_bytes += self.block_nbytes
        c.offload_seconds += time.perf_counter() - t0
        self._stored(h, meta, MEDIUM_HOST)
        if evicted is not None:
            old, old_meta, data = evicted
            self._removed(old, MEDIUM_HOST)
            if self.disk is not None and data is not None:
                self.disk.submit(old, old_meta, data)

    # ---- load ------------------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[str]:
        """The media holding the leading run of `hashes` (stops at the first block no tier has)."""
        out: list[str] = []
        for h in hashes:
            if h in self.host:
                out.append(MEDIUM_HOST)
            elif self.disk is not None and h in self.disk:
                out.append(MEDIUM_DISK)
            else:
                break
        return out

    def record_query(self, medium: str, query_tokens: int) -> None:
        self.counters[medium].query_tokens += query_tokens

    def host_meta(self, h: bytes) -> BlockMeta:
        return self.host.meta(h)

    def host_intact(self, h: bytes) -> bool:
        """False (and the block dropped from the host tier, counted) when its bytes changed since stored."""
        if self.host.intact(h):
            return True
        log.error("KV host tier: block %s changed since it was stored (digest mismatch); dropped, recomputed",
                  h.hex()[:16])
        self.host.drop(h)
        self._removed(h, MEDIUM_HOST)
        self.num_host_digest_mismatches += 1
        return False

    def load_from_host(self, h: bytes, bid: int) -> None:
        t0 = time.perf_counter()
        self.host.load(h, self.pool[bid])
        c = self.counters[MEDIUM_HOST]
        c.load_bytes += self.block_nbytes
        c.load_seconds += time.perf_counter() - t0
        c.hit_tokens += self.block_size

    def start_disk_read(self, request_id: str, hashes: list[bytes]) -> DiskRead | None:
        assert self.disk is not None
        metas = [self.disk.meta(h) for h in hashes]
        if metas and metas[0] is None:
            return None
        n = next((i for i, m in enumerate(metas) if m is None), len(metas))
        read = DiskRead(request_id, hashes[:n], metas[:n],  # type: ignore[arg-type]
                        torch.empty((n, *self.block_shape), dtype=self.pool.dtype, pin_memory=self.pin))
        self._reads.put(read)
        return read

    def _read_loop(self) -> None:
        assert self.disk is not None
        while True:
            read = self._reads.get()
            if read is None:
                return
            t0 = time.perf_counter()
            try:
                for i, h in enumerate(read.hashes):
                    if not self.disk.read_into(h, read.staging[i]):
                        break
                    read.num_ok = i + 1
            except Exception:  # noqa: BLE001 - a failed read is a miss, never a dead reader
                log.exception("KV disk tier: reading blocks failed")
            read.seconds = time.perf_counter() - t0
            read.done.set()
            self._done.put(read)

    def wait_for_read(self, timeout_s: float) -> None:
        """Blocks until a disk read has finished (`poll_reads` then returns it) or `timeout_s` passed."""
        try:
            read = self._done.get(timeout=timeout_s)
        except queue.Empty:
            return
        self._done.put(read)

    def poll_reads(self) -> list[DiskRead]:
        out: list[DiskRead] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def load_from_read(self, read: DiskRead, i: int, bid: int) -> None:
        t0 = time.perf_counter()
        self.pool[bid].copy_(read.staging[i])
        c = self.counters[MEDIUM_DISK]
        c.load_bytes += self.block_nbytes
        c.load_seconds += time.perf_counter() - t0 + (read.seconds / max(read.num_ok, 1))
        c.hit_tokens += self.block_size

    # ---- introspection -------------------------------------------------------------------------
    def info(self) -> list[dict]:
        """The tiers as /pdserve/info shows them."""
        tiers = [{"medium": MEDIUM_HOST, "backend": "native", "pinned": self.pin,
                  "capacity_blocks": self.host.num_slots, "capacity_bytes": self.host.num_slots * self.block_nbytes}]
        if self.disk is not None:
            tiers.append({"medium": MEDIUM_DISK, "path": str(self.disk.dir),
                          "capacity_blocks": self.disk.capacity_blocks, "capacity_bytes": self.disk.max_bytes,
                          "checksum": "crc32"})
        return tiers

    def usage(self) -> dict[str, tuple[int, int]]:
        """medium -> (blocks held, capacity in blocks)."""
        out = {MEDIUM_HOST: (len(self.host), self.host.num_slots)}
        if self.disk is not None:
            out[MEDIUM_DISK] = (len(self.disk), self.disk.capacity_blocks)
        return out

    def stats(self) -> dict[str, dict[str, float]]:
        """medium -> counters (tokens, bytes, seconds) and usage, for metrics and tests."""
        out: dict[str, dict[str, float]] = {}
        for medium, (held, capacity) in self.usage().items():
            c = self.counters[medium]
            row = {"query_tokens": c.query_tokens, "hit_tokens": c.hit_tokens, "offload_bytes": c.offload_bytes,
                   "offload_seconds": c.offload_seconds, "load_bytes": c.load_bytes, "load_seconds": c.load_seconds,
                   "blocks": held, "capacity_blocks": capacity}
            if medium == MEDIUM_HOST:
                row["digest_mismatch_blocks"] = self.num_host_digest_mismatches
            if medium == MEDIUM_DISK and self.disk is not None:
                row["offload_bytes"] = self.disk.bytes_written
                row["offload_seconds"] = self.disk.write_seconds
                row["corrupt_blocks"] = self.disk.num_corrupt
                row["write_dropped_blocks"] = self.disk.num_write_dropped
            out[medium] = row
        return out

    def shutdown(self) -> None:
        if self._reader is not None:
            self._reads.put(None)
            self._reader.join(timeout=5.0)
        if self.disk is not None:
            self.disk.shutdown()
