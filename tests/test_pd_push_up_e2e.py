"""`pdserve up --kv-transfer-mode push` as a user types it (CPU defaults: blocks of 128): NixlPushConnector on
both pools, the proxy in push mode, token-exact with a collocated instance, streaming and not, on prompts that
share a prefix (the second one's decode registers only the blocks its own cache lacks); and with tensor
parallelism (`--tensor-parallel-size 2` on both pools, `--prefill-tp 2 --decode-tp 1`): each prefill rank
WRITEs its KV heads into the decode ranks' blocks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from launch_helpers import Up, kill_leftovers, tiny_model_with_tokenizer
from server_utils import ServerProcess

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")

from test_pd_e2e import long_prompt  # noqa: E402 - after the skip

STARTUP_S = 400


def _texts(resp: httpx.Response, stream: bool) -> list[str]:
    if not stream:
        return [c["text"] for c in resp.json()["choices"]]
    out = ""
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out += "".join(c.get("text") or "" for c in json.loads(line[6:]).get("choices", []))
    return [out]


def test_up_push_mode_matches_collocated(tiny_model_factory, tmp_path: Path) -> None:
    check_up_push(tiny_model_factory, tmp_path, [])


@pytest.mark.parametrize("tp_args", [["--tensor-parallel-size", "2"], ["--prefill-tp", "2", "--decode-tp", "1"]],
                         ids=["tp2-both", "prefill-tp2"])
def test_up_push_mode_with_tensor_parallelism_matches_collocated(tiny_model_factory, tmp_path: Path,
                                                                 tp_args: list[str]) -> None:
    check_up_push(tiny_model_factory, tmp_path, tp_args, tails=(" one ending here",))


def check_up_push(tiny_model_factory, tmp_path: Path, extra: list[str],
                  tails: tuple[str, ...] = (" one ending here", " another ending there")) -> None:
    tiny = tiny_model_with_tokenizer(tiny_model_factory("llama", vocab_size=49152), tmp_path / "tiny")
    ref_srv = ServerProcess(tiny, tmp_path / "collocated.log", "--block-size", "128")
    up = Up([str(tiny), "--port", "0", "--kv-transfer-mode", "push", "--log-dir", str(tmp_path / "logs"), *extra],
            cwd=tmp_path)
    pids: list[int] = []
    try:
        info = up.ready(STARTUP_S)
        pids = [int(p) for p in info["pids"].split(",")]
        ref_srv.wait_ready()
        shared = long_prompt(260, 3)  # ~580 tokens: over push_layerwise_min_tokens, pushed layer by layer
        with httpx.Client(timeout=120) as http:
            for stream in (False, True):
                for tail in tails:
                    body = {"model": str(tiny), "prompt": shared + tail, "max_tokens": 12, "temperature": 0,
                            "stream": stream}
                    ref = http.post(f"{ref_srv.url}/v1/completions", json={**body, "model": "tiny"})
                    out = http.post(f"{info['proxy']}/v1/completions", json=body)
                    assert out.status_code == 200, out.text
                    assert _texts(out, stream) == _texts(ref, stream), (stream, tail)
            pushed = http.get(f"{info['prefill']}/metrics").text
            tp = {role: http.get(f"{info[role]}/pdserve/info").json()["tensor_parallel_size"]
                  for role in ("prefill", "decode")}
        assert re.search(r'^pdserve:kv_push_jobs_ended_total\{[^}]*outcome="done"[^}]*\} [1-9]', pushed, re.M), pushed
        assert re.search(r'^pdserve:kv_push_written_bytes_total\{[^}]*during_prefill[^}]*\} [1-9]', pushed, re.M)
        config = (tmp_path / "logs" / "decode.log").read_text()
        assert "role=kv_consumer" in config
        want = {"prefill": 1, "decode": 1}
        if "--tensor-parallel-size" in extra:
            want = {"prefill": 2, "decode": 2}
        elif "--prefill-tp" in extra:
            want = {"prefill": 2, "decode": 1}
        assert tp == want
    finally:
        up.kill()
        kill_leftovers(pids)
        ref_srv.stop()
