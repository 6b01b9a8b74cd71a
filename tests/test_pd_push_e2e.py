"""Push transfer (`kv_connector: NixlPushConnector`, pdserve/kv_transfer/push_*.py) end to end: real `pdserve
serve` prefill and decode processes, real NIXL WRITEs, both HTTP legs sent at once as the proxy sends them.

Token-exact with a collocated instance, layer-pipelined and whole-request, streaming and not; the decode's own
prefix cache makes it register (and receive) only the blocks it lacks; a mismatched pair (push with pull) is
refused naming the mode; and the failure rows of vllm-project/vllm#48633: a decode abort stops the prefill and
nothing lands in the freed blocks, a WRITE that fails is learnt at once, a dead prefill fails the decode (or
recomputes) within a bound, a push that never comes frees the decode's blocks.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import (
    PdserveProcess,
    ServerProcess,
    all_ready,
    free_port,
    make_model_dir,
    metric_value,
    wait_idle,
)

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_pd_e2e import SECRET_ENV, long_prompt, start  # noqa: E402 - after the skip
from test_pd_first_token_e2e import sse_tokens  # noqa: E402

from pdserve.api import pd  # noqa: E402

HEADERS = {"Authorization": "Bearer None"}
SLACK = {"transfer_timeout_s": 10.0, "handshake_timeout_s": 10.0}


def push_config(role: str, policy: str = "fail", **extra) -> str:
    return json.dumps({"kv_connector": "NixlPushConnector", "kv_role": role, "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {**SLACK, **extra}})


def pull_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": SLACK})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("push-model"))


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory, pd_reference) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("push-logs")
    servers = {
        # every prompt layer by layer (the tests' prompts are shorter than the default push_layerwise_min_tokens)
        "prefill": start(model_dir, logs, "prefill", "--kv-transfer-config",
                         push_config("kv_producer", push_layerwise_min_tokens=0), "--side-channel-port", "0"),
        "prefill_whole": start(model_dir, logs, "prefill_whole", "--kv-transfer-config",
                               push_config("kv_producer", push_pipeline="request"), "--side-channel-port", "0"),
        "decode": start(model_dir, logs, "decode", "--kv-transfer-config",
                        push_config("kv_consumer", push_registration_timeout=4.0),
                        env={"PDSERVE_STEP_LOG": str(logs / "decode-steps.jsonl")}),
        "decode_recompute": start(model_dir, logs, "decode_recompute", "--kv-transfer-config",
                                  push_config("kv_consumer", "recompute", push_registration_timeout=4.0)),
        "pull_prefill": start(model_dir, logs, "pull_prefill", "--kv-transfer-config", pull_config("kv_producer"),
                              "--side-channel-port", "0"),
    }
    with all_ready(servers):
        port = free_port()
        proxy = PdserveProcess(logs / "proxy.log", port, [
            "proxy", "--host", "127.0.0.1", "--port", str(port), "--prefill", servers["prefill"].url,
            "--decode", servers["decode"].url, "--kv-transfer-mode", "push"])
        try:
            proxy.wait_ready()
            yield {**servers, "collocated": pd_reference.wait_ready(),  # conftest's, for the session
                   "proxy": proxy, "logs": logs}  # type: ignore[dict-item]
        finally:
            proxy.stop()


def info(srv: ServerProcess) -> dict:
    return httpx.get(f"{srv.url}/pdserve/info", timeout=10).json()


class Leg(threading.Thread):
    """One HTTP leg in flight on its own thread."""

    def __init__(self, url: str, route: str, payload: dict, rid: str):
        super().__init__(daemon=True)
        self.url, self.route, self.payload, self.rid = url, route, payload, rid
        self.resp: httpx.Response | None = None
        self.start()

    def run(self) -> None:
        self.resp = httpx.post(f"{self.url}/v1/{self.route}", json=self.payload, timeout=90,
                               headers={"X-Request-Id": self.rid, **HEADERS})

    def result(self) -> httpx.Response:
        self.join(90)
        assert self.resp is not None, "the leg did not answer"
        return self.resp


def push_pair(prefill: ServerProcess, decode: ServerProcess, body: dict, route: str = "completions",
              *, send_prefill: bool = True) -> tuple[Leg, Leg | None, str]:
    """Both legs at once, as `pdserve proxy --kv-transfer-mode push` sends them."""
    key = uuid.uuid4().hex
    i = info(prefill)
    dparams = pd.push_decode_params(key, engine_id=i["engine_id"], host=i["side_channel_host"],
                                    port=i["side_channel_port"])
    d = Leg(decode.url, route, pd.build_decode_body(body, dparams), f"d-{key}")
    p = None
    if send_prefill:
        p = Leg(prefill.url, route, pd.build_prefill_body(body, push_key=key), f"p-{key}")
    return d, p, key


def prompt(seed: int, words: int) -> str:
    """A prompt no other test's shares a prefix with (long_prompt repeats for seeds equal mod 10)."""
    return f"case {seed}: " + long_prompt(words, seed)


def body(seed: int, words: int = 120, **kw) -> dict:
    return {"model": "tiny", "prompt": prompt(seed, words), "max_tokens": 10, "temperature": 0,
            "return_token_ids": True, **kw}


def pushed_bytes(url: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics", timeout=10).text, "vllm:nixl_bytes_transferred_sum") or 0.0


def check_pushed_exactly(collocated: ServerProcess, prefill: ServerProcess, decode: ServerProcess, b: dict) -> None:
    """Both legs at once; the decode's answer is the collocated one, token for token (10 tokens)."""
    ref = httpx.post(f"{collocated.url}/v1/completions", json=b, timeout=60)
    d, p, _ = push_pair(prefill, decode, b)
    assert p is not None
    pout = p.result()
    assert pout.status_code == 200, pout.text
    assert pout.json()["kv_transfer_params"]["transfer_mode"] == "push"
    out = d.result()
    assert out.status_code == 200, out.text
    if b.get("stream"):
        assert sse_tokens(out) == sse_tokens(ref) and len(sse_tokens(out)) == 10
    else:
        assert out.json()["choices"][0]["token_ids"] == ref.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prefill", ["prefill", "prefill_whole"])
def test_push_matches_collocated(cluster, prefill, stream):
    check_pushed_exactly(cluster["collocated"], cluster[prefill], cluster["decode"], body(1 + stream, stream=stream))
    wait_idle(cluster["decode"].url)
    wait_idle(cluster[prefill].url)  # the push ended its lease: the prefill's blocks are free again


def decode_step_line(logs: Path, rid: str) -> dict:
    """The decode engine's lifecycle line of a finished request (PDSERVE_STEP_LOG)."""
    for line in (logs / "decode-steps.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rid in rec.get("request", ""):
            return rec
    raise AssertionError(f"no step-log line for {rid}")


@pytest.mark.parametrize("prefill", ["prefill", "prefill_whole"])
def test_push_decode_adopts_the_prefills_first_token(cluster, prefill):
    """The decode leg, sent before the prefill ran, starts from the token the prefill sampled (sent with the
    push's completion), so the first token and every prompt position's KV come from one prefill forward, as
    in a pull: no decode step recomputes the last prompt token (on a GPU that recompute rounds differently
    and greedy tokens drift). With `push_first_token: false` (choice 0 of n > 1) it recomputes; both exact,
    with logprobs too (the recomputed step's logprobs equal to rounding, the adopted ones to the bit)."""
    b = body(51 + (prefill == "prefill_whole"), words=100, max_tokens=8, logprobs=2)
    ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=b, timeout=60).json()
    n_prompt = ref["usage"]["prompt_tokens"]
    want = ref["choices"][0]["token_ids"]
    for adopt in (True, False):
        key = uuid.uuid4().hex
        i = info(cluster[prefill])
        dparams = pd.push_decode_params(key, engine_id=i["engine_id"], host=i["side_channel_host"],
                                        port=i["side_channel_port"])
        if not adopt:
            dparams = pd.without_first_token(dparams)
        d = Leg(cluster["decode"].url, "completions", pd.build_decode_body(b, dparams), f"d-{key}")
        p = Leg(cluster[prefill].url, "completions", pd.build_prefill_body(b, push_key=key), f"p-{key}")
        pout = p.result()
        assert pout.status_code == 200, pout.text
        assert pout.json()["kv_transfer_params"][pd.FIRST_TOKEN_ID] == want[0]
        out = d.result()
        assert out.status_code == 200, out.text
        got = out.json()["choices"][0]
        assert got["token_ids"] == want, adopt
        tops, ref_tops = got["logprobs"]["top_logprobs"], ref["choices"][0]["logprobs"]["top_logprobs"]
        if adopt:  # one forward made both: equal to the bit
            assert tops == ref_tops
        else:  # a one-token step's rounding (the drift this adoption removes)
            assert [t.keys() for t in tops] == [t.keys() for t in ref_tops]
            assert [list(t.values()) for t in tops] == [pytest.approx(list(t.values()), abs=1e-4) for t in ref_tops]
        wait_idle(cluster["decode"].url)
        line = decode_step_line(cluster["logs"], key)
        # adopted: the whole prompt came over and no step computed a prompt token; else the last one was
        assert line["cached_tokens"] == (n_prompt if adopt else n_prompt - 1), (adopt, line)
    wait_idle(cluster[prefill].url)


def metrics_of(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def labelled(text: str, name: str, label: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


PROXY_CASES = [
    ("completions", {"prompt": prompt(21, 150), "max_tokens": 8}),
    # two prompts sharing a 100-word prefix: the second's decode registers only the blocks its cache lacks
    ("completions", {"prompt": prompt(22, 100) + " and then more words follow here", "max_tokens": 8}),
    ("completions", {"prompt": prompt(22, 100) + " but a different ending comes", "max_tokens": 8}),
    ("completions", {"prompt": prompt(23, 60), "max_tokens": 6, "n": 2, "temperature": 0}),
    ("chat/completions", {"messages": [{"role": "user", "content": prompt(24, 50)}], "max_tokens": 8}),
]


@pytest.mark.parametrize("stream", [False, True])
def test_proxy_push_matches_collocated(cluster, stream):
    """`pdserve proxy --kv-transfer-mode push`: both legs at once, token-exact with collocated."""
    proxy = cluster["proxy"].url  # type: ignore[attr-defined]
    before = metrics_of(cluster["prefill"].url)
    for route, case in PROXY_CASES:
        b = {"model": "tiny", "temperature": 0, **case, "stream": stream}
        ref = httpx.post(f"{cluster['collocated'].url}/v1/{route}", json=b, timeout=60)
        out = httpx.post(f"{proxy}/v1/{route}", json=b, timeout=90, headers=HEADERS)
        assert out.status_code == 200, out.text
        if stream:
            assert [ln for ln in out.text.splitlines() if '"content"' in ln or '"text"' in ln]
            assert _stream_text(out) == _stream_text(ref), (route, case)
        else:
            assert [c.get("text") or c["message"]["content"] for c in out.json()["choices"]] == \
                [c.get("text") or c["message"]["content"] for c in ref.json()["choices"]], (route, case)
    after = metrics_of(cluster["prefill"].url)
    # the KV went by push, and (layer-pipelined) mostly while the prefill was still computing
    during = labelled(after, "pdserve:kv_push_written_bytes_total", "during_prefill") - \
        labelled(before, "pdserve:kv_push_written_bytes_total", "during_prefill")
    assert during > 0

    def writer(name: str) -> float:  # the push writer's counters (kv_transfer/push_stats.py)
        return labelled(after, f"pdserve:kv_push_writer_{name}_total", "model_name") - \
            labelled(before, f"pdserve:kv_push_writer_{name}_total", "model_name")

    assert writer("posts_during_prefill") > 0 and writer("descriptors") >= writer("posts") > 0
    assert writer("writes_done") == writer("posts") and writer("bytes") == during + (
        labelled(after, "pdserve:kv_push_written_bytes_total", "after_prefill")
        - labelled(before, "pdserve:kv_push_written_bytes_total", "after_prefill"))
    # every job ended well: done, or cancelled by a decode whose own prefix cache held the whole prompt (the
    # streamed pass repeats the prompts)
    ended = sum(labelled(after, "pdserve:kv_push_jobs_ended_total", f'"{o}"')
                - labelled(before, "pdserve:kv_push_jobs_ended_total", f'"{o}"') for o in ("done", "cancelled"))
    assert ended == len(PROXY_CASES)
    wait_idle(cluster["decode"].url)
    wait_idle(cluster["prefill"].url)


def _stream_text(resp: httpx.Response) -> list[str]:
    out: dict[int, str] = {}
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for ch in json.loads(line[6:]).get("choices", []):
                piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                out[ch["index"]] = out.get(ch["index"], "") + (piece or "")
    return [out[k] for k in sorted(out)]


def test_decode_prefix_hit_registers_only_missing_blocks_and_stays_exact(cluster):
    """A partial prefix hit on the decode (vLLM#48633 C3): the decode registers only the blocks it lacks and
    each lands in its own slot: exact tokens, and far fewer bytes the second time."""
    shared = prompt(31, 150)
    sent = []
    for i, tail in enumerate([" first tail of words", " second, other tail of words"]):
        b = body(0, prompt=shared + tail, max_tokens=8)
        ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=b, timeout=60).json()
        before = pushed_bytes(cluster["decode"].url)
        d, p, _ = push_pair(cluster["prefill"], cluster["decode"], b)
        assert p is not None and p.result().status_code == 200
        out = d.result()
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"], i
        sent.append(pushed_bytes(cluster["decode"].url) - before)
    assert sent[0] > 0 and 0 < sent[1] < sent[0] / 4
    wait_idle(cluster["decode"].url)
    wait_idle(cluster["prefill"].url)


def test_mismatched_pairs_are_refused_naming_the_mode(cluster):
    b = body(41, words=40)
    # pull params to a push decode instance, push params to a pull one... a 400 naming the transfer mode
    pull_like = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1], "remote_host": "h",
                 "remote_port": 1, "remote_request_id": "r", "remote_lease_token": "t"}
    r = httpx.post(f"{cluster['decode'].url}/v1/completions", json={**b, "kv_transfer_params": pull_like},
                   timeout=30, headers=HEADERS)
    assert r.status_code == 400 and "NixlPushConnector" in r.text and "transfer_mode" in r.text, r.text
    # a push decode registering with a pull prefill: refused at the handshake, the field named
    d, _, _ = push_pair(cluster["pull_prefill"], cluster["decode"], b, send_prefill=False)
    out = d.result()
    assert out.status_code == 409 and "kv_transfer_mode" in out.text, out.text
    wait_idle(cluster["decode"].url)


def test_decode_abort_stops_the_prefill_and_nothing_lands(cluster):
    """The decode leg is dropped after registering, before the prefill ran (vLLM#48633 C1): the prefill's
    job is cancelled, its prefill then computes and WRITEs nothing, and the decode's freed blocks serve the
    next request exactly."""
    b = body(51)
    key = uuid.uuid4().hex
    i = info(cluster["prefill"])
    dparams = pd.push_decode_params(key, engine_id=i["engine_id"], host=i["side_channel_host"],
                                    port=i["side_channel_port"])
    before = metrics_of(cluster["prefill"].url)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up: the connection closes, the leg is aborted
        httpx.post(f"{cluster['decode'].url}/v1/completions", json=pd.build_decode_body(b, dparams), timeout=1.5,
                   headers=HEADERS)
    wait_idle(cluster["decode"].url)  # blocks back only once the prefill said nothing is in flight
    p = httpx.post(f"{cluster['prefill'].url}/v1/completions", json=pd.build_prefill_body(b, push_key=key),
                   timeout=60, headers=HEADERS)
    assert p.status_code == 200
    wait_idle(cluster["prefill"].url)
    after = metrics_of(cluster["prefill"].url)
    assert labelled(after, "pdserve:kv_push_jobs_ended_total", "cancelled") == \
        labelled(before, "pdserve:kv_push_jobs_ended_total", "cancelled") + 1
    assert labelled(after, "pdserve:kv_push_written_bytes_total", "phase") == \
        labelled(before, "pdserve:kv_push_written_bytes_total", "phase")  # not one byte written
    test_push_matches_collocated(cluster, "prefill", False)


FAIL_OR_RECOMPUTE = (("decode", 500), ("decode_recompute", 200))


def _both_policies(cluster, prefill: ServerProcess, seed: int) -> tuple[list[Leg], list]:
    """A decode leg registered with `prefill` on each policy's decode instance, its prefill leg never sent."""
    b = body(seed, words=60)
    ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=b, timeout=60).json()
    return [push_pair(prefill, cluster[name], b, send_prefill=False)[0] for name, _ in FAIL_OR_RECOMPUTE], \
        ref["choices"][0]["token_ids"]


def _check_policies(cluster, legs: list[Leg], ref: list) -> None:
    for leg, (name, status) in zip(legs, FAIL_OR_RECOMPUTE, strict=True):
        out = leg.result()
        assert out.status_code == status, (name, out.text)
        if status == 200:
            assert out.json()["choices"][0]["token_ids"] == ref  # recomputed into the quiesced blocks
        wait_idle(cluster[name].url)  # the registered blocks were freed


def test_push_that_never_comes_frees_the_blocks(cluster):
    """Registered, but the prefill leg never comes: at push_registration_timeout (4 s here) the prefill
    gives the registration up, the decode learns it and fails (or recomputes, exactly); its blocks are freed."""
    t0 = time.monotonic()
    legs, ref = _both_policies(cluster, cluster["prefill"], 61)
    _check_policies(cluster, legs, ref)
    assert time.monotonic() - t0 < 4.0 + 10.0 + 5.0  # the timeout plus the WRITE release bound, never a hang


def test_prefill_killed_mid_push_fails_or_recomputes_fast(cluster, model_dir, tmp_path):
    victim = start(model_dir, tmp_path, "victim", "--kv-transfer-config", push_config("kv_producer"),
                   "--side-channel-port", "0")
    try:
        victim.wait_ready()
        legs, ref = _both_policies(cluster, victim, 71)
        time.sleep(1.0)  # admitted and registered (the prefill's jobs wait for their prefill legs)
        os.kill(victim.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        for leg in legs:
            leg.join(30)
        assert time.monotonic() - t0 < 3.0  # refused connections: learnt within a few status polls
        _check_policies(cluster, legs, ref)
    finally:
        victim.stop()


def test_a_silent_prefill_is_given_up_and_its_blocks_quarantined(cluster, model_dir, tmp_path):
    """A prefill that stops answering mid-push (SIGSTOP: a frozen process, or a cut link) may still WRITE into
    the registered blocks until the registration's deadline. The decode answers the request once the prefill
    has been silent for transfer_timeout_s (fail: the error names it; recompute: exact tokens, in new blocks)
    and keeps the registered blocks out of its pool until the deadline, then frees them."""
    victim = start(model_dir, tmp_path, "silent", "--kv-transfer-config", push_config("kv_producer"),
                   "--side-channel-port", "0")
    stopped = False
    try:
        victim.wait_ready()
        legs, ref = _both_policies(cluster, victim, 81)
        time.sleep(1.0)  # admitted and registered (the prefill's jobs wait for their prefill legs)
        os.kill(victim.proc.pid, signal.SIGSTOP)
        stopped = True
        fail_leg = legs[0].result()
        assert fail_leg.status_code == 500 and "silent" in fail_leg.text, fail_leg.text
        _check_policies(cluster, legs, ref)  # the recompute is exact; both decodes end with every block free
        for name, _ in FAIL_OR_RECOMPUTE:
            log = (cluster["logs"] / f"{name}.log").read_text()
            assert "kept out of the pool" in log, name
    finally:
        if stopped:
            os.kill(victim.proc.pid, signal.SIGCONT)
        victim.stop()


def expect_the_write_failure_at_once(consumer, prefill_url: str, prefill_body: dict) -> None:
    """A probe consumer registered blocks its agent cannot be written into (started just before): once the prefill
    leg is sent, the push's WRITE fails and the consumer learns it at once, and the prefill frees its blocks."""
    time.sleep(0.5)  # registered
    p = httpx.post(f"{prefill_url}/v1/completions", json=prefill_body, timeout=60, headers=HEADERS)
    assert p.status_code == 200
    t0 = time.monotonic()
    results: list = []
    while not results and time.monotonic() - t0 < 10:
        time.sleep(0.01)
        results = consumer.poll_loads()
    assert results and not results[0].ok, results
    assert time.monotonic() - t0 < 2.0  # at once, not at the 30 s deadline
    assert "WRITE" in (results[0].error or ""), results[0].error
    wait_idle(prefill_url)  # the failed job gave the prefill's blocks back


def test_a_write_that_fails_to_post_is_learnt_at_once(cluster, model_dir):
    """vLLM#48633 C2: the prefill's WRITE cannot be posted (the registered pool names memory the decode's agent
    never registered); the decode side learns it from push_status at once, long before its deadline. The decode
    half is a real push consumer (KVConsumer over a PushReceiver) on a real NIXL agent in this process (only its
    pool description is wrong)."""
    import dataclasses

    import numpy as np
    from prometheus_client import CollectorRegistry

    from pdserve.kv_transfer import side_channel
    from pdserve.kv_transfer.auth import MessageAuth
    from pdserve.kv_transfer.compat import make_compat
    from pdserve.kv_transfer.config import KVTransferConfig
    from pdserve.kv_transfer.consumer import KVConsumer
    from pdserve.kv_transfer.local_kv import LocalKV
    from pdserve.kv_transfer.messages import Handshake
    from pdserve.kv_transfer.metrics import TransferMetrics
    from pdserve.kv_transfer.nixl_agent import NixlAgent
    from pdserve.kv_transfer.pool import region_of
    from pdserve.kv_transfer.push_receiver import PushReceiver
    from pdserve.server.kv import model_identity

    secret = SECRET_ENV["PDSERVE_KV_SECRET"]
    i = info(cluster["prefill"])
    compat = make_compat(model=model_identity(model_dir), dtype=i["dtype"], block_size=i["block_size"],
                         num_layers=i["num_layers"], num_kv_heads=i["num_kv_heads"], head_dim=i["head_dim"],
                         kv_layout=i["kv_layout"], kv_cache_dtype=i["kv_cache_dtype"])
    compat["kv_transfer_mode"] = "push"
    hello = side_channel.call(i["side_channel_host"], i["side_channel_port"],
                              Handshake(engine_id="probe", compat=compat), 10.0, to=i["engine_id"],
                              auth=MessageAuth(secret))
    pool_info = hello.pool
    config = KVTransferConfig.from_json(push_config("kv_consumer", push_registration_timeout=30.0),
                                        env={"PDSERVE_KV_SECRET": secret})
    pool = np.zeros((pool_info.num_blocks, 1, 2, pool_info.block_bytes // 2, 1, 1), dtype=np.uint8)
    real = region_of(pool)
    agent = NixlAgent(config.engine_id, config.backends)
    agent.register(real)
    wrong = dataclasses.replace(real, base_addr=real.base_addr + 2 * real.length)  # not registered memory
    metrics = TransferMetrics(model_name="tiny", registry=CollectorRegistry())
    consumer = KVConsumer(LocalKV(config, agent, wrong, hello.compat, metrics, MessageAuth(secret)), PushReceiver)
    try:
        b = body(81, words=60)
        key = uuid.uuid4().hex
        params = pd.push_decode_params(key, engine_id=i["engine_id"], host=i["side_channel_host"],
                                       port=i["side_channel_port"])
        tokens = len(httpx.post(f"{cluster['prefill'].url}/tokenize", json={"model": "tiny", "prompt": b["prompt"]},
                                timeout=10).json()["tokens"]) - 1
        consumer.start_load("probe-1", pd.parse_push_decode_params(params), list(range(-(-tokens // 16))), 0, tokens)
        expect_the_write_failure_at_once(consumer, cluster["prefill"].url, pd.build_prefill_body(b, push_key=key))
    finally:
        consumer.shutdown()
        agent.close()


def test_fp8_pools_push_exactly(tmp_path, tmp_path_factory):
    """FP8 KV pools (scales inline in each (block, layer) slab): layer-pipelined push is token-exact with an fp8
    collocated instance (float32 compute, as tests/test_pd_fp8_e2e.py, so P/D and collocated agree exactly)."""
    from test_pd_fp8_e2e import COMMON as FP8_COMMON
    from test_pd_fp8_e2e import model_dir as fp8_model_dir

    model = fp8_model_dir.__wrapped__(tmp_path_factory)  # the fp8 suite's head_dim-64 tiny model

    def fp8(name: str, *args: str) -> ServerProcess:
        return ServerProcess(model, tmp_path / f"{name}.log", *FP8_COMMON, "--dtype", "float32",
                             "--kv-cache-dtype", "fp8", *args, env=SECRET_ENV)

    servers = {"collocated": fp8("collocated"),
               "prefill": fp8("prefill", "--kv-transfer-config", push_config("kv_producer"), "--side-channel-port", "0"),
               "decode": fp8("decode", "--kv-transfer-config", push_config("kv_consumer"))}
    with all_ready(servers):
        for stream in (False, True):
            check_pushed_exactly(servers["collocated"], servers["prefill"], servers["decode"],
                                 body(91 + stream, words=100, stream=stream))
        assert pushed_bytes(servers["decode"].url) > 0
        wait_idle(servers["prefill"].url)


def test_proxy_push_without_a_prefill_serves_on_the_decode_under_decode_local(cluster, tmp_path):
    """`--on-prefill-failure decode-local` (what `pdserve up` sets): with no prefill instance up, a push-mode
    proxy sends the request whole to a decode instance, which computes it exactly."""
    port = free_port()
    proxy = PdserveProcess(tmp_path / "proxy-local.log", port, [
        "proxy", "--host", "127.0.0.1", "--port", str(port), "--prefill", f"http://127.0.0.1:{free_port()}",
        "--decode", cluster["decode"].url, "--kv-transfer-mode", "push", "--on-prefill-failure", "decode-local"])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # listening (its /health may say 503: no prefill instance is up)
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        time.sleep(1.0)  # the decode instance admitted by the first health probe
        b = body(101, words=40)
        ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=b, timeout=60).json()
        out = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=b, timeout=60, headers=HEADERS)
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    finally:
        proxy.stop()
