"""A worker rank's share of KV transfer: its own NIXL agent over its own pool shard.

Every rank registers its pool with NIXL itself (a pool in another process, or on another GPU, cannot be
registered by the engine process). The engine process keeps the side channel, the leases and the load
bookkeeping; for ranks 1..N-1 it reaches their agents through `RemoteRankAgent`, which has the methods of
`pdserve.kv_transfer.nixl_agent.NixlAgent` that the connector uses, carried over `rank_rpc`.

The calls are the command classes below (`rank_rpc` runs a command's handler by its type). Worker side
(`RankKVService`): `KvInit` creates the agent and registers the pool, then a progress thread
polls the agent's notifications (that also progresses it as a READ target: connection setup, TCP
transports), every 10 ms when idle and every ~50 us for a while after the engine's `Boost` (a claim).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from pdserve.kv_transfer.digest import digest_blocks
from pdserve.kv_transfer.digest_split import Received, SplitLayout, received_digests
from pdserve.kv_transfer.errors import TransferFailed, TransferTimeout
from pdserve.kv_transfer.nixl_agent import NixlAgent, ReadStats, apply_env_defaults, load_nixl
from pdserve.kv_transfer.pool import KVPool, PoolRegion, bind_cuda_device, pretouch, region_of
from pdserve.parallel.rank_rpc import Handlers, RankCallError, RankClient

log = logging.getLogger("pdserve.parallel")

_FAST_POLL_S = 0.00005
_IDLE_POLL_S = 0.01
# Slack on top of a READ's own deadline before the engine gives up on the rank's answer.
_CALL_SLACK_S = 5.0
_SETUP_TIMEOUT_S = 60.0


# ---- the calls into a rank (engine -> worker) ---------------------------------------------------------
@dataclass(frozen=True)
class KvInit:
    """Create the rank's NIXL agent and register its pool; answers the agent's name, metadata and pool."""

    name: str
    backends: tuple[str, ...]
    backend_params: dict
    loopback: bool
    gpu: bool


@dataclass(frozen=True)
class RankInfo:
    """KvInit's answer: the rank's agent and its pool shard."""

    agent_name: str
    agent_metadata: bytes
    region: PoolRegion


@dataclass(frozen=True)
class AddRemote:
    """Load a producer's agent metadata; answers its agent name."""

    metadata: bytes
    expected_name: str


@dataclass(frozen=True)
class RemoveRemote:
    name: str


class _Descs(TypedDict):
    local_descs: np.ndarray
    local_mem: str
    remote_descs: np.ndarray
    remote_mem: str
    remote_name: str


@dataclass(frozen=True)
class _Transfer:
    """A transfer between this rank's pool and a peer rank's: NixlAgent's descriptor lists, bounded by timeout_s."""

    local_descs: np.ndarray
    local_mem: str
    remote_descs: np.ndarray
    remote_mem: str
    remote_name: str
    timeout_s: float

    def descs(self) -> _Descs:
        """The descriptor arguments of NixlAgent.read/write."""
        return {"local_descs": self.local_descs, "local_mem": self.local_mem, "remote_descs": self.remote_descs,
                "remote_mem": self.remote_mem, "remote_name": self.remote_name}


@dataclass(frozen=True)
class Read(_Transfer):
    """READ remote blocks into this rank's (NixlAgent.read); answers ReadStats."""

    notif: bytes


@dataclass(frozen=True)
class BlockDigests:
    """This rank's digests of its shard of `block_ids` (kv_transfer/digest.py); answers a list of strings."""

    block_ids: tuple[int, ...]
    algo: str


@dataclass(frozen=True)
class ReceivedDigests:
    """This rank's digests of what it received of `block_ids` from producer ranks of TP size `src_tp`
    (kv_transfer/digest_split.py); answers a list of `Received`."""

    block_ids: tuple[int, ...]
    algo: str
    layout: SplitLayout
    dst_rank: int
    dst_tp: int
    src_tp: int


@dataclass(frozen=True)
class Write(_Transfer):
    """Push mode: WRITE this rank's blocks into a decode rank's and wait (NixlAgent.write); answers the bytes.
    Past `timeout_s` the WRITE is released and the decode's agent removed (`TransferTimeout`)."""


@dataclass(frozen=True)
class Boost:
    """Poll the agent fast for `seconds` (a claim is under way). Sent as a notification."""

    seconds: float


@dataclass(frozen=True)
class KvClose:
    """Stop the progress thread and close the agent."""


class RankKVService:
    """Runs in a worker: the handlers of the KV calls, over this rank's KV pool."""

    def __init__(self, kv_pool: KVPool) -> None:
        self._pool = kv_pool
        self.region: PoolRegion | None = None
        self.agent: NixlAgent | None = None
        self._boost_until = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._progress: threading.Thread | None = None

    def handlers(self) -> Handlers:
        return {KvInit: self.kv_init, AddRemote: self.add_remote, RemoveRemote: self.remove_remote,
                Read: self.read, Write: self.write, Boost: self.boost, KvClose: lambda _: self.close(),
                BlockDigests: lambda cmd: digest_blocks(self._pool, cmd.block_ids, cmd.algo),
                ReceivedDigests: lambda cmd: received_digests(self._pool, cmd.block_ids, cmd.algo, cmd.layout,
                                                              dst_rank=cmd.dst_rank, dst_tp=cmd.dst_tp,
                                                              src_tp=cmd.src_tp)}

    def kv_init(self, cmd: KvInit) -> RankInfo:
        if self.agent is not None:
            raise RuntimeError("this rank's KV agent already exists")
        apply_env_defaults(loopback=cmd.loopback, gpu=cmd.gpu)
        load_nixl()
        region = region_of(self._pool)
        pretouch(region)
        bind_cuda_device(region)
        agent = NixlAgent(cmd.name, tuple(cmd.backends), dict(cmd.backend_params))
        agent.register(region)
        self.region, self.agent = region, agent
        self._progress = threading.Thread(target=self._progress_loop, name="pdserve-kv-rank-progress",
                                          daemon=True)
        self._progress.start()
        return RankInfo(agent.name, agent.metadata(), region)

    def _need(self) -> NixlAgent:
        if self.agent is None:
            raise RuntimeError("this rank's KV agent is not initialised (kv_init)")
        return self.agent

    def add_remote(self, cmd: AddRemote) -> str:
        return self._need().add_remote(cmd.metadata, cmd.expected_name)

    def remove_remote(self, cmd: RemoveRemote) -> None:
        self._need().remove_remote(cmd.name)

    def read(self, cmd: Read) -> ReadStats:
        assert self.region is not None
        bind_cuda_device(self.region)  # RPC threads are fresh threads without a CUDA context
        return self._need().read(**cmd.descs(), notif=cmd.notif, deadline=time.monotonic() + cmd.timeout_s)

    def write(self, cmd: Write) -> int:
        assert self.region is not None
        bind_cuda_device(self.region)
        return self._need().write(**cmd.descs(), deadline=time.monotonic() + cmd.timeout_s)

    def boost(self, cmd: Boost) -> None:
        self._boost_until = max(self._boost_until, time.monotonic() + cmd.seconds)
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._progress is not None:
            self._progress.join(timeout=5.0)
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    def _progress_loop(self) -> None:
        assert self.region is not None and self.agent is not None
        bind_cuda_device(self.region)
        while not self._stop.is_set():
            try:
                self.agent.get_notifs()  # read notifications are the lease's business, on rank 0
            except Exception:  # noqa: BLE001 - keep progressing
                log.exception("NIXL notification polling failed")
            if time.monotonic() < self._boost_until:
                time.sleep(_FAST_POLL_S)
            else:
                self._wake.wait(_IDLE_POLL_S)
                self._wake.clear()


class RemoteRankAgent:
    """The engine process's handle on a worker rank's NIXL agent (the NixlAgent methods the connector
    uses), plus the rank's pool as a PoolRegion."""

    def __init__(self, client: RankClient, info: RankInfo) -> None:
        self.client = client
        self.rank = client.rank
        self.name = info.agent_name
        self._metadata = info.agent_metadata
        self.region = info.region

    @classmethod
    def start(cls, client: RankClient, name: str, backends: tuple[str, ...], backend_params: dict,
              *, loopback: bool, gpu: bool) -> RemoteRankAgent:
        info = client.call(KvInit(name, tuple(backends), dict(backend_params), loopback, gpu),
                           timeout_s=_SETUP_TIMEOUT_S)
        return cls(client, info)

    def metadata(self) -> bytes:
        return self._metadata

    def add_remote(self, metadata: bytes, expected_name: str) -> str:
        try:
            return self.client.call(AddRemote(metadata, expected_name), timeout_s=_SETUP_TIMEOUT_S)
        except (TimeoutError, RankCallError) as e:
            raise TransferFailed(str(e)) from None

    def remove_remote(self, name: str) -> None:
        self.client.call(RemoveRemote(name), timeout_s=_SETUP_TIMEOUT_S)

    def read(self, *, local_descs: np.ndarray, local_mem: str, remote_descs: np.ndarray, remote_mem: str,
             remote_name: str, notif: bytes, deadline: float) -> ReadStats:
        timeout_s = max(0.0, deadline - time.monotonic())
        try:
            return self.client.call(Read(local_descs, local_mem, remote_descs, remote_mem, remote_name, timeout_s,
                                         notif=notif), timeout_s=timeout_s + _CALL_SLACK_S)
        except TimeoutError as e:
            raise TransferTimeout(str(e)) from None
        except RankCallError as e:
            raise TransferFailed(str(e)) from None

    # push mode: a WRITE is posted as one call that the rank waits out itself (its handle here is the call's
    # future), so the engine's writer thread polls futures, not NIXL handles across the pipe
    def post_write(self, *, local_descs: np.ndarray, local_mem: str, remote_descs: np.ndarray, remote_mem: str,
                   remote_name: str, timeout_s: float) -> Future:
        try:
            return self.client.call_async(Write(local_descs, local_mem, remote_descs, remote_mem, remote_name,
                                                timeout_s))
        except RankCallError as e:
            raise TransferFailed(str(e)) from None

    @staticmethod
    def xfer_state(posted: Future) -> str:
        """"PROC" until the rank answered, then "DONE", or "TIMEOUT" (the rank removed the peer) or "ERR"."""
        if not posted.done():
            return "PROC"
        exc = posted.exception()
        if exc is None:
            return "DONE"
        if isinstance(exc, TransferTimeout):
            return "TIMEOUT"
        log.warning("a tensor-parallel rank's KV WRITE failed: %s", exc)
        return "ERR"

    @staticmethod
    def release_handle(posted: Future) -> None:
        """Nothing to release here: the rank releases its NIXL handle itself (and the call's future must stay
        uncancelled: the rank's late answer still resolves it)."""

    def send_notif(self, remote_name: str, message: bytes) -> None:
        raise TransferFailed("push completion notifications are sent by rank 0")

    def boost(self, seconds: float) -> None:
        self.client.notify(Boost(seconds))

    def block_digests(self, block_ids: list[int], algo: str) -> list[str]:
        return self.client.call(BlockDigests(tuple(block_ids), algo), timeout_s=_SETUP_TIMEOUT_S)

    def received_digests(self, block_ids: list[int], algo: str, layout: SplitLayout, dst_tp: int,
                         src_tp: int) -> list[Received]:
        return self.client.call(ReceivedDigests(tuple(block_ids), algo, layout, self.rank, dst_tp, src_tp),
                                timeout_s=_SETUP_TIMEOUT_S)

    def close(self) -> None:
        try:
            self.client.call(KvClose(), timeout_s=10.0)
        except Exception as e:  # noqa: BLE001 - the rank may be gone already
            log.debug("closing rank %d's KV agent: %s", self.rank, e)
