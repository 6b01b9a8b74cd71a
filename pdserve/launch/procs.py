"""Child processes of `pdserve up`: start in their own process group, poll readiness, stop without orphans.

Each child is a session (and process-group) leader, so a terminal's Ctrl-C reaches only the launcher, which
then stops the children in order; stopping signals the whole group (grandchildren included): SIGTERM, a
bounded wait, then SIGKILL. If the launcher itself is killed (SIGKILL), a watchdog process
(`pdserve.launch.watchdog`, in its own session) sees its pipe close and stops the groups; on Linux each
child also gets PR_SET_PDEATHSIG(SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from pdserve.launch.spec import ProcSpec

POLL_S = 0.25
KILL_WAIT_S = 5.0


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after "pid (comm) " (state, ppid, pgrp, ...), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return data[data.rindex(")") + 2 :].split()


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a pid from /proc, or None if it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else (fields[0], int(fields[2]))


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by its parent, does not count)."""
    stat = _proc_stat(pid)
    if stat is not None:
        return stat[0] not in ("Z", "X")
    if os.path.isdir("/proc/self"):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def descendants(roots: set[int]) -> set[int]:
    """`roots` and every live process below them (from /proc; Linux only): what a tree's owner must stop when
    the processes it started may have started others (daemons, workers) in other process groups."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        fields = _stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None and fields[0] not in ("Z", "X"):
            parent[int(entry)] = int(fields[1])
    found = {p for p in roots if p in parent}
    grew = True
    while grew:
        new = {pid for pid, ppid in parent.items() if ppid in found and pid not in found}
        found |= new
        grew = bool(new)
    return found


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`. Without /proc: [pgid] while killpg(pgid, 0) works."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            return [pgid]
        return [pgid]
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X"):
                members.append(int(entry))
    return members


def _preexec(cpus: list[int] | None, parent: int) -> Callable[[], None]:
    def run() -> None:
        if sys.platform.startswith("linux"):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the launcher died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return run


@dataclass
class Child:
    spec: ProcSpec
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    started: float

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        """The exit code once the leader has exited (it is reaped here), else None."""
        return self.proc.poll()

    def group_alive(self) -> bool:
        """Whether any live process of the child's process group remains (the leader is reaped first)."""
        self.proc.poll()
        return bool(group_members(self.proc.pid))

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def start(spec: ProcSpec, env: dict[str, str] | None = None, *, restart: int = 0) -> Child:
    """Start `spec` with stdout and stderr to its log file, in a new session. The log is truncated on the
    first start; a restart appends to it after a marker line, so the crash before it stays readable."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(spec.log_path, "ab" if restart else "wb")  # noqa: SIM115 - closed by stop_all
    if restart:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"\n===== pdserve up: restart {restart} of {spec.name} at {stamp} =====\n".encode())
        log.flush()
    child_env = dict(os.environ if env is None else env)
    child_env.update(spec.env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        proc = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
            preexec_fn=_preexec(spec.cpus, os.getpid()),
        )
    except OSError:
        log.close()
        raise
    return Child(spec, proc, log, time.monotonic())


def _wait_gone(children: Sequence[Child], seconds: float) -> None:
    """Until no child's process group is alive, or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(c.group_alive() for c in children):
        time.sleep(0.05)


def stop_all(children: Sequence[Child], timeout: float) -> list[str]:
    """SIGTERM every child's process group, wait up to `timeout` s, SIGKILL what remains.

    Returns a line per child that needed SIGKILL or could not be confirmed gone.
    """
    problems: list[str] = []
    for child in children:
        if child.group_alive():
            child.signal_group(signal.SIGTERM)
    _wait_gone(children, timeout)
    for child in children:
        if child.group_alive():
            problems.append(f"{child.name} (pid {child.pid}) did not stop within {timeout:g}s: killed")
            child.signal_group(signal.SIGKILL)
    _wait_gone(children, KILL_WAIT_S)
    for child in children:
        if child.group_alive():
            problems.append(f"{child.name} (pid {child.pid}): processes remain after SIGKILL")
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=0.1)
        child.log.close()
    return problems


def tail(path: Path, lines: int = 20) -> list[str]:
    """The last `lines` lines of a log file (decoded leniently)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-lines:]


class Watchdog:
    """The launcher's dead-man switch: see `pdserve.launch.watchdog`."""

    def __init__(self, grace: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.launch.watchdog", str(grace)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )

    def watch(self, child: Child) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{child.pid}\n".encode())
        self.proc.stdin.flush()

    def close(self, timeout: float = 10.0) -> None:
        """Close the pipe (after the children are stopped) and reap the watchdog."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class ReadyResult:
    ok: bool
    failed: Child | None = None  # the child that exited during startup
    timed_out: list[Child] | None = None  # children not ready in time
    interrupted: bool = False


def wait_ready(
    children: Sequence[Child],
    timeout: float,
    *,
    stopping: Callable[[], bool],
    report: Callable[[str], None],
    path: str = "/health",
    progress_every: float = 15.0,
    watch: Sequence[Child] = (),
) -> ReadyResult:
    """Poll each child's `GET path` until 200, watching for exits (of `children` and of the already running
    `watch`), a stop request and the deadline."""
    pending = list(children)
    t0 = time.monotonic()
    deadline = t0 + timeout
    next_progress = t0 + progress_every
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while pending:
            if stopping():
                return ReadyResult(False, interrupted=True)
            for child in watch:
                if child.exited() is not None:
                    return ReadyResult(False, failed=child)
            for child in list(pending):
                if child.exited() is not None:
                    return ReadyResult(False, failed=child)
                try:
                    r = client.get(child.spec.url + path)
                except httpx.HTTPError:
                    continue
                if r.status_code == 200:
                    pending.remove(child)
                    report(f"  [{time.monotonic() - t0:6.1f}s] {child.name:<12} ready  {child.spec.url}")
            now = time.monotonic()
            if not pending:
                break
            if now >= deadline:
                return ReadyResult(False, timed_out=pending)
            if now >= next_progress:
                next_progress = now + progress_every
                for child in pending:
                    last = next((ln for ln in reversed(tail(child.spec.log_path, 5)) if ln.strip()), "")
                    last = last[:100] if last else "(no log output yet)"
                    report(f"  [{now - t0:6.1f}s] {child.name:<12} starting ... {last}")
            time.sleep(POLL_S)
    return ReadyResult(True)
