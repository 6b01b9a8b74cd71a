"""Prompt logprobs over HTTP, against transformers' log_softmax (float32, within 1e-4): completions `echo`
with `logprobs` (max_tokens 0 and 1, as lm-evaluation-harness scores), `prompt_logprobs` on completions and
chat, collocated and through the P/D proxy (a scoring request is served whole by a prefill instance, one that
also decodes by a decode instance), and the 400s (stream, a decode leg reading remote KV)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from server_utils import (
    MODEL,
    PdserveProcess,
    ServerProcess,
    all_ready,
    free_port,
    make_model_dir,
    metric_value,
)

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

PROMPT = [1, 504, 3158, 314, 4849, 28, 253, 1345, 4457, 30, 378, 2012, 9843, 17, 5, 900, 77, 4001, 23]


def kv(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("plp-model"))


@pytest.fixture(scope="module")
def hf_logprobs(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def pd(model_dir: Path, tmp_path_factory) -> Iterator[dict[str, PdserveProcess]]:
    logs = tmp_path_factory.mktemp("plp-logs")
    servers: dict[str, PdserveProcess] = {
        "prefill": ServerProcess(model_dir, logs / "prefill.log", "--kv-transfer-config", kv("kv_producer"),
                                 "--side-channel-port", "0"),
        "decode": ServerProcess(model_dir, logs / "decode.log", "--kv-transfer-config", kv("kv_consumer")),
    }
    with all_ready(servers):
        port = free_port()
        proxy = PdserveProcess(logs / "proxy.log", port, ["proxy", "--host", "127.0.0.1", "--port", str(port),
                                                          "--prefill", servers["prefill"].url,
                                                          "--decode", servers["decode"].url])
        try:
            proxy.wait_ready()
            yield {**servers, "proxy": proxy}
        finally:
            proxy.stop()


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json={"model": MODEL, **body}, timeout=120)


def check_echo(choice: dict, prompt: list[int], ref: torch.Tensor, generated: int) -> None:
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(prompt) + generated
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for j in range(1, len(prompt)):
        want = ref[j - 1, prompt[j]].item()
        assert abs(lps["token_logprobs"][j] - want) < 1e-4, j
        best = ref[j - 1].max().item()
        assert abs(max(lps["top_logprobs"][j].values()) - max(want, best)) < 1e-4


def check_prompt_logprobs(entries: list, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's shape: per position None or {token id: {logprob, rank, decoded_token}}, prompt token first."""
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        row = ref[j - 1]
        entry = entries[j]
        mine = entry[str(prompt[j])]
        assert abs(mine["logprob"] - row[prompt[j]].item()) < 1e-4
        assert mine["rank"] == int((row > row[prompt[j]]).sum()) + 1
        top_vals, top_ids = torch.topk(row, k)
        for rank, (tid, val) in enumerate(zip(top_ids.tolist(), top_vals.tolist(), strict=True), start=1):
            assert entry[str(tid)]["rank"] == rank and abs(entry[str(tid)]["logprob"] - val) < 1e-4
        assert len(entry) in (k, k + 1)


@pytest.mark.parametrize("where", ["decode", "proxy"])
def test_echo_scoring_matches_hf(pd, hf_logprobs, where: str) -> None:
    """lm-evaluation-harness's loglikelihood request (token prompt, echo, logprobs 1, max_tokens 1), and
    OpenAI's max_tokens 0 form: collocated on one instance, and through the P/D proxy."""
    ref = hf_logprobs(PROMPT)
    url = pd[where].url
    one = post(url, "completions", {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1,
                                    "temperature": 0})
    assert one.status_code == 200, one.text
    check_echo(one.json()["choices"][0], PROMPT, ref, generated=1)
    zero = post(url, "completions", {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert zero.status_code == 200, zero.text
    choice = zero.json()["choices"][0]
    check_echo(choice, PROMPT, ref, generated=0)
    assert choice["logprobs"]["token_logprobs"] == one.json()["choices"][0]["logprobs"]["token_logprobs"][:-1]
    tokens = httpx.post(f"{pd['decode'].url}/detokenize", json={"model": MODEL, "tokens": PROMPT}).json()["prompt"]
    assert choice["text"] == tokens  # the prompt alone


def test_scoring_goes_to_prefill_and_generation_to_decode(pd, hf_logprobs) -> None:
    """Through the proxy: a scoring request (at most one token out) is served whole by the prefill instance;
    one that generates more is served whole by a decode instance; both with HF's values."""
    ref = hf_logprobs(PROMPT)

    def served(role: str) -> float:  # finished requests, whatever their finish reason
        text = httpx.get(f"{pd[role].url}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total{"))

    def paths() -> str:
        return httpx.get(f"{pd['proxy'].url}/metrics").text

    before = {role: served(role) for role in ("prefill", "decode")}
    scored_before = metric_value(paths(), 'pdserve_proxy_requests_total{path="prefill_local"}')
    r = post(pd["proxy"].url, "completions", {"prompt": PROMPT, "prompt_logprobs": 3, "max_tokens": 1})
    assert r.status_code == 200, r.text
    check_prompt_logprobs(r.json()["choices"][0]["prompt_logprobs"], PROMPT, ref, 3)
    assert served("prefill") == before["prefill"] + 1 and served("decode") == before["decode"]
    assert metric_value(paths(), 'pdserve_proxy_requests_total{path="prefill_local"}') == scored_before + 1
    chat = post(pd["proxy"].url, "chat/completions", {"messages": [{"role": "user", "content": "Hello there"}],
                                                      "prompt_logprobs": 2, "max_tokens": 6, "temperature": 0,
                                                      "return_token_ids": True})
    assert chat.status_code == 200, chat.text
    assert served("decode") == before["decode"] + 1 and served("prefill") == before["prefill"] + 1
    ids, entries = chat.json()["prompt_token_ids"], chat.json()["prompt_logprobs"]
    check_prompt_logprobs(entries, ids, hf_logprobs(ids), 2)


def test_stream_echo_logprobs_and_refusals(pd, hf_logprobs) -> None:
    url = pd["decode"].url
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 2,
                                                 "max_tokens": 3, "temperature": 0, "stream": True}, timeout=120)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    check_echo(first, PROMPT, hf_logprobs(PROMPT), generated=len(first["logprobs"]["tokens"]) - len(PROMPT))
    for body, param in (({"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                        ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
                        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
                        # a decode leg reads its prompt's KV: no logits for the prompt positions
                        ({"prompt": PROMPT, "prompt_logprobs": 1, "kv_transfer_params": {
                            "do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [0],
                            "remote_host": "127.0.0.1", "remote_port": 1}}, "prompt_logprobs")):
        bad = post(url, "completions", body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
