"""Thin integration with `pdserve up`: start a topology as a subprocess, wait for /health, SIGTERM it.

The launcher owns its instances and proxy; we only own the one process we start (in its own session,
so a launcher that fails to clean up on SIGTERM can still be stopped as a group as a last resort).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from types import TracebackType


class LaunchError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_launch_command() -> list[str]:
    return [sys.executable, "-m", "pdserve", "up"]


def _tail(path: str, n_bytes: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:  # noqa: S310 - local URL we built
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


class LaunchedTopology:
    """`with LaunchedTopology(...) as url:` runs `pdserve up --topology T --model M --port P ...`."""

    def __init__(
        self,
        name: str,
        topology: str,
        model: str,
        log_path: str,
        command: Sequence[str] | None = None,
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int | None = None,
        ready_timeout_s: float = 900.0,
        stop_timeout_s: float = 60.0,
    ) -> None:
        self.name = name
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        self.argv = [
            *(command or default_launch_command()),
            "--topology",
            topology,
            "--model",
            model,
            "--port",
            str(self.port),
            *extra_args,
        ]
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        self.start()
        return self.url

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        print(f"[{self.name}] launching: {shlex.join(self.argv)} (log: {self.log_path})", flush=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise LaunchError(
                    f"[{self.name}] `pdserve up` exited with {code} before becoming healthy:\n"
                    f"{_tail(self.log_path)}"
                )
            if _healthy(self.url):
                print(f"[{self.name}] healthy at {self.url}", flush=True)
                return
            time.sleep(0.5)
        self.stop()
        raise LaunchError(
            f"[{self.name}] not healthy at {self.url}/health after {self.ready_timeout_s:.0f} s:\n"
            f"{_tail(self.log_path)}"
        )

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            print(
                f"[{self.name}] did not stop within {self.stop_timeout_s:.0f} s of SIGTERM; killing its group",
                file=sys.stderr,
                flush=True,
            )
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
