"""`pdserve proxy` in front of real `pdserve serve` instances: 1P1D on a tiny random model with real NIXL
DRAM transfers. Greedy outputs through the proxy must be identical to the same model served collocated
(the prefill instance asked without kv_transfer_params: it computes everything itself, so a corrupted
transfer cannot leak into the reference through the decode instance's prefix cache), and every request
through the proxy must have moved its KV over NIXL (the decode instance's transfer counter).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import free_port

try:
    from pdserve.kv_transfer.nixl_agent import load_nixl

    load_nixl()
except Exception as exc:  # noqa: BLE001 - any failure to load NIXL means no P/D on this machine
    pytest.skip(f"NIXL not importable: {exc}", allow_module_level=True)

MODEL = "tiny"
READY_TIMEOUT_S = 300.0
COMMON = ("--max-model-len", "512", "--num-gpu-blocks-override", "128", "--block-size", "16")
http = httpx.Client(timeout=120.0)


class Server:
    """A subprocess with its log in a file, ready when `GET /health` answers 200."""

    def __init__(self, args: list[str], log: Path, url: str | None = None, env: dict[str, str] | None = None):
        self.log = log
        self._fh = log.open("wb")
        self.proc = subprocess.Popen(
            args, stdout=self._fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.url = url

    def wait_ready(self, status: int = 200) -> Server:
        """Until GET /health answers `status` (a proxy without a live prefill instance answers 503)."""
        for _ in range(int(READY_TIMEOUT_S / 0.25)):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"exited with {self.proc.returncode}:\n{self.log.read_text(errors='replace')[-4000:]}"
                )
            if self.url is None:
                match = re.search(r"listening on (http://[\d.]+:\d+)", self.log.read_text(errors="replace"))
                self.url = match.group(1) if match else None
            if self.url is not None:
                try:
                    if http.get(self.url + "/health", timeout=2).status_code == status:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.25)
        raise TimeoutError(f"not ready:\n{self.log.read_text(errors='replace')[-4000:]}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._fh.close()


def _model_dir(root: Path) -> Path:
    """Tiny random Llama with the embedded SmolLM2's tokenizer and chat template."""
    from tiny_models import make_tiny_model

    try:
        from pdserve.model.default_model import resolve_model

        src = Path(resolve_model("smollm2-135m"))
    except Exception as exc:  # noqa: BLE001 - the embedded model's package may be absent
        pytest.skip(f"embedded model unavailable for its tokenizer: {exc}")
    out = root / "tiny-smol"
    out.mkdir(parents=True, exist_ok=True)
    make_tiny_model(out, "llama", vocab_size=49152, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    return out


def _instance(model: Path, log: Path, kv_role: str, *extra: str) -> Server:
    port = free_port()
    kv = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_load_failure_policy": "fail"}
    args = [
        sys.executable,
        "-m",
        "pdserve",
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--disable-uvicorn-access-log",
        *COMMON,
        "--kv-transfer-config",
        json.dumps(kv),
        *extra,
    ]
    return Server(
        args, log, f"http://127.0.0.1:{port}", env={"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}
    )


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    root = tmp_path_factory.mktemp("proxy-e2e")
    model = _model_dir(root)
    servers: dict[str, Server] = {}
    try:
        servers["prefill"] = _instance(model, root / "prefill.log", "kv_producer", "--side-channel-port", "0")
        servers["decode"] = _instance(model, root / "decode.log", "kv_consumer")
        for srv in servers.values():
            srv.wait_ready()
        servers["proxy"] = Server(
            [
                sys.executable,
                "-m",
                "pdserve",
                "proxy",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--prefill",
                servers["prefill"].url or "",
                "--decode",
                servers["decode"].url or "",
            ],
            root / "proxy.log",
        ).wait_ready()
        yield servers
    finally:
        for srv in reversed(list(servers.values())):  # all at once: instances take a while to exit
            srv.terminate()
        for srv in servers.values():
            srv.stop()


def _text(route: str, resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    if not resp.headers["content-type"].startswith("text/event-stream"):
        choice = resp.json()["choices"][0]
        return choice["text"] if route == "completions" else choice["message"]["content"]
    assert resp.text.endswith("data: [DONE]\n\n")
    out = ""
    for block in resp.text.split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            event = json.loads(block[len("data: ") :])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                out += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return out


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ":
            return float(line.rsplit(" ", 1)[1])
    return 0.0


WORDS = ["alpha", "river", "stone", "cloud", "seven", "orange", "signal", "quiet", "market", "engine"]
# (route, body, whether the prompt spans full KV blocks, i.e. must be moved over NIXL)
CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("completions", {"prompt": "Hi", "max_tokens": 8}, False),
    (
        "completions",
        {
            "prompt": " ".join(WORDS * 6),
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        True,
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": " ".join(WORDS * 3)}], "max_tokens": 10, "stream": True},
        True,
    ),
    (
        "chat/completions",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."},
            ],
            "max_tokens": 6,
        },
        True,
    ),
]


def test_1p1d_through_proxy_matches_collocated(pd: dict[str, Server]) -> None:
    proxy, prefill, decode = pd["proxy"].url, pd["prefill"].url, pd["decode"].url
    before = _metric(http.get(f"{decode}/metrics").text, "vllm:nixl_xfer_time_seconds_count")
    for route, case, _ in CASES:
        body = {"model": MODEL, "temperature": 0.0, **case}
        via_proxy = _text(route, http.post(f"{proxy}/v1/{route}", json=body))
        collocated = _text(route, http.post(f"{prefill}/v1/{route}", json=body))
        assert via_proxy == collocated, (route, case)
        assert via_proxy  # the tiny model generates something for every case
    transfers = _metric(http.get(f"{decode}/metrics").text, "vllm:nixl_xfer_time_seconds_count") - before
    # Every proxied prompt of at least one full block moved its KV over NIXL (a shorter one may not need to).
    assert sum(long for _, _, long in CASES) <= transfers <= len(CASES)
    metrics = http.get(f"{proxy}/metrics").text
    assert _metric(metrics, 'pdserve_proxy_requests_total{path="disagg"}') == len(CASES)
    # pdserve decode instances get their leg with the prefill leg, the params after it (the default)
    assert _metric(metrics, "pdserve_proxy_early_decode_legs_total") == len(CASES)
    errors = [
        line
        for line in metrics.splitlines()
        if line.startswith("pdserve_proxy_errors_total") and not line.endswith(" 0.0")
    ]
    assert errors == []


def test_1p1d_prefill_instance_down_fails_cleanly(pd: dict[str, Server]) -> None:
    """An unreachable prefill instance is never admitted: the proxy's /health says 503 and a request gets a
    clean 503 with Retry-After once --instance-wait-timeout passes, never a silent recompute."""
    proxy_log = pd["proxy"].log.parent / "proxy-dead-prefill.log"
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = Server(
        [
            sys.executable,
            "-m",
            "pdserve",
            "proxy",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--prefill",
            dead,
            "--decode",
            pd["decode"].url or "",
            "--instance-wait-timeout",
            "1",
        ],
        proxy_log,
    )
    try:
        proxy.wait_ready(status=503)
        resp = http.post(
            f"{proxy.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}
        )
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "ServiceUnavailableError"
        assert int(resp.headers["Retry-After"]) >= 1
        assert "no prefill instance available" in resp.json()["error"]["message"]
        # the decode leg sent with the failed prefill leg (early) was dropped: nothing waits for params there
        for _ in range(120):
            if _metric(http.get(f"{pd['decode'].url}/metrics").text, "pdserve:num_requests_awaiting_kv_params") == 0:
                break
            time.sleep(0.25)
        else:
            raise AssertionError("a decode leg still waits for its params on the decode instance")
    finally:
        proxy.stop()


def test_1p1d_without_early_decode_leg_matches_collocated(pd: dict[str, Server]) -> None:
    """--no-early-decode-leg: the decode leg goes out once the prefill answered, with its params (the order
    vLLM decode instances always get)."""
    proxy = Server(
        [sys.executable, "-m", "pdserve", "proxy", "--host", "127.0.0.1", "--port", "0", "--prefill",
         pd["prefill"].url or "", "--decode", pd["decode"].url or "", "--no-early-decode-leg"],
        pd["proxy"].log.parent / "proxy-no-early.log",
    )
    try:
        proxy.wait_ready()
        for route, case, _ in CASES[1:3]:
            body = {"model": MODEL, "temperature": 0.0, **case}
            via_proxy = _text(route, http.post(f"{proxy.url}/v1/{route}", json=body))
            assert via_proxy == _text(route, http.post(f"{pd['prefill'].url}/v1/{route}", json=body)), route
        metrics = http.get(f"{proxy.url}/metrics").text
        assert _metric(metrics, 'pdserve_proxy_requests_total{path="disagg"}') == 2
        assert _metric(metrics, "pdserve_proxy_early_decode_legs_total") == 0
    finally:
        proxy.stop()
