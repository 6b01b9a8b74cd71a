"""Push mode, prefill side (`kv_connector: NixlPushConnector`): WRITE the KV into blocks a decode registered.

vLLM's push connector (vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_scheduler.py, push_worker.py;
vllm-project/vllm#35264) WRITEs the whole request from a writer thread after the prefill; the open per-layer
PR (vllm-project/vllm#56874) WRITEs each layer as it is computed. Both are here (`push_pipeline`: "request" or
"layer"; "auto", the default, is layer on CPU pools and request on GPU pools: config.push_layer_by_layer), with
the reliability rows of vllm-project/vllm#48633 designed out:

- C1 (writes after the decode aborted): a cancel stops the job at once (nothing more is posted); the decode
  frees its blocks only once `push_status` says the job is quiesced (no WRITE of it in flight), the prefill
  is gone (a dead process writes nothing), or its own deadline passed (no WRITE is posted after the
  registration's `timeout_s`, and one in flight is released after `transfer_timeout_s`: the decode waits
  for both).
- C2 (a WRITE that fails to post leaves the decode waiting to lease expiry): the job fails with the error at
  once and `push_status`, which the decode polls every few tens of ms, says so.
- C3 (a partial prefix hit sends blocks into the wrong slots): the decode registers exactly the blocks it
  lacks, `[first_block, n)` of the request's block table, and block i of the request goes to the decode's
  i-th registered block: prefix hits on either side only change which blocks exist, never the pairing.

The forward thread only appends to a queue (`step_hook`'s per-layer callback); a writer thread merges the
layer windows queued together, builds the descriptors (`push_plan`: one per run of consecutive blocks, per
layer window, per pair of tensor-parallel ranks), posts the WRITEs without waiting (a worker rank's through
its `kv_rank.RemoteRankAgent`), polls them, and sends the completion notification (NIXL, from rank 0 to the
decode's rank 0, after every rank's WRITEs completed) once every block of every layer has landed. A job's
prefill blocks stay under the request's lease until the job ended and nothing of it is in flight.
- C4 (vllm#55470: a deferred write after the producer request ended): WRITEs come only from blocks held under
  the job's lease; a prefill that ended without its KV fails its job, and one whose lease ended with no
  registration fails it too, so a registration arriving later writes nothing.

On a GPU the per-layer callback runs when the host has launched a layer's kernels, not when they ran: each
queued layer carries a readiness marker (pdserve/kv_transfer/layer_ready.py: a CUDA event recorded on the
compute stream; on the CPU a marker that is always ready), and the writer thread waits on it before posting
that layer's window, so the forward never waits on the wire nor the wire on the forward's host side. When the writer
falls behind, layers of a job that are ready by the time it posts go out as one WRITE whose descriptors span
those layers of each block (a block's layers are contiguous in the pool), so a slow writer posts fewer,
larger descriptors. Prompts shorter than `layerwise_min_tokens` are pushed whole after the prefill: per-layer
posting costs more than it hides there (SGLang's layerwise PR measured +18 % TTFT at 256 tokens).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pdserve.api.pd import (
    PUSH_KEY,
    FirstToken,
    InvalidKVTransferParams,
    PushParams,
    first_token_fields,
    parse_first_token,
)
from pdserve.kv_transfer.auth import AuthRefused, MessageAuth
from pdserve.kv_transfer.config import DEFAULT_PUSH_LAYERWISE_MIN_TOKENS
from pdserve.kv_transfer.errors import KVTransferError, SideChannelRefused
from pdserve.kv_transfer.head_split import BlockGeometry
from pdserve.kv_transfer.layer_ready import READY, LayerReady, marker_for
from pdserve.kv_transfer.messages import (
    PushCancel,
    PushRegister,
    PushStateReply,
    PushStatus,
    PushStatusReply,
    RankEntry,
)
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.nixl_agent import NixlAgent, PostedWrite, RankAgent
from pdserve.kv_transfer.pool import (
    PoolRegion,
    RemotePool,
    bind_cuda_device,
    check_block_ids,
    coalesce_block_runs,
)
from pdserve.kv_transfer.push_plan import plan_rank_writes, write_pairs
from pdserve.kv_transfer.push_stats import PushStats, PushStatsCollector
from pdserve.types.tp_layout import kv_heads_per_rank

if TYPE_CHECKING:
    from pdserve.kv_transfer.faults import KVFaults

logger = logging.getLogger("pdserve.kv_transfer")

PUSH_NOTIF_PREFIX = b"pdserve-push:"


def completion_notif(push_key: str, first_token: FirstToken | None) -> bytes:
    """The completion notice a push's decode waits for: its key, and the token the prefill sampled (the decode
    adopts it, so the first token and the whole prompt's KV come from one forward, as in a pull)."""
    body: dict[str, object] = {PUSH_KEY: push_key}
    if first_token is not None:
        body.update(first_token_fields(first_token))
    return PUSH_NOTIF_PREFIX + json.dumps(body, separators=(",", ":")).encode()


def parse_completion_notif(message: bytes) -> tuple[str, FirstToken | None] | None:
    """(push key, first token or None) of a completion notice; None for any other notification. A malformed
    first token reads as none (the decode then recomputes the last prompt token): never a guess."""
    if not message.startswith(PUSH_NOTIF_PREFIX):
        return None
    payload = message[len(PUSH_NOTIF_PREFIX):]
    try:
        body = json.loads(payload)
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get(PUSH_KEY), str):
        return payload.decode("utf-8", "replace"), None  # a bare key (a sender without the first token)
    return body[PUSH_KEY], first_token_from(body)


def first_token_from(fields: object) -> FirstToken | None:
    """The first token in a completion's fields (notice or push_status), None when absent or malformed."""
    if not isinstance(fields, dict):
        return None
    try:
        return parse_first_token(fields)
    except InvalidKVTransferParams:
        return None


class _KVHandoffView(Protocol):
    @property
    def send(self) -> bool: ...  # a prefill leg: its blocks go to a consumer

    @property
    def push(self) -> PushParams | None: ...  # push mode: its pairing key


class StepRequest(Protocol):
    """What `step_hook` reads of one request of a step: the engine's `Request` (engine/request.py, `kv` its
    engine/pd/kv_handoff.py `KVHandoff`), which this layer cannot import."""

    @property
    def request_id(self) -> str: ...

    @property
    def block_ids(self) -> list[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def kv(self) -> _KVHandoffView: ...


_KEEP_ENDED_S = 120.0  # ended jobs answer push_status this long (then "unknown")
_IDLE_WAIT_S = 0.02


@dataclass
class _Registration:
    ranks: list[tuple[str, RemotePool]]  # every decode rank's agent and pool shard, rank 0 first
    block_ids: list[int]  # the decode's blocks for request blocks [first_block, first_block + len)
    first_block: int
    num_tokens: int  # tokens the decode needs (blocks covering them are written)
    cutoff: float  # monotonic: nothing is posted after this

    @property
    def agent_name(self) -> str:  # decode rank 0's: the completion notification goes there
        return self.ranks[0][0]


@dataclass
class _Task:
    """WRITE layers [lay_lo, lay_hi) of request blocks [lo, hi) once `ready` says their K/V is in the pool;
    `count` queued tasks merged into it."""

    job: _Job
    lay_lo: int
    lay_hi: int
    lo: int
    hi: int
    count: int = 1
    ready: LayerReady = READY  # the marker of the window's last layer (a CUDA stream runs layers in order)


def merge_tasks(tasks: Sequence[_Task]) -> list[_Task]:
    """Tasks queued together: the same blocks of adjacent layer windows of one job become one task (one WRITE
    per run of blocks for all those layers: fewer pieces, as a block's layers are contiguous). A writer that
    keeps up posts each layer alone; one that falls behind sends bigger windows."""
    groups: dict[tuple[int, int, int], list[_Task]] = {}
    for t in tasks:
        groups.setdefault((id(t.job), t.lo, t.hi), []).append(t)
    out: list[_Task] = []
    for group in groups.values():
        group.sort(key=lambda t: t.lay_lo)
        merged = [group[0]]
        for t in group[1:]:
            last = merged[-1]
            if t.lay_lo == last.lay_hi:
                merged[-1] = _Task(last.job, last.lay_lo, t.lay_hi, last.lo, last.hi, last.count + t.count, t.ready)
            else:
                merged.append(t)
        out.extend(merged)
    return out


@dataclass
class _Job:
    key: str
    request_id: str | None = None
    state: str = "pending"  # pending | done | failed | cancelled
    error: str = ""
    reg: _Registration | None = None
    local_blocks: list[int] = field(default_factory=list)
    progress: list[int] = field(default_factory=list)  # per layer: tokens whose KV is in the pool
    sent: list[int] = field(default_factory=list)  # per layer: request blocks [.., sent) enqueued
    ready: list[LayerReady] = field(default_factory=list)  # per layer: the marker of its latest progress
    latest: LayerReady = READY  # the marker recorded last: every layer's progress so far is behind it
    final: bool = False  # the prefill finished: its blocks are held under `lease`
    lease: tuple[str, str] | None = None  # (request id, lease token) to end once nothing is in flight
    lease_cutoff: float = float("inf")  # monotonic: the lease ends soon after; no decode registered by then
    queued: int = 0
    inflight: list[tuple[PostedWrite, float, int]] = field(default_factory=list)  # (handle, posted at, prefill rank)
    ended_at: float | None = None
    bytes: int = 0
    finished_at: float | None = None  # monotonic: the prefill finished (every layer's K/V is computed)
    first_token: FirstToken | None = None  # the token the prefill sampled, sent with the completion


class PushSender:
    """ranks: (agent, region) of every tensor-parallel rank of this prefill, rank 0 (`agent`, `region`) first;
    each rank WRITEs its own KV heads from its own pool (a worker rank's agent is a `kv_rank.RemoteRankAgent`).
    `geometry` / `num_kv_heads`: how a block splits by heads (`head_split.block_geometry` of the compatibility
    dict); without them a block is `num_layers` slabs of one head (no tensor parallelism on either side)."""

    def __init__(self, *, agent: NixlAgent, region: PoolRegion, num_layers: int, block_size: int,
                 layerwise: bool, transfer_timeout_s: float, lease_duration_s: float,
                 release_lease: Callable[[str, str], None],
                 extend_lease: Callable[[str, str], None] | None = None, auth: MessageAuth | None,
                 metrics: TransferMetrics | None = None, ranks: Sequence[tuple[RankAgent, PoolRegion]] | None = None,
                 geometry: BlockGeometry | None = None, num_kv_heads: int | None = None,
                 layerwise_min_tokens: int = DEFAULT_PUSH_LAYERWISE_MIN_TOKENS,
                 layer_ready: Callable[[], LayerReady] | None = None) -> None:
        """layerwise: WRITE each layer as the forward computes it (prompts of at least layerwise_min_tokens
        tokens); layer_ready: the per-layer marker the forward's callback records (default: the pool's, a CUDA
        event for a GPU pool)."""
        self._agent = agent
        self._region = region
        self._ranks = list(ranks) if ranks is not None else [(agent, region)]
        self._num_layers = num_layers
        self._block_size = block_size
        if region.block_bytes % num_layers:
            raise ValueError("a KV block is not a whole number of per-layer slabs")
        self._num_kv_heads = num_kv_heads if num_kv_heads is not None else len(self._ranks)
        self._geometry = geometry or BlockGeometry(
            num_layers, (region.block_bytes // (num_layers * kv_heads_per_rank(len(self._ranks), self._num_kv_heads)),))
        self.layerwise = layerwise
        self.layerwise_min_tokens = layerwise_min_tokens
        self._layer_ready = layer_ready or marker_for(region.mem_type, region.device_id)
        self.stats = PushStats()
        self._collector: PushStatsCollector | None = None
        if metrics is not None:
            self._collector = PushStatsCollector(self.stats, metrics.labels)
            metrics.registry.register(self._collector)
        self._transfer_timeout_s = transfer_timeout_s
        self._lease_duration_s = lease_duration_s
        self._release_lease = release_lease
        self._extend_lease = extend_lease
        self._next_extend = 0.0
        self._auth = auth
        self._metrics = metrics
        self.faults: KVFaults | None = None  # test-only (kv_transfer/faults.py): a stale WRITE before a job's notification
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._by_request: dict[str, str] = {}
        self._remote_agents: list[set[str]] = [set() for _ in self._ranks]  # decode agents each rank loaded
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._pending: list[_Task] = []  # the writer thread's: tasks taken from the queue, not yet posted
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._writer_loop, name="pdserve-kv-push-writer", daemon=True)
        self._thread.start()

    # ---- the engine's side ---------------------------------------------------------------------------------

    def step_hook(self, batch: Sequence[tuple[StepRequest, int]]) -> Callable[[int], None] | None:
        """For a step about to run: a callback the model calls once each layer's K/V store is issued (None: no
        layer-by-layer push job in it). It records a readiness marker, progress and WRITE tasks; the writer
        thread does the rest."""
        entries = []
        layered = []  # the entries pushed layer by layer (long enough prompts)
        for req, n in batch:
            push = req.kv.push  # set for a push-mode prefill leg (KVProducer.parse_prefill_leg)
            if req.kv.send and push is not None:
                end = req.num_computed_tokens + n
                entry = (push.push_key, req.request_id, list(req.block_ids), end, end >= req.num_prompt_tokens)
                entries.append(entry)
                if self.layerwise and req.num_prompt_tokens >= self.layerwise_min_tokens:
                    layered.append(entry)
        if not entries:
            return None
        with self._lock:
            for key, rid, blocks, _, _ in entries:
                self._check_blocks_locked(self._job_locked(key, rid), blocks)
        if not layered:
            return None
        marker = self._layer_ready

        def on_layer(layer: int) -> None:
            ready = marker()  # on a GPU: an event queued behind this layer's kernels (no sync here)
            with self._lock:
                for key, rid, blocks, end, last in layered:
                    job = self._jobs.get(key)
                    if job is None or job.state != "pending" or job.request_id != rid:
                        continue
                    job.local_blocks = blocks
                    job.progress[layer] = max(job.progress[layer], end)
                    job.ready[layer] = job.latest = ready
                    self._enqueue_locked(job, layer, end, last, ready)
        return on_layer

    def finish(self, request_id: str, params: PushParams, block_ids: Sequence[int], num_tokens: int,
               lease: tuple[str, str], first_token: FirstToken | None = None) -> None:
        """The prefill finished; its blocks are held under `lease` (ended by this sender). `first_token`: the
        token it sampled, sent with the completion for the decode to adopt."""
        key = params.push_key
        with self._lock:
            job = self._job_locked(key, request_id)
            job.first_token = first_token
            self._check_blocks_locked(job, [int(b) for b in block_ids])
            job.local_blocks = [int(b) for b in block_ids]
            job.final = True
            job.finished_at = time.monotonic()
            job.lease = lease
            job.lease_cutoff = time.monotonic() + max(0.0, self._lease_duration_s - self._transfer_timeout_s)
            if job.state != "pending":
                self._end_locked(job, job.state, job.error)
                return
            for layer in range(self._num_layers):
                job.progress[layer] = max(job.progress[layer], num_tokens)
                job.ready[layer] = READY  # the prefill's steps ran to the end (its tokens were read back)
            if job.reg is not None:
                self._enqueue_locked(job, None, num_tokens, True)
        self._tasks.put(None)  # wake the writer (a job with nothing left to write completes now)

    def abandon(self, request_id: str) -> None:
        """The prefill request ended without its KV (aborted, failed): its job fails, nothing more is posted."""
        with self._lock:
            key = self._by_request.get(request_id)
            job = self._jobs.get(key) if key is not None else None
            if job is not None and job.state == "pending":
                self._end_locked(job, "failed", "the prefill request ended before its KV was computed")

    # ---- the side channel's side ---------------------------------------------------------------------------

    def handle(self, request: PushRegister | PushStatus | PushCancel) -> PushStateReply | PushStatusReply:
        match request:
            case PushRegister():
                return PushStateReply(state=self._register(request))
            case PushStatus():
                with self._lock:
                    jobs = [self._jobs.get(k) for k in request.push_keys]
                    # a decode that missed the completion notice learns the first token here
                    return PushStatusReply(
                        states=tuple(self._state_locked(j) for j in jobs),
                        errors=tuple(j.error if j is not None else "" for j in jobs),
                        first_tokens=tuple(first_token_fields(j.first_token)
                                           if j is not None and j.first_token is not None else None for j in jobs))
            case PushCancel():
                with self._lock:
                    # a cancel before the registration leaves a tombstone, so a registration still on its way
                    # (sent before the cancel) finds the job ended and nothing is ever written for it
                    job = self._job_locked(request.push_key, None)
                    if job.state == "pending":
                        self._end_locked(job, "cancelled", "cancelled by the decode instance")
                    return PushStateReply(state=self._state_locked(job))
        raise SideChannelRefused("bad_request", f"unsupported op {request.op!r}")

    def _register(self, msg: PushRegister) -> str:
        block_ids = list(msg.block_ids)
        ranks = self._decode_ranks(msg.all_ranks())
        try:
            check_block_ids(block_ids, ranks[0][1].num_blocks, "decode")
        except ValueError as exc:
            raise SideChannelRefused("bad_request", f"push_register: {exc}") from None
        first, num_tokens = msg.first_block, msg.num_tokens
        if first < 0 or num_tokens < 0 or first + len(block_ids) != -(-num_tokens // self._block_size):
            raise SideChannelRefused("bad_request", f"push_register: {len(block_ids)} blocks from block {first} do "
                                                    f"not cover {num_tokens} tokens")
        blobs = [r.agent_metadata for r in msg.all_ranks()]
        if self._auth is not None:  # sealed: whoever holds it can WRITE into the decode's pool
            try:
                blobs = self._auth.open_parts(blobs, msg.seal_nonce, msg.generation)
            except AuthRefused as exc:  # altered or moved from another registration: the sender's fault
                raise SideChannelRefused(exc.reason, f"push_register: {exc}") from None
        with self._lock:
            job = self._jobs.get(msg.push_key)
            if job is not None and job.reg is not None:
                raise SideChannelRefused("already_claimed", "push_register: this push key is already registered")
        # each prefill rank loads the agents of the decode ranks it WRITEs heads to
        for s, dsts in write_pairs(self._num_kv_heads, len(self._ranks), len(ranks)).items():
            agent = self._ranks[s][0]
            for d in dsts:
                name = ranks[d][0]
                with self._lock:
                    known = name in self._remote_agents[s]
                if known:
                    continue
                try:
                    agent.add_remote(blobs[d], name)
                except KVTransferError as exc:
                    raise SideChannelRefused("bad_request", f"push_register: {exc}") from None
                with self._lock:
                    self._remote_agents[s].add(name)
        cutoff = time.monotonic() + msg.timeout_s
        with self._lock:
            job = self._job_locked(msg.push_key, None)
            if job.reg is not None:
                raise SideChannelRefused("already_claimed", "push_register: this push key is already registered")
            job.reg = _Registration(ranks, block_ids, first, num_tokens, cutoff)
            if job.state == "pending":
                # catch up: what is computed already (all of it once the prefill finished)
                self._enqueue_locked(job, None, min(job.progress), job.final, job.latest)
                for layer in range(self._num_layers):
                    self._enqueue_locked(job, layer, job.progress[layer], job.final, job.ready[layer])
            state = self._state_locked(job)
        self._tasks.put(None)
        return state

    def _decode_ranks(self, listed: Sequence[RankEntry]) -> list[tuple[str, RemotePool]]:
        """The decode's ranks from its registration (rank 0 first; checked as a message by `PushRegister`), checked
        against this model's KV heads."""
        tp, heads = len(listed), self._num_kv_heads
        if heads % tp and tp % heads:
            raise SideChannelRefused("incompatible", f"push_register: a decode of tensor-parallel size {tp} cannot "
                                                     f"split this model's {heads} KV heads")
        want = self._geometry.block_bytes(kv_heads_per_rank(tp, heads))
        for d, entry in enumerate(listed):
            if entry.pool.block_bytes != want:
                raise SideChannelRefused("incompatible", f"push_register: decode rank {d} has blocks of "
                                                         f"{entry.pool.block_bytes} bytes, "
                                                         f"{kv_heads_per_rank(tp, heads)} KV heads of this model "
                                                         f"take {want}")
        return [(entry.agent_name, entry.pool) for entry in listed]

    def forget_agent(self, name: str, rank: int | None = None) -> None:
        """A decode agent is no longer loaded by `rank` (None: by any); a later registration loads it again."""
        with self._lock:
            for r, known in enumerate(self._remote_agents):
                if rank is None or r == rank:
                    known.discard(name)

    # ---- bookkeeping (under the lock) ----------------------------------------------------------------------

    def _job_locked(self, key: str, request_id: str | None) -> _Job:
        job = self._jobs.get(key)
        if job is None:
            job = self._jobs[key] = _Job(key, progress=[0] * self._num_layers, sent=[0] * self._num_layers,
                                         ready=[READY] * self._num_layers)
        if request_id is not None and job.request_id is None:
            job.request_id = request_id
            self._by_request[request_id] = key
        return job

    def _check_blocks_locked(self, job: _Job, blocks: list[int]) -> None:
        """The request's blocks already written must be the same: a prefill preempted and recomputed into
        other blocks may have had WRITEs in flight from blocks now reused, so its push fails (the decode
        then applies its policy)."""
        sent = min(max(job.sent), len(job.local_blocks), len(blocks))
        if job.state == "pending" and job.local_blocks[:sent] != blocks[:sent]:
            self._end_locked(job, "failed", "the prefill request was preempted during its push")

    def _state_locked(self, job: _Job | None) -> str:
        if job is None:
            return "unknown"
        if job.state == "pending":
            return "registered" if job.reg is not None else "pending"
        return job.state if not job.inflight and job.queued == 0 else "ending"

    def _enqueue_locked(self, job: _Job, layer: int | None, tokens: int, last: bool,
                        ready: LayerReady = READY) -> None:
        """Queue the request blocks of `layer` (None: every layer) that `tokens` completed and the decode lacks,
        to be written once `ready` says their K/V is in the pool."""
        reg = job.reg
        if reg is None or job.state != "pending":
            return
        upto = -(-tokens // self._block_size) if last else tokens // self._block_size
        upto = min(upto, reg.first_block + len(reg.block_ids), len(job.local_blocks))
        window: tuple[int, int, int] | None = None  # (first layer, end layer, first block)
        for lay in range(self._num_layers) if layer is None else (layer,):
            lo = max(job.sent[lay], reg.first_block)
            if upto <= lo:
                continue
            job.sent[lay] = upto
            if window is not None and window[1] == lay and window[2] == lo:
                window = (window[0], lay + 1, lo)
                continue
            if window is not None:
                self._put_locked(job, window, upto, ready)
            window = (lay, lay + 1, lo)
        if window is not None:
            self._put_locked(job, window, upto, ready)

    def _put_locked(self, job: _Job, window: tuple[int, int, int], upto: int, ready: LayerReady) -> None:
        job.queued += 1
        self._tasks.put(_Task(job, window[0], window[1], window[2], upto, ready=ready))

    def _end_locked(self, job: _Job, state: str, error: str = "") -> None:
        if job.ended_at is None:
            job.state, job.error = state, error
            job.ended_at = time.monotonic()
            if self._metrics is not None:
                self._metrics.record_push_job(state)
            if state == "failed":
                logger.warning("KV push %s (request %s) failed: %s", job.key[:8], job.request_id, error)
        if job.lease is not None and not job.inflight and job.queued == 0:
            rid, token = job.lease
            job.lease = None
            self._release_lease(rid, token)

    # ---- writer thread -------------------------------------------------------------------------------------

    def _writer_loop(self) -> None:
        bind_cuda_device(self._region)  # UCX's CUDA transports copy in the posting thread's CUDA context
        while not self._stop.is_set():
            busy = False
            with self._lock:
                busy = any(j.inflight for j in self._jobs.values())
            if not self._pending:
                try:
                    task = self._tasks.get(timeout=0.0002 if busy else _IDLE_WAIT_S)
                except queue.Empty:
                    task = None
                if task is not None:
                    self._pending.append(task)
            try:
                if self._pending:
                    self._post_ready()
                self._poll()
            except Exception:  # noqa: BLE001 - the writer must survive anything one job does
                logger.exception("KV push writer failed")

    def _post_ready(self) -> None:
        """Wait until the oldest pending task's K/V is in the pool, then post it together with every other
        pending task that is ready by now (adjacent layer windows of the same blocks merged into one WRITE)."""
        first = self._pending.pop(0)
        self.stats.add_wait(first.ready.wait())  # the GPU's compute stream reached this layer (0 on the CPU)
        self._drain()  # what the forward queued meanwhile: tasks that are ready by now go out with this one
        ready = [first] + [t for t in self._pending if t.ready.ready()]
        self._pending = [t for t in self._pending if not any(t is r for r in ready)]
        for task in merge_tasks(ready):
            self._post(task)

    def _drain(self) -> None:
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                return
            if task is not None:
                self._pending.append(task)

    def _post(self, task: _Task) -> None:
        # The task stays counted in `queued` until its WRITEs are in `inflight` (or not posted): a cancel that
        # comes meanwhile reads "ending", never "cancelled" with a WRITE about to be posted.
        job = task.job
        with self._lock:
            reg = job.reg
            stop = ""
            if job.state != "pending" or reg is None:
                stop = job.state
            elif time.monotonic() > reg.cutoff:
                stop = "expired"
            if stop:
                job.queued -= task.count
                if stop == "expired":
                    self._end_locked(job, "failed", "the decode's registration expired before the KV was written")
                else:
                    self._end_locked(job, job.state, job.error)
                return
            assert reg is not None
            during = not job.final  # posted while the prefill still computes (decided as the post starts)
            local = job.local_blocks[task.lo:task.hi]
            remote = reg.block_ids[task.lo - reg.first_block:task.hi - reg.first_block]
        error = ""
        posted: list[tuple[PostedWrite, float, int]] = []
        nbytes = descriptors = 0
        t0 = time.perf_counter()
        try:
            writes = plan_rank_writes(coalesce_block_runs(local, remote), layers=(task.lay_lo, task.lay_hi),
                                      num_layers=self._num_layers, geometry=self._geometry,
                                      num_kv_heads=self._num_kv_heads, local=[r for _, r in self._ranks],
                                      remote=[pool for _, pool in reg.ranks])
        except ValueError as exc:
            writes, error = [], str(exc)
        t1 = time.perf_counter()
        for w in writes:
            agent, region = self._ranks[w.src_rank]
            name, pool = reg.ranks[w.dst_rank]
            try:
                handle = agent.post_write(local_descs=w.local_descs, local_mem=region.mem_type,
                                          remote_descs=w.remote_descs, remote_mem=pool.mem_type, remote_name=name,
                                          timeout_s=self._transfer_timeout_s)
            except KVTransferError as exc:
                error = str(exc)
                break
            posted.append((handle, time.monotonic(), w.src_rank))
            nbytes += w.nbytes
            descriptors += len(w.local_descs)
        t2 = time.perf_counter()
        with self._lock:
            job.inflight.extend(posted)
            job.queued -= task.count
            job.bytes += nbytes
            if error:
                self._end_locked(job, "failed", error)
        if posted:
            self.stats.add_post(descriptors=descriptors, layers=task.lay_hi - task.lay_lo, blocks=len(local),
                                nbytes=nbytes, build_s=t1 - t0, post_s=t2 - t1, during_prefill=during)
        if self._metrics is not None and nbytes:
            self._metrics.record_push_write(nbytes, during)

    def _poll(self) -> None:
        """Check in-flight WRITEs; complete jobs whose every block landed; end what outlived its deadline."""
        now = time.monotonic()
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.inflight or j.state == "pending" or j.lease is not None]
        for job in jobs:
            done: list[PostedWrite] = []
            failed = ""
            for handle, posted, rank in list(job.inflight):
                agent = self._ranks[rank][0]
                state = agent.xfer_state(handle)
                if state == "PROC" and now - posted < self._transfer_timeout_s:
                    continue
                if state != "DONE":
                    failed = failed or (f"NIXL WRITE ended in state {state}" if state not in ("PROC", "TIMEOUT")
                                        else f"NIXL WRITE not complete after {self._transfer_timeout_s:g}s")
                else:
                    self.stats.add_done(now - posted)
                agent.release_handle(handle)
                done.append(handle)
                if state in ("PROC", "TIMEOUT") and job.reg is not None:
                    # stuck: disconnecting from that decode cancels whatever is still in flight to it (a
                    # later registration loads its metadata again; a worker rank that timed out did it already)
                    for name, _ in job.reg.ranks:
                        if state == "PROC":
                            agent.remove_remote(name)
                        self.forget_agent(name, rank)
            notify = None
            with self._lock:
                job.inflight = [entry for entry in job.inflight if entry[0] not in done]
                if failed and job.state == "pending":
                    self._end_locked(job, "failed", failed)
                reg = job.reg
                if job.state == "pending" and reg is not None and now > reg.cutoff:
                    self._end_locked(job, "failed", "the decode's registration expired before the KV was written")
                elif job.state == "pending" and now > job.lease_cutoff and reg is None:
                    self._end_locked(job, "failed", "no decode instance registered blocks within the lease")
                elif (job.state == "pending" and job.final and reg is not None and job.queued == 0
                      and not job.inflight and all(s >= min(reg.first_block + len(reg.block_ids),
                                                            len(job.local_blocks)) for s in job.sent)):
                    notify = reg.agent_name
                elif job.state != "pending":
                    self._end_locked(job, job.state, job.error)
            if notify is not None:
                if self.faults is not None and reg is not None:
                    self.faults.before_push_done(job.request_id, self._agent, self._region,
                                                 job.local_blocks[reg.first_block:reg.first_block + len(reg.block_ids)],
                                                 reg.agent_name, reg.ranks[0][1], reg.block_ids)  # rank 0's shard
                try:
                    self._agent.send_notif(notify, completion_notif(job.key, job.first_token))
                    outcome, error = "done", ""
                    if job.finished_at is not None:
                        self.stats.add_job(time.monotonic() - job.finished_at)
                except KVTransferError as exc:
                    outcome, error = "failed", str(exc)
                with self._lock:
                    self._end_locked(job, outcome, error)
        if self._extend_lease is not None and now >= self._next_extend:
            # a registered push still writing keeps its prefill blocks (their lease) for as long as its
            # registration allows (a slow link may need longer than one lease)
            self._next_extend = now + 1.0
            with self._lock:
                writing = [j.lease for j in self._jobs.values()
                           if j.state == "pending" and j.reg is not None and j.lease is not None]
            for rid, token in writing:
                self._extend_lease(rid, token)
        with self._lock:
            for key in [k for k, j in self._jobs.items() if j.ended_at is not None and j.lease is None
                        and now - j.ended_at > _KEEP_ENDED_S]:
                job = self._jobs.pop(key)
                if job.request_id is not None:
                    self._by_request.pop(job.request_id, None)

    def shutdown(self) -> None:
        self._stop.set()
        self._tasks.put(None)
        self._thread.join(timeout=5.0)
        if self._collector is not None and self._metrics is not None:
            self._metrics.registry.unregister(self._collector)
            self._collector = None
