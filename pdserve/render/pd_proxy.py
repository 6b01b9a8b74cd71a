"""P/D for the render tier is handed to a proxy: `pdserve render --prefill URL --decode URL` starts `pdserve proxy`
as its child on 127.0.0.1 and sends every tokens-only generate request there, as it sends them to an engine under
`--engine URL`. The proxy splits each into its prefill and decode legs (its /inference/v1/generate route, the same
plan as its OpenAI routes: retries, the decode leg sent with the prefill leg, push pairs, --on-prefill-failure), so
there is one P/D driver. (Render and proxy are independent tiers that speak HTTP, never each other's code; a
render tier may as well be given a shared proxy's URL as its `--engine`.)

The child gets `--on-prefill-failure decode-local` (a failed prefill is recomputed on the decode instance, as the
render tier always did; `pdserve up` sets the same), then the `--proxy-arg` words, which may override it. It dies
with the render tier (PR_SET_PDEATHSIG on Linux) and is stopped with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading

log = logging.getLogger("pdserve.render")

READY_TIMEOUT_S = 120.0  # the proxy imports no torch: seconds, even on a loaded machine
STOP_TIMEOUT_S = 10.0
_LISTENING = re.compile(r"pdserve proxy listening on (http://[^\s]+)")


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


class ChildProxy:
    """A `pdserve proxy` child process for one render tier's P/D."""

    def __init__(self, prefill: list[str], decode: list[str], extra_args: list[str] | None = None) -> None:
        self.prefill, self.decode = list(prefill), list(decode)
        self.argv = [sys.executable, "-m", "pdserve", "proxy", "--host", "127.0.0.1", "--port", "0",
                     "--prefill", *self.prefill, "--decode", *self.decode,
                     "--on-prefill-failure", "decode-local", *(extra_args or [])]
        self.url: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._listening = threading.Event()

    def start(self) -> str:
        """Starts the proxy and returns its URL once it listens (ValueError when it exits or never listens)."""
        self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=_die_with_parent)  # at startup: no thread of ours yet
        threading.Thread(target=self._echo, args=(self._proc,), name="pd-proxy-log", daemon=True).start()
        if not self._listening.wait(READY_TIMEOUT_S) or self.url is None:
            self.stop()
            raise ValueError(f"the P/D proxy ({' '.join(self.argv[2:])}) did not start listening")
        log.info("P/D handed to the proxy at %s (pid %d)", self.url, self._proc.pid)
        return self.url

    def _echo(self, proc: subprocess.Popen[str]) -> None:
        """The proxy's log lines, passed on to ours; the first 'listening on' line gives its URL."""
        assert proc.stderr is not None
        for line in proc.stderr:
            if self.url is None and (match := _LISTENING.search(line)):
                self.url = match.group(1)
                self._listening.set()
            sys.stderr.write(f"[pd-proxy] {line}")
        self._listening.set()  # it exited: start() stops waiting

    def stop(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
