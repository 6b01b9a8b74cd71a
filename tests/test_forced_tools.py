"""tool_choice "required" and a named function, forced by structured outputs (vLLM's semantics), and vLLM's
structural_tag: the real `openai` SDK against `pdserve serve` on a tiny random model (whose free choice would
never be a valid call), streamed and not; the structural tag's grammar also token by token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from server_utils import MODEL, ServerProcess, all_ready, make_model_dir

from pdserve.text.forced_tools import ForcedTool

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"hour": {"enum": [6, 7, 8]}}, "required": ["hour"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
         {"type": "function", "function": {"name": "ping"}}]  # no parameters: {} only
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM, "ping": {"type": "object", "properties": {},
                                                                "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris for three days, and wake me at 7?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    model_dir: Path = make_model_dir(tmp_path_factory.mktemp("forced-model"))
    # a random model would pick JSON whitespace forever: the server-wide option README tells users about
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("forced-logs") / "serve.log",
                        "--structured-outputs-config", '{"disable_any_whitespace": true}')
    with all_ready({"serve": srv}):
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)


def streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """The tool calls of a stream, assembled as clients do (by index, arguments concatenated)."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or tc.id
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_named_function_is_a_valid_call(client: openai.OpenAI, stream: bool) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        calls, finish, content = streamed_calls(client.chat.completions.create(stream=True, **kw))
        assert not content and calls[0]["id"]
    else:
        msg = client.chat.completions.create(**kw).choices[0]
        finish = msg.finish_reason
        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in msg.message.tool_calls]
    assert finish == "stop" and len(calls) == 1 and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_is_one_or_more_valid_calls(client: openai.OpenAI, stream: bool) -> None:
    # parallel_tool_calls false: one call. Parallel: the random model would add calls until max_tokens, so
    # "]" is favoured (the grammar still decides where it may go)
    close = client.post("/../tokenize", body={"model": MODEL, "prompt": "]", "add_special_tokens": False},
                        cast_to=object)["tokens"]
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=150, temperature=0.8,
              seed=5, parallel_tool_calls=stream, logit_bias={str(close[0]): 30} if stream else None)
    if stream:
        calls, finish, _ = streamed_calls(client.chat.completions.create(stream=True, **kw))
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        finish = choice.finish_reason
        calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                 for t in choice.message.tool_calls]
    assert finish == "tool_calls" and calls and (stream or len(calls) == 1)
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tool_choice_errors(client: openai.OpenAI) -> None:
    for choice, fragment in (({"type": "function", "function": {"name": "nope"}}, "has not been passed"),
                             ({"type": "function"}, "named tool_choice")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice)
        assert fragment in err.value.body["message"] and err.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[], tool_choice="required")


def test_structural_tag(client: openai.OpenAI) -> None:
    """Free text until the trigger, then begin + JSON of the schema + end. The tiny model is pushed to the
    trigger with logit_bias (the grammar allows it anywhere in free text); after it the grammar decides."""
    at = client.post("/../tokenize", body={"model": MODEL, "prompt": "@", "add_special_tokens": False},
                     cast_to=object)["tokens"]
    assert len(at) == 1
    tag = {"type": "structural_tag", "triggers": ["@"],
           "structures": [{"begin": "@weather ", "schema": WEATHER, "end": " ;"}]}
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                                         response_format=tag, logit_bias={str(at[0]): 100})
    text = out.choices[0].message.content
    assert text.startswith("@weather ")
    body, end, _ = text[len("@weather "):].partition(" ;")
    assert end, text  # the structure closed
    jsonschema.validate(json.loads(body), WEATHER)


def test_structural_tag_grammar_token_by_token(tmp_path) -> None:
    """The matcher itself: text, then a tagged JSON, then text again; a tag with JSON off the schema is refused."""
    from pdserve.model.default_model import resolve_model
    from pdserve.structured.grammar import load_compiler
    from pdserve.text.tokenizer import load_tokenizer
    from pdserve.types.structured_params import StructuredOutputsParams

    path = resolve_model("smollm2-135m")
    tok = load_tokenizer(path)
    compiler = load_compiler(path, 49152, [2])
    spec = StructuredOutputsParams(structural_tag=json.dumps(
        {"type": "structural_tag", "triggers": ["<fn="],
         "structures": [{"begin": "<fn=weather>", "schema": WEATHER, "end": "</fn>"}]}))

    def accepts(text: str) -> bool:
        g = compiler.compile(spec)
        return all(g.accept(t) for t in tok.hf.encode(text, add_special_tokens=False))

    assert accepts('Let me look. <fn=weather>{"city": "Rome", "days": 2}</fn> Done.')
    assert not accepts('Let me look. <fn=weather>{"city": "Lima", "days": 2}</fn>')
    assert not accepts('<fn=weather>{"city": "Rome"}</fn>')


def test_required_schema_hoists_defs() -> None:
    tools = [{"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}}]
    schema = ForcedTool(None).schema(tools)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "a", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)


# ---- objects are strict by default (vLLM's default backend), relaxed by naming the guidance backend -------
OPEN_WEATHER = {k: v for k, v in WEATHER.items() if k != "additionalProperties"}  # says nothing about extra keys
OPEN_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": OPEN_WEATHER}},
              {"type": "function", "function": {"name": "set_alarm", "parameters": {
                  k: v for k, v in ALARM.items() if k != "additionalProperties"}}}]


def test_objects_are_closed_unless_the_schema_or_the_server_says_otherwise() -> None:
    from pdserve.model.default_model import resolve_model
    from pdserve.structured.grammar import close_objects, load_compiler
    from pdserve.text.tokenizer import load_tokenizer
    from pdserve.types.structured_params import StructuredOutputsParams

    path = resolve_model("smollm2-135m")
    tok = load_tokenizer(path)

    def accepts(compiler, schema, text: str, **spec: object) -> bool:
        g = compiler.compile(StructuredOutputsParams(json=schema, **spec))  # type: ignore[arg-type]
        return all(g.accept(t) for t in tok.hf.encode(text, add_special_tokens=False)) and g.stopped

    listed, extra = '{"city": "Rome", "days": 2}', '{"city": "Rome", "days": 2, "note": "x"}'
    nested = {"type": "object", "properties": {"where": OPEN_WEATHER}, "required": ["where"]}
    default = load_compiler(path, 49152, [2])  # no --structured-outputs-config: strict
    assert accepts(default, OPEN_WEATHER, listed) and not accepts(default, OPEN_WEATHER, extra)
    assert not accepts(default, nested, '{"where": ' + extra + "}")  # nested objects too
    assert accepts(default, {**OPEN_WEATHER, "additionalProperties": True}, extra)  # the schema says otherwise
    assert accepts(default, {**OPEN_WEATHER, "additionalProperties": {"type": "string"}}, extra)
    assert not accepts(default, {**OPEN_WEATHER, "additionalProperties": {"type": "integer"}}, extra)
    assert accepts(default, {"type": "object"}, '{"any": 1}')  # an object that lists nothing stays any object
    # vLLM's guidance backend by name: open, unless disable_additional_properties (server-wide or per request)
    guidance = load_compiler(path, 49152, [2], {"backend": "guidance"})
    assert accepts(guidance, OPEN_WEATHER, extra)
    assert not accepts(guidance, OPEN_WEATHER, extra, disable_additional_properties=True)
    closed = load_compiler(path, 49152, [2], {"backend": "guidance", "disable_additional_properties": True})
    assert not accepts(closed, OPEN_WEATHER, extra)
    # the walk reaches every subschema keyword, as vLLM's does
    walked = close_objects({"anyOf": [OPEN_WEATHER], "items": {"properties": {}}, "$defs": {"d": OPEN_WEATHER},
                            "patternProperties": {"^x": {"properties": {}}}})
    assert walked["anyOf"][0]["additionalProperties"] is False and walked["items"]["additionalProperties"] is False
    assert walked["$defs"]["d"]["additionalProperties"] is False and walked["additionalProperties"] is False
    assert walked["patternProperties"]["^x"]["additionalProperties"] is False
    assert "additionalProperties" not in OPEN_WEATHER  # the caller's schema is not changed


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_call_closes_on_schemas_that_do_not_close_themselves(client: openai.OpenAI, stream: bool) -> None:
    """Tool schemas without additionalProperties (as most clients send them): under tool_choice "required"
    the random model's call still ends where its schema does, and validates with every object closed. The
    model is pushed to wander (a "," favoured): with open objects it would add keys until max_tokens."""
    comma = client.post("/../tokenize", body={"model": MODEL, "prompt": ",", "add_special_tokens": False},
                        cast_to=object)["tokens"]
    kw = dict(model=MODEL, messages=ASK, tools=OPEN_TOOLS, tool_choice="required", max_tokens=80,
              temperature=0.8, seed=11, parallel_tool_calls=False, logit_bias={str(comma[0]): 30})
    if stream:
        calls, finish, _ = streamed_calls(client.chat.completions.create(stream=True, **kw))
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        finish = choice.finish_reason
        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in choice.message.tool_calls]
    assert finish == "tool_calls" and len(calls) == 1
    schema = {"get_weather": WEATHER, "set_alarm": ALARM}[calls[0]["name"]]  # the closed forms
    jsonschema.validate(json.loads(calls[0]["arguments"]), schema)
