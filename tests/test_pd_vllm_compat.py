"""What vLLM users reach for, over 1P1D: `pdserve proxy` in front of a producer and a consumer `pdserve serve`
(real NIXL DRAM transfers), next to a collocated instance as the reference. The shipped Grafana dashboard's
queries name only metrics that these live processes export; structured outputs through the proxy equal
the collocated instance's (the decode side owns the grammar; the prefill leg's token is never shown).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import MODEL, PdserveProcess, ServerProcess, free_port, make_model_dir, metric_value

from pdserve.testing.json_schemas import SCHEMAS

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

COMMON = ("--max-model-len", "512", "--num-gpu-blocks-override", "128", "--block-size", "16",
          "--structured-outputs-config", '{"disable_any_whitespace": true}')  # a random model: see test_vllm_compat
DASHBOARD = Path(__file__).resolve().parents[1] / "pdserve" / "data" / "grafana" / "pdserve-dashboard.json"


def kv_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                       "kv_connector_extra_config": {"transfer_timeout_s": 5.0, "handshake_timeout_s": 5.0}})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict[str, PdserveProcess]]:
    model_dir = make_model_dir(tmp_path_factory.mktemp("pdc-model"))
    logs = tmp_path_factory.mktemp("pdc-logs")
    procs: dict[str, PdserveProcess] = {}
    try:
        procs["collocated"] = ServerProcess(model_dir, logs / "collocated.log", *COMMON)
        procs["prefill"] = ServerProcess(model_dir, logs / "prefill.log", *COMMON, "--kv-transfer-config",
                                         kv_config("kv_producer"), "--side-channel-port", "0")
        procs["decode"] = ServerProcess(model_dir, logs / "decode.log", *COMMON, "--kv-transfer-config",
                                        kv_config("kv_consumer"))
        for p in procs.values():
            p.wait_ready()
        port = free_port()
        procs["proxy"] = PdserveProcess(logs / "proxy.log", port, [
            "proxy", "--host", "127.0.0.1", "--port", str(port), "--prefill", procs["prefill"].url,
            "--decode", procs["decode"].url]).wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def client(proc: PdserveProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)


def exported_names(url: str) -> set[str]:
    """Every sample name on a /metrics page (histograms give _bucket/_sum/_count, counters _total)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def dashboard_queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    return exprs


def test_grafana_dashboard_queries_exported_metrics(cluster) -> None:
    # one request through the proxy, so every instance has served (and transferred) something
    out = client(cluster["proxy"]).completions.create(model=MODEL, prompt="Hello there", max_tokens=4,
                                                      temperature=0)
    assert out.choices[0].text is not None
    exported = set()
    for name in ("prefill", "decode", "proxy"):
        exported |= exported_names(cluster[name].url)
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 25
    named = set()
    for expr in queries:
        metrics = set(re.findall(r"\b(?:vllm:|pdserve:|pdserve_)[A-Za-z0-9_:]+", expr))
        assert metrics, f"a query without a pdserve/vLLM metric: {expr}"
        named |= metrics
    missing = sorted(named - exported)
    assert not missing, f"dashboard queries metrics no live process exports: {missing}"
    # and it covers each family: the engine, the KV transfer, the proxy, pdserve's own
    for prefix in ("vllm:e2e_", "vllm:nixl_", "pdserve_proxy_", "pdserve:"):
        assert any(m.startswith(prefix) for m in named), prefix


def disagg_count(proxy: PdserveProcess) -> float:
    return metric_value(httpx.get(f"{proxy.url}/metrics", timeout=10).text, 'pdserve_proxy_requests_total{path="disagg"}')


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_structured_outputs_over_pd_equal_collocated(cluster, stream: bool) -> None:
    before = disagg_count(cluster["proxy"])
    picks = [SCHEMAS[i] for i in (0, 4, 10, 17)]
    for name, schema, _ in picks:
        texts = []
        for which in ("proxy", "collocated"):
            kw = dict(model=MODEL, messages=[{"role": "user", "content": f"JSON for {name}"}], max_tokens=300,
                      temperature=0, response_format={"type": "json_schema",
                                                      "json_schema": {"name": name, "schema": schema}})
            if stream:
                chunks = client(cluster[which]).chat.completions.create(stream=True, **kw)
                texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            else:
                texts.append(client(cluster[which]).chat.completions.create(**kw).choices[0].message.content)
        assert texts[0] == texts[1], name
        jsonschema.validate(json.loads(texts[0]), schema)
    assert disagg_count(cluster["proxy"]) - before == len(picks)  # every one went prefill -> decode
    regex = r"[A-Z][a-z]{1,5} [0-9]{2}"
    out = [client(cluster[w]).completions.create(model=MODEL, prompt="Name and age:", max_tokens=20, temperature=0,
                                                 extra_body={"structured_outputs": {"regex": regex}}).choices[0].text
           for w in ("proxy", "collocated")]
    assert out[0] == out[1] and re.fullmatch(regex, out[0])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_several_prompts_split_into_pd_pairs(cluster, stream: bool) -> None:
    """A completions request with several prompts: one P/D pair per prompt (not served locally), merged
    into the answer the collocated instance gives the same request."""
    before = metric_value(httpx.get(f"{cluster['proxy'].url}/metrics", timeout=10).text,
                          'pdserve_proxy_requests_total{path="disagg_split"}')
    prompts = ["The capital of France is", "1 2 3 4 5", "Once upon a time"]
    answers = []
    for which in ("proxy", "collocated"):
        kw = dict(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
        if stream:
            texts = {i: "" for i in range(len(prompts))}
            usage = None
            for chunk in client(cluster[which]).completions.create(stream=True, stream_options={"include_usage": True},
                                                                   **kw):
                for c in chunk.choices:
                    texts[c.index] += c.text
                usage = chunk.usage or usage
            answers.append(([texts[i] for i in sorted(texts)], usage.prompt_tokens, usage.completion_tokens))
        else:
            res = client(cluster[which]).completions.create(**kw)
            answers.append(([c.text for c in sorted(res.choices, key=lambda c: c.index)], res.usage.prompt_tokens,
                            res.usage.completion_tokens))
    assert answers[0] == answers[1]
    assert answers[0][2] == 8 * len(prompts)
    after = metric_value(httpx.get(f"{cluster['proxy'].url}/metrics", timeout=10).text,
                         'pdserve_proxy_requests_total{path="disagg_split"}')
    assert after == before + 1


def xfer_count(decode: PdserveProcess) -> float:
    return metric_value(httpx.get(f"{decode.url}/metrics", timeout=10).text, "vllm:nixl_xfer_time_seconds_count")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_over_pd_equals_collocated(cluster, stream: bool) -> None:
    """n=4 over 1P1D: one prefill, one KV transfer, the decode instance forks the load into 4 choices;
    with seeds, the choices equal the collocated instance's (choice j has seed + j on both)."""
    prompt = "In a quiet village by the sea, " * 3  # several full blocks: the forks share them
    answers = []
    for which in ("proxy", "collocated"):
        xfers = xfer_count(cluster["decode"])
        kw = dict(model=MODEL, prompt=prompt, n=4, max_tokens=12, temperature=0.9, seed=11)
        if stream:
            texts = ["", "", "", ""]
            for chunk in client(cluster[which]).completions.create(stream=True, **kw):
                for c in chunk.choices:
                    texts[c.index] += c.text
        else:
            res = client(cluster[which]).completions.create(**kw)
            texts = [c.text for c in sorted(res.choices, key=lambda c: c.index)]
        answers.append(texts)
        if which == "proxy":
            assert xfer_count(cluster["decode"]) == xfers + 1  # one transfer for the four choices
    assert answers[0] == answers[1]
    assert len(set(answers[0])) > 1  # four different samples, not four copies
    chat = [client(cluster[w]).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                       n=3, max_tokens=8, temperature=0.9, seed=5)
            for w in ("proxy", "collocated")]
    assert [c.message.content for c in chat[0].choices] == [c.message.content for c in chat[1].choices]
