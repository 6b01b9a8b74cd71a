"""Helpers shared by the tests that run `pdserve` subprocesses on 127.0.0.1 (no tests here).

* `free_port`: a TCP port nothing listens on right now.
* `make_model_dir`: a tiny random Llama with SmolLM2's tokenizer, chat template and generation config.
* `PdserveProcess`: `python -m pdserve ...` with its output in a log file, ready when `/health` is 200,
  stopped by SIGTERM (SIGKILL after a timeout); `ServerProcess` is `pdserve serve MODEL_DIR` on one of them.
* `all_ready`: a fixture's servers, ready for the block and stopped after it.
* `metric_value`, `wait_idle`: reading a server's Prometheus `/metrics`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Self

import httpx

from pdserve.testing.pd_cluster import metric_value  # noqa: F401 - the tests' import of it

MODEL = "tiny"  # the --served-model-name of a ServerProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model_dir(root: Path, **overrides) -> Path:
    """Tiny random Llama (vocab of SmolLM2) with SmolLM2's tokenizer, chat template and generation config;
    `overrides` go to make_tiny_model (e.g. num_key_value_heads=1)."""
    from tiny_models import make_tiny_model

    from pdserve.model.default_model import resolve_model

    src = Path(resolve_model("smollm2-135m"))
    out = root / "tiny-smol"
    out.mkdir(parents=True, exist_ok=True)
    make_tiny_model(out, "llama", **{"vocab_size": 49152, "max_position_embeddings": 512, **overrides})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    return out


class PdserveProcess:
    """`python -m pdserve <args>` listening on 127.0.0.1:`port`, with its output in a log file."""

    poll_s = 0.3  # how often wait_ready asks /health

    port_retries = 3  # a port from free_port() taken by another process before this one bound it: a new port

    def __init__(self, log_path: Path, port: int, args: list[str], env: dict[str, str] | None = None):
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._args, self._env = list(args), env
        self._spawn(port)

    def _spawn(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve", *self._args], stdout=self._log,
                                     stderr=subprocess.STDOUT, env={**os.environ, **(self._env or {})})

    def _port_taken(self) -> bool:
        """The process exited because its port was bound meanwhile (free_port's port is free only when asked:
        servers starting beside it bind ports of the same ephemeral range), and it was given one on the command
        line that a new free_port() can replace."""
        ours = ["--port", str(self.port)]
        given = any(self._args[i:i + 2] == ours for i in range(len(self._args) - 1))
        return given and f"'127.0.0.1', {self.port}): address already in use" in self.log()

    def _respawn_on_a_new_port(self) -> None:
        port = free_port()
        i = next(i for i in range(len(self._args) - 1) if self._args[i:i + 2] == ["--port", str(self.port)])
        self._args[i + 1] = str(port)
        self.port_retries -= 1
        self._spawn(port)

    def wait_ready(self, timeout: float = 180.0) -> Self:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self.port_retries > 0 and self._port_taken():
                    self._respawn_on_a_new_port()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


class ServerProcess(PdserveProcess):
    """`pdserve serve MODEL_DIR` serving it as `MODEL`, plus `args`."""

    def __init__(self, model_dir: Path, log_path: Path, *args: str, env: dict[str, str] | None = None):
        port = free_port()
        # the tests' pools, prompts and prefix hits are sized in blocks of 16 (GPU's default; CPU's is 128)
        block = [] if "--block-size" in args else ["--block-size", "16"]
        super().__init__(log_path, port, ["serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                                          "--served-model-name", MODEL, "--disable-uvicorn-access-log", *block,
                                          *args], env=env)


@contextmanager
def all_ready(servers: Mapping[str, PdserveProcess]) -> Iterator[None]:
    """Waits until every server answers /health, then runs the block; stops them all (by PID) however it ends."""
    try:
        for srv in servers.values():
            srv.wait_ready()
        yield
    finally:
        for srv in servers.values():
            srv.stop()


def wait_idle(url: str, timeout: float = 30.0) -> str:
    """Polls /metrics until no request runs or waits and the KV pool is empty; returns the last scrape."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        if (metric_value(text, "vllm:num_requests_running") == 0
                and metric_value(text, "vllm:num_requests_waiting") == 0
                and metric_value(text, "pdserve:num_requests_awaiting_kv_params") == 0
                and metric_value(text, "vllm:kv_cache_usage_perc") == 0):
            return text
        time.sleep(0.1)
    raise AssertionError(f"server not idle after {timeout}s:\n{text}")
