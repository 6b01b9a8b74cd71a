"""The host-memory tier: a fixed array of block slots (pinned on CUDA boxes, so copies run at DMA speed),
indexed by block hash, evicted LRU. Used only from the engine thread."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from pdserve.kv_offload.block_meta import BlockMeta


class HostTier:
    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
                 digest: Callable[[torch.Tensor, int], str] | None = None):
        """digest(blocks, i): block i's digest (pdserve.kv_transfer.digest.cpu_block_digest); with it each block's
        digest is kept as stored, so that a block whose bytes changed in this tier is caught before it is loaded
        back (`intact`)."""
        if num_slots < 1:
            raise ValueError("the host KV tier holds no block: raise --kv-offloading-size")
        self.num_slots = num_slots
        self.data = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin)
        self._slot: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._meta: dict[bytes, BlockMeta] = {}
        self._digest_fn = digest
        self._digest: dict[bytes, str] | None = {} if digest is not None else None
        self._free = list(range(num_slots - 1, -1, -1))
        # blocks being loaded back right now: never the victim of the offloads those loads cause
        self.pinned: set[bytes] = set()

    def __contains__(self, h: bytes) -> bool:
        return h in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def meta(self, h: bytes) -> BlockMeta:
        return self._meta[h]

    def touch(self, h: bytes) -> None:
        self._slot.move_to_end(h)

    def store(self, h: bytes, meta: BlockMeta, src: torch.Tensor,
              keep_evicted: bool) -> tuple[bytes, BlockMeta, torch.Tensor | None] | None:
        """Copies `src` (one block) in under `h`. Returns the entry evicted to make room (hash, meta and, if
        keep_evicted, a copy of its data for the next tier), or None. When every slot is pinned, `h` is not
        stored (returns None; `h in self` tells)."""
        if h in self._slot:
            self._slot.move_to_end(h)
            return None
        evicted = None
        if not self._free:
            old = next((k for k in self._slot if k not in self.pinned), None)
            if old is None:
                return None
            slot = self._slot.pop(old)
            evicted = (old, self._meta.pop(old), self.data[slot].clone() if keep_evicted else None)
            if self._digest is not None:
                self._digest.pop(old, None)
            self._free.append(slot)
        slot = self._free.pop()
        self.data[slot].copy_(src)
        self._slot[h] = slot
        self._meta[h] = meta
        if self._digest is not None:
            self._digest[h] = self._digest_of(slot)
        return evicted

    def _digest_of(self, slot: int) -> str:
        assert self._digest_fn is not None
        return self._digest_fn(self.data, slot)

    def intact(self, h: bytes) -> bool:
        """Whether block `h`'s bytes are still those stored (True when digests are off)."""
        if self._digest is None or h not in self._slot:
            return True
        return self._digest_of(self._slot[h]) == self._digest[h]

    def drop(self, h: bytes) -> None:
        slot = self._slot.pop(h)
        self._meta.pop(h, None)
        if self._digest is not None:
            self._digest.pop(h, None)
        self._free.append(slot)

    def load(self, h: bytes, dst: torch.Tensor) -> None:
        """Copies block `h` into `dst` (a pool block) and marks it recently used."""
        dst.copy_(self.data[self._slot[h]])
        self._slot.move_to_end(h)

    def clear(self) -> list[bytes]:
        gone = list(self._slot)
        self.pinned.clear()
        self._slot.clear()
        self._meta.clear()
        if self._digest is not None:
            self._digest.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        return gone
