"""Test-only faults that make wrong KV in a producer process (tests/test_kv_digest_e2e.py, the chaos soak):
the digests must catch every one.

Off unless the environment variable `PDSERVE_TESTING_KV_FAULTS` holds a JSON object: no flag, config key or
endpoint turns them on, so no user meets them by accident, and a producer started with it says so in its log
at WARNING. Keys (each a probability per held request, 0 by default): `flip` (one byte of the last, partial
held block is flipped after the producer digested it: the block a consumer always reads, never shared through
the prefix cache), `reassign` (the engine gets the blocks back at once while the lease stays held: another
request may reuse them before a late READ, as when a lease expires in the allocator but not in the lease
table), `stale_push` (push mode: before the completion notification, one registered block gets another pool
block's bytes WRITTEN into it); `seed`; `log`: a file that gets one JSON line per injection and per victim
(`{"kind": ..., "request_id": ..., "victim": bool, "phase": ...}`): an injection is logged with victim false
(phase "held"); a victim is a fault whose wrong bytes a consumer read (phase "read": a flipped lease a consumer
released after its READ, a reassigned one whose blocks changed before that release; a stale write whose bytes
differ from the block's).
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.kv_transfer.digest import BlockDigester
from pdserve.kv_transfer.pool import KVPool, PoolRegion, RemotePool, coalesce_block_runs, descriptor_arrays

if TYPE_CHECKING:
    from pdserve.kv_transfer.nixl_agent import NixlAgent

logger = logging.getLogger("pdserve.kv_transfer")

ENV = "PDSERVE_TESTING_KV_FAULTS"
KINDS = ("flip", "reassign", "stale_push")


def _number(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{ENV}: {key} must be a number, got {value!r}")
    return float(value)


class KVFaults:
    def __init__(self, spec: dict[str, object], pool: KVPool, block_size: int, digester: BlockDigester | None) -> None:
        """spec: the environment variable's JSON object (probabilities by kind, `seed`, `log`: a file)."""
        unknown = set(spec) - {*KINDS, "seed", "log"}
        if unknown:
            raise ValueError(f"{ENV}: unknown keys {sorted(unknown)}")
        self._p = {k: _number(spec.get(k, 0.0), k) for k in KINDS}
        seed = spec.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{ENV}: seed must be an integer, got {seed!r}")
        self._rng = random.Random(seed)
        log = spec.get("log")
        if log is not None and not isinstance(log, str):
            raise ValueError(f"{ENV}: log must be a file name")
        self._log = log
        self._pool = pool
        self._block_size = block_size
        self._digester = digester
        self._lock = threading.Lock()
        self._early: list[str] = []  # reassigned: handed back to the engine at its next poll
        self._reassigned: dict[str, tuple[list[int], tuple[str, ...]]] = {}  # rid -> blocks, digests at hold
        self._flipped: set[str] = set()  # held with a flipped byte, not yet read
        logger.warning("TEST FAULTS ON (%s=%s): this producer corrupts KV on purpose", ENV, json.dumps(spec))

    @classmethod
    def from_env(cls, pool: KVPool, block_size: int, digester: BlockDigester | None) -> KVFaults | None:
        raw = os.environ.get(ENV)
        if not raw:
            return None
        spec = json.loads(raw)
        if not isinstance(spec, dict):
            raise ValueError(f"{ENV} must be a JSON object")
        return cls(spec, pool, block_size, digester)

    def _roll(self, kind: str) -> bool:
        with self._lock:
            return self._p[kind] > 0 and self._rng.random() < self._p[kind]

    def _record(self, kind: str, request_id: str, victim: bool, **extra: object) -> None:
        logger.warning("TEST FAULT %s on request %s (victim: %s)", kind, request_id, victim)
        if self._log:
            line = json.dumps({"kind": kind, "request_id": request_id, "victim": victim, "t": time.time(), **extra})
            with self._lock, open(self._log, "a") as f:
                f.write(line + "\n")

    # ---- the producer's calls -------------------------------------------------------------------------------

    def after_hold(self, request_id: str, block_ids: Sequence[int], num_tokens: int, push: bool) -> None:
        """The blocks are held and digested: maybe flip a byte, or hand them back early (pull only)."""
        if not push and num_tokens % self._block_size not in (0, 1) and self._roll("flip"):
            self._flip(request_id, int(block_ids[(num_tokens - 1) // self._block_size]))
        elif not push and self._digester is not None and self._roll("reassign"):
            ids = [int(b) for b in block_ids]
            with self._lock:
                self._reassigned[request_id] = (ids, tuple(self._digester.rank_digests(0, ids)))
                self._early.append(request_id)
            self._record("reassign", request_id, False, phase="held")

    def _flip(self, request_id: str, block: int) -> None:
        import torch

        row = self._pool[block].view(-1).view(torch.uint8) if self._pool.dtype != torch.uint8 \
            else self._pool[block].view(-1)
        offset = self._rng.randrange(row.numel())
        row[offset] ^= 0x5A
        with self._lock:
            self._flipped.add(request_id)
        self._record("flip", request_id, False, phase="held", block=block, offset=offset)

    def take_early_released(self) -> list[str]:
        with self._lock:
            out, self._early = self._early, []
        return out

    def was_reassigned(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._reassigned

    def on_released(self, request_id: str) -> None:
        """A consumer released the lease after its READ: a reassigned lease is a victim if its blocks changed."""
        with self._lock:
            entry = self._reassigned.pop(request_id, None)
            flipped = request_id in self._flipped
            self._flipped.discard(request_id)
        if flipped:
            self._record("flip", request_id, True, phase="read")
        if entry is None or self._digester is None:
            return
        ids, before = entry
        changed = tuple(self._digester.rank_digests(0, ids)) != before
        self._record("reassign", request_id, changed, phase="read")

    def before_push_done(self, request_id: str, agent: NixlAgent, region: PoolRegion, local_blocks: Sequence[int],
                         remote_name: str, remote_pool: RemotePool, remote_blocks: Sequence[int]) -> None:
        """Push mode, every block landed, the notification not yet sent: maybe WRITE another pool block's bytes
        into the last registered block (a stale write that lands before the decode's check)."""
        if not remote_blocks or not self._roll("stale_push"):
            return
        dst = int(remote_blocks[-1])
        own = {int(b) for b in local_blocks}
        src = next((b for b in range(region.num_blocks) if b not in own), None)
        if src is None:
            return
        local_descs, remote_descs = descriptor_arrays(coalesce_block_runs([src], [dst]), region, remote_pool)
        if remote_pool.block_bytes != region.block_bytes:  # another TP size: blocks of other sizes, fill the smaller
            remote_descs[0, 0] = remote_pool.base_addr + dst * remote_pool.block_bytes
            local_descs[0, 1] = remote_descs[0, 1] = min(region.block_bytes, remote_pool.block_bytes)
        handle = agent.post_write(local_descs=local_descs, local_mem=region.mem_type, remote_descs=remote_descs,
                                  remote_mem=remote_pool.mem_type, remote_name=remote_name)
        deadline = time.monotonic() + 5.0
        try:
            while agent.xfer_state(handle) == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0005)
        finally:
            agent.release_handle(handle)
        victim = True
        if self._digester is not None:
            src_d, held_d = self._digester.rank_digests(0, [src, int(local_blocks[-1])])
            victim = src_d != held_d
        self._record("stale_push", request_id, victim, src_block=src, dst_block=dst)
