"""tool_choice "required" and a named function (`{"type": "function", "function": {"name": ...}}`), as
vLLM serves them (vllm/entrypoints/openai/chat_completion/protocol.py `_get_json_schema_from_tool`,
serving.py): the reply is forced by structured outputs to be

* named: the JSON arguments of that function (its `parameters` schema; `{}`-only when it has none), shown
  as one tool call of that name (finish_reason as the output ended: "stop" or "length");
* required: a JSON array of at least one `{"name": <a tool's name>, "parameters": <its arguments>}`
  (one anyOf branch per tool, the tools' `$defs` hoisted to the top), shown as those tool calls
  (finish_reason "tool_calls").

No tool-call parser and no `--enable-auto-tool-choice` are needed: the grammar guarantees the shape. No
torch here: the render tier imports this.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.text.tool_parsers import ToolCall, make_tool_call_id

_EMPTY_OBJECT = {"type": "object", "properties": {}}


class ForcedToolError(ValueError):
    """A tool_choice / tools combination that cannot be forced (HTTP 400 on `tool_choice` or `tools`)."""

    def __init__(self, message: str, param: str = "tool_choice"):
        super().__init__(message)
        self.param = param


def _function(tool: Any) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ForcedToolError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                              "\"parameters\": {...}}}", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ForcedToolError(f"tool {fn['name']!r}: parameters must be a JSON schema object", "tools")
    return fn


@dataclass(frozen=True)
class ForcedTool:
    name: str | None  # the named function; None for "required"

    @property
    def required(self) -> bool:
        return self.name is None

    def schema(self, tools: list[Any], parallel_tool_calls: bool = True) -> dict[str, Any]:
        """The JSON schema the reply must match. `parallel_tool_calls` false (OpenAI's "at most one call"):
        "required" allows exactly one."""
        functions = [_function(t) for t in tools]
        if self.name is not None:
            fn = next(f for f in functions if f["name"] == self.name)
            return fn.get("parameters") or dict(_EMPTY_OBJECT)
        defs: dict[str, Any] = {}
        branches = []
        for fn in functions:
            params = dict(fn.get("parameters") or _EMPTY_OBJECT)
            for def_name, def_schema in (params.pop("$defs", None) or {}).items():
                if defs.setdefault(def_name, def_schema) != def_schema:
                    raise ForcedToolError(f"tool definition {def_name!r} has multiple schemas, which is not "
                                          "supported", "tools")
            branches.append({"properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                            "parameters": params},
                             "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def calls(self, text: str, make_id: Callable[[], str] = make_tool_call_id) -> list[ToolCall] | None:
        """The tool calls of a whole reply. Named: always the one call, its arguments the text as generated
        (as vLLM; streamed the same way). Required: None when the text is not a complete call array (cut by
        max_tokens): it is then shown as content."""
        if self.name is not None:
            return [ToolCall(0, make_id(), self.name, text)]
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, list):
            return None
        out = []
        for i, call in enumerate(value):
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            out.append(ToolCall(i, make_id(), call["name"], json.dumps(call.get("parameters", {}),
                                                                        ensure_ascii=False)))
        return out


def forced_tool(tools: Any, tool_choice: Any) -> ForcedTool | None:
    """The forced call of a request, or None ("auto", "none", absent). ForcedToolError for a malformed
    named choice or a name that is not among the tools."""
    if tool_choice == "required":
        if not tools:
            raise ForcedToolError('tool_choice "required" needs a non-empty tools list')
        for t in tools:
            _function(t)
        return ForcedTool(None)
    if not isinstance(tool_choice, dict):
        return None
    fn = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ForcedToolError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
    names = [_function(t)["name"] for t in tools or []]
    if fn["name"] not in names:
        raise ForcedToolError(f"Tool {fn['name']!r} has not been passed in `tools`.")
    return ForcedTool(fn["name"])
