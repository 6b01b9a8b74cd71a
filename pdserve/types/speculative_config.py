"""vLLM's `--speculative-config` JSON (vllm/config/speculative.py): the same keys and defaults for what
pdserve implements, a clear error for the rest."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# ngram's lookup window when neither bound is given (vLLM's defaults: 5 and 5)
DEFAULT_PROMPT_LOOKUP = 5
MAX_SPECULATIVE_TOKENS = 32  # a verify step of more rows than this costs more than any draft saves

_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "disable_by_batch_size"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    # speculation pauses while more requests than this are running (vLLM's disable_by_batch_size); None: never
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft's folder or embedded name (same tokenizer as the target)

    @classmethod
    def parse(cls, value: dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """The JSON object (or its text) as `vllm serve --speculative-config` takes it; ValueError naming the
        bad key or value. None or {} (no speculation): None."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        if not value:
            return None
        unknown = set(value) - _KEYS
        if unknown:
            raise ValueError(f"speculative_config: unknown or unsupported keys {sorted(unknown)} "
                             f"(pdserve takes {sorted(_KEYS)})")
        method = value.get("method")
        model = value.get("model")
        if method is None and model in ("ngram", "[ngram]"):  # vLLM's older spelling: model "ngram"
            method = "ngram"
        if method == "[ngram]":
            method = "ngram"
        if method is None and model is not None:
            method = "draft_model"
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config: method {method!r} is not available: pdserve implements "
                             "\"ngram\" (prompt lookup) and \"draft_model\" (a smaller model given as model)")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError("speculative_config.model: a draft_model needs the draft's folder (or name)")
        k = value.get("num_speculative_tokens")
        if type(k) is not int or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if type(v) is not int or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer > 0, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        off = value.get("disable_by_batch_size")
        if off is not None and (type(off) is not int or off < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1, got {off!r}")
        return cls(method, k, lo, hi, off, model if method == "draft_model" else None)
