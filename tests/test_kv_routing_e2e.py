"""Routing by cached prefix with real servers: two `pdserve serve` instances publishing KV events
(`--kv-events-config`, vLLM's ZMQ wire format) behind `pdserve proxy` (collocated), a tiny random model,
everything on 127.0.0.1.

- A prompt whose prefix only instance B holds is sent to B (the proxy's routing hit counter and B's own
  request count), by a proxy that tokenizes locally (`--tokenizer`) and by one that asks `/tokenize`;
  for completions and for chat (the chat template applied as the instances apply it).
- Greedy outputs are unchanged: the same requests sent to A (which computes every token) give the same text.
- B killed with SIGKILL leaves the index (its ZMQ connection drops) and its requests go to A.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import MODEL, PdserveProcess, ServerProcess, free_port, make_model_dir, metric_value

pytest.importorskip("zmq")

COMMON = ("--max-model-len", "512", "--num-gpu-blocks-override", "128", "--block-size", "16")
EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                     "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"})
WORDS = ["alpha", "river", "stone", "cloud", "seven", "orange", "signal", "quiet", "market", "engine"]
PREFIX = " ".join(WORDS * 8)  # ~80 tokens: several full blocks of 16
SYSTEM = "You are a terse assistant. " + " ".join(reversed(WORDS * 6))
QUESTIONS = ["What comes next?", "Say one word.", "Count to three.", "Name a colour."]
http = httpx.Client(timeout=120.0)


def _proxy(root: Path, name: str, *urls: str, tokenizer: Path | None) -> PdserveProcess:
    port = free_port()
    args = ["proxy", "--host", "127.0.0.1", "--port", str(port), "--decode", *urls, "--health-interval", "1"]
    if tokenizer is not None:
        args += ["--tokenizer", str(tokenizer)]
    return PdserveProcess(root / f"{name}.log", port, args)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("kv-routing")
    model = make_model_dir(root)
    procs: dict[str, PdserveProcess] = {}
    try:
        for name in ("a", "b"):
            procs[name] = ServerProcess(model, root / f"{name}.log", *COMMON, "--kv-events-config", EVENTS)
        for p in procs.values():
            p.wait_ready()
        urls = [procs["a"].url, procs["b"].url]
        procs["proxy_local"] = _proxy(root, "proxy-local", *urls, tokenizer=model)
        procs["proxy_remote"] = _proxy(root, "proxy-remote", *urls, tokenizer=None)
        for name in ("proxy_local", "proxy_remote"):
            procs[name].wait_ready()
        yield {"procs": procs, "model": model}
    finally:
        for p in reversed(list(procs.values())):
            p.stop()


def _listing(proxy: str) -> dict[str, dict[str, Any]]:
    return {inst["url"]: inst for inst in http.get(proxy + "/pdserve/instances").json()["decode"]}


def _wait(pred: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _generate(url: str, route: str, body: dict[str, Any]) -> str:
    resp = http.post(f"{url}/v1/{route}", json={"model": MODEL, "temperature": 0, "max_tokens": 8, **body})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["text"] if route == "completions" else choice["message"]["content"]


def _bodies() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = [("completions", {"prompt": f"{PREFIX} {q}"}) for q in QUESTIONS]
    out += [("chat/completions", {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]})
            for q in QUESTIONS]
    return out


def test_routes_to_the_instance_holding_the_prefix_and_output_is_unchanged(fleet: dict[str, Any]) -> None:
    procs = fleet["procs"]
    a, b = procs["a"].url, procs["b"].url
    # B alone computes the shared prefixes (one request each, straight to it)
    _generate(b, "completions", {"prompt": f"{PREFIX} warm up"})
    _generate(b, "chat/completions", {"messages": [{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": "warm up"}]})
    for proxy in (procs["proxy_local"].url, procs["proxy_remote"].url):
        _wait(lambda p=proxy: _listing(p)[b]["kv_events"]["blocks"] >= 5, "B's blocks in the proxy's index")
        assert _listing(proxy)[a]["kv_events"] == {"subscribed": True, "connected": True, "blocks": 0}

    routed: dict[str, list[str]] = {}
    for proxy in (procs["proxy_local"].url, procs["proxy_remote"].url):
        before = _listing(proxy)
        routed[proxy] = [_generate(proxy, route, body) for route, body in _bodies()]
        after = _listing(proxy)
        n = len(_bodies())
        assert after[b]["requests_total"] - before[b]["requests_total"] == n, (proxy, after)
        assert after[a]["requests_total"] == before[a]["requests_total"]
        metrics = http.get(proxy + "/metrics").text
        assert metric_value(metrics, 'pdserve_proxy_kv_routed_requests_total{outcome="hit"}') == n
        assert metric_value(metrics, "pdserve_proxy_kv_routing_hit_rate") == 1.0
        assert metric_value(metrics, "pdserve_proxy_kv_events_total") > 0
        assert metric_value(metrics, "pdserve_proxy_kv_index_blocks") >= 5
        assert metric_value(metrics, "pdserve_proxy_kv_publishers") == 2

    # the prefix really was reused on B (its own prefix cache counters), and the text is what A computes
    # from scratch
    b_metrics = http.get(b + "/metrics").text
    assert metric_value(b_metrics, "vllm:prefix_cache_hits_total") > 0
    reference = [_generate(a, route, body) for route, body in _bodies()]
    for texts in routed.values():
        assert texts == reference


def test_sigkilled_instance_leaves_the_index_and_its_requests_go_elsewhere(fleet: dict[str, Any]) -> None:
    procs = fleet["procs"]
    a, b = procs["a"].url, procs["b"].url
    proxy = procs["proxy_local"].url
    _generate(b, "completions", {"prompt": f"{PREFIX} before the kill"})
    _wait(lambda: _listing(proxy)[b]["kv_events"]["blocks"] >= 5, "B's blocks in the index")
    os.kill(procs["b"].proc.pid, signal.SIGKILL)
    procs["b"].proc.wait(10)
    killed = time.monotonic()
    # the ZMQ connection drops at once: B's entries go before the health checker even ejects it
    _wait(lambda: _listing(proxy)[b]["kv_events"]["blocks"] == 0, "B's entries to leave the index", timeout=10)
    assert time.monotonic() - killed < 10
    _wait(lambda: not _listing(proxy)[b]["healthy"], "B's ejection", timeout=20)
    _wait(lambda: _listing(proxy)[b]["kv_events"]["subscribed"] is False, "B's unsubscription", timeout=5)
    before = _listing(proxy)[a]["requests_total"]
    for q in QUESTIONS:  # prompts whose prefix only B held: now served by A
        assert _generate(proxy, "completions", {"prompt": f"{PREFIX} {q}"})
    assert _listing(proxy)[a]["requests_total"] - before == len(QUESTIONS)
    metrics = http.get(proxy + "/metrics").text
    assert metric_value(metrics, 'pdserve_proxy_kv_resyncs_total{kind="reset"}') >= 1
