"""`pdserve render` as a process: torch-free, render/derender shapes, utility routes, and bad input -> 400.

One render process for the module (2 worker processes, qwen3 + hermes parsers) over a tokenizer-only
folder: the render tier needs no weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_render_support import SCRIPT_TEXT, Proc, make_tokenizer_dir

from pdserve.api.openai.errors import APIError
from pdserve.render.context import RenderConfig, RenderContext
from pdserve.render.derender import derender_chat

MAX_MODEL_LEN = 256
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("render-api"))


@pytest.fixture(scope="module")
def render(tok_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = Proc(tmp_path_factory.mktemp("logs") / "render.log", "render", str(tok_dir), "--served-model-name",
                "tiny", "--max-model-len", str(MAX_MODEL_LEN), "--renderer-num-workers", "2",
                "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def post(proc: Proc, path: str, body: Any, **kw: Any) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(proc.url + path, content=body, headers={"content-type": "application/json"}, timeout=30,
                          **kw)
    return httpx.post(proc.url + path, json=body, timeout=30, **kw)


def encode(proc: Proc, text: str) -> list[int]:
    r = post(proc, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_no_torch_and_utility_routes(render: Proc) -> None:
    info = httpx.get(render.url + "/pdserve/info", timeout=10).json()
    assert info["torch_loaded"] is False and info["workers_torch_loaded"] is False
    assert info["role"] == "render" and info["renderer_num_workers"] == 2
    assert httpx.get(render.url + "/version", timeout=10).json()["version"]
    models = httpx.get(render.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    ids = encode(render, "<think>hi</think>")
    assert ids[0] == 49152 and ids[-1] == 49153  # the added tags are single tokens
    assert post(render, "/detokenize", {"tokens": ids}).json()["prompt"] == "<think>hi</think>"
    assert post(render, "/detokenize", {"tokens": [10**7]}).status_code == 400


def test_render_chat_shape(render: Proc) -> None:
    body = {**CHAT, "max_completion_tokens": 7, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "kv_transfer_params": {"do_remote_decode": True, "prompt_token_ids": [1, 2]}, "stream": True}
    r = post(render, "/v1/chat/completions/render", body, headers={"X-Request-Id": "abc"})
    assert r.status_code == 200, r.text
    gen = r.json()
    assert gen["request_id"] == "chatcmpl-abc" and gen["output_mode"] == "tokens" and gen["stream"] is True
    tok = post(render, "/tokenize", {"messages": CHAT["messages"], "tools": TOOLS}).json()
    assert gen["token_ids"] == tok["tokens"]
    sp = gen["sampling_params"]
    assert sp["max_tokens"] == 7 and sp["temperature"] == 0 and sp["logprobs"] == 2 and sp["n"] == 1
    assert gen["kv_transfer_params"] == {"do_remote_decode": True}  # hoisted; the ids hand-off is dropped
    assert gen["parse_context"]["tools"] == TOOLS and gen["reasoning_ended"] is True  # no think block open in the prompt
    # max_tokens defaults to the room left in the context
    gen = post(render, "/v1/chat/completions/render", CHAT).json()
    assert gen["sampling_params"]["max_tokens"] == MAX_MODEL_LEN - len(gen["token_ids"])


def test_render_completions_shape(render: Proc) -> None:
    r = post(render, "/v1/completions/render", {"model": "tiny", "prompt": ["a b", "c"], "max_tokens": 3,
                                                "n": 2, "seed": 4}, headers={"X-Request-Id": "q"})
    assert r.status_code == 200, r.text
    gens = r.json()
    assert [g["request_id"] for g in gens] == ["cmpl-q-0", "cmpl-q-1"]
    assert gens[0]["token_ids"] == encode(render, "a b") and gens[1]["token_ids"] == encode(render, "c")
    assert all(g["sampling_params"]["n"] == 2 and g["sampling_params"]["seed"] == 4 for g in gens)
    [gen] = post(render, "/v1/completions/render", {"model": "tiny", "prompt": [5, 6, 7]},
                 headers={"X-Request-Id": "q"}).json()
    assert gen["request_id"] == "cmpl-q" and gen["token_ids"] == [5, 6, 7]
    assert gen["sampling_params"]["max_tokens"] == 16  # the completions default


def test_derender_chat_batch(render: Proc) -> None:
    ids = encode(render, SCRIPT_TEXT)
    lps = {"content": [{"token_id": t, "logprob": -0.25, "rank": 1,
                        "top_logprobs": [{"token_id": t, "logprob": -0.25, "rank": 1},
                                         {"token_id": 5, "logprob": -3.5, "rank": 2}]} for t in ids]}
    body = {"generate_response": {"request_id": "generate-tokens-chatcmpl-1", "choices": [
        {"index": 0, "token_ids": ids, "finish_reason": "length", "logprobs": lps}],
        "kv_transfer_params": {"remote_block_ids": [1]}},
        "prompt_tokens": 12, "chat_request": {**CHAT, "logprobs": True, "top_logprobs": 2}}
    r = post(render, "/v1/chat/completions/derender", body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert out["id"] == "chatcmpl-1" and out["kv_transfer_params"] == {"remote_block_ids": [1]}
    assert choice["message"]["reasoning"] == "Let me plan" and choice["message"]["content"] == "Sure!"
    assert choice["finish_reason"] == "tool_calls"  # vLLM issue 47931: batch derender misses it
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"days": 3}'}
    # Real logprob values, not placeholders (vLLM issue 57574).
    first = choice["logprobs"]["content"][0]
    assert first["token"] == "<think>" and first["logprob"] == -0.25
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.25, -3.5]
    assert out["usage"] == {"prompt_tokens": 12, "completion_tokens": len(ids), "total_tokens": 12 + len(ids),
                            "prompt_tokens_details": None}


def test_derender_stream_roundtrip(render: Proc) -> None:
    """One HTTP call per token, the state carried by the client, equals the batch derender."""
    ids = encode(render, SCRIPT_TEXT)
    for finish in ("length", "stop"):  # "stop": the last id is the stop token, its text is not shown
        state = None
        reasoning = content = ""
        calls: list[dict[str, Any]] = []
        reported = None
        for k, t in enumerate(ids):
            body = {"stream": True, "generate_chunk": {"request_id": "generate-tokens-chatcmpl-2", "choices": [
                {"index": 0, "token_ids": [t], "finish_reason": finish if k == len(ids) - 1 else None}]},
                "stream_state": state, "chat_request": CHAT, "prompt_token_ids": [198] if state is None else None}
            r = post(render, "/v1/chat/completions/derender", body)
            assert r.status_code == 200, r.text
            assert r.json()["chunk"]["id"] == "chatcmpl-2"
            state = r.json()["stream_state"]
            for c in r.json()["chunk"]["choices"]:
                reasoning += c["delta"].get("reasoning") or ""
                content += c["delta"].get("content") or ""
                calls += c["delta"].get("tool_calls") or []
                reported = c["finish_reason"] or reported
        assert r.json()["finished"] is True
        batch = post(render, "/v1/chat/completions/derender", {"generate_response": {"request_id": "x", "choices": [
            {"index": 0, "token_ids": ids, "finish_reason": finish}]}, "chat_request": CHAT,
            "prompt_token_ids": [198]}).json()["choices"][0]
        assert (reasoning, content, reported) == ("Let me plan", "Sure!", "tool_calls")
        assert (batch["message"]["reasoning"], batch["message"]["content"], batch["finish_reason"]) == (
            reasoning, content, reported)
        # With "stop" the block never closed, but what is left is a complete call: it still counts.
        assert [c["function"] for c in calls] == [c["function"] for c in batch["message"]["tool_calls"]] == [
            {"name": "get_weather", "arguments": '{"days": 3}'}]


_GOOD_CHOICE = {"index": 0, "token_ids": [5, 6], "finish_reason": "length"}


def _derender(choices: list[Any] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"generate_response": {"request_id": "r", "choices": choices or [_GOOD_CHOICE]},
                            "chat_request": CHAT}
    body.update(extra)
    return body


def _chunk(state: Any, **extra: Any) -> dict[str, Any]:
    return {"stream": True, "stream_state": state, "chat_request": CHAT,
            "generate_chunk": {"request_id": "r", "choices": [{"index": 0, "token_ids": [5]}]}, **extra}


_VALID_STATE = {"version": 1, "choices": [{"index": 0, "prev_tokens": [5], "read_offset": 1,
                                           "parser": {"reasoning": {"mode": "content", "pending": ""},
                                                      "tools": {"mode": "text", "pending": "", "num_calls": 0}}}]}


def _state(**changes: Any) -> dict[str, Any]:
    choice = {**_VALID_STATE["choices"][0], **changes}
    return {"version": 1, "choices": [choice]}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions/derender", {"generate_response": {"request_id": "r", "choices": [_GOOD_CHOICE]}},
     "chat_request"),
    ("/v1/chat/completions/derender", _derender(chat_request={"messages": "not a list"}), "messages"),
    ("/v1/chat/completions/derender", _derender(chat_request={**CHAT, "tool_choice": "required"}), "tool_choice"),
    ("/v1/chat/completions/derender", _derender([{"index": 1, "token_ids": [5]}]), "generate_response.choices"),
    ("/v1/chat/completions/derender", _derender([{"index": 0, "token_ids": [-1]}]), None),
    ("/v1/chat/completions/derender", _derender([{"index": 0, "token_ids": [10**9]}]), None),
    ("/v1/chat/completions/derender", _derender([{"index": 0, "token_ids": ["5"]}]), None),
    ("/v1/chat/completions/derender", _derender([{"index": 0, "token_ids": [1.5]}]), None),
    ("/v1/chat/completions/derender", _derender([{"index": 0, "token_ids": [True]}]), None),
    ("/v1/chat/completions/derender", _derender(prompt_token_ids=[-3]), None),
    ("/v1/chat/completions/derender", {"chat_request": CHAT}, "generate_response"),
    ("/v1/chat/completions/derender", {**_derender(), "generate_response": {
        "request_id": "r", "output_mode": "text", "choices": [_GOOD_CHOICE]}}, "generate_response.output_mode"),
    ("/v1/chat/completions/derender", _chunk(_state(read_offset=5)), "stream_state"),
    ("/v1/chat/completions/derender", _chunk(_state(prev_tokens=[10**8])), "stream_state"),
    ("/v1/chat/completions/derender", _chunk(_state(parser=None)), "stream_state"),
    ("/v1/chat/completions/derender", _chunk(_state(parser={"reasoning": {"mode": "x", "pending": ""},
                                                             "tools": None})), "stream_state"),
    ("/v1/chat/completions/derender", _chunk(_state(index=3)), "stream_state"),
    ("/v1/chat/completions/derender", _chunk(_state(unemitted=9)), "stream_state"),
    ("/v1/chat/completions/derender", _chunk(_state(stop_tail="x" * 100)), "stream_state"),
    ("/v1/chat/completions/derender", _chunk(_state(num_output_tokens=-1)), None),
    ("/v1/chat/completions/derender", _chunk(_state(surprise=1)), None),
    ("/v1/chat/completions/derender", _chunk({"version": 2, "choices": []}), None),
    ("/v1/chat/completions/derender", _chunk("garbage"), None),
    ("/v1/chat/completions/derender", {"stream": True, "chat_request": CHAT}, "generate_chunk"),
    ("/v1/completions/derender", {"completion_request": {"prompt": "x"}}, "generate_responses"),
    ("/v1/completions/derender", {"generate_responses": [{"request_id": "r", "choices": [_GOOD_CHOICE]}],
                                  "completion_request": {"prompt": [1, 2], "echo": True}}, "prompt_token_ids"),
    ("/v1/chat/completions/render", {"model": "tiny", "messages": []}, "messages"),
    ("/v1/chat/completions/render", {**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ("/v1/chat/completions/render", {**CHAT, "messages": [{"role": "user", "content": "x " * 400}]}, "prompt"),
    ("/v1/chat/completions/render", {**CHAT, "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions/render", {"model": "tiny", "prompt": [[-1]]}, None),
    ("/v1/completions/render", {"model": "tiny"}, "prompt"),
    ("/v1/completions/render", b"{not json", None),
    ("/v1/completions/render", b"[1, 2]", None),
])
def test_bad_input_is_400(render: Proc, path: str, body: Any, param: str | None) -> None:
    r = post(render, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_unknown_model_is_404(render: Proc) -> None:
    r = post(render, "/v1/chat/completions/render", {**CHAT, "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert "Served models: tiny" in r.json()["error"]["message"]


def test_empty_or_missing_model_is_the_default(render: Proc) -> None:
    """vLLM serves its one model to a request without a model name."""
    body = {k: v for k, v in CHAT.items() if k != "model"}
    assert post(render, "/v1/chat/completions/render", body).status_code == 200
    assert post(render, "/v1/chat/completions/render", {**body, "model": ""}).status_code == 200


def test_no_parser_server_needs_no_chat_request(tok_dir: Path) -> None:
    """Without parsers (vLLM: only then), derender works from the generate response alone."""
    ctx = RenderContext(RenderConfig.from_model_dir(tok_dir, served_model_names=["tiny"], max_model_len=64))
    ids = ctx.tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
    out = derender_chat(ctx, {"generate_response": {"request_id": "r", "choices": [
        {"index": 0, "token_ids": ids, "finish_reason": "length"}]}})
    message = out["choices"][0]["message"]
    assert message["content"] == SCRIPT_TEXT and message["tool_calls"] == [] and message["reasoning"] is None
    with pytest.raises(APIError) as e:  # but tools with "auto" need the parser flags
        derender_chat(ctx, {"generate_response": {"request_id": "r", "choices": []}, "chat_request": CHAT})
    assert e.value.status == 400 and "enable-auto-tool-choice" in e.value.message


def test_n_is_rendered(render: Proc) -> None:
    r = post(render, "/v1/completions/render", {"model": "tiny", "prompt": "hi", "n": 3})
    assert r.status_code == 200, r.text
    assert r.json()[0]["sampling_params"]["n"] == 3
