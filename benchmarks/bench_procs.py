"""Server processes of the benchmark scripts: wait until /health answers, stop by PID."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, name: str = "server", poll_s: float = 0.5) -> None:
    """Returns once `url`/health answers 200; raises if the process exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{name} did not become ready in {timeout:.0f} s")


def stop(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGTERM (a graceful drain), then SIGKILL after `grace_s`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
