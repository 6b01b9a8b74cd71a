"""`pdserve serve` as a vLLM user drives it: the OpenAI quickstart snippets from vLLM's docs run as-is
(only the base URL points here), a request without a model name is served by the default model, a wrong
name's 404 lists the served names, and structured outputs (`response_format`, `structured_outputs`, the
old `guided_*` fields) give output that matches, streamed or not, with the real `openai` client.

The model has random weights: whatever the grammar allows is as likely as anything else, so the server
runs with `disable_any_whitespace` (vLLM's --structured-outputs-config) and the schemas bound every
string, array and number (pdserve/testing/json_schemas.py); a trained model needs neither.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from server_utils import PdserveProcess, free_port, make_model_dir

from pdserve.testing.json_schemas import SCHEMAS

SERVED = "Qwen/Qwen2.5-1.5B-Instruct"  # the name vLLM's quickstart uses; served here by a tiny model
ALIAS = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[PdserveProcess]:
    model_dir = make_model_dir(tmp_path_factory.mktemp("compat-model"))
    port = free_port()
    srv = PdserveProcess(tmp_path_factory.mktemp("compat-log") / "server.log", port, [
        "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED, ALIAS,
        "--max-model-len", "512", "--num-gpu-blocks-override", "512", "--disable-uvicorn-access-log",
        "--structured-outputs-config", '{"disable_any_whitespace": true}'])
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: PdserveProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


OPENAI_QUICKSTART = textwrap.dedent('''
    from openai import OpenAI

    # Modify OpenAI's API key and API base to use vLLM's API server.
    openai_api_key = "EMPTY"
    openai_api_base = BASE

    client = OpenAI(
        api_key=openai_api_key,
        base_url=openai_api_base,
    )
    completion = client.completions.create(model="Qwen/Qwen2.5-1.5B-Instruct",
                                          prompt="San Francisco is a")
    print("Completion result:", completion)

    chat_response = client.chat.completions.create(
        model="Qwen/Qwen2.5-1.5B-Instruct",
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Tell me a joke."},
        ]
    )
    print("Chat response:", chat_response)

    models = client.models.list()
    model = models.data[0].id
    stream = client.chat.completions.create(model=model, stream=True, max_tokens=8,
                                            messages=[{"role": "user", "content": "Hi"}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
''')


def test_openai_quickstart_runs_as_is(server: PdserveProcess, tmp_path: Path) -> None:
    script = tmp_path / "quickstart_client.py"
    script.write_text(f"BASE = {server.url + '/v1'!r}\n" + OPENAI_QUICKSTART)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=os.environ.copy(), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Completion result: Completion(" in proc.stdout and "Chat response: ChatCompletion(" in proc.stdout


def test_empty_or_missing_model_is_the_default(server: PdserveProcess, client: openai.OpenAI) -> None:
    res = client.completions.create(model="", prompt="Hello", max_tokens=3, temperature=0)
    assert res.model == SERVED and res.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.model == SERVED
    for path, body in (("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
                       ("/tokenize", {"prompt": "Hello"})):
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
    alias = client.completions.create(model=ALIAS, prompt="Hello", max_tokens=2)
    assert alias.model == ALIAS


def test_wrong_model_lists_served_names(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="Hello", max_tokens=2)
    message = err.value.body["message"]
    assert message.startswith("The model `gpt-4o` does not exist.")  # vLLM's words first
    assert SERVED in message and ALIAS in message


# ---- structured outputs ------------------------------------------------------------------------------
ASK = [{"role": "user", "content": "Reply in JSON."}]


def chat_json(client: openai.OpenAI, name: str, schema: dict, **kw) -> str:
    res = client.chat.completions.create(
        model=SERVED, messages=ASK, max_tokens=400, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        **kw)
    assert res.choices[0].finish_reason == "stop", res.choices[0]
    return res.choices[0].message.content


def test_json_schema_outputs_are_valid(client: openai.OpenAI) -> None:
    """Twenty schemas at once (one batch mixes twenty grammars): every answer parses and validates."""
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        texts = list(pool.map(lambda c: chat_json(client, c[0], c[1]), SCHEMAS))
    for (_, schema, _), text in zip(SCHEMAS, texts, strict=True):
        jsonschema.validate(json.loads(text), schema)
    # greedy and deterministic: the same answer alone as in the crowd
    assert chat_json(client, SCHEMAS[4][0], SCHEMAS[4][1]) == texts[4]


def test_json_schema_streamed(client: openai.OpenAI) -> None:
    name, schema, _ = SCHEMAS[17]
    stream = client.chat.completions.create(
        model=SERVED, messages=ASK, max_tokens=400, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    text = "".join(pieces)
    jsonschema.validate(json.loads(text), schema)
    assert text == chat_json(client, name, schema)


def test_completions_regex_choice_grammar(client: openai.OpenAI) -> None:
    regex = r"[a-z]{2,6}@(example|test)\.(com|org)"
    for seed in range(4):
        out = client.completions.create(model=SERVED, prompt="Email:", max_tokens=40, temperature=1.0, seed=seed,
                                        extra_body={"structured_outputs": {"regex": regex}})
        assert re.fullmatch(regex, out.choices[0].text), out.choices[0].text
    choices = ["positive", "negative", "neutral"]
    got = {client.completions.create(model=SERVED, prompt=f"Sentiment {i}:", max_tokens=10, temperature=1.0, seed=i,
                                     extra_body={"structured_outputs": {"choice": choices}}).choices[0].text
           for i in range(6)}
    assert got <= set(choices)
    lark = 'start: NUM " + " NUM " = " NUM\nNUM: /[0-9]{1,3}/'
    out = client.completions.create(model=SERVED, prompt="Sum:", max_tokens=30, temperature=0.7, seed=3,
                                    extra_body={"structured_outputs": {"grammar": lark}})
    assert re.fullmatch(r"[0-9]{1,3} \+ [0-9]{1,3} = [0-9]{1,3}", out.choices[0].text), out.choices[0].text
    gbnf = 'root ::= "yes" | "no"'
    out = client.completions.create(model=SERVED, prompt="Ok?", max_tokens=5, temperature=0,
                                    extra_body={"structured_outputs": {"grammar": gbnf}})
    assert out.choices[0].text in ("yes", "no")


def test_chat_choice_with_n_and_legacy_field(client: openai.OpenAI) -> None:
    choices = ["alpha", "beta", "gamma", "delta"]
    res = client.chat.completions.create(model=SERVED, messages=ASK, n=4, max_tokens=10, temperature=1.0, seed=5,
                                         extra_body={"structured_outputs": {"choice": choices}})
    assert len(res.choices) == 4 and all(c.message.content in choices for c in res.choices)
    legacy = client.chat.completions.create(model=SERVED, messages=ASK, max_tokens=10, temperature=0,
                                            extra_body={"guided_choice": choices})
    assert legacy.choices[0].message.content in choices


def test_json_object(server: PdserveProcess, client: openai.OpenAI) -> None:
    """`json_object`: any object. A random model would ramble inside keys forever; a bias towards "}" lets
    it close the object at once, which only the grammar can make the first thing after "{"."""
    close = httpx.post(f"{server.url}/tokenize", json={"prompt": "}", "add_special_tokens": False}).json()["tokens"]
    res = client.chat.completions.create(model=SERVED, messages=ASK, max_tokens=20, temperature=0,
                                         response_format={"type": "json_object"}, logit_bias={str(close[0]): 60})
    assert isinstance(json.loads(res.choices[0].message.content), dict)
    assert res.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("extra, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "strin"),
    ({"structured_outputs": {"regex": "[a-"}}, "regex"),
    ({"structured_outputs": {"grammar": "start: ???"}}, "rammar"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a+"}}, "one kind"),
    ({"structured_outputs": {"choice": []}}, "choice"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "none are specified"),
    ({"response_format": {"type": "json_schema"}}, "'json_schema' field must be provided"),
    ({"response_format": {"type": "structural_tag"}}, "non-empty `structures`"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}}, "structures/triggers"),
])
def test_invalid_constraints_are_400s(client: openai.OpenAI, extra: dict, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=SERVED, messages=ASK, max_tokens=5, extra_body=extra)
    assert fragment in err.value.body["message"], err.value.body
