"""Wrong KV never becomes an answer: real `pdserve serve` prefill and decode processes, real NIXL transfers, the
producer corrupting KV on purpose (test-only faults, `PDSERVE_TESTING_KV_FAULTS`: pdserve/kv_transfer/faults.py)
and the decode catching it with the per-block digests (`remote_block_digests`, `enable_kv_digest` on both).

- a byte flipped in a held block: caught, recomputed, the answer equal to collocated's; under `fail` a clear
  error (500 naming the digest mismatch), never 200;
- a READ after the producer reassigned the blocks (handed back to its pool while the lease still looked held,
  then reused by other prompts): caught;
- push mode, a stale WRITE into a registered block before the completion: caught.
Every victim the producer logged is counted on the decode (`pdserve:kv_digest_mismatch_total`), and clean
transfers verify without a false positive. Between instances of different (and equal) TP sizes:
tests/test_kv_digest_tp_e2e.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess, all_ready, make_model_dir, metric_value, wait_idle

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_pd_e2e import decode_leg, kv_config, long_prompt, prefill_leg, start  # noqa: E402 - after the skip
from test_pd_push_e2e import push_config, push_pair  # noqa: E402

FAULTS_ENV = "PDSERVE_TESTING_KV_FAULTS"
BLOCK = 16  # the tests' --block-size
DIGESTS = {"enable_kv_digest": True}  # off by default (their CPU cost: BENCHMARKS.md), on in both roles here


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("digest-model"))


def faulty(logs: Path, name: str, **spec: float) -> dict[str, str]:
    return {FAULTS_ENV: json.dumps({**spec, "seed": 1, "log": str(logs / f"{name}-faults.jsonl")})}


def fault_log(logs: Path, name: str) -> list[dict]:
    path = logs / f"{name}-faults.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def pull(model_dir: Path, tmp_path_factory, pd_reference) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("digest-logs")
    servers = {
        "prefill_flip": start(model_dir, logs, "prefill_flip", "--kv-transfer-config",
                              kv_config("kv_producer", **DIGESTS), "--side-channel-port", "0", env=faulty(logs, "prefill_flip", flip=1.0)),
        # a small pool, so that a few other prompts reuse the blocks the fault handed back
        "prefill_reassign": start(model_dir, logs, "prefill_reassign", "--kv-transfer-config",
                                  kv_config("kv_producer", **DIGESTS), "--side-channel-port", "0",
                                  "--num-gpu-blocks-override", "40",
                                  env=faulty(logs, "prefill_reassign", reassign=1.0)),
        "decode_recompute": start(model_dir, logs, "decode_recompute", "--kv-transfer-config",
                                  kv_config("kv_consumer", "recompute", **DIGESTS)),
        "decode_fail": start(model_dir, logs, "decode_fail", "--kv-transfer-config",
                             kv_config("kv_consumer", **DIGESTS)),
    }
    with all_ready(servers):
        yield {**servers, "collocated": pd_reference.wait_ready(), "logs": logs}  # conftest's, for the session


def num_tokens(srv: ServerProcess, text: str) -> int:
    r = httpx.post(f"{srv.url}/tokenize", json={"model": "tiny", "prompt": text}, timeout=30)
    r.raise_for_status()
    return int(r.json()["count"])


def prompt_with(srv: ServerProcess, flippable: bool, seed: int) -> str:
    """A prompt whose last block holds >= 2 tokens (the fault flips a byte there) or exactly fills its blocks
    (the fault leaves it alone: a clean transfer)."""
    for words in range(20, 200):
        text = f"digest case {seed}: " + long_prompt(words, seed)
        tail = num_tokens(srv, text) % BLOCK
        if (tail not in (0, 1)) if flippable else tail == 0:
            return text
    raise AssertionError("no prompt of the wanted length")


def mismatches(srv: ServerProcess, outcome: str = "") -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:kv_digest_mismatch_total{") and outcome in line)


def verified(srv: ServerProcess) -> float:
    return metric_value(httpx.get(f"{srv.url}/metrics", timeout=10).text, "pdserve:kv_digest_verified_blocks_total")


def body_for(text: str) -> dict:
    return {"model": "tiny", "prompt": text, "max_tokens": 8, "temperature": 0, "return_token_ids": True}


def test_flipped_byte_is_caught_and_recomputed_exactly(pull):
    prefill, decode = pull["prefill_flip"], pull["decode_recompute"]
    b = body_for(prompt_with(pull["collocated"], True, 1))
    ref = httpx.post(f"{pull['collocated'].url}/v1/completions", json=b, timeout=60).json()
    before = mismatches(decode, 'outcome="recomputed"')
    params = prefill_leg(prefill, "completions", b, "flip-recompute")
    assert params["remote_block_digests"] and params["kv_digest_algo"] == "xxh3_128"
    out = decode_leg(decode, "completions", b, params, "flip-recompute")
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert mismatches(decode, 'outcome="recomputed"') == before + 1
    victims = [e for e in fault_log(pull["logs"], "prefill_flip") if "flip-recompute" in e["request_id"]
               and e["victim"]]
    assert len(victims) == 1
    wait_idle(decode.url)
    wait_idle(prefill.url)


@pytest.mark.parametrize("stream", [False, True])
def test_flipped_byte_under_fail_is_a_clear_error(pull, stream):
    prefill, decode = pull["prefill_flip"], pull["decode_fail"]
    b = {**body_for(prompt_with(pull["collocated"], True, 2 + stream)), "stream": stream}
    before = mismatches(decode, 'outcome="failed"')
    params = prefill_leg(prefill, "completions", b, f"flip-fail-{stream}")
    out = decode_leg(decode, "completions", b, params, f"flip-fail-{stream}")
    if stream:  # the producer's first token may have gone out (it did not come from the bad KV); then the error
        frames = [json.loads(ln[6:]) for ln in out.text.splitlines() if ln.startswith("data: {")]
        assert "KV digest mismatch" in frames[-1]["error"]["message"], out.text
        assert sum(1 for f in frames[:-1] for c in f.get("choices", []) if c.get("text")) <= 1, out.text
    else:
        assert out.status_code == 500, out.text
        assert "KV digest mismatch" in out.json()["error"]["message"]
    assert mismatches(decode, 'outcome="failed"') == before + 1
    wait_idle(decode.url)
    wait_idle(prefill.url)


def test_clean_transfers_verify_without_false_positives(pull):
    prefill, decode = pull["prefill_flip"], pull["decode_fail"]
    b = body_for(prompt_with(pull["collocated"], False, 4))  # fills its blocks exactly: no flip
    ref = httpx.post(f"{pull['collocated'].url}/v1/completions", json=b, timeout=60).json()
    before, checked = mismatches(decode), verified(decode)
    params = prefill_leg(prefill, "completions", b, "clean")
    out = decode_leg(decode, "completions", b, params, "clean")
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert mismatches(decode) == before
    assert verified(decode) >= checked + len(params["remote_block_ids"][0]) - 1
    wait_idle(decode.url)


def test_read_after_reassign_is_caught(pull):
    prefill, decode = pull["prefill_reassign"], pull["decode_recompute"]
    b = body_for(prompt_with(pull["collocated"], True, 5))
    ref = httpx.post(f"{pull['collocated'].url}/v1/completions", json=b, timeout=60).json()
    before = mismatches(decode)
    params = prefill_leg(prefill, "completions", b, "reassign")
    # other prompts take the pool's blocks, the handed-back ones among them, before the decode's late READ
    for i in range(6):
        churn = {"model": "tiny", "prompt": f"churn {i}: " + long_prompt(90, 7 + i), "max_tokens": 1}
        assert httpx.post(f"{prefill.url}/v1/completions", json=churn, timeout=60).status_code == 200
    out = decode_leg(decode, "completions", b, params, "reassign")
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]  # recomputed, never wrong
    read = [e for e in fault_log(pull["logs"], "prefill_reassign")
            if "reassign" in e["request_id"] and e["phase"] == "read"]
    assert len(read) == 1 and read[0]["victim"], read  # the blocks did change before the READ's release
    assert mismatches(decode) == before + 1
    wait_idle(decode.url)
    wait_idle(prefill.url)


@pytest.fixture(scope="module")
def push(model_dir: Path, tmp_path_factory, pd_reference) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("digest-push-logs")
    servers = {
        "prefill": start(model_dir, logs, "prefill", "--kv-transfer-config", push_config("kv_producer", **DIGESTS),
                         "--side-channel-port", "0", env=faulty(logs, "prefill", stale_push=1.0)),
        "decode": start(model_dir, logs, "decode", "--kv-transfer-config",
                        push_config("kv_consumer", "recompute", push_registration_timeout=4.0, **DIGESTS)),
    }
    with all_ready(servers):
        yield {**servers, "collocated": pd_reference.wait_ready(), "logs": logs}  # conftest's, for the session


def test_stale_push_write_is_caught(push):
    b = body_for("stale push: " + long_prompt(80, 3))
    ref = httpx.post(f"{push['collocated'].url}/v1/completions", json=b, timeout=60).json()
    before = mismatches(push["decode"], 'where="push"')
    d, p, key = push_pair(push["prefill"], push["decode"], b)
    assert p is not None and p.result().status_code == 200
    out = d.result()
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]  # recomputed
    victims = [e for e in fault_log(push["logs"], "prefill") if e["kind"] == "stale_push" and e["victim"]]
    assert len(victims) == 1
    assert mismatches(push["decode"], 'where="push"') == before + 1
    wait_idle(push["decode"].url)
    wait_idle(push["prefill"].url)


def unverified(srv: ServerProcess, reason: str) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:kv_digest_unverified_total{") and f'reason="{reason}"' in line)
