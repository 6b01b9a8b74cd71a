"""Push transfer with multi-turn history (bidirectional_kv_xfer, which vLLM's NixlPushConnector refuses:
vllm-project/vllm#46473): real `pdserve serve` push instances behind `pdserve proxy` given only their addresses.

The push decode instance (kv_consumer) keeps each turn's conversation under a history lease; the next turn's
push prefill instance (kv_producer) READs it back, computes only the new tokens, and pushes the KV on: the
decode registers only the blocks its own prefix cache lacks, so only the new blocks travel. A 4-turn chat is
token-exact with a collocated instance, streamed and not.
"""

from __future__ import annotations

import json
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

from test_pd_multiturn_e2e import ANSWER, body_for, collocated_turns, start, user_ids  # noqa: E402
from test_pd_push_e2e import labelled, metrics_of  # noqa: E402

TURNS = 4


def push_history_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlPushConnector", "kv_role": role, "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"transfer_timeout_s": 10.0, "handshake_timeout_s": 10.0,
                                                     "bidirectional_kv_xfer": True, "kv_recompute_threshold": 0}})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    model_dir: Path = make_model_dir(tmp_path_factory.mktemp("push-mt-model"))
    logs = tmp_path_factory.mktemp("push-mt-logs")
    servers: dict[str, ServerProcess] = {
        "collocated": start(model_dir, logs, "collocated"),
        "prefill": start(model_dir, logs, "prefill", "--kv-transfer-config", push_history_config("kv_producer"),
                         "--side-channel-port", "0"),
        "decode": start(model_dir, logs, "decode", "--kv-transfer-config", push_history_config("kv_consumer"),
                        "--side-channel-port", "0"),
    }
    with all_ready(servers):
        port = free_port()
        proxy = PdserveProcess(logs / "proxy.log", port, [
            "proxy", "--host", "127.0.0.1", "--port", str(port), "--prefill", servers["prefill"].url,
            "--decode", servers["decode"].url, "--kv-history-bandwidth", "5GB/s",
            "--kv-history-prefill-tps", "50"])  # a slow prefill: reading back wins from one token on
        try:
            proxy.wait_ready()
            yield {**servers, "proxy": proxy}
        finally:
            proxy.stop()


def stream_ids(resp: httpx.Response) -> list[int]:
    ids: list[int] = []
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for ch in json.loads(line[6:]).get("choices", []):
                ids += ch.get("token_ids") or []
    return ids


@pytest.mark.parametrize("stream", [False, True])
def test_a_four_turn_chat_in_push_mode_with_history_matches_collocated(cluster, stream):
    system = [(17 * i + 7 * stream + 3) % 4000 + 150 for i in range(40)]  # a conversation of its own
    reference = collocated_turns(cluster["collocated"].url, system)[:TURNS]
    proxy = cluster["proxy"].url
    before_proxy = httpx.get(f"{proxy}/metrics", timeout=10).text
    before_p, before_d = metrics_of(cluster["prefill"].url), metrics_of(cluster["decode"].url)
    history = list(system)
    for t in range(TURNS):
        prompt = history + user_ids(t)
        out = httpx.post(f"{proxy}/v1/completions", json={**body_for(prompt), "stream": stream}, timeout=120)
        assert out.status_code == 200, out.text
        ids = stream_ids(out) if stream else out.json()["choices"][0]["token_ids"]
        assert ids == reference[t], f"turn {t}"
        assert len(ids) == ANSWER
        history = prompt + ids
    after_proxy = httpx.get(f"{proxy}/metrics", timeout=10).text

    def proxy_count(choice: str) -> float:
        name = f'pdserve_proxy_kv_history_total{{choice="{choice}"}}'
        return (metric_value(after_proxy, name) or 0) - (metric_value(before_proxy, name) or 0)

    # every turn remembered; turns 2-4 read the held history back (none recomputed)
    assert proxy_count("remembered") == TURNS and proxy_count("recompute") == 0
    assert proxy_count("pull") + proxy_count("p_cache") == TURNS - 1 and proxy_count("pull") >= 1
    after_p, after_d = metrics_of(cluster["prefill"].url), metrics_of(cluster["decode"].url)
    # every turn's KV went by push
    assert (labelled(after_p, "pdserve:kv_push_jobs_ended_total", '"done"')
            - labelled(before_p, "pdserve:kv_push_jobs_ended_total", '"done"')) == TURNS
    # the decode's held histories were read back by the prefill (a pull READ of the held lease)
    pulled = (labelled(after_d, "pdserve:kv_history_leases_ended_total", '"pulled"')
              - labelled(before_d, "pdserve:kv_history_leases_ended_total", '"pulled"'))
    assert pulled == proxy_count("pull")
    wait_idle(cluster["prefill"].url)
