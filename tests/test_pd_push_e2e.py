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
from server_utils import ServerProcess, all_ready, make_model_dir, metric_value, wait_idle

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_pd_e2e import long_prompt, start  # noqa: E402 - after the skip
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
def cluster(model_dir: Path, tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("push-logs")
    servers = {
        "collocated": start(model_dir, logs, "collocated"),
        "prefill": start(model_dir, logs, "prefill", "--kv-transfer-config", push_config("kv_producer"),
                         "--side-channel-port", "0"),
        "prefill_whole": start(model_dir, logs, "prefill_whole", "--kv-transfer-config",
                               push_config("kv_producer", push_pipeline="request"), "--side-channel-port", "0"),
        "decode": start(model_dir, logs, "decode", "--kv-transfer-config",
                        push_config("kv_consumer", push_registration_timeout=4.0)),
        "decode_recompute": start(model_dir, logs, "decode_recompute", "--kv-transfer-config",
                                  push_config("kv_consumer", "recompute", push_registration_timeout=4.0)),
    }
    with all_ready(servers):
        yield servers


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


def body(seed: int, words: int = 120, **kw) -> dict:
    return {"model": "tiny", "prompt": long_prompt(words, seed), "max_tokens": 10, "temperature": 0,
            "return_token_ids": True, **kw}


def pushed_bytes(url: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics", timeout=10).text, "vllm:nixl_bytes_transferred_sum") or 0.0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prefill", ["prefill", "prefill_whole"])
def test_push_matches_collocated(cluster, prefill, stream):
    b = body(1 + stream, stream=stream)
    ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=b, timeout=60)
    d, p, _ = push_pair(cluster[prefill], cluster["decode"], b)
    assert p is not None
    pout = p.result()
    assert pout.status_code == 200, pout.text
    assert pout.json()["kv_transfer_params"]["transfer_mode"] == "push"
    out = d.result()
    assert out.status_code == 200, out.text
    if stream:
        assert sse_tokens(out) == sse_tokens(ref) and len(sse_tokens(out)) == 10
    else:
        assert out.json()["choices"][0]["token_ids"] == ref.json()["choices"][0]["token_ids"]
    wait_idle(cluster["decode"].url)
    wait_idle(cluster[prefill].url)  # the push ended its lease: the prefill's blocks are free again
