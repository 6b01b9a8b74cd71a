"""`POST /inference/v1/abort_requests` through `pdserve proxy` (pdserve/proxy/abort.py): real tokens-only
`pdserve serve` prefill (NIXL producer) and decode (NIXL consumer) processes, a real proxy process, real HTTP.

A streamed generate request runs on its decode instance (its prefill done, its KV read over NIXL); the client
aborts it through the proxy by the id the instances answer with (`generate-tokens-{X-Request-Id}`), or by the bare
id of a body `request_id` sent without the header: the proxy forwards the abort to the decode instance holding the
leg, the stream ends with finish_reason "abort" long before its max_tokens, and both instances end idle (no
request, no blocks held). An id the proxy has not in flight aborts nothing; a body without `request_ids` is a 400.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_utils import PdserveProcess, ServerProcess, all_ready, free_port, make_model_dir, wait_idle

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_pd_e2e import kv_config  # noqa: E402 - after the skip

from pdserve.api.scale_out_routes import ABORT_PATH, GENERATE_ID_PREFIX, GENERATE_PATH  # noqa: E402

MAX_TOKENS = 3000  # far more than the few steps between the first chunk and the abort
ARGS = ("--tokens-only", "--max-model-len", "4096", "--num-gpu-blocks-override", "512")
SLACK = {"transfer_timeout_s": 30.0, "handshake_timeout_s": 30.0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict[str, PdserveProcess]]:
    model_dir = make_model_dir(tmp_path_factory.mktemp("abort-model"), max_position_embeddings=4096)
    logs = tmp_path_factory.mktemp("abort-logs")
    servers: dict[str, PdserveProcess] = {
        "prefill": ServerProcess(model_dir, logs / "prefill.log", *ARGS, "--kv-transfer-config",
                                 kv_config("kv_producer", **SLACK), "--side-channel-port", "0"),
        "decode": ServerProcess(model_dir, logs / "decode.log", *ARGS, "--kv-transfer-config",
                                kv_config("kv_consumer", "fail", **SLACK)),
    }
    with all_ready(servers):
        port = free_port()
        servers["proxy"] = PdserveProcess(logs / "proxy.log", port, [
            "proxy", "--host", "127.0.0.1", "--port", str(port), "--prefill", servers["prefill"].url,
            "--decode", servers["decode"].url, "--health-interval", "1"])
        servers["proxy"].wait_ready()
        yield servers


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def _abort_mid_stream(proxy: str, body: dict[str, Any], headers: dict[str, str], abort_id: str) -> tuple[str, int,
                                                                                                           str | None]:
    """Streams `body` through the proxy, aborts `abort_id` after the first token: (the stream's request_id, its
    tokens, its last finish_reason)."""
    with httpx.Client(timeout=120) as http, http.stream("POST", proxy + GENERATE_PATH, json=body,
                                                        headers=headers) as resp:
        assert resp.status_code == 200, resp.read()
        events = _events(resp.iter_lines())
        first = next(events)
        tokens = sum(len(c["token_ids"]) for c in first["choices"])
        aborted = http.post(proxy + ABORT_PATH, json={"request_ids": [abort_id]})
        assert aborted.status_code == 200, aborted.text
        assert aborted.json()["num_aborted"] == 1
        finish = None
        for event in events:
            for c in event["choices"]:
                tokens += len(c["token_ids"])
                finish = c["finish_reason"] or finish
    return first["request_id"], tokens, finish


def _body(seed: int, **kw: Any) -> dict[str, Any]:
    return {"token_ids": [(seed * 31 + i * 7) % 4000 + 10 for i in range(40)], "stream": True,
            "sampling_params": {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}, **kw}


def test_an_abort_by_the_instances_id_reaches_the_decode_leg(cluster):
    proxy = cluster["proxy"].url
    rid, tokens, finish = _abort_mid_stream(proxy, _body(1), {"X-Request-Id": "abort-e2e-1"},
                                            GENERATE_ID_PREFIX + "abort-e2e-1")
    assert rid == GENERATE_ID_PREFIX + "abort-e2e-1"  # the decode instance named it by the proxy's upstream id
    assert finish == "abort" and 0 < tokens < MAX_TOKENS
    wait_idle(cluster["decode"].url)
    wait_idle(cluster["prefill"].url)


def test_a_body_request_id_is_the_id_and_aborts_bare(cluster):
    """Without X-Request-Id the generate body's request_id names the request upstream, as on one instance."""
    proxy = cluster["proxy"].url
    rid, tokens, finish = _abort_mid_stream(proxy, _body(2, request_id="abort-e2e-2"), {}, "abort-e2e-2")
    assert rid == GENERATE_ID_PREFIX + "abort-e2e-2"
    assert finish == "abort" and 0 < tokens < MAX_TOKENS
    wait_idle(cluster["decode"].url)


def test_unknown_ids_abort_nothing_and_a_bad_body_is_a_400(cluster):
    proxy = cluster["proxy"].url
    none = httpx.post(proxy + ABORT_PATH, json={"request_ids": ["never-sent"]}, timeout=30)
    assert none.status_code == 200 and none.json() == {"request_ids": ["never-sent"], "num_aborted": 0}
    for bad in ({}, {"request_ids": "x"}, [1]):
        resp = httpx.post(proxy + ABORT_PATH, json=bad, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
