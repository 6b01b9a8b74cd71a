"""A P/D deployment spread over a `Testbed`: one `pdserve serve` per host, a `pdserve proxy` on its own host,
a collocated reference instance and a client host, each process started with `--host` its host's address.

Layout for `PDCluster(bed, ...)` with P prefill and D decode instances (the bed needs P + D + 3 hosts):
host 0 the proxy, hosts 1..P the prefill instances, then the D decode instances, then the collocated
reference, and the last host is the client's (no server: tests and tools talk from it, `with cluster.client():`).

Every instance shares one deployment secret (`PDSERVE_KV_SECRET`, as `pdserve up` gives its own), so side
channels listen on the host's address (not loopback) authenticated, and KV moves over NIXL/UCX TCP between
hosts. `idle_problems()` reads every instance's /metrics and says what is not back to idle (used KV blocks,
held leases, running/waiting/awaiting-params requests): the leak check after faults.

`transfer_mode="push"` gives both pools `NixlPushConnector` (the proxy learns the mode from each instance's
/pdserve/info: no proxy flag); `prefill_tp` / `decode_tp` start those instances with `--tensor-parallel-size`
(each rank a process of its own on the instance's host, gone with its engine).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.testing.netns import Host, Proc, Testbed

SERVE_PORT = 8000
SIDE_CHANNEL_PORT = 5600
MODEL_NAME = "tiny"
# What a shared 2-core box can start at once; the tiny model loads in seconds.
READY_TIMEOUT_S = 240.0
# (metric, idle value) of one instance: what `idle_problems` checks.
IDLE_METRICS = (
    ("vllm:num_requests_running", 0.0),
    ("vllm:num_requests_waiting", 0.0),
    ("pdserve:num_requests_awaiting_kv_params", 0.0),
    ("pdserve:num_requests_held", 0.0),
    ("vllm:kv_cache_usage_perc", 0.0),
)


def hosts_needed(n_prefill: int, n_decode: int) -> int:
    return n_prefill + n_decode + 3


def metric_value(text: str, name: str) -> float:
    """The first sample of `name` (a metric name, optionally with labels) in a Prometheus scrape."""
    for line in text.splitlines():
        if line.startswith(name) and len(line) > len(name) and line[len(name)] in "{ ,}":
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@dataclass
class Node:
    role: str  # proxy / prefill / decode / collocated
    host: Host
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host.addr}:{SERVE_PORT}"


TRANSFER_CONNECTORS = {"pull": "NixlConnector", "push": "NixlPushConnector"}


def kv_config(role: str, policy: str, extra: dict[str, object], transfer_mode: str = "pull") -> str:
    return json.dumps({"kv_connector": TRANSFER_CONNECTORS[transfer_mode], "kv_role": role,
                       "kv_load_failure_policy": policy, "kv_connector_extra_config": extra})


def tp_args(size: int) -> list[str]:
    if size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {size}")
    return ["--tensor-parallel-size", str(size)] if size > 1 else []


class PDCluster:
    def __init__(
        self,
        bed: Testbed,
        model_dir: Path,
        logs: Path,
        *,
        n_prefill: int = 2,
        n_decode: int = 2,
        policy: str = "fail",
        kv_extra: dict[str, object] | None = None,
        serve_args: tuple[str, ...] = (),
        proxy_args: tuple[str, ...] = (),
        secret: str | None = None,
        prefill_env: dict[str, str] | None = None,
        transfer_mode: str = "pull",
        prefill_tp: int = 1,
        decode_tp: int = 1,
    ) -> None:
        """prefill_env: more environment for the prefill instances (the soak's test-only KV faults).
        transfer_mode: "pull" (NixlConnector) or "push" (NixlPushConnector) on both pools."""
        if transfer_mode not in TRANSFER_CONNECTORS:
            raise ValueError(f"transfer_mode must be one of {sorted(TRANSFER_CONNECTORS)}, got {transfer_mode!r}")
        if len(bed.hosts) < hosts_needed(n_prefill, n_decode):
            raise ValueError(f"{n_prefill}P{n_decode}D needs {hosts_needed(n_prefill, n_decode)} hosts")
        self.bed = bed
        self.client_host = bed.hosts[n_prefill + n_decode + 2]
        env = {"PDSERVE_KV_SECRET": secret or os.urandom(24).hex()}
        extra = {"transfer_timeout_s": 5.0, "handshake_timeout_s": 5.0, **(kv_extra or {})}
        common = ["--served-model-name", MODEL_NAME, "--disable-uvicorn-access-log", *serve_args]

        def serve(role: str, host: Host, kv: list[str]) -> Node:
            argv = [sys.executable, "-m", "pdserve", "serve", str(model_dir), "--host", host.addr,
                    "--port", str(SERVE_PORT), *common, *kv]
            node_env = {**env, **(prefill_env or {})} if role == "prefill" else env
            return Node(role, host, argv, node_env, logs / f"{role}-{host.index}.log")

        self.prefill = [serve("prefill", bed.hosts[1 + i],
                              ["--kv-transfer-config", kv_config("kv_producer", policy, extra, transfer_mode),
                               "--side-channel-port", str(SIDE_CHANNEL_PORT), *tp_args(prefill_tp)])
                        for i in range(n_prefill)]
        self.decode = [serve("decode", bed.hosts[1 + n_prefill + i],
                             ["--kv-transfer-config", kv_config("kv_consumer", policy, extra, transfer_mode),
                              *tp_args(decode_tp)])
                       for i in range(n_decode)]
        self.collocated = serve("collocated", bed.hosts[1 + n_prefill + n_decode], [])
        proxy_host = bed.hosts[0]
        self.proxy = Node("proxy", proxy_host,
                          [sys.executable, "-m", "pdserve", "proxy", "--host", proxy_host.addr,
                           "--port", str(SERVE_PORT), "--prefill", *[n.url for n in self.prefill],
                           "--decode", *[n.url for n in self.decode], *proxy_args],
                          env, logs / "proxy.log")

    @property
    def instances(self) -> list[Node]:
        return [*self.prefill, *self.decode, self.collocated]

    @property
    def nodes(self) -> list[Node]:
        return [*self.instances, self.proxy]

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> PDCluster:
        for node in self.instances:
            self.launch(node)
        self.wait_ready(self.instances)
        self.launch(self.proxy)
        self.wait_ready([self.proxy])
        return self

    def launch(self, node: Node) -> None:
        node.proc = self.bed.spawn(node.host, node.argv, env=node.env, log_path=node.log_path)

    def restart(self, node: Node, *, wait: bool = True) -> None:
        if node.proc is not None:
            node.proc.stop()
        self.launch(node)
        if wait:
            self.wait_ready([node])

    def wait_ready(self, nodes: list[Node], timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        pending = list(nodes)
        with self.client(), httpx.Client(timeout=3.0) as http:
            while pending:
                node = pending[0]
                assert node.proc is not None
                if node.proc.popen.poll() is not None:
                    raise RuntimeError(f"{node.role} on {node.host.addr} exited:\n{node.proc.log()}")
                if self._ready(http, node):
                    pending.pop(0)
                    continue
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{node.role} on {node.host.addr} not ready:\n{node.proc.log()}")
                time.sleep(0.3)

    @staticmethod
    def _ready(http: httpx.Client, node: Node) -> bool:
        # The proxy's /health is up before its first probe round; a request meanwhile waits for an instance
        # (its bounded instance wait), so /health is enough for every role.
        try:
            return http.get(f"{node.url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        for node in [self.proxy, *self.instances]:
            if node.proc is not None:
                node.proc.stop()

    @contextmanager
    def client(self) -> Iterator[None]:
        """The calling thread on the client host for the block (every request to the bed goes from there)."""
        with self.bed.entered(self.client_host):
            yield

    # ---- checks ---------------------------------------------------------------------------------------
    def idle_problems(self, nodes: list[Node] | None = None, timeout: float = 30.0) -> list[str]:
        """Waits (bounded) for every instance to be back at its idle values; returns what is not."""
        with self.client():
            return idle_problems({f"{n.role}@{n.host.addr}": n.url for n in nodes or self.instances}, timeout)


def idle_problems(urls: dict[str, str], timeout: float = 30.0) -> list[str]:
    """Waits (bounded) for every instance ({label: base URL}) to be back at its idle values (`IDLE_METRICS`, read
    from /metrics); returns what is not. The calling thread must be where the URLs are reachable."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as http:
        while True:
            problems: list[str] = []
            for label, url in urls.items():
                try:
                    text = http.get(f"{url}/metrics").text
                except httpx.HTTPError as exc:
                    problems.append(f"{label}: /metrics: {exc}")
                    continue
                for name, idle in IDLE_METRICS:
                    try:
                        value = metric_value(text, name)
                    except KeyError:
                        continue  # a role without that metric
                    if value != idle:
                        problems.append(f"{label}: {name}={value:g} (idle {idle:g})")
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(0.5)


def completion_body(prompt: str, max_tokens: int, stream: bool, model: str = MODEL_NAME) -> dict[str, object]:
    """A greedy completion that returns its token ids (vLLM's `return_token_ids`): what answers are compared by."""
    body: dict[str, object] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                               "stream": stream, "return_token_ids": True, "ignore_eos": True}
    return body


def answer_token_ids(status: int, body: bytes, stream: bool) -> list[int] | str:
    """The generated token ids of a 200 answer, or a one-line reason it is an error (a non-200 status, an SSE
    error frame, a stream without [DONE])."""
    if status != 200:
        return f"HTTP {status}: {body[:200]!r}"
    if not stream:
        data = json.loads(body)
        return list(data["choices"][0]["token_ids"])
    ids: list[int] = []
    done = False
    for line in body.decode(errors="replace").splitlines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return f"SSE error frame: {json.dumps(chunk['error'])[:200]}"
        for choice in chunk.get("choices", []):
            ids.extend(choice.get("token_ids") or [])
    return ids if done else "stream ended without [DONE]"
