"""Pull mode, decode side: the transfer of a `KVConsumer` (consumer.py) that READs the KV a producer holds under
a lease: handshake once per producer, then per request claim -> READ -> release-with-verify; meanwhile the leases
of requests still waiting for blocks are heartbeated.

Safety rule: the bytes of a load are only reported usable if the producer confirms, on release, that the lease
was held from the claim until after the READ completed. Otherwise the blocks might have been freed and reused
mid-read, so the load fails (and the engine applies its failure policy).

A producer that refuses the lease the params name (unknown, expired, already claimed, wrong token: forged,
replayed or duplicated params), or params that do not fit the request (`mismatch`), are not a failed
transfer: the result says `rejected=<reason>`, it is counted in `pdserve:kv_lease_rejected_total`, and the
engine answers the client's mistake as such. One exception: under `kv_load_failure_policy: recompute` a lease
that `expired` (refused so only to the holder of its token: the leg is late, not forged) is counted the same
but recomputed.

All network and NIXL work runs on a small worker pool. Every step has a deadline: side-channel calls time out,
READs time out (a frozen producer never completes), and after a failed READ the handle is released and the
remote agent removed (which disconnects it) *before* the failure is reported, so nothing can land in the local
blocks after the engine gets them back.

Tensor parallelism (either side): the handshake lists the producer's ranks; each local rank loads the agents
of the producer ranks that hold its KV heads and READs exactly those heads into its own pool shard
(`head_split`); one claim and one release cover all ranks, and a load succeeds only if every rank's READs did.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pdserve.api.pd import LEASE_REJECTION_STATUS, KVTransferParams, LoadParams, RemotePrefillParams
from pdserve.kv_transfer.auth import AuthRefused
from pdserve.kv_transfer.compat import check_compat
from pdserve.kv_transfer.consumer import LoadResult, LoadSink
from pdserve.kv_transfer.errors import (
    CompatibilityError,
    KVTransferError,
    SideChannelError,
    SideChannelRefused,
    TransferFailed,
    TransferTimeout,
)
from pdserve.kv_transfer.head_split import RankRead, block_geometry, plan_rank_reads, source_ranks
from pdserve.kv_transfer.local_kv import LocalKV
from pdserve.kv_transfer.messages import Abort, Claim, Handshake, Heartbeat, Release
from pdserve.kv_transfer.nixl_agent import ReadStats
from pdserve.kv_transfer.pool import RemotePool, bind_cuda_device, check_block_ids, coalesce_block_runs
from pdserve.kv_transfer.producer import NOTIF_PREFIX
from pdserve.types.tp_layout import kv_heads_per_rank

logger = logging.getLogger("pdserve.kv_transfer")

# Heartbeats and early aborts are best-effort; they must not hold a worker for long on a frozen producer.
_NOTIFY_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class _RemoteRank:
    agent_name: str
    pool: RemotePool


@dataclass(frozen=True)
class _Remote:
    engine_id: str
    agent_name: str
    generation: int
    host: str
    port: int
    pool: RemotePool
    tp_size: int = 1
    ranks: tuple[_RemoteRank, ...] = ()  # every producer rank, rank 0 (agent_name, pool) first
    # for each local rank, the producer agents it loaded (removed again when the producer is forgotten)
    loaded: tuple[tuple[str, ...], ...] = ()


class _LoadFailed(Exception):
    """A load failure with its message for the engine/user.

    After the failure has been reported, best effort: `release` names a claim still to be released, `abort`
    says the producer is reachable and should free the (unclaimed) lease now instead of at its expiry.
    """

    def __init__(
        self,
        message: str,
        *,
        release: tuple[_Remote, str] | None = None,
        abort: bool = False,
        incompatible: bool = False,
        rejected: str | None = None,
    ) -> None:
        super().__init__(message)
        self.release = release
        self.abort = abort
        self.incompatible = incompatible
        self.rejected = rejected


@dataclass(frozen=True)
class _Load:
    """One load on its way: remote block i into local[i] for i in [first_block, len(local))."""

    request_id: str
    params: RemotePrefillParams
    local: list[int]
    first_block: int
    num_tokens: int | None
    t0: float  # perf_counter at its start


def _pull(params: LoadParams) -> RemotePrefillParams:
    """The params of a READ; push registrations are `push_receiver.PushReceiver`'s."""
    if not isinstance(params, RemotePrefillParams):
        raise TypeError(f"a pull consumer loads from RemotePrefillParams, not {type(params).__name__}")
    return params


class PullReader:
    """The pull transfer (`consumer.LoadTransfer`): claims a producer's lease, READs its blocks, releases it;
    heartbeats the leases of requests still waiting."""

    def __init__(self, kv: LocalKV, sink: LoadSink) -> None:
        self._kv = kv
        self._sink = sink
        local_heads = kv_heads_per_rank(len(kv.ranks), kv.num_kv_heads)
        # the units of a block and each head's bytes in them (an fp8 pool: head-major values, then scales)
        self._geometry = block_geometry(kv.compat, kv.region.block_bytes, local_heads)
        # READs of the ranks (and of several producer ranks) of one load run side by side
        self._read_pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._remotes: dict[str, _Remote] = {}
        self._remote_locks: dict[str, threading.Lock] = {}
        self._executor = ThreadPoolExecutor(
            kv.config.num_load_workers,
            thread_name_prefix="pdserve-kv-load",
            initializer=bind_cuda_device,
            initargs=(kv.region,),
        )

    # ---- the consumer's side ------------------------------------------------------------------------

    def parse(self, params: KVTransferParams) -> LoadParams:
        return params.parse_load(push=False)

    def let_go(self, params: LoadParams) -> None:
        """Ask the producer to free the lease now (best effort)."""
        parsed = _pull(params)
        with contextlib.suppress(RuntimeError):  # shutting down: the lease expires instead
            self._executor.submit(self._abort_remote, parsed)

    decline = let_go  # a held prefix not worth reading: the same early free

    def start(self, request_id: str, params: LoadParams, local: list[int], first_block: int,
              num_tokens: int | None) -> None:
        """Claim, READ local[first_block:] (fewer when the producer holds fewer blocks), release; on a worker."""
        self._executor.submit(self._run_load, _Load(request_id, _pull(params), local, first_block, num_tokens,
                                                   time.perf_counter()))

    def cancel(self, request_id: str) -> None:
        """A READ just finishes (its result still comes)."""

    def keep_alive(self, waiting: Sequence[LoadParams], stop: threading.Event) -> None:
        """Heartbeat the leases of the waiting requests, one call per producer."""
        interval = self._kv.config.heartbeat_interval_s
        by_producer: dict[tuple[str, int, str], list[RemotePrefillParams]] = {}
        for p in map(_pull, waiting):
            by_producer.setdefault((*p.address, p.remote_engine_id), []).append(p)
        for (host, port, engine_id), group in by_producer.items():
            if stop.is_set():
                return
            request = Heartbeat(request_ids=tuple(p.remote_request_id for p in group),
                                lease_tokens=tuple(p.lease_token for p in group))
            try:
                reply = self._kv.call(host, port, engine_id, request, min(_NOTIFY_TIMEOUT_S, interval))
                if reply.unknown:
                    logger.info("producer %s:%d no longer holds KV of %s", host, port, list(reply.unknown[:8]))
            except SideChannelError as exc:
                logger.info("KV heartbeat to %s:%d failed: %s", host, port, exc)

    def shutdown(self) -> None:
        # Running loads finish within their deadlines; queued ones are dropped.
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=True)

    def num_cached_remotes(self) -> int:
        with self._lock:
            return len(self._remotes)

    # ---- one load ----------------------------------------------------------------------------------

    def _run_load(self, job: _Load) -> None:
        request_id, p = job.request_id, job.params
        after: tuple[_Remote, str] | None = None  # a claim to release after reporting a failed READ
        abort = False
        try:
            result = self._load(job)
        except _LoadFailed as exc:
            after, abort = exc.release, exc.abort
            if exc.rejected is not None:
                self._kv.metrics.record_lease_rejected(exc.rejected)
                status = LEASE_REJECTION_STATUS[exc.rejected]
                if exc.rejected == "expired" and self._kv.config.kv_load_failure_policy == "recompute":
                    # The producer answers `expired` only to the lease's own token (a wrong one is `bad_token`,
                    # a lease already read or never held `unknown`): an honest leg that came late (a slow link,
                    # a long queue). Nothing was read; under `recompute` it computes the prompt, not a 410.
                    exc.rejected = None
            else:
                self._kv.metrics.record_failed_transfer()
                status = 409 if exc.incompatible else 500
            result = LoadResult(
                request_id,
                False,
                str(exc),
                seconds=time.perf_counter() - job.t0,
                error_status=status,
                rejected=exc.rejected,
            )
        except Exception as exc:
            logger.exception("KV load of request %s failed unexpectedly", request_id)
            self._kv.metrics.record_failed_transfer()
            result = LoadResult(
                request_id, False, f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - job.t0
            )
        if result.rejected is not None:
            logger.info("KV load of request %s refused by the producer: %s", request_id, result.error)
        elif not result.ok:
            logger.warning("KV load of request %s failed: %s", request_id, result.error)
        self._sink.report(result)
        if after is not None:
            # The producer can free its blocks early; the outcome does not depend on this call.
            remote, claim_token = after
            self._release(remote, p, claim_token, timeout_s=_NOTIFY_TIMEOUT_S, best_effort=True)
        elif abort:
            self._abort_remote(p)

    def _load(self, job: _Load) -> LoadResult:
        request_id, p, local, first_block, num_tokens = (
            job.request_id, job.params, job.local, job.first_block, job.num_tokens)
        if num_tokens is not None and (
            len(p.remote_block_ids) < len(local)
            or (p.remote_num_tokens is not None and p.remote_num_tokens < num_tokens)
        ):
            # The prompt is not the one the prefill computed (or the params were edited): the client's mistake.
            raise _LoadFailed(
                f"producer holds KV of {p.remote_num_tokens} tokens in {len(p.remote_block_ids)} blocks for "
                f"request {p.remote_request_id}; {num_tokens} tokens ({len(local)} blocks) are needed",
                abort=True,
                rejected="mismatch",
            )
        n = min(len(local), len(p.remote_block_ids))
        if first_block >= n:
            # Everything is in the local prefix cache: nothing to read, let the producer free at once.
            self._abort_remote(p)
            return LoadResult(request_id, True, seconds=time.perf_counter() - job.t0)

        remote = self._remote_for(p)
        remote, block_ids, token, timeout_s = self._claim(p, remote, n - first_block)
        if tuple(block_ids) != p.remote_block_ids:
            self._release(remote, p, token, timeout_s=_NOTIFY_TIMEOUT_S, best_effort=True)
            raise _LoadFailed(
                f"producer's lease of {p.remote_request_id} covers other blocks than the params name",
                rejected="mismatch",
            )
        self._sink.claimed(request_id)

        try:
            check_block_ids(block_ids[first_block:n], remote.pool.num_blocks, "remote")
            runs = coalesce_block_runs(local[first_block:n], block_ids[first_block:n])
            plans = [
                (d, plan_rank_reads(runs, geometry=self._geometry, num_kv_heads=self._kv.num_kv_heads, dst_rank=d,
                                    dst_tp=len(self._kv.ranks), src_tp=remote.tp_size, local=region,
                                    remotes=[r.pool for r in remote.ranks]))
                for d, (_, region) in enumerate(self._kv.ranks)
            ]
        except ValueError as exc:
            self._release(remote, p, token, timeout_s=_NOTIFY_TIMEOUT_S, best_effort=True)
            raise _LoadFailed(str(exc)) from None
        nbytes = sum(r.nbytes for _, reads in plans for r in reads)
        num_descriptors = sum(r.num_descriptors for _, reads in plans for r in reads)
        deadline = time.monotonic() + timeout_s
        notif = NOTIF_PREFIX + p.remote_request_id.encode()
        try:
            stats = self._read_all(plans, remote, notif, deadline)
        except (TransferTimeout, TransferFailed) as exc:
            # The peer is frozen or gone: disconnect it (cancels anything in flight) and re-handshake next time.
            self._forget_remote(remote)
            raise _LoadFailed(
                f"KV READ from {remote.host}:{remote.port} failed: {exc}", release=(remote, token)
            ) from None

        held = self._release(remote, p, token, timeout_s=self._kv.config.transfer_timeout_s)
        if not held:
            raise _LoadFailed(
                f"producer {remote.host}:{remote.port} did not hold the KV lease of {p.remote_request_id} "
                "throughout the READ (it expired); the data was discarded"
            )
        problem = self._sink.check_digests(p.block_digests, p.digest_algo, remote.tp_size, local[first_block:n],
                                           range(first_block, n), f"request {request_id}", "read")
        if problem is not None:
            raise _LoadFailed(problem)
        self._kv.metrics.record_transfer(
            xfer_s=stats.xfer_s, post_s=stats.post_s, nbytes=nbytes, num_descriptors=num_descriptors
        )
        return LoadResult(
            request_id,
            True,
            bytes=nbytes,
            seconds=time.perf_counter() - job.t0,
            num_descriptors=num_descriptors,
            xfer_seconds=stats.xfer_s,
            post_seconds=stats.post_s,
        )

    def _read_one(self, dst_rank: int, read: RankRead, remote: _Remote, notif: bytes, deadline: float) -> ReadStats:
        agent, region = self._kv.ranks[dst_rank]
        src = remote.ranks[read.src_rank]
        return agent.read(local_descs=read.local_descs, local_mem=region.mem_type, remote_descs=read.remote_descs,
                          remote_mem=src.pool.mem_type, remote_name=src.agent_name, notif=notif, deadline=deadline)

    def _read_all(self, plans: list[tuple[int, list[RankRead]]], remote: _Remote, notif: bytes,
                  deadline: float) -> ReadStats:
        """Every local rank's READs; with one READ in all (one rank each side) on this thread, as without
        tensor parallelism. Returns after all of them ended (so no READ still writes when a failure is
        reported); raises the first failure."""
        jobs = [(d, read) for d, reads in plans for read in reads]
        if len(jobs) == 1:
            return self._read_one(jobs[0][0], jobs[0][1], remote, notif, deadline)
        with self._lock:
            if self._read_pool is None:
                self._read_pool = ThreadPoolExecutor(
                    max(4, 2 * len(jobs)), thread_name_prefix="pdserve-kv-rank-read",
                    initializer=bind_cuda_device, initargs=(self._kv.region,))
            pool = self._read_pool
        futures: list[Future] = [pool.submit(self._read_one, d, read, remote, notif, deadline) for d, read in jobs]
        errors: list[BaseException] = []
        stats: list[ReadStats] = []
        for fut in futures:
            try:
                stats.append(fut.result())  # each READ is bounded by the deadline
            except (TransferTimeout, TransferFailed) as exc:
                errors.append(exc)
            except Exception as exc:  # noqa: BLE001 - a failed rank call is a failed READ
                errors.append(TransferFailed(f"{type(exc).__name__}: {exc}"))
        if errors:
            raise errors[0]
        return ReadStats(post_s=max(s.post_s for s in stats), xfer_s=max(s.xfer_s for s in stats))

    def _claim(
        self, p: RemotePrefillParams, remote: _Remote, num_blocks: int
    ) -> tuple[_Remote, tuple[int, ...], str, float]:
        nbytes = num_blocks * self._kv.region.block_bytes * len(self._kv.ranks)
        # Big READs over a slow transport legitimately take longer than the base timeout.
        timeout_s = self._kv.config.transfer_timeout_s + nbytes / (self._kv.config.transfer_min_gbps * 1e9)
        for attempt in range(2):
            try:
                claim = Claim(request_id=p.remote_request_id, lease_token=p.lease_token,
                              generation=remote.generation, timeout_s=timeout_s)
                reply = self._kv.call(remote.host, remote.port, remote.engine_id, claim,
                                      self._kv.config.transfer_timeout_s)
                return remote, reply.block_ids, reply.claim_token, timeout_s
            except SideChannelRefused as exc:
                if exc.reason == "stale_generation" and attempt == 0:
                    # The producer restarted since we cached its metadata: handshake again, then retry.
                    remote = self._remote_for(p, force=True)
                    continue
                if exc.reason in LEASE_REJECTION_STATUS:
                    raise _LoadFailed(str(exc), rejected=exc.reason) from None
                raise _LoadFailed(f"claim of {p.remote_request_id} refused ({exc.reason}): {exc}") from None
            except SideChannelError as exc:
                raise _LoadFailed(f"claim of {p.remote_request_id} failed: {exc}") from None
        raise AssertionError("unreachable")

    def _release(
        self,
        remote: _Remote,
        p: RemotePrefillParams,
        claim_token: str,
        *,
        timeout_s: float,
        best_effort: bool = False,
    ) -> bool:
        remote_request_id = p.remote_request_id
        try:
            release = Release(request_id=remote_request_id, lease_token=p.lease_token, claim_token=claim_token)
            return self._kv.call(remote.host, remote.port, remote.engine_id, release, timeout_s).held_throughout
        except SideChannelError as exc:
            self._kv.metrics.record_failed_notification()
            if best_effort:
                logger.info("KV release of %s not delivered: %s", remote_request_id, exc)
                return False
            raise _LoadFailed(
                f"could not confirm the KV lease of {remote_request_id} after the READ: {exc}"
            ) from None

    def _abort_remote(self, p: RemotePrefillParams) -> None:
        try:
            self._kv.call(p.remote_host, p.remote_port, p.remote_engine_id,
                          Abort(request_id=p.remote_request_id, lease_token=p.lease_token), _NOTIFY_TIMEOUT_S)
        except SideChannelRefused as exc:
            if exc.reason not in LEASE_REJECTION_STATUS:
                self._kv.metrics.record_failed_notification()
            logger.info("KV abort of %s refused: %s", p.remote_request_id, exc)  # e.g. forged params' token
        except SideChannelError as exc:
            self._kv.metrics.record_failed_notification()
            logger.info("KV abort of %s not delivered: %s", p.remote_request_id, exc)

    # ---- producers ---------------------------------------------------------------------------------

    def _remote_for(self, p: RemotePrefillParams, *, force: bool = False) -> _Remote:
        with self._lock:
            lock = self._remote_locks.setdefault(p.remote_engine_id, threading.Lock())
        with lock:
            with self._lock:
                cached = self._remotes.get(p.remote_engine_id)
            if (
                cached is not None
                and not force
                and (cached.host, cached.port) == p.address
                and (p.generation is None or p.generation == cached.generation)
                and p.tp_size == cached.tp_size
            ):
                return cached
            remote = self._handshake(p)
            with self._lock:
                self._remotes[p.remote_engine_id] = remote
            return remote

    def _handshake(self, p: RemotePrefillParams) -> _Remote:
        where = f"{p.remote_host}:{p.remote_port}"
        try:
            reply = self._kv.call(p.remote_host, p.remote_port, p.remote_engine_id,
                                  Handshake(engine_id=self._kv.config.engine_id, compat=self._kv.compat),
                                  self._kv.config.handshake_timeout_s)
        except SideChannelRefused as exc:
            if exc.reason == "incompatible":
                raise _LoadFailed(f"KV handshake with {where} refused: {exc}", abort=True, incompatible=True) from None
            raise _LoadFailed(f"KV handshake with {where} refused ({exc.reason}): {exc}") from None
        except SideChannelError as exc:
            raise _LoadFailed(f"KV handshake with {where} failed: {exc}") from None
        if reply.engine_id != p.remote_engine_id:
            raise _LoadFailed(
                f"side channel {where} belongs to engine {reply.engine_id!r}, the params name {p.remote_engine_id!r}",
                abort=True,
            )
        try:
            check_compat(self._kv.compat, reply.compat, peer=f"producer {where}", labels=("consumer", "producer"))
        except CompatibilityError as exc:
            raise _LoadFailed(str(exc), abort=True, incompatible=True) from None
        entries = reply.all_ranks()  # checked as a message: rank 0 is the reply's own agent, names unique
        if p.tp_size != len(entries):
            raise _LoadFailed(f"producer {where}: the params say the producer has tensor-parallel size {p.tp_size}, "
                              f"its handshake {len(entries)}", abort=True)
        ranks = [_RemoteRank(e.agent_name, e.pool) for e in entries]
        src_heads = kv_heads_per_rank(len(ranks), self._kv.num_kv_heads)
        bad = [r for r, rank in enumerate(ranks) if rank.pool.block_bytes != self._geometry.block_bytes(src_heads)]
        if bad:
            raise _LoadFailed(
                f"producer {where} rank {bad[0]} has {ranks[bad[0]].pool.block_bytes}-byte blocks; "
                f"{src_heads} KV heads of this model take {self._geometry.block_bytes(src_heads)}",
                abort=True,
                incompatible=True,
            )
        if p.generation is not None and reply.generation != p.generation:
            raise _LoadFailed(
                f"producer {where} restarted (generation {reply.generation}) since it issued these params "
                f"(generation {p.generation}); their KV is gone"
            )
        # Every rank's agent metadata, in rank order; with a secret each is sealed (AEAD) by the producer.
        blobs = [e.agent_metadata for e in entries]
        if self._kv.auth is not None:  # the reply is signed, so it came from a producer with the secret
            assert reply.re is not None  # it answers our nonce (side_channel.call checked)
            try:
                blobs = self._kv.auth.open_parts(blobs, reply.re, reply.generation)
            except AuthRefused as exc:
                raise _LoadFailed(f"producer {where}: {exc}", abort=True) from None
        metadata = {e.agent_name: blob for e, blob in zip(entries, blobs, strict=True)}
        loaded: list[list[str]] = [[] for _ in self._kv.ranks]
        try:
            for d, (agent, _) in enumerate(self._kv.ranks):
                for src in source_ranks(self._kv.num_kv_heads, d, len(self._kv.ranks), len(ranks)):
                    name = ranks[src].agent_name
                    agent.add_remote(metadata[name], name)
                    loaded[d].append(name)
        except KVTransferError as exc:
            self._remove_loaded(loaded)
            raise _LoadFailed(f"producer {where}: {exc}", abort=True) from None
        logger.info(
            "KV handshake with %s done (engine %s, generation %d, %d rank(s) there, %d here)",
            where,
            p.remote_engine_id,
            reply.generation,
            len(ranks),
            len(self._kv.ranks),
        )
        return _Remote(p.remote_engine_id, reply.agent_name, reply.generation, p.remote_host, p.remote_port,
                       reply.pool, len(ranks), tuple(ranks), tuple(tuple(names) for names in loaded))

    def _remove_loaded(self, loaded: Sequence[Sequence[str]]) -> None:
        for (agent, _), names in zip(self._kv.ranks, loaded, strict=True):
            for name in names:
                try:
                    agent.remove_remote(name)
                except Exception as exc:  # noqa: BLE001 - best effort: the rank may be gone
                    logger.debug("removing remote agent %s: %s", name, exc)

    def _forget_remote(self, remote: _Remote) -> None:
        """Drop a failed producer so the next load handshakes again.

        Under the producer's handshake lock, and only while the cache still holds this very entry: a restarted
        producer reuses the agent name, and a concurrent load may already have added its new metadata.
        """
        with self._lock:
            lock = self._remote_locks.setdefault(remote.engine_id, threading.Lock())
        with lock:
            with self._lock:
                if self._remotes.get(remote.engine_id) != remote:
                    return
                del self._remotes[remote.engine_id]
            self._remove_loaded(remote.loaded)
