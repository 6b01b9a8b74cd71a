"""Fleet features at the product defaults, as a user types them: no block-size, pool or topic flags (the CPU
default block of 128 tokens, the default 1 GiB pool), everything on 127.0.0.1.

- `test_events_and_routing_through_proxy`: two `pdserve serve` instances with vLLM's documented
  `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:PORT"}'`,
  one tensor-parallel (TP=2), one with an fp8 KV cache and a host-memory tier (`--kv-offloading-size`),
  behind `pdserve proxy` with no routing flags. A plain ZMQ SUB socket per instance (subscribed to
  everything, as vLLM's example subscriber) receives the batches and decodes them with current vLLM's
  msgspec declarations; the second request of each shared ~700-token prefix lands on the instance holding
  it (cached_tokens > 0), the proxy counting routing hits, also for a prefix computed before the proxy
  started (learnt from the replay socket a bound endpoint gets by default).
- `test_up_collocated_2_routes_without_flags`: `pdserve up MODEL --topology collocated:2` with no flag routes
  the second request of a shared prefix to the instance holding it.
- `test_up_ray_local_serves_on_loopback_only`: the same under `pdserve up --ray local --port X`, which
  answers on 127.0.0.1:X while no process of the deployment, Ray's included, listens on another address.
- `test_up_1p1d_kv_history_reads_back_and_says_so`: `pdserve up MODEL --topology 1p1d --kv-history`, a
  two-turn conversation: turn 2's prefill reads turn 1's prompt and answer back from the decode instance,
  and the answer says what was decided (`kv_transfer_params.kv_history`, `X-PDServe-KV-History`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from launch_helpers import Up, descendants, kill_leftovers, listening_addresses
from server_utils import MODEL, PdserveProcess, free_port, make_model_dir, metric_value
from test_kv_events import VLLM_DECODER, VBlockStored

from pdserve.kv_events.block_hash import external_block_hashes
from pdserve.launch.ray_cli import RAY_LOOPBACK_ENV

BLOCK = 128  # the CPU default block size: the prompts below are sized in it
PREFIX_TOKENS = 5 * BLOCK  # ~700-token prompts sharing 640 tokens
SUFFIX_TOKENS = 60
STARTUP_S = 240.0
http = httpx.Client(timeout=180.0)


def _documented_events_config(port: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"})


def _prompts(seed: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing a PREFIX_TOKENS prefix, with different suffixes."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 49_000) for _ in range(PREFIX_TOKENS)]
    return ([*prefix, *(rng.randrange(100, 49_000) for _ in range(SUFFIX_TOKENS))],
            [*prefix, *(rng.randrange(100, 49_000) for _ in range(SUFFIX_TOKENS))])


def _complete(url: str, prompt: list[int], model: str = MODEL) -> dict[str, Any]:
    resp = http.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2,
                                                      "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _cached(resp: dict[str, Any]) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def _wait_indexed(proxy: str, blocks: int, timeout: float = 30.0) -> None:
    """Until the proxy's index holds at least `blocks` blocks (the events arrive asynchronously)."""
    deadline = time.monotonic() + timeout
    have = 0.0
    while time.monotonic() < deadline:
        have = metric_value(http.get(f"{proxy}/metrics").text, "pdserve_proxy_kv_index_blocks")
        if have >= blocks:
            return
        time.sleep(0.1)
    raise AssertionError(f"the proxy's KV index holds {have} blocks, expected {blocks}")


def _routes_shared_prefixes(proxy: str, firsts: dict[int, str | None], model: str = MODEL) -> None:
    """For each seed, the first prompt sent to the given URL (an instance or the proxy), then the second
    through the proxy: it is served from the cache of the instance holding the shared prefix."""
    indexed = 0
    for seed, where in firsts.items():
        first, second = _prompts(seed)
        if where is not None:  # None: sent before the proxy started (it learns those blocks by replay)
            _complete(where, first, model)
        indexed += (len(first) - 1) // BLOCK
        _wait_indexed(proxy, indexed)
        cached = _cached(_complete(proxy, second, model))
        assert cached == PREFIX_TOKENS, f"prefix {seed}: {cached} cached tokens, expected {PREFIX_TOKENS}"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("fleet-defaults"), max_position_embeddings=1024)


def _serve(root: Path, name: str, model: Path, events_port: int, *args: str) -> PdserveProcess:
    port = free_port()
    return PdserveProcess(root / f"{name}.log", port, [
        "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL,
        "--disable-uvicorn-access-log", "--kv-events-config", _documented_events_config(events_port), *args])


@pytest.fixture(scope="module")
def fleet(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("fleet")
    events = {"tp": free_port(), "fp8": free_port()}
    procs = {"tp": _serve(root, "tp", model, events["tp"], "--tensor-parallel-size", "2"),
             "fp8": _serve(root, "fp8", model, events["fp8"], "--kv-cache-dtype", "fp8",
                           "--kv-offloading-size", "0.25")}
    ctx = zmq.Context()
    subs: dict[str, zmq.Socket] = {}
    try:
        for p in procs.values():
            p.wait_ready(STARTUP_S)
        for name, proc in procs.items():
            info = http.get(f"{proc.url}/pdserve/info").json()
            assert info["block_size"] == BLOCK
            assert info["kv_events"]["endpoint"] == f"tcp://127.0.0.1:{events[name]}", info["kv_events"]
            sub = subs[name] = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")  # everything, whatever the topic
            sub.connect(info["kv_events"]["endpoint"])
        # a prefix computed before any router subscribed: the proxy learns it from the replay socket
        _complete(procs["tp"].url, _prompts(3)[0])
        port = free_port()
        procs["proxy"] = PdserveProcess(root / "proxy.log", port, [
            "proxy", "--host", "127.0.0.1", "--port", str(port), "--decode", procs["tp"].url, procs["fp8"].url])
        procs["proxy"].wait_ready(STARTUP_S)
        yield {"procs": procs, "subs": subs}
    finally:
        for s in subs.values():
            s.close(linger=0)
        ctx.term()
        for p in reversed(list(procs.values())):
            p.stop()


def _drain(sub: zmq.Socket) -> list[Any]:
    batches = []
    while sub.poll(200):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"" and len(seq) == 8
        batches.append(VLLM_DECODER.decode(payload))
    return batches


def test_events_and_routing_through_proxy(fleet: dict[str, Any]) -> None:
    procs, proxy = fleet["procs"], fleet["procs"]["proxy"].url
    deadline = time.monotonic() + 30
    while http.get(f"{proxy}/metrics").text.count("pdserve_proxy_kv_publishers 2") == 0:
        assert time.monotonic() < deadline, "the proxy did not subscribe to both instances"
        time.sleep(0.2)
    # a prefix computed before the proxy started, one first computed on each instance directly, then one
    # first routed by the proxy
    firsts = {3: None, 0: procs["tp"].url, 1: procs["fp8"].url, 2: proxy}
    _routes_shared_prefixes(proxy, firsts)
    metrics = http.get(f"{proxy}/metrics").text
    assert metric_value(metrics, 'pdserve_proxy_kv_routed_requests_total{outcome="hit"}') == len(firsts), metrics
    # (seed 3 went out right after the subscribers connected: a subscription reaches a PUB socket
    # asynchronously, so a plain subscriber may miss that first batch; the proxy got it by replay)
    seeds = [seed for seed, where in firsts.items() if where is not None]
    # a plain vLLM-format subscriber saw every full block each instance stored, in blocks of 128
    stored: set[int] = set()
    for name, sub in fleet["subs"].items():
        batches = _drain(sub)
        events = [e for b in batches for e in b.events]
        assert batches and all(b.data_parallel_rank == 0 for b in batches), name
        assert all(e.block_size == BLOCK and e.medium == "GPU" and len(e.token_ids) == BLOCK * len(e.block_hashes)
                   for e in events if isinstance(e, VBlockStored)), name
        stored |= {h for e in events if isinstance(e, VBlockStored) for h in e.block_hashes}
    for seed in seeds:
        for prompt in _prompts(seed):
            assert set(external_block_hashes(prompt, BLOCK)) <= stored, seed


@contextmanager
def _up(model: Path, tmp_path: Path, *args: str) -> Iterator[str]:
    """`pdserve up MODEL ARGS` until the block ends; yields its proxy's URL."""
    up = Up([str(model), *args, "--port", "0", "--log-dir", str(tmp_path / "logs")], cwd=tmp_path)
    pids: list[int] = []
    try:
        info = up.ready(STARTUP_S)
        pids = [int(p) for p in info["pids"].split(",")]
        yield info["proxy"]
    finally:
        up.kill()
        kill_leftovers(pids)


def _wait_subscribed(proxy: str, count: int = 2, timeout: float = 60.0) -> None:
    """Until the proxy subscribes to the KV events of `count` instances of its decode pool."""
    deadline = time.monotonic() + timeout
    while True:
        listing = http.get(f"{proxy}/pdserve/instances").json()["decode"]
        if len(listing) == count and all(i["kv_events"]["subscribed"] for i in listing):
            return
        assert time.monotonic() < deadline, f"the proxy did not subscribe to {count} instances: {listing}"
        time.sleep(0.2)


def test_up_collocated_2_routes_without_flags(model: Path, tmp_path: Path) -> None:
    with _up(model, tmp_path, "--topology", "collocated:2") as proxy:
        _wait_subscribed(proxy)
        _routes_shared_prefixes(proxy, {10: proxy, 11: proxy}, model=str(model))


def test_up_ray_local_serves_on_loopback_only(model: Path, tmp_path: Path) -> None:
    """`pdserve up --ray local --port X`: the proxy answers on 127.0.0.1:X, and no process of the deployment
    (Ray's GCS, raylet and workers, the actors, the instances, their KV events sockets, the proxy) listens
    on any other address. collocated:2 with no flag also routes by cached prefix under Ray."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'pdserve[ray]')")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != RAY_LOOPBACK_ENV}  # as a user's shell has it
    up = Up([str(model), "--ray", "local", "--topology", "collocated:2", "--port", str(port), "--cpus-per-instance",
             "0.5", "--log-dir", str(tmp_path / "logs")], cwd=tmp_path, env=env)
    pids: list[int] = []
    try:
        info = up.ready(STARTUP_S)
        pids = descendants(up.proc.pid)
        proxy = f"http://127.0.0.1:{port}"
        assert info["proxy"] == proxy, info
        _wait_subscribed(proxy)
        _routes_shared_prefixes(proxy, {20: proxy}, model=str(model))
        bound = listening_addresses(descendants(up.proc.pid))
        everything = {a for addrs in bound.values() for a in addrs}
        assert (("127.0.0.1", port) in everything) and len(everything) > 5, bound
        assert {addr for addr, _ in everything} == {"127.0.0.1"}, {p: a for p, a in bound.items() if a}
        assert up.stop(signal.SIGTERM, timeout=120) == 0, up.output
    finally:
        up.kill()
        kill_leftovers(pids)


def test_up_1p1d_kv_history_reads_back_and_says_so(model: Path, tmp_path: Path) -> None:
    with _up(model, tmp_path, "--topology", "1p1d", "--kv-history") as proxy:
        rng = random.Random(7)
        prompt = [rng.randrange(100, 49_000) for _ in range(300)]
        body = {"model": str(model), "max_tokens": 130, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        first = http.post(f"{proxy}/v1/completions", json={**body, "prompt": prompt})
        assert first.status_code == 200, first.text
        assert first.headers["X-PDServe-KV-History"] == "decision=none; reason=no_history; prefill_cached_tokens=0"
        assert "kv_history" not in first.json()["kv_transfer_params"]  # the held history's params only
        history = prompt + first.json()["choices"][0]["token_ids"]
        second = http.post(f"{proxy}/v1/completions", json={**body, "prompt": history + [101] * 40})
        assert second.status_code == 200, second.text
        decision = second.json()["kv_transfer_params"]["kv_history"]
        # the prefill instance cached turn 1's 2 full blocks of 128; the decode instance holds the 3 full
        # blocks of turn 1's 430 tokens: one block to read back
        assert decision["decision"] == "pull" and decision["reason"] == "cost_model", decision
        assert decision["held_tokens"] == 3 * BLOCK and decision["tokens"] == BLOCK
        assert decision["pull_ms"] < decision["recompute_ms"]
        assert decision["prefill_cached_tokens"] == 3 * BLOCK
        assert second.headers["X-PDServe-KV-History"].startswith("decision=pull; reason=cost_model; ")
        assert _cached(second.json()) == 3 * BLOCK
