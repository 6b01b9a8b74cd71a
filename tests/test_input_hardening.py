"""Bad input to the command lines and servers: one clear line (exit 2 for usage, 1 for the environment), no
traceback, checked before the model is loaded; oversized prompts refused before tokenization; `pdserve plan`
against a live instance uses its real KV dtype."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import MODEL, ServerProcess, free_port, make_model_dir

from pdserve.model.config import derived_max_model_len, verify_max_model_len

CLI_TIMEOUT_S = 180


def pdserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, env={**os.environ, **(env or {})})


def one_error_line(out: subprocess.CompletedProcess[str], prefix: str) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("hardening"))  # max_position_embeddings=512


@pytest.mark.parametrize("args, expected", [
    (["--model", "no-such-model", "hi"], "cannot resolve model 'no-such-model'"),
    (["--max-tokens", "-1", "hi"], "max_tokens must be at least 1"),
    (["--top-p", "0", "hi"], "top_p must be in (0, 1]"),
    (["--dtype", "int8", "hi"], "dtype must be one of"),
    (["--device", "tpu", "hi"], "is not a device"),
])
def test_generate_bad_input_is_one_line_exit_2(args: list[str], expected: str) -> None:
    out = pdserve("generate", *args)
    assert out.returncode == 2
    assert expected in one_error_line(out, "pdserve generate: error:")


def test_generate_cuda_without_cuda_is_one_line_exit_2() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = pdserve("generate", "--device", "cuda", "hi")
    assert out.returncode == 2
    assert "CUDA is not available" in one_error_line(out, "pdserve generate: error:")


def test_max_model_len_above_the_model_is_refused_like_vllm(model_dir: Path) -> None:
    out = pdserve("serve", str(model_dir), "--port", str(free_port()), "--max-model-len", "100000")
    assert out.returncode == 1
    line = one_error_line(out, "pdserve serve: error:")
    assert "100000" in line and "512" in line and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in line
    # The rule itself (vllm/config/model.py): allowed with the env var, with a warning; linear RoPE scaling
    # extends the derived length; llama3 scaling does not (its max_position_embeddings is the scaled one).
    assert verify_max_model_len(None, 512) == 512 and verify_max_model_len(300, 512) == 300
    assert verify_max_model_len(100000, 512, env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}) == 100000
    with pytest.raises(ValueError, match="at least 2"):
        verify_max_model_len(1, 512)
    assert derived_max_model_len(512, {"rope_type": "linear", "factor": 4.0}) == 2048
    assert derived_max_model_len(512, {"rope_type": "llama3", "factor": 8.0}) == 512


def test_render_refuses_max_model_len_above_the_model_too(model_dir: Path) -> None:
    out = pdserve("render", str(model_dir), "--port", str(free_port()), "--max-model-len", "100000")
    assert out.returncode == 1
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in one_error_line(out, "pdserve render: error:")


def test_busy_ports_fail_before_the_model_is_loaded(tmp_path: Path) -> None:
    """The model folder does not even exist: the port problem is reported first, so nothing was loaded."""
    missing = str(tmp_path / "not-a-model")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out = pdserve("serve", missing, "--port", str(port))
        assert out.returncode == 1
        assert f"--port: 127.0.0.1:{port} is not free" in one_error_line(out, "pdserve serve: error:")
        producer = '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
        out = pdserve("serve", missing, "--port", str(free_port()), "--kv-transfer-config", producer,
                      "--side-channel-port", str(port))
        assert out.returncode == 1
        line = one_error_line(out, "pdserve serve: error:")
        assert f"KV side channel: 127.0.0.1:{port} is not free" in line and "--side-channel-port" in line
        # the default side-channel port, as a second producer on one host meets it
        out = pdserve("serve", missing, "--port", str(free_port()), "--kv-transfer-config", producer,
                      env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)})
        assert out.returncode == 1 and "KV side channel" in one_error_line(out, "pdserve serve: error:")
        out = pdserve("render", missing, "--port", str(port))
        assert out.returncode == 1
        assert f"--port: 127.0.0.1:{port} is not free" in one_error_line(out, "pdserve render: error:")
    out = pdserve("serve", missing, "--port", str(free_port()))  # the port is free: now the model is the problem
    assert out.returncode == 1 and "not-a-model" in one_error_line(out, "pdserve serve: error:")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("hardening-logs") / "serve.log")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_oversized_prompts_are_refused_before_tokenization(server: ServerProcess) -> None:
    from pdserve.text.tokenizer import load_tokenizer

    limit = 512 * load_tokenizer(server_model_dir(server)).max_token_chars
    huge = "x" * (limit + 1)
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": huge, "max_tokens": 1}),
        ("/v1/completions", {"model": MODEL, "prompt": ["short", huge], "max_tokens": 1}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": huge}]}),
        ("/tokenize", {"model": MODEL, "prompt": huge}),
    ]
    for path, body in cases:
        resp = httpx.post(server.url + path, json=body, timeout=60)
        assert resp.status_code == 400, (path, resp.text[:300])
        message = resp.json()["error"]["message"]
        assert f"at most {limit}" in message and "512 tokens" in message, message
    # Just under the bound: tokenized, then the engine's own context check answers (also a 400).
    resp = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi " * 2000}, timeout=60)
    assert resp.status_code == 400 and "maximum context length is 512" in resp.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def server_model_dir(server: ServerProcess) -> str:
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["root"]


def test_plan_against_a_live_instance_uses_its_dtype(server: ServerProcess) -> None:
    info = httpx.get(server.url + "/pdserve/info", timeout=10).json()
    assert info["dtype"] == "float32"  # CPU default
    out = pdserve("plan", "--instance", server.url, "--prompt-len", "1000", "--json")
    assert out.returncode == 0, out.stderr
    import json

    plan = json.loads(out.stdout)
    per_token = info["num_layers"] * 2 * info["num_kv_heads"] * info["head_dim"] * 4  # float32: 4 bytes
    assert plan["shape"]["dtype"] == "float32" and plan["bytes_per_token"] == per_token
    assert plan["block_size"] == info["block_size"]
    # From the model's config alone the dtype is the weights' one, and the plan says so.
    text = pdserve("plan", server_model_dir(server), "--prompt-len", "1000").stdout
    assert "note: " in text and "--instance URL" in text
    bad = pdserve("plan", "--instance", f"127.0.0.1:{free_port()}", "--prompt-len", "10")
    assert bad.returncode == 2 and "cannot read its KV shape" in one_error_line(bad, "pdserve plan:")
