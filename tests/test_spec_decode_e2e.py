"""Speculative decoding over HTTP: a `pdserve serve --speculative-config` instance answers as one without
(greedy: the same text, stop strings, logprobs, structured output), collocated and as the decode instance
behind a prefill instance (real NIXL transfer); vLLM's spec_decode counters on /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import MODEL, ServerProcess, all_ready, make_model_dir, metric_value, wait_idle
from test_pd_e2e import SECRET_ENV, decode_leg, kv_config, prefill_leg, text_of

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

COMMON = ("--max-model-len", "512", "--num-gpu-blocks-override", "128")
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    model_dir: Path = make_model_dir(tmp_path_factory.mktemp("spec-model"))
    logs = tmp_path_factory.mktemp("spec-logs")

    def start(name: str, *args: str) -> ServerProcess:
        return ServerProcess(model_dir, logs / f"{name}.log", *COMMON, *args, env=SECRET_ENV)

    procs = {
        "plain": start("plain"),
        "prefill": start("prefill", "--kv-transfer-config", kv_config("kv_producer"), "--side-channel-port", "0"),
        "spec": start("spec", "--speculative-config", SPEC, "--kv-transfer-config", kv_config("kv_consumer")),
        # the target as its own draft: every draft is accepted only if the draft's prompt KV is right
        "draft": start("draft", "--speculative-config", json.dumps({"model": str(model_dir),
                                                                     "num_speculative_tokens": 3}),
                       "--kv-transfer-config", kv_config("kv_consumer")),
    }
    with all_ready(procs):
        yield procs


def complete(srv: ServerProcess, **body) -> dict:
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("stream", [False, True])
def test_collocated_text_stop_strings_and_logprobs_as_without(servers, stream):
    plain, spec = servers["plain"], servers["spec"]
    full = complete(plain, prompt=PROMPT, max_tokens=48, ignore_eos=True)["text"]
    assert complete(spec, prompt=PROMPT, max_tokens=48, ignore_eos=True)["text"] == full
    for cut in (5, 17, 30):
        stop = full[cut : cut + 4]
        if not stop.strip():
            continue
        body = {"model": MODEL, "temperature": 0, "prompt": PROMPT, "max_tokens": 48, "stop": [stop],
                "stream": stream}
        ref = httpx.post(f"{plain.url}/v1/completions", json=body, timeout=120)
        got = httpx.post(f"{spec.url}/v1/completions", json=body, timeout=120)
        assert text_of("completions", got, stream) == text_of("completions", ref, stream)
    a = complete(plain, prompt=PROMPT, max_tokens=24, logprobs=2, ignore_eos=True)["logprobs"]
    b = complete(spec, prompt=PROMPT, max_tokens=24, logprobs=2, ignore_eos=True)["logprobs"]
    assert a["tokens"] == b["tokens"]
    assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], abs=1e-4)


def test_structured_output_as_without(servers):
    body = {"prompt": PROMPT, "max_tokens": 12, "structured_outputs": {"choice": ["fox", "dog", "lazy fox"]}}
    assert complete(servers["spec"], **body)["text"] == complete(servers["plain"], **body)["text"]


@pytest.mark.parametrize("decode", ["spec", "draft"])
def test_decode_instance_behind_a_prefill_gives_the_collocated_tokens(servers, decode):
    """ngram, and a draft model whose prompt KV the decode instance computes itself (a draft prefill): the
    prefill instance has no draft model and sends only the target's KV."""
    body = {"model": MODEL, "temperature": 0, "prompt": PROMPT + " " + decode, "max_tokens": 40, "ignore_eos": True}
    ref = complete(servers["plain"], **{k: v for k, v in body.items() if k != "model"})["text"]
    before = httpx.get(f"{servers[decode].url}/metrics", timeout=10).text
    params = prefill_leg(servers["prefill"], "completions", body, f"spec-pd-{decode}")
    out = decode_leg(servers[decode], "completions", body, params, f"spec-pd-{decode}")
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == ref
    wait_idle(servers["prefill"].url)
    after = httpx.get(f"{servers[decode].url}/metrics", timeout=10).text
    drafted, accepted = (metric_value(after, name) - metric_value(before, name) for name in (
        "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"))
    assert drafted > 0
    if decode == "draft":
        assert accepted == drafted  # the draft's KV of the transferred prompt was computed on the decode


def test_metrics_have_vllms_spec_decode_counters(servers):
    complete(servers["spec"], prompt=PROMPT, max_tokens=32, ignore_eos=True)
    text = httpx.get(f"{servers['spec'].url}/metrics", timeout=10).text
    drafts = metric_value(text, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric_value(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric_value(text, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = {line.split('position="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")}
    assert sorted(per_pos) == ["0", "1", "2", "3"]  # num_speculative_tokens positions
    pos0 = per_pos["0"]
    assert 0 < accepted <= draft_tokens and 0 < drafts <= draft_tokens and 0 < pos0 <= drafts
    assert "vllm:spec_decode" not in httpx.get(f"{servers['plain'].url}/metrics", timeout=10).text
