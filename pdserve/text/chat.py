"""Chat messages as the template sees them: content-format detection and message normalisation.

Templates come in two kinds, as vLLM distinguishes them: "string" templates concatenate
`message['content']` as text, "openai" templates iterate over a list of content parts. A request may
send either form; it is converted to what the template expects.
"""

from __future__ import annotations

import contextlib
import json
from functools import lru_cache
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]


class ChatTemplateError(ValueError):
    """A chat request the template cannot render; a client mistake (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@lru_cache(maxsize=32)
def detect_content_format(template: str | None) -> ContentFormat:
    """"openai" when the template loops over a message's content, else "string"."""
    if not template:
        return "string"
    try:
        import jinja2
        from jinja2 import nodes

        ast = jinja2.Environment().parse(template)
    except Exception:  # noqa: BLE001 - a template jinja cannot parse fails later with a clear error
        return "string"

    def is_content(sub: nodes.Node) -> bool:
        if isinstance(sub, nodes.Getattr):
            return sub.attr == "content"
        if isinstance(sub, nodes.Getitem):
            return isinstance(sub.arg, nodes.Const) and sub.arg.value == "content"
        return isinstance(sub, nodes.Name) and sub.name == "content"

    def names_content(node: nodes.Node) -> bool:
        return is_content(node) or any(is_content(s) for s in node.find_all((nodes.Getitem, nodes.Getattr)))

    for loop in ast.find_all(nodes.For):
        if names_content(loop.iter):
            return "openai"
    return "string"


def _text_parts(content: list[Any], index: int) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            raise ChatTemplateError(f"{where} must be an object", "messages")
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text", "refusal"):
            key = "refusal" if kind == "refusal" else "text"
            text = part.get(key)
            if not isinstance(text, str):
                raise ChatTemplateError(f"{where}.{key} must be a string", "messages")
            parts.append({"type": "text", "text": text})
        else:
            raise ChatTemplateError(f"{where}: content parts of type {kind!r} are not supported", "messages")
    return parts


def _tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ChatTemplateError(f"messages[{index}].tool_calls must be a list", "messages")
    out: list[dict[str, Any]] = []
    for call in calls:
        if not isinstance(call, dict):
            raise ChatTemplateError(f"messages[{index}].tool_calls entries must be objects", "messages")
        call = dict(call)
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            fn = dict(fn)
            with contextlib.suppress(ValueError):  # templates expect a mapping (they render it with tojson)
                fn["arguments"] = json.loads(fn["arguments"])
            call["function"] = fn
        out.append(call)
    return out


def prepare_messages(messages: Any, content_format: ContentFormat) -> list[dict[str, Any]]:
    """Validates the messages and converts their content to the template's format."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object", "messages")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string", "messages")
        item = dict(msg)
        content = msg.get("content")
        if content is None:
            parts: list[dict[str, Any]] = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = _text_parts(content, i)
        else:
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of parts", "messages")
        if content_format == "string":
            item["content"] = "\n".join(p["text"] for p in parts)
        else:
            item["content"] = parts
        if msg.get("tool_calls") is not None:
            item["tool_calls"] = _tool_calls(msg["tool_calls"], i)
        out.append(item)
    return out


def message_text(message: Any) -> str:
    """The text of one message's content (for chat `echo`)."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in _text_parts(content, 0))
    return ""
