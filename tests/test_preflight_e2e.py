"""`pdserve preflight` against real deployments: a healthy 1P1D started with `pdserve up --demo`, and broken
ones (a dead instance, a prefill with another block size, a threshold the measured transfers exceed).

The module's deployment is also the 1P1D lifecycle test of `pdserve up`: demo output, the endpoint, then
SIGTERM, every child gone by PID and every port free.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from launch_helpers import (
    Up,
    assert_all_gone,
    children_of,
    kill_leftovers,
    ports_in,
    tiny_model_with_tokenizer,
)
from server_utils import free_port

from pdserve.api.pd import build_decode_body, build_prefill_body
from pdserve.launch import procs as launch_procs
from pdserve.launch.spec import ProcSpec, kv_transfer_config

STARTUP_S = 400


@dataclass
class Deployment:
    up: Up
    info: dict[str, str]
    logs: Path
    odd_prefill: str  # a producer started with --block-size 8
    failing_decode: str  # a consumer whose KV handshakes time out (every transfer fails)


@pytest.fixture(scope="module")
def deployment(tiny_model_factory, tmp_path_factory) -> Iterator[Deployment]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("preflight")
    model = tiny_model_with_tokenizer(tiny_model_factory("llama", vocab_size=49152), root / "tiny")
    logs = root / "logs"
    # two odd instances load while `pdserve up` starts its own
    failing_kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                             "kv_connector_extra_config": {"handshake_timeout_s": 1e-6, "transfer_timeout_s": 1e-6}})
    extra = []
    for name, role, args in (("odd-prefill", "prefill", ["--block-size", "8", "--kv-transfer-config",
                                                         kv_transfer_config("prefill", "fail")]),
                             ("failing-decode", "decode", ["--kv-transfer-config", failing_kv])):
        port, side = free_port(), free_port()
        extra.append(launch_procs.start(ProcSpec(
            name, role,
            [sys.executable, "-m", "pdserve", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
             *args, "--side-channel-host", "127.0.0.1", "--side-channel-port", str(side)],
            {}, "127.0.0.1", port, root / f"{name}.log",
        )))
    up = Up([str(model), "--port", "0", "--demo", "--demo-max-tokens", "8", "--log-dir", str(logs)], cwd=root)
    pids: list[int] = []
    try:
        info = up.ready(STARTUP_S)
        listed = [int(p) for p in info["pids"].split(",")]
        pids = listed + [p for p in children_of(up.proc.pid) if p not in listed]  # + the watchdog
        up.wait_for(r"^serving; Ctrl-C stops everything", STARTUP_S)
        ready = launch_procs.wait_ready(extra, STARTUP_S, stopping=lambda: False, report=lambda _: None)
        assert ready.ok, [launch_procs.tail(c.spec.log_path) for c in extra]
        yield Deployment(up, info, logs, extra[0].spec.url, extra[1].spec.url)
        # teardown is part of the lifecycle test: SIGTERM, clean exit, nothing left
        rc = up.stop(signal.SIGTERM)
        assert rc == 0, up.output
        assert up.output.rstrip().endswith("stopped.")
        assert_all_gone(pids, ports_in(up.output))
    finally:
        assert launch_procs.stop_all(extra, timeout=15) == []
        up.kill()
        kill_leftovers(pids)


def _preflight(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve", "preflight", *args], capture_output=True, text=True,
                          timeout=300)


def _rows(out: subprocess.CompletedProcess[str]) -> dict[str, dict[str, object]]:
    data = json.loads(out.stdout)
    return {c["name"]: c for c in data["checks"]}


def test_up_1p1d_demo_and_endpoint(deployment: Deployment) -> None:
    out = deployment.up.output
    info = deployment.info
    assert re.search(r"^  prefill +http://127\.0\.0\.1:\d+ +\(CPUs? [\d,-]+, side channel :\d+\)", out, re.M), out
    assert re.search(r"^answer: The three primary colours are\S*.+", out, re.M), out
    assert re.search(r"^TTFT: \d+\.\d ms; total \d+\.\d ms, 8 tokens", out, re.M), out
    assert re.search(r"^KV Transfer metrics \(from .*/metrics\): Num successful transfers=1, ", out, re.M), out
    assert re.search(r"^decode\.log: .*KV Transfer metrics: Num successful transfers=1", out, re.M), out
    listing = httpx.get(info["proxy"] + "/pdserve/instances", timeout=10).json()
    assert [i["url"] for i in listing["prefill"]] == [info["prefill"]]
    assert [i["url"] for i in listing["decode"]] == [info["decode"]]
    r = httpx.post(info["proxy"] + "/v1/completions", timeout=120,
                   json={"model": info["model"], "prompt": "Say hello.", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    for name in ("prefill.log", "decode.log", "proxy.log"):
        assert (deployment.logs / name).stat().st_size > 0


def test_preflight_go_on_healthy_1p1d(deployment: Deployment) -> None:
    out = _preflight("--proxy", deployment.info["proxy"], "--json", "--long-prompts", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = _rows(out)
    assert {k: v["status"] for k, v in rows.items()} == {
        "instances": "pass", "versions/configs": "pass", "gpu p2p": "skip", "ucx transport": "skip",
        "short request": "pass", "kv transfer time": "pass", "leases/failures": "pass",
    }
    kv = rows["kv transfer time"]["data"]
    assert isinstance(kv, dict) and kv["transfers"] == 2 and kv["bandwidth"] == "cpu-dram"
    assert kv["prompt_tokens"] == 1020  # 1024 capped by the tiny model's max_model_len
    # the measured bytes agree with the KV arithmetic (2 layers x 2 x 2 heads x 16 x 4 B), block-rounded
    assert kv["bytes_per_token"] == 512 and 0.9 < kv["avg_bytes"] / kv["arithmetic_bytes_per_prompt"] < 1.1
    assert "CPU" in str(rows["gpu p2p"]["detail"])
    assert json.loads(out.stdout)["verdict"] == "go"


def test_preflight_go_after_client_mistakes_and_an_earlier_failure(deployment: Deployment) -> None:
    """Forged params are the client's 4xx, not failed transfers; a transport failure before preflight ran is
    reported, not judged (preflight looks at counter deltas over its own run)."""
    info = deployment.info
    prefill, decode = info["prefill"], info["decode"]
    # `pdserve up` gave the instances a KV side-channel secret, by environment only
    assert httpx.get(prefill + "/pdserve/info", timeout=10).json()["side_channel_auth"] is True
    pids = [int(p) for p in info["pids"].split(",")]
    secrets_seen, cmdlines = set(), b""
    for pid in pids:
        with suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            secrets_seen |= {e.split(b"=", 1)[1] for e in env if e.startswith(b"PDSERVE_KV_SECRET=")}
            cmdlines += Path(f"/proc/{pid}/cmdline").read_bytes()
    assert len(secrets_seen) == 1 and secrets_seen.pop() not in cmdlines + deployment.up.output.encode()

    body = {"model": info["model"], "prompt": "Say hello twice.", "max_tokens": 2, "temperature": 0}
    leg = httpx.post(prefill + "/v1/completions", timeout=120, json=build_prefill_body(body))
    params = leg.json()["kv_transfer_params"]
    for bad, status in (({**params, "remote_lease_token": "forged-" + "y" * 24}, 400),
                        ({**params, "remote_request_id": "cmpl-made-up"}, 410)):
        r = httpx.post(decode + "/v1/completions", timeout=120, json=build_decode_body(body, bad))
        assert r.status_code == status and r.json()["error"]["param"] == "kv_transfer_params", r.text
    # a real transport failure (nothing listens where these params point), before preflight runs
    dead = {**params, "remote_port": free_port()}
    r = httpx.post(decode + "/v1/completions", timeout=120, json=build_decode_body(body, dead))
    assert r.status_code == 500, r.text
    ok = httpx.post(decode + "/v1/completions", timeout=120, json=build_decode_body(body, params))
    assert ok.status_code == 200, ok.text  # the lease is consumed: nothing expires later
    out = _preflight("--proxy", info["proxy"], "--json", "--long-prompts", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    row = _rows(out)["leases/failures"]
    assert row["status"] == "pass" and "before it, not judged" in str(row["detail"]), row
    assert "nixl_num_failed_transfers" in str(row["detail"]) and json.loads(out.stdout)["verdict"] == "go"


def test_preflight_flags_slow_transfers(deployment: Deployment) -> None:
    out = _preflight("--proxy", deployment.info["proxy"], "--long-prompts", "1", "--slow-factor", "0.001")
    assert out.returncode == 1, out.stdout + out.stderr
    lines = {ln.split()[1]: ln for ln in out.stdout.splitlines() if ln.startswith("  ")}
    assert lines["kv"].split()[0] == "FAIL" and "the KV path is slow" in lines["kv"]
    assert [ln.split()[0] for k, ln in lines.items() if k != "kv"].count("FAIL") == 0, out.stdout
    assert "NO-GO: fix kv transfer time first" in out.stdout


def test_preflight_dead_instance(deployment: Deployment) -> None:
    out = _preflight("--prefill", f"127.0.0.1:{free_port()}", "--decode", deployment.info["decode"], "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    rows = _rows(out)
    assert rows["instances"]["status"] == "fail" and "unreachable" in str(rows["instances"]["detail"])
    assert rows["short request"]["status"] == "fail"
    assert json.loads(out.stdout)["verdict"] == "no-go"


def test_preflight_block_size_mismatch(deployment: Deployment) -> None:
    out = _preflight("--prefill", deployment.odd_prefill, "--decode", deployment.info["decode"], "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    rows = _rows(out)
    assert rows["instances"]["status"] == "pass"
    row = rows["versions/configs"]
    assert row["status"] == "fail" and "block_size differs" in str(row["detail"])
    assert "=8" in str(row["detail"]) and "=128" in str(row["detail"])  # 128: the CPU default
    # no request was sent between the mismatched pair: the decode's counters stay clean
    assert rows["short request"]["status"] == "skip" and rows["leases/failures"]["status"] == "pass"


def test_preflight_decode_with_failing_transfers(deployment: Deployment) -> None:
    """Last in the module: the main prefill's lease for the failed request expires 30 s later."""
    out = _preflight("--prefill", deployment.info["prefill"], "--decode", deployment.failing_decode, "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    rows = _rows(out)
    assert rows["instances"]["status"] == "pass" and rows["versions/configs"]["status"] == "pass"
    assert rows["short request"]["status"] == "fail" and "handshake" in str(rows["short request"]["detail"])
    row = rows["leases/failures"]
    assert row["status"] == "fail" and "nixl_num_failed_transfers +1 during preflight" in str(row["detail"])
