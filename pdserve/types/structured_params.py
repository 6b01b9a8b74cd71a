"""What a request asks its output to match, with vLLM's field names (vllm/sampling_params.py
`StructuredOutputsParams`), and how the OpenAI request fields map onto it (vLLM's
`structured_outputs_from_response_format`). No torch, no grammar engine: the render tier imports this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.types.param_error import ParamError

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
    # vLLM's legacy structural tag, as JSON text: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
    # (free text until a trigger; then begin + JSON matching the schema + end; see structural_tags())
    structural_tag: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        given = [c for c in CONSTRAINTS if getattr(self, c) is not None]
        if len(given) > 1:
            raise ParamError("You can only use one kind of structured outputs constraint but multiple are "
                             f"specified: {', '.join(given)}.", "structured_outputs")
        if not given:
            raise ParamError("You must use one kind of structured outputs constraint but none are specified "
                             f"(one of {', '.join(CONSTRAINTS[:-1])}).", "structured_outputs")
        if self.structural_tag is not None:
            structural_tags(self.structural_tag)  # well-formed, or a ParamError
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
        elif rf_type == "structural_tag":
            spec["structural_tag"] = json.dumps(_as_dict(response_format))  # as vLLM passes it on
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
                             "json_schema, structural_tag).", "response_format")
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


def _as_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, dict):
        return obj
    dump = getattr(obj, "model_dump", None)
    return dump(exclude_none=True) if dump is not None else dict(vars(obj))


def structural_tags(text: str) -> list[tuple[str, str, dict[str, Any], str]]:
    """(trigger, begin, schema, end) of each structure of a structural tag (vLLM's legacy
    `{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}`, the form
    vLLM's guidance backend serves); each structure's trigger is the trigger its `begin` starts with.
    ParamError for anything else, including xgrammar's newer `{"format": ...}` form."""
    param = "structured_outputs"
    try:
        tag = json.loads(text)
    except (TypeError, ValueError) as e:
        raise ParamError(f"structural_tag must be JSON: {e}", param) from None
    if not isinstance(tag, dict):
        raise ParamError("structural_tag must be a JSON object.", param)
    if "format" in tag and "structures" not in tag:
        raise ParamError("structural_tag: only the structures/triggers form is supported by this server "
                         "(vLLM's guidance backend serves the same), not xgrammar's \"format\" form.", param)
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if (not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers
            or not all(isinstance(t, str) and t for t in triggers)):
        raise ParamError("structural_tag needs a non-empty `structures` list and a non-empty `triggers` list "
                         "of strings.", param)
    out = []
    for s in structures:
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise ParamError("each structural_tag structure is {\"begin\": str, \"schema\": {...}, \"end\": str}.",
                             param)
        schema = s.get("schema")
        if schema is None:
            schema = {}
        if not isinstance(schema, dict):
            raise ParamError("a structural_tag structure's schema must be a JSON schema object.", param)
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ParamError(f"structural_tag: the begin {s['begin']!r} starts with none of the triggers "
                             f"{triggers}.", param)
        out.append((trigger, s["begin"], schema, s["end"]))
    return out
