"""One choice's token deltas -> text deltas, resumable from a small serialised state.

The semantics are those of `pdserve.text.output.OutputProcessor` (the in-process server's): incremental
detokenisation, stop strings (held back while they may still match, gated by `min_tokens`), the stop
token's text left out unless `include_stop_str_in_output`, then the reasoning/tool parsers. What differs
is the state: instead of the whole output text and token list, only

* the detokeniser window (the ids of the last decoded character plus any not yet decodable),
* the last `max(len(stop)) - 1` characters of text (what a stop string could still straddle),
* counters, and the parsers' own small states,

so a derender call costs the same for chunk 10 and chunk 10,000 and the `stream_state` the client sends
back stays a few hundred bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.api.generate import MAX_STATE_TOKENS, ChoiceStreamState, TokenLogprobEntry
from pdserve.text.detokenizer import IncrementalDetokenizer
from pdserve.text.output_parsers import ChatDelta, ChatOutputParser, ParserConfig
from pdserve.text.stop import StopStringMatcher
from pdserve.text.tool_parsers import make_tool_call_id
from pdserve.types.outputs import TokenLogprob


class ResumableDetokenizer(IncrementalDetokenizer):
    """`IncrementalDetokenizer` whose state is its window: ids from the prefix offset on."""

    def to_window(self) -> tuple[list[int], int]:
        return list(self._ids[self._prefix_offset:]), self._read_offset - self._prefix_offset

    @classmethod
    def from_window(cls, tokenizer: Any, window: list[int], read_offset: int,
                    skip_special_tokens: bool) -> ResumableDetokenizer:
        if read_offset > len(window):
            raise ValueError("read_offset is past the end of prev_tokens")
        self = cls.__new__(cls)
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._ids = list(window)
        self._prefix_offset = 0
        self._read_offset = read_offset
        self._prefix_text = self._decode(0, read_offset)
        return self

    @property
    def window_len(self) -> int:
        return len(self._ids) - self._prefix_offset


@dataclass
class TextOptions:
    """The request fields that shape one choice's text."""

    stop: Sequence[str] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0


@dataclass
class ChoiceDelta:
    text: str  # text that may be shown now (after stop-string hold-back)
    token_ids: list[int]  # ids accepted in this delta (ids after a stop string are dropped)
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    parsed: ChatDelta | None = None  # the text split by the parsers (chat with parsers only)
    stop_string_hit: bool = False


def to_engine_logprobs(entries: Sequence[TokenLogprobEntry]) -> list[TokenLogprob]:
    return [TokenLogprob(e.token_id, e.logprob, e.rank if e.rank is not None else 0,
                         [(t.token_id, t.logprob) for t in e.top_logprobs]) for e in entries]


@dataclass
class ChoiceStream:
    index: int
    detok: ResumableDetokenizer
    stop: StopStringMatcher
    options: TextOptions
    parser: ChatOutputParser | None
    role_sent: bool = False
    num_output_tokens: int = 0
    text_len: int = 0
    stop_tail: str = ""
    unemitted: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def new(cls, index: int, tokenizer: Any, prompt_token_ids: Sequence[int] | None, options: TextOptions,
            parser: ChatOutputParser | None) -> ChoiceStream:
        detok = ResumableDetokenizer(tokenizer, list(prompt_token_ids or []), options.skip_special_tokens)
        return cls(index, detok, StopStringMatcher(options.stop, options.include_stop_str_in_output), options,
                   parser)

    @classmethod
    def from_state(cls, state: ChoiceStreamState, tokenizer: Any, options: TextOptions,
                   parser_config: ParserConfig | None, use_tools: bool, include_reasoning: bool,
                   make_id: Callable[[], str] = make_tool_call_id) -> ChoiceStream:
        """Raises ValueError (a 400) for a state that does not fit the request or the server (the caller has
        checked the ids against the vocabulary)."""
        stop = StopStringMatcher(options.stop, options.include_stop_str_in_output)
        if state.unemitted > len(state.stop_tail):
            raise ValueError("stream_state: unemitted exceeds the stop tail")
        if len(state.stop_tail) > 2 * max((len(s) for s in stop.stop), default=0):
            raise ValueError("stream_state: stop_tail is longer than the request's stop strings need")
        parser = None
        if parser_config is not None and parser_config.any and state.parser is not None:
            parser = ChatOutputParser.from_state(parser_config, state.parser, use_tools=use_tools,
                                                 include_reasoning=include_reasoning, make_id=make_id)
        elif state.parser is not None or (parser_config is not None and parser_config.any):
            raise ValueError("stream_state parser state does not match this server's parsers")
        detok = ResumableDetokenizer.from_window(tokenizer, state.prev_tokens, state.read_offset,
                                                 options.skip_special_tokens)
        return cls(state.index, detok, stop, options, parser, state.role_sent, state.num_output_tokens,
                   state.text_len, state.stop_tail, state.unemitted, state.finished)

    def to_state(self) -> ChoiceStreamState:
        window, read_offset = self.detok.to_window()
        if self.finished:  # nothing is decoded after the end
            window, read_offset = [], 0
        return ChoiceStreamState(
            index=self.index, prev_tokens=window, read_offset=read_offset, role_sent=self.role_sent,
            num_output_tokens=self.num_output_tokens, text_len=self.text_len, stop_tail=self.stop_tail,
            unemitted=self.unemitted, finished=self.finished,
            parser=self.parser.to_state() if self.parser is not None else None,
        )

    # ---- processing ------------------------------------------------------------------------------
    def _context_chars(self) -> int:
        return max((len(s) for s in self.stop.stop), default=1) - 1

    def _check_stop(self, piece: str) -> bool:
        self.stop_tail += piece
        self.unemitted += len(piece)
        if not self.stop or self.num_output_tokens < self.options.min_tokens:
            return False
        hit = self.stop.check(self.stop_tail, len(piece))
        if hit is None:
            return False
        stop_str, cut = hit
        removed = len(self.stop_tail) - cut
        self.stop_tail = self.stop_tail[:cut]
        self.unemitted = max(0, self.unemitted - removed)
        self.finished = True
        self.finish_reason = "stop"
        self.stop_reason = stop_str
        return True

    def _take_text(self) -> str:
        n = self.unemitted if self.finished else max(0, self.unemitted - self.stop.holdback)
        start = len(self.stop_tail) - self.unemitted
        piece = self.stop_tail[start:start + n]
        self.unemitted -= n
        keep = max(self._context_chars(), self.unemitted)
        if len(self.stop_tail) > keep:
            self.stop_tail = self.stop_tail[len(self.stop_tail) - keep:] if keep else ""
        self.text_len += len(piece)
        return piece

    def process(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None, finished: bool,
                finish_reason: str | None, stop_reason: int | str | None) -> ChoiceDelta:
        if self.finished:  # chunks racing the abort after a stop string
            return ChoiceDelta("", [], None, True, self.finish_reason, self.stop_reason)
        accepted: list[int] = []
        accepted_lps: list[TokenLogprob] | None = [] if logprobs is not None else None
        token_stop = finished and finish_reason == "stop" and not isinstance(stop_reason, str)
        hit = False
        last = len(token_ids) - 1
        for k, token_id in enumerate(token_ids):
            accepted.append(token_id)
            if accepted_lps is not None and logprobs is not None and k < len(logprobs):
                accepted_lps.append(logprobs[k])
            self.num_output_tokens += 1
            if token_stop and k == last and not self.options.include_stop_str_in_output:
                continue
            piece = self.detok.step(token_id)
            if piece and self._check_stop(piece):
                hit = True
                break
        if not hit and not finished and self.detok.window_len > MAX_STATE_TOKENS // 2:
            # A run of ids that never completes a character (garbage output): release it as U+FFFD text
            # rather than let the window, and the stream_state, grow without bound.
            tail = self.detok.flush()
            hit = bool(tail) and self._check_stop(tail)
        if not hit and finished:
            tail = self.detok.flush()
            if tail:
                hit = self._check_stop(tail)
            if not self.finished:
                self.finished = True
                self.finish_reason = finish_reason
                self.stop_reason = stop_reason
        text = self._take_text()
        parsed = None
        if self.parser is not None:
            parsed = self.parser.feed(text)
            if self.finished:
                parsed += self.parser.finish()
        return ChoiceDelta(text, accepted, accepted_lps, self.finished, self.finish_reason, self.stop_reason,
                           parsed, hit)

    @property
    def tools_called(self) -> bool:
        return self.parser is not None and self.parser.tools_called

    @property
    def reported_finish_reason(self) -> str | None:
        """What the response says: "tool_calls" when the output called tools (batch and streamed alike)."""
        if self.finish_reason is not None and self.tools_called:
            return "tool_calls"
        return self.finish_reason
