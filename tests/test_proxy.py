"""`pdserve proxy` against stand-in vLLM backends, every server a real process on 127.0.0.1.

The stand-ins (`python -m pdserve.testing.standin`) record what they receive and misbehave on demand;
the proxy runs as `python -m pdserve proxy ...`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

READY_TIMEOUT_S = 30.0
POLL_S = 0.05
http = httpx.Client(timeout=30.0)  # one pooled client: a new httpx client per call costs ~0.1 s


class Proc:
    """A server subprocess whose log goes to a file; its URL is read from its 'listening on' line."""

    def __init__(self, args: list[str], log: Path, ready: str) -> None:
        self.args = args
        self.log = log
        self._fh = log.open("ab")
        self.proc = subprocess.Popen(args, stdout=self._fh, stderr=subprocess.STDOUT)
        self.url = self._wait_ready(ready)

    def _wait_ready(self, ready: str) -> str:
        pattern = re.compile(ready + r" (http://[\d.]+:\d+)")
        for _ in range(int(READY_TIMEOUT_S / POLL_S)):
            match = pattern.search(self.log.read_text(errors="replace"))
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(POLL_S)
        self.stop()
        raise RuntimeError(f"{self.args} did not start:\n{self.log.read_text(errors='replace')[-3000:]}")

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._fh.close()


def start_standin(log: Path, port: int = 0) -> Proc:
    return Proc(
        [sys.executable, "-m", "pdserve.testing.standin", "--port", str(port)], log, "standin listening on"
    )


class Standin:
    """HTTP handle on a stand-in backend."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.url = proc.url

    def requests(self) -> list[dict[str, Any]]:
        return http.get(self.url + "/_standin/requests").json()

    def generation_requests(self) -> list[dict[str, Any]]:
        return [r for r in self.requests() if r["path"].startswith("/v1/")]

    def stats(self) -> dict[str, int]:
        return http.get(self.url + "/_standin/stats").json()

    def behave(self, **changes: Any) -> None:
        http.post(self.url + "/_standin/behaviour", json=changes).raise_for_status()

    def release(self) -> None:
        http.post(self.url + "/_standin/release").raise_for_status()

    def reset(self) -> None:
        self.release()
        http.post(
            self.url + "/_standin/behaviour",
            json={
                "fail_status": 0,
                "fail_count": 0,
                "retry_after": "",
                "no_params": False,
                "hold_before_response": False,
                "hold_after_chunks": -1,
                "die_after_chunks": -1,
            },
        ).raise_for_status()
        http.delete(self.url + "/_standin/requests").raise_for_status()


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / POLL_S)):
        if predicate():
            return
        time.sleep(POLL_S)
    raise AssertionError(f"timed out waiting for {what}")


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return 0.0


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("proxy-logs")


@pytest.fixture(scope="module")
def backends(logs: Path) -> Iterator[dict[str, Standin]]:
    procs: list[Proc] = []
    try:
        for name in ("p1", "p2", "d1", "d2"):
            procs.append(start_standin(logs / f"{name}.log"))
        yield {name: Standin(proc) for name, proc in zip(("p1", "p2", "d1", "d2"), procs, strict=True)}
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(autouse=True)
def clean_backends(request: pytest.FixtureRequest) -> None:
    if "backends" in request.fixturenames:
        for standin in request.getfixturevalue("backends").values():
            standin.reset()


@pytest.fixture
def start_proxy(logs: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., str]]:
    """Starts `pdserve proxy ARGS` and returns its URL; stopped at the end of the test."""
    procs: list[Proc] = []

    def start(*args: str) -> str:
        log = logs / f"proxy-{request.node.name}-{len(procs)}.log"
        cmd = [sys.executable, "-m", "pdserve", "proxy", "--host", "127.0.0.1", "--port", "0", *args]
        procs.append(Proc(cmd, log, "pdserve proxy listening on"))
        return procs[-1].url

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture(scope="module")
def proxy(backends: dict[str, Standin], logs: Path) -> Iterator[str]:
    """The 2P2D proxy shared by the tests that leave no failure state behind."""
    b = backends
    proc = Proc(
        [
            sys.executable,
            "-m",
            "pdserve",
            "proxy",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--prefill",
            b["p1"].url,
            b["p2"].url,
            "--decode",
            b["d1"].url,
            b["d2"].url,
        ],
        logs / "proxy-shared.log",
        "pdserve proxy listening on",
    )
    yield proc.url
    proc.stop()


def legs(backends: dict[str, Standin]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(prefill legs, decode legs) received by the stand-ins, in arrival order per instance."""
    prefill = backends["p1"].generation_requests() + backends["p2"].generation_requests()
    decode = backends["d1"].generation_requests() + backends["d2"].generation_requests()
    return prefill, decode


def sse_events(text: str) -> list[str]:
    return [block[len("data: ") :] for block in text.split("\n\n") if block.startswith("data: ")]


SIX_KEYS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# -- protocol ---------------------------------------------------------------------------------------


def test_completions_stream_protocol_of_both_legs(proxy: str, backends: dict[str, Standin]) -> None:
    body = {
        "model": "standin",
        "prompt": "The capital of France is",
        "max_tokens": 3,
        "max_completion_tokens": 3,
        "min_tokens": 2,
        "min_completion_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    resp = http.post(proxy + "/v1/completions", json=body, headers={"X-Request-Id": "client-rid-1"})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-request-id"] == "client-rid-1"
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]" and resp.text.endswith("data: [DONE]\n\n")
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " tok0 tok1 tok2"
    assert chunks[-1]["usage"]["completion_tokens"] == 3

    prefill, decode = legs(backends)
    assert len(prefill) == 1 and len(decode) == 1
    expected_prefill = {
        k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")
    }
    expected_prefill.update(stream=False, max_tokens=1, max_completion_tokens=1, kv_transfer_params=SIX_KEYS)
    assert prefill[0]["body"] == expected_prefill
    params = prefill[0]["response"]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert decode[0]["body"] == {**body, "kv_transfer_params": params}  # original body + params verbatim
    assert prefill[0]["path"] == decode[0]["path"] == "/v1/completions"
    assert prefill[0]["headers"]["X-Request-ID"] == decode[0]["headers"]["X-Request-ID"] == "client-rid-1"


def test_generated_request_id_shared_and_auth_forwarded(proxy: str, backends: dict[str, Standin]) -> None:
    body = {"model": "standin", "prompt": "hi there", "max_tokens": 2}
    resp = http.post(proxy + "/v1/completions", json=body, headers={"Authorization": "Bearer client-key"})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.json()["choices"][0]["text"] == " tok0 tok1"
    prefill, decode = legs(backends)
    rid = resp.headers["x-request-id"]
    assert rid and prefill[0]["headers"]["X-Request-ID"] == decode[0]["headers"]["X-Request-ID"] == rid
    # No --api-key on the proxy and no --upstream-api-key: the client's header goes through.
    assert (
        prefill[0]["headers"]["Authorization"] == decode[0]["headers"]["Authorization"] == "Bearer client-key"
    )


def test_chat_prompt_token_ids_handoff(proxy: str, backends: dict[str, Standin]) -> None:
    body = {
        "model": "standin",
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 2,
        "stream": True,
    }
    resp = http.post(proxy + "/v1/chat/completions", json=body)
    assert resp.status_code == 200
    events = sse_events(resp.text)
    content = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert content == " tok0 tok1"
    prefill, decode = legs(backends)
    assert prefill[0]["body"]["return_token_ids"] is True
    response = prefill[0]["response"]
    assert decode[0]["body"] == {
        **body,
        "kv_transfer_params": {
            **response["kv_transfer_params"],
            "prompt_token_ids": response["prompt_token_ids"],
        },
    }
    assert "return_token_ids" not in decode[0]["body"]

    # Non-text content: no token-id hand-off, params still verbatim.
    for standin in backends.values():
        standin.reset()
    image = {
        "model": "standin",
        "max_tokens": 1,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ],
    }
    assert http.post(proxy + "/v1/chat/completions", json=image).status_code == 200
    prefill, decode = legs(backends)
    assert "return_token_ids" not in prefill[0]["body"]
    assert decode[0]["body"]["kv_transfer_params"] == prefill[0]["response"]["kv_transfer_params"]


def test_openai_sdk_through_proxy(proxy: str, backends: dict[str, Standin]) -> None:
    import openai

    client = openai.OpenAI(base_url=proxy + "/v1", api_key="sdk-key", max_retries=0)
    stream = client.completions.create(model="standin", prompt="Once upon a time", max_tokens=4, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == " tok0 tok1 tok2 tok3"
    chat = client.chat.completions.create(
        model="standin", messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    assert chat.choices[0].message.content == " tok0 tok1"
    assert [m.id for m in client.models.list()] == ["standin"]
    prefill, decode = legs(backends)
    assert len(prefill) == 2 and len(decode) == 2
    assert all(d["body"]["kv_transfer_params"]["do_remote_prefill"] for d in decode)
    client.close()


def test_health_and_metrics_routes(proxy: str) -> None:
    health = http.get(proxy + "/health")
    assert health.status_code == 200
    assert health.json()["decode_healthy"] == 2 and health.json()["prefill_healthy"] == 2
    text = http.get(proxy + "/metrics").text
    for name in (
        "pdserve_proxy_prefill_seconds_bucket",
        "pdserve_proxy_decode_ttfb_seconds_bucket",
        "pdserve_proxy_request_seconds_bucket",
        "pdserve_proxy_instance_in_flight",
    ):
        assert name in text
    assert metric(text, "pdserve_proxy_requests_total", path="disagg") >= 1


# -- balancing --------------------------------------------------------------------------------------


def test_2p2d_load_spread(proxy: str, backends: dict[str, Standin]) -> None:
    body = {"model": "standin", "prompt": "spread me", "max_tokens": 1}
    for _ in range(8):
        assert http.post(proxy + "/v1/completions", json=body).status_code == 200
    counts = {name: len(s.generation_requests()) for name, s in backends.items()}
    assert counts == {"p1": 4, "p2": 4, "d1": 4, "d2": 4}  # idle instances: ties rotate

    # Under load the least busy decode instance is chosen: hold every decode leg, send 4 at once.
    for name in ("d1", "d2"):
        backends[name].behave(hold_before_response=True)
        http.delete(backends[name].url + "/_standin/requests")
    results: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                http.post(proxy + "/v1/completions", json=body, timeout=30).status_code
            )
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    wait_until(
        lambda: sum(len(backends[n].generation_requests()) for n in ("d1", "d2")) == 4, "4 held decode legs"
    )
    assert [len(backends[n].generation_requests()) for n in ("d1", "d2")] == [2, 2]
    instances = http.get(proxy + "/pdserve/instances").json()
    assert [inst["in_flight"] for inst in instances["decode"]] == [2, 2]
    for name in ("d1", "d2"):
        backends[name].behave(hold_before_response=False)
        backends[name].release()
    for t in threads:
        t.join(timeout=30)
    assert results == [200] * 4


def test_many_concurrent_streams(proxy: str, backends: dict[str, Standin]) -> None:
    import asyncio

    import aiohttp

    n = 128
    body = {"model": "standin", "prompt": "concurrent", "max_tokens": 3, "stream": True}

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str]:
        headers = {"X-Request-Id": f"conc-{i}"}
        async with session.post(proxy + "/v1/completions", json=body, headers=headers) as resp:
            return resp.status, (await resp.read()).decode()

    async def run() -> list[tuple[int, str]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(one(session, i) for i in range(n)))

    results = asyncio.run(run())
    for status, text in results:
        assert status == 200
        events = sse_events(text)
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == " tok0 tok1 tok2"
    prefill, decode = legs(backends)
    assert len(prefill) == len(decode) == n
    assert sorted(r["headers"]["X-Request-ID"] for r in decode) == sorted(f"conc-{i}" for i in range(n))


# -- streaming failures and disconnects ----------------------------------------------------------------


def test_decode_failure_mid_stream_ends_with_error_event(proxy: str, backends: dict[str, Standin]) -> None:
    for name in ("d1", "d2"):
        backends[name].behave(die_after_chunks=2)
    resp = http.post(
        proxy + "/v1/completions", json={"model": "standin", "prompt": "x", "max_tokens": 5, "stream": True}
    )
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == [" tok0", " tok1"]
    error = json.loads(events[2])["error"]
    assert error["code"] == 502 and "mid-stream" in error["message"]
    assert events[3:] == ["[DONE]"]
    assert metric(http.get(proxy + "/metrics").text, "pdserve_proxy_errors_total", kind="decode_stream") >= 1
    _, decode = legs(backends)
    assert len(decode) == 1  # a P/D decode leg that reached its instance is never retried


def test_client_disconnect_closes_upstream_stream(proxy: str, backends: dict[str, Standin]) -> None:
    for name in ("d1", "d2"):
        backends[name].behave(hold_after_chunks=1)
    body = {"model": "standin", "prompt": "long story", "max_tokens": 10, "stream": True}
    with http.stream("POST", proxy + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        first = next(resp.iter_raw())
        assert first.startswith(b"data: ")
    # The proxy closed its decode connection: the stand-in's stream handler was cancelled.
    wait_until(
        lambda: backends["d1"].stats()["disconnects"] + backends["d2"].stats()["disconnects"] == 1,
        "the decode stand-in to see the disconnect",
    )
    assert backends["d1"].stats()["streams_completed"] + backends["d2"].stats()["streams_completed"] == 0
    wait_until(
        lambda: all(i["in_flight"] == 0 for i in http.get(proxy + "/pdserve/instances").json()["decode"]),
        "decode in-flight counters to drop",
    )
    assert (
        metric(http.get(proxy + "/metrics").text, "pdserve_proxy_errors_total", kind="client_disconnect") >= 1
    )


# -- upstream errors --------------------------------------------------------------------------------


def test_upstream_client_errors_pass_through(proxy: str, backends: dict[str, Standin]) -> None:
    for name in ("d1", "d2"):
        backends[name].behave(fail_status=400, fail_count=1)
    resp = http.post(proxy + "/v1/completions", json={"model": "standin", "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 400
    assert resp.json() == {
        "error": {"message": "injected failure", "type": "StandinError", "param": None, "code": 400}
    }
    for standin in backends.values():
        standin.reset()
    for name in ("p1", "p2"):
        backends[name].behave(fail_status=400, fail_count=1)
    resp = http.post(
        proxy + "/v1/completions", json={"model": "standin", "prompt": "x", "max_tokens": 2, "stream": True}
    )
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "injected failure"
    prefill, decode = legs(backends)
    assert len(prefill) == 1 and decode == []  # a 4xx is the client's problem: no retry, no decode


def test_bad_request_bodies(proxy: str) -> None:
    resp = http.post(
        proxy + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
    assert http.post(proxy + "/v1/chat/completions", json=[1, 2]).status_code == 400


def test_decode_5xx_is_clean_error_without_retry(
    start_proxy: Callable[..., str], backends: dict[str, Standin]
) -> None:
    b = backends
    url = start_proxy("--prefill", b["p1"].url, "--decode", b["d1"].url, b["d2"].url)
    for name in ("d1", "d2"):
        b[name].behave(fail_status=500, fail_count=-1)
    resp = http.post(url + "/v1/completions", json={"model": "standin", "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 500 and resp.json()["error"]["code"] == 500
    _, decode = legs(b)
    assert len(decode) == 1  # the KV lease may be claimed: never a second decode leg
    stream = http.post(
        url + "/v1/completions", json={"model": "standin", "prompt": "x", "max_tokens": 2, "stream": True}
    )
    assert stream.status_code == 500 and stream.json()["error"]["code"] == 500


def test_decode_connect_failure_retries_on_another_instance(
    start_proxy: Callable[..., str], backends: dict[str, Standin], logs: Path
) -> None:
    dead = start_standin(logs / "dead.log")
    b = backends
    url = start_proxy(
        "--prefill", b["p1"].url, "--decode", dead.url, b["d1"].url, "--eject-after", "100",
        "--health-interval", "3600",
    )
    wait_until(lambda: http.get(url + "/health").json()["decode_healthy"] == 2, "both decode instances admitted")
    dead.stop()  # admitted, then nothing listens there any more: connection refused
    for _ in range(4):
        resp = http.post(url + "/v1/completions", json={"model": "standin", "prompt": "x", "max_tokens": 1})
        assert resp.status_code == 200
    assert len(b["d1"].generation_requests()) == 4
    text = http.get(url + "/metrics").text
    assert (
        metric(text, "pdserve_proxy_retries_total", leg="decode") == 2
    )  # the dead one is chosen every other time
    assert metric(text, "pdserve_proxy_errors_total", kind="decode_connect") == 2


# -- prefill failures and policies ----------------------------------------------------------------


def test_prefill_retried_on_another_instance(
    start_proxy: Callable[..., str], backends: dict[str, Standin]
) -> None:
    b = backends
    url = start_proxy("--prefill", b["p1"].url, b["p2"].url, "--decode", b["d1"].url, "--eject-after", "100")
    b["p1"].behave(fail_status=500, fail_count=-1)
    for _ in range(4):
        resp = http.post(url + "/v1/completions", json={"model": "standin", "prompt": "x", "max_tokens": 1})
        assert resp.status_code == 200
    assert len(b["p2"].generation_requests()) == 4
    decode = b["d1"].generation_requests()
    assert len(decode) == 4
    p2_params = [r["response"]["kv_transfer_params"] for r in b["p2"].generation_requests()]
    assert [d["body"]["kv_transfer_params"] for d in decode] == p2_params
    text = http.get(url + "/metrics").text
    retries = metric(text, "pdserve_proxy_retries_total", leg="prefill")
    assert retries == len(b["p1"].generation_requests()) >= 1
    assert metric(text, "pdserve_proxy_errors_total", kind="prefill_status") == retries
    assert metric(text, "pdserve_proxy_requests_total", path="disagg") == 4


def test_prefill_policy_retry_then_fail(
    start_proxy: Callable[..., str], backends: dict[str, Standin]
) -> None:
    b = backends
    url = start_proxy("--prefill", b["p1"].url, b["p2"].url, "--decode", b["d1"].url)
    for name in ("p1", "p2"):
        b[name].behave(no_params=True)
    resp = http.post(url + "/v1/completions", json={"model": "standin", "prompt": "x", "max_tokens": 1})
    assert resp.status_code == 502 and "prefill" in resp.json()["error"]["message"]
    prefill, decode = legs(b)
    assert len(prefill) == 2 and decode == []  # both prefill instances tried, no silent recompute
    text = http.get(url + "/metrics").text
    assert metric(text, "pdserve_proxy_errors_total", kind="prefill_no_params") == 2
    assert metric(text, "pdserve_proxy_errors_total", kind="prefill_failed") == 1


def test_prefill_policy_fail_does_not_retry(
    start_proxy: Callable[..., str], backends: dict[str, Standin]
) -> None:
    b = backends
    url = start_proxy(
        "--prefill", b["p1"].url, b["p2"].url, "--decode", b["d1"].url, "--on-prefill-failure", "fail"
    )
    for name in ("p1", "p2"):
        b[name].behave(fail_status=503, fail_count=-1)
    resp = http.post(
        url + "/v1/completions", json={"model": "standin", "prompt": "x", "max_tokens": 1, "stream": True}
    )
    assert resp.status_code == 502 and resp.json()["error"]["type"] == "BadGatewayError"
    prefill, decode = legs(b)
    assert len(prefill) == 1 and decode == []


def test_prefill_policy_decode_local(start_proxy: Callable[..., str], backends: dict[str, Standin]) -> None:
    b = backends
    url = start_proxy(
        "--prefill", b["p1"].url, "--decode", b["d1"].url, "--on-prefill-failure", "decode-local"
    )
    b["p1"].behave(no_params=True)
    body = {"model": "standin", "prompt": "fallback please", "max_tokens": 2, "stream": True}
    resp = http.post(url + "/v1/completions", json=body)
    assert resp.status_code == 200 and sse_events(resp.text)[-1] == "[DONE]"
    prefill, decode = legs(b)
    assert len(prefill) == 1
    assert decode[0]["body"] == body  # the client's own body: the decode instance prefills locally
    text = http.get(url + "/metrics").text
    assert metric(text, "pdserve_proxy_requests_total", path="decode_local_fallback") == 1
    assert metric(text, "pdserve_proxy_requests_total", path="disagg") == 0


# -- paths ------------------------------------------------------------------------------------------


def test_conditional_disagg_affinity_and_rewrite_from_config_file(
    start_proxy: Callable[..., str], backends: dict[str, Standin], tmp_path: Path
) -> None:
    b = backends
    config = tmp_path / "proxy.yaml"
    config.write_text(
        f"prefill: [{b['p1'].url}, {b['p2'].url}]\ndecode: [{b['d1'].url}]\n"
        "disagg-threshold-tokens: 50\nrewrite-remote-host: true\nprefix-affinity: true\nprefix-affinity-chars: 64\n"
    )
    url = start_proxy("--config", str(config))
    short = {"model": "standin", "prompt": "short prompt", "max_tokens": 1}
    assert http.post(url + "/v1/completions", json=short).status_code == 200
    prefill, decode = legs(b)
    assert prefill == [] and decode[0]["body"] == short
    shared = "s" * 64
    for i in range(6):
        long = {"model": "standin", "prompt": shared + f" question {i} " + "x" * 300, "max_tokens": 1}
        assert http.post(url + "/v1/completions", json=long).status_code == 200
    counts = sorted(len(b[n].generation_requests()) for n in ("p1", "p2"))
    assert counts == [0, 6]  # one shared prefix -> one prefill instance
    _, decode = legs(b)
    assert all(d["body"]["kv_transfer_params"]["remote_host"] == "127.0.0.1" for d in decode[1:])
    text = http.get(url + "/metrics").text
    assert metric(text, "pdserve_proxy_requests_total", path="conditional_local") == 1
    assert metric(text, "pdserve_proxy_requests_total", path="disagg") == 6


def test_collocated_mode_and_batch_prompts(
    start_proxy: Callable[..., str], backends: dict[str, Standin]
) -> None:
    b = backends
    url = start_proxy("--decode", b["d1"].url, b["d2"].url)
    body = {"model": "standin", "prompt": "no prefill pool", "max_tokens": 2, "stream": True}
    for _ in range(2):
        assert http.post(url + "/v1/completions", json=body).status_code == 200
    assert [r["body"] for r in b["d1"].generation_requests() + b["d2"].generation_requests()] == [body, body]
    assert metric(http.get(url + "/metrics").text, "pdserve_proxy_requests_total", path="collocated") == 2
    # With a prefill pool, a multi-prompt completions request becomes one P/D pair per prompt, merged.
    url2 = start_proxy("--prefill", b["p1"].url, "--decode", b["d1"].url)
    batch = {"model": "standin", "prompt": ["first", "second"], "max_tokens": 1}
    merged = http.post(url2 + "/v1/completions", json=batch)
    assert merged.status_code == 200, merged.text
    assert [c["index"] for c in merged.json()["choices"]] == [0, 1]
    assert sorted(r["body"]["prompt"] for r in b["p1"].generation_requests()) == ["first", "second"]
    assert sorted(r["body"]["prompt"] for r in b["d1"].generation_requests()[-2:]) == ["first", "second"]
    # A request sampling several choices is one pair: the prefill leg asks one choice (one held lease), the
    # decode instance forks the load into the n choices.
    several = {"model": "standin", "prompt": "pick two", "max_tokens": 1, "n": 2}
    assert http.post(url2 + "/v1/completions", json=several).status_code == 200
    assert b["p1"].generation_requests()[-1]["body"]["n"] == 1
    assert b["d1"].generation_requests()[-1]["body"]["n"] == 2
    assert "kv_transfer_params" in b["d1"].generation_requests()[-1]["body"]
    text = http.get(url2 + "/metrics").text
    assert metric(text, "pdserve_proxy_requests_total", path="disagg_split") == 1
    assert metric(text, "pdserve_proxy_requests_total", path="disagg") == 1
    # In front of vLLM decode instances (which cannot fork a load), --no-disagg-n serves it locally.
    url3 = start_proxy("--prefill", b["p1"].url, "--decode", b["d1"].url, "--no-disagg-n")
    p1_before = len(b["p1"].generation_requests())
    assert http.post(url3 + "/v1/completions", json=several).status_code == 200
    assert len(b["p1"].generation_requests()) == p1_before
    assert b["d1"].generation_requests()[-1]["body"] == several
    assert metric(http.get(url3 + "/metrics").text, "pdserve_proxy_requests_total", path="conditional_local") == 1


# -- admission control and auth -------------------------------------------------------------------


def test_overload_answers_503(start_proxy: Callable[..., str], backends: dict[str, Standin]) -> None:
    b = backends
    url = start_proxy("--prefill", b["p1"].url, "--decode", b["d1"].url, "--max-inflight", "2")
    b["d1"].behave(hold_before_response=True)
    body = {"model": "standin", "prompt": "x", "max_tokens": 1, "stream": True}
    results: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                http.post(url + "/v1/completions", json=body, timeout=30).status_code
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    wait_until(lambda: len(b["d1"].generation_requests()) == 2, "2 held requests")
    over = http.post(url + "/v1/completions", json=body)
    assert over.status_code == 503
    assert over.json()["error"]["type"] == "ServiceUnavailableError"
    b["d1"].behave(hold_before_response=False)
    b["d1"].release()
    for t in threads:
        t.join(timeout=30)
    assert results == [200, 200]
    assert http.post(url + "/v1/completions", json=body).status_code == 200
    assert metric(http.get(url + "/metrics").text, "pdserve_proxy_errors_total", kind="overload") == 1


def test_api_key_upstream_key_and_admin(
    start_proxy: Callable[..., str], backends: dict[str, Standin]
) -> None:
    b = backends
    url = start_proxy(
        "--prefill",
        b["p1"].url,
        "--decode",
        b["d1"].url,
        "--api-key",
        "client-secret",
        "--upstream-api-key",
        "instance-secret",
        "--admin-key",
        "admin-secret",
    )
    body = {"model": "standin", "prompt": "x", "max_tokens": 1}
    assert http.post(url + "/v1/completions", json=body).status_code == 401
    wrong = http.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "AuthenticationError"
    assert http.get(url + "/v1/models").status_code == 401
    client = {"Authorization": "Bearer client-secret"}
    assert http.post(url + "/v1/completions", json=body, headers=client).status_code == 200
    assert http.get(url + "/v1/models", headers=client).json()["data"][0]["id"] == "standin"
    prefill, decode = legs(b)
    assert (
        prefill[0]["headers"]["Authorization"]
        == decode[0]["headers"]["Authorization"]
        == "Bearer instance-secret"
    )
    assert http.get(url + "/health").status_code == 200  # health and metrics stay open
    assert http.get(url + "/metrics").status_code == 200

    admin = {"Authorization": "Bearer admin-secret"}
    listing = http.get(url + "/pdserve/instances").json()  # read-only: open, like /health and /metrics
    assert [i["url"] for i in listing["prefill"]] == [b["p1"].url]
    assert [i["url"] for i in listing["decode"]] == [b["d1"].url]
    assert set(listing["decode"][0]) >= {"url", "healthy", "in_flight"}

    def change(action: str, role: str, target: str) -> httpx.Response:
        return http.post(
            url + "/pdserve/instances", headers=admin, json={"action": action, "role": role, "url": target}
        )

    add_d2 = {"action": "add", "role": "decode", "url": b["d2"].url}
    assert http.post(url + "/pdserve/instances", json=add_d2).status_code == 401
    assert http.post(url + "/pdserve/instances", json=add_d2, headers=client).status_code == 401
    added = change("add", "decode", b["d2"].url.removeprefix("http://"))
    assert added.status_code == 200
    assert [(i["url"], i["healthy"]) for i in added.json()["decode"]] == [
        (b["d1"].url, True),
        (b["d2"].url, True),
    ]
    assert change("add", "decode", b["d2"].url).status_code == 409
    assert change("remove", "decode", b["d1"].url).status_code == 200
    assert change("remove", "decode", b["d2"].url).status_code == 409  # never the last decode instance
    assert change("remove", "prefill", b["p2"].url).status_code == 404
    assert change("drop", "decode", b["d2"].url).status_code == 400
    for standin in b.values():
        standin.reset()
    assert http.post(url + "/v1/completions", json=body, headers=client).status_code == 200
    assert len(b["d2"].generation_requests()) == 1 and b["d1"].generation_requests() == []
    # Removing the only prefill instance turns the proxy into a collocated router.
    assert change("remove", "prefill", b["p1"].url).json()["prefill"] == []
    assert http.post(url + "/v1/completions", json=body, headers=client).status_code == 200
    assert len(b["p1"].generation_requests()) == 1
    assert change("add", "prefill", b["p2"].url).status_code == 200
    assert http.post(url + "/v1/completions", json=body, headers=client).status_code == 200
    assert len(b["p2"].generation_requests()) == 1


# -- health -----------------------------------------------------------------------------------------


def test_dead_decode_instance_is_ejected_and_readmitted(
    start_proxy: Callable[..., str], backends: dict[str, Standin], logs: Path
) -> None:
    victim = start_standin(logs / "victim-1.log")
    port = victim.port
    try:
        url = start_proxy(
            "--prefill",
            backends["p1"].url,
            "--decode",
            victim.url,
            backends["d1"].url,
            "--health-interval",
            "0.2",
            "--eject-after",
            "2",
        )

        def victim_healthy() -> bool:
            listing = http.get(url + "/pdserve/instances").json()["decode"]
            return next(i for i in listing if i["url"] == victim.url)["healthy"]

        victim.stop()
        wait_until(lambda: not victim_healthy(), "the dead instance to be ejected")
        body = {"model": "standin", "prompt": "x", "max_tokens": 1}
        for _ in range(4):
            assert http.post(url + "/v1/completions", json=body).status_code == 200
        assert len(backends["d1"].generation_requests()) == 4
        assert (
            metric(http.get(url + "/metrics").text, "pdserve_proxy_errors_total", kind="decode_connect") == 0
        )

        victim = start_standin(logs / "victim-2.log", port=port)  # same port
        wait_until(victim_healthy, "the restarted instance to be re-admitted")
        standin = Standin(victim)
        for _ in range(4):
            assert http.post(url + "/v1/completions", json=body).status_code == 200
        assert len(standin.generation_requests()) == 2
        text = http.get(url + "/metrics").text
        assert metric(text, "pdserve_proxy_instance_ejections_total", role="decode", url=victim.url) == 1
    finally:
        victim.stop()


# -- hardening: admin off by default, readiness, Retry-After, retry budget ------------------------------


def test_admin_route_is_off_without_admin_key(start_proxy: Callable[..., str], backends: dict[str, Standin]) -> None:
    b = backends
    url = start_proxy("--prefill", b["p1"].url, "--decode", b["d1"].url)
    for change in ({"action": "add", "role": "decode", "url": "127.0.0.1:1"},
                   {"action": "remove", "role": "prefill", "url": b["p1"].url}):
        resp = http.post(url + "/pdserve/instances", json=change)
        assert resp.status_code == 403 and "--admin-key" in resp.json()["error"]["message"]
    listing = http.get(url + "/pdserve/instances").json()
    assert [i["url"] for i in listing["prefill"]] == [b["p1"].url]
    assert [i["url"] for i in listing["decode"]] == [b["d1"].url]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_instances_admitted_only_after_a_probe_and_requests_wait_for_one(
    start_proxy: Callable[..., str], logs: Path
) -> None:
    """A proxy started before its instance: /health is 503 and the instance 'starting'; a request waits
    (bounded) and gets 503 with Retry-After, or its answer once the instance comes up meanwhile."""
    port = free_port()
    url = start_proxy("--decode", f"127.0.0.1:{port}", "--instance-wait-timeout", "0.5")
    health = http.get(url + "/health")
    assert health.status_code == 503 and health.json()["decode_healthy"] == 0
    assert http.get(url + "/pdserve/instances").json()["decode"][0]["state"] == "starting"
    body = {"model": "standin", "prompt": "x", "max_tokens": 1}
    resp = http.post(url + "/v1/completions", json=body)
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "ServiceUnavailableError"
    assert int(resp.headers["Retry-After"]) >= 1
    assert http.get(url + "/v1/models").status_code == 503
    # Now a request that arrives first and an instance that starts while it waits.
    url = start_proxy("--decode", f"127.0.0.1:{port}", "--instance-wait-timeout", "60")
    results: list[int] = []
    waiter = threading.Thread(target=lambda: results.append(http.post(url + "/v1/completions", json=body).status_code))
    waiter.start()
    late = start_standin(logs / "late.log", port=port)
    try:
        waiter.join(timeout=60)
        assert results == [200]
        assert http.get(url + "/health").status_code == 200
        assert len(Standin(late).generation_requests()) == 1
    finally:
        late.stop()
        waiter.join(timeout=60)


def test_upstream_retry_after_is_respected(start_proxy: Callable[..., str], backends: dict[str, Standin]) -> None:
    b = backends
    url = start_proxy("--decode", b["d1"].url, b["d2"].url, "--instance-wait-timeout", "0.3")
    wait_until(lambda: http.get(url + "/health").json()["decode_healthy"] == 2, "both decode instances admitted")
    b["d1"].behave(fail_status=503, fail_count=-1, retry_after="30")
    body = {"model": "standin", "prompt": "x", "max_tokens": 1}
    for _ in range(6):  # the one that meets d1 is retried on d2; then d1 is passed over
        assert http.post(url + "/v1/completions", json=body).status_code == 200
    assert len(b["d1"].generation_requests()) == 1 and len(b["d2"].generation_requests()) == 6
    d1 = next(i for i in http.get(url + "/pdserve/instances").json()["decode"] if i["url"] == b["d1"].url)
    assert d1["state"] == "backoff" and d1["healthy"] and d1["ejections_total"] == 0  # busy, not broken
    b["d2"].behave(fail_status=503, fail_count=-1, retry_after="7")
    busy = http.post(url + "/v1/completions", json=body)
    assert busy.status_code == 503 and busy.headers["Retry-After"] == "7"
    none_left = http.post(url + "/v1/completions", json=body)  # both back off: nothing sent, 503
    assert none_left.status_code == 503 and 1 <= int(none_left.headers["Retry-After"]) <= 7
    assert len(b["d1"].generation_requests()) == 1 and len(b["d2"].generation_requests()) == 7


def test_retry_budget_caps_prefill_work_in_an_error_storm(
    start_proxy: Callable[..., str], backends: dict[str, Standin]
) -> None:
    b = backends
    url = start_proxy(
        "--prefill", b["p1"].url, b["p2"].url, "--decode", b["d1"].url, "--eject-after", "1000",
        "--retry-budget-ratio", "0.1", "--retry-budget-burst", "1", "--retry-budget-min-per-s", "0",
    )
    for name in ("p1", "p2"):
        b[name].behave(fail_status=500, fail_count=-1)
    n = 40
    for _ in range(n):
        body = {"model": "standin", "prompt": "x", "max_tokens": 1}
        assert http.post(url + "/v1/completions", json=body).status_code == 502
    prefill, decode = legs(b)
    retries = len(prefill) - n
    assert decode == [] and 1 <= retries <= 1 + n * 0.1  # not 2n legs: the budget held
    text = http.get(url + "/metrics").text
    assert metric(text, "pdserve_proxy_retries_total", leg="prefill") == retries
    assert metric(text, "pdserve_proxy_errors_total", kind="retry_budget") == n - retries


def test_proxy_on_a_busy_port_says_so_in_one_line(backends: dict[str, Standin], tmp_path: Path) -> None:
    busy = backends["d1"].proc.port
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "proxy", "--port", str(busy), "--decode", backends["d1"].url],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith(f"pdserve proxy: cannot listen on 127.0.0.1:{busy}")
    assert "Traceback" not in out.stderr
