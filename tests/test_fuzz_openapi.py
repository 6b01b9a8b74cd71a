"""Fuzzing `pdserve serve` and `pdserve render` from their own OpenAPI documents (schemathesis).

Each server runs as a real process on 127.0.0.1 (a tiny random model; a tokenizer-only folder for render).
Schemathesis reads `/openapi.json` (request bodies are the pydantic models the routes validate with, see
pdserve/api/openapi.py) and generates, for every operation, bodies that follow the schema and bodies
that break it. Every answer must be below 500 (client mistakes are 4xx with an OpenAI error body), no
request may hang past its timeout, and the server must be healthy and serving afterwards. Bounded:
EXAMPLES per operation and mode, a fixed seed in CI. (The proxy has no OpenAPI document; see
tests/test_fuzz_proxy.py.)
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from server_utils import MODEL, ServerProcess, make_model_dir
from test_render_support import Proc, make_tokenizer_dir

EXAMPLES = 8  # per operation and generation mode
REQUEST_TIMEOUT_S = 30.0  # an answer later than this is a hang
MAX_MODEL_LEN = "96"  # bounds the work of any generated generation request


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(serve URL, render URL), started together (each takes seconds to import and load)."""
    root = tmp_path_factory.mktemp("fuzz")
    model, tok = make_model_dir(root), make_tokenizer_dir(root / "tok")
    srv = ServerProcess(model, root / "serve.log", "--max-model-len", MAX_MODEL_LEN, "--enable-scale-out",
                        "--max-num-seqs", "16")
    try:
        rnd = Proc(root / "render.log", "render", str(tok), "--served-model-name", MODEL,
                   "--max-model-len", MAX_MODEL_LEN)
    except BaseException:
        srv.stop()
        raise
    try:
        yield srv.wait_ready().url, rnd.wait_ready().url
    finally:
        srv.stop()
        rnd.stop()


def fuzz_operation(url: str, op: schemathesis.APIOperation, mode: GenerationMode, statuses: dict[str, int]) -> None:
    positive = mode == GenerationMode.POSITIVE

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(mode))
    def run(case: schemathesis.Case) -> None:
        if positive and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # a served name, so that cases get past the 404 into the route
        response = case.call(base_url=url, timeout=REQUEST_TIMEOUT_S)
        status = response.status_code
        statuses[f"{status // 100}xx"] = statuses.get(f"{status // 100}xx", 0) + 1
        assert status < 500, f"{case.method} {case.path} -> {status}: {response.text[:500]}\n{case.body!r}"
        if status >= 400 and status != 404:
            error = response.json().get("error")
            assert isinstance(error, dict) and error.get("message"), response.text[:500]

    run()


def fuzz(url: str) -> dict[str, int]:
    """Every operation of the server's OpenAPI document, positive and negative cases; returns the count of
    answers by status class."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    statuses: dict[str, int] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.body for op in operations), "the document describes no request body"
    for op in operations:
        fuzz_operation(url, op, GenerationMode.POSITIVE, statuses)
        if op.body or any(True for _ in op.iter_parameters()):  # without input nothing can break the schema
            fuzz_operation(url, op, GenerationMode.NEGATIVE, statuses)
    return statuses


def test_fuzz_serve_openapi(servers: tuple[str, str]) -> None:
    serve = servers[0]
    statuses = fuzz(serve)
    assert statuses.get("2xx", 0) > 0 and statuses.get("4xx", 0) > 0, statuses
    assert httpx.get(serve + "/health", timeout=10).status_code == 200
    ok = httpx.post(serve + "/v1/completions", json={"model": MODEL, "prompt": "still fine", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_fuzz_render_openapi(servers: tuple[str, str]) -> None:
    render = servers[1]
    statuses = fuzz(render)
    assert statuses.get("2xx", 0) > 0 and statuses.get("4xx", 0) > 0, statuses
    assert httpx.get(render + "/health", timeout=10).status_code == 200
    ok = httpx.post(render + "/v1/completions/render", json={"model": MODEL, "prompt": "still fine"}, timeout=60)
    assert ok.status_code == 200 and ok.json()[0]["token_ids"]


def test_served_documents_describe_the_bodies(servers: tuple[str, str]) -> None:
    serve, render = servers
    serve_doc = httpx.get(serve + "/openapi.json", timeout=10).json()
    body = serve_doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert "messages" in serve_doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    render_doc = httpx.get(render + "/openapi.json", timeout=10).json()
    assert "requestBody" in render_doc["paths"]["/v1/completions/render"]["post"]


def test_body_request_id_that_is_no_header_value(servers: tuple[str, str]) -> None:
    """Found by the fuzz: a body request_id with control characters was echoed as X-Request-Id, which
    uvicorn refuses to send: the connection dropped with no answer. Now the header carries what is safe."""
    serve, render = servers
    for url, path in ((serve, "/inference/v1/generate"), (serve, "/v1/completions"),
                      (render, "/v1/completions/render")):
        body = {"model": MODEL, "request_id": "a\u001fb\u00e9\nc", "max_tokens": 1}
        body |= {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}} if "generate" in path else {
            "prompt": "hi"}
        resp = httpx.post(url + path, json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert "b" in resp.headers.get("x-request-id", "b") and "\n" not in resp.headers.get("x-request-id", "")
