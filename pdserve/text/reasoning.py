"""Reasoning parsers: split a model's output text into `reasoning_content` and `content`.

Models of the Qwen3 / DeepSeek-R1 family think inside `<think> ... </think>`. The parser is a small
state machine over text deltas; the batch form runs the very same machine over the whole text, so a
streamed answer and a non-streamed one always split identically (vLLM's batch and streaming code paths
can disagree). Work per delta is proportional to the delta plus a held-back tail shorter than a tag, never
to the history, and the whole state (`mode`, `pending`) serialises to a few bytes for the render tier's
`stream_state`.

Semantics:

* `qwen3`: reasoning when the output *starts* with `<think>` (or when the prompt already opened a think
  block, as thinking-only templates do: see `prompt_opens_reasoning`), up to `</think>`. Output that does
  not start with `<think>` is plain content (Qwen3 with `enable_thinking=False`). An output cut off
  inside the think block (max_tokens) is all reasoning.
* `deepseek_r1`: the template opens the think block, so everything before `</think>` is reasoning
  (a leading `<think>` the model repeats is dropped); no `</think>` at all means all reasoning.

The tags are matched in the decoded text, so they must survive detokenisation: Qwen3's `<think>` and
`</think>` are added tokens that are not "special", as they are in every Qwen3 tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"

# Modes of the state machine.
_START = "start"  # qwen3, nothing decided yet: is the output opening with <think>?
_THINK_START = "think_start"  # reasoning, and a leading <think> (repeated by the model) is still dropped
_REASONING = "reasoning"
_CONTENT = "content"
_MODES = (_START, _THINK_START, _REASONING, _CONTENT)
_MAX_PENDING = 64  # a held-back tail is always shorter than a tag; more means a forged state


class ReasoningStateError(ValueError):
    """A serialised parser state that cannot be resumed (client mistake: HTTP 400)."""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def prompt_opens_reasoning(prompt_tail: str | None) -> bool:
    """Whether the end of the prompt text leaves a think block open (`<think>` after the last `</think>`)."""
    if not prompt_tail:
        return False
    return prompt_tail.rfind(THINK_START) > prompt_tail.rfind(THINK_END)


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: ReasoningDelta) -> ReasoningDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningStream:
    """Incremental splitter for one output. `feed(delta)` returns what may be shown now."""

    def __init__(self, mode: str, pending: str = ""):
        self.mode = mode
        self.pending = pending
        self.chars_scanned = 0  # work counter: characters examined so far (tests check it per delta)

    # ---- state -----------------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        return {"mode": self.mode, "pending": self.pending}

    @classmethod
    def from_state(cls, state: Any) -> ReasoningStream:
        if not isinstance(state, dict) or set(state) != {"mode", "pending"}:
            raise ReasoningStateError("reasoning state must be an object with 'mode' and 'pending'")
        mode, pending = state["mode"], state["pending"]
        if mode not in _MODES or not isinstance(pending, str) or len(pending) > _MAX_PENDING:
            raise ReasoningStateError("malformed reasoning state")
        return cls(mode, pending)

    # ---- the machine -----------------------------------------------------------------------------
    def feed(self, text: str) -> ReasoningDelta:
        self.chars_scanned += len(self.pending) + len(text)
        buf = self.pending + text
        self.pending = ""
        out = ReasoningDelta()
        while buf:
            if self.mode == _CONTENT:
                out.content += buf
                return out
            if self.mode in (_START, _THINK_START):
                if buf.startswith(THINK_START):
                    buf = buf[len(THINK_START):]
                    self.mode = _REASONING
                    continue
                if THINK_START.startswith(buf):  # could still become <think>: wait for more text
                    self.pending = buf
                    return out
                self.mode = _CONTENT if self.mode == _START else _REASONING
                continue
            # _REASONING
            end = buf.find(THINK_END)
            if end >= 0:
                out.reasoning += buf[:end]
                buf = buf[end + len(THINK_END):]
                self.mode = _CONTENT
                continue
            keep = _partial_suffix(buf, THINK_END)
            out.reasoning += buf[: len(buf) - keep]
            self.pending = buf[len(buf) - keep:]
            return out
        return out

    def finish(self) -> ReasoningDelta:
        """End of output: release the held-back tail (it was not a tag after all)."""
        tail, self.pending = self.pending, ""
        if not tail:
            return ReasoningDelta()
        if self.mode == _START:
            self.mode = _CONTENT
            return ReasoningDelta(content=tail)
        if self.mode == _THINK_START:
            self.mode = _REASONING
        return ReasoningDelta(reasoning=tail) if self.mode == _REASONING else ReasoningDelta(content=tail)


class ReasoningParser:
    """A named configuration (`--reasoning-parser NAME`); makes one `ReasoningStream` per output."""

    name = "base"

    def initial_mode(self, prompt_tail: str | None) -> str:
        raise NotImplementedError

    def stream(self, prompt_tail: str | None = None) -> ReasoningStream:
        return ReasoningStream(self.initial_mode(prompt_tail))

    def extract(self, text: str, prompt_tail: str | None = None) -> tuple[str | None, str | None]:
        """Batch form: (reasoning or None, content or None), identical to a streamed split."""
        s = self.stream(prompt_tail)
        out = s.feed(text)
        out += s.finish()
        return (out.reasoning or None), (out.content or None)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def initial_mode(self, prompt_tail: str | None) -> str:
        return _THINK_START if prompt_opens_reasoning(prompt_tail) else _START


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def initial_mode(self, prompt_tail: str | None) -> str:
        return _THINK_START


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
}
