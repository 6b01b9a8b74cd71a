"""P/D between prefill and decode instances of different tensor-parallel sizes, on CPU: real `pdserve serve`
processes (TP=2 ones with their worker rank), real NIXL DRAM reads from each rank's own pool shard, the two
HTTP legs built by the wire contract (pdserve/api/pd.py). Greedy outputs must be token-identical to a
collocated TP=1 instance, and each decode must have read exactly the KV bytes of the prompt (each rank
each of its heads once, none missing), whatever the mapping: P TP=2 -> D TP=1 (one rank reads both
producers' heads), P TP=1 -> D TP=2 (each rank reads its half of the one producer's heads), P TP=2 ->
D TP=2 (rank to rank); and with a one-KV-head model, whose head every TP=2 rank holds (replicated: read
once per holding rank, from one producer rank). And with fp8 KV pools on every instance: the head slices
then move as two strided pieces per region, the heads' fp8 values and their scales (pdserve.attention.fp8_kv).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import MODEL, ServerProcess, make_model_dir, metric_value

from pdserve.api.pd import build_decode_body, build_prefill_body, prefill_kv_params

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")
# five servers and two worker ranks start in the module fixture: slow on a loaded CI box
pytestmark = pytest.mark.timeout(1200)

SECRET = "tp-test-deployment-secret"
COMMON = ("--max-model-len", "512", "--num-gpu-blocks-override", "96", "--block-size", "16", "--device", "cpu")


def block_bytes(kv_heads: int, fp8: bool = False) -> int:
    """make_model_dir's tiny Llama: 2 layers, K and V, 16 tokens, heads of 16 float32 values (fp8: 16 bytes
    and a 2-byte scale)."""
    return 2 * 2 * 16 * kv_heads * (16 + 2 if fp8 else 16 * 4)


def kv_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": {"transfer_timeout_s": 10.0, "handshake_timeout_s": 10.0}})


@pytest.fixture(scope="module", params=[(2, "auto"), (1, "auto"), (2, "fp8")], ids=["2kv", "1kv", "2kv-fp8"])
def servers(request, tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    kv_heads, kv_cache_dtype = request.param
    model_dir = make_model_dir(tmp_path_factory.mktemp("pd-tp-model"), num_key_value_heads=kv_heads)
    logs = tmp_path_factory.mktemp("pd-tp-logs")

    def start(name: str, *args: str) -> ServerProcess:
        # with a deployment secret: every rank's NIXL metadata travels concealed in the handshake
        return ServerProcess(model_dir, logs / f"{name}.log", *COMMON, "--kv-cache-dtype", kv_cache_dtype, *args,
                             env={"PDSERVE_KV_SECRET": SECRET})

    procs = {
        "collocated": start("collocated"),
        "p1": start("p1", "--kv-transfer-config", kv_config("kv_producer"), "--side-channel-port", "0"),
        "p2": start("p2", "--kv-transfer-config", kv_config("kv_producer"), "--side-channel-port", "0",
                    "--tensor-parallel-size", "2"),
        "d1": start("d1", "--kv-transfer-config", kv_config("kv_consumer")),
        "d2": start("d2", "--kv-transfer-config", kv_config("kv_consumer"), "--tensor-parallel-size", "2"),
    }
    try:
        for proc in procs.values():
            proc.wait_ready(300)
        procs["kv_heads"] = kv_heads  # type: ignore[assignment]
        procs["fp8"] = kv_cache_dtype == "fp8"  # type: ignore[assignment]
        yield procs
    finally:
        for name, proc in procs.items():
            if name not in ("kv_heads", "fp8"):
                proc.stop()


def _prompts(seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 23, 40, 71)]


def _complete(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _loaded_bytes(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return (metric_value(text, "vllm:nixl_bytes_transferred_sum"),
            metric_value(text, "vllm:nixl_bytes_transferred_count"))


@pytest.mark.parametrize(("prefill", "decode", "seed"), [("p2", "d1", 1), ("p1", "d2", 2), ("p2", "d2", 3)])
def test_pd_across_tp_sizes_matches_collocated(servers, prefill: str, decode: str, seed: int) -> None:
    p, d = servers[prefill], servers[decode]
    info = {name: httpx.get(f"{servers[name].url}/pdserve/info", timeout=5).json() for name in (prefill, decode)}
    assert info[prefill]["tensor_parallel_size"] == int(prefill[1])
    assert info[decode]["tensor_parallel_size"] == int(decode[1])
    bytes0, loads0 = _loaded_bytes(d.url)
    expected_bytes = 0
    for prompt in _prompts(seed):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        want = _complete(servers["collocated"].url, body)["choices"][0]["text"]
        params = prefill_kv_params(_complete(p.url, build_prefill_body(body)))
        assert params is not None and params["tp_size"] == int(prefill[1])
        got = _complete(d.url, build_decode_body(body, params))
        assert got["choices"][0]["text"] == want, (prompt, params)
        # the decode read the KV of len(prompt) - 1 tokens: each rank whole blocks of each of its heads, once
        # (a replicated head is stored, so read, by every rank that holds it)
        d_tp, kv_heads = int(decode[1]), servers["kv_heads"]
        expected_bytes += -(-(len(prompt) - 1) // 16) * block_bytes(max(1, kv_heads // d_tp), servers["fp8"]) * d_tp
    bytes1, loads1 = _loaded_bytes(d.url)
    assert loads1 - loads0 == len(_prompts(seed))
    assert bytes1 - bytes0 == expected_bytes
    for proc in (p, d):  # the handshakes were signed and every rank's metadata concealed
        assert "side-channel messages authenticated" in Path(proc.log_path).read_text()


def test_consumer_refuses_params_whose_tp_size_is_not_the_producers(servers) -> None:
    """A decode request naming the wrong producer TP size (a stale or edited hand-off) fails cleanly: the
    handshake's rank list decides, and the error says what disagrees."""
    body = {"model": MODEL, "prompt": _prompts(9)[2], "max_tokens": 4, "temperature": 0}
    params = prefill_kv_params(_complete(servers["p2"].url, build_prefill_body(body)))
    assert params is not None
    params = dict(params, tp_size=4)
    r = httpx.post(f"{servers['d1'].url}/v1/completions", json=build_decode_body(body, params), timeout=60)
    assert r.status_code >= 400
    assert "tensor-parallel size 4" in r.text or "tensor-parallel size 4" in Path(servers["d1"].log_path).read_text()
