"""Helpers for end-to-end tests of `pdserve up` and `pdserve preflight`: a launcher subprocess whose output
is read line by line, bounded waits, and checks that every process is gone and every port free."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdserve.launch.procs import pid_alive


def tiny_model_with_tokenizer(src: Path, out: Path) -> Path:
    """A copy of a tiny random model (vocab 49152) with the embedded SmolLM2 tokenizer next to it."""
    from pdserve.model.default_model import resolve_model

    shutil.copytree(src, out)
    default = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default / name, out / name)
    return out


_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp{,6}


def _tcp_states(port: int) -> list[str] | None:
    """States (hex, as /proc/net/tcp writes them) of every TCP socket whose local port is `port`; None off Linux."""
    states: list[str] = []
    found = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        found = True
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and int(fields[1].rsplit(":", 1)[1], 16) == port:
                states.append(fields[3])
    return states if found else None


def _hex_address(field: str) -> str:
    """/proc/net/tcp's "0100007F:1F90" (or the tcp6 form) as an address string without the port; an
    IPv4-mapped IPv6 address (a dual-stack socket bound to ::ffff:127.0.0.1) as its IPv4 address."""
    import ipaddress

    raw = bytes.fromhex(field.rsplit(":", 1)[0])
    # the kernel writes each 32-bit word in host (little-endian) order
    addr = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    return str(getattr(addr, "ipv4_mapped", None) or addr)


def listening_addresses(pids: list[int]) -> dict[int, set[tuple[str, int]]]:
    """The TCP (address, port) pairs each of `pids` listens on, from /proc (Linux only), each read in the
    process's own network namespace (/proc/PID/net is its namespace's view)."""
    out: dict[int, set[tuple[str, int]]] = {}
    for pid in pids:
        listeners: dict[str, tuple[str, int]] = {}  # socket inode -> (address, port)
        for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
            with contextlib.suppress(OSError):
                for line in Path(table).read_text().splitlines()[1:]:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == _TCP_LISTEN:
                        listeners[fields[9]] = (_hex_address(fields[1]), int(fields[1].rsplit(":", 1)[1], 16))
        found: set[tuple[str, int]] = set()
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in listeners:
                        found.add(listeners[link[8:-1]])
        out[pid] = found
    return out


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it (from /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children_of(p))
    return out


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on the port. Connections the killed servers leave to the kernel (TIME_WAIT, and
    FIN_WAIT while a client of the test still holds its end) do not count: they are no process's, and a
    restarted server binds past them. On Linux read from /proc/net/tcp; elsewhere a bind probe."""
    states = _tcp_states(port)
    if states is not None:
        return _TCP_LISTEN not in states
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def wait_until(cond, timeout: float, step: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())


def children_of(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = data[data.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return out


class Up:
    """`python -m pdserve up ARGS` with its output collected by a reader thread."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str] | None = None,
                 prefix: tuple[str, ...] = ()) -> None:
        # prefix: a launcher that execs the command, e.g. `ip netns exec NS` (the PID stays pdserve up's)
        self.argv = [*prefix, sys.executable, "-m", "pdserve", "up", *args]
        self.proc = subprocess.Popen(
            self.argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env, start_new_session=True,
        )
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first output line matching `pattern`; fails if the launcher exits or time runs out first."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                for line in self.lines:
                    if m := rx.search(line):
                        return m
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                with self._lock:
                    for line in self.lines:
                        if m := rx.search(line):
                            return m
                raise AssertionError(f"pdserve up exited ({self.proc.returncode}) before {pattern!r}:\n{self.output}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} within {timeout:g}s:\n{self.output}")
            time.sleep(0.2)

    def ready(self, timeout: float) -> dict[str, str]:
        m = self.wait_for(r"^PDSERVE_READY (.*)$", timeout)
        return dict(w.split("=", 1) for w in shlex.split(m.group(1)))

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"pdserve up did not exit within {timeout:g}s:\n{self.output}") from None
        self._reader.join(timeout=5)
        return rc

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(timeout)

    def kill(self) -> None:
        """Last resort for a test that failed half-way: SIGKILL the launcher (its watchdog stops the rest)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def ports_in(text: str) -> set[int]:
    """Every 127.0.0.1:PORT and `side channel :PORT` mentioned in the launcher's output."""
    ports = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", text)}
    ports |= {int(p) for p in re.findall(r"side channel :(\d+)", text)}
    return ports


def assert_all_gone(pids: list[int], ports: set[int], timeout: float = 30) -> None:
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout), (
        f"still running: {[p for p in pids if pid_alive(p)]}"
    )
    assert wait_until(lambda: all(port_free(p) for p in ports), timeout), (
        f"ports still listened on: {[(p, _tcp_states(p)) for p in ports if not port_free(p)]}"
    )


def kill_leftovers(pids: list[int]) -> None:
    """After a failed assertion: make sure no test process outlives the test (by PID, never by name)."""
    for p in pids:
        if pid_alive(p):
            try:
                os.killpg(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
