"""Push transfer combined with what pull supports (ARCHITECTURE.md "Push transfer", the combinations table):
real `pdserve serve` push instances, real NIXL WRITEs, both legs at once as the proxy sends them.

- speculative decoding on the push decode: ngram, and a draft model whose prompt KV the decode computes itself
  (as in pull: only the target's KV travels; every draft of the target-as-its-own-draft is accepted only if
  the draft's prompt KV is right);
- the host KV tier on the push decode: a prompt whose prefix left the pool for the host tier is loaded from
  the tier and the push brings only the blocks the decode lacks: token-exact.
(n > 1, kv_load_failure_policy recompute, prefix caching and FP8 are tests/test_pd_push_e2e.py's; multi-turn
history tests/test_pd_push_multiturn_e2e.py's.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import MODEL, ServerProcess, all_ready, make_model_dir, metric_value, wait_idle

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_pd_e2e import SECRET_ENV  # noqa: E402 - after the skip
from test_pd_push_e2e import push_config, push_pair  # noqa: E402

BS = 16
TIER_BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # make_model_dir's tiny Llama: layers x (K, V) x tokens x heads x dim
PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    model_dir: Path = make_model_dir(tmp_path_factory.mktemp("push-combo-model"))
    logs = tmp_path_factory.mktemp("push-combo-logs")

    def start(name: str, *args: str, blocks: int = 128) -> ServerProcess:
        return ServerProcess(model_dir, logs / f"{name}.log", "--max-model-len", "512", "--num-gpu-blocks-override",
                             str(blocks), *args, env=SECRET_ENV)

    decode = ("--kv-transfer-config", push_config("kv_consumer", push_registration_timeout=10.0))
    procs = {
        "plain": start("plain"),
        "prefill": start("prefill", "--kv-transfer-config", push_config("kv_producer"), "--side-channel-port", "0"),
        "ngram": start("ngram", "--speculative-config", NGRAM, *decode),
        "draft": start("draft", "--speculative-config", json.dumps({"model": str(model_dir),
                                                                    "num_speculative_tokens": 3}), *decode),
        # a pool of 12 blocks and a host tier of 8: a few prompts push a prefix out to the tier
        "tier": start("tier", "--kv-offloading-size", str(8 * TIER_BLOCK_BYTES / 1024**3), "--kv-offloading-backend",
                      "native", *decode, blocks=12),
    }
    with all_ready(procs):
        yield procs


def metrics(srv: ServerProcess) -> str:
    return httpx.get(f"{srv.url}/metrics", timeout=10).text


def pushed(servers: dict, decode: str, body: dict) -> httpx.Response:
    d, p, _ = push_pair(servers["prefill"], servers[decode], body)
    assert p is not None
    assert p.result().status_code == 200
    return d.result()


@pytest.mark.parametrize("decode", ["ngram", "draft"])
def test_speculative_decoding_on_a_push_decode(servers, decode):
    body = {"model": MODEL, "temperature": 0, "prompt": PROMPT + " " + decode, "max_tokens": 40, "ignore_eos": True}
    ref = httpx.post(f"{servers['plain'].url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    before = metrics(servers[decode])
    out = pushed(servers, decode, body)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == ref
    after = metrics(servers[decode])
    drafted, accepted = (metric_value(after, name) - metric_value(before, name) for name in (
        "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"))
    assert drafted > 0
    if decode == "draft":
        assert accepted == drafted  # the draft's KV of the pushed prompt was computed on the decode
    wait_idle(servers["prefill"].url)


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 17 * i) % 3000 + 300 for i in range(n)]


def test_host_tier_on_a_push_decode(servers):
    prompt = ids(1, 4 * BS) + [7, 7, 7]
    body = {"model": MODEL, "temperature": 0, "prompt": prompt, "max_tokens": 6, "ignore_eos": True}
    ref = httpx.post(f"{servers['plain'].url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    out = pushed(servers, "tier", body)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == ref
    hits = metric_value(metrics(servers["tier"]), 'pdserve:kv_tier_hits_total{engine="0",medium="CPU"') or 0
    for seed in range(2, 5):  # other prompts, served on the decode alone: the first prefix leaves the pool
        other = {**body, "prompt": ids(seed, 5 * BS)}
        assert httpx.post(f"{servers['tier'].url}/v1/completions", json=other, timeout=60).status_code == 200
    written = metric_value(metrics(servers["tier"]), "vllm:nixl_bytes_transferred_sum") or 0
    out = pushed(servers, "tier", body)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == ref
    after = metrics(servers["tier"])
    # the prefix came from the host tier, and the push carried only the blocks the decode lacked
    assert (metric_value(after, 'pdserve:kv_tier_hits_total{engine="0",medium="CPU"') or 0) > hits
    assert (metric_value(after, "vllm:nixl_bytes_transferred_sum") or 0) - written < 4 * TIER_BLOCK_BYTES
    wait_idle(servers["prefill"].url)
    wait_idle(servers["tier"].url)
