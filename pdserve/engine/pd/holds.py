"""KV kept after its request finished, under a lease a peer reads: a prefill leg's blocks held for its decode
instance (KVState.HELD), a decode leg's conversation held for the next turn's prefill (HISTORY; vLLM's
bidirectional_kv_xfer), and a cached prefix pinned for a peer's prefill (a HISTORY entry too). `held` and
`history` index those states; both move together, here only, until the lease ends (RELEASED)."""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pdserve.api import pd
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.pd.connector_protocol import KVConnectorProtocol
from pdserve.engine.request import Request
from pdserve.types.sampling_params import SamplingParams

log = logging.getLogger("pdserve.engine")

PIN_PREFIX = "peer-pin-"  # lease ids of cached prefixes pinned for a peer (in Holds.history)


class PinRefused(RuntimeError):
    """A pin of cached blocks for a peer that this instance will not take (`reason`: disabled or busy)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Holds:
    def __init__(self, connector: KVConnectorProtocol | None, blocks: BlockManager, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.connector = connector  # the peer-pin settings
        self.producer = connector.producer if connector is not None else None  # the leases
        self.blocks = blocks
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.held: dict[str, Request] = {}  # producer: finished P legs whose blocks a consumer may read
        # finished decode legs' conversations (and pins) held for a later prefill, by lease id, oldest first
        # (the first evicted when the pool runs short)
        self.history: OrderedDict[str, Request] = OrderedDict()

    def finished(self, req: Request, completed: bool) -> bool:
        """A request ended: when `completed` (by a stop or its length), its blocks are held for a consumer
        (`kv.send`) or as a conversation (`kv.keep_history`). True when they are kept; False: the loop frees them."""
        if completed and req.kv.keep_history and req.finish_reason in ("length", "stop") and req.block_ids:
            return self._hold_history(req)
        if completed and req.kv.send and req.finish_reason in ("length", "stop") and req.block_ids \
                and self.producer is not None:
            first = None
            if len(req.output_token_ids) == 1 and req.num_computed_tokens == req.num_prompt_tokens:
                # a prefill leg (max_tokens 1): its token travels to the decode instance, which starts from it
                # (in its params; a push's also with the completion notice)
                lp = req.output_logprobs[0] if req.output_logprobs else None
                first = pd.FirstToken(req.output_token_ids[0], None if lp is None else lp.logprob,
                                      None if lp is None else lp.rank, tuple(lp.top) if lp is not None else ())
            params = self.producer.hold(
                req.request_id, list(req.block_ids), req.num_computed_tokens, max(req.num_cached_tokens, 0),
                push=req.kv.push, first_token=first,
            )
            req.result_kv_transfer_params = params
            req.kv.hold()
            self.held[req.request_id] = req
            return True
        if req.kv.send and self.producer is not None:
            self.producer.send_ended(req.request_id)  # a push job for it stops before the blocks go
        return False

    def released(self, lease_ids: Iterable[str]) -> None:
        """Leases that ended (read, expired, freed by the peer): their blocks go back to the pool."""
        for lease_id in lease_ids:
            req = self.held.pop(lease_id, None)
            if req is None:
                req = self.history.pop(lease_id, None)
            if req is not None:
                self._release(req)

    def _release(self, req: Request) -> None:
        req.kv.release()
        self.blocks.release(req)

    def _keep_history(self, lease_id: str, req: Request) -> None:
        req.kv.keep_as_history()
        self.history[lease_id] = req

    def _hold_history(self, req: Request) -> bool:
        """Keep the full blocks of a finished decode leg (prompt and answer: every token whose KV is
        computed) under a history lease; the partial last block is freed now. Its params go back in the
        response for the next turn's prefill to read (vLLM's bidirectional_kv_xfer). False when nothing is
        kept (the loop frees the blocks)."""
        assert self.producer is not None  # keep_history needs the producer role
        bs = self.blocks.block_size
        full = min(req.num_computed_tokens // bs, len(req.block_ids))
        lease_id = f"{req.request_id}-history"
        if full == 0 or lease_id in self.history:
            return False
        hashes = [pd.wire_block_hash(h) for h in self.blocks.block_hashes(req, full * bs)]
        self.blocks.free_blocks(req.block_ids[full:])
        req.block_ids = req.block_ids[:full]
        try:
            params = self.producer.hold_history(lease_id, list(req.block_ids), full * bs, hashes)
        except ValueError as e:  # e.g. an earlier request of the same id still holds its lease
            log.warning("request %s: its conversation's KV is not kept: %s", req.request_id, e)
            return False
        req.result_kv_transfer_params = params
        self._keep_history(lease_id, req)
        return True

    def make_room(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        """Held histories give their blocks back, oldest first, before this step's requests would wait or be
        preempted for lack of blocks: what the running requests still need for their tokens and the next one,
        and the next waiting prompt's blocks."""
        if not self.history:
            return
        assert self.producer is not None  # a held history needs the producer role
        bm = self.blocks
        need = sum(max(bm.blocks_needed(r.num_tokens + 1) - len(r.block_ids), 0) for r in running)
        if waiting:
            need += bm.blocks_needed(waiting[0].num_tokens + 1)
        for lease_id in list(self.history):
            if bm.num_free_blocks >= need:
                return
            if self.producer.evict_history(lease_id):  # False while a prefill reads it: it stays
                self._release(self.history.pop(lease_id))

    def pin_cached_prefix(self, token_ids: Sequence[int], min_tokens: int = 1) -> pd.HeldKVParams | None:
        """Hold the leading blocks of `token_ids` that this pool has cached under a short history lease
        (`peer_pin_ttl_s`), so that a peer's prefill can read them as it reads a held conversation; returns
        those params, or None when fewer than `min_tokens` tokens are cached. The pin is a history entry: it
        gives way when the pool runs short and ends as any held history does. Raises PinRefused."""
        conn = self.connector
        cap = conn.peer_pin_max_leases if conn is not None else 0
        if conn is None or cap <= 0 or not self.blocks.enable_prefix_caching:
            raise PinRefused("disabled", "this instance does not pin cached prefixes for peers")
        if sum(1 for lid in self.history if lid.startswith(PIN_PREFIX)) >= cap:
            raise PinRefused("busy", f"this instance already holds {cap} pinned prefixes")
        lease_id = f"{PIN_PREFIX}{uuid.uuid4().hex}"
        req = Request(lease_id, list(token_ids), SamplingParams(max_tokens=1), self.eos_token_ids,
                      self.max_model_len)
        hits = self.blocks.find_cached_prefix(req)
        bs = self.blocks.block_size
        if not hits or len(hits) * bs < min_tokens:
            return None
        self.blocks.allocate(req, len(hits) * bs, cached=hits)  # takes a reference: no longer evictable
        hashes = [pd.wire_block_hash(h) for h in self.blocks.block_hashes(req, len(hits) * bs)]
        assert self.producer is not None  # peer pins need bidirectional_kv_xfer, which needs the producer role
        params = self.producer.hold_history(lease_id, list(req.block_ids), len(hits) * bs, hashes,
                                            duration_s=conn.peer_pin_ttl_s)
        self._keep_history(lease_id, req)
        return params
