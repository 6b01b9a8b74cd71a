"""What a publisher's events say its instance holds now, served as a snapshot (vLLM's KV event snapshots,
`docs/features/kv_events.md`, "Install a snapshot and follow live updates").

The recorder sees every batch the publisher numbers, in order, before it goes out (the publisher thread
applies it, then sends it), so a snapshot taken between two batches is exactly the state after the last one
sent: its sequence number is where a subscriber's live stream resumes. State is kept per medium, as vLLM's
recorder counts residency by (medium, ..., hash):

- `BlockStored` adds one reference per block, keeping its parent hash, tokens and block size (a subscriber
  that rebuilds prefix chains needs them; tokenless stores, as offload tiers may send, keep none);
- `BlockRemoved` drops one reference; at none the block is gone;
- `AllBlocksCleared` (the device pool's reset) clears the `GPU` medium only: host and disk tiers keep
  their blocks, as vLLM's tier semantics say (subscribers must apply the same rule to the live stream).

A snapshot is a list of `KVEventBatch` chunks of `BlockStored` events, in the order the blocks were stored
(a parent before its children), consecutive chained blocks of one medium merged into one event. Past
`max_blocks` live references the recorder is invalid and every later snapshot is "unavailable" (vLLM's
-2) until the publisher restarts; so is input loss (a batch the publisher's queue refused). Pure Python.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pdserve.kv_events.events import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)

MAX_BLOCKS = 1_000_000  # live references (vLLM's limit too)
CHUNK_BLOCKS = 4096  # blocks per snapshot chunk (one KVEventBatch)


class _Block:
    __slots__ = ("refs", "parent", "tokens", "block_size")

    def __init__(self, parent: int | None, tokens: tuple[int, ...], block_size: int) -> None:
        self.refs = 0
        self.parent = parent
        self.tokens = tokens
        self.block_size = block_size


class SnapshotRecorder:
    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._media: dict[str, dict[int, _Block]] = {}  # medium -> hash -> block, in store order
        self._refs = 0
        self.invalid: str | None = None  # why snapshots are unavailable, once they are

    @property
    def blocks(self) -> int:
        """Live references recorded."""
        return self._refs

    def invalidate(self, reason: str) -> None:
        if self.invalid is None:
            self.invalid = reason
            self._media.clear()
            self._refs = 0

    def apply(self, batch: KVEventBatch) -> None:
        if self.invalid is not None:
            return
        for event in batch.events:
            self._apply(event)
        if self._refs > self.max_blocks:
            self.invalidate(f"more than {self.max_blocks} live block references")

    def _apply(self, event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored):
            blocks = self._media.setdefault(event.medium or MEDIUM_DEVICE, {})
            bs, tokens = event.block_size, event.token_ids
            whole = bs > 0 and len(tokens) == bs * len(event.block_hashes)
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                block = blocks.get(h)
                if block is None:
                    block = blocks[h] = _Block(parent, tuple(tokens[i * bs:(i + 1) * bs]) if whole else (), bs)
                block.refs += 1
                self._refs += 1
                parent = h
        elif isinstance(event, BlockRemoved):
            blocks = self._media.get(event.medium or MEDIUM_DEVICE, {})
            for h in event.block_hashes:
                block = blocks.get(h)
                if block is None:
                    continue  # a removal of what was never announced: nothing to forget
                block.refs -= 1
                self._refs -= 1
                if block.refs == 0:
                    del blocks[h]
        elif isinstance(event, AllBlocksCleared):
            gone = self._media.pop(MEDIUM_DEVICE, {})
            self._refs -= sum(b.refs for b in gone.values())

    def chunks(self, data_parallel_rank: int | None = 0, chunk_blocks: int = CHUNK_BLOCKS) -> list[KVEventBatch]:
        """The recorded state as BlockStored batches (empty list: an empty cache). Call only when valid."""
        assert self.invalid is None
        now = time.time()
        out: list[KVEventBatch] = []
        events: list[KVCacheEvent] = []
        in_chunk = 0
        for event in self._events():
            events.append(event)
            in_chunk += len(event.block_hashes)
            if in_chunk >= chunk_blocks:
                out.append(KVEventBatch(ts=now, events=events, data_parallel_rank=data_parallel_rank))
                events, in_chunk = [], 0
        if events:
            out.append(KVEventBatch(ts=now, events=events, data_parallel_rank=data_parallel_rank))
        return out

    def _events(self) -> Iterable[BlockStored]:
        for medium, blocks in self._media.items():
            run: BlockStored | None = None
            extra: list[BlockStored] = []  # second and later references of one hash (kept, as vLLM's recorder does)
            for h, b in blocks.items():
                chained = (run is not None and b.parent == run.block_hashes[-1] and b.block_size == run.block_size
                           and bool(b.tokens) == bool(run.token_ids) and len(run.block_hashes) < CHUNK_BLOCKS)
                if chained:
                    assert run is not None
                    run.block_hashes.append(h)
                    run.token_ids.extend(b.tokens)
                else:
                    if run is not None:
                        yield run
                    run = BlockStored([h], b.parent, list(b.tokens), b.block_size, medium=medium)
                extra.extend(BlockStored([h], b.parent, list(b.tokens), b.block_size, medium=medium)
                             for _ in range(b.refs - 1))
            if run is not None:
                yield run
            yield from extra
