"""KV events a fleet can trust, on real processes: two `pdserve serve` instances publishing with vLLM's snapshot
service (`snapshot_endpoint`), each under another PYTHONHASHSEED than the proxies (block hashes must not
depend on it), and `pdserve proxy` processes routing by their events.

- A proxy restarted after the instances' replay buffers have long wrapped (4 batches, heartbeats included)
  rebuilds its index from the snapshots: every instance's block count equals what its publisher holds, and
  requests for prefixes computed before the restart are routed to their holder (hits).
- A proxy that drops 50% of live event messages (PDSERVE_CHAOS_KV_EVENTS_DROP) sees every gap, resyncs from
  snapshots and converges to the publishers' state; routing still hits.
- A subscriber written from vLLM's documented frame layout and bootstrap (`docs/features/kv_events.md`,
  msgspec structs as vLLM declares them) installs a pdserve instance's snapshot and follows its live stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_utils import MODEL, PdserveProcess, ServerProcess, free_port, make_model_dir, metric_value

zmq = pytest.importorskip("zmq")
from test_kv_events import VLLM_DECODER, VAllBlocksCleared, VBlockRemoved, VBlockStored  # noqa: E402

from pdserve.kv_events.block_hash import external_block_hashes  # noqa: E402

BS = 16
EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
          "snapshot_endpoint": "tcp://127.0.0.1:*", "buffer_steps": 4}
http = httpx.Client(timeout=120.0)


def doc(i: int, n: int = 100) -> list[int]:
    return [(i * 37 + j * 11 + (j * j) % 7) % 250 + 3 for j in range(n)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("kv-fleet")
    model = make_model_dir(root)
    procs: dict[str, PdserveProcess] = {}
    try:
        for name, seed in (("a", "11"), ("b", "22")):
            procs[name] = ServerProcess(model, root / f"{name}.log", "--max-model-len", "512",
                                        "--num-gpu-blocks-override", "64", "--kv-events-config", json.dumps(EVENTS),
                                        env={"PYTHONHASHSEED": seed})
        for p in procs.values():
            p.wait_ready()
        yield {"procs": procs, "model": model, "root": root}
    finally:
        for p in procs.values():
            p.stop()


def _proxy(fleet: dict[str, Any], name: str, **env: str) -> PdserveProcess:
    port = free_port()
    urls = [fleet["procs"]["a"].url, fleet["procs"]["b"].url]
    return PdserveProcess(fleet["root"] / f"{name}.log", port, [
        "proxy", "--host", "127.0.0.1", "--port", str(port), "--decode", *urls, "--tokenizer", str(fleet["model"])],
        env={"PYTHONHASHSEED": "33", **env}).wait_ready()


def _complete(url: str, prompt: list[int]) -> None:
    r = http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def _info(url: str) -> dict[str, Any]:
    return http.get(f"{url}/pdserve/info").json()["kv_events"]


def _snapshot(url: str) -> tuple[int, bytes, set[int]]:
    """What an instance's publisher holds (GPU medium), asked straight from its snapshot socket."""
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    try:
        req.connect(_info(url)["snapshot_endpoint"])
        req.send(b"snapshot")
        assert req.poll(10_000), "no snapshot reply"
        seq, pid, *chunks = req.recv_multipart()
    finally:
        req.close(linger=0)
    held = {h for c in chunks for e in VLLM_DECODER.decode(c).events if isinstance(e, VBlockStored)
            and e.medium == "GPU" for h in e.block_hashes}
    return int.from_bytes(seq, "big", signed=True), pid, held


def _listing(proxy: str) -> dict[str, dict[str, Any]]:
    return {inst["url"]: inst for inst in http.get(proxy + "/pdserve/instances").json()["decode"]}


def _wait(pred: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _index_matches_publishers(proxy: str, urls: list[str]) -> bool:
    listing = _listing(proxy)
    return all(listing[u]["kv_events"]["connected"] and listing[u]["kv_events"]["blocks"] == len(_snapshot(u)[2])
               for u in urls)


def _routed_to_holder(proxy: str, holder: str, prompts: list[list[int]]) -> None:
    before = _listing(proxy)[holder]["requests_total"]
    hits = metric_value(http.get(proxy + "/metrics").text, 'pdserve_proxy_kv_routed_requests_total{outcome="hit"}')
    for p in prompts:
        _complete(proxy, p)
    assert _listing(proxy)[holder]["requests_total"] - before == len(prompts)
    after = metric_value(http.get(proxy + "/metrics").text, 'pdserve_proxy_kv_routed_requests_total{outcome="hit"}')
    assert after - hits == len(prompts)


def test_a_restarted_proxy_rebuilds_its_index_from_snapshots(fleet: dict[str, Any]) -> None:
    a, b = fleet["procs"]["a"].url, fleet["procs"]["b"].url
    for i in (0, 1):
        _complete(a, doc(i))
    for i in (2, 3):
        _complete(b, doc(i))
    time.sleep(5)  # heartbeats: the 4-batch replay buffers no longer hold any store
    first = _proxy(fleet, "proxy-1")
    try:
        _wait(lambda: _index_matches_publishers(first.url, [a, b]), "the first proxy's index")
        _routed_to_holder(first.url, a, [doc(0) + [5, 6, 7]])
    finally:
        first.stop()
    second = _proxy(fleet, "proxy-2")
    try:
        _wait(lambda: _index_matches_publishers(second.url, [a, b]), "the restarted proxy's index")
        _routed_to_holder(second.url, a, [doc(1) + [9, 9, 9]])
        _routed_to_holder(second.url, b, [doc(2) + [8, 8], doc(3) + [4]])
        metrics = http.get(second.url + "/metrics").text
        assert metric_value(metrics, "pdserve_proxy_kv_snapshots_total") == 2  # one per instance
        assert metric_value(metrics, "pdserve_proxy_kv_routing_hit_rate") == 1.0
    finally:
        second.stop()


def test_dropped_event_messages_are_resynced_from_snapshots(fleet: dict[str, Any]) -> None:
    a, b = fleet["procs"]["a"].url, fleet["procs"]["b"].url
    proxy = _proxy(fleet, "proxy-lossy", PDSERVE_CHAOS_KV_EVENTS_DROP="0.5")
    try:
        _wait(lambda: _index_matches_publishers(proxy.url, [a, b]), "the lossy proxy's first snapshots")
        for i in range(10, 20):  # 10 documents of 6 blocks into 64-block pools: stores and evictions
            _complete(a if i % 2 else b, doc(i))
        _wait(lambda: _index_matches_publishers(proxy.url, [a, b]), "the lossy proxy's index to converge")
        metrics = http.get(proxy.url + "/metrics").text
        assert metric_value(metrics, "pdserve_proxy_kv_events_dropped_total") > 0
        assert metric_value(metrics, 'pdserve_proxy_kv_resyncs_total{kind="snapshot"}') > 0
        # every block the proxy counts is one the publisher holds (not just as many)
        _routed_to_holder(proxy.url, a, [doc(19) + [3]])
        _routed_to_holder(proxy.url, b, [doc(18) + [3]])
    finally:
        proxy.stop()


def test_a_vllm_format_subscriber_installs_the_snapshot_and_follows_live(fleet: dict[str, Any]) -> None:
    """The bootstrap exactly as vLLM's docs give it, with vLLM's msgspec structs for the payloads."""
    a = fleet["procs"]["a"].url
    info = _info(a)
    _complete(a, doc(30))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    req = ctx.socket(zmq.REQ)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, info["topic"].encode())
        sub.connect(info["endpoint"])
        # 1. a live message (an idle instance's heartbeat) before asking: the subscription delivers
        assert sub.poll(10_000), "no heartbeat from an idle publisher"
        buffered = []

        def read() -> tuple[bytes, int, bytes]:
            _, frame, payload = sub.recv_multipart()
            assert len(frame) == 24  # seq + publisher identity
            return frame[8:], int.from_bytes(frame[:8], "big"), payload

        buffered.append(read())
        # 2. keep buffering while the snapshot request is out
        req.connect(info["snapshot_endpoint"])
        req.send(b"snapshot")
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(req, zmq.POLLIN)
        reply = None
        while reply is None:
            ready = dict(poller.poll(10_000))
            assert ready, "no snapshot reply"
            if sub in ready:
                buffered.append(read())
            if req in ready:
                reply = req.recv_multipart()
        assert len(reply[0]) == 8 and len(reply[1]) == 16
        seq, pid = int.from_bytes(reply[0], "big", signed=True), reply[1]
        assert seq >= 0 and buffered[-1][0] == pid
        # 3. a private index from the chunks, in order
        index: set[int] = set()

        def apply(payload: bytes) -> None:
            for e in VLLM_DECODER.decode(payload).events:
                if isinstance(e, VBlockStored):
                    index.update(e.block_hashes)
                elif isinstance(e, VBlockRemoved):
                    index.difference_update(e.block_hashes)
                elif isinstance(e, VAllBlocksCleared):
                    index.clear()

        for chunk in reply[2:]:
            apply(chunk)
        assert set(external_block_hashes(doc(30), BS)) <= index  # computed before we subscribed
        # 4. the buffered suffix: same identity, consecutive from seq + 1
        expected = seq + 1
        for p, s, payload in buffered:
            if s <= seq:
                continue
            assert p == pid and s == expected
            apply(payload)
            expected += 1
        # 5. follow live: consecutive, same identity; a new prompt's blocks arrive
        _complete(a, doc(31))
        want = set(external_block_hashes(doc(31), BS)[:5])
        deadline = time.monotonic() + 30
        while not want <= index:
            assert time.monotonic() < deadline and sub.poll(5000), "the new prompt's blocks never came"
            p, s, payload = read()
            assert p == pid and s == expected
            apply(payload)
            expected += 1
    finally:
        sub.close(linger=0)
        req.close(linger=0)
