"""Streaming derender: the work per chunk does not grow with the history (vLLM replays it: issue 57571).

Work is counted, not timed: token ids handed to the tokenizer's decoder per chunk, the size of the
`stream_state` sent back, and the size of the request body a caller sends per chunk. A 1000-token output
(reasoning, content, a tool call, more content) is streamed one token per derender call, with the state
going through JSON in between, exactly as an HTTP client would carry it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_render_support import make_tokenizer_dir

from pdserve.render.context import RenderConfig, RenderContext
from pdserve.render.derender import derender_chat
from pdserve.text.output_parsers import ParserConfig

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


class CountingTokenizer:
    """Counts the ids every decode sees; everything else is the real tokenizer."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.decoded = 0

    def decode_window(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.decoded += len(ids)
        return self.inner.decode_window(ids, skip_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> RenderContext:
    folder = make_tokenizer_dir(tmp_path_factory.mktemp("stream-cost"))
    config = RenderConfig.from_model_dir(folder, served_model_names=["tiny"], max_model_len=4096,
                                         parsers=ParserConfig("qwen3", "hermes", True))
    context = RenderContext(config)
    context.tokenizer = CountingTokenizer(context.tokenizer)  # type: ignore[assignment]
    return context


def long_output(ctx: RenderContext) -> list[int]:
    words = " ".join(f"thought {i}," for i in range(100))
    answer = " ".join(f"fact {i}." for i in range(50))
    more = " ".join(f"fact {i}." for i in range(50, 250))
    text = (f"<think>{words}</think>{answer}<tool_call>" '{"name": "get_weather", "arguments": {"city": "Paris"}}'
            f"</tool_call>{more}")
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= 1000
    return ids[:1000]


def test_chunk_cost_is_flat(ctx: RenderContext) -> None:
    tok: CountingTokenizer = ctx.tokenizer  # type: ignore[assignment]
    output = long_output(ctx)
    chat_request = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
                    "stream": True}
    prompt_tail = ctx.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    state: dict[str, Any] | None = None
    decoded: list[int] = []
    state_bytes: list[int] = []
    body_bytes: list[int] = []
    reasoning = content = ""
    calls: list[dict[str, Any]] = []
    finish = None
    for k, token in enumerate(output):
        last = k == len(output) - 1
        body = {"stream": True, "stream_state": state, "chat_request": chat_request,
                "prompt_token_ids": prompt_tail if state is None else None,
                "generate_chunk": {"request_id": "generate-tokens-chatcmpl-x", "choices": [
                    {"index": 0, "token_ids": [token], "finish_reason": "length" if last else None}]}}
        body = json.loads(json.dumps(body))  # what goes over the wire
        before = tok.decoded
        result = derender_chat(ctx, body)
        decoded.append(tok.decoded - before)
        state = json.loads(json.dumps(result["stream_state"]))
        state_bytes.append(len(json.dumps(state)))
        body_bytes.append(len(json.dumps(body)))
        for choice in result["chunk"]["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            calls.extend(delta.get("tool_calls") or [])
            finish = choice["finish_reason"] or finish

    early, late = slice(10, 110), slice(900, 1000)
    # Work per chunk: a handful of ids per decode, the same at token 1000 as at token 10.
    assert max(decoded[10:]) <= 24, max(decoded[10:])
    assert sum(decoded[late]) <= 1.5 * sum(decoded[early]) + 10
    # What travels per chunk stays small and flat as well.
    assert max(state_bytes) <= 800, max(state_bytes)
    assert max(state_bytes[late]) <= max(state_bytes[early]) + 64
    assert max(body_bytes[late]) <= max(body_bytes[early]) + 64

    # And the incremental answer is the batch answer.
    batch = derender_chat(ctx, {"chat_request": {**chat_request, "stream": False}, "prompt_token_ids": prompt_tail,
                                "generate_response": {"request_id": "x", "choices": [
                                    {"index": 0, "token_ids": output, "finish_reason": "length"}]}})
    message = batch["choices"][0]["message"]
    assert reasoning == message["reasoning"] and reasoning.startswith("thought 0,")
    assert content == message["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]
    assert finish == batch["choices"][0]["finish_reason"] == "tool_calls"


def test_state_resume_equals_one_pass(ctx: RenderContext) -> None:
    """Multi-token chunks of uneven sizes (incl. a character split over byte tokens) give the same text."""
    text = "héllo wörld → 你好 <think>x</think> done"
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    req = {"messages": [{"role": "user", "content": "hi"}], "include_reasoning": True}
    out = ""
    state = None
    pos = 0
    for size in (1, 3, 2, 5, 1, 4, 100):
        piece = ids[pos:pos + size]
        pos += len(piece)
        done = pos >= len(ids)
        result = derender_chat(ctx, {"stream": True, "stream_state": state, "chat_request": req,
                                     "generate_chunk": {"request_id": "r", "choices": [
                                         {"index": 0, "token_ids": piece, "finish_reason": "length" if done else None}]}})
        state = result["stream_state"]
        for c in result["chunk"]["choices"]:
            out += c["delta"].get("content") or ""
        if done:
            break
    assert out == text  # qwen3: the output does not start with <think>, so it is all content
