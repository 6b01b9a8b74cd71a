"""Reasoning + tool-call parsing of one chat output, in the order vLLM applies them.

`ParserConfig` is the server-wide configuration (`--reasoning-parser`, `--enable-auto-tool-choice`,
`--tool-call-parser`), shared by the in-process OpenAI server and the render tier so that both split an
output into `reasoning_content` / `content` / `tool_calls` identically. `ChatOutputParser` is the
per-output machine: text deltas go through the reasoning parser first and its content through the tool
parser. `parse()` is the batch form and runs the same machine, so streamed and non-streamed answers agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pdserve.text.forced_tools import ForcedToolError, forced_tool
from pdserve.text.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream
from pdserve.text.tool_parsers import TOOL_PARSERS, HermesToolStream, ToolCall, ToolParser, make_tool_call_id

P = TypeVar("P")

PROMPT_TAIL_TOKENS = 8  # prompt tokens decoded to tell whether the prompt opened a think block


def prompt_tail_text(tokenizer: Any, prompt_token_ids: Sequence[int] | None) -> str | None:
    """The text of the prompt's last few tokens, special tokens included: what the reasoning parser reads
    to know whether the template already opened a think block. `tokenizer` has `decode_window`."""
    if not prompt_token_ids:
        return None
    return tokenizer.decode_window(list(prompt_token_ids[-PROMPT_TAIL_TOKENS:]), False)


class ToolChoiceError(ValueError):
    """A request whose tool settings this server cannot honour (HTTP 400)."""

    def __init__(self, message: str, param: str = "tool_choice"):
        super().__init__(message)
        self.param = param


class ParserStateError(ValueError):
    """A serialised parser state that cannot be resumed (HTTP 400)."""


def named_parser(parsers: Mapping[str, type[P]], name: str | None, what: str) -> P | None:
    """A new parser of the kind a flag names (`what`: "reasoning parser", ...); None when the flag is unset."""
    if not name:
        return None
    cls = parsers.get(name)
    if cls is None:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(parsers)}")
    return cls()


@dataclass(frozen=True)
class ParserConfig:
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        self.reasoning()  # validates the names
        self.tools()
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")

    @property
    def any(self) -> bool:
        return bool(self.reasoning_parser or self.tool_call_parser)

    def reasoning(self) -> ReasoningParser | None:
        return named_parser(REASONING_PARSERS, self.reasoning_parser, "reasoning parser")

    def tools(self) -> ToolParser | None:
        return named_parser(TOOL_PARSERS, self.tool_call_parser, "tool call parser")


def effective_tool_choice(tools: Any, tool_choice: Any) -> Any:
    """OpenAI's default: "auto" when tools are given, else "none"."""
    if tool_choice is None:
        return "auto" if tools else "none"
    return tool_choice


def parses_tool_calls(config: ParserConfig, tools: Any, tool_choice: Any) -> bool:
    """Whether a request's output goes through the tool parser. Raises ToolChoiceError (400) for tool
    settings the server cannot honour: "auto" without `--enable-auto-tool-choice`, a malformed or unknown
    named function. "required" and a named function are forced by structured outputs
    (pdserve.text.forced_tools) and need no parser: False."""
    choice = effective_tool_choice(tools, tool_choice)
    if choice == "none":
        return False
    if not tools:
        if choice == "auto":
            return False
        raise ToolChoiceError(f"tool_choice {choice!r} needs a non-empty tools list")
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise ToolChoiceError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            )
        return True
    if choice == "required" or isinstance(choice, dict):
        try:
            forced_tool(tools, choice)
        except ForcedToolError as e:
            raise ToolChoiceError(str(e), e.param) from e
        return False
    raise ToolChoiceError(f"invalid tool_choice {choice!r}")


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ChatDelta) -> ChatDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        return self

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """Splits one output's text. Build it with `ChatOutputParser.new(...)` or `.from_state(...)`."""

    def __init__(self, reasoning: ReasoningStream | None, tools: HermesToolStream | None,
                 include_reasoning: bool = True):
        self.reasoning = reasoning
        self.tools = tools
        self.include_reasoning = include_reasoning

    @classmethod
    def new(cls, config: ParserConfig, *, use_tools: bool, prompt_tail: str | None = None,
            include_reasoning: bool = True, make_id: Callable[[], str] = make_tool_call_id) -> ChatOutputParser:
        rp = config.reasoning()
        tp = config.tools() if use_tools else None
        return cls(rp.stream(prompt_tail) if rp else None, tp.stream(make_id) if tp else None, include_reasoning)

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    @property
    def tools_called(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0

    @property
    def chars_scanned(self) -> int:
        return (self.reasoning.chars_scanned if self.reasoning else 0) + (
            self.tools.chars_scanned if self.tools else 0)

    def _route(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        out = ChatDelta(reasoning=reasoning if self.include_reasoning else "")
        if self.tools is None:
            out.content = content
            return out
        td = self.tools.feed(content)
        if final:
            td += self.tools.finish()
        out.content = td.content
        out.tool_calls = td.calls
        return out

    def feed(self, text: str) -> ChatDelta:
        if self.reasoning is None:
            return self._route("", text, False)
        rd = self.reasoning.feed(text)
        return self._route(rd.reasoning, rd.content, False)

    def finish(self) -> ChatDelta:
        if self.reasoning is None:
            return self._route("", "", True)
        rd = self.reasoning.finish()
        return self._route(rd.reasoning, rd.content, True)

    def parse(self, text: str) -> ChatDelta:
        """Batch form: the whole output at once."""
        out = self.feed(text)
        out += self.finish()
        return out

    # ---- state for the render tier's stream_state ----------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        return {
            "reasoning": self.reasoning.to_state() if self.reasoning else None,
            "tools": self.tools.to_state() if self.tools else None,
        }

    @classmethod
    def from_state(cls, config: ParserConfig, state: Any, *, use_tools: bool, include_reasoning: bool = True,
                   make_id: Callable[[], str] = make_tool_call_id) -> ChatOutputParser:
        if not isinstance(state, dict) or set(state) != {"reasoning", "tools"}:
            raise ParserStateError("parser state must be an object with 'reasoning' and 'tools'")
        rp = config.reasoning()
        tp = config.tools() if use_tools else None
        if (rp is None) != (state["reasoning"] is None) or (tp is None) != (state["tools"] is None):
            raise ParserStateError("parser state does not match this server's parsers and the request's tools")
        try:
            reasoning = ReasoningStream.from_state(state["reasoning"]) if rp else None
            tools = tp.stream_from_state(state["tools"], make_id) if tp else None
        except ValueError as e:
            raise ParserStateError(str(e)) from e
        return cls(reasoning, tools, include_reasoning)
