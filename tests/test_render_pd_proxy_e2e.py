"""The render tier hands its P/D to a `pdserve proxy` child (pdserve/render/pd_proxy.py), so its requests get what
the proxy's get. A render-tier P/D request survives a prefill kill, as a proxy's does (test_chaos_up.py).

Real processes on 127.0.0.1: a tokens-only prefill instance (NIXL producer), a tokens-only decode instance (NIXL
consumer) and `pdserve render --prefill P --decode D` (whose child proxy runs the legs). A request is answered over
P/D (its KV moved over NIXL); the prefill instance is then SIGKILLed; the same request, whole and streamed, and a new
one are answered 200 with the same tokens, served by the decode instance (--on-prefill-failure decode-local, which the
render tier gives its proxy), and no decode leg is left waiting for params. Stopping the render tier stops its proxy.

And the proxy's push pairs serve the render tier too: over push instances (NixlPushConnector, learnt from their
/pdserve/info) a render-tier request is one push pair, token-exact with the decode instance computing it alone.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_pd_push_e2e import labelled, push_config
from test_render_support import Proc, kv_config, make_scripted_model, sse_events, start_all

HAVE_NIXL = importlib.util.find_spec("nixl_cu12") is not None
pytestmark = pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

MAX_MODEL_LEN = 512
ENGINE_ARGS = ("--served-model-name", "tiny", "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override",
               "256", "--max-num-batched-tokens", "512", "--tokens-only")


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    model = make_scripted_model(tmp_path_factory.mktemp("scripted") / "model", MAX_MODEL_LEN)
    logs = tmp_path_factory.mktemp("logs")
    all_procs = {
        "prefill": Proc(logs / "prefill.log", "serve", str(model), *ENGINE_ARGS, "--kv-transfer-config",
                        kv_config("kv_producer"), "--side-channel-port", "0"),
        "decode": Proc(logs / "decode.log", "serve", str(model), *ENGINE_ARGS, "--kv-transfer-config",
                       kv_config("kv_consumer")),
    }
    start_all(*all_procs.values())
    all_procs["render"] = Proc(logs / "render.log", "render", str(model), "--served-model-name", "tiny",
                               "--max-model-len", str(MAX_MODEL_LEN), "--prefill", all_procs["prefill"].url,
                               "--decode", all_procs["decode"].url, "--proxy-arg", "--health-interval 1")
    try:
        start_all(all_procs["render"])
        yield all_procs
    finally:
        for p in reversed(all_procs.values()):  # the render tier first: it holds connections to the engines
            p.stop()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ":
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _tokens(render: Proc, body: dict[str, Any]) -> list[int]:
    resp = httpx.post(render.url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    if not body.get("stream"):
        return resp.json()["choices"][0]["token_ids"]
    return [t for event in sse_events(resp) for c in event.get("choices") or [] for t in c.get("token_ids") or []]


def _body(prompt: list[int], stream: bool = False) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream,
            "return_token_ids": True}


def test_render_pd_request_survives_a_prefill_kill(procs: dict[str, Proc]) -> None:
    render, prefill, decode = procs["render"], procs["prefill"], procs["decode"]
    proxy = httpx.get(render.url + "/pdserve/info", timeout=10).json()["pd_proxy"]
    assert proxy and proxy.startswith("http://127.0.0.1:")
    moved = "vllm:nixl_bytes_transferred_sum"
    first = [4000 + 7 * i for i in range(100)] + [198]  # new to every cache: its KV moves over NIXL
    before = _metric(decode.url, moved)
    answer = _tokens(render, _body(first))
    assert answer and _metric(decode.url, moved) > before  # served as a P/D pair
    assert _metric(proxy, 'pdserve_proxy_requests_total{path="disagg"}') == 1

    os.kill(prefill.proc.pid, signal.SIGKILL)
    prefill.proc.wait(30)

    assert _tokens(render, _body(first)) == answer
    assert _tokens(render, _body(first, stream=True)) == answer
    second = [5000 + 3 * i for i in range(60)] + [198]
    via_render = _tokens(render, _body(second))
    direct = httpx.post(decode.url + "/inference/v1/generate", timeout=120, json={
        "token_ids": second, "sampling_params": {"max_tokens": 12, "temperature": 0}}).json()
    assert via_render == direct["choices"][0]["token_ids"]
    # every request after the kill was served by the decode instance under the proxy's failure policy
    assert _metric(proxy, 'pdserve_proxy_requests_total{path="decode_local_fallback"}') == 3
    # the decode legs sent with the failed prefill legs (early) were dropped: nothing waits for params there
    for _ in range(120):
        if _metric(decode.url, "pdserve:num_requests_awaiting_kv_params") == 0:
            break
        time.sleep(0.25)
    else:
        raise AssertionError("a decode leg still waits for its params on the decode instance")

    render.stop()
    with pytest.raises(httpx.HTTPError):  # the render tier's proxy went with it
        httpx.get(proxy + "/health", timeout=5)


@pytest.fixture()
def push_procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    model = make_scripted_model(tmp_path_factory.mktemp("scripted-push") / "model", MAX_MODEL_LEN)
    logs = tmp_path_factory.mktemp("push-logs")
    all_procs = {
        "prefill": Proc(logs / "prefill.log", "serve", str(model), *ENGINE_ARGS, "--kv-transfer-config",
                        push_config("kv_producer"), "--side-channel-port", "0"),
        "decode": Proc(logs / "decode.log", "serve", str(model), *ENGINE_ARGS, "--kv-transfer-config",
                       push_config("kv_consumer")),
    }
    start_all(*all_procs.values())
    all_procs["render"] = Proc(logs / "render.log", "render", str(model), "--served-model-name", "tiny",
                               "--max-model-len", str(MAX_MODEL_LEN), "--prefill", all_procs["prefill"].url,
                               "--decode", all_procs["decode"].url)
    try:
        start_all(all_procs["render"])
        yield all_procs
    finally:
        for p in reversed(all_procs.values()):
            p.stop()


def test_render_pd_over_push_instances(push_procs: dict[str, Proc]) -> None:
    render, prefill, decode = push_procs["render"], push_procs["prefill"], push_procs["decode"]

    def pushed() -> float:
        return labelled(httpx.get(prefill.url + "/metrics", timeout=10).text, "pdserve:kv_push_jobs_ended_total",
                        '"done"')

    for stream in (False, True):
        before = pushed()
        prompt = [4500 + 5 * i + int(stream) for i in range(90)] + [198]
        via_render = _tokens(render, _body(prompt, stream))
        assert pushed() == before + 1  # the KV went by push
        direct = httpx.post(decode.url + "/inference/v1/generate", timeout=120, json={
            "token_ids": prompt, "sampling_params": {"max_tokens": 12, "temperature": 0}}).json()
        assert via_render == direct["choices"][0]["token_ids"], stream
