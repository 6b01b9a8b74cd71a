"""`pdserve up` end to end: real instances and proxy on 127.0.0.1, stopped by PID, no orphans, ports free.

The 1P1D lifecycle (SIGTERM teardown) is exercised by the deployment fixture of test_preflight_e2e.py.
"""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path

import pytest
from launch_helpers import (
    Up,
    assert_all_gone,
    children_of,
    kill_leftovers,
    ports_in,
    tiny_model_with_tokenizer,
)

from pdserve.cache_dir import cache_dir
from pdserve.model.default_model import resolve_model

STARTUP_S = 400  # bounds only: a loaded 2-core CI box can take minutes to import torch twice


@pytest.fixture(scope="module")
def tiny(tiny_model_factory, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    src = tiny_model_factory("llama", vocab_size=49152)
    return tiny_model_with_tokenizer(src, tmp_path_factory.mktemp("up-model") / "tiny")


def test_collocated_demo_exit(tiny: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    up = Up([str(tiny), "--topology", "collocated:1", "--port", "0", "--demo", "--exit", "--demo-max-tokens", "8",
             "--log-dir", str(logs)], cwd=tmp_path)
    pids: list[int] = []
    try:
        info = up.ready(STARTUP_S)
        listed = [int(p) for p in info["pids"].split(",")]
        pids = listed + [p for p in children_of(up.proc.pid) if p not in listed]  # + the watchdog
        rc = up.wait(STARTUP_S)
        out = up.output
        assert rc == 0, out
        assert len(listed) == 2 and "prefill" not in info
        assert info["decode"].startswith("http://127.0.0.1:") and info["proxy"].startswith("http://127.0.0.1:")
        assert re.search(r"^answer: The three primary colours are\S*.+", out, re.M), out
        assert re.search(r"^TTFT: \d+\.\d ms; total \d+\.\d ms, 8 tokens, finish_reason=length", out, re.M), out
        assert "curl -s " + info["proxy"] + "/v1/completions" in out
        assert (logs / "collocated.log").stat().st_size > 0 and (logs / "proxy.log").stat().st_size > 0
        assert_all_gone(pids, ports_in(out))
    finally:
        up.kill()
        kill_leftovers(pids)


def test_multi_turn_chat_reads_the_history_back(tiny: Path, tmp_path: Path) -> None:
    """`pdserve up --kv-history --kv-events`: turn 2 of a chat reads turn 1 (prompt and answer) back from the
    decode instance instead of recomputing it, and the proxy follows both instances' KV events."""
    import httpx

    # blocks of 16 (not the CPU default of 128): a short chat's history fills whole blocks to read back
    up = Up([str(tiny), "--port", "0", "--kv-history", "--kv-events", "--log-dir", str(tmp_path / "logs"),
             "--serve-arg=--block-size 16"], cwd=tmp_path)
    pids: list[int] = []
    try:
        info = up.ready(STARTUP_S)
        pids = [int(p) for p in info["pids"].split(",")]
        proxy = info["proxy"]
        messages = [{"role": "user", "content": "Tell me a long story about the sea and the ships on it."}]
        body = {"model": str(tiny), "max_tokens": 80, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=120) as http:
            first = http.post(f"{proxy}/v1/chat/completions", json={**body, "messages": messages})
            assert first.status_code == 200, first.text
            answer = first.json()["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
            second = http.post(f"{proxy}/v1/chat/completions", json={**body, "messages": messages})
            assert second.status_code == 200, second.text
            usage = second.json()["usage"]
            # the history (turn 1's prompt and answer) was not recomputed: without --kv-history the prefill's
            # own cache holds only turn 1's prompt (measured: 32 cached tokens of a 44-token first prompt)
            assert usage["prompt_tokens_details"]["cached_tokens"] >= first.json()["usage"]["prompt_tokens"] + 48
            pulls = http.get(f"{info['prefill']}/metrics").text
            assert re.search(r'^pdserve:kv_prefix_pulls_total\{[^}]*outcome="loaded"[^}]*\} [1-9]', pulls, re.M), pulls
            listing = http.get(f"{proxy}/pdserve/instances").json()
            assert all(i["kv_events"]["subscribed"] for role in ("prefill", "decode") for i in listing[role]), listing
    finally:
        up.kill()
        kill_leftovers(pids)


def test_child_crash_at_startup_is_reported(tiny: Path, tmp_path: Path) -> None:
    """A bad serve argument on decode: prefill is stopped, decode's log tail shown, exit code non-zero."""
    up = Up([str(tiny), "--port", "0", "--decode-arg=--max-waiting-requests 0", "--log-dir", str(tmp_path)],
            cwd=tmp_path)
    try:
        rc = up.wait(STARTUP_S)
    finally:
        up.kill()
    out = up.output
    assert rc == 1, out
    assert "pdserve up: decode exited with code 2 during startup" in out
    assert "  | pdserve serve: error: --max-waiting-requests must be at least 1" in out
    assert "PDSERVE_READY" not in out
    stopping = re.search(r"^stopping: (.*)$", out, re.M)
    assert stopping, out
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", stopping.group(1))]
    assert len(pids) == 2  # decode and prefill; the proxy never started
    assert_all_gone(pids, ports_in(out))


def test_readme_command_default_model(tmp_path: Path) -> None:
    """README command 1 as written (`pdserve up --demo`: embedded SmolLM2, 1P1D + proxy), then Ctrl-C."""
    resolve_model(None)  # converted already, so `up` must not say it is preparing it
    up = Up(["--demo"], cwd=tmp_path)
    pids: list[int] = []
    try:
        info = up.ready(STARTUP_S)
        pids = [int(p) for p in info["pids"].split(",")]
        pids += [p for p in children_of(up.proc.pid) if p not in pids]  # the watchdog
        up.wait_for(r"^serving; Ctrl-C stops everything", STARTUP_S)
        out = up.output
        assert info["model"] == "smollm2-135m" and info["prefill"] and info["decode"]
        assert re.search(r"^answer: The three primary colours are .+", out, re.M), out
        assert re.search(r"^TTFT: \d+\.\d ms", out, re.M), out
        assert re.search(r"^KV Transfer metrics \(from http://127\.0\.0\.1:\d+/metrics\): Num successful "
                         r"transfers=1, Avg xfer time \(ms\)=", out, re.M), out
        assert re.search(r"^decode\.log: .*KV Transfer metrics: Num successful transfers=1", out, re.M), out
        rc = up.stop(signal.SIGINT)
        out = up.output
        assert rc == 0, out
        assert out.rstrip().endswith("stopped.")
        log_dir = Path(info["log_dir"])  # the user cache, not the current directory
        assert not (tmp_path / "pdserve-logs").exists() and log_dir.is_relative_to(cache_dir() / "logs")
        for name in ("prefill.log", "decode.log", "proxy.log"):
            assert (log_dir / name).stat().st_size > 0
        key_file = log_dir / "admin-key"
        assert f"proxy admin key (POST /pdserve/instances) in {key_file}" in out
        assert key_file.stat().st_mode & 0o777 == 0o600 and len(key_file.read_text().strip()) >= 32
        assert "preparing model" not in out  # converted by an earlier run: nothing to prepare
        assert_all_gone(pids, ports_in(out))
    finally:
        up.kill()
        kill_leftovers(pids)
        if "info" in locals():
            shutil.rmtree(info["log_dir"], ignore_errors=True)


def test_ctrl_c_during_startup_stops_everything(tiny: Path, tmp_path: Path) -> None:
    up = Up([str(tiny), "--port", "0", "--log-dir", str(tmp_path)], cwd=tmp_path)
    pids: list[int] = []
    try:
        up.wait_for(r"^waiting for prefill, decode to answer /health", STARTUP_S)
        pids = children_of(up.proc.pid)  # the watchdog and both instances, still loading
        assert len(pids) == 3
        rc = up.stop(signal.SIGINT)
        out = up.output
        assert rc == 130, out
        assert "PDSERVE_READY" not in out and out.rstrip().endswith("stopped.")
        assert_all_gone(pids, ports_in(out))
    finally:
        up.kill()
        kill_leftovers(pids)
