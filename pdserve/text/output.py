"""The output processor: engine token deltas -> text deltas, with stop strings and logprobs.

One `OutputProcessor` per request. Feed it each engine `RequestOutput` (token ids since the last one);
it detokenises token by token, checks stop strings, and returns a `TextDelta` with the text that may be
shown now. When a stop string is hit, `TextDelta.stop_string_hit` is set: the caller aborts the engine
request (it is finished from the client's point of view, `finish_reason="stop"`,
`stop_reason=<the string>`). Tokens the engine produced after the one completing the stop string are
dropped, as are their logprobs.

Like vLLM, a request that the engine ends with a stop token (EOS or `stop_token_ids`) does not get that
token's text unless `include_stop_str_in_output` is set; its id is still in `token_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.text.detokenizer import IncrementalDetokenizer
from pdserve.text.stop import StopStringMatcher


class EngineOutput(Protocol):
    """The fields of `pdserve.types.outputs.RequestOutput` read here (no import: no torch in text/)."""

    new_token_ids: list[int]
    new_logprobs: list[Any] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None


class StopParams(Protocol):
    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    min_tokens: int


@dataclass
class TextDelta:
    text: str  # text that may be shown now (held-back stop-string prefixes excluded until resolved)
    token_ids: list[int]  # token ids accepted in this delta
    logprobs: list[Any] | None  # the engine's TokenLogprob per accepted token, when requested
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_string_hit: bool = False  # the caller must abort the engine request


@dataclass
class FinalOutput:
    """A whole request's result (the same fields as `pdserve.llm.CompletionOutput`)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[Any] | None = field(default=None)


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        detokenize: bool = True,
    ):
        self.detokenize = detokenize
        self._detok = (
            IncrementalDetokenizer(tokenizer, list(prompt_token_ids), skip_special_tokens) if detokenize else None
        )
        self._stop = StopStringMatcher(stop if detokenize else (), include_stop_str_in_output)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self.text = ""  # the full output text so far (after any stop-string cut)
        self.token_ids: list[int] = []
        self.logprobs: list[Any] = []
        self._emitted = 0  # characters of `text` already returned
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @classmethod
    def from_params(cls, tokenizer: Any, prompt_token_ids: Sequence[int], params: StopParams,
                    detokenize: bool = True) -> OutputProcessor:
        return cls(
            tokenizer, prompt_token_ids, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens, min_tokens=params.min_tokens, detokenize=detokenize,
        )

    def process(self, out: EngineOutput) -> TextDelta:
        if self.finished:  # outputs racing an abort we asked for after a stop string
            return TextDelta("", [], None, True, self.finish_reason, self.stop_reason)
        new_ids = out.new_token_ids
        new_lps = out.new_logprobs
        accepted_ids: list[int] = []
        accepted_lps: list[Any] | None = [] if new_lps is not None else None
        token_stop = out.finished and out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
        stop_hit: str | None = None
        last = len(new_ids) - 1
        for k, token_id in enumerate(new_ids):
            accepted_ids.append(token_id)
            if accepted_lps is not None and new_lps is not None and k < len(new_lps):
                accepted_lps.append(new_lps[k])
            self.token_ids.append(token_id)
            if self._detok is None or (token_stop and k == last and not self._include_stop):
                continue
            piece = self._detok.step(token_id)
            if piece and self._check_stop(piece):
                stop_hit = self.stop_reason  # type: ignore[assignment]
                break
        if accepted_lps:
            self.logprobs.extend(accepted_lps)

        if stop_hit is None and out.finished:
            if self._detok is not None:
                tail = self._detok.flush()
                if tail:
                    self._check_stop(tail)
            if not self.finished:
                self.finished = True
                self.finish_reason = out.finish_reason
                self.stop_reason = out.stop_reason
        text = self._take_text()
        return TextDelta(
            text=text,
            token_ids=accepted_ids,
            logprobs=accepted_lps,
            finished=self.finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            stop_string_hit=stop_hit is not None,
        )

    def _check_stop(self, piece: str) -> bool:
        """Appends a piece of text; True if it completed a stop string (the request is then finished)."""
        self.text += piece
        if not self._stop or len(self.token_ids) < self._min_tokens:
            return False
        hit = self._stop.check(self.text, len(piece))
        if hit is None:
            return False
        stop_str, cut = hit
        self.text = self.text[:cut]
        self.finished = True
        self.finish_reason = "stop"
        self.stop_reason = stop_str
        return True

    def _take_text(self) -> str:
        end = len(self.text) if self.finished else max(len(self.text) - self._stop.holdback, self._emitted)
        piece = self.text[self._emitted:end]
        self._emitted = end
        return piece

    def result(self) -> FinalOutput:
        return FinalOutput(
            text=self.text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs else None,
        )


class OfflineOutputCollector:
    """What `pdserve.llm.LLM` uses: `add(out)` returns True when a stop string ended the request."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: StopParams,
                 detokenize: bool = True):
        self._proc = OutputProcessor.from_params(tokenizer, prompt_token_ids, params, detokenize)
        self._wants_logprobs = getattr(params, "logprobs", None) is not None

    def add(self, out: EngineOutput) -> bool:
        return self._proc.process(out).stop_string_hit

    def result(self) -> FinalOutput:
        res = self._proc.result()
        if self._wants_logprobs and res.logprobs is None:
            res.logprobs = []
        return res
