"""Paged KV blocks: allocation, reference counts and prefix caching by chained block hashes.

A block whose ref count drops to zero goes to the back of the free queue but keeps its hash, so a later
request with the same prefix can revive it; blocks are evicted (hash dropped) from the front, LRU first.
Only block ids live here: the tensors belong to the model runner. Block identities are the chained
hashes of pdserve.kv_events.block_hash (one definition, shared with routers); with events enabled, every
change of what the pool holds is queued as a vLLM-compatible KV event (BlockStored / BlockRemoved /
AllBlocksCleared, medium "GPU") for the engine to publish once per step, as vLLM's block_pool.py does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from pdserve.engine.request import Request
from pdserve.kv_events import block_hash
from pdserve.kv_events.block_hash import external_block_hash
from pdserve.kv_events.events import MEDIUM_DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pdserve.kv_offload.block_meta import BlockMeta


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_events: bool = False):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.block_meta: list[BlockMeta | None] = [None] * num_blocks  # a cached block's parent hash and tokens
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there
        self.external_queries = 0  # tokens looked up past the pool's own hits in the offload tiers
        self.external_hits = 0  # tokens the offload tiers supplied
        self._events: list[KVCacheEvent] | None = [] if enable_events else None
        # Called with (block id, hash, meta) just before a cached block's identity is dropped to reuse the
        # block: its KV is still intact, so an offload tier can copy it out first. Set it before the first
        # request: a block's meta (its tokens) is kept only while events or this callback can read it.
        self.on_evict: Callable[[int, bytes, BlockMeta], None] | None = None

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix cache -----------------------------------------------------------------------
    def _compute_hashes(self, req: Request, upto_tokens: int) -> None:
        """Extend req.block_hashes to cover every full block within the first `upto_tokens` tokens."""
        bs = self.block_size
        done, full = len(req.block_hashes), upto_tokens // bs
        if done < full:
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.extend(block_hash.block_hashes(req.token_slice(done * bs, full * bs), bs, parent))

    def block_hashes(self, req: Request, upto_tokens: int) -> list[int]:
        """The chained hashes of req's full blocks within its first `upto_tokens` tokens (prompt, then
        output), whether or not prefix caching is on: what a held prefix is matched by."""
        self._compute_hashes(req, upto_tokens)
        return req.block_hashes[: upto_tokens // self.block_size]

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix of req's tokens. At least one token is always left to
        compute, since the last prompt token's logits are needed."""
        if not self.enable_prefix_caching:
            return []
        max_tokens = req.num_tokens - 1
        self._compute_hashes(req, max_tokens)
        if req.params.prompt_logprobs is not None:
            # prompt logprobs need the logits of every prompt position: the whole prompt is computed (vLLM's
            # kv_cache_manager.get_computed_blocks skips the cache for them too); its blocks are still cached
            return []
        hits: list[int] = []
        for h in req.block_hashes[: max_tokens // self.block_size]:
            bid = self.cached.get(h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def record_prefix_query(self, queried_tokens: int, hit_tokens: int, external_hit_tokens: int = 0,
                            count_external: bool = False) -> None:
        """hit_tokens: every prompt token not computed (pool and tiers); the pool's own share goes to
        prefix_hits, as vLLM's local prefix cache counters, the tiers' to external_* (vLLM's connector ones)."""
        local = hit_tokens - external_hit_tokens
        self.prefix_queries += queried_tokens
        self.prefix_hits += local
        if count_external:
            self.external_queries += queried_tokens - local
            self.external_hits += external_hit_tokens

    def touch(self, block_ids: Sequence[int]) -> None:
        """Marks evictable cached blocks most recently used (a prompt is about to reuse them)."""
        for bid in block_ids:
            if self.ref_cnt[bid] == 0:
                self.free.move_to_end(bid)

    def promote(self, h: bytes, meta: BlockMeta) -> int | None:
        """Registers a block for hash `h` whose KV the caller is about to copy in from an offload tier: an
        evictable cached block (ref count 0, most recently used), taken from the LRU end of the free queue.
        None when the pool has no free block or already holds `h`."""
        if h in self.cached or not self.free:
            return None
        bid = self._take_free()
        self.ref_cnt[bid] = 0
        self.free[bid] = None
        self.block_hash[bid] = h
        self.block_meta[bid] = meta
        self.cached[h] = bid
        if self._events is not None:
            self._events.append(BlockStored(
                [external_block_hash(h)], None if meta.parent is None else external_block_hash(meta.parent),
                list(meta.tokens), self.block_size, medium=MEDIUM_DEVICE))
        return bid

    def cache_full_blocks(self, req: Request) -> None:
        """Register the hashes of req's blocks that are now completely computed."""
        if not self.enable_prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        first = req.num_registered_blocks
        if full <= first:
            return  # nothing new: keeps the per-step cost independent of context length
        self._compute_hashes(req, req.num_computed_tokens)
        # A hot path (a 32k prompt is 2k blocks at 16 tokens): locals, and a block's meta (its tokens as a tuple)
        # built only when something reads it: the KV events and the offload tiers' on_evict.
        block_hash, cached, ids, hashes = self.block_hash, self.cached, req.block_ids, req.block_hashes
        if self._events is None and self.on_evict is None:
            for i in range(first, full):
                bid = ids[i]
                h = hashes[i]
                if block_hash[bid] is None and h not in cached:
                    # (an identical block may already exist; then this one stays uncached)
                    block_hash[bid] = h
                    cached[h] = bid
            req.num_registered_blocks = full
            return
        bs = self.block_size
        run_start = -1  # first block of the current run of newly cached blocks (one BlockStored per run)
        for i in range(first, full):
            bid = ids[i]
            h = hashes[i]
            if block_hash[bid] is None and h not in cached:
                block_hash[bid] = h
                cached[h] = bid
                self.block_meta[bid] = BlockMeta(hashes[i - 1] if i > 0 else None,
                                                 tuple(req.token_slice(i * bs, (i + 1) * bs)))
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                self._stored_event(req, run_start, i)
                run_start = -1
        if run_start >= 0:
            self._stored_event(req, run_start, full)
        req.num_registered_blocks = full

    # ---- events -------------------------------------------------------------------------------
    def _stored_event(self, req: Request, first: int, end: int) -> None:
        if self._events is None:
            return
        self._events.append(BlockStored(
            block_hashes=[external_block_hash(h) for h in req.block_hashes[first:end]],
            parent_block_hash=external_block_hash(req.block_hashes[first - 1]) if first > 0 else None,
            token_ids=[t for bid in req.block_ids[first:end] for t in self.block_meta[bid].tokens],
            block_size=self.block_size, medium=MEDIUM_DEVICE))

    def take_events(self, more: Sequence[KVCacheEvent] = ()) -> list[KVCacheEvent]:
        """The events queued since the last call, then `more` (the offload tiers'), with consecutive removals
        of one medium merged into one event, and a stored block that extends the previous stored run."""
        if not self._events and not more:
            return []
        out: list[KVCacheEvent] = []
        for e in [*(self._events or ()), *more]:
            prev = out[-1] if out else None
            if isinstance(e, BlockRemoved) and isinstance(prev, BlockRemoved) and prev.medium == e.medium:
                prev.block_hashes.extend(e.block_hashes)
            elif (isinstance(e, BlockStored) and isinstance(prev, BlockStored) and prev.medium == e.medium
                  and e.parent_block_hash == prev.block_hashes[-1] and prev.block_size == e.block_size):
                prev.block_hashes.extend(e.block_hashes)
                prev.token_ids.extend(e.token_ids)
            else:
                out.append(e)
        if self._events is not None:
            self._events = []
        return out

    # ---- allocation -------------------------------------------------------------------------
    def _take_free(self) -> int:
        return self._take_free_blocks(1)[0]

    def _take_free_blocks(self, n: int) -> list[int]:
        """n blocks from the front of the free queue (LRU first), each one's cached identity evicted as it is
        taken, ref count 1. One loop for all n: a long prompt takes thousands at once."""
        pop, block_hash, block_meta, cached = self.free.popitem, self.block_hash, self.block_meta, self.cached
        ref_cnt, on_evict, events = self.ref_cnt, self.on_evict, self._events
        out: list[int] = []
        for _ in range(n):
            bid = pop(False)[0]
            h = block_hash[bid]
            if h is not None:  # evict its cached identity
                meta = block_meta[bid]
                if on_evict is not None and meta is not None:
                    on_evict(bid, h, meta)
                block_hash[bid] = None
                block_meta[bid] = None
                if cached.get(h) == bid:
                    del cached[h]
                    if events is not None:
                        events.append(BlockRemoved([external_block_hash(h)], MEDIUM_DEVICE))
            ref_cnt[bid] = 1
            out.append(bid)
        return out

    def can_allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        revived = sum(1 for b in cached if self.ref_cnt[b] == 0)
        new = self.blocks_needed(num_tokens) - len(req.block_ids) - len(cached)
        return new + revived <= len(self.free)

    def allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Grow req.block_ids to cover num_tokens tokens, first sharing `cached` prefix blocks.
        Returns False (and changes nothing) when the pool is short."""
        if not self.can_allocate(req, num_tokens, cached):
            return False
        for bid in cached:
            if self.ref_cnt[bid] == 0:
                del self.free[bid]
            self.ref_cnt[bid] += 1
            req.block_ids.append(bid)
        new = self.blocks_needed(num_tokens) - len(req.block_ids)
        if new > 0:
            req.block_ids.extend(self._take_free_blocks(new))
        return True

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        # Tail blocks first, so they are evicted before the shared prefix they extend.
        ref_cnt, free = self.ref_cnt, self.free
        for bid in reversed(block_ids):
            left = ref_cnt[bid] - 1
            ref_cnt[bid] = left
            assert left >= 0, f"block {bid} freed twice"
            if left == 0:
                free[bid] = None

    def release(self, req: Request) -> None:
        self.free_blocks(req.block_ids)
        req.block_ids = []
        req.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        for h, bid in list(self.cached.items()):
            self.block_hash[bid] = None
            self.block_meta[bid] = None
            del self.cached[h]
        if self._events is not None:
            self._events.append(AllBlocksCleared())
