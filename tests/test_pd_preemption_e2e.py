"""A decode instance under KV memory pressure, its normal operating point: real `pdserve serve` producer,
consumer and collocated processes, real NIXL transfers, legs sent as vLLM's toy proxy sends them.

The consumer's pool (40 blocks of 16 tokens) holds about a third of what 8 concurrent requests need, so
it preempts requests whose remote KV was already loaded. Each must come back by local recompute (never a
second read from a lease that is gone) and answer exactly what the collocated instance answers: no 500s,
and every block free again on both sides at the end.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess, all_ready, make_model_dir, metric_value, wait_idle

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_pd_e2e import decode_leg, kv_config, prefill_leg, start  # noqa: E402 - after the NIXL skip

NUM_REQUESTS = 8
DECODE_BLOCKS = "40"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, pd_reference) -> Iterator[dict[str, ServerProcess]]:
    model_dir: Path = make_model_dir(tmp_path_factory.mktemp("pd-preempt-model"))
    logs = tmp_path_factory.mktemp("pd-preempt-logs")
    servers = {
        "prefill": start(model_dir, logs, "prefill", "--kv-transfer-config", kv_config("kv_producer"),
                         "--side-channel-port", "0"),
        "decode": start(model_dir, logs, "decode", "--kv-transfer-config", kv_config("kv_consumer", "fail"),
                        "--num-gpu-blocks-override", DECODE_BLOCKS),
    }
    with all_ready(servers):
        yield {**servers, "collocated": pd_reference.wait_ready()}  # conftest's, for the session


def bodies() -> list[dict]:
    rng = random.Random(14)
    return [{"model": "tiny", "prompt": [rng.randrange(3, 49000) for _ in range(rng.randrange(100, 151))],
             "max_tokens": 120, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            for _ in range(NUM_REQUESTS)]


def disaggregated(cluster: dict[str, ServerProcess], body: dict, rid: str) -> httpx.Response:
    params = prefill_leg(cluster["prefill"], "completions", body, rid)
    return decode_leg(cluster["decode"], "completions", body, params, rid)


def test_preempted_decode_requests_recompute_and_match_collocated(cluster):
    decode = cluster["decode"]
    reqs = bodies()
    before = metric_value(httpx.get(f"{decode.url}/metrics").text, "vllm:num_preemptions_total")
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        refs = list(pool.map(lambda b: httpx.post(f"{cluster['collocated'].url}/v1/completions", json=b,
                                                  timeout=120), reqs))
        outs = list(pool.map(lambda ib: disaggregated(cluster, ib[1], f"preempt-{ib[0]}"), enumerate(reqs)))

    assert [r.status_code for r in refs] == [200] * NUM_REQUESTS
    assert [o.status_code for o in outs] == [200] * NUM_REQUESTS, [o.text for o in outs if o.status_code != 200]
    for ref, out in zip(refs, outs, strict=True):
        want, got = ref.json()["choices"][0], out.json()["choices"][0]
        assert len(got["token_ids"]) == 120
        assert got["token_ids"] == want["token_ids"]
        assert got["text"] == want["text"]

    after = wait_idle(decode.url)  # nothing running or waiting, every block free again
    wait_idle(cluster["prefill"].url)  # every lease was read and released
    assert metric_value(after, "vllm:num_preemptions_total") > before  # the pressure was real
    log = decode.log_path.read_text(errors="replace")
    assert "KV load could not start" not in log and "Traceback" not in log
