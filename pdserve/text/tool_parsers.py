"""Tool-call parsers: find function calls in a model's content text.

`hermes` (Hermes / Qwen2.5 / Qwen3 format): each call is
`<tool_call>{"name": "...", "arguments": {...}}</tool_call>` (whitespace around the JSON allowed).

Like the reasoning parsers this is one state machine over text deltas, and the batch form runs the same
machine over the whole text, so streaming and non-streaming results always agree:

* text outside `<tool_call>` blocks is content; whitespace directly before a call, and whitespace
  left at the end of an output that called tools, is dropped (so "\\n\\n<tool_call>..." has no content);
* a call is emitted whole (id, name, arguments) in the delta where its block closes: its arguments are
  `json.dumps` of the parsed object, byte-identical to the batch form (partial JSON is never guessed);
* a block whose JSON is not a call object (no string "name") is shown as content, verbatim;
* a block left open at the end of the output is a call if its text is already a complete call object.

Work per delta is the delta plus the held-back tail (a partial tag, pending whitespace, or the open
call's text), never the history before the current call.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

_TEXT = "text"
_CALL = "call"
_MAX_PENDING_CHARS = 1 << 20  # one open tool call's text; a larger serialised state is refused


class ToolParserStateError(ValueError):
    """A serialised parser state that cannot be resumed (client mistake: HTTP 400)."""


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text

    def to_message(self) -> dict[str, Any]:
        """The `tool_calls[]` entry of a non-streamed assistant message."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_delta(self) -> dict[str, Any]:
        """The `delta.tool_calls[]` entry of a streamed chunk (the whole call in one delta)."""
        return {"index": self.index, **self.to_message()}


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ToolDelta) -> ToolDelta:
        self.content += other.content
        self.calls.extend(other.calls)
        return self


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_call_json(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call's JSON text, or None when it is not a call object."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


class HermesToolStream:
    """Incremental Hermes parser for one output."""

    def __init__(self, mode: str = _TEXT, pending: str = "", num_calls: int = 0,
                 make_id: Callable[[], str] = make_tool_call_id):
        self.mode = mode
        self.pending = pending
        self.num_calls = num_calls
        self.make_id = make_id
        self.chars_scanned = 0

    # ---- state -----------------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        return {"mode": self.mode, "pending": self.pending, "num_calls": self.num_calls}

    @classmethod
    def from_state(cls, state: Any, make_id: Callable[[], str] = make_tool_call_id) -> HermesToolStream:
        if not isinstance(state, dict) or set(state) != {"mode", "pending", "num_calls"}:
            raise ToolParserStateError("tool parser state must be an object with 'mode', 'pending', 'num_calls'")
        mode, pending, num_calls = state["mode"], state["pending"], state["num_calls"]
        if (mode not in (_TEXT, _CALL) or not isinstance(pending, str) or len(pending) > _MAX_PENDING_CHARS
                or type(num_calls) is not int or num_calls < 0):
            raise ToolParserStateError("malformed tool parser state")
        return cls(mode, pending, num_calls, make_id)

    # ---- the machine -----------------------------------------------------------------------------
    def _emit_call(self, body: str, out: ToolDelta) -> None:
        parsed = parse_call_json(body.strip())
        if parsed is None:
            out.content += TOOL_CALL_START + body + TOOL_CALL_END
            return
        out.calls.append(ToolCall(self.num_calls, self.make_id(), parsed[0], parsed[1]))
        self.num_calls += 1

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        if not text:
            return out
        held = len(self.pending)
        self.chars_scanned += held + len(text)
        buf = self.pending + text
        self.pending = ""
        while buf:
            if self.mode == _CALL:
                end = buf.find(TOOL_CALL_END, max(0, held - len(TOOL_CALL_END) + 1))
                if end < 0:
                    self.pending = buf
                    if len(buf) > _MAX_PENDING_CHARS:  # keep resumable: give up on this block as a call
                        out.content += TOOL_CALL_START + buf
                        self.pending = ""
                        self.mode = _TEXT
                    return out
                self._emit_call(buf[:end], out)
                buf = buf[end + len(TOOL_CALL_END):]
                self.mode = _TEXT
                held = 0
                continue
            start = buf.find(TOOL_CALL_START, max(0, held - len(TOOL_CALL_START) + 1) if held else 0)
            if start >= 0:
                out.content += buf[:start].rstrip()
                buf = buf[start + len(TOOL_CALL_START):]
                self.mode = _CALL
                held = 0
                continue
            keep = _partial_suffix(buf, TOOL_CALL_START)
            body = buf[: len(buf) - keep]
            stripped = body.rstrip()
            out.content += stripped
            self.pending = body[len(stripped):] + buf[len(buf) - keep:]
            return out
        return out

    def finish(self) -> ToolDelta:
        """End of output: an open block may still be a complete call; held text is released."""
        out = ToolDelta()
        tail, self.pending = self.pending, ""
        if self.mode == _CALL:
            self.mode = _TEXT
            parsed = parse_call_json(tail.strip())
            if parsed is None:
                out.content += TOOL_CALL_START + tail
            else:
                out.calls.append(ToolCall(self.num_calls, self.make_id(), parsed[0], parsed[1]))
                self.num_calls += 1
            return out
        if tail and not (self.num_calls and not tail.strip()):
            out.content += tail
        return out


class ToolParser:
    """A named configuration (`--tool-call-parser NAME`); makes one stream per output."""

    name = "base"

    def stream(self, make_id: Callable[[], str] = make_tool_call_id) -> HermesToolStream:
        raise NotImplementedError

    def stream_from_state(self, state: Any, make_id: Callable[[], str] = make_tool_call_id) -> HermesToolStream:
        raise NotImplementedError

    def extract(self, text: str, make_id: Callable[[], str] = make_tool_call_id) -> tuple[str | None, list[ToolCall]]:
        """Batch form: (content or None, calls), identical to a streamed parse."""
        s = self.stream(make_id)
        out = s.feed(text)
        out += s.finish()
        return (out.content or None), out.calls


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self, make_id: Callable[[], str] = make_tool_call_id) -> HermesToolStream:
        return HermesToolStream(make_id=make_id)

    def stream_from_state(self, state: Any, make_id: Callable[[], str] = make_tool_call_id) -> HermesToolStream:
        return HermesToolStream.from_state(state, make_id)


TOOL_PARSERS: dict[str, type[ToolParser]] = {HermesToolParser.name: HermesToolParser}
