"""The server's routes in-process over a scripted engine: engine-side errors, a full queue, and the
`kv_transfer_params` plumbing a P/D proxy relies on. No model, no subprocess (fast)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.api import pd
from pdserve.api.openai.params import GenerationDefaults
from pdserve.engine.async_engine import QueueFullError
from pdserve.engine.engine import EngineStats
from pdserve.server.app import build_app
from pdserve.server.metrics import ServerMetrics
from pdserve.server.state import ServerState
from pdserve.text.tokenizer import Tokenizer, load_tokenizer
from pdserve.types.outputs import RequestMetrics, RequestOutput
from pdserve.types.sampling_params import ParamError, SamplingParams

Script = Callable[[str, list[int], SamplingParams, dict | None], list[RequestOutput]]


class ScriptedEngine:
    """Answers each request with the outputs a script returns (or the exception it raises)."""

    def __init__(self, script: Script):
        self.script = script
        self.calls: list[tuple[str, list[int], SamplingParams, dict | None]] = []
        self.aborted: list[str] = []
        self.dead_error = None

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        self.calls.append((request_id, prompt, params, kv_transfer_params))
        outputs = self.script(request_id, prompt, params, kv_transfer_params)
        for out in outputs:
            await asyncio.sleep(0)
            yield out

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 0, 0.0, 16, 16, 0, 0, 0)


def output(rid: str, prompt: list[int], ids: list[int], n: int, finished: bool = False, reason: str | None = None,
           error: str | None = None, kv: pd.HeldKVParams | None = None, cached: int = 0) -> RequestOutput:
    return RequestOutput(rid, prompt, ids, None, n, finished, reason if finished else None, None, error, cached,
                         kv if finished else None, RequestMetrics(arrival_time=0.0))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from pdserve.model.default_model import resolve_model

    return load_tokenizer(Path(resolve_model("smollm2-135m")))


def make_client(tok: Tokenizer, script: Script, defaults: GenerationDefaults | None = None,
                **state_fields: Any) -> tuple[httpx.AsyncClient, ScriptedEngine]:
    engine = ScriptedEngine(script)
    state = ServerState(engine=engine, tokenizer=tok, served_model_names=["m"], model_path="/m",
                        max_model_len=64, vocab_size=tok.vocab_size, defaults=defaults or GenerationDefaults(),
                        metrics=ServerMetrics("m", 64, engine.stats), **state_fields)
    app = build_app(state, manage_engine=False)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test"), engine


def words(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def sse_events(body: str) -> list[Any]:
    events = [line[6:] for line in body.split("\n\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_engine_error_is_500_or_an_error_frame(tok: Tokenizer) -> None:
    ids = words(tok, " one two")

    def script(rid: str, prompt: list[int], params: SamplingParams, kv: dict | None) -> list[RequestOutput]:
        return [output(rid, prompt, ids[:1], 1),
                output(rid, prompt, [], 1, True, "error", error="KV load failed: peer gone")]

    async def go() -> None:
        client, _ = make_client(tok, script)
        async with client:
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
            assert r.status_code == 500 and "KV load failed: peer gone" in r.json()["error"]["message"]
            r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                 "stream": True})
            assert r.status_code == 200
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == 500 and "peer gone" in events[-2]["error"]["message"]

    run(go())


def test_a_refused_lease_is_the_clients_error_also_for_a_stream(tok: Tokenizer) -> None:
    params = {"do_remote_prefill": True}

    def script(rid: str, prompt: list[int], params: SamplingParams, kv: dict | None) -> list[RequestOutput]:
        out = output(rid, prompt, [], 0, True, "error", error="producer refused claim: already claimed")
        out.kv_rejection, out.error_status = "already_claimed", 409  # as the engine reports a refused lease
        return [out]

    async def go() -> None:
        client, _ = make_client(tok, script)
        async with client:
            for stream, n in ((False, 1), (True, 1), (False, 2), (True, 2)):  # n = 2: the fork fails with it
                r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": stream,
                                                               "n": n, "kv_transfer_params": params})
                assert r.status_code == 409, r.text  # before any byte of the stream: a real status
                err = r.json()["error"]
                assert err["param"] == "kv_transfer_params" and err["type"] == "ConflictError"
                assert err["message"].startswith("kv_transfer_params rejected (already_claimed): producer refused")

    run(go())


def test_engine_refusals(tok: Tokenizer) -> None:
    def full(*_: Any) -> list[RequestOutput]:
        raise QueueFullError("the server's waiting queue is full (1 requests)")

    def invalid(*_: Any) -> list[RequestOutput]:
        raise ParamError("remote_block_ids must be a list", "kv_transfer_params")

    async def go() -> None:
        client, _ = make_client(tok, full)
        async with client:
            r = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
            assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        client, _ = make_client(tok, invalid)
        async with client:
            r = await client.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"

    run(go())


def test_kv_transfer_params_round_trip(tok: Tokenizer) -> None:
    ids = words(tok, " a b c")

    def produced(rid: str) -> pd.HeldKVParams:
        return pd.HeldKVParams(request_id=rid, block_ids=(1, 2), num_tokens=3, engine_id="e", host="127.0.0.1",
                               port=5600, generation=1, expires_at=9.0, lease_token="t" * 32)

    def script(rid: str, prompt: list[int], params: SamplingParams, kv: Any) -> list[RequestOutput]:
        return [output(rid, prompt, ids[:1], 1), output(rid, prompt, ids[1:], 3, True, "length",
                                                        kv=produced(rid), cached=2)]

    async def go() -> None:
        client, engine = make_client(tok, script)
        async with client:
            sent = {"do_remote_decode": True, "remote_host": None}
            r = await client.post("/v1/completions", headers={"X-Request-Id": "p1"},
                                  json={"prompt": ["x", "y"], "max_tokens": 1, "kv_transfer_params": sent})
            body = r.json()
            assert [dict(c[3].wire) for c in engine.calls] == [sent, sent]
            assert [c[0].rsplit("-", 1)[0] for c in engine.calls] == ["cmpl-p1-0", "cmpl-p1-1"]
            assert body["kv_transfer_params"] == produced(engine.calls[0][0]).to_json()  # the first prompt's, as vLLM
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
            # streamed: only on the chunk that carries the finish reason
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "stream": True,
                "kv_transfer_params": {"do_remote_prefill": True, "remote_prefill_cached_tokens": 7,
                                       "prompt_token_ids": [5, 6, 7]},
                "stream_options": {"include_usage": True}})
            events = sse_events(r.text)
            chunks = [e for e in events[:-1] if e["choices"]]
            with_kv = [c for c in chunks if "kv_transfer_params" in c]
            assert len(with_kv) == 1 and with_kv[0]["choices"][0]["finish_reason"] == "length"
            assert engine.calls[-1][1] == [5, 6, 7]  # the proxy's prompt ids, no templating
            assert "prompt_token_ids" not in engine.calls[-1][3].wire  # popped before the engine sees it
            assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 7  # P's hits, reported by D

    run(go())


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_continuous_usage_stats_only_with_include_usage(tok: Tokenizer, path: str, body: dict) -> None:
    ids = words(tok, " one two")

    def script(rid: str, prompt: list[int], params: SamplingParams, kv: Any) -> list[RequestOutput]:
        return [output(rid, prompt, ids[:1], 1), output(rid, prompt, ids[1:2], 2, True, "length")]

    async def go() -> None:
        client, _ = make_client(tok, script)
        async with client:
            for include in (True, False):
                r = await client.post(path, json={**body, "max_tokens": 2, "stream": True, "stream_options": {
                    "include_usage": include, "continuous_usage_stats": True}})
                events = sse_events(r.text)
                assert events[-1] == "[DONE]"
                content = [e for e in events[:-1] if e["choices"] and "role" not in e["choices"][0].get("delta", {})]
                assert [c["choices"][0]["finish_reason"] for c in content] == [None, "length"]
                # the held KV's params ride on the finishing chunk alone (None: nothing held)
                assert ["kv_transfer_params" in c for c in content] == [False, True]
                if include:  # every chunk its usage so far, then the whole usage alone
                    assert [c["usage"]["completion_tokens"] for c in content] == [1, 2]
                    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 2
                else:  # continuous_usage_stats means nothing without include_usage
                    assert all("usage" not in e for e in events[:-1])

    run(go())


def test_stop_string_aborts_the_engine_request(tok: Tokenizer) -> None:
    ids = words(tok, " alpha beta gamma delta")

    def script(rid: str, prompt: list[int], params: SamplingParams, kv: dict | None) -> list[RequestOutput]:
        return [output(rid, prompt, [t], i + 1) for i, t in enumerate(ids)]  # never finishes by itself

    async def go() -> None:
        client, engine = make_client(tok, script)
        async with client:
            r = await client.post("/v1/completions", json={"prompt": "x", "stop": "gamma", "max_tokens": 10})
            choice = r.json()["choices"][0]
            assert choice["text"] == " alpha beta " and choice["stop_reason"] == "gamma"
            assert engine.aborted == [engine.calls[0][0]]

    run(go())


def test_generation_config_repetition_penalty_is_a_default(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.15, "temperature": 0.6}))
    assert GenerationDefaults.from_model_dir(tmp_path) == GenerationDefaults(temperature=0.6, repetition_penalty=1.15)
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 0}))
    assert GenerationDefaults.from_model_dir(tmp_path).repetition_penalty == 1.0  # would fail every request


def test_penalties_logit_bias_and_allowed_ids_reach_the_engine(tok: Tokenizer) -> None:
    ids = words(tok, " a")

    def script(rid: str, prompt: list[int], params: SamplingParams, kv: dict | None) -> list[RequestOutput]:
        return [output(rid, prompt, ids, 1, True, "length")]

    async def go() -> None:
        client, engine = make_client(tok, script, GenerationDefaults(repetition_penalty=1.15))
        async with client:
            r = await client.post("/v1/completions", json={
                "prompt": "x", "max_tokens": 1, "presence_penalty": 0.5, "frequency_penalty": -1,
                "logit_bias": {"5": 250, "7": -3.5}, "allowed_token_ids": [5, 7, 9]})
            assert r.status_code == 200, r.text
            p = engine.calls[-1][2]
            assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.15)
            assert p.logit_bias == {5: 100.0, 7: -3.5} and p.allowed_token_ids == [5, 7, 9]  # clamped as OpenAI
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "repetition_penalty": 1.0,
                "presence_penalty": None})
            assert r.status_code == 200, r.text
            p = engine.calls[-1][2]
            assert (p.presence_penalty, p.repetition_penalty, p.logit_bias, p.allowed_token_ids) == (0.0, 1.0, None,
                                                                                                       None)
            calls = len(engine.calls)
            for body, param in (({"presence_penalty": 3}, "presence_penalty"),
                                ({"frequency_penalty": -2.5}, "frequency_penalty"),
                                ({"repetition_penalty": 0}, "repetition_penalty"),
                                ({"logit_bias": {"abc": 1}}, "logit_bias"),
                                ({"allowed_token_ids": []}, "allowed_token_ids")):
                r = await client.post("/v1/completions", json={"prompt": "x", **body})
                assert r.status_code == 400, (body, r.text)
                assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "BadRequestError"
            assert len(engine.calls) == calls  # refused before the engine

    run(go())


def test_kv_transfer_params_are_read_once_per_leg(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A leg's `kv_transfer_params` become typed once, where the route parses the body (`KVTransferParams.read`,
    counted here through that constructor); the engine requests carry that object (or, for the choice that loads
    for n > 1 forks, the same object without the first token), never the dict. The delivery route of a decode
    leg sent before its params reads them once too."""
    reads: list[Any] = []
    read = pd.KVTransferParams.read.__func__  # type: ignore[attr-defined]

    def counted(cls: type[pd.KVTransferParams], params: Any) -> pd.KVTransferParams:
        typed = read(cls, params)
        reads.append(typed)
        return typed

    monkeypatch.setattr(pd.KVTransferParams, "read", classmethod(counted))
    ids = words(tok, " a b")
    decode = {"do_remote_prefill": True, "remote_prefill_cached_tokens": 1, pd.FIRST_TOKEN_ID: ids[0]}

    def script(rid: str, prompt: list[int], params: SamplingParams, kv: Any) -> list[RequestOutput]:
        return [output(rid, prompt, ids, 2, True, "length")]

    async def go() -> None:
        client, engine = make_client(tok, script, enable_scale_out=True, info={"kv_params_later": True})
        delivered: list[tuple[str, Any]] = []

        async def deliver_params(key: str, params: Any) -> None:
            delivered.append((key, params))

        engine.deliver_params = deliver_params  # type: ignore[attr-defined]
        async with client:
            legs = [("/v1/completions", {"prompt": "x", "max_tokens": 1,
                                         "kv_transfer_params": pd.prefill_leg_params()}),
                    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2, "kv_transfer_params": decode}),
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                              "kv_transfer_params": {**decode, pd.PROMPT_TOKEN_IDS: [5, 6]}}),
                    ("/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2},
                                                "kv_transfer_params": decode})]
            for path, body in legs:
                reads.clear()
                engine.calls.clear()
                r = await client.post(path, json=body)
                assert r.status_code == 200, r.text
                assert len(reads) == 1, path  # parsed once per leg
                first = engine.calls[0][3]
                assert first is reads[0] or first == reads[0].without_first_token()  # the fork's loader
                assert all(c[3] is None for c in engine.calls[1:])  # the forks load nothing
                if path != "/inference/v1/generate" and body["kv_transfer_params"].get("do_remote_prefill"):
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 1  # P's, typed once
            reads.clear()
            r = await client.post(pd.KV_PARAMS_PATH, json=pd.params_delivery("k", decode))
            assert r.status_code == 200, r.text
            assert len(reads) == 1 and delivered == [("k", reads[0])]

    run(go())


def test_only_the_server_reads_kv_transfer_params() -> None:
    """Below the server's routes nothing reads the dict again: `KVTransferParams.read` is called only in
    pdserve/server (the engine, the P/D half and the connector take the typed object), and in pdserve/sim, whose
    simulated instance stands where the server's route is (it reads the proxy's wire params for the engine's
    Admission, once, as the route does)."""
    import ast

    package = Path(__file__).resolve().parent.parent / "pdserve"
    callers = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "read":
                owner = node.func.value
                name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
                if name == "KVTransferParams":
                    callers.append(str(path.relative_to(package)))
    assert callers and {c.split("/")[0] for c in callers} <= {"server", "sim"}, callers
    assert any(c.startswith("server/") for c in callers), callers
