"""`pdserve bench` against a real `pdserve serve` (tiny Llama with dummy weights and SmolLM2's tokenizer).

No `--model` and no `--tokenizer`: the client discovers the served name and the model folder through
GET /v1/models, loads the tokenizer from that folder and aligns prompts through the server's /tokenize.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_utils import free_port

from pdserve.bench import cli as bench_cli

TINY_LLAMA = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "torch_dtype": "float32",
}  # fmt: skip


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from pdserve.model.default_model import resolve_model

    src = Path(resolve_model("smollm2-135m"))
    model = tmp_path_factory.mktemp("bench-real") / "tiny"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, model / name)
    config = json.loads((src / "config.json").read_text())
    config.update(TINY_LLAMA)
    (model / "config.json").write_text(json.dumps(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = model.parent / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "serve", str(model), "--load-format", "dummy", "--port", str(port),
             "--served-model-name", "tiny", "--max-model-len", "256", "--disable-uvicorn-access-log", "--shutdown-timeout", "2"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            assert proc.poll() is None, f"server exited:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"server not healthy:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _bench(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return bench_cli.main(parser.parse_args(list(argv)))


def test_bench_real_server_completions_and_chat(
    server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = _bench("--base-url", server, "--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "4",
                "--goodput", "ttft:600000", "tpot:600000", "--disable-tqdm", "--save-result", "--save-detailed",
                "--result-dir", str(tmp_path), "--result-filename", "completions.json")  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "First model name: tiny" in out and "/tokenize unavailable" not in out
    assert "Successful requests:                     6         " in out
    assert "Total input tokens:                      144       " in out  # server-side count, as requested
    assert (
        "Total generated tokens:                  24        " in out
    )  # ignore_eos: every request runs to length
    result = json.loads((tmp_path / "completions.json").read_text())
    assert result["model_id"].endswith("tiny") and result["tokenizer_id"] == result["model_id"]
    assert result["request_goodput"] == result["request_throughput"]
    assert result["output_lens"] == [4] * 6 and all(len(itl) >= 1 for itl in result["itls"])

    rc = _bench("--base-url", server, "--backend", "openai-chat", "--num-prompts", "3", "--random-input-len", "16",
                "--random-output-len", "3", "--temperature", "0", "--disable-tqdm", "--save-result",
                "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "chat.json")  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    chat = json.loads((tmp_path / "chat.json").read_text())
    assert chat["completed"] == 3 and chat["output_lens"] == [3, 3, 3]
    assert all(t > 0 for t in chat["ttfts"]) and all(
        lat >= t for lat, t in zip(chat["latencies"], chat["ttfts"], strict=True)
    )
    assert all(i >= 16 for i in chat["input_lens"])  # the chat template adds tokens around the prompt
