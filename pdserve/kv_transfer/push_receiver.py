"""Push mode, decode side (`kv_connector: NixlPushConnector`): register the blocks a request lacks with its
prefill instance, then wait for the prefill to WRITE them (pdserve/kv_transfer/push_sender.py).

`PushReceiver` is the transfer of a push decode's `KVConsumer` (consumer.py), as `PullReader` is a pull one's: the
engine's load state machine is the pull path's (`KVHandoff`: WAITING -> LOADING -> LOADED/FAILED). `start` (from
`KVConsumer.start_load`) is called once the scheduler allocated the request's blocks after the local prefix-cache
hit, with `first_block` = the blocks that hit; only `[first_block, n)` are registered (vLLM's
NixlPushConnectorScheduler.update_state_after_alloc registers the unhashed blocks alike). The outcome is one
`LoadResult`, reported to the consumer (`LoadSink.report`) as a READ's is.

One watcher thread serves every pending push: it progresses the NIXL agent (a TCP transport needs the target
to progress for WRITEs to land) and reads the prefill's completion notification; every `_STATUS_EVERY_S` it
asks each prefill for the state of its pushes (`push_status`), which is how a failed WRITE, a prefill
request that ended without its KV, or a dead prefill (refused connections: a dead process writes nothing)
is learnt at once instead of at the deadline. Blocks are handed back to the engine (freed, or recomputed
into) only when nothing can still land in them: the push is done, quiesced after a failure or cancel, the
prefill is gone, or the registration's deadline (`push_registration_timeout`, after which the prefill posts
nothing) has passed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdserve.api.pd import KVTransferParams, LoadParams, PushParams
from pdserve.kv_transfer.auth import new_nonce
from pdserve.kv_transfer.compat import check_compat
from pdserve.kv_transfer.consumer import LoadResult, LoadSink
from pdserve.kv_transfer.digest import check_push
from pdserve.kv_transfer.errors import (
    CompatibilityError,
    SideChannelError,
    SideChannelRefused,
    SideChannelTimeout,
)
from pdserve.kv_transfer.local_kv import LocalKV
from pdserve.kv_transfer.messages import (
    Handshake,
    KvDigests,
    PushCancel,
    PushRegister,
    PushStatus,
    R,
    RankEntry,
    Request,
)
from pdserve.kv_transfer.pool import bind_cuda_device
from pdserve.kv_transfer.push_sender import first_token_from, parse_completion_notif

logger = logging.getLogger("pdserve.kv_transfer")

_STATUS_EVERY_S = 0.02
_FAST_POLL_S = 0.0002
_IDLE_POLL_S = 0.05
_DEAD_AFTER = 2  # consecutive refused/reset status calls: the prefill process is gone
_DEADLINE_MARGIN_S = 1.0
_BOOST_EVERY_S = 1.0  # the registration reaches the prefill a little after we sent it


@dataclass
class _Pending:
    request_id: str
    params: PushParams
    started: float
    deadline: float  # monotonic: give the blocks back (the prefill posts nothing after its own cutoff)
    nbytes: int
    cancel: bool = False  # the engine aborted the request: cancel, then wait until quiesced
    cancel_sent: bool = False
    unreachable: int = 0
    silent_since: float | None = None  # monotonic: the first of the status calls timing out in a row
    registered: bool = False  # the prefill accepted the registration (before: only cancel is sent)
    blocks: list[int] = field(default_factory=list)  # the local blocks registered, for request blocks [first_block..)
    first_block: int = 0


def _push(params: LoadParams) -> PushParams:
    if not isinstance(params, PushParams):
        raise TypeError(f"a push consumer loads from PushParams, not {type(params).__name__}")
    return params


class PushReceiver:
    """The push transfer (`consumer.LoadTransfer`) of a `KVConsumer`: a load registers the request's blocks with
    its prefill, which WRITEs them, instead of READing a lease; the outcome goes to the consumer (`sink`)."""

    def __init__(self, kv: LocalKV, sink: LoadSink) -> None:
        """kv.ranks: every rank registers its pool shard, and the prefill's ranks WRITE each decode rank its heads.
        sink: the consumer core; with its digester set, a push's blocks are checked against the prefill's digests."""
        self._kv = kv
        self._sink = sink
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}  # by push key
        self._by_request: dict[str, str] = {}
        # producer -> (generation, tensor-parallel size), once a handshake checked it
        self._generations: dict[tuple[str, str, int], tuple[int, int]] = {}
        self._next_boost = 0.0
        self._executor = ThreadPoolExecutor(kv.config.num_load_workers, thread_name_prefix="pdserve-kv-push-reg")
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch_loop, name="pdserve-kv-push-watch", daemon=True)
        self._thread.start()

    # ---- the consumer's side (consumer.LoadTransfer) -------------------------------------------------------

    def parse(self, params: KVTransferParams) -> LoadParams:
        return params.parse_load(push=True)

    def keep_alive(self, waiting: Sequence[LoadParams], stop: threading.Event) -> None:
        """Nothing to keep alive: the prefill holds no lease for a push before its registration."""

    def let_go(self, params: LoadParams) -> None:
        """A request gone before its blocks were allocated: tell the prefill to stop (best effort)."""
        with contextlib.suppress(RuntimeError):
            self._executor.submit(self._cancel_remote, _push(params))

    def decline(self, params: LoadParams) -> None:
        raise TypeError("a push decode instance reads no held prefix (its params are refused by `parse`)")

    def start(self, request_id: str, params: LoadParams, local: list[int], first_block: int,
              num_tokens: int | None) -> None:
        """Register local[first_block:] (`consumer.load_span`'s blocks) with the prefill, which WRITEs them."""
        if num_tokens is None:
            raise ValueError("a push load needs its number of tokens")
        p = _push(params)
        now = time.monotonic()
        item = _Pending(request_id, p, time.perf_counter(),
                        # the prefill posts nothing after timeout_s and releases a WRITE after transfer_timeout_s
                        now + self._kv.config.push_registration_timeout + self._kv.config.transfer_timeout_s
                        + _DEADLINE_MARGIN_S,
                        (len(local) - first_block) * sum(r.block_bytes for _, r in self._kv.ranks),
                        blocks=local[first_block:], first_block=first_block)
        with self._lock:
            if p.push_key in self._pending:
                raise ValueError("a push under this push_key is already registered here")
            self._pending[p.push_key] = item
            self._by_request[request_id] = p.push_key
        if first_block == len(local):  # the local prefix cache holds every block the prompt needs from the prefill
            self._executor.submit(self._cancel_remote, p)  # the prefill's job ends now, not at its lease
            self._end(item, LoadResult(request_id, True))
            return
        self._executor.submit(self._register, item, local[first_block:], first_block, num_tokens)

    def cancel(self, request_id: str) -> None:
        """The request was aborted while its push was pending: cancel; its result comes once quiesced."""
        with self._lock:
            key = self._by_request.get(request_id)
            item = self._pending.get(key) if key is not None else None
            if item is not None:
                item.cancel = True
        self._wake.set()

    def on_notif(self, message: bytes) -> bool:
        """A NIXL notification; True when it was a push completion (consumed)."""
        notice = parse_completion_notif(message)
        if notice is None:
            return False
        key, first_token = notice
        with self._lock:
            item = self._pending.get(key)
        if item is not None and item.registered:
            self._end(item, LoadResult(item.request_id, True, bytes=item.nbytes,
                                       seconds=time.perf_counter() - item.started, first_token=first_token))
        return True

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- registration --------------------------------------------------------------------------------------

    def _call(self, p: PushParams, request: Request[R], timeout_s: float) -> R:
        return self._kv.call(p.remote_host, p.remote_port, p.remote_engine_id, request, timeout_s)

    def _verify(self, item: _Pending) -> str | None:
        """After a push: the prefill's digests of what it WROTE (side channel) against the blocks here."""
        p = item.params
        return check_push(lambda: self._call(p, KvDigests(push_key=p.push_key), self._kv.config.handshake_timeout_s),
                          self._sink.check_digests, item.request_id, item.blocks, item.first_block)

    def _generation(self, p: PushParams, *, force: bool = False) -> int:
        """The prefill's generation, after a handshake that checked compatibility (the transfer mode too) and
        that the params name the prefill's tensor-parallel size."""
        where = (p.remote_engine_id, p.remote_host, p.remote_port)
        with self._lock:
            known = self._generations.get(where)
        if known is None or force:
            reply = self._call(p, Handshake(engine_id=self._kv.config.engine_id, compat=self._kv.compat),
                               self._kv.config.handshake_timeout_s)
            if reply.engine_id != p.remote_engine_id:
                raise CompatibilityError(f"side channel {p.remote_host}:{p.remote_port} belongs to engine "
                                         f"{reply.engine_id!r}, the params name {p.remote_engine_id!r}")
            check_compat(self._kv.compat, reply.compat, peer=f"prefill {p.remote_host}:{p.remote_port}",
                         labels=("decode", "prefill"))
            known = (reply.generation, reply.tp_size)
            with self._lock:
                self._generations[where] = known
        generation, tp_size = known
        if tp_size != p.tp_size:
            raise CompatibilityError(f"the params say the prefill has tensor-parallel size {p.tp_size}, its "
                                     f"handshake {tp_size}")
        return generation

    def _register(self, item: _Pending, blocks: list[int], first_block: int, num_tokens: int) -> None:
        p = item.params
        try:
            for attempt in range(2):
                generation = self._generation(p, force=attempt > 0)
                seal = new_nonce()
                # every rank's agent metadata, each part sealed and bound to its rank index
                metadata = [a.metadata() for a, _ in self._kv.ranks]
                if self._kv.auth is not None:
                    metadata = self._kv.auth.seal_parts(metadata, seal, generation)
                ranks = None
                if len(self._kv.ranks) > 1:  # tensor parallelism: each rank's agent and pool shard, rank 0 first
                    ranks = tuple(RankEntry(a.name, md, r.describe())
                                  for (a, r), md in zip(self._kv.ranks, metadata, strict=True))
                register = PushRegister(
                    push_key=p.push_key, generation=generation, engine_id=self._kv.config.engine_id,
                    agent_name=self._kv.agent.name, agent_metadata=metadata[0], seal_nonce=seal,
                    pool=self._kv.region.describe(), block_ids=tuple(blocks), first_block=first_block,
                    num_tokens=num_tokens, timeout_s=self._kv.config.push_registration_timeout, ranks=ranks)
                try:
                    reply = self._call(p, register, self._kv.config.handshake_timeout_s)
                    break
                except SideChannelRefused as exc:
                    if exc.reason != "stale_generation" or attempt:
                        raise
        except CompatibilityError as exc:
            self._end(item, LoadResult(item.request_id, False, str(exc), error_status=409), failed=True)
            return
        except SideChannelRefused as exc:
            status = 409 if exc.reason == "incompatible" else 500
            self._end(item, LoadResult(item.request_id, False, f"push registration refused ({exc.reason}): {exc}",
                                       error_status=status), failed=True)
            return
        except SideChannelError as exc:
            # nothing registered (or a prefill that cannot answer): no WRITE can target these blocks
            self._end(item, LoadResult(item.request_id, False, f"push registration failed: {exc}"), failed=True)
            return
        with self._lock:
            item.registered = True
        self._wake.set()  # poll its status now (a job that already failed says why)
        logger.debug("KV push %s registered: %s", p.push_key[:8], reply.state)

    def _cancel_remote(self, p: PushParams) -> str | None:
        try:
            return self._call(p, PushCancel(push_key=p.push_key), 1.0).state
        except SideChannelError as exc:
            logger.info("KV push cancel of %s not delivered: %s", p.push_key[:8], exc)
            return None

    # ---- the watcher ---------------------------------------------------------------------------------------

    def _end(self, item: _Pending, result: LoadResult, *, failed: bool = False) -> None:
        with self._lock:
            if self._pending.get(item.params.push_key) is not item:
                return  # ended already
            del self._pending[item.params.push_key]
            self._by_request.pop(item.request_id, None)
        if result.ok and item.blocks and self._sink.digester is not None:
            problem = self._verify(item)
            if problem is not None:
                result, failed = LoadResult(item.request_id, False, problem), True
        if failed:
            self._kv.metrics.record_failed_transfer()
        elif result.ok and result.bytes:
            self._kv.metrics.record_transfer(xfer_s=result.seconds, post_s=0.0, nbytes=result.bytes, num_descriptors=0)
        if not result.ok:
            logger.warning("KV push into request %s ended: %s", item.request_id, result.error)
        self._sink.report(result)

    def _watch_loop(self) -> None:
        # this thread progresses the agent: a UCX transport that lands data through the host (TCP with
        # cuda_copy) copies it into the GPU pool here, in this thread's CUDA context
        bind_cuda_device(self._kv.region)
        next_status = 0.0
        while not self._stop.is_set():
            with self._lock:
                busy = bool(self._pending)
            if not busy:
                self._wake.wait(_IDLE_POLL_S)
                self._wake.clear()
                continue
            try:
                for messages in self._kv.agent.get_notifs().values():
                    for message in messages:
                        self.on_notif(message)
                now = time.monotonic()
                if now >= next_status or self._wake.is_set():
                    self._wake.clear()
                    next_status = now + _STATUS_EVERY_S
                    self._poll_status(now)
            except Exception:  # noqa: BLE001 - the watcher must survive anything one push does
                logger.exception("KV push watcher failed")
            time.sleep(_FAST_POLL_S)

    def _gave_up_on_silence(self, item: _Pending, now: float) -> bool:
        """A registered push whose prefill has answered no status call for `transfer_timeout_s` (a cut link, a
        frozen process): the request is answered now (failed: the policy applies) instead of at the
        registration's deadline, but its blocks stay out of the decode's pool until that deadline, as a WRITE
        of it may still land (`LoadResult.quarantine_until`). A prefill that comes back meanwhile is told to
        cancel (best effort). True when it gave up."""
        if item.silent_since is None:
            item.silent_since = now
            return False
        silent = now - item.silent_since
        if not item.registered or silent < self._kv.config.transfer_timeout_s or now > item.deadline:
            return False
        self._executor.submit(self._cancel_remote, item.params)
        self._end(item, LoadResult(item.request_id, False, f"prefill instance silent for {silent:.1f}s during the "
                                   "push (its status calls time out); its blocks are kept until the push's "
                                   "deadline", quarantine_until=item.deadline), failed=True)
        return True

    def _poll_status(self, now: float) -> None:
        with self._lock:
            items = [i for i in self._pending.values() if i.registered or i.cancel]
        if items and len(self._kv.ranks) > 1 and now >= self._next_boost:
            # worker ranks progress their agents fast while WRITEs may land in them (a TCP transport needs the
            # target to progress); renewed while pushes are pending, so an idle decode does not spin
            self._next_boost = now + _BOOST_EVERY_S
            for a in self._kv.worker_agents:
                a.boost(2 * _BOOST_EVERY_S)
        by_prefill: dict[tuple[str, str, int], list[_Pending]] = {}
        for item in items:
            p = item.params
            by_prefill.setdefault((p.remote_engine_id, p.remote_host, p.remote_port), []).append(item)
        for group in by_prefill.values():
            p = group[0].params
            for item in group:
                if item.cancel and not item.cancel_sent:
                    item.cancel_sent = True
                    if self._cancel_remote(item.params) is None and not item.registered:
                        self._end(item, LoadResult(item.request_id, False, "aborted"))
            firsts: Sequence[object] = ()
            try:
                reply = self._call(p, PushStatus(push_keys=tuple(i.params.push_key for i in group)), 1.0)
            except SideChannelTimeout:
                states = errors = None  # frozen or slow: wait (it may still write) until the deadline
            except SideChannelError as exc:
                for item in group:
                    item.unreachable += 1
                    if item.unreachable >= _DEAD_AFTER:
                        self._end(item, LoadResult(item.request_id, False, f"prefill instance unreachable during "
                                                   f"the push (gone: nothing more can land): {exc}"), failed=True)
                continue
            else:
                states, errors = reply.states, reply.errors
                firsts = reply.first_tokens
            for k, item in enumerate(group):
                state = states[k] if states is not None and k < len(states) else None
                if state is not None:
                    item.unreachable = 0
                    item.silent_since = None
                elif states is None and self._gave_up_on_silence(item, now):
                    continue
                if state == "done":  # the completion notice was missed (or is behind this reply)
                    self._end(item, LoadResult(item.request_id, True, bytes=item.nbytes,
                                               seconds=time.perf_counter() - item.started,
                                               first_token=first_token_from(firsts[k] if k < len(firsts) else None)))
                elif state in ("failed", "cancelled", "unknown") and (item.registered or item.cancel):
                    if item.cancel:
                        self._end(item, LoadResult(item.request_id, False, "aborted"))
                    else:
                        why = errors[k] if state == "failed" and errors else (
                            "the prefill instance no longer knows this push (restarted?)")
                        self._end(item, LoadResult(item.request_id, False, f"KV push failed: {why}"), failed=True)
                elif now > item.deadline:
                    self._end(item, LoadResult(item.request_id, False, f"KV push not completed within "
                                               f"{self._kv.config.push_registration_timeout:g}s"), failed=True)

