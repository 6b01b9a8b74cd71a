"""Chaos on `pdserve up`: SIGKILL of the prefill instance, then of the decode instance, under a bounded load.

Real instances (a tiny model), the real proxy and launcher on 127.0.0.1. What must hold: the launcher does
not tear the deployment down but restarts each killed instance, which comes back; the deployment keeps
answering (every request gets an HTTP answer within its timeout: a 200, or a clean 5xx with an OpenAI error
body while an instance is down, and 200s again after each recovery); free KV blocks return to their
baseline on every instance (nothing leaked by the requests the kills broke); after teardown no process of
the deployment is left.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
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

from pdserve.launch.procs import pid_alive

STARTUP_S = 400  # bounds only: a loaded 2-core box can take minutes to import torch twice
REQUEST_TIMEOUT_S = 60.0  # the client's; the proxy answers 503 after --instance-wait-timeout (10 s) before
CLIENTS = 2
KV_SETTLE_S = 120.0  # a lease whose consumer died expires after kv_lease_duration (30 s)


@dataclass
class Outcome:
    started: float
    finished: float
    status: int  # 0: no HTTP answer (timeout, connection error)
    ok: bool  # a 200 with a complete answer
    detail: str


class Load:
    """CLIENTS threads sending completions (half of them streamed) through the proxy until stopped."""

    def __init__(self, proxy: str, model: str) -> None:
        self.proxy = proxy
        self.model = model
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _one(self, client: httpx.Client, i: int) -> Outcome:
        stream = i % 2 == 1
        body = {"model": self.model, "prompt": f"chaos request {i} " + "word " * 40, "max_tokens": 8,
                "stream": stream}
        t0 = time.monotonic()
        try:
            resp = client.post(self.proxy + "/v1/completions", json=body)
        except httpx.HTTPError as e:
            return Outcome(t0, time.monotonic(), 0, False, f"{type(e).__name__}: {e}")
        t1 = time.monotonic()
        if resp.status_code != 200:
            error = resp.json().get("error", {})  # an OpenAI error body, or this raises
            assert error.get("message"), resp.text
            return Outcome(t0, t1, resp.status_code, False, error["message"][:200])
        if stream:
            ok = resp.text.endswith("data: [DONE]\n\n") and '"error"' not in resp.text
            return Outcome(t0, t1, 200, ok, resp.text[-200:])
        return Outcome(t0, t1, 200, bool(resp.json()["choices"][0]["text"]), "")

    def _run(self, worker: int) -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            i = worker
            while not self._stop.is_set():
                outcome = self._one(client, i)
                with self._lock:
                    self.outcomes.append(outcome)
                i += CLIENTS
                if not outcome.ok:
                    time.sleep(0.2)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=REQUEST_TIMEOUT_S + 10)
        assert not any(t.is_alive() for t in self._threads), "a client is stuck past its timeout"

    def successes_after(self, t: float) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.ok and o.started >= t)


def wait_for(cond, timeout: float, what: str, step: float = 0.5) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ":
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def kv_idle(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    names = ("vllm:kv_cache_usage_perc", "pdserve:num_requests_held", "vllm:num_requests_running",
             "vllm:num_requests_waiting")
    return {name: metric(text, name) for name in names}


@pytest.fixture(scope="module")
def tiny(tiny_model_factory, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    src = tiny_model_factory("llama", vocab_size=49152)
    return tiny_model_with_tokenizer(src, tmp_path_factory.mktemp("chaos-model") / "tiny")


def test_sigkill_prefill_then_decode_under_load(tiny: Path, tmp_path: Path) -> None:
    up = Up([str(tiny), "--topology", "1p1d", "--port", "0", "--log-dir", str(tmp_path / "logs"),
             "--max-restarts", "3", "--serve-arg=--max-model-len 256",
             "--proxy-arg=--health-interval 1 --instance-wait-timeout 10"], cwd=tmp_path)
    pids: list[int] = []
    load: Load | None = None
    try:
        info = up.ready(STARTUP_S)
        pids = [int(p) for p in info["pids"].split(",")]
        pids += [p for p in children_of(up.proc.pid) if p not in pids]  # the watchdog
        prefill_pid, decode_pid = pids[0], pids[1]
        baseline = {url: kv_idle(url) for url in (info["prefill"], info["decode"])}
        assert all(v == {"vllm:kv_cache_usage_perc": 0.0, "pdserve:num_requests_held": 0.0,
                         "vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
                   for v in baseline.values()), baseline
        load = Load(info["proxy"], info["model"])
        load.start()
        t0 = time.monotonic()
        wait_for(lambda: load.successes_after(t0) >= 4, 120, "the first answers")

        for role, pid in (("prefill", prefill_pid), ("decode", decode_pid)):
            restarts_before = up.output.count(f"{role} ready again")
            up.proc.poll()
            assert up.proc.returncode is None, up.output
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda role=role, n=restarts_before: up.output.count(f"{role} ready again") > n, STARTUP_S,
                     f"{role} to be restarted and ready again:\n{up.output}")
            new_pid = int(up.wait_for(rf"{role} restarted \(pid (\d+)\)", 10).group(1))
            pids.append(new_pid)
            assert new_pid != pid and pid_alive(new_pid) and not pid_alive(pid)
            back = time.monotonic()
            wait_for(lambda back=back: load.successes_after(back) >= 4, 180,
                     f"answers after {role} came back:\n{up.output}")
        load.stop()

        out = up.output
        assert up.proc.poll() is None, out  # never torn down
        assert "crash loop" not in out
        for role in ("prefill", "decode"):
            assert f"pdserve up: {role} (pid" in out and "was killed by SIGKILL; restarting it in 1s" in out
        outcomes = load.outcomes
        assert all(o.finished - o.started <= REQUEST_TIMEOUT_S + 5 for o in outcomes)
        assert [o for o in outcomes if o.status == 0] == []  # every request got an HTTP answer
        assert {o.status for o in outcomes} <= {200, 500, 502, 503, 504}, [o for o in outcomes if not o.ok]
        assert sum(o.ok for o in outcomes) >= 12
        # The killed prefill's in-flight legs fell back to local prefill (counted, budgeted), not 502s.
        proxy_metrics = httpx.get(info["proxy"] + "/metrics", timeout=10).text
        assert metric(proxy_metrics, 'pdserve_proxy_requests_total{path="decode_local_fallback"}') >= 1

        # Free KV blocks back to baseline everywhere (the restarted instances start at it; the surviving
        # prefill frees the blocks leased to the killed decode once the lease expires).
        for url in (info["prefill"], info["decode"]):
            wait_for(lambda url=url: kv_idle(url) == baseline[url], KV_SETTLE_S,
                     f"KV blocks of {url} to return to baseline: {kv_idle(url)}")

        rc = up.stop(signal.SIGTERM)
        out = up.output
        assert rc == 0, out
        assert_all_gone(pids, ports_in(out))
        summary = {"requests": len(outcomes), "ok": sum(o.ok for o in outcomes),
                   "statuses": sorted({o.status for o in outcomes})}
        print(json.dumps(summary))
    finally:
        if load is not None:
            load.stop()
        up.kill()
        kill_leftovers(pids)
