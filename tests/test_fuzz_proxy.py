"""Fuzzing the proxy's JSON routes (hypothesis) against a live `pdserve proxy` in front of stand-in backends.

The proxy is aiohttp (no OpenAPI document), so the bodies are generated here: arbitrary JSON, arbitrary
bytes, and OpenAI-shaped bodies whose fields take wrong types and extreme values. Every answer must be
a 2xx or a 4xx with an OpenAI error body (zero 5xx), every request must finish within its timeout (zero
hangs), and the proxy must be healthy and serving afterwards. Bounded: a fixed number of examples, a
fixed seed in CI (tests/conftest.py's "ci" profile).
"""

from __future__ import annotations

import json
import string
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_proxy import Proc, start_standin

REQUEST_TIMEOUT_S = 20.0  # a request not answered by then is a hang
EXAMPLES = 120

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=16,
)
odd_numbers = st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30, 0.5, -0.0, 1e308, "1", "", None, True, [], {}])
prompts = st.one_of(
    st.text(max_size=300),
    st.lists(st.integers(min_value=-5, max_value=2**40), max_size=20),
    st.lists(st.text(max_size=30), max_size=4),
    json_values,
)
messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "nobody"]) | json_values},
            optional={"content": st.text(max_size=200) | json_values | st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=50) | json_values}),
                max_size=3,
            )},
        ),
        max_size=4,
    ),
    json_values,
)
generation_fields = {
    "max_tokens": odd_numbers | st.integers(min_value=1, max_value=8),
    "max_completion_tokens": odd_numbers,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | json_values}) | json_values,
    "n": odd_numbers,
    "temperature": odd_numbers,
    "echo": st.booleans() | json_values,
    "logprobs": odd_numbers,
    "prompt_logprobs": odd_numbers,
    "kv_transfer_params": json_values,
    "min_tokens": odd_numbers,
    "stop": json_values,
}
completion_bodies = st.fixed_dictionaries(
    {"model": st.just("standin") | json_values, "prompt": prompts}, optional=generation_fields
)
chat_bodies = st.fixed_dictionaries(
    {"model": st.just("standin") | json_values, "messages": messages}, optional=generation_fields
)
header_text = st.text(alphabet=string.ascii_letters + string.digits + "-_.:/", max_size=40)


@pytest.fixture(scope="module")
def fuzz_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[Proc]]]:
    logs: Path = tmp_path_factory.mktemp("fuzz-proxy")
    procs: list[Proc] = []
    try:
        for name in ("p", "d"):
            procs.append(start_standin(logs / f"{name}.log"))
        proxy = Proc(
            [sys.executable, "-m", "pdserve", "proxy", "--host", "127.0.0.1", "--port", "0",
             "--prefill", procs[0].url, "--decode", procs[1].url, "--admin-key", "fuzz-admin"],
            logs / "proxy.log", "pdserve proxy listening on",
        )
        procs.append(proxy)
        yield proxy.url, procs
    finally:
        for proc in reversed(procs):
            proc.stop()


def _check(resp: httpx.Response) -> None:
    assert resp.status_code < 500, f"{resp.status_code}: {resp.text[:500]}"
    if resp.status_code >= 400:
        body = resp.json()
        assert isinstance(body.get("error"), dict) and body["error"].get("message"), resp.text[:500]


FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def test_fuzz_proxy_json_routes(fuzz_proxy: tuple[str, list[Proc]]) -> None:
    url, procs = fuzz_proxy
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:

        @FUZZ
        @given(
            route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
            body=completion_bodies | chat_bodies | json_values,
            request_id=st.none() | header_text,
        )
        def generation(route: str, body: object, request_id: str | None) -> None:
            headers = {"X-Request-Id": request_id} if request_id else {}
            _check(client.post(route, content=json.dumps(body), headers=headers))

        @FUZZ
        @given(
            route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/pdserve/instances"]),
            raw=st.binary(max_size=300),
        )
        def raw_bytes(route: str, raw: bytes) -> None:
            _check(client.post(route, content=raw, headers={"Content-Type": "application/json"}))

        @FUZZ
        @given(
            body=st.fixed_dictionaries(
                {},
                optional={"action": st.sampled_from(["add", "remove"]) | json_values,
                          "role": st.sampled_from(["prefill", "decode"]) | json_values,
                          "url": header_text | json_values},
            )
            | json_values,
            key=st.sampled_from([None, "wrong"]),
        )
        def admin(body: object, key: str | None) -> None:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            resp = client.post("/pdserve/instances", content=json.dumps(body), headers=headers)
            _check(resp)
            assert resp.status_code == 401  # never changes anything without the admin key

        generation()
        raw_bytes()
        admin()
        assert client.get("/health").status_code == 200
        ok = client.post("/v1/completions", json={"model": "standin", "prompt": "still fine", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
        listing = client.get("/pdserve/instances").json()
        assert [i["url"] for i in listing["prefill"]] == [procs[0].url]
        assert [i["url"] for i in listing["decode"]] == [procs[1].url]
    assert all(proc.proc.poll() is None for proc in procs)
