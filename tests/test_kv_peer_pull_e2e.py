"""Pulling a prefix from a peer (issue 18 part 4): the prefill instance lacks a long prefix that another
instance has in its prefix cache (here the decode instance, which computed it as a plain request); the proxy's
fleet index (KV events) says so, the proxy asks that peer to pin it (POST /pdserve/kv/pin) and the prefill leg
reads it over NIXL with the multi-turn machinery instead of recomputing it. Real `pdserve serve` processes
(bidirectional_kv_xfer, KV events), a real `pdserve proxy`, real NIXL DRAM transfers, 127.0.0.1 only; greedy
tokens compared with a collocated instance that computes everything. A pin that expired before it was read,
and one refused over the cap, are recomputed / refused, never wrong tokens.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import httpx
import pytest
from server_utils import PdserveProcess, ServerProcess, all_ready, free_port, make_model_dir, metric_value

pytest.importorskip("zmq")
pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

COMMON = ("--max-model-len", "512", "--num-gpu-blocks-override", "160", "--block-size", "16")
ENV = {"PDSERVE_KV_SECRET": "peer-pull-" + os.urandom(16).hex(), "UCX_NET_DEVICES": "lo"}
EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                     "replay_endpoint": "tcp://127.0.0.1:*"})
PIN_TTL_S = 2.0
LONG = [(7 * i + 3) % 4000 + 100 for i in range(100)]  # 6 full blocks of 16 can be taken from a cache
LONG_2 = [(11 * i + 5) % 4000 + 200 for i in range(100)]
QUESTION = [901, 902, 903, 904, 905]
ANSWER = 8


def kv_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"transfer_timeout_s": 2.0, "handshake_timeout_s": 2.0,
                                                     "bidirectional_kv_xfer": True,
                                                     "peer_pin_ttl_s": PIN_TTL_S, "peer_pin_max_leases": 1}})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict[str, PdserveProcess]]:
    root = tmp_path_factory.mktemp("peer-pull")
    model = make_model_dir(root)

    def serve(name: str, *args: str) -> ServerProcess:
        return ServerProcess(model, root / f"{name}.log", *COMMON, *args, env=ENV)

    servers: dict[str, PdserveProcess] = {
        "collocated": serve("collocated"),
        "prefill": serve("prefill", "--kv-transfer-config", kv_config("kv_producer"), "--side-channel-port", "0",
                         "--kv-events-config", EVENTS),
        "decode": serve("decode", "--kv-transfer-config", kv_config("kv_consumer"), "--side-channel-port", "0",
                        "--kv-events-config", EVENTS),
    }
    with all_ready(servers):
        port = free_port()
        servers["proxy"] = PdserveProcess(root / "proxy.log", port, [
            "proxy", "--host", "127.0.0.1", "--port", str(port), "--prefill", servers["prefill"].url,
            "--decode", servers["decode"].url, "--tokenizer", str(model),
            # a slow prefill: reading the peer's prefix wins by the plan arithmetic
            "--kv-history-bandwidth", "5GB/s", "--kv-history-prefill-tps", "50"])
        servers["proxy"].wait_ready()
        yield servers


def complete(url: str, prompt: list[int], **extra) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=5).text


def counter(text: str, name: str, outcome: str) -> float:
    try:
        return metric_value(text, f'{name}{{engine="0",model_name="tiny",outcome="{outcome}"}}')
    except KeyError:
        return 0.0


def index_blocks(proxy: str, url: str) -> int:
    listing = httpx.get(f"{proxy}/pdserve/instances", timeout=5).json()
    inst = next(i for role in ("prefill", "decode") for i in listing[role] if i["url"] == url)
    return (inst.get("kv_events") or {}).get("blocks", 0)


def test_prefill_reads_the_prefix_a_peer_caches(cluster):
    proxy, p, d = cluster["proxy"].url, cluster["prefill"].url, cluster["decode"].url
    info = httpx.get(f"{d}/pdserve/info", timeout=5).json()
    assert info["kv_peer_pin"] == {"ttl_s": PIN_TTL_S, "max_leases": 1}
    complete(d, LONG + [42], max_tokens=1)  # only the decode instance computes the long prefix
    deadline = time.monotonic() + 30
    while index_blocks(proxy, d) < 6:
        assert time.monotonic() < deadline, "the decode instance's blocks never reached the proxy's index"
        time.sleep(0.1)
    before_p, before_d = metrics(p), metrics(d)
    prompt = LONG + QUESTION
    out = complete(proxy, prompt)
    assert out["choices"][0]["token_ids"] == complete(cluster["collocated"].url, prompt)["choices"][0]["token_ids"]
    # the 6 blocks came from the peer: the prefill computed only the rest (the decode leg reports its count)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    text = metrics(proxy)
    assert metric_value(text, 'pdserve_proxy_kv_peer_pulls_total{outcome="pull"}') == 1
    after_p, after_d = metrics(p), metrics(d)
    assert (counter(after_p, "pdserve:kv_prefix_pulls_total", "loaded")
            - counter(before_p, "pdserve:kv_prefix_pulls_total", "loaded")) == 1
    assert (counter(after_d, "pdserve:kv_history_leases_ended_total", "pulled")
            - counter(before_d, "pdserve:kv_history_leases_ended_total", "pulled")) == 1
    assert "peer " + d in (cluster["proxy"].log_path.read_text()), "no log line for the choice"


def pin(url: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(f"{url}/pdserve/kv/pin", json={"prompt_token_ids": prompt, "min_tokens": 64}, timeout=10)


def test_expired_pin_is_recomputed_and_the_cap_refuses(cluster):
    p, d = cluster["prefill"].url, cluster["decode"].url
    prompt = LONG_2 + QUESTION
    complete(d, LONG_2 + [42], max_tokens=1)  # cached on the decode instance only
    assert pin(d, [5] * 40).json() == {"kv_transfer_params": None}  # nothing cached: nothing pinned
    first = pin(d, prompt)
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["remote_num_tokens"] == 96 and len(params["remote_block_hashes"]) == 6
    refused = pin(d, prompt)  # peer_pin_max_leases 1
    assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
    assert pin(d, [1, "x"]).status_code == 400
    before_p, before_d = metrics(p), metrics(d)
    time.sleep(PIN_TTL_S + 0.8)  # the pin's lease is over: its blocks are free again
    out = complete(p, prompt, kv_transfer_params={**params, "do_remote_decode": False})
    assert out["choices"][0]["token_ids"] == complete(cluster["collocated"].url, prompt)["choices"][0]["token_ids"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed, nothing read
    after_p, after_d = metrics(p), metrics(d)
    assert (counter(after_p, "pdserve:kv_prefix_pulls_total", "recomputed")
            - counter(before_p, "pdserve:kv_prefix_pulls_total", "recomputed")) == 1
    assert (counter(after_d, "pdserve:kv_history_leases_ended_total", "expired")
            - counter(before_d, "pdserve:kv_history_leases_ended_total", "expired")) == 1
    assert pin(d, prompt).status_code == 200  # the expired pin no longer counts against the cap
