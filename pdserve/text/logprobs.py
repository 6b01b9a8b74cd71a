"""Logprobs in the OpenAI response shapes.

Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` where each top_logprobs entry
maps token text to logprob (the sampled token first, then the top ones, as vLLM builds it).
Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
-inf and NaN become -9999.0 (JSON has neither).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

MIN_LOGPROB = -9999.0


class TokenLogprobLike(Protocol):
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


def clamp(logprob: float) -> float:
    if math.isnan(logprob) or logprob < MIN_LOGPROB:
        return MIN_LOGPROB
    return float(logprob)


class LogprobFormatter:
    """Turns engine logprobs into OpenAI shapes. `token_text(id)` gives a token's text (cached)."""

    def __init__(self, token_text: Callable[[int], str], return_tokens_as_token_ids: bool = False):
        self._token_text = token_text
        self.as_ids = return_tokens_as_token_ids

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self._token_text(token_id)

    # ---- completions -------------------------------------------------------------------------
    def completion(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobLike | None],
        num_top: int,
        initial_text_offset: int = 0,
    ) -> dict[str, Any]:
        """`logprobs[i]` is None for a token without logprobs (an echoed prompt token)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        offset = initial_text_offset
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            token = self.text(token_id)
            tokens.append(token)
            text_offset.append(offset)
            offset += len(token)
            if lp is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(clamp(lp.logprob))
            top: dict[str, float] = {token: clamp(lp.logprob)}
            for tid, value in lp.top[:num_top]:
                top.setdefault(self.text(tid), clamp(value))
            top_logprobs.append(top)
        return {
            "text_offset": text_offset,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": top_logprobs,
        }

    # ---- prompt logprobs (vLLM's `prompt_logprobs` field) -------------------------------------
    def prompt(self, logprobs: Sequence[TokenLogprobLike | None]) -> list[dict[str, dict[str, Any]] | None]:
        """Per prompt position: None (the first), or {token id as a string: {"logprob", "rank",
        "decoded_token"}} for the prompt token, then the top n (best first), as vLLM serialises them."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for lp in logprobs:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): self._prompt_entry(lp.token_id, lp.logprob, lp.rank)}
            for rank, (tid, value) in enumerate(lp.top, start=1):
                entry.setdefault(str(tid), self._prompt_entry(tid, value, rank))
            out.append(entry)
        return out

    def _prompt_entry(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": clamp(logprob), "rank": rank, "decoded_token": self.text(token_id)}

    # ---- chat --------------------------------------------------------------------------------
    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.text(token_id)
        return {"token": token, "logprob": clamp(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}

    def chat(self, logprobs: Sequence[TokenLogprobLike], num_top: int) -> dict[str, Any]:
        content = []
        for lp in logprobs:
            entry = self._entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._entry(tid, value) for tid, value in lp.top[:num_top]]
            content.append(entry)
        return {"content": content}
