"""Three hops (render -> tokens-only engine -> derender) == one in-process server, over real processes.

Processes (127.0.0.1, one set for the module):

* `serve`   : `pdserve serve` with the qwen3 reasoning and hermes tool parsers (the reference; its
              `/inference/v1/*` answer 403 since it has no `--enable-scale-out`);
* `engine`  : `pdserve serve --tokens-only`;
* `render`  : `pdserve render --engine <engine>` with the same parsers (the orchestrator);
* `prefill` : `pdserve serve --tokens-only` as a NIXL KV producer, and `engine` is then the consumer;
* `render_pd`: `pdserve render --prefill <prefill> --decode <engine>`, no parsers, 2 worker processes: render
              once, prefill leg (max_tokens=1, do_remote_decode), decode leg with the prefill's
              kv_transfer_params (real NIXL DRAM transfers), derender. Without NIXL installed, the prefill
              leg goes to `engine` too and carries no KV (the code path still runs).

The model is the scripted tiny Qwen3 of `test_render_support`: after a newline it writes
`<think>Let me plan</think>Sure!<tool_call>{...}</tool_call>` then EOS, so the parsers see real
reasoning and a real tool call; other prompts give random text. Greedy everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_render_support import Proc, kv_config, make_scripted_model, sse_events, start_all

MAX_MODEL_LEN = 512
PARSERS = ("--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
ENGINE_ARGS = ("--served-model-name", "tiny", "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override",
               "256", "--max-num-batched-tokens", "512")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}}}}]
ASK = [{"role": "user", "content": "What is the weather?"}]
HAVE_NIXL = importlib.util.find_spec("nixl_cu12") is not None


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    model = make_scripted_model(tmp_path_factory.mktemp("scripted") / "model", MAX_MODEL_LEN)
    logs = tmp_path_factory.mktemp("logs")
    all_procs: dict[str, Proc] = {}
    if HAVE_NIXL:
        all_procs["prefill"] = Proc(logs / "prefill.log", "serve", str(model), *ENGINE_ARGS, "--tokens-only",
                                    "--kv-transfer-config", kv_config("kv_producer"), "--side-channel-port", "0")
    kv = ("--kv-transfer-config", kv_config("kv_consumer")) if HAVE_NIXL else ()
    engine = all_procs["engine"] = Proc(logs / "engine.log", "serve", str(model), *ENGINE_ARGS, "--tokens-only", *kv)
    all_procs["serve"] = Proc(logs / "serve.log", "serve", str(model), *ENGINE_ARGS, *PARSERS)
    common = (str(model), "--served-model-name", "tiny", "--max-model-len", str(MAX_MODEL_LEN))
    all_procs["render"] = Proc(logs / "render.log", "render", *common, *PARSERS, "--engine", engine.url)
    prefill_url = all_procs["prefill"].url if HAVE_NIXL else engine.url
    all_procs["render_pd"] = Proc(logs / "render_pd.log", "render", *common, "--prefill", prefill_url, "--decode",
                                  engine.url, "--renderer-num-workers", "2")
    start_all(*all_procs.values())
    try:
        yield all_procs
    finally:
        for p in reversed(all_procs.values()):  # render tiers first: they hold connections to the engines
            p.stop()


def post(proc: Proc, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(proc.url + path, json=body, timeout=120, **kw)


# ---- normalising answers so that three-hop and in-process can be compared --------------------------
def summarize(resp: dict[str, Any]) -> dict[str, Any]:
    """A whole response, minus what is legitimately random (tool call ids, timestamps)."""
    choices = []
    for c in sorted(resp["choices"], key=lambda c: c["index"]):
        entry: dict[str, Any] = {"index": c["index"], "finish_reason": c["finish_reason"],
                                 "stop_reason": c.get("stop_reason"), "token_ids": c.get("token_ids"),
                                 "logprobs": c.get("logprobs")}
        if "message" in c:
            m = c["message"]
            entry.update(content=m["content"], reasoning=m.get("reasoning"),
                         calls=[(t["function"]["name"], t["function"]["arguments"]) for t in m["tool_calls"]])
        else:
            entry["text"] = c["text"]
        choices.append(entry)
    usage = resp["usage"]
    return {"id": resp["id"], "model": resp["model"], "choices": choices,
            "usage": (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])}


def summarize_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Streamed chunks accumulated per choice."""
    acc: dict[int, dict[str, Any]] = {}
    ids = {e["id"] for e in events}
    usage = None
    for e in events:
        if e.get("usage") and not e["choices"]:
            usage = (e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"], e["usage"]["total_tokens"])
        for c in e["choices"]:
            a = acc.setdefault(c["index"], {"index": c["index"], "text": "", "reasoning": "", "calls": [],
                                            "finish_reason": None, "stop_reason": None, "token_ids": [],
                                            "logprobs": [], "role": None})
            delta = c.get("delta", {"content": c.get("text", "")})
            a["role"] = delta.get("role") or a["role"]
            a["text"] += delta.get("content") or ""
            a["reasoning"] += delta.get("reasoning") or ""
            a["calls"] += [(t["function"]["name"], t["function"]["arguments"]) for t in delta.get("tool_calls") or []]
            a["token_ids"] += c.get("token_ids") or []
            if c.get("logprobs"):
                a["logprobs"] += c["logprobs"].get("content") or [c["logprobs"]]
            if c.get("finish_reason") is not None:
                a["finish_reason"], a["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    return {"ids": ids, "choices": [acc[i] for i in sorted(acc)], "usage": usage}


def both(procs: dict[str, Proc], render: str, path: str, body: dict[str, Any], rid: str) -> tuple[Any, Any]:
    headers = {"X-Request-Id": rid}
    a = post(procs["serve"], path, body, headers=headers)
    b = post(procs[render], path, body, headers=headers)
    assert a.status_code == 200, a.text
    assert b.status_code == b.status_code == 200, b.text
    if body.get("stream"):
        return summarize_stream(sse_events(a)), summarize_stream(sse_events(b))
    return summarize(a.json()), summarize(b.json())


# ---- the render process ------------------------------------------------------------------------------
def test_render_processes_never_import_torch(procs: dict[str, Proc]) -> None:
    for name in ("render", "render_pd"):
        info = httpx.get(procs[name].url + "/pdserve/info", timeout=10).json()
        assert info["torch_loaded"] is False and info["workers_torch_loaded"] is False, (name, info)
    assert httpx.get(procs["render_pd"].url + "/pdserve/info", timeout=10).json()["renderer_num_workers"] == 2


# ---- three hops == in-process --------------------------------------------------------------------------
CHAT_CASES = {
    "tools": {"messages": ASK, "tools": TOOLS},
    "no_tools": {"messages": ASK},
    "no_reasoning_field": {"messages": ASK, "tools": TOOLS, "include_reasoning": False},
    "logprobs": {"messages": ASK, "tools": TOOLS, "logprobs": True, "top_logprobs": 3, "return_token_ids": True},
    "thinking_off": {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 12},
    "response_format": {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}, "response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object", "properties": {
            "sky": {"enum": ["clear", "cloudy"]}}, "required": ["sky"]}}}},
    "stop_string": {"messages": ASK, "stop": ["Sure"]},
    "n2_seeded": {"messages": ASK, "n": 2, "temperature": 0.8, "seed": 11, "max_tokens": 6,
                  "chat_template_kwargs": {"enable_thinking": False}},
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_chat_three_hop_equals_in_process(procs: dict[str, Proc], case: str, stream: bool) -> None:
    body = {"model": "tiny", "temperature": 0, "max_tokens": 40, **CHAT_CASES[case], "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    a, b = both(procs, "render", "/v1/chat/completions", body, f"chat-{case}-{stream}")
    assert a == b
    first = a["choices"][0]
    if case in ("tools", "logprobs"):
        assert first["finish_reason"] == "tool_calls"
        assert first["calls"] == [("get_weather", '{"days": 3}')]
        assert first["reasoning"] == "Let me plan"
        assert (first["content"] if not stream else first["text"]) == "Sure!"
    if case == "logprobs":
        lps = first["logprobs"] if stream else first["logprobs"]["content"]
        assert lps[0]["token"] == "<think>" and isinstance(lps[0]["logprob"], float)
        assert len(lps[0]["top_logprobs"]) == 3 and lps[0]["top_logprobs"][1]["logprob"] < lps[0]["logprob"]
    if case == "stop_string":
        assert (first["finish_reason"], first["stop_reason"]) == ("stop", "Sure")
    if case == "no_reasoning_field":
        assert not first["reasoning"]
    if not stream:
        assert a["id"] == f"chatcmpl-chat-{case}-{stream}"


COMPLETION_CASES = {
    "script": {"prompt": "Weather report:\n", "max_tokens": 30},
    # echo with logprobs needs prompt logprobs, which the render tier refuses (test_render_refuses_prompt_logprobs)
    "two_prompts_logprobs": {"prompt": ["Once upon a time", "hello\n"], "max_tokens": 8, "logprobs": 2},
    "two_prompts_echo": {"prompt": ["Once upon a time", "hello\n"], "max_tokens": 8, "echo": True},
    "token_prompt_n2_echo": {"prompt": [1000, 2000, 3000], "max_tokens": 5, "n": 2, "temperature": 0.9, "seed": 3,
                             "return_token_ids": True, "echo": True},
    "stop_string": {"prompt": "x\n", "max_tokens": 30, "stop": ["plan"], "include_stop_str_in_output": True},
    "penalties_bias_allowed": {"prompt": "Weather report:\n", "max_tokens": 10, "return_token_ids": True,
                               "allowed_token_ids": [1000, 2000, 3000, 4000], "logit_bias": {"2000": 3},
                               "frequency_penalty": 1.5, "presence_penalty": 0.2, "repetition_penalty": 1.2},
    # structured outputs: render passes the spec on, the engine (P/D: the decode side) holds the grammar
    "structured_choice": {"prompt": "Weather report:\n", "max_tokens": 10,
                          "structured_outputs": {"choice": ["sunny", "rainy", "windy"]}},
    "structured_json": {"prompt": "x\n", "max_tokens": 60, "structured_outputs": {
        "disable_any_whitespace": True,  # a random model would pick whitespace forever
        "json": {"type": "object", "properties": {"sky": {"enum": ["clear", "cloudy"]}, "days": {"enum": [1, 2]}},
                 "required": ["sky", "days"], "additionalProperties": False}}},
}


@pytest.mark.parametrize("render", ["render", "render_pd"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", sorted(COMPLETION_CASES))
def test_completions_three_hop_equals_in_process(procs: dict[str, Proc], case: str, stream: bool,
                                                 render: str) -> None:
    body = {"model": "tiny", "temperature": 0, **COMPLETION_CASES[case], "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    a, b = both(procs, render, "/v1/completions", body, f"cmpl-{case}-{stream}")
    assert a == b
    if case == "stop_string":
        assert a["choices"][0]["text"].endswith("Let me plan") and a["choices"][0]["stop_reason"] == "plan"
    if case == "penalties_bias_allowed":  # the fields went through render's JSON to the engine
        assert set(a["choices"][0]["token_ids"]) <= {1000, 2000, 3000, 4000}
    if case == "structured_choice":
        assert a["choices"][0]["text"] in ("sunny", "rainy", "windy")
    if case == "structured_json":
        assert set(json.loads(a["choices"][0]["text"])) == {"sky", "days"}


@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_pd_render_moves_the_kv_over_nixl(procs: dict[str, Proc], stream: bool) -> None:
    """Render once -> prefill leg -> decode leg with the prefill's kv_transfer_params: the decode instance
    reads the prompt's blocks over NIXL, and the answer is the in-process server's."""
    metric = "vllm:nixl_bytes_transferred_sum"
    before = _metric(procs["engine"], metric, 0.0)
    prompt = [3000 + 7 * i + int(stream) for i in range(100)] + [198]  # new to the decode instance's cache
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream,
            "return_token_ids": True}
    a, b = both(procs, "render_pd", "/v1/completions", body, f"pd-kv-{stream}")
    assert a == b and a["choices"][0]["token_ids"][:4] == [49152, 4239, 549, 1252]
    assert _metric(procs["engine"], metric, 0.0) > before


def test_render_refuses_prompt_logprobs(procs: dict[str, Proc]) -> None:
    """Prompt logprobs do not travel through /inference/v1/generate: a 400 naming them, not a response
    without them (`pdserve serve` computes them)."""
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1, "echo": True, "logprobs": 1}),
                       ("/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "prompt_logprobs": 1})):
        r = post(procs["render"], path, {"model": "tiny", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        assert post(procs["serve"], path, {"model": "tiny", **body}).status_code == 200


def test_chat_without_parsers_on_pd_render(procs: dict[str, Proc]) -> None:
    """No parsers on render_pd: where the output has no tags, it equals the parsing in-process server."""
    body = {"model": "tiny", "messages": ASK, "max_tokens": 10, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}
    a, b = both(procs, "render_pd", "/v1/chat/completions", body, "pd-chat")
    assert a == b and a["choices"][0]["content"]
    # With tags in the output, the parser-less tier returns them verbatim as content.
    raw = post(procs["render_pd"], "/v1/chat/completions", {**body, "chat_template_kwargs": {}, "max_tokens": 40})
    assert raw.json()["choices"][0]["message"]["content"].startswith("<think>Let me plan</think>Sure!<tool_call>")


def test_openai_sdk_streams_tool_calls(procs: dict[str, Proc]) -> None:
    client = openai.OpenAI(base_url=procs["render"].url + "/v1", api_key="none", max_retries=0, timeout=60)
    stream = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40,
                                            stream=True)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert calls == {0: {"name": "get_weather", "arguments": '{"days": 3}'}}


# ---- the tokens-only engine ---------------------------------------------------------------------------
def test_tokens_only_generate(procs: dict[str, Proc]) -> None:
    engine = procs["engine"]
    prompt = [1000, 2000, 3000, 198]  # ends with a newline: the script follows
    r = post(engine, "/inference/v1/generate", {"request_id": "g1", "token_ids": prompt, "return_token_ids": True,
                                                "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 2}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["request_id"] == "generate-tokens-g1" and out["output_mode"] == "tokens"
    assert out["prompt_token_ids"] == prompt and out["kv_transfer_params"] is None
    [choice] = out["choices"]
    assert choice["token_ids"] == [49152, 4239, 549, 1252] and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    entry = choice["logprobs"]["content"][0]
    assert entry["token_id"] == 49152 and entry["rank"] == 1 and isinstance(entry["logprob"], float)
    assert [t["rank"] for t in entry["top_logprobs"]] == [1, 2] and entry["top_logprobs"][1]["logprob"] < -10
    # The in-process server generates the same ids for the same prompt.
    ref = post(procs["serve"], "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                   "temperature": 0, "return_token_ids": True}).json()
    assert ref["choices"][0]["token_ids"] == choice["token_ids"]


def test_tokens_only_stream_and_defaults(procs: dict[str, Proc]) -> None:
    engine = procs["engine"]
    r = post(engine, "/inference/v1/generate", {"token_ids": [5, 198], "stream": True,
                                                "stream_options": {"include_usage": True},
                                                "sampling_params": {"max_tokens": 3, "temperature": 0}})
    events = sse_events(r)
    assert [e["choices"][0]["token_ids"] for e in events[:-1]] == [[49152], [4239], [549]]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all("kv_transfer_params" not in e for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    # max_tokens left out: the room left in the context.
    prompt = list(range(1000, 1500))
    r = post(engine, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {"ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == MAX_MODEL_LEN - len(prompt)
    # n > 1: one choice each.
    r = post(engine, "/inference/v1/generate", {"token_ids": [7, 8], "sampling_params": {
        "n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 5}})
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1]


def test_tokens_only_abort(procs: dict[str, Proc]) -> None:
    engine = procs["engine"]
    body = {"request_id": "long-1", "token_ids": [11, 12, 13], "stream": True,
            "sampling_params": {"max_tokens": 400, "ignore_eos": True, "temperature": 0}}
    finish = None
    with httpx.Client(timeout=60) as client, client.stream("POST", engine.url + "/inference/v1/generate",
                                                           json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break  # the request is running
        r = client.post(engine.url + "/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-long-1"]})
        assert r.status_code == 200 and r.json()["num_aborted"] == 1
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    finish = chunk["choices"][0]["finish_reason"]
    assert finish == "abort"


@pytest.mark.parametrize("body,param", [
    ({"sampling_params": {"max_tokens": 2}}, "token_ids"),
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [-1]}, None),
    ({"token_ids": ["5"]}, None),
    ({"token_ids": [1.0]}, None),
    ({"token_ids": [10**9]}, "token_ids"),
    ({"token_ids": [5], "sampling_params": {"stop": ["x"]}}, "sampling_params.stop"),
    ({"token_ids": [5], "sampling_params": {"stop": "x"}}, "sampling_params.stop"),
    ({"token_ids": [5], "output_mode": "text"}, "output_mode"),
    ({"token_ids": [5], "stream": True, "kv_transfer_params": {"do_remote_decode": True}}, "stream"),
    ({"token_ids": [5], "sampling_params": {"temperature": -1}}, None),
    ({"token_ids": [5], "sampling_params": {"seed": 2**70}}, "sampling_params"),
    ({"token_ids": [5], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"token_ids": [5], "sampling_params": {"logit_bias": {"abc": 1.0}}}, "sampling_params.logit_bias"),
    ({"token_ids": [5], "sampling_params": {"logit_bias": {"1000000": 1.0}}}, "sampling_params.logit_bias"),
    ({"token_ids": [5], "sampling_params": {"allowed_token_ids": [5, 10**6]}}, "sampling_params.allowed_token_ids"),
    ({"token_ids": [5], "sampling_params": {"repetition_penalty": 0}}, "sampling_params.repetition_penalty"),
    ({"token_ids": list(range(600))}, "prompt"),
])
def test_tokens_only_bad_input(procs: dict[str, Proc], body: dict[str, Any], param: str | None) -> None:
    r = post(procs["engine"], "/inference/v1/generate", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "BadRequestError"
    if param is not None:
        assert r.json()["error"]["param"] == param


def test_abort_and_text_routes_on_tokens_only(procs: dict[str, Proc]) -> None:
    engine = procs["engine"]
    r = post(engine, "/inference/v1/abort_requests", {})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_ids"
    assert post(engine, "/abort_requests", {"request_ids": ["nope"]}).status_code == 200  # legacy route
    r = post(engine, "/v1/chat/completions", {"model": "tiny", "messages": ASK})
    assert r.status_code == 400 and "--tokens-only" in r.json()["error"]["message"]


def test_scale_out_routes_forbidden_without_flag(procs: dict[str, Proc]) -> None:
    r = post(procs["serve"], "/inference/v1/generate", {"token_ids": [5]})
    assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"
    assert post(procs["serve"], "/inference/v1/abort_requests", {"request_ids": []}).status_code == 403


# ---- the orchestrator's failure paths ------------------------------------------------------------------
def _metric(engine: Proc, prefix: str, default: float | None = None) -> float:
    for line in httpx.get(engine.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise AssertionError(f"no {prefix} metric")


def _running(engine: Proc) -> float:
    return _metric(engine, "vllm:num_requests_running")


def _aborted(engine: Proc) -> float:
    return _metric(engine, 'vllm:request_success_total{engine="0",finished_reason="abort"')


def _wait_idle(engine: Proc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _running(engine) == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the engine still runs requests")


def test_client_disconnect_aborts_engine_request(procs: dict[str, Proc]) -> None:
    engine, render = procs["engine"], procs["render"]
    _wait_idle(engine)
    aborted = _aborted(engine)
    body = {"model": "tiny", "prompt": [21, 22, 23], "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", render.url + "/v1/completions",
                                                           json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # held: dropping the iterator would already close the connection
        for line in lines:
            if line.startswith("data: {"):
                break
        assert _running(engine) == 1
    _wait_idle(engine)
    assert _aborted(engine) == aborted + 1  # closing the client's stream aborted the engine request


def test_stop_string_aborts_engine_request(procs: dict[str, Proc]) -> None:
    """The engine cannot see the stop string; the orchestrator stops it when derender does."""
    engine, render = procs["engine"], procs["render"]
    _wait_idle(engine)
    aborted = _aborted(engine)
    r = post(render, "/v1/completions", {"model": "tiny", "prompt": "a\n", "max_tokens": 400, "ignore_eos": True,
                                         "temperature": 0, "stop": ["me"]})
    assert r.json()["choices"][0]["text"] == "<think>Let " and r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    _wait_idle(engine)
    assert _aborted(engine) == aborted + 1


def test_engine_errors_pass_through(procs: dict[str, Proc], tmp_path: Path) -> None:
    r = post(procs["render"], "/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 5,
                                                       "presence_penalty": 3})
    assert r.status_code == 400  # refused by render before any engine call
    r = post(procs["render"], "/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 5,
                                                       "logit_bias": {"1000000": 2}})
    assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]  # the engine's check
    unreachable = Proc(tmp_path / "r.log", "render", "smollm2-135m", "--max-model-len", "64", "--engine",
                       "127.0.0.1:9")
    try:
        unreachable.wait_ready()
        r = post(unreachable, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
    finally:
        unreachable.stop()
