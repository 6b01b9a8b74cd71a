"""What a request asks its output to match, with vLLM's field names (vllm/sampling_params.py
`StructuredOutputsParams`), and how the OpenAI request fields map onto it (vLLM's
`structured_outputs_from_response_format`). No torch, no grammar engine: the render tier imports this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.sampling_params import ParamError

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
# vLLM's pre-0.12 request fields, still sent by older clients and docs
LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern"}


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF/EBNF
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = field(default=None, repr=False)  # accepted by the schema, refused below

    def __post_init__(self) -> None:
        given = [c for c in CONSTRAINTS if getattr(self, c) is not None]
        if len(given) > 1:
            raise ParamError("You can only use one kind of structured outputs constraint but multiple are "
                             f"specified: {', '.join(given)}.", "structured_outputs")
        if not given:
            raise ParamError("You must use one kind of structured outputs constraint but none are specified "
                             f"(one of {', '.join(CONSTRAINTS[:-1])}).", "structured_outputs")
        if self.structural_tag is not None:
            raise ParamError("structured_outputs.structural_tag is not supported by this server.",
                             "structured_outputs")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ParamError("structured_outputs.json must be a JSON schema (an object or its JSON text).",
                             "structured_outputs")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ParamError("structured_outputs.regex must be a string.", "structured_outputs")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ParamError("structured_outputs.grammar must be a string.", "structured_outputs")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ParamError("structured_outputs.choice must be a non-empty list of strings.", "structured_outputs")
        if self.json_object is not None and self.json_object is not True:
            raise ParamError("structured_outputs.json_object must be true when given.", "structured_outputs")

    @property
    def kind(self) -> str:
        return next(c for c in CONSTRAINTS if getattr(self, c) is not None)

    def key(self) -> str:
        """A stable text of the whole spec (compiled grammars are cached by it)."""
        spec = {c: getattr(self, c) for c in (*CONSTRAINTS, *OPTIONS) if getattr(self, c) not in (None, False)}
        return json.dumps(spec, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any, param: str = "structured_outputs") -> StructuredOutputsParams:
        if isinstance(data, StructuredOutputsParams):
            return data
        if not isinstance(data, dict):
            raise ParamError(f"{param} must be an object.", param)
        known = {k: v for k, v in data.items() if k in (*CONSTRAINTS, *OPTIONS)}
        for flag in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(known.get(flag, False), bool):
                raise ParamError(f"{param}.{flag} must be a boolean.", param)
        if known.get("whitespace_pattern") is not None and not isinstance(known["whitespace_pattern"], str):
            raise ParamError(f"{param}.whitespace_pattern must be a string.", param)
        try:
            return cls(**known)
        except ParamError as e:
            raise ParamError(str(e), param) from None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (*CONSTRAINTS, *OPTIONS) if getattr(self, k) not in (None, False)}


def from_openai_request(structured_outputs: Any, response_format: Any,
                        legacy: dict[str, Any] | None = None) -> StructuredOutputsParams | None:
    """The constraint of an OpenAI-style request: `structured_outputs` (vLLM), overridden by
    `response_format` (`json_object`, or `json_schema` with its `schema`), as vLLM merges them; vLLM's old
    `guided_*` fields count as `structured_outputs` when that is absent. None for plain text."""
    spec: dict[str, Any] = dict(structured_outputs) if isinstance(structured_outputs, dict) else {}
    if structured_outputs is not None and not isinstance(structured_outputs, dict):
        raise ParamError("structured_outputs must be an object.", "structured_outputs")
    if structured_outputs is None and legacy:
        spec = {LEGACY_FIELDS[k]: v for k, v in legacy.items() if k in LEGACY_FIELDS and v is not None}
    rf_type = _get(response_format, "type")
    if rf_type not in (None, "text"):
        for c in CONSTRAINTS:
            spec.pop(c, None)
        if rf_type == "json_object":
            spec["json_object"] = True
        elif rf_type == "json_schema":
            js = _get(response_format, "json_schema")
            if js is None:
                raise ParamError("When response_format type is 'json_schema', the 'json_schema' field must be "
                                 "provided.", "response_format")
            schema = _get(js, "schema")
            if schema is None:
                schema = _get(js, "json_schema")  # pydantic models keep OpenAI's `schema` under this name
            if not isinstance(schema, (dict, str)):
                raise ParamError("response_format.json_schema.schema must be a JSON schema object.",
                                 "response_format")
            spec["json"] = schema
        else:
            raise ParamError(f"response_format type {rf_type!r} is not supported (text, json_object, "
                             "json_schema).", "response_format")
    if not spec:
        return None
    return StructuredOutputsParams.from_dict(spec, "response_format" if rf_type not in (None, "text")
                                             else "structured_outputs")


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)
