"""A multi-host test bed on one Linux box: each host a network namespace, all on a private bridge.

Each `Host` is a namespace `pdnet-<owner pid>-hN` with its own address (default subnet 10.200.0.0/24, host N
at .N+1) on a veth whose other end is a port of a bridge that lives in a namespace of its own
(`pdnet-<owner pid>-sw`). Nothing is added to the caller's namespace, so the addresses exist only inside the
bed: a process there can reach the other hosts and nothing else. Loopback is up in every host (servers and
UCX may use it for themselves).

Faults act on a host's switch port, as a pulled cable or a congested uplink would:
* `partition(host)` / `heal(host)`: the port down/up (TCP to and from the host stalls; nothing is refused).
* `shape(host, rate)`: a token bucket (`tc qdisc tbf`, both directions); `unshape(host)` removes it.

Processes run in a host with `ip netns exec` (which execs the command: the PID is the process's own) and are
stopped by that PID. `close()` (also on `with` exit and at interpreter exit) stops them all and deletes the
namespaces, which removes the veths and the bridge with them. At start, namespaces a crashed earlier run left
(`pdnet-<pid>-*` whose pid is gone) are deleted.

The caller talks to the bed from inside a host: `with bed.entered(host): httpx.get(...)` switches the calling
thread's network namespace (setns(2) is per thread) while sockets are created, and back afterwards; a socket
keeps the namespace it was created in.

UCX between hosts is told to use TCP on the host's veth (`host.env()`): the namespaces share one kernel's
memory, so UCX's shared-memory transports would otherwise connect the "hosts" around the network, and
partitions and shaping would not reach the KV transfers.

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and the `ip` and `tc` tools: `unavailable_reason()` says why
not, for tests to skip with.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pdserve.launch.procs import pid_alive

logger = logging.getLogger("pdserve.testing.netns")

PREFIX = "pdnet-"
DEFAULT_SUBNET = "10.200.0"  # /24; host N is .N+1 (.1 is left free)
HOST_DEV = "eth0"  # the veth inside each host
_CLONE_NEWNET = 0x40000000
_STALE = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """None when namespaces can be made here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` tool (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def clean_stale() -> list[str]:
    """Deletes `pdnet-<pid>-*` namespaces whose owner process is gone; returns their names."""
    listing = _ip("netns", "list", check=False).stdout
    removed = []
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _STALE.match(name)
        if m and not pid_alive(int(m.group(1))):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


def _kill_namespace_processes(ns: str) -> None:
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@dataclass
class Host:
    index: int
    ns: str
    addr: str
    port_dev: str  # its port on the bridge, in the switch namespace

    def env(self) -> dict[str, str]:
        """Environment for a pdserve process on this host: UCX over TCP on the host's veth."""
        return {"UCX_NET_DEVICES": HOST_DEV, "UCX_TLS": "tcp"}


@dataclass
class Proc:
    host: Host
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path | None
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self, tail: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-tail:]

    def stop(self, timeout: float = 20.0, sig: int = signal.SIGTERM) -> int | None:
        """Signal by PID, SIGKILL after `timeout`; returns the exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.popen.returncode


class Testbed:
    """`n` hosts on one private bridge; use as a context manager (or call close())."""

    def __init__(self, n: int, *, subnet: str = DEFAULT_SUBNET, tag: str | None = None) -> None:
        if not 1 <= n <= 200:
            raise ValueError("1..200 hosts")
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        self._prefix = f"{PREFIX}{os.getpid()}-{tag or 'b'}"
        self.switch_ns = f"{self._prefix}sw"
        self.hosts: list[Host] = []
        self.procs: list[Proc] = []
        self._closed = False
        for stale in clean_stale():
            logger.warning("deleted network namespace %s left by a run that is gone", stale)
        atexit.register(self.close)
        try:
            self._build(n, subnet)
        except BaseException:
            self.close()
            raise

    def _build(self, n: int, subnet: str) -> None:
        _ip("netns", "add", self.switch_ns)
        _ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch_ns, "link", "set", "br0", "up")
        for i in range(n):
            host = Host(i, f"{self._prefix}h{i}", f"{subnet}.{i + 2}", f"p{i}")
            _ip("netns", "add", host.ns)
            self.hosts.append(host)
            _ip("link", "add", "name", HOST_DEV, "netns", host.ns, "type", "veth",
                "peer", "name", host.port_dev, "netns", self.switch_ns)
            _ip("-n", self.switch_ns, "link", "set", host.port_dev, "master", "br0")
            _ip("-n", self.switch_ns, "link", "set", host.port_dev, "up")
            _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", HOST_DEV)
            _ip("-n", host.ns, "link", "set", HOST_DEV, "up")
            _ip("-n", host.ns, "link", "set", "lo", "up")

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- processes ------------------------------------------------------------------------------------
    def spawn(self, host: Host, argv: Sequence[str], *, env: dict[str, str] | None = None,
              log_path: Path | None = None) -> Proc:
        """`argv` in `host` (its environment: ours, then `host.env()`, then `env`)."""
        # appended: a restarted process (the chaos soak's kill-instance) keeps its predecessor's lines
        log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - closed by Proc.stop
        full_env = {**os.environ, **host.env(), **(env or {})}
        popen = subprocess.Popen(["ip", "netns", "exec", host.ns, *argv], env=full_env,
                                 stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT)
        proc = Proc(host, list(argv), popen, log_path, log)
        self.procs.append(proc)
        return proc

    @contextlib.contextmanager
    def entered(self, host: Host) -> Iterator[None]:
        """The calling thread in `host`'s network namespace for the block (sockets made there stay there)."""
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/var/run/netns/{host.ns}", os.O_RDONLY)
        try:
            if libc.setns(target, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {host.ns} failed")
            try:
                yield
            finally:
                if libc.setns(own, _CLONE_NEWNET) != 0:  # pragma: no cover - would leave the thread stranded
                    raise OSError(ctypes.get_errno(), "setns back to the caller's namespace failed")
        finally:
            os.close(own)
            os.close(target)

    # ---- faults ---------------------------------------------------------------------------------------
    def partition(self, host: Host) -> None:
        _ip("-n", self.switch_ns, "link", "set", host.port_dev, "down")

    def heal(self, host: Host) -> None:
        _ip("-n", self.switch_ns, "link", "set", host.port_dev, "up")

    def _link_ends(self, host: Host, direction: str) -> list[tuple[str, str]]:
        """(namespace, device) whose egress carries `host`'s traffic: "out" of the host, "in" to it, or both."""
        ends = {"out": [(host.ns, HOST_DEV)], "in": [(self.switch_ns, host.port_dev)]}
        if direction == "both":
            return ends["out"] + ends["in"]
        if direction not in ends:
            raise ValueError(f"direction must be out, in or both, got {direction!r}")
        return ends[direction]

    def shape(self, host: Host, rate: str = "10mbit", *, burst: str = "32kb", latency: str = "400ms",
              direction: str = "both") -> None:
        """A token bucket (`tc qdisc tbf`; rates and sizes in tc's units) on `host`'s link."""
        for ns, dev in self._link_ends(host, direction):
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                            "burst", burst, "latency", latency], check=True, capture_output=True, timeout=30)

    def unshape(self, host: Host, direction: str = "both") -> None:
        for ns, dev in self._link_ends(host, direction):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False,
                           capture_output=True, timeout=30)

    # ---- teardown -------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in reversed(self.procs):
            try:
                proc.stop(timeout=10)
            except Exception:  # noqa: BLE001 - keep tearing down
                logger.exception("stopping %s in %s", proc.argv[:3], proc.host.ns)
        for ns in [h.ns for h in self.hosts] + [self.switch_ns]:
            _kill_namespace_processes(ns)  # anything a stopped process left behind
            _ip("netns", "del", ns, check=False)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
