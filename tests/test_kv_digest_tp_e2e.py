"""KV digests between instances of different tensor-parallel sizes, on real processes: `pdserve serve` prefills
and decodes of TP=1 and TP=2 (a TP=2 instance's worker rank digests its own shard and what it received, over
rank RPC), real NIXL READs and WRITEs that move each decode rank's KV heads (head_split), the producers
corrupting KV on purpose (test-only faults, `PDSERVE_TESTING_KV_FAULTS`: pdserve/kv_transfer/faults.py).

Each decode rank digests the bytes it received in the producer's terms (pdserve/kv_transfer/digest_split.py):
- pull, prefill TP=2 -> decode TP=1: the decode's one rank holds both producer ranks' heads; XXH3 (the CPU
  default) re-assembles each producer rank's blocks and hashes them;
- pull, prefill TP=1 -> decode TP=2: each decode rank holds half of the producer's heads; the prefill digests
  with vLLM's lane sums (`kv_digest_algo`), whose per-head pieces add up across the decode ranks;
- pull, TP=2 -> TP=2: rank to rank, as before;
- push with fp8 pools (values and scales), TP=2 -> TP=1 and TP=1 -> TP=2: a stale WRITE into a registered block
  before the completion.
A clean load verifies (counted, no mismatch, no unverified load) and the answer equals collocated; a
corrupted one is caught and recomputed, the answer still equal to collocated. A prefill TP=1 with XXH3 and a
decode TP=2 cannot be checked (XXH3 does not add up over split heads): tests/test_kv_digest_split.py shows it
reported as "tp_split", as it shows every TP pair and layout on in-process pools.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_utils import MODEL, ServerProcess, all_ready, make_model_dir, metric_value, wait_idle

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_kv_digest_e2e import body_for, fault_log, faulty, mismatches, prompt_with, unverified, verified  # noqa: E402
from test_pd_e2e import decode_leg, kv_config, long_prompt, prefill_leg, start  # noqa: E402
from test_pd_push_tp_e2e import COMMON, SECRET, pair, push_config  # noqa: E402

pytestmark = pytest.mark.timeout(1500)

DIGESTS = {"enable_kv_digest": True}  # "auto" leaves them off on CPU pools (their cost: BENCHMARKS.md)
LANESUM = {**DIGESTS, "kv_digest_algo": "vllm_lanesum"}
TP2 = ("--tensor-parallel-size", "2", "--device", "cpu")


@pytest.fixture(scope="module")
def pull(tmp_path_factory, pd_reference) -> Iterator[dict]:
    model_dir = make_model_dir(tmp_path_factory.mktemp("digest-tp-model"))  # 2 KV heads: one a TP=2 rank
    logs = tmp_path_factory.mktemp("digest-tp-logs")
    servers = {
        # flip=1: every prompt whose last block is partial gets a byte flipped there (prompt_with picks)
        "p2": start(model_dir, logs, "p2", "--kv-transfer-config", kv_config("kv_producer", **DIGESTS),
                    "--side-channel-port", "0", *TP2, env=faulty(logs, "p2", flip=1.0)),
        "p1": start(model_dir, logs, "p1", "--kv-transfer-config", kv_config("kv_producer", **LANESUM),
                    "--side-channel-port", "0", env=faulty(logs, "p1", flip=1.0)),
        "d1": start(model_dir, logs, "d1", "--kv-transfer-config", kv_config("kv_consumer", "recompute", **DIGESTS)),
        "d2": start(model_dir, logs, "d2", "--kv-transfer-config", kv_config("kv_consumer", "recompute", **DIGESTS),
                    *TP2),
    }
    with all_ready(servers):
        yield {**servers, "collocated": pd_reference.wait_ready(), "logs": logs}  # conftest's, for the session


PULL_PAIRS = [("p2", "d1", "xxh3_128"), ("p1", "d2", "vllm_lanesum"), ("p2", "d2", "xxh3_128")]


@pytest.mark.parametrize(("prefill", "decode", "algo"), PULL_PAIRS, ids=[f"{p}-{d}" for p, d, _ in PULL_PAIRS])
def test_pull_across_tp_sizes_verifies_clean_reads_and_catches_a_flipped_byte(pull, prefill, decode, algo):
    p, d = pull[prefill], pull[decode]
    seed = 10 * PULL_PAIRS.index((prefill, decode, algo))
    for corrupt in (False, True):
        b = body_for(prompt_with(pull["collocated"], corrupt, seed + corrupt))
        ref = httpx.post(f"{pull['collocated'].url}/v1/completions", json=b, timeout=60).json()
        rid = f"tp-{prefill}-{decode}-{corrupt}"
        caught, checked, unchecked = mismatches(d), verified(d), unverified(d, "tp_split")
        params = prefill_leg(p, "completions", b, rid)
        assert len(params["remote_block_digests"]) == int(prefill[1]) and params["kv_digest_algo"] == algo
        out = decode_leg(d, "completions", b, params, rid)
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]  # recomputed if caught
        victims = [e for e in fault_log(pull["logs"], prefill) if rid in e["request_id"] and e["victim"]]
        assert len(victims) == int(corrupt), victims
        assert mismatches(d, 'outcome="recomputed"') - caught == int(corrupt)
        assert unverified(d, "tp_split") == unchecked
        if not corrupt:  # every block on every decode rank checked
            assert verified(d) - checked == len(params["remote_block_ids"][0]) * int(decode[1])
        wait_idle(d.url)
        wait_idle(p.url)


@pytest.fixture(scope="module")
def push(tmp_path_factory) -> Iterator[dict]:
    """fp8 pools everywhere; the prefills write a stale block into half of their pushes (seeded), just before
    the completion."""
    model_dir = make_model_dir(tmp_path_factory.mktemp("digest-tp-push-model"))
    logs = tmp_path_factory.mktemp("digest-tp-push-logs")
    fp8 = ("--kv-cache-dtype", "fp8")
    stale = {"PDSERVE_KV_SECRET": SECRET}
    cfg = {
        "collocated": (),
        "p2": ("--kv-transfer-config", push_config("kv_producer", **DIGESTS), "--side-channel-port", "0",
               "--tensor-parallel-size", "2"),
        "p1": ("--kv-transfer-config", push_config("kv_producer", **LANESUM), "--side-channel-port", "0"),
        "d1": ("--kv-transfer-config", push_config("kv_consumer", "recompute", push_registration_timeout=10.0,
                                                   **DIGESTS)),
        "d2": ("--kv-transfer-config", push_config("kv_consumer", "recompute", push_registration_timeout=10.0,
                                                   **DIGESTS), "--tensor-parallel-size", "2"),
    }
    servers = {name: ServerProcess(model_dir, logs / f"{name}.log", *COMMON, *fp8, *args,
                                   env={**stale, **(faulty(logs, name, stale_push=0.5) if name[0] == "p" else {})})
               for name, args in cfg.items()}
    with all_ready(servers):
        yield {**servers, "logs": logs}


def push_mismatches(srv: ServerProcess) -> float:
    return mismatches(srv, 'where="push"')


PUSH_PAIRS = [("p2", "d1"), ("p1", "d2")]


@pytest.mark.parametrize(("prefill", "decode"), PUSH_PAIRS, ids=[f"{p}-{d}" for p, d in PUSH_PAIRS])
def test_fp8_push_across_tp_sizes_verifies_clean_writes_and_catches_a_stale_one(push, prefill, decode):
    p, d = push[prefill], push[decode]
    outcomes: set[bool] = set()
    for i in range(12):  # the fault's coin (seeded) gives both outcomes within a few pushes
        tokens = {"prompt": f"push digest {prefill} {decode} {i}: " + long_prompt(40 + 3 * i, i)}
        b = {"model": MODEL, **tokens, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        ref = httpx.post(f"{push['collocated'].url}/v1/completions", json=b, timeout=60).json()
        caught, checked = push_mismatches(d), verified(d)
        dleg, pleg, key = pair(p, d, b)
        assert pleg is not None and pleg.result().status_code == 200
        out = dleg.result()
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
        stale = [e for e in fault_log(push["logs"], prefill) if e["kind"] == "stale_push" and e["victim"]
                 and key in e["request_id"]]
        assert push_mismatches(d) - caught == len(stale)
        if not stale:
            assert verified(d) > checked
        outcomes.add(bool(stale))
        wait_idle(d.url)
        wait_idle(p.url)
        if outcomes == {True, False}:
            break
    assert outcomes == {True, False}
    assert unverified(d, "tp_split") == 0 and unverified(d, "tp_mismatch") == 0


def test_metrics_name_the_verified_blocks(pull):
    """The decode's /metrics carry the counters the tests read (a renamed metric would make them vacuous)."""
    text = httpx.get(f"{pull['d2'].url}/metrics", timeout=10).text
    assert metric_value(text, "pdserve:kv_digest_verified_blocks_total") > 0
