"""Producer (prefill) side: leases over finished requests' blocks, the side-channel handlers, NIXL progress.

Threads:
- side channel server: answers handshake/claim/release/abort/heartbeat from the lease table;
- progress: calls `get_new_notifs()` on the agent. With the UCX progress thread off, nobody else answers the
  consumer's connection setup or (on TCP) serves its READ, so this loop polls every ~50 us while a claim is
  outstanding or a handshake just happened, and sleeps 10 ms between polls when idle (never spins a core idle).
  It also runs the lease reaper and the periodic metrics log line.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import msgspec

from pdserve.api.pd import FirstToken, HeldKVParams, KVTransferParams, PushParams
from pdserve.kv_transfer.auth import MessageAuth
from pdserve.kv_transfer.compat import Compat, compat_differences
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.kv_transfer.digest import BlockDigester
from pdserve.kv_transfer.errors import SideChannelRefused
from pdserve.kv_transfer.leases import ClaimRefused, LeaseTable
from pdserve.kv_transfer.messages import (
    Abort,
    AbortReply,
    Claim,
    ClaimReply,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatReply,
    KvDigests,
    KvDigestsReply,
    PushCancel,
    PushRegister,
    PushStatus,
    RankEntry,
    Release,
    ReleaseReply,
    Reply,
    Request,
)
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.nixl_agent import NixlAgent, RankAgent, WorkerRankAgent
from pdserve.kv_transfer.pool import PoolRegion, bind_cuda_device
from pdserve.kv_transfer.side_channel import SideChannelServer

if TYPE_CHECKING:
    from pdserve.kv_transfer.faults import KVFaults
    from pdserve.kv_transfer.push_sender import PushSender

logger = logging.getLogger("pdserve.kv_transfer")

NOTIF_PREFIX = b"pdserve:"
_FAST_POLL_S = 0.00005
_IDLE_POLL_S = 0.01
_REAP_EVERY_S = 0.05
# After a handshake the consumer connects and posts its first READ; keep polling fast meanwhile.
_HANDSHAKE_BOOST_S = 2.0


class KVProducer:
    """The producer role (`pdserve.engine.pd.connector_protocol.KVProducerRole`): holds finished requests'
    blocks under leases for consumers to READ, or (push mode, `push_sender`) WRITEs them to the decode
    instance that registered for them."""

    def __init__(
        self,
        config: KVTransferConfig,
        *,
        server: SideChannelServer,
        agent: NixlAgent,
        region: PoolRegion,
        compat: Compat,
        metrics: TransferMetrics,
        auth: MessageAuth | None = None,
        ranks: Sequence[tuple[RankAgent, PoolRegion]] | None = None,
        digester: BlockDigester | None = None,
        faults: KVFaults | None = None,
    ) -> None:
        """ranks: (agent, region) of every tensor-parallel rank, rank 0 (`agent`, `region`) first; None = one.
        digester: digests held blocks into their params (`enable_kv_digest`); faults: test-only (faults.py)."""
        self._config = config
        self.digester = digester
        self.faults = faults
        # push mode: the digests of a push's blocks, served to its decode after the WRITEs (`kv_digests`), by
        # push key, until the decode fetched them or they expired
        self._push_digests: dict[str, tuple[tuple[tuple[str, ...], ...], str, float]] = {}
        self._push_digests_lock = threading.Lock()
        self._auth = auth
        self._server = server
        self._agent = agent
        self._region = region
        self._compat = dict(compat)
        self._metrics = metrics
        # Unique per incarnation (ms since the epoch): a consumer that cached an older incarnation's metadata
        # must re-handshake, and its claims with the old generation are refused.
        self.generation = time.time_ns() // 1_000_000
        self.leases = LeaseTable(
            config.kv_lease_duration,
            on_expired=lambda _rid: metrics.record_kv_expired(),
            on_late=lambda _rid: metrics.record_notification_after_expiry(),
            on_history_end=metrics.record_history_ended,
        )
        self._history_ids: set[str] = set()  # held conversation histories (engine thread only)
        self.num_refused_handshakes = 0
        self._agent_metadata = agent.metadata()
        ranks = list(ranks) if ranks is not None else [(agent, region)]
        # ranks 1..N-1: their progress loops run in their processes
        self._worker_agents = cast("list[WorkerRankAgent]", [a for a, _ in ranks[1:]])
        # What the handshake says about each rank: its agent and its pool shard.
        self._ranks = [RankEntry(a.name, a.metadata(), r.describe()) for a, r in ranks]
        self._boost_until = 0.0
        # push mode: its side-channel ops (push_sender.PushSender.handle), and where push completions a
        # co-located push receiver waits for go (kv_both: this loop reads the agent's notifications)
        self.push_handler: Callable[[PushRegister | PushStatus | PushCancel], Reply] | None = None
        self.push_sender: PushSender | None = None  # push mode: WRITEs held blocks to their decode instance
        self.push_notif: Callable[[bytes], bool] | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, name="pdserve-kv-progress", daemon=True)
        self._progress.start()
        server.set_handler(self._handle)

    # ---- engine API --------------------------------------------------------------------------------

    def parse_prefill_leg(self, params: KVTransferParams) -> PushParams | None:
        """A prefill leg's pairing key on a push producer (every leg's KV is pushed: pdserve's proxy's carry the key,
        one of vLLM's router's shape gets a minted one), else None (a pull producer serves a push-mode leg as a pull
        one); InvalidKVTransferParams when malformed."""
        return params.parse_push_prefill() if self.push_sender is not None and params.remote_decode else None

    def hold(
        self, request_id: str, block_ids: Sequence[int], num_tokens: int, num_cached_tokens: int = 0,
        push: PushParams | None = None, first_token: FirstToken | None = None,
    ) -> HeldKVParams:
        """Keep `block_ids` under a lease; returns the response's `kv_transfer_params`. A push-mode prefill leg
        (`push`, from `parse_prefill_leg`) is WRITTEN to the decode that registered under its push key; its
        lease ends when the push does."""
        self._check_block_ids(block_ids)
        lease_token = self.leases.hold(request_id, block_ids, num_tokens)
        digests = self._digests(request_id, block_ids)
        held = HeldKVParams(
            request_id=request_id,
            block_ids=tuple(int(b) for b in block_ids),
            num_tokens=num_tokens,
            num_cached_tokens=num_cached_tokens,
            engine_id=self._config.engine_id,
            host=self._config.side_channel_host,
            port=self._server.port,
            generation=self.generation,
            expires_at=time.time() + self._config.kv_lease_duration,
            lease_token=lease_token,
            tp_size=len(self._ranks),
            block_digests=digests,
            digest_algo=self.digester.algo if self.digester is not None else "",
            first_token=first_token,
        )
        if self.faults is not None:
            self.faults.after_hold(request_id, block_ids, num_tokens, push is not None and self.push_sender is not None)
        if push is None or self.push_sender is None:
            return held
        if digests:
            assert self.digester is not None
            ttl = self._config.push_registration_timeout + self._config.kv_lease_duration
            now = time.monotonic()
            with self._push_digests_lock:
                self._reap_push_digests_locked(now)  # those no decode fetched (its digests off) go too
                self._push_digests[push.push_key] = (digests, self.digester.algo, now + ttl)
        self.push_sender.finish(request_id, push, block_ids, num_tokens, (request_id, lease_token), first_token)
        # vLLM's push response shape (push_scheduler.request_finished); no lease token: nothing to claim. A minted
        # key goes back in the answer: the decode leg that vLLM's router builds from it presents it.
        return dataclasses.replace(held, push=True, push_key=push.push_key if push.minted else "")

    def send_ended(self, request_id: str) -> None:
        """A prefill leg ended without its KV (aborted, failed): a push job for it stops."""
        if self.push_sender is not None:
            self.push_sender.abandon(request_id)

    def hold_history(
        self, lease_id: str, block_ids: Sequence[int], num_tokens: int, block_hashes: Sequence[str],
        duration_s: float | None = None,
    ) -> HeldKVParams:
        """A finished decode leg's conversation (its full blocks) held for decoder_kv_blocks_ttl seconds (or
        `duration_s`: a cached prefix pinned for a peer) for the next prefill (bidirectional_kv_xfer); returns
        the kv_transfer_params it reads (vLLM's bidirectional shape)."""
        self._check_block_ids(block_ids)
        ttl = self._config.decoder_kv_blocks_ttl if duration_s is None else duration_s
        lease_token = self.leases.hold(lease_id, block_ids, num_tokens, duration_s=ttl, history=True)
        digests = self._digests(lease_id, block_ids)
        self._history_ids.add(lease_id)
        self._metrics.set_history_held(len(self._history_ids))
        return HeldKVParams(
            request_id=lease_id,
            block_ids=tuple(int(b) for b in block_ids),
            num_tokens=num_tokens,
            block_hashes=tuple(block_hashes),
            engine_id=self._config.engine_id,
            host=self._config.side_channel_host,
            port=self._server.port,
            generation=self.generation,
            expires_at=time.time() + ttl,
            lease_token=lease_token,
            block_bytes=self._region.block_bytes * len(self._ranks),
            tp_size=len(self._ranks),
            history=True,
            block_digests=digests,
            digest_algo=self.digester.algo if self.digester is not None else "",
        )

    def evict_history(self, lease_id: str) -> bool:
        """Free a held history now (its blocks are needed); False while a prefill is reading it."""
        return self.leases.evict(lease_id)

    def poll_released(self) -> list[str]:
        released = self.leases.poll_released()
        if self.faults is not None:  # test-only: leases whose blocks go back to the engine while still held
            released += self.faults.take_early_released()
        if self._history_ids and released:
            before = len(self._history_ids)
            self._history_ids.difference_update(released)
            if len(self._history_ids) != before:
                self._metrics.set_history_held(len(self._history_ids))
        return released

    def _digests(self, request_id: str, block_ids: Sequence[int]) -> tuple[tuple[str, ...], ...]:
        """Every rank's digests of the held blocks; none (the consumer counts the load as unverified) when a
        rank cannot answer: the KV itself is still good, and the engine thread must not fail here."""
        if self.digester is None:
            return ()
        try:
            return self.digester.held(block_ids)
        except Exception:  # noqa: BLE001 - e.g. a worker rank's RPC timed out
            logger.exception("KV digests of request %s not computed; its params carry none", request_id)
            return ()

    def _check_block_ids(self, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not 0 <= int(b) < self._region.num_blocks]
        if bad:
            raise ValueError(
                f"block ids out of range for a pool of {self._region.num_blocks} blocks: {bad[:8]}"
            )

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._progress.join(timeout=5.0)

    # ---- side channel ------------------------------------------------------------------------------

    def _handle(self, request: Request[Reply], peer: str) -> Reply:
        match request:
            case Handshake():
                return self._handshake(request)
            case KvDigests():
                return self._serve_push_digests(request.push_key)
            case PushRegister() | PushStatus() | PushCancel():
                return self._push_op(request)
            case Claim() | Release() | Abort() | Heartbeat():
                try:
                    return self._lease_op(request, peer)
                except ClaimRefused as exc:
                    raise SideChannelRefused(exc.reason, str(exc)) from None
        raise SideChannelRefused("bad_request", f"unsupported op {request.op!r}")

    def _push_op(self, request: PushRegister | PushStatus | PushCancel) -> Reply:
        if self.push_handler is None:
            raise SideChannelRefused("incompatible", "this prefill instance uses transfer_mode 'pull' "
                                     "(NixlConnector); push requests need NixlPushConnector on both sides")
        if isinstance(request, PushRegister) and request.generation != self.generation:
            raise SideChannelRefused("stale_generation", f"registration for generation {request.generation}, "
                                     f"this producer is generation {self.generation}")
        # No fast polling here: in push mode this instance is the WRITE initiator, progressed by its writer
        # thread (which polls its WRITEs), never a target; and a decode asks push_status every 20 ms for the
        # whole push, so a boost per call kept this loop spinning (a get_notifs call every 50 us, each taking
        # the GIL) on the prefill's cores for as long as the prefill computed: the push prefill leg's
        # slowness of issue 41.
        return self.push_handler(request)

    def _lease_op(self, request: Claim | Release | Abort | Heartbeat, peer: str) -> Reply:
        match request:
            case Heartbeat():
                return self._heartbeat(request, peer)
            case Claim():
                if request.generation != self.generation:
                    raise SideChannelRefused(
                        "stale_generation",
                        f"claim for generation {request.generation}, this producer is generation {self.generation}",
                    )
                block_ids, claim_token = self.leases.claim(request.request_id, request.lease_token,
                                                           request.timeout_s)
                self._wake.set()  # switch the progress loop to fast polling now
                for worker in self._worker_agents:  # and the other ranks' loops, while the claim may last
                    worker.boost(request.timeout_s)
                return ClaimReply(block_ids=tuple(block_ids), claim_token=claim_token)
            case Release():
                held = self.leases.release(request.request_id, request.lease_token, request.claim_token)
                if self.faults is not None:
                    self.faults.on_released(request.request_id)
                return ReleaseReply(held_throughout=held)
            case Abort():
                return AbortReply(freed=self.leases.abort(request.request_id, request.lease_token))

    def _serve_push_digests(self, push_key: str) -> KvDigestsReply:
        """A push's block digests, once, to the decode it WROTE to (the push key is the capability)."""
        with self._push_digests_lock:
            self._reap_push_digests_locked(time.monotonic())
            entry = self._push_digests.pop(push_key, None)
        if entry is None:
            raise SideChannelRefused("unknown", "no KV digests for this push (digests off, or expired)")
        digests, algo, _ = entry
        return KvDigestsReply(digests=digests, algo=algo)

    def _reap_push_digests_locked(self, now: float) -> None:
        for key in [k for k, (_, _, until) in self._push_digests.items() if until < now]:
            del self._push_digests[key]

    def _heartbeat(self, request: Heartbeat, peer: str) -> HeartbeatReply:
        request_ids, tokens = request.request_ids, request.lease_tokens
        if len(request_ids) != len(tokens):
            raise SideChannelRefused(
                "bad_request", f"heartbeat names {len(request_ids)} request ids but {len(tokens)} lease tokens"
            )
        unknown, refused = self.leases.heartbeat(zip(request_ids, tokens, strict=True))
        for rid in refused:
            # Counted and logged like any refusal; the consumer sees these leases as unknown (not extended).
            self._server.note_refusal("bad_token", peer, "heartbeat", f"wrong lease token for {rid!r}; not extended")
        return HeartbeatReply(unknown=tuple(unknown + refused))

    def _handshake(self, request: Handshake) -> HandshakeReply:
        diffs = compat_differences(self._compat, request.compat, ("producer", "consumer"))
        if diffs:
            self.num_refused_handshakes += 1
            text = "; ".join(diffs)
            logger.error("Refusing KV handshake from consumer %s: incompatible (%s)", request.engine_id, text)
            raise SideChannelRefused("incompatible", f"incompatible KV layout/model: {text}")
        self._boost_until = time.monotonic() + _HANDSHAKE_BOOST_S
        self._wake.set()
        metadatas = [r.agent_metadata for r in self._ranks]  # rank 0's is self._agent_metadata
        if self._auth is not None:
            # Readable only with the secret, even if the (signed) request was relayed by someone without it;
            # each rank's part is bound to this request, this generation and its rank index.
            metadatas = self._auth.seal_parts(metadatas, request.nonce, self.generation)
        return HandshakeReply(
            engine_id=self._config.engine_id,
            agent_name=self._agent.name,
            agent_metadata=metadatas[0],
            generation=self.generation,
            compat=self._compat,
            pool=self._region.describe(),
            lease_duration_s=self._config.kv_lease_duration,
            # tensor parallelism: every rank's agent and pool shard (rank 0's are the fields above)
            tp_size=len(self._ranks),
            ranks=tuple(msgspec.structs.replace(r, agent_metadata=md)
                        for r, md in zip(self._ranks, metadatas, strict=True)),
        )

    # ---- progress ----------------------------------------------------------------------------------

    def _progress_loop(self) -> None:
        bind_cuda_device(self._region)
        next_reap = 0.0
        while not self._stop.is_set():
            try:
                notifs = self._agent.get_notifs()
            except Exception:
                logger.exception("NIXL notification polling failed")
                notifs = {}
            for messages in notifs.values():
                for message in messages:
                    self._on_notif(message)
            now = time.monotonic()
            if now >= next_reap:
                next_reap = now + _REAP_EVERY_S
                self.leases.reap()
                self._metrics.maybe_log()
            if self.leases.num_claimed > 0 or now < self._boost_until:
                time.sleep(_FAST_POLL_S)
            else:
                self._wake.wait(_IDLE_POLL_S)
                self._wake.clear()

    def _on_notif(self, message: bytes) -> None:
        if self.push_notif is not None and self.push_notif(message):
            return
        if not message.startswith(NOTIF_PREFIX):
            logger.debug("ignoring foreign NIXL notification %r", message[:64])
            return
        self.leases.note_read_notification(message[len(NOTIF_PREFIX) :].decode("utf-8", "replace"))
