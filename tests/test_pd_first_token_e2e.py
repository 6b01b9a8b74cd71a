"""The prefill leg's first token, handed to the decode instance (pdserve/api/pd.py `first_token_fields`):
real `pdserve serve` producer, consumer and collocated processes, real NIXL transfers.

The decode instance starts from the producer's sampled token instead of recomputing the last prompt token;
params without it (a vLLM producer's) are served by recompute as before. Both must answer exactly what the
collocated instance answers: greedy, seeded sampling and logprobs alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess, all_ready, make_model_dir, wait_idle

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_pd_e2e import decode_leg, kv_config, long_prompt, prefill_leg, start  # noqa: E402 - after the skip

from pdserve.api import pd  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("pd-first-token-model"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pd-first-token-logs")


@pytest.fixture(scope="module")
def cluster(model_dir: Path, logs: Path, pd_reference) -> Iterator[dict[str, ServerProcess]]:
    # generous transfer deadlines: these tests check outputs, not failure handling (test_pd_e2e does that),
    # and a heavily loaded CI box can take seconds for a DRAM transfer
    slack = {"transfer_timeout_s": 30.0, "handshake_timeout_s": 30.0}
    servers = {
        "prefill": start(model_dir, logs, "prefill", "--kv-transfer-config", kv_config("kv_producer", **slack),
                         "--side-channel-port", "0"),
        "decode": start(model_dir, logs, "decode", "--kv-transfer-config",
                        kv_config("kv_consumer", "fail", **slack),
                        env={"PDSERVE_STEP_LOG": str(logs / "decode-steps.jsonl")}),
    }
    with all_ready(servers):
        yield {**servers, "collocated": pd_reference.wait_ready()}  # conftest's, for the session


def body(prompt_words: int = 60, prompt_seed: int = 1, **kw) -> dict:
    return {"model": "tiny", "prompt": long_prompt(prompt_words, prompt_seed), "max_tokens": 10, "temperature": 0,
            "return_token_ids": True, **kw}


def sse_tokens(resp: httpx.Response) -> list[int]:
    ids: list[int] = []
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for ch in json.loads(line[6:]).get("choices", []):
                ids.extend(ch.get("token_ids") or [])
    return ids


def request_line(logs: Path, rid: str) -> dict:
    """The decode engine's lifecycle line of a finished request (step log): times relative to arrival."""
    for line in (logs / "decode-steps.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("request", "").startswith(f"cmpl-{rid}"):
            return rec
    raise AssertionError(f"no step-log line for {rid}")


def three_ways(cluster: dict[str, ServerProcess], b: dict, rid: str) -> tuple[dict, dict, dict, dict]:
    """(collocated, decode from the first token, decode by recompute, the producer's params)."""
    ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=b, timeout=60)
    params = prefill_leg(cluster["prefill"], "completions", b, rid + "-a")
    adopted = decode_leg(cluster["decode"], "completions", b, params, rid + "-a")
    params2 = prefill_leg(cluster["prefill"], "completions", b, rid + "-r")
    recomputed = decode_leg(cluster["decode"], "completions", b, pd.without_first_token(params2), rid + "-r")
    for r in (ref, adopted, recomputed):
        assert r.status_code == 200, r.text
    return ref.json(), adopted.json(), recomputed.json(), params


def test_prefill_params_carry_the_sampled_first_token(cluster):
    b = body(prompt_seed=2)
    p = dict(b, max_tokens=1, kv_transfer_params=pd.prefill_leg_params())
    r = httpx.post(f"{cluster['prefill'].url}/v1/completions", json=p, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    params = data["kv_transfer_params"]
    assert params[pd.FIRST_TOKEN_ID] == data["choices"][0]["token_ids"][0]
    assert pd.FIRST_TOKEN_LOGPROB not in params  # not asked for
    assert pd.parse_remote_prefill_params(params).first_token == pd.FirstToken(params[pd.FIRST_TOKEN_ID])
    # nobody reads this lease: abort it through a decode leg that ends on its first token (max_tokens 1)
    out = decode_leg(cluster["decode"], "completions", dict(b, max_tokens=1), params, "ft-carry")
    assert out.status_code == 200, out.text
    wait_idle(cluster["prefill"].url)


def test_greedy_from_the_first_token_and_by_recompute_match_collocated(cluster, logs):
    b = body(prompt_words=90, prompt_seed=3, max_tokens=12)
    ref, adopted, recomputed, params = three_ways(cluster, b, "ft-greedy")
    want = ref["choices"][0]["token_ids"]
    assert adopted["choices"][0]["token_ids"] == want
    assert recomputed["choices"][0]["token_ids"] == want
    assert adopted["choices"][0]["text"] == ref["choices"][0]["text"]
    assert params[pd.FIRST_TOKEN_ID] == want[0]
    assert adopted["usage"]["completion_tokens"] == 12
    wait_idle(cluster["decode"].url)
    n_prompt = ref["usage"]["prompt_tokens"]
    # adopted: the whole prompt came from the producer and the first token went out once the producer
    # granted the lease, before the READ's end was handled and before the request's first model step
    a = request_line(logs, "ft-greedy-a")
    assert a["cached_tokens"] == n_prompt
    assert a["load_start_ms"] <= a["first_token_ms"] <= a["load_done_ms"] <= a["scheduled_ms"]
    # recompute: all but the last prompt token came over; the first token came out of a model step
    r = request_line(logs, "ft-greedy-r")
    assert r["cached_tokens"] == n_prompt - 1 and r["first_token_ms"] > r["scheduled_ms"]
    wait_idle(cluster["prefill"].url)


def test_streamed_first_token_comes_first(cluster):
    b = body(prompt_seed=4, stream=True, max_tokens=8)
    ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=b, timeout=60)
    params = prefill_leg(cluster["prefill"], "completions", b, "ft-stream")
    out = decode_leg(cluster["decode"], "completions", b, params, "ft-stream")
    assert out.status_code == 200, out.text
    got = sse_tokens(out)
    assert got == sse_tokens(ref) and got[0] == params[pd.FIRST_TOKEN_ID] and len(got) == 8


def test_seeded_sampling_matches_collocated_both_ways(cluster):
    b = body(prompt_seed=5, temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)
    ref, adopted, recomputed, _ = three_ways(cluster, b, "ft-seeded")
    want = ref["choices"][0]["token_ids"]
    assert adopted["choices"][0]["token_ids"] == want
    assert recomputed["choices"][0]["token_ids"] == want


def test_first_token_logprobs_travel_with_it(cluster, logs):
    b = body(prompt_seed=6, logprobs=3, max_tokens=5)
    ref, adopted, recomputed, params = three_ways(cluster, b, "ft-logprobs")
    lp = params[pd.FIRST_TOKEN_LOGPROB]
    assert len(lp["top"]) == 3 and lp["rank"] >= 1
    want = ref["choices"][0]["logprobs"]
    for got in (adopted, recomputed):
        g = got["choices"][0]["logprobs"]
        assert g["tokens"] == want["tokens"]
        assert g["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
        assert [sorted(d) for d in g["top_logprobs"]] == [sorted(d) for d in want["top_logprobs"]]
    # a decode leg asking for more top logprobs than the producer sent recomputes instead (still exact)
    more = dict(b, logprobs=5)
    params = prefill_leg(cluster["prefill"], "completions", b, "ft-more")  # the producer computed top 3
    out = decode_leg(cluster["decode"], "completions", more, params, "ft-more")
    assert out.status_code == 200, out.text
    wait_idle(cluster["decode"].url)
    assert request_line(logs, "ft-more")["cached_tokens"] == ref["usage"]["prompt_tokens"] - 1
    wait_idle(cluster["prefill"].url)


def test_min_tokens_declines_a_stop_first_token(cluster, model_dir):
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    b = body(prompt_seed=7, min_tokens=3, max_tokens=6)
    params = prefill_leg(cluster["prefill"], "completions", b, "ft-min")
    forged = dict(params, **{pd.FIRST_TOKEN_ID: eos})  # as if the prefill leg (no min_tokens) drew EOS
    out = decode_leg(cluster["decode"], "completions", b, forged, "ft-min")
    ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=b, timeout=60)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["token_ids"] == ref.json()["choices"][0]["token_ids"]
    wait_idle(cluster["prefill"].url)


@pytest.mark.parametrize("bad", [{pd.FIRST_TOKEN_ID: "7"}, {pd.FIRST_TOKEN_ID: -1}, {pd.FIRST_TOKEN_ID: 49152},
                                 {pd.FIRST_TOKEN_ID: 7, pd.FIRST_TOKEN_LOGPROB: {"logprob": "x"}},
                                 {pd.FIRST_TOKEN_ID: 7, pd.FIRST_TOKEN_LOGPROB: {"logprob": -1.0, "top": [[1]]}}])
def test_malformed_first_token_is_a_400(cluster, bad):
    b = body(prompt_seed=8, max_tokens=2)
    rid = f"ft-bad-{abs(hash(json.dumps(bad))) % 10**6}"
    params = prefill_leg(cluster["prefill"], "completions", b, rid)
    out = decode_leg(cluster["decode"], "completions", b, dict(params, **bad), rid)
    assert out.status_code == 400, out.text
    assert "kv_transfer_params" in out.json()["error"]["message"]
    # the lease nobody read expires or is released; the decode instance holds nothing
    wait_idle(cluster["decode"].url)
