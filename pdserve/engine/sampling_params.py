"""Per-request sampling parameters, with vLLM's field names and validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class ParamError(ValueError):
    """A client mistake in the request parameters; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token (0 = only the sampled one)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):
                raise ParamError(f"{name} must be a finite number, got {getattr(self, name)}.", name)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParamError(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")
        if self.temperature < 0:
            raise ParamError(f"temperature must be non-negative, got {self.temperature}.", "temperature")
        if not 0 < self.top_p <= 1:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if self.top_k < 0:
            raise ParamError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.", "top_k")
        if not 0 <= self.min_p <= 1:
            raise ParamError(f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        if self.min_tokens < 0:
            raise ParamError(f"min_tokens must be non-negative, got {self.min_tokens}.", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}).", "min_tokens"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ParamError(f"logprobs must be in [0, 20], got {self.logprobs}.", "logprobs")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ParamError("stop_token_ids must be non-negative integers.", "stop_token_ids")
