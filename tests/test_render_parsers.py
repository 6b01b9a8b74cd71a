"""Reasoning and tool-call parsers: semantics, and streamed == batch for every chunking."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.text.output_parsers import (
    ChatDelta,
    ChatOutputParser,
    ParserConfig,
    ParserStateError,
    ToolChoiceError,
    parses_tool_calls,
)
from pdserve.text.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningStream
from pdserve.text.tool_parsers import HermesToolParser, HermesToolStream

FULL = ParserConfig("qwen3", "hermes", True)


def ids():
    counter = itertools.count()
    return lambda: f"call-{next(counter)}"


def stream_split(config: ParserConfig, text: str, cuts: list[int], prompt_tail: str | None = None,
                 roundtrip: bool = False) -> ChatDelta:
    make_id = ids()
    parser = ChatOutputParser.new(config, use_tools=True, prompt_tail=prompt_tail, make_id=make_id)
    out = ChatDelta()
    pos = 0
    for cut in [*sorted(set(cuts)), len(text)]:
        if roundtrip:  # resume from the serialised state, as the render tier does per chunk
            state = json.loads(json.dumps(parser.to_state()))
            parser = ChatOutputParser.from_state(config, state, use_tools=True, make_id=make_id)
        out += parser.feed(text[pos:cut])
        pos = cut
    out += parser.finish()
    return out


def batch_split(config: ParserConfig, text: str, prompt_tail: str | None = None) -> ChatDelta:
    return ChatOutputParser.new(config, use_tools=True, prompt_tail=prompt_tail, make_id=ids()).parse(text)


def as_tuple(d: ChatDelta):
    return d.reasoning, d.content, [(c.index, c.id, c.name, json.loads(c.arguments)) for c in d.tool_calls]


def test_qwen3_reasoning_split():
    p = Qwen3ReasoningParser()
    assert p.extract("<think>\nplan it\n</think>\n\nThe answer.") == ("\nplan it\n", "\n\nThe answer.")
    assert p.extract("Just an answer.") == (None, "Just an answer.")
    assert p.extract("<think>cut off") == ("cut off", None)
    # </think> without an opening tag in the output is literal text for Qwen3...
    assert p.extract("a</think>b") == (None, "a</think>b")
    # ...unless the prompt opened the think block (thinking-only templates).
    assert p.extract("a</think>b", prompt_tail="<|im_start|>assistant\n<think>\n") == ("a", "b")
    assert p.extract("x", prompt_tail="<think>\n\n</think>\n\n") == (None, "x")


def test_deepseek_r1_reasoning_split():
    p = DeepSeekR1ReasoningParser()
    assert p.extract("plan</think>answer") == ("plan", "answer")
    assert p.extract("<think>plan</think>answer") == ("plan", "answer")
    assert p.extract("still thinking") == ("still thinking", None)


def test_hermes_tool_calls():
    p = HermesToolParser()
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "now", "arguments": {}}</tool_call>\n')
    content, calls = p.extract(text, ids())
    assert content == "Let me check."
    assert [(c.index, c.id, c.name, c.arguments) for c in calls] == [
        (0, "call-0", "get_weather", '{"city": "Paris"}'), (1, "call-1", "now", "{}")]
    # Not a call object: shown verbatim as content.
    assert p.extract("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    # An unclosed block that is already a complete call counts.
    content, calls = p.extract('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert content is None and calls[0].arguments == '{"x": 1}'
    # Whitespace-only content around calls is dropped; real text is not.
    assert p.extract("\n\n<tool_call>{\"name\": \"f\"}</tool_call>\n")[0] is None
    assert p.extract("a < b <tool")[0] == "a < b <tool"


def test_reasoning_then_tools():
    text = '<think>need weather</think>\n\n<tool_call>{"name": "w", "arguments": {"c": "X"}}</tool_call>'
    out = batch_split(FULL, text)
    assert as_tuple(out) == ("need weather", "", [(0, "call-0", "w", {"c": "X"})])
    # Tags inside reasoning are not tool calls.
    out = batch_split(FULL, '<think><tool_call>{"name": "w"}</tool_call></think>ok')
    assert as_tuple(out) == ('<tool_call>{"name": "w"}</tool_call>', "ok", [])
    no_reasoning = ChatOutputParser.new(FULL, use_tools=True, include_reasoning=False).parse(text)
    assert no_reasoning.reasoning == "" and no_reasoning.tool_calls


_ALPHABET = ["<think>", "</think>", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": [1, 2]}}',
             "<", "</", "<thi", "</tool", "{", "}", " ", "\n", "text", "é", '"', "name"]


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(_ALPHABET), max_size=14),
    cuts=st.lists(st.integers(0, 200), max_size=8),
    parser=st.sampled_from(["qwen3", "deepseek_r1", None]),
    tail=st.sampled_from([None, "assistant\n<think>\n", "<think>\n\n</think>\n\n"]),
    roundtrip=st.booleans(),
)
def test_streamed_equals_batch(pieces, cuts, parser, tail, roundtrip):
    config = ParserConfig(parser, "hermes", True)
    text = "".join(pieces)
    cuts = [c for c in cuts if c <= len(text)]
    assert as_tuple(stream_split(config, text, cuts, tail, roundtrip)) == as_tuple(batch_split(config, text, tail))


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab<>/thinkol_c{}\"\n ", max_size=60))
def test_nothing_is_lost_without_tool_calls(text):
    """With no valid call, reasoning + content + stripped tags is the whole text (modulo the dropped tags)."""
    out = batch_split(ParserConfig("deepseek_r1", None, False), text)
    assert out.reasoning + out.content == text.replace("<think>", "", 1 if text.startswith("<think>") else 0) \
        .replace("</think>", "", 1)


def test_state_validation():
    with pytest.raises(ValueError):
        ReasoningStream.from_state({"mode": "weird", "pending": ""})
    with pytest.raises(ValueError):
        ReasoningStream.from_state({"mode": "reasoning", "pending": "x" * 1000})
    with pytest.raises(ValueError):
        HermesToolStream.from_state({"mode": "text", "pending": "", "num_calls": -1})
    with pytest.raises(ValueError):
        HermesToolStream.from_state({"mode": "text", "pending": "", "num_calls": True})
    with pytest.raises(ParserStateError):
        ChatOutputParser.from_state(FULL, {"reasoning": None, "tools": None}, use_tools=True)
    with pytest.raises(ParserStateError):
        ChatOutputParser.from_state(FULL, [], use_tools=True)


def test_tool_choice_rules():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert parses_tool_calls(FULL, tools, None) is True
    assert parses_tool_calls(FULL, tools, "auto") is True
    assert parses_tool_calls(FULL, tools, "none") is False
    assert parses_tool_calls(FULL, None, None) is False
    with pytest.raises(ToolChoiceError, match="enable-auto-tool-choice"):
        parses_tool_calls(ParserConfig("qwen3"), tools, "auto")
    # "required" and a named function are forced by structured outputs: no parser reads them
    assert parses_tool_calls(ParserConfig(), tools, "required") is False
    assert parses_tool_calls(ParserConfig(), tools, {"type": "function", "function": {"name": "f"}}) is False
    with pytest.raises(ToolChoiceError, match="has not been passed"):
        parses_tool_calls(FULL, tools, {"type": "function", "function": {"name": "g"}})
    with pytest.raises(ToolChoiceError, match="non-empty tools"):
        parses_tool_calls(FULL, [], "required")
    with pytest.raises(ToolChoiceError):
        parses_tool_calls(FULL, tools, {"type": "function", "function": "f"})
    with pytest.raises(ValueError):
        ParserConfig(None, None, True)
    with pytest.raises(ValueError):
        ParserConfig("nope")


def test_parser_names_are_checked_and_each_call_makes_a_new_parser():
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'nope'; choose one of \['deepseek_r1', 'qwen3'\]"):
        ParserConfig(reasoning_parser="nope")
    with pytest.raises(ValueError, match=r"unknown tool call parser 'nope'; choose one of \['hermes'\]"):
        ParserConfig(tool_call_parser="nope")
    assert ParserConfig().reasoning() is None and ParserConfig().tools() is None
    assert isinstance(FULL.reasoning(), Qwen3ReasoningParser) and FULL.reasoning() is not FULL.reasoning()
    assert isinstance(FULL.tools(), HermesToolParser)
