"""Plain data carried between the dataset, the client and the metric maths (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SampleRequest:
    """One benchmark request: a completions prompt or a chat conversation."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    chat_messages: list[dict[str, Any]] | None = None


@dataclass
class RequestInput:
    """What the request function needs to send one request (vLLM's `RequestFuncInput`)."""

    prompt: str
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    model_name: str | None = None
    logprobs: int | None = None
    extra_headers: dict[str, str] | None = None
    extra_body: dict[str, Any] | None = None
    ignore_eos: bool = False
    request_id: str | None = None
    chat_messages: list[dict[str, Any]] | None = None


@dataclass
class RequestOutput:
    """What one request measured (vLLM's `RequestFuncOutput`). Times are seconds on `time.perf_counter`."""

    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: prompt tokens not computed
    error: str = ""
    start_time: float = 0.0
    client_queue_time: float = 0.0
