"""A thin wrapper over the NIXL Python agent: import, environment, registration, READ with a deadline.

NIXL facts this relies on (measured, see the project's NIXL notes):
- `import nixl` (the meta package) imports torch just to pick a CUDA build; importing `nixl_cu13` /
  `nixl_cu12` directly does not.
- The UCX progress thread busy-polls most of a core, so it is off; the producer drives progress itself.
- Errors arrive as exceptions from `transfer`/`check_xfer_state` (e.g. nixlRemoteDisconnectError); a frozen
  peer never completes and never errors, hence the deadline on every wait.
- On cma `transfer()` does the whole copy synchronously (and releases the GIL): callers run it off the
  engine thread.
- A peer that restarted under the same agent name must be removed before its new metadata is added.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol, Union

import numpy as np

from pdserve.kv_transfer.digest import DigestingRank
from pdserve.kv_transfer.errors import NixlUnavailableError, TransferFailed, TransferTimeout
from pdserve.kv_transfer.pool import PoolRegion

logger = logging.getLogger("pdserve.kv_transfer")

_NIXL_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
_nixl: ModuleType | None = None
_import_lock = threading.Lock()


def apply_env_defaults(*, loopback: bool, gpu: bool) -> None:
    """Environment defaults for UCX; never overrides what the user set. Must run before the agent is created."""
    if gpu:
        # Without it UCX disables CUDA-IPC get when no NVLink is detected and READs silently fall back to TCP.
        # Only for GPU pools: on a CPU-only host UCX warns about it as an unused variable.
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    if loopback:
        # Keeps UCX's TCP on loopback when everything is on one host; cross-host setups must not get this.
        os.environ.setdefault("UCX_NET_DEVICES", "lo")


def load_nixl() -> ModuleType:
    """The NIXL API module (`nixl_agent`, `nixl_agent_config`, `nixl_thread_sync_t`)."""
    global _nixl
    with _import_lock:
        if _nixl is not None:
            return _nixl
        # NIXL configures its logger at import time; its INFO lines go to stdout otherwise.
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        errors = []
        for name in _NIXL_MODULES:
            try:
                module = importlib.import_module(name)
            except (ImportError, OSError) as exc:  # OSError: a shared library of the wheel failed to load
                errors.append(f"{name}: {exc}")
                continue
            if hasattr(module, "nixl_agent"):
                _nixl = module
                return module
            errors.append(f"{name}: no nixl_agent")
        raise NixlUnavailableError(
            "NIXL is not importable, so KV transfer is unavailable. Install it with "
            "`pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1` (or nixl-cu13). Tried: " + "; ".join(errors)
        )


def nixl_error_name(exc: BaseException) -> str:
    return type(exc).__name__


class NixlReleasable(Protocol):
    """A NIXL transfer handle or prepared descriptor list: pdserve only passes it back to NIXL and releases it."""

    def release(self) -> None: ...


@dataclass(frozen=True)
class WriteHandle:
    """A posted WRITE: NIXL's handle and, for a strided one, the prepared lists it was made from."""

    handle: NixlReleasable
    dlists: list[NixlReleasable]


# A WRITE in flight, as the agent that posted it tracks it (a worker rank's: the RPC's future, `kv_rank`); only
# that agent reads it back (`xfer_state`, `release_handle`).
PostedWrite = Union[WriteHandle, "Future[int]"]  # noqa: UP007 - a string part


@dataclass(frozen=True)
class ReadStats:
    post_s: float  # duration of the transfer() call (the whole copy on cma)
    xfer_s: float  # from posting to completion


class RankAgent(Protocol):
    """What the KV roles use of one tensor-parallel rank's NIXL agent: a `NixlAgent` (rank 0, in this process) or
    a `kv_rank.RemoteRankAgent` (ranks 1..N-1, carried into their worker processes)."""

    name: str

    def metadata(self) -> bytes: ...

    def add_remote(self, metadata: bytes, expected_name: str) -> str: ...

    def remove_remote(self, name: str) -> None: ...

    def read(self, *, local_descs: np.ndarray, local_mem: str, remote_descs: np.ndarray, remote_mem: str,
             remote_name: str, notif: bytes, deadline: float) -> ReadStats: ...

    def post_write(self, *, local_descs: np.ndarray, local_mem: str, remote_descs: np.ndarray, remote_mem: str,
                   remote_name: str, timeout_s: float) -> PostedWrite: ...

    def xfer_state(self, posted: PostedWrite) -> str: ...

    def release_handle(self, posted: PostedWrite) -> None: ...

    def send_notif(self, remote_name: str, message: bytes) -> None: ...


class WorkerRankAgent(RankAgent, DigestingRank, Protocol):
    """Ranks 1..N-1's (`kv_rank.RemoteRankAgent`): their agents progress in their own processes, fast on demand;
    each has its own pool shard and digests it itself."""

    @property
    def region(self) -> PoolRegion: ...

    def boost(self, seconds: float) -> None: ...

    def close(self) -> None: ...


class NixlAgent:
    """One agent per engine; thread-safe (NIXL strict sync mode) so producer and consumer threads share it."""

    def __init__(
        self, name: str, backends: tuple[str, ...], backend_params: dict[str, dict[str, str]] | None = None
    ) -> None:
        nixl = load_nixl()
        self.name = name
        config = nixl.nixl_agent_config(
            enable_prog_thread=False,
            backends=[],  # created below, because nixl_agent_config cannot pass backend parameters
            sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = nixl.nixl_agent(name, config)
        for backend in backends:
            params = dict((backend_params or {}).get(backend, {}))
            try:
                self._agent.create_backend(backend, params)
            except Exception as exc:
                hint = ""
                if backend == "UCX" and "UCX_TLS" in os.environ:
                    hint = (
                        f" (UCX_TLS={os.environ['UCX_TLS']!r}; transports without peer error handling such as "
                        "self,sm need backend_params {'UCX': {'ucx_error_handling_mode': 'none'}})"
                    )
                raise RuntimeError(
                    f"cannot create NIXL backend {backend}: {nixl_error_name(exc)}: {exc}{hint}"
                ) from exc
        self._reg: object | None = None  # NIXL's registration, only handed back to deregister_memory
        self._remotes: set[str] = set()
        self._lock = threading.Lock()

    # ---- registration ------------------------------------------------------------------------------

    def register(self, region: PoolRegion) -> None:
        """Register the whole pool once; fetch metadata only afterwards (it describes registered memory)."""
        self._reg = self._agent.register_memory(
            [(region.base_addr, region.length, region.device_id, "")], region.mem_type
        )

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    # ---- remote agents ------------------------------------------------------------------------------

    def add_remote(self, metadata: bytes, expected_name: str) -> str:
        """Load a peer's metadata, replacing whatever an earlier incarnation of the same name left."""
        with self._lock:
            if expected_name in self._remotes:
                self._remove_locked(expected_name)
            try:
                name = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise TransferFailed(
                    f"loading metadata of NIXL agent {expected_name!r}: {nixl_error_name(exc)}: {exc}"
                ) from exc
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes.add(name)
            if name != expected_name:
                self._remove_locked(name)
                raise TransferFailed(
                    f"producer announced agent {expected_name!r} but its metadata names {name!r}"
                )
            return name

    def remove_remote(self, name: str) -> None:
        with self._lock:
            self._remove_locked(name)

    def _remove_locked(self, name: str) -> None:
        self._remotes.discard(name)
        try:
            # Also disconnects the endpoint, which cancels anything still in flight to that peer.
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            logger.debug("remove_remote_agent(%s) failed: %s", name, exc)

    # ---- transfers ---------------------------------------------------------------------------------

    def read(
        self,
        *,
        local_descs: np.ndarray,
        local_mem: str,
        remote_descs: np.ndarray,
        remote_mem: str,
        remote_name: str,
        notif: bytes,
        deadline: float,
    ) -> ReadStats:
        """READ remote -> local and wait until done; raises TransferTimeout/TransferFailed.

        On any failure the handle is released before returning, so nothing writes into local blocks after the
        caller hands them back (after a timeout the caller also removes the remote agent, which disconnects).
        """
        agent = self._agent
        dlists: list[NixlReleasable] = []  # prepared lists of a strided READ, released with the handle
        try:
            if local_descs.shape[1] == 5:
                handle = self._strided_xfer(local_descs, local_mem, remote_descs, remote_mem, remote_name, notif,
                                            dlists)
            else:
                handle = agent.initialize_xfer(
                    "READ",
                    agent.get_xfer_descs(local_descs, local_mem),
                    agent.get_xfer_descs(remote_descs, remote_mem),
                    remote_name,
                    notif,
                )
        except Exception as exc:
            self._release_dlists(dlists)
            raise TransferFailed(f"NIXL could not prepare the READ: {nixl_error_name(exc)}: {exc}") from exc
        try:
            return self._wait(handle, remote_name, deadline)
        finally:
            self._release_dlists(dlists)

    def _strided_xfer(self, local_descs: np.ndarray, local_mem: str, remote_descs: np.ndarray, remote_mem: str,
                      remote_name: str, notif: bytes, dlists: list[NixlReleasable]) -> NixlReleasable:
        """A READ of Nx5 (address, length, device, stride, count) rows: `count` pieces each, `stride` bytes
        apart (NIXL >= 1.5's compressed lists; used to move some KV heads of every token row)."""
        agent = self._agent
        n = int(local_descs[:, 4].sum())
        if n != int(remote_descs[:, 4].sum()):
            raise ValueError("strided READ: local and remote piece counts differ")
        dlists.append(agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, local_mem))
        dlists.append(agent.prep_xfer_dlist(remote_name, remote_descs, remote_mem))
        idx = np.arange(n, dtype=np.int32)
        return agent.make_prepped_xfer("READ", dlists[0], idx, dlists[1], idx, notif)

    @staticmethod
    def _release_dlists(dlists: list[NixlReleasable]) -> None:
        for d in dlists:
            try:
                d.release()
            except Exception as exc:
                logger.debug("releasing a NIXL descriptor list failed: %s", exc)
        dlists.clear()

    def _wait(self, handle: NixlReleasable, remote_name: str, deadline: float) -> ReadStats:
        agent = self._agent
        t0 = time.perf_counter()
        try:
            state = agent.transfer(handle)
            post_s = time.perf_counter() - t0
            while state == "PROC":
                now = time.monotonic()
                if now >= deadline:
                    raise TransferTimeout(
                        f"NIXL READ from {remote_name!r} not complete after {time.perf_counter() - t0:.2f}s"
                    )
                # Spin for the first few ms (TCP transports need the initiator to progress), then back off.
                time.sleep(0 if time.perf_counter() - t0 < 0.005 else 0.00005)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferFailed(f"NIXL READ from {remote_name!r} ended in state {state}")
            xfer_s = time.perf_counter() - t0
        except (TransferTimeout, TransferFailed):
            self._release_handle(handle)
            raise
        except Exception as exc:
            self._release_handle(handle)
            raise TransferFailed(
                f"NIXL READ from {remote_name!r} failed: {nixl_error_name(exc)}: {exc}"
            ) from exc
        self._release_handle(handle)
        return ReadStats(post_s=post_s, xfer_s=xfer_s)

    @staticmethod
    def _release_handle(handle: NixlReleasable) -> None:
        try:
            handle.release()
        except Exception as exc:
            logger.debug("releasing a NIXL transfer handle failed: %s", exc)

    # ---- push: WRITEs posted without waiting (pdserve/kv_transfer/push_sender.py polls them) -------------

    def post_write(self, *, local_descs: np.ndarray, local_mem: str, remote_descs: np.ndarray, remote_mem: str,
                   remote_name: str, timeout_s: float = 0.0) -> WriteHandle:
        """Post a WRITE local -> remote (Nx3 rows, or Nx5 strided rows as `read` takes) and return its handle
        (poll with `xfer_state`, then `release_handle`); raises TransferFailed when NIXL cannot prepare or post
        it. `timeout_s` is the caller's to enforce (a worker rank's `RemoteRankAgent.post_write` waits itself)."""
        agent = self._agent
        dlists: list[NixlReleasable] = []  # a strided WRITE's prepared lists live as long as its handle
        try:
            if local_descs.shape[1] == 5:
                n = int(local_descs[:, 4].sum())
                if n != int(remote_descs[:, 4].sum()):
                    raise ValueError("strided WRITE: local and remote piece counts differ")
                dlists.append(agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, local_mem))
                dlists.append(agent.prep_xfer_dlist(remote_name, remote_descs, remote_mem))
                idx = np.arange(n, dtype=np.int32)
                handle = agent.make_prepped_xfer("WRITE", dlists[0], idx, dlists[1], idx, b"")
            else:
                handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local_descs, local_mem),
                                               agent.get_xfer_descs(remote_descs, remote_mem), remote_name, b"")
        except Exception as exc:
            self._release_dlists(dlists)
            raise TransferFailed(f"NIXL could not prepare the WRITE: {nixl_error_name(exc)}: {exc}") from exc
        posted = WriteHandle(handle, dlists)
        try:
            state = agent.transfer(handle)
        except Exception as exc:
            self.release_handle(posted)
            raise TransferFailed(f"NIXL WRITE to {remote_name!r} failed to post: {nixl_error_name(exc)}: {exc}") \
                from exc
        if state not in ("PROC", "DONE"):
            self.release_handle(posted)
            raise TransferFailed(f"NIXL WRITE to {remote_name!r} failed to post (state {state})")
        return posted

    def write(self, *, local_descs: np.ndarray, local_mem: str, remote_descs: np.ndarray, remote_mem: str,
              remote_name: str, deadline: float) -> int:
        """Post a WRITE and wait until it is done (a worker rank's WRITE, `kv_rank.Write`); returns its bytes.
        On a timeout the handle is released and the peer removed (which cancels what is still in flight)."""
        posted = self.post_write(local_descs=local_descs, local_mem=local_mem, remote_descs=remote_descs,
                                 remote_mem=remote_mem, remote_name=remote_name)
        try:
            t0 = time.perf_counter()
            while (state := self.xfer_state(posted)) == "PROC":
                if time.monotonic() >= deadline:
                    self.remove_remote(remote_name)
                    raise TransferTimeout(f"NIXL WRITE to {remote_name!r} not complete after "
                                          f"{time.perf_counter() - t0:.2f}s")
                time.sleep(0 if time.perf_counter() - t0 < 0.005 else 0.00005)
            if state != "DONE":
                raise TransferFailed(f"NIXL WRITE to {remote_name!r} ended in state {state}")
        finally:
            self.release_handle(posted)
        lengths = local_descs[:, 1] if local_descs.shape[1] == 3 else local_descs[:, 1] * local_descs[:, 4]
        return int(lengths.sum())

    def xfer_state(self, posted: WriteHandle) -> str:
        """"PROC", "DONE" or an error state (a raised NIXL error reads as "ERR")."""
        try:
            return self._agent.check_xfer_state(posted.handle)
        except Exception as exc:  # noqa: BLE001 - any NIXL error ends the transfer as failed
            logger.debug("check_xfer_state failed: %s", exc)
            return "ERR"

    def release_handle(self, posted: WriteHandle) -> None:
        self._release_handle(posted.handle)
        self._release_dlists(posted.dlists)

    def send_notif(self, remote_name: str, message: bytes) -> None:
        """A notification to a peer agent (ordered after the WRITEs to it that completed before it)."""
        try:
            self._agent.send_notif(remote_name, message)
        except Exception as exc:
            raise TransferFailed(f"NIXL notification to {remote_name!r} failed: {nixl_error_name(exc)}: {exc}") \
                from exc

    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications by sender; calling it is also what progresses this agent as a READ target."""
        return self._agent.get_new_notifs()

    def close(self) -> None:
        with self._lock:
            for name in list(self._remotes):
                self._remove_locked(name)
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as exc:
                logger.debug("deregister_memory failed: %s", exc)
            self._reg = None
