"""A Ray cluster across `Testbed` hosts: `ray start --head` on one network-namespace host, `ray start --address`
on others, each node with `--node-ip-address` its host's address.

Ray runs small (`--num-cpus`, a 200 MB object store, no dashboard UI) and with token authentication on: one
random token per cluster, given to every node and to drivers by environment (`RAY_AUTH_MODE=token`,
`RAY_AUTH_TOKEN`), so a node or a driver with another token (or a token file in the user's home) is refused.
Each node runs `ray start --block`, so the process started in the host is the node's parent; `stop()` sends
it SIGTERM, then SIGKILLs whatever is left of the processes below it (raylet, GCS, agents, workers), by PID.
`ray stop` is never used: it stops every Ray process on the machine.

Ray's daemons listen on their host's address or on the wildcard, which inside a namespace means that host's
own interfaces (its veth and loopback) and nothing else; nodes reach each other over the bed's bridge.
Session files go to a temporary directory of the cluster's own (`--temp-dir`), not Ray's shared default one.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.launch.procs import descendants, pid_alive
from pdserve.testing.netns import Host, Proc, Testbed

GCS_PORT = 6379
OBJECT_STORE_BYTES = 200 * 1024**2
START_TIMEOUT_S = 180.0


def ray_executable() -> str:
    """The `ray` command next to this interpreter (the environment pdserve runs in)."""
    found = Path(sys.executable).with_name("ray")
    if found.exists():
        return str(found)
    return shutil.which("ray") or "ray"


class RayNetnsCluster:
    """A head on `head` and one more node per host of `workers`, each offering `num_cpus` CPUs and the custom
    resources given for it (e.g. `{"prefill_node": 1}`)."""

    def __init__(self, bed: Testbed, head: Host, workers: list[Host], logs: Path, *, num_cpus: int = 1,
                 resources: dict[str, dict[str, float]] | None = None) -> None:
        self.bed = bed
        self.head = head
        self.workers = workers
        self.logs = logs
        self.num_cpus = num_cpus
        self.resources = resources or {}
        self.address = f"{head.addr}:{GCS_PORT}"
        self.temp_dir = tempfile.mkdtemp(prefix="pdray")  # short: Ray's socket paths live under it
        self.env = {
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray's memory monitor kills the newest workers when the *machine* is nearly out of memory; on a
            # shared box that would kill this cluster's actors for memory it does not use
            "RAY_memory_monitor_refresh_ms": "0",
        }
        self.nodes: list[Proc] = []

    def _start_node(self, host: Host, head: bool) -> Proc:
        argv = [ray_executable(), "start", "--block", "--node-ip-address", host.addr,
                "--num-cpus", str(self.num_cpus), "--object-store-memory", str(OBJECT_STORE_BYTES),
                "--disable-usage-stats"]
        if self.resources.get(host.addr):
            argv += ["--resources", json.dumps(self.resources[host.addr])]
        if head:
            argv += ["--head", "--port", str(GCS_PORT), "--include-dashboard=false", "--temp-dir", self.temp_dir]
        else:
            argv += ["--address", self.address]
        proc = self.bed.spawn(host, argv, env=self.env, log_path=self.logs / f"ray-{host.addr}.log")
        self.nodes.append(proc)
        return proc

    def start(self) -> RayNetnsCluster:
        """The head, then the other nodes; returns once the head's GCS sees every node alive."""
        self._start_node(self.head, head=True)
        self._wait(1)
        for host in self.workers:
            self._start_node(host, head=False)
        self._wait(1 + len(self.workers))
        return self

    def alive_nodes(self) -> list[dict[str, object]]:
        """`ray list nodes`-like facts from the GCS, asked from the head's host with the cluster's token."""
        probe = ("import json, ray\n"
                 f"ray.init(address={self.address!r}, logging_level='ERROR', log_to_driver=False)\n"
                 "print(json.dumps([{'ip': n['NodeManagerAddress'], 'resources': n['Resources']}"
                 " for n in ray.nodes() if n['Alive']]))\n")
        out = self.run_driver([sys.executable, "-c", probe], timeout=60)
        if out.returncode != 0:
            return []
        return json.loads(out.stdout.strip().splitlines()[-1])

    def run_driver(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """`argv` on the head's host with the cluster's token (a short-lived driver)."""
        return subprocess.run(["ip", "netns", "exec", self.head.ns, *argv], capture_output=True, text=True,
                              env={**os.environ, **self.head.env(), **self.env}, timeout=timeout)

    def _wait(self, n: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for proc in self.nodes:
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"ray start on {proc.host.addr} exited:\n{proc.log()}")
            if len(self.alive_nodes()) >= n:
                return
            time.sleep(1.0)
        raise TimeoutError(f"{n} Ray nodes not up within {START_TIMEOUT_S:g}s:\n"
                           + "\n".join(p.log() for p in self.nodes))

    def process_ids(self) -> set[int]:
        """Every live process of the cluster's nodes (each `ray start` and everything below it)."""
        return descendants({p.pid for p in self.nodes})

    def stop(self) -> list[int]:
        """SIGTERM to each node's `ray start --block` (workers first), then SIGKILL to what is left below them;
        returns the PIDs that were still alive after that (should be none)."""
        everything = self.process_ids()
        for proc in reversed(self.nodes):
            proc.stop(timeout=20)
        for pid in everything:
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(pid_alive(p) for p in everything):
            time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return [p for p in everything if pid_alive(p)]
