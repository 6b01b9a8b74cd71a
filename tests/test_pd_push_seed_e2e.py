"""The second seed's deployment in push mode, on CPU: its launch flags (shared/seeds/000_*.txt, "Configuring vLLM
V1 Disaggregated Pools") with `"kv_connector": "NixlPushConnector"` on both pools: TP=4 prefill and decode,
`--kv-cache-dtype fp8_e4m3`, prefix caching, and `kv_rank` / `kv_parallel_size` / `kv_buffer_size` as the
seed writes them (accepted, and meaningless to NIXL), behind `pdserve proxy --prefill P --decode D`.

Sized for a test (the tiny model, 2 layers, 4 attention heads over 2 KV heads, so each TP=4 rank holds one
KV head replicated on two ranks; a small pool; the GPU memory fraction means nothing on CPU): 8 engine
processes on the machine's cores. Token-exact with a collocated instance of the same KV dtype, streamed and
not, and every push moves exactly the registered bytes.

Two proxies: one given ONLY the two addresses (the seed's way: the proxy must learn push from the instances;
that auto-detection is built on another branch, proxy-push, and this case fails until it is merged) and one
told `--kv-transfer-mode push` (this branch's side: the instances push across TP=4)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import httpx
import pytest
from server_utils import (
    MODEL,
    PdserveProcess,
    ServerProcess,
    free_port,
    make_model_dir,
    metric_value,
    wait_idle,
)

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_pd_push_e2e import HEADERS, _stream_text, labelled, metrics_of  # noqa: E402

pytestmark = pytest.mark.timeout(1800)

SECRET = "push-seed-test-deployment-secret"
SEED_PREFILL = {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer", "kv_rank": 0, "kv_parallel_size": 2,
                "kv_buffer_size": 8589934592}
SEED_DECODE = {"kv_connector": "NixlPushConnector", "kv_role": "kv_consumer", "kv_rank": 1, "kv_parallel_size": 2,
               "kv_buffer_size": 17179869184}
TEST_SIZING = ("--max-model-len", "512", "--num-gpu-blocks-override", "64", "--block-size", "16", "--device", "cpu")


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Iterator[dict]:
    model_dir = make_model_dir(tmp_path_factory.mktemp("seed-model"))
    logs = tmp_path_factory.mktemp("seed-logs")
    env = {"PDSERVE_KV_SECRET": SECRET}
    procs: dict[str, PdserveProcess] = {
        "collocated": ServerProcess(model_dir, logs / "collocated.log", *TEST_SIZING, "--kv-cache-dtype", "fp8_e4m3",
                                    env=env),
        "prefill": ServerProcess(model_dir, logs / "prefill.log", *TEST_SIZING, "--tensor-parallel-size", "4",
                                 "--kv-cache-dtype", "fp8_e4m3", "--gpu-memory-utilization", "0.90",
                                 "--enable-prefix-caching", "--kv-transfer-config", json.dumps(SEED_PREFILL),
                                 # the seed leaves the side channel at its default port; a free one here
                                 env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}),
        "decode": ServerProcess(model_dir, logs / "decode.log", *TEST_SIZING, "--tensor-parallel-size", "4",
                                "--kv-cache-dtype", "fp8_e4m3", "--max-num-seqs", "192",
                                "--gpu-memory-utilization", "0.94", "--kv-transfer-config", json.dumps(SEED_DECODE),
                                env=env),
    }
    try:
        for proc in procs.values():
            proc.wait_ready(600)
        for name, mode in (("proxy", ()), ("proxy_push", ("--kv-transfer-mode", "push"))):
            port = free_port()
            procs[name] = PdserveProcess(logs / f"{name}.log", port, [
                "proxy", "--host", "127.0.0.1", "--port", str(port), "--prefill", procs["prefill"].url,
                "--decode", procs["decode"].url, *mode])
            procs[name].wait_ready()
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def fp8_block_bytes() -> int:
    """One TP=4 rank's fp8 block of the tiny model: 2 layers, K and V, 16 tokens, one head of 16 bytes + scale."""
    return 2 * 2 * 16 * (16 + 2)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("proxy", ["proxy", "proxy_push"], ids=["addresses-only", "told-push"])
def test_seed_launch_flags_push_behind_the_proxy(seed, proxy: str, stream: bool) -> None:
    info = {n: httpx.get(f"{seed[n].url}/pdserve/info", timeout=10).json() for n in ("prefill", "decode")}
    assert all(i["tensor_parallel_size"] == 4 and i["kv_transfer_mode"] == "push" for i in info.values()), info
    received0 = metric_value(metrics_of(seed["decode"].url), "vllm:nixl_bytes_transferred_sum") or 0.0
    written0 = labelled(metrics_of(seed["prefill"].url), "pdserve:kv_push_written_bytes_total", "phase")
    tokens = prompt(100 * stream + (proxy == "proxy_push"), 40)
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    ref = httpx.post(f"{seed['collocated'].url}/v1/completions", json=body, timeout=120)
    out = httpx.post(f"{seed[proxy].url}/v1/completions", json=body, timeout=300, headers=HEADERS)
    assert out.status_code == 200, out.text
    if stream:
        assert _stream_text(out) == _stream_text(ref)
    else:
        assert [c["text"] for c in out.json()["choices"]] == [c["text"] for c in ref.json()["choices"]]
    want = -(-(len(tokens) - 1) // 16) * fp8_block_bytes() * 4  # each decode rank its (replicated) head, once
    received = (metric_value(metrics_of(seed["decode"].url), "vllm:nixl_bytes_transferred_sum") or 0.0) - received0
    assert received == want
    wait_idle(seed["prefill"].url, 60)
    assert labelled(metrics_of(seed["prefill"].url), "pdserve:kv_push_written_bytes_total", "phase") - written0 \
        == want
    wait_idle(seed["decode"].url, 60)
