"""Routing by cached prefix in P/D: two prefill instances and one decode instance, all publishing KV events,
real NIXL DRAM transfers, a tiny random model, everything on 127.0.0.1.

- The prefill leg goes to the prefill instance holding the prompt's prefix; greedy output is unchanged
  (the other prefill instance, asked directly, computes it from scratch).
- Conditional disaggregation counts only the uncached suffix: with --disagg-threshold-tokens 32, a long
  prompt whose prefix the decode instance holds is served there locally (conditional_local), a long prompt
  nobody holds goes P/D.
- Blocks a decode instance received over the transfer (and those it computed after them) are announced by
  its publisher, medium "GPU" (its own pool), so its snapshot and the proxy's index have them and a later
  prompt with that prefix is served there (llm-d-kv-cache PR #347: indexers lost track of decode instances
  because vLLM announces no event for received blocks).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import MODEL, PdserveProcess, ServerProcess, free_port, make_model_dir, metric_value

pytest.importorskip("zmq")
try:
    from pdserve.kv_transfer.nixl_agent import load_nixl

    load_nixl()
except Exception as exc:  # noqa: BLE001 - any failure to load NIXL means no P/D on this machine
    pytest.skip(f"NIXL not importable: {exc}", allow_module_level=True)

COMMON = ("--max-model-len", "512", "--num-gpu-blocks-override", "128", "--block-size", "16")
EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                     "replay_endpoint": "tcp://127.0.0.1:*", "snapshot_endpoint": "tcp://127.0.0.1:*"})
NIXL_ENV = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}
WORDS = ["alpha", "river", "stone", "cloud", "seven", "orange", "signal", "quiet", "market", "engine"]
PREFIX = " ".join(WORDS * 8)
LOCAL_PREFIX = " ".join(reversed(WORDS * 8))
FRESH_PREFIX = " ".join(WORDS[::2] * 16)
RECEIVED_PREFIX = " ".join(WORDS[1::2] * 16)
QUESTIONS = ["What comes next?", "Say one word.", "Count to three."]
http = httpx.Client(timeout=120.0)


def _instance(model: Path, log: Path, role: str, *extra: str) -> ServerProcess:
    kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": "fail"}
    return ServerProcess(model, log, *COMMON, "--kv-transfer-config", json.dumps(kv), "--kv-events-config", EVENTS,
                         *extra, env=NIXL_ENV)


def _proxy(root: Path, name: str, prefill: list[str], decode: str, *extra: str) -> PdserveProcess:
    port = free_port()
    return PdserveProcess(root / f"{name}.log", port, ["proxy", "--host", "127.0.0.1", "--port", str(port),
                                                        "--prefill", *prefill, "--decode", decode, *extra])


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PdserveProcess]]:
    root = tmp_path_factory.mktemp("kv-routing-pd")
    model = make_model_dir(root)
    procs: dict[str, PdserveProcess] = {}
    try:
        procs["p1"] = _instance(model, root / "p1.log", "kv_producer", "--side-channel-port", "0")
        procs["p2"] = _instance(model, root / "p2.log", "kv_producer", "--side-channel-port", "0")
        procs["d"] = _instance(model, root / "d.log", "kv_consumer")
        for p in procs.values():
            p.wait_ready()
        prefill = [procs["p1"].url, procs["p2"].url]
        procs["proxy"] = _proxy(root, "proxy", prefill, procs["d"].url, "--tokenizer", str(model))
        procs["proxy_cond"] = _proxy(root, "proxy-cond", prefill, procs["d"].url, "--tokenizer", str(model),
                                     "--disagg-threshold-tokens", "32")
        for name in ("proxy", "proxy_cond"):
            procs[name].wait_ready()
        yield procs
    finally:
        for p in reversed(list(procs.values())):
            p.stop()


def _instances(proxy: str) -> dict[str, dict[str, Any]]:
    listing = http.get(proxy + "/pdserve/instances").json()
    return {inst["url"]: inst for role in ("prefill", "decode") for inst in listing[role]}


def _wait(pred: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _complete(url: str, prompt: str) -> str:
    resp = http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                    "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_prefill_leg_goes_to_the_prefill_instance_holding_the_prefix(pd: dict[str, PdserveProcess]) -> None:
    proxy, p1, p2 = pd["proxy"].url, pd["p1"].url, pd["p2"].url
    _complete(p2, f"{PREFIX} warm up")  # P2 alone computes the prefix
    _wait(lambda: _instances(proxy)[p2]["kv_events"]["blocks"] >= 5, "P2's blocks in the index")
    before = _instances(proxy)
    texts = [_complete(proxy, f"{PREFIX} {q}") for q in QUESTIONS]
    after = _instances(proxy)
    assert after[p2]["requests_total"] - before[p2]["requests_total"] == len(QUESTIONS)
    assert after[p1]["requests_total"] == before[p1]["requests_total"]
    metrics = http.get(proxy + "/metrics").text
    assert metric_value(metrics, 'pdserve_proxy_kv_routed_requests_total{outcome="hit"}') == len(QUESTIONS)
    assert metric_value(metrics, 'pdserve_proxy_requests_total{path="disagg"}') == len(QUESTIONS)
    assert metric_value(metrics, "pdserve_proxy_kv_publishers") == 3
    assert texts == [_complete(p1, f"{PREFIX} {q}") for q in QUESTIONS]  # P1 computes every token


def test_conditional_disaggregation_counts_only_the_uncached_suffix(pd: dict[str, PdserveProcess]) -> None:
    proxy, d = pd["proxy_cond"].url, pd["d"].url
    _complete(d, f"{LOCAL_PREFIX} warm up")  # the decode instance holds this prefix
    _wait(lambda: _instances(proxy)[d]["kv_events"]["blocks"] >= 5, "D's blocks in the index")
    metrics = http.get(proxy + "/metrics").text
    local0 = metric_value(metrics, 'pdserve_proxy_requests_total{path="conditional_local"}')
    disagg0 = metric_value(metrics, 'pdserve_proxy_requests_total{path="disagg"}')
    d_requests = _instances(proxy)[d]["requests_total"]
    # ~80 prompt tokens, all but a few cached on D: below the threshold of 32 -> served by D locally
    local_text = _complete(proxy, f"{LOCAL_PREFIX} Name a colour.")
    # as long, nothing cached anywhere -> P/D
    _complete(proxy, f"{FRESH_PREFIX} Name a colour.")
    metrics = http.get(proxy + "/metrics").text
    assert metric_value(metrics, 'pdserve_proxy_requests_total{path="conditional_local"}') - local0 == 1
    assert metric_value(metrics, 'pdserve_proxy_requests_total{path="disagg"}') - disagg0 == 1
    assert _instances(proxy)[d]["requests_total"] - d_requests == 2  # the local one, then the decode leg
    assert local_text == _complete(pd["p1"].url, f"{LOCAL_PREFIX} Name a colour.")


def _decode_snapshot(d: str) -> dict[int, str]:
    """Block hash -> medium, as the decode instance's publisher holds them (its snapshot socket)."""
    import zmq

    from pdserve.kv_events.events import BlockStored, decode_batch

    info = http.get(d + "/pdserve/info").json()["kv_events"]
    req = zmq.Context.instance().socket(zmq.REQ)
    try:
        req.connect(info["snapshot_endpoint"])
        req.send(b"snapshot")
        assert req.poll(10_000)
        _, _, *chunks = req.recv_multipart()
    finally:
        req.close(linger=0)
    return {h: e.medium for c in chunks for e in decode_batch(c).events if isinstance(e, BlockStored)
            for h in e.block_hashes}


def test_blocks_the_decode_instance_received_are_announced_and_routable(pd: dict[str, PdserveProcess]) -> None:
    from pdserve.kv_events.block_hash import external_block_hashes

    proxy, d = pd["proxy_cond"].url, pd["d"].url
    prompt = f"{RECEIVED_PREFIX} Name a colour."
    ids = http.post(d + "/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
    received = external_block_hashes(ids[:-1], 16)  # what the READ brings: all but the last prompt token
    assert len(received) >= 4 and not set(received) & set(_decode_snapshot(d))
    metrics = http.get(proxy + "/metrics").text
    disagg0 = metric_value(metrics, 'pdserve_proxy_requests_total{path="disagg"}')
    local0 = metric_value(metrics, 'pdserve_proxy_requests_total{path="conditional_local"}')
    hits0 = metric_value(http.get(d + "/metrics").text, "vllm:prefix_cache_hits_total")
    _complete(proxy, prompt)  # nobody holds it: P/D, the decode instance reads the prompt's KV over NIXL
    assert metric_value(http.get(proxy + "/metrics").text, 'pdserve_proxy_requests_total{path="disagg"}') - disagg0 == 1
    held = _decode_snapshot(d)
    assert {held.get(h) for h in received} == {"GPU"}  # announced, in the decode instance's own pool
    _wait(lambda: _instances(proxy)[d]["kv_events"]["blocks"] >= len(held), "D's received blocks in the index")
    d_requests = _instances(proxy)[d]["requests_total"]
    # the same prefix again: the proxy knows D holds it, so the uncached suffix is below the threshold -> local
    text = _complete(proxy, f"{RECEIVED_PREFIX} Say one word.")
    metrics = http.get(proxy + "/metrics").text
    assert metric_value(metrics, 'pdserve_proxy_requests_total{path="conditional_local"}') - local0 == 1
    assert _instances(proxy)[d]["requests_total"] - d_requests == 1
    assert metric_value(http.get(d + "/metrics").text, "vllm:prefix_cache_hits_total") - hits0 >= 16 * (len(received) - 1)
    assert text == _complete(pd["p1"].url, f"{RECEIVED_PREFIX} Say one word.")
