"""One pdserve instance as a Ray actor: the actor supervises a `pdserve serve` process on its node.

Why a supervised process rather than the engine inside the actor: the instance is then exactly what
`pdserve up` runs (same command line, same log file, same signal handling and shutdown), its threads and
CUDA context live outside Ray's worker runtime, and a future tensor-parallel server can fork its ranks as
it does on one machine. The actor and its server share one fate:

- the actor's process dies (SIGKILL, node failure): the server gets SIGKILL from the kernel
  (PR_SET_PDEATHSIG, armed by the supervising thread, which lives as long as the server) so nothing is
  orphaned; Ray restarts the actor (`max_restarts`), which starts a new server, at a new port;
- the server dies after it served: the actor exits (`os._exit`) so that Ray restarts it the same way;
- the server fails before it ever served: in the actor's first life that is a startup error, reported
  by `wait_ready` with the log's last lines (the controller gives up on it, no restart loop); in a later
  life (a restart) the actor exits and Ray tries again, up to `max_restarts`.

The server binds the node's address (as Ray reports it) and advertises it as the KV side-channel host,
so a decode instance on another node reaches this prefill's side channel and NIXL agent; never 127.0.0.1
unless the node's address is 127.0.0.1 (a one-machine test cluster).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.launch.procs import tail
from pdserve.launch.ray_spec import InstanceSpec

HEALTH_POLL_S = 0.25
TAIL_LINES = 30


def free_port(host: str) -> int:
    """A port nothing listens on right now on `host` (the server binds it a moment later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


if sys.platform.startswith("linux"):
    import ctypes

    # Loaded here, not in the child: between fork and exec a child of a many-threaded process (a Ray
    # worker) must not import or dlopen (another thread may have held those locks at fork time).
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
else:  # pragma: no cover
    _PRCTL = None


def _die_with_parent_thread() -> None:
    """In the child before exec: SIGKILL when the thread that started it ends (so: when the actor dies)."""
    if _PRCTL is not None:
        _PRCTL(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL


class InstanceServer:
    """The actor class (wrapped with `ray.remote` by the controller, threaded so that `endpoint()` answers
    while `wait_ready` blocks)."""

    def __init__(self, name: str, spec: dict[str, Any], bind_host: str | None = None) -> None:
        import ray

        self.name = name
        self.spec = InstanceSpec(**spec)
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.restarted = ctx.was_current_actor_reconstructed
        self.bind_host = bind_host or self.node_ip
        self.port = free_port(self.bind_host)
        self.url = f"http://{self.node_ip}:{self.port}"
        self.log_path = Path(self.spec.log_dir) / f"{name.replace('/', '-')}.log"
        self.state = "starting"  # starting | serving | draining | stopping | stopped | failed
        self.error: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._supervise, name="pdserve-instance", daemon=True)
        self._thread.start()

    # -- supervision (one thread for the server's whole life: it also holds PR_SET_PDEATHSIG) ----------

    def _set_state(self, state: str, error: str | None = None) -> None:
        with self._changed:
            self.state = state
            if error is not None:
                self.error = error
            self._changed.notify_all()

    def _supervise(self) -> None:
        argv = self.spec.serve_argv(sys.executable, self.bind_host, self.port, self.node_ip)
        env = {**os.environ, **self.spec.env, "PYTHONUNBUFFERED": "1"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            life = "restarted by Ray" if self.restarted else "first start"
            log.write(f"=== pdserve ray: {self.name} ({self.spec.role}) on node {self.node_ip} "
                      f"[{self.node_id[:12]}], actor pid {os.getpid()}, {life}: {' '.join(argv)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True, preexec_fn=_die_with_parent_thread)
            except OSError as e:
                self._set_state("failed", f"cannot start {argv[0]}: {e}")
                return
        served = self._wait_healthy()
        code = self.proc.wait()
        if self.state in ("stopping", "stopped"):
            return
        if served or self.restarted:
            with open(self.log_path, "ab") as log:
                log.write(f"=== pdserve ray: server exited with code {code}; the actor exits so that Ray "
                          "restarts it\n".encode())
            os._exit(1)
        if self.state != "failed":  # (a startup timeout already said why)
            self._set_state("failed", f"{self.name}: server exited with code {code} during startup; last lines "
                            f"of {self.log_path} on {self.node_ip}:\n" + "\n".join(tail(self.log_path, TAIL_LINES)))

    def _wait_healthy(self) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + self.spec.startup_timeout
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while self.proc.poll() is None:
                if self.state != "starting":
                    return self.state in ("serving", "draining")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        self._set_state("serving")
                        return True
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self._set_state("failed", f"{self.name}: not healthy within {self.spec.startup_timeout:g}s; "
                                    f"last lines of {self.log_path}:\n" + "\n".join(tail(self.log_path, TAIL_LINES)))
                    self._kill_group(signal.SIGKILL)
                    return False
                time.sleep(HEALTH_POLL_S)
        return False

    def _kill_group(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    # -- actor methods ---------------------------------------------------------------------------------

    def endpoint(self) -> dict[str, Any]:
        return {
            "name": self.name, "role": self.spec.role, "url": self.url, "state": self.state,
            "node_ip": self.node_ip, "node_id": self.node_id, "pid": os.getpid(),
            "server_pid": self.proc.pid if self.proc is not None else None, "restarted": self.restarted,
            "log_path": str(self.log_path),
        }

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Blocks until the server answers /health (returns endpoint()) or failed (raises with the log tail)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.state == "starting" and time.monotonic() < deadline:
                self._changed.wait(min(1.0, max(0.0, deadline - time.monotonic())))
        if self.state == "failed":
            raise RuntimeError(self.error or f"{self.name} failed")
        if self.state == "starting":
            raise TimeoutError(f"{self.name} not ready within {timeout:g}s")
        return self.endpoint()

    def drain(self) -> dict[str, Any]:
        """Stop taking new work: discovery takes a draining instance out of the proxy's pools."""
        if self.state in ("starting", "serving"):
            self._set_state("draining")
        return self.endpoint()

    def stop(self, timeout: float | None = None) -> dict[str, Any]:
        """SIGTERM the server's process group (it finishes or aborts in-flight requests), SIGKILL after
        `timeout` (default: the spec's stop_timeout). The actor stays, stopped, until it is killed."""
        grace = self.spec.stop_timeout if timeout is None else timeout
        self._set_state("stopping")
        if self.proc is not None and self.proc.poll() is None:
            self._kill_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._kill_group(signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._kill_group(signal.SIGKILL)  # anything left in the group (the server's own children)
        self._set_state("stopped")
        return self.endpoint()

    def log_tail(self, lines: int = TAIL_LINES) -> list[str]:
        return tail(self.log_path, lines)
