"""The fleet-wide index of cached KV blocks: block hash -> the instances holding it, and on which medium.

Fed by the instances' KV event batches (`pdserve.kv_events.events`, vLLM's wire format); read by the router, which asks for
the longest cached prefix of a request's block hashes on every instance. Block hashes are chained (each
depends on all tokens before it), so a hash found on an instance means that instance holds the block's
whole prefix too; the lookup still stops at the first missing block, as the engine's lookup does.

The index is a hint, never a correctness matter: a stale entry (an eviction event not seen yet) only costs
a cache miss on the chosen instance, which then computes the prompt as it would anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdserve.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

# Opaque: vLLM's events carry 64-bit ints by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), else bytes.
BlockHash = int | bytes

# vLLM's name for the device tier (`MEDIUM_GPU`); events without a medium mean it.
DEFAULT_MEDIUM = "GPU"


class KVIndex:
    """Media are kept as bit masks (one bit per medium name seen) so that an entry costs one small int: a
    fleet of instances with 10^5 blocks each is 10^5-10^6 entries."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, dict[str, int]] = {}  # hash -> instance url -> media mask
        self._by_instance: dict[str, dict[BlockHash, int]] = {}  # instance url -> hash -> media mask
        self._medium_bits: dict[str, int] = {}

    def _bit(self, medium: str | None) -> int:
        name = medium or DEFAULT_MEDIUM
        bit = self._medium_bits.get(name)
        if bit is None:
            bit = self._medium_bits[name] = 1 << len(self._medium_bits)
        return bit

    # ---- updates ---------------------------------------------------------------------------------
    def store(self, url: str, hashes: Iterable[BlockHash], medium: str | None = None) -> None:
        bit = self._bit(medium)
        mine = self._by_instance.setdefault(url, {})
        for h in hashes:
            mine[h] = mask = mine.get(h, 0) | bit
            self._holders.setdefault(h, {})[url] = mask

    def remove(self, url: str, hashes: Iterable[BlockHash], medium: str | None = None) -> None:
        bit = self._bit(medium)
        mine = self._by_instance.get(url)
        if not mine:
            return
        for h in hashes:
            mask = mine.get(h)
            if mask is None:
                continue
            mask &= ~bit
            if mask:
                mine[h] = self._holders[h][url] = mask
                continue
            del mine[h]
            holders = self._holders[h]
            del holders[url]
            if not holders:
                del self._holders[h]

    def clear(self, url: str) -> int:
        """Forget everything `url` holds (it restarted, left, died or lost events); returns the count."""
        mine = self._by_instance.pop(url, None)
        if not mine:
            return 0
        for h in mine:
            holders = self._holders[h]
            del holders[url]
            if not holders:
                del self._holders[h]
        return len(mine)

    def replace(self, url: str, other: KVIndex) -> None:
        """`url`'s entries become those `other` has for it, in one step (a snapshot built privately)."""
        self.clear(url)
        names = {bit: name for name, bit in other._medium_bits.items()}
        for h, mask in other._by_instance.get(url, {}).items():
            for bit, name in names.items():
                if mask & bit:
                    self.store(url, (h,), name)

    def apply(self, url: str, batch: KVEventBatch) -> None:
        """One decoded event batch from `url`, in order. `AllBlocksCleared` is the device pool's reset: it
        clears the `GPU` medium only (host and disk tiers keep theirs, as vLLM's tier semantics say)."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.store(url, event.block_hashes, event.medium)
            elif isinstance(event, BlockRemoved):
                self.remove(url, event.block_hashes, event.medium)
            elif isinstance(event, AllBlocksCleared):
                self.remove(url, list(self._by_instance.get(url, ())), DEFAULT_MEDIUM)

    # ---- queries ---------------------------------------------------------------------------------
    def prefix_blocks(self, hashes: Sequence[BlockHash], urls: Iterable[str] | None = None) -> dict[str, int]:
        """For every instance (of `urls`, default all) holding the first block: how many leading blocks of
        `hashes` it holds, on any medium. Instances holding none are absent."""
        if not hashes:
            return {}
        first = self._holders.get(hashes[0])
        if not first:
            return {}
        alive = set(first) if urls is None else set(first).intersection(urls)
        result = dict.fromkeys(alive, 1)
        for i in range(1, len(hashes)):
            if not alive:
                break
            holders = self._holders.get(hashes[i])
            alive = alive.intersection(holders) if holders else set()
            for url in alive:
                result[url] = i + 1
        return result

    def media(self, url: str, block_hash: BlockHash) -> frozenset[str]:
        mask = self._by_instance.get(url, {}).get(block_hash, 0)
        return frozenset(name for name, bit in self._medium_bits.items() if mask & bit)

    def instance_blocks(self, url: str) -> int:
        return len(self._by_instance.get(url, ()))

    def instances(self) -> list[str]:
        return [url for url, blocks in self._by_instance.items() if blocks]

    @property
    def entries(self) -> int:
        """(block, instance) pairs held: the index's size."""
        return sum(len(blocks) for blocks in self._by_instance.values())

    def __len__(self) -> int:
        """Distinct block hashes known."""
        return len(self._holders)
