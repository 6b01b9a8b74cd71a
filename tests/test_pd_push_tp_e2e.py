"""Push transfer (`kv_connector: NixlPushConnector`) between instances of different tensor-parallel sizes, on
CPU: real `pdserve serve` processes (TP=2 ones with their worker rank), real NIXL WRITEs from each prefill
rank's own pool shard into each decode rank's registered blocks, both HTTP legs at once as the proxy sends them.

Token-exact with a collocated TP=1 instance, streamed and not, for P TP=2 -> D TP=1, P TP=1 -> D TP=2 and
P TP=2 -> D TP=2; with a one-KV-head model (every TP=2 rank holds the head: written once per decode rank, from
one prefill rank) and with fp8 pools (values and scales). Every push moves exactly the registered bytes (the
prefill's written-bytes counter and the decode's received-bytes counter both), so a silent recompute cannot
pass for a push. And the write-safety rows of vllm-project/vllm#48633 with TP=2 on at least one side: a decode
abort before the prefill ran writes nothing (C1), a WRITE failing on a worker rank is learnt at once (C2), a
partial prefix hit on a TP decode lands each block in its own slot (C3), a registration arriving after the
prefill request ended and its blocks were freed writes nothing (C4, vllm#55470)."""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from server_utils import MODEL, ServerProcess, make_model_dir, metric_value, wait_idle

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_pd_push_e2e import (  # noqa: E402
    HEADERS,
    Leg,
    _stream_text,
    expect_the_write_failure_at_once,
    labelled,
    metrics_of,
)

from pdserve.api import pd  # noqa: E402

pytestmark = pytest.mark.timeout(1500)

SECRET = "push-tp-test-deployment-secret"
COMMON = ("--max-model-len", "512", "--num-gpu-blocks-override", "96", "--block-size", "16", "--device", "cpu")
# the TP=2 prefill ends a lease no decode registered for 6 - 2 = 4 s after its prefill (C4's test waits that out)
SLACK = {"transfer_timeout_s": 2.0, "handshake_timeout_s": 10.0}


def block_bytes(kv_heads: int, fp8: bool = False) -> int:
    """make_model_dir's tiny Llama: 2 layers, K and V, 16 tokens, heads of 16 float32 values (fp8: 16 bytes
    and a 2-byte scale)."""
    return 2 * 2 * 16 * kv_heads * (16 + 2 if fp8 else 16 * 4)


def push_config(role: str, policy: str = "fail", **extra) -> str:
    return json.dumps({"kv_connector": "NixlPushConnector", "kv_role": role, "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {**SLACK, **extra}})


VARIANTS = {  # kv heads, KV cache dtype, the instances it starts
    "2kv": (2, "auto", ("collocated", "p1", "p2", "d1", "d2")),
    "1kv": (1, "auto", ("collocated", "p1", "p2", "d1", "d2")),
    "2kv-fp8": (2, "fp8", ("collocated", "p2", "d2")),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def servers(request, tmp_path_factory) -> Iterator[dict]:
    kv_heads, dtype, names = VARIANTS[request.param]
    model_dir = make_model_dir(tmp_path_factory.mktemp("push-tp-model"), num_key_value_heads=kv_heads)
    logs = tmp_path_factory.mktemp("push-tp-logs")
    args = {
        "collocated": (),
        "p1": ("--kv-transfer-config", push_config("kv_producer"), "--side-channel-port", "0"),
        "p2": ("--kv-transfer-config", push_config("kv_producer", kv_lease_duration=6.0), "--side-channel-port", "0",
               "--tensor-parallel-size", "2"),
        "d1": ("--kv-transfer-config", push_config("kv_consumer", push_registration_timeout=10.0)),
        "d2": ("--kv-transfer-config", push_config("kv_consumer", "recompute", push_registration_timeout=10.0),
               "--tensor-parallel-size", "2"),
    }
    procs = {n: ServerProcess(model_dir, logs / f"{n}.log", *COMMON, "--kv-cache-dtype", dtype, *args[n],
                              env={"PDSERVE_KV_SECRET": SECRET}) for n in names}
    try:
        for proc in procs.values():
            proc.wait_ready(300)
        yield {**procs, "kv_heads": kv_heads, "fp8": dtype == "fp8", "variant": request.param, "model": model_dir}
    finally:
        for proc in procs.values():
            proc.stop()


def info(srv: ServerProcess) -> dict:
    return httpx.get(f"{srv.url}/pdserve/info", timeout=10).json()


def decode_params(prefill: ServerProcess, key: str, **over) -> dict:
    i = info(prefill)
    return pd.push_decode_params(key, engine_id=i["engine_id"], host=i["side_channel_host"],
                                 port=i["side_channel_port"], tp_size=over.get("tp_size", i["tensor_parallel_size"]))


def pair(prefill: ServerProcess, decode: ServerProcess, body: dict, *, send_prefill: bool = True):
    key = uuid.uuid4().hex
    d = Leg(decode.url, "completions", pd.build_decode_body(body, decode_params(prefill, key)), f"d-{key}")
    p = Leg(prefill.url, "completions", pd.build_prefill_body(body, push_key=key), f"p-{key}") if send_prefill \
        else None
    return d, p, key


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def body(tokens: list[int], stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": tokens, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def text_of(resp: httpx.Response, stream: bool) -> list[str]:
    assert resp.status_code == 200, resp.text
    return _stream_text(resp) if stream else [c["text"] for c in resp.json()["choices"]]


def written(url: str) -> float:
    return labelled(metrics_of(url), "pdserve:kv_push_written_bytes_total", "phase")


def received(url: str) -> float:
    return metric_value(metrics_of(url), "vllm:nixl_bytes_transferred_sum") or 0.0


def need(servers: dict, *names: str, variant: str | None = None) -> None:
    if variant is not None and servers["variant"] != variant:
        pytest.skip(f"run with the {variant} model only")
    missing = [n for n in names if n not in servers]
    if missing:
        pytest.skip(f"variant {servers['variant']} starts no {', '.join(missing)}")


def pushed_bytes(servers: dict, decode: str, tokens: int) -> int:
    """What a decode of `decode`'s TP size receives for a prompt of `tokens` (its cache holding none of it):
    every rank whole blocks of each of its heads for len(prompt) - 1 tokens (a replicated head once per rank)."""
    d_tp, heads = int(decode[1]), servers["kv_heads"]
    return -(-(tokens - 1) // 16) * block_bytes(max(1, heads // d_tp), servers["fp8"]) * d_tp


def check_exact(servers: dict, prefill: str, decode: str, tokens: list[int], stream: bool) -> None:
    p, d = servers[prefill], servers[decode]
    ref = httpx.post(f"{servers['collocated'].url}/v1/completions", json=body(tokens, stream), timeout=120)
    w0, r0 = written(p.url), received(d.url)
    dleg, pleg, _ = pair(p, d, body(tokens, stream))
    assert pleg is not None
    pout = pleg.result()
    assert pout.status_code == 200, pout.text
    assert pout.json()["kv_transfer_params"]["tp_size"] == int(prefill[1])
    assert text_of(dleg.result(), stream) == text_of(ref, stream)
    # pushed, exactly the registered KV (each decode rank's heads once), never recomputed
    want = pushed_bytes(servers, decode, len(tokens))
    assert received(d.url) - r0 == want
    wait_idle(p.url)  # the push ended the prefill's lease
    assert written(p.url) - w0 == want
    wait_idle(d.url)


PAIRS = [("p2", "d1"), ("p1", "d2"), ("p2", "d2")]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(("prefill", "decode"), PAIRS, ids=[f"{p}-{d}" for p, d in PAIRS])
def test_push_across_tp_sizes_matches_collocated(servers, prefill, decode, stream):
    need(servers, prefill, decode)
    for i, n in enumerate((23, 71)):  # a partial last block, and several blocks
        check_exact(servers, prefill, decode, prompt(1000 * PAIRS.index((prefill, decode)) + 10 * stream + i, n),
                    stream)


def test_partial_prefix_hit_on_a_tp_decode_lands_in_its_own_slots(servers):
    """C3 with TP=2 on both sides: the second prompt shares 3 blocks with the first; the decode registers only
    the blocks it lacks, the prefill's ranks WRITE request block i into the decode ranks' i-th registered block,
    and the tokens are exact."""
    need(servers, "p2", "d2")
    shared = prompt(5000, 48)
    sent = []
    for i in range(2):
        tokens = shared + prompt(5001 + i, 30)
        ref = httpx.post(f"{servers['collocated'].url}/v1/completions", json=body(tokens), timeout=120)
        r0 = received(servers["d2"].url)
        dleg, pleg, _ = pair(servers["p2"], servers["d2"], body(tokens))
        assert pleg is not None and pleg.result().status_code == 200
        assert text_of(dleg.result(), False) == text_of(ref, False), i
        sent.append(received(servers["d2"].url) - r0)
    full = pushed_bytes(servers, "d2", 78)
    assert sent[0] == full
    assert sent[1] == full - 3 * block_bytes(max(1, servers["kv_heads"] // 2), servers["fp8"]) * 2
    wait_idle(servers["d2"].url)
    wait_idle(servers["p2"].url)


def test_decode_abort_before_the_prefill_writes_nothing(servers):
    """C1 with TP=2 on both sides: the decode leg is dropped after registering, before the prefill leg came;
    the prefill's job is cancelled, its prefill computes and no rank WRITEs a byte; the decode's blocks come
    back and serve the next request exactly."""
    need(servers, "p2", "d2", variant="2kv")
    key = uuid.uuid4().hex
    b = body(prompt(6000, 60))
    before = metrics_of(servers["p2"].url)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up: the connection closes, the leg is aborted
        httpx.post(f"{servers['d2'].url}/v1/completions", json=pd.build_decode_body(b, decode_params(servers["p2"],
                   key)), timeout=1.5, headers=HEADERS)
    wait_idle(servers["d2"].url)  # blocks back only once the prefill said nothing is in flight
    p = httpx.post(f"{servers['p2'].url}/v1/completions", json=pd.build_prefill_body(b, push_key=key), timeout=60,
                   headers=HEADERS)
    assert p.status_code == 200
    wait_idle(servers["p2"].url)
    after = metrics_of(servers["p2"].url)
    assert labelled(after, "pdserve:kv_push_jobs_ended_total", "cancelled") == \
        labelled(before, "pdserve:kv_push_jobs_ended_total", "cancelled") + 1
    assert labelled(after, "pdserve:kv_push_written_bytes_total", "phase") == \
        labelled(before, "pdserve:kv_push_written_bytes_total", "phase")  # not one byte written
    check_exact(servers, "p2", "d2", prompt(6001, 40), False)


def test_registration_after_the_prefill_ended_writes_nothing(servers):
    """C4 (vllm#55470: a deferred write after the producer request ended answered 200 with wrong KV): the
    prefill leg runs alone, finishes, and its lease ends with no decode registered (4 s here); its blocks go
    back to its pool. A registration arriving after that writes nothing: the fail-policy decode answers an
    error naming the push, the recompute-policy TP=2 decode computes the prompt itself, exactly."""
    need(servers, "p2", "d1", "d2", variant="2kv")
    tokens = prompt(7000, 60)
    ref = httpx.post(f"{servers['collocated'].url}/v1/completions", json=body(tokens), timeout=120)
    keys = [uuid.uuid4().hex for _ in range(2)]
    for key in keys:
        p = httpx.post(f"{servers['p2'].url}/v1/completions", json=pd.build_prefill_body(body(tokens), push_key=key),
                       timeout=60, headers=HEADERS)
        assert p.status_code == 200
    w0 = written(servers["p2"].url)
    time.sleep(4.5)
    wait_idle(servers["p2"].url)  # the leases ended: the prefill's blocks are free (and may be reused)
    # the prefill's pool is reused meanwhile by another request, as in production
    httpx.post(f"{servers['p2'].url}/v1/completions", json=body(prompt(7001, 60)), timeout=60)
    outs = {}
    for name, key in zip(("d1", "d2"), keys, strict=True):
        leg = Leg(servers[name].url, "completions", pd.build_decode_body(body(tokens), decode_params(servers["p2"],
                  key)), f"d-{key}")
        outs[name] = leg.result()
    assert outs["d1"].status_code == 500, outs["d1"].text
    assert text_of(outs["d2"], False) == text_of(ref, False)  # recomputed locally
    assert written(servers["p2"].url) == w0  # nothing written from freed blocks
    for name in ("d1", "d2", "p2"):
        wait_idle(servers[name].url)


def test_a_write_failing_on_a_worker_rank_is_learnt_at_once(servers, tmp_path):
    """C2 with a TP=2 prefill: the decode (a real push consumer, KVConsumer over a PushReceiver, on a real NIXL
    agent in this process, TP=1) registers a pool whose address its agent never registered, so both prefill
    ranks' WRITEs fail (rank 1's in its worker process); the decode learns it from push_status at once, not at
    its deadline, and the prefill's blocks come back."""
    need(servers, "p2", variant="2kv")
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
    from pdserve.types.tp_layout import kv_heads_per_rank

    i = info(servers["p2"])
    compat = make_compat(model=model_identity(servers["model"]), dtype=i["dtype"], block_size=i["block_size"],
                         num_layers=i["num_layers"], num_kv_heads=i["num_kv_heads"], head_dim=i["head_dim"],
                         kv_layout=i["kv_layout"], kv_cache_dtype=i["kv_cache_dtype"])
    compat["kv_transfer_mode"] = "push"
    hello = side_channel.call(i["side_channel_host"], i["side_channel_port"],
                              Handshake(engine_id="probe", compat=compat), 10.0, to=i["engine_id"],
                              auth=MessageAuth(SECRET))
    assert hello.tp_size == 2
    pool_info = hello.pool
    heads = servers["kv_heads"]
    bb = pool_info.block_bytes // kv_heads_per_rank(2, heads) * heads  # a TP=1 block holds every head
    config = KVTransferConfig.from_json(push_config("kv_consumer", push_registration_timeout=30.0),
                                        env={"PDSERVE_KV_SECRET": SECRET})
    pool = np.zeros((pool_info.num_blocks, 1, 2, bb // 2, 1, 1), dtype=np.uint8)
    real = region_of(pool)
    agent = NixlAgent(config.engine_id, config.backends)
    agent.register(real)
    wrong = dataclasses.replace(real, base_addr=real.base_addr + 2 * real.length)  # not registered memory
    metrics = TransferMetrics(model_name="tiny", registry=CollectorRegistry())
    consumer = KVConsumer(LocalKV(config, agent, wrong, hello.compat, metrics, MessageAuth(SECRET)), PushReceiver)
    try:
        tokens = prompt(8000, 60)
        key = uuid.uuid4().hex
        params = pd.parse_push_decode_params(decode_params(servers["p2"], key))
        n = len(tokens) - 1
        consumer.start_load("probe-1", params, list(range(-(-n // 16))), 0, n)
        expect_the_write_failure_at_once(consumer, servers["p2"].url, pd.build_prefill_body(body(tokens), push_key=key))
    finally:
        consumer.shutdown()
        agent.close()


def test_params_naming_another_tp_size_are_refused(servers):
    """A decode leg whose params give the prefill's TP size wrong (a stale or edited hand-off) fails with a 409
    naming both sizes; nothing is registered."""
    need(servers, "p2", "d1", variant="2kv")
    key = uuid.uuid4().hex
    b = pd.build_decode_body(body(prompt(9000, 30)), decode_params(servers["p2"], key, tp_size=1))
    r = httpx.post(f"{servers['d1'].url}/v1/completions", json=b, timeout=60, headers=HEADERS)
    assert r.status_code == 409 and "tensor-parallel size 1" in r.text, r.text
    wait_idle(servers["d1"].url)
