"""Routing by cached prefix: how much of a request's prompt each instance holds, and what sending it there costs.

The request's block hashes are computed from its prompt token ids exactly as the instances compute them
(`pdserve.kv_events.block_hash`, vLLM's sha256_cbor chain in its 64-bit event form), over the tokens the
engine may take from its cache: all but the last prompt token (an engine always computes at least one
token, so a prompt of exactly k full blocks can hit at most k - 1 of them). The index answers, for every
instance, how many leading blocks it holds.

The choice among available instances is Dynamo's KV router cost, in tokens rather than blocks:

    cost(instance) = weight x (prompt tokens not cached there) + the instance's outstanding tokens

(`--kv-overlap-weight`, default 1; outstanding tokens are the proxy's own estimate of the legs it has in
flight there, each counted by its uncached prompt tokens). The instance holding the prefix wins unless it
is busier than the prefill work it saves; an instance that publishes no events counts as holding nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.kv_events.block_hash import external_block_hashes
from pdserve.proxy.kv_index import KVIndex
from pdserve.proxy.pool import Instance

HIT = "hit"  # sent to an instance holding at least --kv-hit-fraction of the longest prefix cached anywhere
MISS = "miss"  # some instance held more of it
UNCACHED = "uncached"  # no instance held a block of it
UNKNOWN = "unknown"  # no prompt token ids, or no instance of the pool publishes events
OUTCOMES = (HIT, MISS, UNCACHED, UNKNOWN)


def cacheable_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Event-form hashes of the full blocks an engine can take from its cache for this prompt."""
    return external_block_hashes(token_ids[: max(len(token_ids) - 1, 0)], block_size)


@dataclass
class CachedPrefix:
    """What the fleet holds of one request's prompt (cached tokens by instance URL)."""

    prompt_tokens: int
    weight: float = 1.0
    cached: dict[str, int] = field(default_factory=dict)
    token_ids: Sequence[int] = ()  # the prompt's ids (a peer asked to pin its prefix is given them)

    def cached_tokens(self, inst: Instance) -> int:
        return self.cached.get(inst.url, 0)

    def uncached_tokens(self, inst: Instance) -> int:
        return max(self.prompt_tokens - self.cached.get(inst.url, 0), 0)

    def cost(self, inst: Instance) -> float:
        return self.weight * self.uncached_tokens(inst) + inst.outstanding_tokens

    def best_cached(self, instances: Iterable[Instance] | None = None) -> int:
        if instances is None:
            return max(self.cached.values(), default=0)
        return max((self.cached.get(inst.url, 0) for inst in instances), default=0)

    def outcome(self, chosen: Instance, instances: Iterable[Instance], hit_fraction: float) -> str:
        best = self.best_cached(instances)
        if best == 0:
            return UNCACHED
        return HIT if self.cached_tokens(chosen) >= hit_fraction * best else MISS


def lookup(
    index: KVIndex, token_ids: Sequence[int], block_sizes: dict[str, int], weight: float
) -> CachedPrefix:
    """The cached prefix of `token_ids` on every instance of `block_sizes` (URL -> its block size)."""
    prefix = CachedPrefix(len(token_ids), weight, token_ids=token_ids)
    by_size: dict[int, list[str]] = {}
    for url, size in block_sizes.items():
        by_size.setdefault(size, []).append(url)
    for size, urls in by_size.items():
        hashes = cacheable_hashes(token_ids, size)
        for url, blocks in index.prefix_blocks(hashes, urls).items():
            prefix.cached[url] = blocks * size
    return prefix
