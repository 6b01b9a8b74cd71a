"""`pdserve serve` end to end: a real server process on 127.0.0.1, driven with the real `openai` SDK.

One server for the module (tiny random-weight Llama + the embedded SmolLM2 tokenizer and chat template).
Greedy outputs must equal the offline engine's (`pdserve.llm.LLM`) on the same folder.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import MODEL, ServerProcess, make_model_dir, metric_value, wait_idle

from pdserve.types.sampling_params import SamplingParams

MAX_MODEL_LEN = 128
NUM_BLOCKS = 256


# ---- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("server-model"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    srv = ServerProcess(model_dir, log, "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override",
                        str(NUM_BLOCKS), "--max-request-body-bytes", "200000")
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, f"server exit code {code}:\n{srv.log()}"


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model_dir: Path):
    from pdserve.llm import LLM

    return LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=NUM_BLOCKS)


PROMPTS = ["Hello world", "The capital of France is", "1 2 3 4"]


# ---- completions ------------------------------------------------------------------------------------
def test_completions_match_offline_engine(client: openai.OpenAI, offline) -> None:
    ref = offline.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    res = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert [c.index for c in res.choices] == [0, 1, 2]
    for choice, r in zip(res.choices, ref, strict=True):
        assert choice.text == r.outputs[0].text
        assert choice.token_ids == r.outputs[0].token_ids
        assert choice.prompt_token_ids == r.prompt_token_ids
        assert choice.finish_reason == r.outputs[0].finish_reason == "length"
    assert res.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert res.usage.completion_tokens == 36
    # token-id prompts (one and several) give the same outputs
    ids = [r.prompt_token_ids for r in ref]
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=12, temperature=0)
    assert one.choices[0].text == ref[0].outputs[0].text
    many = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in many.choices] == [r.outputs[0].text for r in ref]


def test_completions_stream_equals_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_async_client_concurrent_streams(server: ServerProcess, client: openai.OpenAI) -> None:
    expected = [client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text
                for p in PROMPTS]

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as ac:
            async def one(p: str) -> str:
                stream = await ac.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                                     stream=True)
                return "".join([c.choices[0].text async for c in stream if c.choices])

            return await asyncio.gather(*(one(p) for p in PROMPTS * 3))

    assert asyncio.run(run()) == expected * 3


def test_stop_strings(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    assert stop.strip(), base
    cut = base[: base.index(stop)]
    for stream in (False, True):
        kwargs = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "stop": [stop],
                  "extra_body": {"ignore_eos": True}}
        if stream:
            chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
            text = "".join(c.choices[0].text for c in chunks)
            last = chunks[-1].choices[0]
        else:
            last = client.completions.create(**kwargs).choices[0]
            text = last.text
        assert text == cut
        assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop
    inc = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop,
                                    extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert inc.choices[0].text == cut + stop


def test_logprobs_echo_and_n(client: openai.OpenAI) -> None:
    res = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == res.choices[0].text
    assert all(len(t) <= 4 and all(v <= 0 for v in t.values()) for t in lp.top_logprobs)
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPTS[0] + res.choices[0].text
    many = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=1.0, n=2, seed=7)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    again = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=1.0, n=2, seed=7)
    assert [c.text for c in many.choices] == [c.text for c in again.choices]  # seeded: reproducible
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, n=3)
    assert len({c.text for c in greedy.choices}) == 1


def test_penalties_match_offline_engine(client: openai.OpenAI, offline) -> None:
    kw = {"max_tokens": 16, "temperature": 0, "presence_penalty": 0.4, "frequency_penalty": 0.3}
    ref = offline.generate(PROMPTS, SamplingParams(**kw, repetition_penalty=1.3))
    res = client.completions.create(model=MODEL, prompt=PROMPTS, **kw,
                                    extra_body={"repetition_penalty": 1.3, "return_token_ids": True})
    assert [c.token_ids for c in res.choices] == [r.outputs[0].token_ids for r in ref]
    plain = offline.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0))
    assert [r.outputs[0].token_ids for r in ref] != [r.outputs[0].token_ids for r in plain]


def test_logit_bias_and_allowed_token_ids(client: openai.OpenAI) -> None:
    forced = 4242
    res = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                    logit_bias={str(forced): 100},
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert res.choices[0].token_ids == [forced] * 6
    allowed = [300, 301, 302, 4242]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=12, temperature=1.0,
                                          seed=5, extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                                                              "return_token_ids": True})
    ids = chat.choices[0].model_extra["token_ids"]
    assert len(ids) == 12 and set(ids) <= set(allowed)


# ---- chat -------------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]


def test_chat_matches_offline_engine(client: openai.OpenAI, offline) -> None:
    ids = offline.tokenizer.encode_chat(MESSAGES)
    ref = offline.generate([ids], SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
    res = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == ref.text
    assert res.model_extra["prompt_token_ids"] == ids
    assert res.choices[0].model_extra["token_ids"] == ref.token_ids
    assert res.usage.prompt_tokens == len(ids)
    # a proxy-provided prompt (kv_transfer_params.prompt_token_ids) skips templating, same result
    other = [{"role": "user", "content": "something else entirely"}]
    via_ids = client.chat.completions.create(model=MODEL, messages=other, max_tokens=10, temperature=0,
                                             extra_body={"kv_transfer_params": {"prompt_token_ids": ids}})
    assert via_ids.choices[0].message.content == ref.text


def test_chat_stream(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 logprobs=True, top_logprobs=2))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    lps = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(lps) == 12 and all(len(e.top_logprobs) == 2 for e in lps)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_template_kwargs_and_continue(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well"}]
    res = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                         extra_body={"add_generation_prompt": False,
                                                     "continue_final_message": True, "echo": True})
    assert res.choices[0].message.content.startswith("Well")
    bad = httpx.post(f"{client.base_url}chat/completions", json={
        "messages": msgs, "add_generation_prompt": True, "continue_final_message": True})
    assert bad.status_code == 400


# ---- utility routes, ids --------------------------------------------------------------------------
def test_models_tokenize_detokenize(server: ServerProcess, offline) -> None:
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    tok = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Hello there"}).json()
    assert tok["tokens"] == offline.tokenizer.encode("Hello there") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()
    assert back == {"prompt": "Hello there"}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == offline.tokenizer.encode_chat(MESSAGES)
    assert httpx.get(f"{server.url}/version").json()["version"]
    info = httpx.get(f"{server.url}/pdserve/info").json()
    assert info["served_model_name"] == MODEL and info["max_model_len"] == MAX_MODEL_LEN
    assert info["num_layers"] == 2 and info["num_kv_heads"] == 2 and info["head_dim"] == 16
    assert info["device"] == "cpu" and info["gpu_uuid"] is None and "cuda_visible_devices" in info


def test_request_id_header(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "my-id-1"},
                   json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-1"
    assert r.json()["id"] == "cmpl-my-id-1"
    c = httpx.post(f"{server.url}/v1/chat/completions", headers={"X-Request-Id": "my-id-2",
                                                                 "Authorization": "Bearer None"},
                   json={"messages": MESSAGES, "max_tokens": 2})
    assert c.status_code == 200 and c.json()["id"] == "chatcmpl-my-id-2"
    generated = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert generated.json()["id"] == f"cmpl-{generated.headers['x-request-id']}"


def test_metrics(server: ServerProcess) -> None:
    text = wait_idle(server.url)
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"):
        assert metric_value(text, name) >= 0
    assert metric_value(text, "vllm:generation_tokens_total") > 0
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}' in text


# ---- errors -----------------------------------------------------------------------------------------
def _post(url: str, path: str, body: object, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60,
                      **kw)


ERROR_CASES = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi " * 400}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1000000": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5, 1000000]}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": "x" * 300000}, 413, None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "presence_penalty": -3}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"1.5": 2}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": MESSAGES, "allowed_token_ids": [-1]}, 400, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "kv_transfer_params": {"prompt_token_ids": [1, True]}},
     400, "kv_transfer_params.prompt_token_ids"),
    ("/v1/chat/completions", {"messages": MESSAGES, "kv_transfer_params": {"prompt_token_ids": []}},
     400, "kv_transfer_params.prompt_token_ids"),
    ("/v1/chat/completions", {"messages": MESSAGES, "kv_transfer_params": {"prompt_token_ids": [99999999]}},
     400, "kv_transfer_params.prompt_token_ids"),
    ("/tokenize", {"model": MODEL}, 400, None),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), ERROR_CASES)
def test_client_errors(server: ServerProcess, path: str, body: object, status: int, param: str | None) -> None:
    r = _post(server.url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_sdk_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="unknown", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)


# ---- disconnects ------------------------------------------------------------------------------------
ABORTED = 'vllm:request_success_total{engine="0",finished_reason="abort"'


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_frees_blocks(server: ServerProcess, path: str) -> None:
    before = metric_value(wait_idle(server.url), ABORTED)
    body: dict = {"max_tokens": MAX_MODEL_LEN - 40, "ignore_eos": True, "stream": True, "temperature": 0}
    body.update({"prompt": "a long story"} if "chat" not in path else {"messages": MESSAGES})
    with httpx.Client(timeout=30) as hc, hc.stream("POST", f"{server.url}{path}", json=body) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 3:
                break
    after = wait_idle(server.url)  # nothing running, KV usage back to 0
    assert metric_value(after, ABORTED) == before + 1


def test_disconnect_before_the_response(server: ServerProcess) -> None:
    before = metric_value(wait_idle(server.url), ABORTED)
    body = json.dumps({"prompt": "x", "max_tokens": MAX_MODEL_LEN - 10, "ignore_eos": True, "n": 8,
                       "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # close only once the engine runs the request
            if metric_value(httpx.get(f"{server.url}/metrics").text, "vllm:num_requests_running") > 0:
                break
            time.sleep(0.01)
    after = wait_idle(server.url)
    assert metric_value(after, ABORTED) == before + 8  # all eight choices
    assert httpx.get(f"{server.url}/health").status_code == 200


# ---- fuzzing ----------------------------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_WEIRD = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.integers(-3, 40),
    st.floats(allow_nan=False, allow_infinity=False), st.floats(-2, 3), st.text(max_size=20),
    st.lists(st.integers(-5, 60000), max_size=6), st.lists(st.text(max_size=5), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
_COMMON = {
    "model": st.one_of(st.just(MODEL), _WEIRD),
    "max_tokens": st.one_of(st.integers(-2, 40), _WEIRD),
    "temperature": st.one_of(st.floats(0, 2), _WEIRD),
    "top_p": _WEIRD, "top_k": _WEIRD, "min_p": _WEIRD, "seed": _WEIRD, "n": st.sampled_from([-1, 0, 1, 2, 10**9, "x"]),
    "stop": _WEIRD, "stop_token_ids": _WEIRD, "ignore_eos": _WEIRD, "min_tokens": _WEIRD, "logprobs": _WEIRD,
    "stream": st.booleans(), "stream_options": st.one_of(st.just({"include_usage": True}), _WEIRD),
    "skip_special_tokens": _WEIRD, "include_stop_str_in_output": _WEIRD, "return_token_ids": _WEIRD,
    "kv_transfer_params": st.one_of(st.none(), st.dictionaries(st.sampled_from(
        ["do_remote_decode", "do_remote_prefill", "prompt_token_ids", "remote_block_ids"]), _WEIRD, max_size=3)),
    "truncate_prompt_tokens": _WEIRD, "echo": _WEIRD, "unknown_field": _WEIRD,
    "presence_penalty": st.one_of(st.floats(-3, 3), _WEIRD), "frequency_penalty": st.one_of(st.floats(-3, 3), _WEIRD),
    "repetition_penalty": st.one_of(st.floats(0, 3), _WEIRD),
    "logit_bias": st.one_of(st.dictionaries(st.integers(-3, 60000).map(str), st.floats(-300, 300), max_size=3),
                            _WEIRD),
    "allowed_token_ids": _WEIRD,
}
_PROMPT = st.one_of(st.text(max_size=40), st.lists(st.integers(-3, 60000), max_size=8),
                    st.lists(st.text(max_size=10), max_size=3), st.lists(st.lists(st.integers(-1, 60000), max_size=4),
                                                                         max_size=3), _WEIRD)
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                           "content": st.one_of(st.text(max_size=30), st.none(),
                                                st.lists(st.fixed_dictionaries({"type": st.sampled_from(
                                                    ["text", "image_url"]), "text": _WEIRD}), max_size=2))}),
    _WEIRD,
)
_COMPLETION_BODY = st.fixed_dictionaries({"prompt": _PROMPT}, optional=_COMMON)
_CHAT_BODY = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(_MESSAGE, max_size=3), _WEIRD)},
    optional={**_COMMON, "logprobs": _WEIRD, "top_logprobs": _WEIRD, "max_completion_tokens": _WEIRD,
              "add_generation_prompt": _WEIRD, "continue_final_message": _WEIRD, "chat_template_kwargs": _WEIRD,
              "tools": _WEIRD, "tool_choice": _WEIRD},
)


def _check_no_5xx(url: str, path: str, body: dict) -> None:
    with httpx.Client(timeout=60) as hc:
        r = hc.post(f"{url}{path}", json=body)
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["code"] == r.status_code and isinstance(err["message"], str)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
        assert not any('"error"' in e[:12] for e in events), r.text
    else:
        assert r.json()["choices"]


_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(body=_COMPLETION_BODY)
def test_fuzz_completions(server: ServerProcess, body: dict) -> None:
    _check_no_5xx(server.url, "/v1/completions", body)


@_FUZZ
@given(body=_CHAT_BODY)
def test_fuzz_chat(server: ServerProcess, body: dict) -> None:
    _check_no_5xx(server.url, "/v1/chat/completions", body)


@settings(max_examples=20, deadline=None)
@given(raw=st.binary(max_size=200))
def test_fuzz_raw_bodies(server: ServerProcess, raw: bytes) -> None:
    r = httpx.post(f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500


def test_healthy_after_fuzzing(server: ServerProcess, client: openai.OpenAI) -> None:
    wait_idle(server.url)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3
