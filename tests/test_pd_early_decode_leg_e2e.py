"""The decode leg sent before its params (pdserve/api/pd.py `early_decode_params`, `POST KV_PARAMS_PATH`):
real `pdserve serve` producer, consumer and collocated processes, real NIXL transfers, real HTTP.

A proxy sends the decode leg together with the prefill leg, so that the decode instance parses, validates
and admits it while the prefill runs, then delivers the prefill's params. Either may arrive first. The
output must be exactly the collocated one; refused params end the waiting leg with a 400 (before any byte).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from server_utils import ServerProcess, all_ready, make_model_dir, metric_value, wait_idle

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_pd_e2e import kv_config, long_prompt, prefill_leg, start  # noqa: E402 - after the skip
from test_pd_first_token_e2e import sse_tokens  # noqa: E402

from pdserve.api import pd  # noqa: E402

HEADERS = {"Authorization": "Bearer None"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, pd_reference) -> Iterator[dict[str, ServerProcess]]:
    model_dir = make_model_dir(tmp_path_factory.mktemp("pd-early-model"))
    logs = tmp_path_factory.mktemp("pd-early-logs")
    slack = {"transfer_timeout_s": 30.0, "handshake_timeout_s": 30.0}
    servers = {
        "prefill": start(model_dir, logs, "prefill", "--kv-transfer-config", kv_config("kv_producer", **slack),
                         "--side-channel-port", "0"),
        "decode": start(model_dir, logs, "decode", "--kv-transfer-config", kv_config("kv_consumer", "fail", **slack)),
    }
    with all_ready(servers):
        yield {**servers, "collocated": pd_reference.wait_ready()}  # conftest's, for the session


def body(prompt_seed: int, **kw) -> dict:
    return {"model": "tiny", "prompt": long_prompt(80, prompt_seed), "max_tokens": 10, "temperature": 0,
            "return_token_ids": True, **kw}


class Leg(threading.Thread):
    """A decode leg in flight on its own thread (the client side of an overlapped proxy)."""

    def __init__(self, url: str, payload: dict, rid: str):
        super().__init__(daemon=True)
        self.url, self.payload, self.rid = url, payload, rid
        self.resp: httpx.Response | None = None

    def run(self) -> None:
        self.resp = httpx.post(f"{self.url}/v1/completions", json=self.payload, timeout=60,
                               headers={"X-Request-Id": self.rid, **HEADERS})

    def result(self) -> httpx.Response:
        self.join(60)
        assert self.resp is not None, "the decode leg did not answer"
        return self.resp


def early_leg(decode: ServerProcess, b: dict, key: str) -> Leg:
    leg = Leg(decode.url, pd.build_decode_body(b, pd.early_decode_params(key)), key)
    leg.start()
    return leg


def deliver(decode: ServerProcess, key: str, params: dict) -> httpx.Response:
    return httpx.post(f"{decode.url}{pd.KV_PARAMS_PATH}", json=pd.params_delivery(key, params), timeout=60,
                      headers=HEADERS)


def wait_awaiting_params(url: str, n: int, timeout: float = 30.0) -> None:
    """Until the instance reports `n` decode legs waiting for their params."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric_value(httpx.get(f"{url}/metrics", timeout=5).text, "pdserve:num_requests_awaiting_kv_params") == n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{url} never had {n} waiting requests")


def test_info_says_the_decode_instance_takes_params_later(cluster):
    assert httpx.get(f"{cluster['decode'].url}/pdserve/info", timeout=10).json()["kv_params_later"] is True
    assert httpx.get(f"{cluster['prefill'].url}/pdserve/info", timeout=10).json()["kv_params_later"] is False


@pytest.mark.parametrize("stream", [False, True])
def test_leg_waits_for_its_params_then_matches_collocated(cluster, stream):
    b = body(1 + stream, stream=stream)
    ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=b, timeout=60)
    key = f"early-wait-{stream}"
    leg = early_leg(cluster["decode"], b, key)
    wait_awaiting_params(cluster["decode"].url, 1)  # admitted and waiting, before the prefill even started
    params = prefill_leg(cluster["prefill"], "completions", b, key)
    assert deliver(cluster["decode"], key, params).status_code == 200
    out = leg.result()
    assert out.status_code == 200, out.text
    if stream:
        assert sse_tokens(out) == sse_tokens(ref) and len(sse_tokens(out)) == 10
    else:
        assert out.json()["choices"][0]["token_ids"] == ref.json()["choices"][0]["token_ids"]
        assert out.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
        # usage counts the producer's prefix hits (from the delivered params), as with params up front, not
        # the decode instance's own full "hit" from the transfer
        cached = out.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == params["remote_prefill_cached_tokens"] < out.json()["usage"]["prompt_tokens"]
    wait_idle(cluster["decode"].url)
    wait_idle(cluster["prefill"].url)


def test_params_that_come_first_wait_for_their_leg(cluster):
    b = body(3)
    ref = httpx.post(f"{cluster['collocated'].url}/v1/completions", json=b, timeout=60)
    params = prefill_leg(cluster["prefill"], "completions", b, "early-first")
    assert deliver(cluster["decode"], "early-first", params).status_code == 200
    out = early_leg(cluster["decode"], b, "early-first").result()
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["token_ids"] == ref.json()["choices"][0]["token_ids"]
    # a second delivery under a key whose params are still kept is refused
    assert deliver(cluster["decode"], "early-twice", params).status_code == 200
    again = deliver(cluster["decode"], "early-twice", params)
    assert again.status_code == 400 and "already delivered" in again.json()["error"]["message"]
    wait_idle(cluster["decode"].url)


def test_refused_params_end_the_waiting_leg_with_a_400(cluster):
    b = body(4)
    leg = early_leg(cluster["decode"], b, "early-bad")
    wait_awaiting_params(cluster["decode"].url, 1)
    bad = deliver(cluster["decode"], "early-bad", {"do_remote_prefill": True, "remote_block_ids": "x"})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "kv_transfer_params"
    out = leg.result()
    assert out.status_code == 400, out.text
    assert "kv_transfer_params" in out.json()["error"]["message"]
    wait_idle(cluster["decode"].url)


def test_a_leg_gone_before_its_params_is_aborted(cluster):
    b = body(5, stream=True)
    payload = json.dumps(pd.build_decode_body(b, pd.early_decode_params("early-gone"))).encode()
    port = int(cluster["decode"].url.rsplit(":", 1)[1])
    # a raw connection: the response headers only come with the first output, so closing it is the client
    # going away while its leg waits for params
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer None\r\nX-Request-Id: early-gone\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        wait_awaiting_params(cluster["decode"].url, 1)
    wait_idle(cluster["decode"].url)  # the request waiting for its params was aborted with the connection


@pytest.mark.parametrize(("params", "status"), [
    (pd.early_decode_params(""), 400),
    ({**pd.early_decode_params("k"), "remote_block_ids": [1]}, 400),
])
def test_malformed_params_later_is_a_400(cluster, params, status):
    b = body(6)
    out = httpx.post(f"{cluster['decode'].url}/v1/completions", json=pd.build_decode_body(b, params), timeout=60,
                     headers=HEADERS)
    assert out.status_code == status, out.text


def test_n_choices_need_their_params_up_front(cluster):
    b = body(7, n=2, temperature=0.8, seed=1)
    out = httpx.post(f"{cluster['decode'].url}/v1/completions", timeout=60, headers=HEADERS,
                     json=pd.build_decode_body(b, pd.early_decode_params("early-n")))
    assert out.status_code == 400 and pd.PARAMS_LATER in out.json()["error"]["message"]


def test_an_instance_that_loads_no_kv_takes_no_params(cluster):
    out = deliver(cluster["collocated"], "k", {"do_remote_prefill": True})
    assert out.status_code == 409, out.text
    bad = httpx.post(f"{cluster['decode'].url}{pd.KV_PARAMS_PATH}", json={"key": 3}, timeout=10, headers=HEADERS)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "key"
