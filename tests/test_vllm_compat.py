"""`pdserve serve` as a vLLM user drives it: the OpenAI quickstart snippets from vLLM's docs run as-is
(only the base URL points here), a request without a model name is served by the default model, and a
wrong name's 404 lists the served names.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import PdserveProcess, free_port, make_model_dir

SERVED = "Qwen/Qwen2.5-1.5B-Instruct"  # the name vLLM's quickstart uses; served here by a tiny model
ALIAS = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[PdserveProcess]:
    model_dir = make_model_dir(tmp_path_factory.mktemp("compat-model"))
    port = free_port()
    srv = PdserveProcess(tmp_path_factory.mktemp("compat-log") / "server.log", port, [
        "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED, ALIAS,
        "--max-model-len", "512", "--num-gpu-blocks-override", "256", "--disable-uvicorn-access-log"])
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
