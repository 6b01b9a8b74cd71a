"""Multi-turn over P/D (vLLM's bidirectional_kv_xfer): the decode instance keeps each turn's conversation
(prompt + answer), the next turn's prefill reads that prefix back over NIXL and computes only the new
tokens. Real `pdserve serve` processes, real NIXL DRAM transfers, greedy tokens compared with a collocated
instance: with the history read back, with it expired (recomputed), and with the decode instance killed
between turns (fail policy: that turn's prefill is a clean error; recompute policy: the same tokens).
Then the same through the real proxy and the `openai` client, with no client change.
"""

from __future__ import annotations

import json
import os
import time
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

from pdserve.api import pd

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

COMMON = ("--max-model-len", "512", "--num-gpu-blocks-override", "160", "--block-size", "16")
SECRET_ENV = {"PDSERVE_KV_SECRET": "pd-multiturn-" + os.urandom(16).hex()}
TOY_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None}
TURNS = 6
ANSWER = 12
SYSTEM = [(7 * i + 3) % 4000 + 100 for i in range(40)]


def user_ids(turn: int) -> list[int]:
    return [(13 * i + 101 * turn) % 3000 + 500 for i in range(18 + 3 * turn)]


def kv_config(role: str, policy: str = "recompute", **extra) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {"transfer_timeout_s": 2.0, "handshake_timeout_s": 2.0,
                                                     "bidirectional_kv_xfer": True,
                                                     # read every block the prefix cache lacks (vLLM's
                                                     # default 64 would recompute a short answer's blocks)
                                                     "kv_recompute_threshold": 0, **extra}})


def start(model_dir: Path, logs: Path, name: str, *args: str) -> ServerProcess:
    return ServerProcess(model_dir, logs / f"{name}.log", *COMMON, *args, env=SECRET_ENV)


def decode_server(model_dir: Path, logs: Path, name: str, **extra) -> ServerProcess:
    return start(model_dir, logs, name, "--kv-transfer-config", kv_config("kv_consumer", **extra),
                 "--side-channel-port", "0")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("mt-model"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mt-logs")


@pytest.fixture(scope="module")
def cluster(model_dir: Path, logs: Path) -> Iterator[dict[str, ServerProcess]]:
    servers = {
        "collocated": start(model_dir, logs, "collocated"),
        "prefill": start(model_dir, logs, "prefill", "--kv-transfer-config", kv_config("kv_producer"),
                         "--side-channel-port", "0"),
        "prefill_fail": start(model_dir, logs, "prefill_fail", "--kv-transfer-config",
                              kv_config("kv_producer", "fail"), "--side-channel-port", "0"),
        "decode": decode_server(model_dir, logs, "decode"),
        "decode_short": decode_server(model_dir, logs, "decode_short", decoder_kv_blocks_ttl=1.0),
    }
    with all_ready(servers):
        yield servers


def body_for(prompt: list[int]) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


def collocated_turns(url: str, system: list[int] = SYSTEM) -> list[list[int]]:
    history: list[int] = list(system)
    outs = []
    for t in range(TURNS):
        prompt = history + user_ids(t)
        r = httpx.post(f"{url}/v1/completions", json=body_for(prompt), timeout=60)
        assert r.status_code == 200, r.text
        ids = r.json()["choices"][0]["token_ids"]
        outs.append(ids)
        history = prompt + ids
    return outs


@pytest.fixture(scope="module")
def reference(cluster) -> list[list[int]]:
    return collocated_turns(cluster["collocated"].url)


def prefill_leg(prefill: ServerProcess, body: dict, history: dict | None, rid: str) -> httpx.Response:
    p = {**body, "max_tokens": 1, "stream": False}
    p["kv_transfer_params"] = dict(history) if history is not None else dict(TOY_PREFILL_PARAMS)
    if history is not None:
        p["kv_transfer_params"].update(do_remote_decode=True, do_remote_prefill=False)
    return httpx.post(f"{prefill.url}/v1/completions", json=p, timeout=60, headers={"X-Request-Id": rid})


def decode_leg(decode: ServerProcess, body: dict, params: dict, rid: str) -> dict:
    r = httpx.post(f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60,
                   headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    return r.json()


def metrics(srv: ServerProcess) -> str:
    return httpx.get(f"{srv.url}/metrics", timeout=5).text


def counter(text: str, name: str, outcome: str) -> float:
    try:
        return metric_value(text, f'{name}{{engine="0",model_name="tiny",outcome="{outcome}"}}')
    except KeyError:
        return 0.0


def run_turn(prefill: ServerProcess, decode: ServerProcess, history_ids: list[int], t: int, held: dict | None,
             tag: str) -> tuple[list[int], dict, int, int]:
    """One turn over P/D: (answer ids, the decode's held-history params, prefill cached tokens, decode
    usage cached tokens)."""
    prompt = history_ids + user_ids(t)
    body = body_for(prompt)
    r = prefill_leg(prefill, body, held, f"{tag}-p{t}")
    assert r.status_code == 200, r.text
    pre = r.json()
    out = decode_leg(decode, body, pre["kv_transfer_params"], f"{tag}-d{t}")
    params = out["kv_transfer_params"]
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_num_tokens"] == (len(prompt) + ANSWER - 1) // 16 * 16
    return (out["choices"][0]["token_ids"], params, pre["usage"]["prompt_tokens_details"]["cached_tokens"],
            out["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_history_pulled_back_gives_collocated_tokens(cluster, reference):
    p, d = cluster["prefill"], cluster["decode"]
    before_p, before_d = metrics(p), metrics(d)
    history: list[int] = list(SYSTEM)
    held = None
    expect_reads = 0
    for t in range(TURNS):
        if held is not None and held["remote_num_tokens"] // 16 > (len(history) - ANSWER) // 16:
            expect_reads += 1  # the held blocks reach past what the prefill's own cache has (its last prompt)
        ids, held_next, p_cached, d_cached = run_turn(p, d, history, t, held, "pull")
        assert ids == reference[t], f"turn {t}"
        if held is not None:
            # every full block of the previous turn's prompt + answer came from a cache or from the decode
            # instance: only the new tokens (and the partial last block) were computed
            assert p_cached == held["remote_num_tokens"], f"turn {t}"
            assert d_cached == p_cached
            new = len(history) + len(user_ids(t)) - held["remote_num_tokens"]
            assert len(history) + len(user_ids(t)) - p_cached == new
        history = history + user_ids(t) + ids
        held = held_next
    after_p, after_d = metrics(p), metrics(d)
    pulled = (counter(after_d, "pdserve:kv_history_leases_ended_total", "pulled")
              - counter(before_d, "pdserve:kv_history_leases_ended_total", "pulled"))
    aborted = (counter(after_d, "pdserve:kv_history_leases_ended_total", "aborted")
               - counter(before_d, "pdserve:kv_history_leases_ended_total", "aborted"))
    assert expect_reads >= 3 and pulled == expect_reads and pulled + aborted == TURNS - 1
    loaded = (counter(after_p, "pdserve:kv_prefix_pulls_total", "loaded")
              - counter(before_p, "pdserve:kv_prefix_pulls_total", "loaded"))
    assert loaded == expect_reads
    assert metric_value(after_p, 'pdserve:kv_prefix_pulled_tokens_total{engine="0",model_name="tiny"}') > 0
    # the last turn's history is still held (until its TTL): shown, and its blocks are in use
    assert metric_value(after_d, 'pdserve:kv_history_leases_held{engine="0",model_name="tiny"}') >= 1


def test_history_expired_is_recomputed(cluster, reference):
    p, d = cluster["prefill"], cluster["decode_short"]
    before = metrics(d)
    history: list[int] = list(SYSTEM)
    held = None
    for t in range(3):
        if held is not None:
            time.sleep(1.6)  # past decoder_kv_blocks_ttl (1 s): the held history is freed
        ids, held, _, _ = run_turn(p, d, history, t, held, "expired")
        assert ids == reference[t], f"turn {t}"
        history = history + user_ids(t) + ids
    after = metrics(d)
    assert (counter(after, "pdserve:kv_history_leases_ended_total", "expired")
            - counter(before, "pdserve:kv_history_leases_ended_total", "expired")) >= 2
    time.sleep(1.6)
    idle = wait_idle(d.url)  # every held history freed: the pool is empty
    assert metric_value(idle, 'pdserve:kv_history_leases_held{engine="0",model_name="tiny"}') == 0


def test_decode_killed_between_turns(cluster, reference, model_dir, logs):
    """The decode instance that holds the history dies: with the fail policy that turn's prefill leg is a
    clean error (and the turn again, without the history, works); with recompute it gives the same tokens."""
    d = decode_server(model_dir, logs, "decode_doomed").wait_ready()
    try:
        history = list(SYSTEM)
        ids, held, _, _ = run_turn(cluster["prefill"], d, history, 0, None, "kill")
        assert ids == reference[0]
        history = history + user_ids(0) + ids
    finally:
        d.proc.kill()
        d.stop()
    body = body_for(history + user_ids(1))
    t0 = time.monotonic()
    r = prefill_leg(cluster["prefill_fail"], body, held, "kill-fail-p1")
    assert r.status_code >= 500 and "error" in r.json(), r.text
    assert time.monotonic() - t0 < 20
    # fail policy: only that turn; the same turn without the history is served
    ids, _, _, _ = run_turn(cluster["prefill_fail"], cluster["decode"], history, 1, None, "kill-fail-retry")
    assert ids == reference[1]
    # recompute policy: the same params, the same tokens
    ids, _, _, _ = run_turn(cluster["prefill"], cluster["decode"], history, 1, held, "kill-recompute")
    assert ids == reference[1]


def test_prefix_that_does_not_match_is_not_read(cluster):
    """Params naming blocks of another conversation: their hashes differ from this prompt's, so nothing is
    read (the holder is told to free them) and the tokens are this prompt's own."""
    p, d = cluster["prefill"], cluster["decode"]
    _, held, _, _ = run_turn(p, d, list(SYSTEM), 0, None, "other")
    other = [5 + i for i in range(120)]
    body = body_for(other)
    ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=body, timeout=60).json()
    before_p, before_d = metrics(p), metrics(d)
    r = prefill_leg(p, body, held, "other-p")
    assert r.status_code == 200, r.text
    out = decode_leg(d, body, r.json()["kv_transfer_params"], "other-d")
    assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert (counter(metrics(p), "pdserve:kv_prefix_pulls_total", "declined")
            - counter(before_p, "pdserve:kv_prefix_pulls_total", "declined")) == 1
    deadline = time.monotonic() + 10
    while (counter(metrics(d), "pdserve:kv_history_leases_ended_total", "aborted")
           == counter(before_d, "pdserve:kv_history_leases_ended_total", "aborted")):
        assert time.monotonic() < deadline, "the declined history was not freed"
        time.sleep(0.1)


def test_the_proxy_s_min_read_tokens_decide_instead_of_the_instance_threshold(cluster):
    """A prefill leg priced by a pdserve proxy carries its cost model's break-even (`min_read_tokens`): the
    instance applies it to what it has left to read, instead of its own kv_recompute_threshold (0 here, which
    reads everything). Above what is left: nothing read, the same tokens from the prefill's own cache and a
    recompute."""
    p, d = cluster["prefill"], cluster["decode"]
    system = [(5 * i + 11) % 4000 + 100 for i in range(40)]  # a conversation no other test's turns cached
    ref = collocated_turns(cluster["collocated"].url, system)
    ids, held, _, _ = run_turn(p, d, list(system), 0, None, "minread")
    assert ids == ref[0]
    history = list(system) + user_ids(0) + ids
    before = metrics(p)
    ids, _, p_cached, _ = run_turn(p, d, history, 1, pd.with_min_read_tokens(held, 10_000), "minread")
    assert ids == ref[1]
    assert p_cached == (len(system) + len(user_ids(0))) // 16 * 16  # its own cache: the previous prompt only
    assert p_cached < held["remote_num_tokens"]
    after = metrics(p)
    assert (counter(after, "pdserve:kv_prefix_pulls_total", "declined")
            - counter(before, "pdserve:kv_prefix_pulls_total", "declined")) == 1
    assert (counter(after, "pdserve:kv_prefix_pulls_total", "loaded")
            - counter(before, "pdserve:kv_prefix_pulls_total", "loaded")) == 0


def test_held_histories_give_way_when_the_pool_is_short(cluster, model_dir, logs):
    """A decode instance whose pool fills with held histories evicts the oldest ones for new requests (never
    a hang, never a preemption for them); a history evicted before its next turn is recomputed."""
    d = start(model_dir, logs, "decode_small", "--kv-transfer-config", kv_config("kv_consumer"),
              "--side-channel-port", "0", "--num-gpu-blocks-override", "24").wait_ready()
    try:
        first = None
        for i in range(7):  # each keeps 4 blocks: the 24-block pool cannot hold all seven
            system = [(17 * j + 31 * i) % 4000 + 100 for j in range(40)]
            ref = collocated_turns(cluster["collocated"].url, system)
            ids, held, _, _ = run_turn(cluster["prefill"], d, system, 0, None, f"small-{i}")
            assert ids == ref[0]
            if first is None:
                first = (system, ref, held)
        text = metrics(d)
        assert counter(text, "pdserve:kv_history_leases_ended_total", "evicted") >= 1
        assert metric_value(text, "vllm:num_preemptions_total") == 0
        system, ref, held = first  # the oldest: evicted; its next turn computes the history instead
        ids, _, _, _ = run_turn(cluster["prefill"], d, system + user_ids(0) + ref[0], 1, held, "small-next")
        assert ids == ref[1]
    finally:
        d.stop()


@pytest.fixture(scope="module")
def proxy(cluster, logs) -> Iterator[PdserveProcess]:
    port = free_port()
    srv = PdserveProcess(logs / "proxy.log", port, ["proxy", "--host", "127.0.0.1", "--port", str(port),
                                                    "--prefill", cluster["prefill"].url,
                                                    "--decode", cluster["decode"].url,
                                                    "--kv-history-bandwidth", "5GB/s",
                                                    # a slow prefill: reading back wins from one token on
                                                    "--kv-history-prefill-tps", "50"])
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_through_the_proxy_with_the_openai_client(cluster, proxy):
    """No client change: the proxy keeps the decode's held-history params per conversation and hands them
    to the next turn's prefill (streamed and not)."""
    import openai

    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none", max_retries=0)
    system = [(11 * i + 5) % 4000 + 200 for i in range(40)]  # a conversation no instance has cached yet
    reference = collocated_turns(cluster["collocated"].url, system)
    before = metrics(cluster["decode"])
    history = list(system)
    for t in range(TURNS):
        prompt = history + user_ids(t)
        kwargs = {"model": "tiny", "prompt": prompt, "max_tokens": ANSWER, "temperature": 0,
                  "extra_body": {"ignore_eos": True, "return_token_ids": True}}
        if t % 2:
            ids: list[int] = []
            usage = None
            for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
                for ch in chunk.choices:
                    ids += (ch.model_extra or {}).get("token_ids") or []
                usage = chunk.usage or usage
        else:
            resp = client.completions.create(**kwargs)
            ids = resp.choices[0].model_extra["token_ids"]
            usage = resp.usage
        assert ids == reference[t], f"turn {t}"
        if t >= 1:
            # the history's full blocks were not recomputed (cached or read back): the decode leg (sent
            # before its params, the proxy's default) reports the prefill's count
            assert usage.prompt_tokens_details.cached_tokens == (len(history) - 1) // 16 * 16, f"turn {t}"
        history = prompt + ids
    text = httpx.get(f"{proxy.url}/metrics", timeout=5).text
    choices = {c: metric_value(text, f'pdserve_proxy_kv_history_total{{choice="{c}"}}')
               for c in ("pull", "p_cache", "recompute", "remembered")}
    assert choices["remembered"] == TURNS and choices["recompute"] == 0
    assert choices["pull"] + choices["p_cache"] == TURNS - 1 and choices["pull"] >= 3
    after = metrics(cluster["decode"])
    ended = sum(counter(after, "pdserve:kv_history_leases_ended_total", o)
                - counter(before, "pdserve:kv_history_leases_ended_total", o) for o in ("pulled", "aborted"))
    assert ended == choices["pull"]
    assert (counter(after, "pdserve:kv_history_leases_ended_total", "pulled")
            - counter(before, "pdserve:kv_history_leases_ended_total", "pulled")) >= 1
