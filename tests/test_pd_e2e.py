"""Disaggregated prefill/decode end to end: real `pdserve serve` producer and consumer processes, real
NIXL DRAM transfers, the two HTTP legs exactly as vLLM's toy proxy sends them. Outputs must be
token-identical to a collocated instance; failures must be bounded in time and never give wrong output.

The module's instances share a KV side-channel secret (PDSERVE_KV_SECRET), as `pdserve up` gives its own;
the loopback default without one is what test_pd_vllm_compat, test_proxy_e2e and the kv_transfer tests run.
Params naming a lease the producer does not hold (forged, replayed, expired, someone else's) are the
client's mistake: a 4xx with the reason, never a 500 or a failed transfer.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess, all_ready, make_model_dir, metric_value, wait_idle

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

COMMON = ("--max-model-len", "512", "--num-gpu-blocks-override", "128", "--block-size", "16")
TOY_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None}
LEASE_S = 2
SECRET_ENV = {"PDSERVE_KV_SECRET": "pd-e2e-" + os.urandom(16).hex()}


def kv_config(role: str, policy: str = "fail", **extra) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {"transfer_timeout_s": 2.0, "handshake_timeout_s": 2.0,
                                                     **extra}})


def start(model_dir: Path, logs: Path, name: str, *args: str, env: dict | None = None) -> ServerProcess:
    srv = ServerProcess(model_dir, logs / f"{name}.log", *COMMON, *args, env={**SECRET_ENV, **(env or {})})
    srv.name = name  # type: ignore[attr-defined]
    return srv


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("pd-model"))


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory, pd_reference) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("pd-logs")
    servers = {
        "prefill": start(model_dir, logs, "prefill", "--kv-transfer-config",
                         kv_config("kv_producer", kv_lease_duration=LEASE_S), "--side-channel-port", "0"),
        "decode": start(model_dir, logs, "decode", "--kv-transfer-config", kv_config("kv_consumer", "fail")),
        "decode_recompute": start(model_dir, logs, "decode_recompute", "--kv-transfer-config",
                                  kv_config("kv_consumer", "recompute")),
    }
    with all_ready(servers):
        yield {**servers, "collocated": pd_reference.wait_ready()}  # conftest's, for the session


def prefill_leg(prefill: ServerProcess, route: str, body: dict, request_id: str) -> dict:
    """What vLLM's toy proxy sends to the prefill instance."""
    p = copy.deepcopy(body)
    p["kv_transfer_params"] = dict(TOY_PREFILL_PARAMS)
    p["stream"] = False
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        p.pop(key, None)
    r = httpx.post(f"{prefill.url}/v1/{route}", json=p, timeout=60,
                   headers={"X-Request-Id": request_id, "Authorization": "Bearer None"})
    r.raise_for_status()
    return r.json()["kv_transfer_params"]


def decode_leg(decode: ServerProcess, route: str, body: dict, params: dict, request_id: str) -> httpx.Response:
    d = copy.deepcopy(body)
    d["kv_transfer_params"] = params
    return httpx.post(f"{decode.url}/v1/{route}", json=d, timeout=60,
                      headers={"X-Request-Id": request_id, "Authorization": "Bearer None"})


def text_of(route: str, resp: httpx.Response, stream: bool) -> tuple[str, list[str]]:
    """(generated text, finish reasons) from a JSON or SSE response."""
    if not stream:
        data = resp.json()
        ch = data["choices"][0]
        return (ch["text"] if route == "completions" else ch["message"]["content"]), [ch["finish_reason"]]
    text, reasons = "", []
    for line in resp.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for ch in chunk.get("choices", []):
            text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            if ch.get("finish_reason"):
                reasons.append(ch["finish_reason"])
    return text, reasons


def long_prompt(n_words: int, seed: int) -> str:
    words = ["alpha", "river", "stone", "cloud", "seven", "orange", "signal", "quiet", "market", "engine"]
    return " ".join(words[(i * 7 + seed) % len(words)] + str(i % 13) for i in range(n_words))


CASES = [
    ("completions", {"prompt": "Hi", "max_tokens": 8}),  # shorter than one block
    ("completions", {"prompt": long_prompt(20, 1), "max_tokens": 12}),  # a few blocks
    ("completions", {"prompt": long_prompt(120, 2), "max_tokens": 16}),  # many blocks
    ("chat/completions", {"messages": [{"role": "user", "content": long_prompt(30, 3)}], "max_tokens": 10}),
    ("chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Name a colour."}], "max_tokens": 6}),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route,body", CASES)
def test_disaggregated_matches_collocated(cluster, route, body, stream):
    body = {"model": "tiny", "temperature": 0, **body, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    ref = httpx.post(f"{cluster['collocated'].url}/v1/{route}", json=body, timeout=60)
    rid = f"pd-{route.replace('/', '-')}-{stream}-{len(json.dumps(body))}"
    params = prefill_leg(cluster["prefill"], route, body, rid)
    assert params["do_remote_prefill"] is True and params["remote_block_ids"][0]
    out = decode_leg(cluster["decode"], route, body, params, rid)
    assert out.status_code == 200, out.text
    assert text_of(route, out, stream) == text_of(route, ref, stream)
    wait_idle(cluster["decode"].url)
    wait_idle(cluster["prefill"].url)  # the consumer's release freed the producer's blocks


def test_decode_side_prefix_cache_pulls_only_missing_blocks(cluster):
    decode = cluster["decode"]
    body = {"model": "tiny", "prompt": long_prompt(150, 5), "max_tokens": 8, "temperature": 0}
    ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=body, timeout=60).json()
    sums = []
    for i in range(2):
        before = httpx.get(f"{decode.url}/metrics").text
        params = prefill_leg(cluster["prefill"], "completions", body, f"prefix-{i}")
        out = decode_leg(decode, "completions", body, params, f"prefix-{i}").json()
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]
        after = httpx.get(f"{decode.url}/metrics").text
        sums.append(metric_value(after, "vllm:nixl_bytes_transferred_sum")
                    - metric_value(before, "vllm:nixl_bytes_transferred_sum"))
    assert sums[0] > 0
    assert sums[1] < sums[0] / 4  # the second time the decode's own prefix cache holds all but the tail
    wait_idle(decode.url)
    wait_idle(cluster["prefill"].url)


def test_malformed_params_are_400(cluster):
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
    for bad in ({"do_remote_prefill": True},  # partial
                {"do_remote_prefill": True, "remote_block_ids": "x", "remote_engine_id": 1,
                 "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": "nope"}):
        r = decode_leg(cluster["decode"], "completions", body, bad, "bad")
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.count("invalid kv_transfer_params:") == 1, message
        assert r.json()["error"]["param"] == "kv_transfer_params"
    # one producer lease serves one prompt: several prompts cannot share it (n > 1 choices can: they fork)
    params = prefill_leg(cluster["prefill"], "completions", body, "n2")
    r = decode_leg(cluster["decode"], "completions", {**body, "prompt": ["hello there", "general kenobi"]}, params,
                   "n2")
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    ok = decode_leg(cluster["decode"], "completions", {**body, "n": 2}, params, "n2")  # the lease is still there
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2, ok.text
    wait_idle(cluster["prefill"].url)
    wait_idle(cluster["decode"].url)


def _expired_count(url: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics").text, "vllm:nixl_num_kv_expired_reqs_total")


def test_lease_expiry_frees_blocks_and_a_late_pull_is_refused_or_recomputed_by_policy(cluster):
    prefill = cluster["prefill"]
    body = {"model": "tiny", "prompt": long_prompt(40, 9), "max_tokens": 8, "temperature": 0}
    before = _expired_count(prefill.url)
    p_fail = prefill_leg(prefill, "completions", body, "late-fail")
    p_recompute = prefill_leg(prefill, "completions", body, "late-recompute")
    deadline = time.monotonic() + 30
    while _expired_count(prefill.url) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _expired_count(prefill.url) == before + 2  # nobody pulled: both leases expired, counted
    wait_idle(prefill.url)  # and their blocks are free
    # An expired lease under `fail` is the client's late params: 410, not a failed transfer. Under `recompute`
    # the leg is honest but late (the producer says `expired` only to the lease's own token): it computes the
    # prompt and answers exactly what the collocated instance does.
    late = decode_leg(cluster["decode"], "completions", body, p_fail, "late-decode")
    assert late.status_code == 410, late.text
    err = late.json()["error"]
    assert err["param"] == "kv_transfer_params" and "expired" in err["message"], err
    rec = cluster["decode_recompute"]
    failed, rejected = _failed_transfers(rec.url), _labelled(rec.url, "pdserve:kv_lease_rejected_total")
    late = decode_leg(rec, "completions", body, p_recompute, "late-decode_recompute")
    ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=body, timeout=60)
    assert late.status_code == 200, late.text
    assert text_of("completions", late, False) == text_of("completions", ref, False)
    assert _failed_transfers(rec.url) == failed  # counted as what it is: an expired lease, not a failed READ
    after = _labelled(rec.url, "pdserve:kv_lease_rejected_total")
    assert after.get("expired", 0) == rejected.get("expired", 0) + 1
    # ... while forged params (a wrong token) for the same expired lease are still the client's error
    forged = decode_leg(rec, "completions", body, {**p_recompute, "remote_lease_token": "forged-" + "y" * 24},
                        "late-forged")
    assert forged.status_code == 400 and "(bad_token)" in forged.json()["error"]["message"], forged.text
    for name in ("decode", "decode_recompute", "prefill"):
        wait_idle(cluster[name].url)


def _failed_transfers(url: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics").text, "vllm:nixl_num_failed_transfers_total")


def _labelled(url: str, name: str) -> dict[str, float]:
    """A `pdserve:*_total{..., reason=...}` counter by reason."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            out[line.split('reason="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_params_naming_a_lease_the_producer_does_not_hold_are_client_errors(cluster, stream):
    """Forged, replayed and duplicated params: a 4xx naming the reason (also for a stream: before any byte),
    counted as lease rejections on the decode and as refusals on the prefill, never as failed transfers."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    body = {"model": "tiny", "prompt": long_prompt(30, 7), "max_tokens": 4, "temperature": 0, "stream": stream}
    ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json={**body, "stream": False}, timeout=60)
    failed = _failed_transfers(decode.url)
    refusals_before = _labelled(prefill.url, "pdserve:kv_side_channel_refused_total")
    params = prefill_leg(prefill, "completions", body, f"forge-{stream}")

    def refused(bad: dict, status: int, reason: str) -> None:
        r = decode_leg(decode, "completions", body, bad, f"forge-{stream}-{reason}")
        assert r.status_code == status, (reason, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == "kv_transfer_params" and f"({reason})" in err["message"], err
        assert params["remote_lease_token"] not in r.text

    # (each answer holds however long the module's 2 s lease takes to expire: an expired lease also refuses
    # a wrong token as bad_token; the honest request below is sent at once, as in the other tests)
    refused({**params, "remote_lease_token": "forged-" + "x" * 24}, 400, "bad_token")
    refused({**params, "remote_request_id": "cmpl-never-issued"}, 410, "unknown")
    # an honest request works; its params replayed afterwards name a lease that is gone
    params = prefill_leg(prefill, "completions", body, f"forge-{stream}-honest")
    ok = decode_leg(decode, "completions", body, params, f"forge-{stream}-ok")
    assert ok.status_code == 200 and text_of("completions", ok, stream) == text_of("completions", ref, False)
    refused(params, 410, "unknown")
    # params for a shorter prompt than this one (edited, or another request's): the lease cannot serve it
    params = prefill_leg(prefill, "completions", {**body, "prompt": "hello"}, f"forge-{stream}-short")
    refused(params, 400, "mismatch")
    assert _failed_transfers(decode.url) == failed
    rejected = _labelled(decode.url, "pdserve:kv_lease_rejected_total")
    assert rejected.get("bad_token", 0) >= 1 and rejected.get("unknown", 0) >= 2 and rejected.get("mismatch", 0) >= 1
    after = _labelled(prefill.url, "pdserve:kv_side_channel_refused_total")
    assert after.get("bad_token", 0) == refusals_before.get("bad_token", 0) + 1
    assert after.get("unknown", 0) == refusals_before.get("unknown", 0) + 2
    assert " ERROR " not in decode.log_path.read_text()
    for name in ("decode", "prefill"):
        wait_idle(cluster[name].url)


def test_the_instances_side_channel_is_authenticated(cluster, model_dir, tmp_path):
    info = httpx.get(f"{cluster['prefill'].url}/pdserve/info").json()
    assert info["side_channel_auth"] is True and SECRET_ENV["PDSERVE_KV_SECRET"] not in json.dumps(info)
    # a consumer without the deployment secret cannot use the producer: a transport failure, and a clear one
    outsider = ServerProcess(model_dir, tmp_path / "outsider.log", *COMMON, "--kv-transfer-config",
                             kv_config("kv_consumer"), env={"PDSERVE_KV_SECRET": ""})
    try:
        outsider.wait_ready()
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}
        params = prefill_leg(cluster["prefill"], "completions", body, "outsider")
        r = decode_leg(outsider, "completions", body, params, "outsider")
        assert r.status_code == 500 and "requires the deployment secret" in r.json()["error"]["message"], r.text
    finally:
        outsider.stop()
    # without a secret, a producer refuses to listen beyond loopback unless told to
    proc = subprocess.run([sys.executable, "-m", "pdserve", "serve", str(model_dir), "--kv-transfer-config",
                           kv_config("kv_producer"), "--side-channel-host", "0.0.0.0", "--port", "1"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PDSERVE_KV_SECRET": ""})
    assert proc.returncode == 1 and "--insecure-side-channel" in proc.stderr, proc.stderr


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_dead_or_frozen_producer_fails_fast_or_recomputes(cluster, model_dir, tmp_path, how):
    victim = start(model_dir, tmp_path, f"victim-{how}", "--kv-transfer-config", kv_config("kv_producer"),
                   "--side-channel-port", "0")
    try:
        victim.wait_ready()
        body = {"model": "tiny", "prompt": long_prompt(40, 11), "max_tokens": 8, "temperature": 0}
        ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=body, timeout=60).json()
        p1 = prefill_leg(victim, "completions", body, f"{how}-1")
        p2 = prefill_leg(victim, "completions", body, f"{how}-2")
        os.kill(victim.proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        failed = decode_leg(cluster["decode"], "completions", body, p1, f"{how}-1")
        elapsed = time.monotonic() - t0
        assert failed.status_code >= 500 and "error" in failed.json(), failed.text
        assert elapsed < 30  # bounded (the configured timeouts are 2 s); never a hang
        rec = decode_leg(cluster["decode_recompute"], "completions", body, p2, f"{how}-2")
        assert rec.status_code == 200 and rec.json()["choices"][0]["text"] == ref["choices"][0]["text"]
        # the consumers keep serving others
        params = prefill_leg(cluster["prefill"], "completions", body, f"{how}-after")
        ok = decode_leg(cluster["decode"], "completions", body, params, f"{how}-after")
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == ref["choices"][0]["text"]
        for name in ("decode", "decode_recompute", "prefill"):
            wait_idle(cluster[name].url)
    finally:
        if how == "stop" and victim.proc.poll() is None:
            os.kill(victim.proc.pid, signal.SIGCONT)
        victim.proc.kill()
        victim.stop()


def test_tcp_transport(cluster, model_dir, tmp_path):
    """UCX_TLS=self,tcp: the asynchronous path a real network takes (posts return PROC, the target must
    keep progressing). The reference is the cluster's collocated instance (no NIXL: UCX_TLS changes nothing)."""
    env = {"UCX_TLS": "self,tcp", "UCX_NET_DEVICES": "lo"}
    servers = [start(model_dir, tmp_path, "tcp-prefill", "--kv-transfer-config", kv_config("kv_producer"),
                     "--side-channel-port", "0", env=env),
               start(model_dir, tmp_path, "tcp-decode", "--kv-transfer-config", kv_config("kv_consumer"), env=env)]
    try:
        for s in servers:
            s.wait_ready()
        prefill, decode = servers
        colo = cluster["collocated"]
        body = {"model": "tiny", "prompt": long_prompt(100, 4), "max_tokens": 10, "temperature": 0}
        ref = httpx.post(f"{colo.url}/v1/completions", json=body, timeout=60).json()
        params = prefill_leg(prefill, "completions", body, "tcp")
        out = decode_leg(decode, "completions", body, params, "tcp")
        assert out.status_code == 200 and out.json()["choices"][0]["text"] == ref["choices"][0]["text"]
        wait_idle(decode.url)
        wait_idle(prefill.url)
    finally:
        for s in servers:
            s.stop()


def test_cpu_default_blocks_of_128_in_head_major_pools_transfer_exactly(model_dir, tmp_path):
    """The CPU defaults (blocks of 128 tokens, head-major (layer, K|V) regions): a prompt of several blocks
    moves over NIXL and decodes to the collocated instance's tokens; both sides report the layout."""
    from pdserve.kv_transfer.compat import HEAD_MAJOR_LAYOUT

    args = ("--max-model-len", "512", "--num-gpu-blocks-override", "24", "--block-size", "128")

    def start128(name: str, *extra: str) -> ServerProcess:
        return ServerProcess(model_dir, tmp_path / f"{name}.log", *args, *extra, env=SECRET_ENV)

    servers = {"prefill": start128("p128", "--kv-transfer-config", kv_config("kv_producer"),
                                   "--side-channel-port", "0"),
               "decode": start128("d128", "--kv-transfer-config", kv_config("kv_consumer")),
               "collocated": start128("c128")}
    with all_ready(servers):
        prefill, decode, colo = servers["prefill"], servers["decode"], servers["collocated"]
        for srv in servers.values():
            info = httpx.get(f"{srv.url}/pdserve/info", timeout=10).json()
            assert info["block_size"] == 128 and info["kv_layout"] == HEAD_MAJOR_LAYOUT
        body = {"model": "tiny", "prompt": long_prompt(140, 5), "max_tokens": 12, "temperature": 0}
        ref = httpx.post(f"{colo.url}/v1/completions", json=body, timeout=60).json()
        assert ref["usage"]["prompt_tokens"] > 2 * 128
        before = httpx.get(f"{decode.url}/metrics").text
        params = prefill_leg(prefill, "completions", body, "b128")
        out = decode_leg(decode, "completions", body, params, "b128")
        assert out.status_code == 200 and out.json()["choices"][0]["text"] == ref["choices"][0]["text"]
        moved = (metric_value(httpx.get(f"{decode.url}/metrics").text, "vllm:nixl_bytes_transferred_sum")
                 - metric_value(before, "vllm:nixl_bytes_transferred_sum"))
        assert moved > 0 and moved % (2 * 128) == 0  # whole blocks of K and V rows
        wait_idle(decode.url)
        wait_idle(prefill.url)
