"""Per-request sampling parameters, with vLLM's field names and validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pdserve.types.param_error import ParamError
from pdserve.types.structured_params import StructuredOutputsParams

MAX_N = 128  # choices per prompt; beyond it a request is refused


@dataclass
class SamplingParams:
    n: int = 1  # outputs per prompt (the offline API runs n requests; servers make one choice each)
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
    # top logprobs per prompt position (vLLM's): every position but the first gets the prompt token's logprob
    # and the top n; such a request computes its whole prompt (no prefix-cache hits, no remote KV)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # on prompt and output tokens: positive logits / p, negative ones * p
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    detokenize: bool = True  # False: token ids only (the offline API's skip_tokenizer_init)
    # what the output must match (pdserve.types.structured_params.StructuredOutputsParams, or its dict form)
    structured_outputs: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.validate()
        if self.logit_bias is not None:
            # OpenAI's range; vLLM clamps the same way
            self.logit_bias = {t: min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before sampling (min_tokens aside, which depends on the progress)."""
        return (self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                or self.structured_outputs is not None)

    def validate(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ParamError(f"n must be an int in [1, {MAX_N}], got {self.n!r}.", "n")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ParamError(f"{name} must be a finite number, got {getattr(self, name)}.", name)
        if self.stop and not self.detokenize:
            raise ParamError("stop strings are only supported when detokenize is True.", "stop")
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
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ParamError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}.", "prompt_logprobs")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ParamError("stop_token_ids must be non-negative integers.", "stop_token_ids")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ParamError(f"{name} must be in [-2, 2], got {getattr(self, name)}.", name)
        if self.repetition_penalty <= 0.0:
            raise ParamError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
                             "repetition_penalty")
        # Token ids are checked against the vocabulary where it is known: LLMEngine.add_request.
        if self.logit_bias is not None:
            if any(not _is_int(t) for t in self.logit_bias):
                raise ParamError("logit_bias keys must be integer token ids.", "logit_bias")
            if any(not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b)
                   for b in self.logit_bias.values()):
                raise ParamError("logit_bias values must be finite numbers.", "logit_bias")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ParamError("allowed_token_ids must not be empty.", "allowed_token_ids")
            if any(not _is_int(t) for t in self.allowed_token_ids):
                raise ParamError("allowed_token_ids must be integer token ids.", "allowed_token_ids")


def child_seed(seed: int | None, index: int) -> int | None:
    """n > 1: each choice is its own engine request; a fixed seed gives each a distinct, reproducible one."""
    if seed is None or index == 0:
        return seed
    value = seed + index
    return value if value <= 2**63 - 1 else value - 2**64


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
