"""The scale-out routes inside the real server app, over a scripted fake engine (no model, no process).

What the process tests cannot cheaply show: 403 without `--enable-scale-out`, `output_mode: "text"` with
stop strings on a normal server, `kv_transfer_params` handed to the engine and returned, and abort by
the external request id reaching the engine ids of every choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from pdserve.api.openai.params import GenerationDefaults
from pdserve.api.pd import PUSH_FIRST_TOKEN, HeldKVParams
from pdserve.server.app import build_app
from pdserve.server.metrics import ServerMetrics
from pdserve.server.state import ServerState
from pdserve.types.outputs import RequestOutput, TokenLogprob

HELD = HeldKVParams(request_id="r", block_ids=(3,), num_tokens=3, engine_id="e", host="127.0.0.1", port=5600,
                    generation=1, expires_at=9.0, lease_token="t" * 32)


class FakeEngine:
    """Emits `script` one token per output; records what it was given. `hold` keeps a request open until
    aborted (for the abort test)."""

    def __init__(self, script: list[int], hold: bool = False):
        self.script = script
        self.hold = hold
        self.calls: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self._abort_events: dict[str, asyncio.Event] = {}
        self.dead_error = None

    async def generate(self, request_id: str, prompt: list[int], params: Any,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        self.calls.append({"id": request_id, "prompt": prompt, "params": params, "kv": kv_transfer_params})
        event = self._abort_events.setdefault(request_id, asyncio.Event())
        n = min(params.max_tokens, len(self.script))
        for i in range(n):
            if event.is_set():
                yield RequestOutput(request_id, prompt, [], None, i, True, "abort")
                return
            last = i == n - 1 and not self.hold
            lp = [TokenLogprob(self.script[i], -0.5, 1, [(self.script[i], -0.5), (7, -2.0)])]
            yield RequestOutput(request_id, prompt, [self.script[i]], lp if params.logprobs is not None else None,
                                i + 1, last, "length" if last else None,
                                kv_transfer_params=HELD if last and kv_transfer_params else None)
            await asyncio.sleep(0)
        if self.hold:
            await event.wait()
            yield RequestOutput(request_id, prompt, [], None, n, True, "abort")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._abort_events.setdefault(request_id, asyncio.Event()).set()

    def stats(self) -> Any:
        raise AssertionError("not scraped in these tests")


def make_state(engine: FakeEngine, *, tokens_only: bool, scale_out: bool) -> ServerState:
    from pdserve.model.default_model import resolve_model
    from pdserve.text.tokenizer import load_tokenizer

    folder = Path(resolve_model("smollm2-135m"))
    return ServerState(
        engine=engine, tokenizer=None if tokens_only else load_tokenizer(folder), served_model_names=["m"],
        model_path=str(folder), max_model_len=64, vocab_size=49152, defaults=GenerationDefaults(),
        metrics=ServerMetrics("m", 64, engine.stats, registry=CollectorRegistry()),
        tokens_only=tokens_only, enable_scale_out=scale_out, randomize_request_ids=False,
    )


@pytest.fixture()
def client_factory() -> Iterator[Any]:
    clients: list[TestClient] = []

    def make(engine: FakeEngine, **kw: bool) -> TestClient:
        client = TestClient(build_app(make_state(engine, **kw), manage_engine=False))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def test_forbidden_without_scale_out(client_factory: Any) -> None:
    client = client_factory(FakeEngine([5]), tokens_only=False, scale_out=False)
    for path, body in (("/inference/v1/generate", {"token_ids": [1]}), ("/inference/v1/abort_requests",
                                                                         {"request_ids": []})):
        r = client.post(path, json=body)
        assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"
    assert client.post("/abort_requests", json={"request_ids": []}).status_code == 404  # tokens-only legacy


def test_text_mode_with_stop_strings_on_scale_out_server(client_factory: Any) -> None:
    tok_ids = [28, 5013, 9891, 2136]  # whatever these are, they decode to some text
    engine = FakeEngine(tok_ids)
    client = client_factory(engine, tokens_only=False, scale_out=True)
    full = client.post("/inference/v1/generate", json={"token_ids": [1, 2], "output_mode": "text",
                                                       "sampling_params": {"max_tokens": 4}}).json()
    text = full["choices"][0]["text"]
    assert full["output_mode"] == "text" and text and full["choices"][0]["token_ids"] == tok_ids
    stop = text[len(text) // 2:][:2]
    cut = client.post("/inference/v1/generate", json={"token_ids": [1, 2], "output_mode": "text",
                                                      "sampling_params": {"max_tokens": 4, "stop": [stop]}}).json()
    choice = cut["choices"][0]
    assert choice["text"] == text[:text.index(stop)] and (choice["finish_reason"], choice["stop_reason"]) == (
        "stop", stop)
    r = client.post("/inference/v1/generate", json={"token_ids": [1], "output_mode": "derender"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "output_mode 'derender'"


def test_kv_transfer_params_and_request_ids(client_factory: Any) -> None:
    engine = FakeEngine([9, 8, 7])
    client = client_factory(engine, tokens_only=True, scale_out=False)
    kv = {"do_remote_decode": True, "do_remote_prefill": False}
    r = client.post("/inference/v1/generate", headers={"X-Request-Id": "hdr"},
                    json={"request_id": "body", "token_ids": [1, 2, 3], "kv_transfer_params": kv,
                          "sampling_params": {"max_tokens": 1, "logprobs": 2}})
    out = r.json()
    assert r.headers["x-request-id"] == "generate-tokens-hdr" and out["request_id"] == "generate-tokens-hdr"
    assert engine.calls[0]["id"] == "generate-tokens-hdr" and dict(engine.calls[0]["kv"].wire) == kv
    assert out["kv_transfer_params"] == HELD.to_json()
    assert out["choices"][0]["logprobs"] == {"content": [{"token_id": 9, "logprob": -0.5, "rank": 1, "top_logprobs": [
        {"token_id": 9, "logprob": -0.5, "rank": 1}, {"token_id": 7, "logprob": -2.0, "rank": 2}]}]}
    # The text routes need a tokenizer that a --tokens-only server does not load.
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert client.post(path, json={}).status_code == 400


def test_remote_prefill_with_n_above_one_forks_the_load(client_factory: Any) -> None:
    """One prefill lease is loaded once, on this route as on completions and chat (the shared pipeline):
    with n > 1 the first choice loads the KV and the others are submitted after it, without the params
    (they share the loaded blocks through the prefix cache). The first choice recomputes the last prompt token
    (the forks wait for its first output as the sign of a loaded prompt): no first token, pushed or sent."""
    kv = {"do_remote_prefill": True, "remote_block_ids": [[0]], "remote_engine_id": "p", "remote_request_id": "r",
          "remote_host": "127.0.0.1", "remote_port": 5600}
    for stream in (False, True):
        engine = FakeEngine([9])
        client = client_factory(engine, tokens_only=True, scale_out=False)
        r = client.post("/inference/v1/generate", json={"token_ids": [1, 2], "kv_transfer_params": kv,
                                                        "stream": stream, "sampling_params": {"n": 3, "max_tokens": 1}})
        assert r.status_code == 200, r.text
        assert [c["kv"] and dict(c["kv"].wire) for c in engine.calls] == [{**kv, PUSH_FIRST_TOKEN: False}, None, None]


def test_abort_reaches_every_choice(client_factory: Any) -> None:
    engine = FakeEngine([4, 4], hold=True)
    client = client_factory(engine, tokens_only=True, scale_out=False)
    with client.stream("POST", "/inference/v1/generate", json={
            "request_id": "x", "token_ids": [1], "stream": True, "sampling_params": {"n": 2, "max_tokens": 2}}) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data: {"):
                seen += 1
                if seen == 4:  # both choices produced their two tokens and now wait
                    break
        ab = client.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-x"]})
        assert ab.status_code == 200 and ab.json()["num_aborted"] == 2
        finishes = [line for line in lines if '"abort"' in line]
    assert sorted(engine.aborted) == ["1_generate-tokens-x", "generate-tokens-x"]
    assert len(finishes) == 2


def test_penalties_logit_bias_and_allowed_ids_reach_the_engine(client_factory: Any) -> None:
    engine = FakeEngine([9])
    client = client_factory(engine, tokens_only=True, scale_out=False)
    r = client.post("/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {
        "max_tokens": 1, "presence_penalty": -0.5, "frequency_penalty": 2, "repetition_penalty": 1.3,
        "logit_bias": {"9": -101, "4": 0.5}, "allowed_token_ids": [4, 9]}})
    assert r.status_code == 200, r.text
    p = engine.calls[-1]["params"]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-0.5, 2.0, 1.3)
    assert p.logit_bias == {9: -100.0, 4: 0.5} and p.allowed_token_ids == [4, 9]
    r = client.post("/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}})
    p = engine.calls[-1]["params"]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias) == (0.0, 0.0, 1.0, None)
    calls = len(engine.calls)
    for sp, param in (({"presence_penalty": 3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                      ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids")):
        r = client.post("/inference/v1/generate", json={"token_ids": [1], "sampling_params": sp})
        assert r.status_code == 400, (sp, r.text)
        assert r.json()["error"]["param"] == f"sampling_params.{param}"
    assert len(engine.calls) == calls
