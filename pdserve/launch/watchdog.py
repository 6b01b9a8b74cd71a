"""Watchdog of `pdserve up`: stops the launcher's process groups if the launcher dies without doing it.

    python -m pdserve.launch.watchdog GRACE_S      (stdin: one process-group id per line)

The launcher starts this in its own session with a pipe on stdin and writes the id of every child process
group it starts. When the pipe closes (the launcher exited, even by SIGKILL) the watchdog sends SIGTERM
to every group still alive, waits up to GRACE_S seconds, SIGKILLs what remains, and exits. After a
normal teardown the groups are already gone and it exits at once. Standard library only, so it starts fast.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time


def _alive(pgid: int) -> bool:
    """Whether a non-zombie process remains in group `pgid`."""
    if os.path.isdir("/proc/self"):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    data = f.read().decode("ascii", "replace")
            except OSError:
                continue
            fields = data[data.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_groups(pgids: list[int], grace: float) -> None:
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pgids):
        time.sleep(0.1)
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    grace = float(argv[0]) if argv else 10.0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe decides
    pgids: list[int] = []
    for line in sys.stdin:
        line = line.strip()
        if line.isdigit():
            pgids.append(int(line))
    live = [p for p in pgids if _alive(p)]
    if live:
        stop_groups(live, grace)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
