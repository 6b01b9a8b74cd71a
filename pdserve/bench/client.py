"""Streaming request functions for OpenAI-compatible completions and chat endpoints.

Payloads and headers are those of `vllm bench serve` (reference section 11.1); timing follows
section 11.4: a message is token-bearing when its `choices` is non-empty (completions, even with empty
text) or, for chat, when its delta carries content / reasoning / tool calls, or `content == ""`
without a `role` (the role-only opening delta does not count). The usage chunk and `[DONE]` never count.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from pdserve.bench.types import RequestInput, RequestOutput

Progress = Callable[[], None]
RequestFunc = Callable[[RequestInput, aiohttp.ClientSession, Progress | None], Awaitable[RequestOutput]]

NO_TOKEN_ERROR = "Never received a valid chunk to calculate TTFT.This response will be marked as failed!"


class SSEDecoder:
    """Splits a byte stream into SSE events; yields each event's `data` payload (comments skipped)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        events: list[str] = []
        while b"\n\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            data = self._event_data(raw)
            if data is not None:
                events.append(data)
        return events

    def flush(self) -> list[str]:
        """An unterminated last event (a server that ends the stream without a blank line)."""
        raw, self._buffer = self._buffer, b""
        data = self._event_data(raw) if raw.strip() else None
        return [data] if data is not None else []

    @staticmethod
    def _event_data(raw: bytes) -> str | None:
        lines = []
        for line in raw.decode("utf-8").split("\n"):
            if line.startswith("data:"):
                value = line[5:]
                lines.append(value[1:] if value.startswith(" ") else value)
        return "\n".join(lines) if lines else None


def _headers(inp: RequestInput, content_type: str | None = None) -> dict[str, str]:
    """Content type, then the caller's headers (Authorization, --header), then x-request-id."""
    headers: dict[str, str] = {}
    if content_type:
        headers["Content-Type"] = content_type
    if inp.extra_headers:
        headers |= inp.extra_headers
    if inp.request_id:
        headers["x-request-id"] = inp.request_id
    return headers


def _finish_payload(payload: dict[str, Any], inp: RequestInput) -> dict[str, Any]:
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    if inp.extra_body:
        payload.update(inp.extra_body)
    return payload


def completions_payload(inp: RequestInput) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": inp.model_name or inp.model,
        "prompt": inp.prompt,
        "repetition_penalty": 1.0,
        "max_tokens": inp.output_len,
        "logprobs": inp.logprobs,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return _finish_payload(payload, inp)


def chat_payload(inp: RequestInput) -> dict[str, Any]:
    messages = inp.chat_messages or [{"role": "user", "content": [{"type": "text", "text": inp.prompt}]}]
    payload: dict[str, Any] = {
        "model": inp.model_name or inp.model,
        "messages": messages,
        "max_completion_tokens": inp.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return _finish_payload(payload, inp)


def completions_token_text(data: dict[str, Any]) -> str | None:
    """Text of a token-bearing completions message (possibly ""), None if it bears no token."""
    choices = data.get("choices")
    if not choices:
        return None
    return choices[0].get("text") or ""


def chat_token_text(data: dict[str, Any]) -> str | None:
    """Content of a token-bearing chat message (possibly ""), None if it bears no token."""
    choices = data.get("choices")
    if not choices:
        return None
    delta = choices[0].get("delta") or {}
    content = delta.get("content")
    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
    if content or reasoning or delta.get("tool_calls"):
        return content or ""
    if content == "" and "role" not in delta:
        return ""
    return None


async def _stream_request(
    inp: RequestInput,
    session: aiohttp.ClientSession,
    payload: dict[str, Any],
    headers: dict[str, str],
    token_text: Callable[[dict[str, Any]], str | None],
    progress: Progress | None,
) -> RequestOutput:
    out = RequestOutput(prompt_len=inp.prompt_len)
    text_parts: list[str] = []
    st = time.perf_counter()
    out.start_time = st
    last = st
    first = False
    try:
        async with session.post(inp.api_url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.text())[:500]
                out.error = f"HTTP {resp.status} {resp.reason or ''}: {body}".strip()
            else:
                decoder = SSEDecoder()

                def handle(events: list[str]) -> None:
                    nonlocal first, last
                    for event in events:
                        if event.strip() == "[DONE]":
                            continue
                        now = time.perf_counter()
                        data = json.loads(event)
                        if not isinstance(data, dict):
                            continue
                        if data.get("error") and not data.get("choices"):
                            raise RuntimeError(f"error in stream: {json.dumps(data['error'])[:500]}")
                        text = token_text(data)
                        if text is not None:
                            if not first:
                                first = True
                                out.ttft = now - st
                            else:
                                out.itl.append(now - last)
                            last = now
                            text_parts.append(text)
                        usage = data.get("usage")
                        if usage:
                            out.output_tokens = int(usage.get("completion_tokens") or 0)
                            if usage.get("prompt_tokens") is not None:
                                out.prompt_len = int(usage["prompt_tokens"])
                            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                            if type(cached) is int:
                                out.cached_tokens = cached

                async for chunk in resp.content.iter_any():
                    handle(decoder.feed(chunk))
                handle(decoder.flush())
                out.generated_text = "".join(text_parts)
                if first:
                    out.success = True
                else:
                    out.error = NO_TOKEN_ERROR
                out.latency = last - st
    except Exception:
        out.success = False
        out.error = traceback.format_exc()
    if progress is not None:
        progress()
    return out


async def request_completions(
    inp: RequestInput, session: aiohttp.ClientSession, progress: Progress | None = None
) -> RequestOutput:
    headers = _headers(inp)
    return await _stream_request(
        inp, session, completions_payload(inp), headers, completions_token_text, progress
    )


async def request_chat(
    inp: RequestInput, session: aiohttp.ClientSession, progress: Progress | None = None
) -> RequestOutput:
    headers = _headers(inp, "application/json")
    return await _stream_request(inp, session, chat_payload(inp), headers, chat_token_text, progress)


# backend name -> (request function, default endpoint)
BACKENDS: dict[str, tuple[RequestFunc, str]] = {
    "openai": (request_completions, "/v1/completions"),
    "vllm": (request_completions, "/v1/completions"),
    "completions": (request_completions, "/v1/completions"),
    "openai-chat": (request_chat, "/v1/chat/completions"),
    "chat": (request_chat, "/v1/chat/completions"),
}


def is_chat_backend(backend: str) -> bool:
    return BACKENDS[backend][0] is request_chat
