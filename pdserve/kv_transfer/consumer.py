"""The consumer role (`pdserve.engine.pd.connector_protocol.KVConsumerRole`): decode legs and held prefixes load
their prompt's KV from a producer. One core whatever moves the bytes, composed with a transfer:

- the core (`KVConsumer`, here) is what the engine talks to: the requests waiting for blocks, the loads in
  flight, the queues of claims and outcomes the engine polls (and its wake-up), the block digests' check, the
  fetch-stage gauge and the periodic metrics line;
- the transfer (`LoadTransfer`) moves the bytes: `pull_reader.PullReader` claims the producer's lease, READs
  it and releases it, heartbeating the leases of requests still waiting; `push_receiver.PushReceiver`
  registers the blocks with the prefill, which WRITEs them. It reports to the core (`LoadSink`) from its own
  threads.

So the engine sees one consumer role in either mode and the connector passes nothing through. All network and
NIXL work runs on the transfer's threads; the engine thread only queues work and polls results.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.api.pd import FirstToken, KVTransferParams, LoadParams
from pdserve.kv_transfer.digest import BlockDigester, verify_load
from pdserve.kv_transfer.local_kv import LocalKV
from pdserve.kv_transfer.pool import check_block_ids

logger = logging.getLogger("pdserve.kv_transfer")


@dataclass(frozen=True)
class LoadResult:
    request_id: str
    ok: bool
    error: str | None = None
    bytes: int = 0
    seconds: float = 0.0  # the whole load: handshake (if any), claim, READ, release
    num_descriptors: int = 0
    xfer_seconds: float = 0.0  # the NIXL READ alone (post to completion)
    post_seconds: float = 0.0  # of which the post (NIXL transfer() call)
    # the HTTP status a failed request gets: 409 when the producer's KV cannot be read here at all
    # (incompatible layout, model or KV dtype: a deployment mistake, never retried), the lease rejection's
    # status (pdserve.api.pd.LEASE_REJECTION_STATUS) when `rejected`, else 500
    error_status: int = 500
    rejected: str | None = None  # the producer refused the lease the params name (a client error), and why
    first_token: FirstToken | None = None  # a push's completion: the token the prefill sampled (adopted by the engine)
    # a failed push whose prefill fell silent with WRITEs possibly in flight: its blocks may still be written until
    # this monotonic time (the registration's deadline); the engine answers the request now and keeps the
    # blocks out of its pool until then (engine/pd/loads.py)
    quarantine_until: float | None = None


def load_span(local_block_ids: Sequence[int], first_block: int, num_tokens: int | None, block_size: int,
              num_blocks: int) -> list[int]:
    """The local blocks a load fills: remote block i lands in local block i for i in [first_block, n), where n
    covers `num_tokens` tokens when given (else every local block given). ValueError when they do not fit."""
    local = [int(b) for b in local_block_ids]
    if num_tokens is not None:
        needed = -(-num_tokens // block_size)
        if num_tokens < 0 or needed > len(local):
            raise ValueError(f"{num_tokens} tokens need {needed} blocks, {len(local)} local blocks given")
        local = local[:needed]
    if first_block < 0 or first_block > len(local):
        raise ValueError(f"first_block {first_block} outside 0..{len(local)}")
    check_block_ids(local[first_block:], num_blocks, "local")
    return local


class LoadSink(Protocol):
    """What a transfer tells its consumer core, from any thread."""

    digester: BlockDigester | None  # the block digests' checker (None: `enable_kv_digest` off)

    def claimed(self, request_id: str) -> None:
        """The producer granted the load's lease (its READ may still run): the params can no longer be refused."""
        ...

    def report(self, result: LoadResult) -> None:
        """A load ended; nothing can land in its blocks any more."""
        ...

    def check_digests(self, expected: Sequence[Sequence[str]], algo: str | None, src_tp: int,
                      local_ids: Sequence[int], positions: Sequence[int], what: str, where: str) -> str | None: ...


class LoadTransfer(Protocol):
    """How a consumer's loads move the bytes (pull: `PullReader`, push: `PushReceiver`)."""

    def parse(self, params: KVTransferParams) -> LoadParams:
        """The load the params name in this mode (InvalidKVTransferParams names what is wrong)."""
        ...

    def keep_alive(self, waiting: Sequence[LoadParams], stop: threading.Event) -> None:
        """Every heartbeat interval, with the params of the requests still waiting for blocks (returns early
        once `stop` is set)."""
        ...

    def let_go(self, params: LoadParams) -> None:
        """A waiting request is gone before its load started: its producer may free now (best effort)."""
        ...

    def decline(self, params: LoadParams) -> None:
        """A held prefix this instance will not read: its holder may free it now (best effort)."""
        ...

    def start(self, request_id: str, params: LoadParams, local: list[int], first_block: int,
              num_tokens: int | None) -> None:
        """Fill local[first_block:] (`load_span`'s blocks); the outcome goes to the sink's `report`."""
        ...

    def cancel(self, request_id: str) -> None:
        """The request was aborted while its load runs; its outcome still comes."""
        ...

    def shutdown(self) -> None: ...


class KVConsumer:
    """The consumer role: waiting requests, loads in flight, claims and outcomes for the engine to poll; the
    bytes move through `transfer` (built here over `kv`, reporting to this core)."""

    def __init__(self, kv: LocalKV, transfer: Callable[[LocalKV, LoadSink], LoadTransfer], *,
                 digester: BlockDigester | None = None) -> None:
        """digester: checks loaded blocks against the producer's digests (None: `enable_kv_digest` off)."""
        self._kv = kv
        self.digester = digester
        self._lock = threading.Lock()
        self._waiting: dict[str, LoadParams] = {}
        self._inflight: set[str] = set()
        self._results: deque[LoadResult] = deque()
        self._claimed: deque[str] = deque()  # loads whose lease the producer granted, READ still to come
        self._notify: Callable[[], None] | None = None
        self.transfer = transfer(kv, self)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="pdserve-kv-heartbeat", daemon=True)
        self._ticker.start()

    # ---- engine API --------------------------------------------------------------------------------

    def parse(self, params: KVTransferParams) -> LoadParams:
        """A decode leg's or a held prefix's params, parsed once (InvalidKVTransferParams names what is wrong);
        what the other calls take."""
        return self.transfer.parse(params)

    def add_waiting(self, request_id: str, params: LoadParams) -> None:
        """The request waits for local blocks; a pull transfer heartbeats its producer's lease meanwhile."""
        with self._lock:
            self._waiting[request_id] = params
        self._update_stages()

    def remove_waiting(self, request_id: str) -> None:
        """The request is gone before its load started (client disconnect): let the producer free now."""
        with self._lock:
            params = self._waiting.pop(request_id, None)
        self._update_stages()
        if params is not None:
            self.transfer.let_go(params)

    def decline(self, params: LoadParams) -> None:
        """A lease this instance will not read: ask its producer to free it now (best effort)."""
        self.transfer.decline(params)

    def cancel_load(self, request_id: str) -> None:
        """The request was aborted while its load runs (a READ just finishes; a push is cancelled): its result
        still comes, once nothing can land in its blocks."""
        self.transfer.cancel(request_id)

    def start_load(
        self,
        request_id: str,
        params: LoadParams,
        local_block_ids: Sequence[int],
        first_block: int = 0,
        num_tokens: int | None = None,
    ) -> None:
        """Fill local block i with the producer's block i for i in [first_block, n).

        n = the blocks covering `num_tokens` tokens when given (the engine needs len(prompt) - 1), which the
        producer must hold, else min(len(local_block_ids), number of remote blocks): local blocks reserved for
        tokens still to be generated have no remote counterpart.
        Returns at once; the outcome comes from `poll_loads()`. The local blocks must stay allocated until then.
        """
        local = load_span(local_block_ids, first_block, num_tokens, self._kv.block_size, self._kv.region.num_blocks)
        with self._lock:
            if request_id in self._inflight:
                raise ValueError(f"a KV load for request {request_id!r} is already in flight")
            self._waiting.pop(request_id, None)
            self._inflight.add(request_id)
        self._update_stages()
        try:
            self.transfer.start(request_id, params, local, first_block, num_tokens)
        except BaseException:
            with self._lock:
                self._inflight.discard(request_id)
            self._update_stages()
            raise

    def poll_loads(self) -> list[LoadResult]:
        with self._lock:
            out = list(self._results)
            self._results.clear()
        if out:
            self._update_stages()
        return out

    def poll_claimed(self) -> list[str]:
        """Request ids whose lease the producer granted since the last call (their READ may still run): from
        here on the params can no longer be refused, only the transfer can fail."""
        with self._lock:
            out = list(self._claimed)
            self._claimed.clear()
        return out

    def set_notify(self, callback: Callable[[], None] | None) -> None:
        """`callback` runs (on a worker thread) whenever a claim or a load's outcome is ready to poll, so the
        engine thread can wake at once instead of polling."""
        self._notify = callback

    def shutdown(self) -> None:
        self._stop.set()
        self._ticker.join(timeout=5.0)
        self.transfer.shutdown()  # running loads finish within their deadlines; queued ones are dropped

    # ---- the transfer's reports (LoadSink) -----------------------------------------------------------

    def claimed(self, request_id: str) -> None:
        with self._lock:
            self._claimed.append(request_id)
        self._notify_engine()

    def report(self, result: LoadResult) -> None:
        with self._lock:
            self._inflight.discard(result.request_id)
            self._results.append(result)
        self._notify_engine()
        self._update_stages()

    def check_digests(self, expected: Sequence[Sequence[str]], algo: str | None, src_tp: int,
                      local_ids: Sequence[int], positions: Sequence[int], what: str, where: str) -> str | None:
        """After a READ or a push: None when the loaded blocks may be used, else why not (a load failure)."""
        if self.digester is None:
            return None
        config = self._kv.config
        return verify_load(self.digester, metrics=self._kv.metrics, policy=config.kv_load_failure_policy,
                           required=config.kv_digest_required, expected=expected, algo=algo, src_tp=src_tp,
                           local_ids=local_ids, positions=list(positions), what=what, where=where)

    # ---- background --------------------------------------------------------------------------------

    def _notify_engine(self) -> None:
        callback = self._notify
        if callback is not None:
            callback()

    def _tick_loop(self) -> None:
        """The periodic metrics line, and every heartbeat interval the transfer's keep-alive of the waiting."""
        interval = self._kv.config.heartbeat_interval_s
        tick = min(interval, 0.5)  # also drives the periodic log line, whatever the lease length
        next_beat = time.monotonic() + interval
        while not self._stop.wait(tick):
            self._kv.metrics.maybe_log()
            if time.monotonic() < next_beat:
                continue
            next_beat = time.monotonic() + interval
            with self._lock:
                waiting = list(self._waiting.values())
            if waiting:
                self.transfer.keep_alive(waiting, self._stop)

    def _update_stages(self) -> None:
        with self._lock:
            waiting, inflight, done = len(self._waiting), len(self._inflight), len(self._results)
        self._kv.metrics.set_fetch_stages(waiting_to_start=waiting, in_progress=inflight, completed_waiting=done)
