"""PDSERVE_STEP_LOG: one JSON line per engine step and per finished request, and its summary script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine_utils import make_engine, run_engine

from pdserve.types.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def test_step_log_records_steps_and_requests(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_STEP_LOG", str(tmp_path / "steps-{role}.jsonl"))
    engine = make_engine(tiny_llama, max_num_batched_tokens=8)
    prompts = [list(range(3, 23)), [5, 6, 7]]
    run_engine(engine, prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.shutdown()
    lines = [json.loads(line) for line in (tmp_path / "steps-engine.jsonl").read_text().splitlines()]
    steps = [s for s in lines if "request" not in s]
    requests = [s for s in lines if "request" in s]
    assert len(requests) == 2 and all(r["output_tokens"] == 4 and r["finish_reason"] == "length" for r in requests)
    for r in requests:
        assert 0 <= r["scheduled_ms"] <= r["first_token_ms"] <= r["finished_ms"] and r["load_start_ms"] is None
    # 20 + 3 prompt tokens under an 8-token budget: chunks of 8, 8, then 4 + 3, then decode steps
    assert [s["prefill_tokens"] for s in steps[:3]] == [8, 8, 7] and steps[2]["seqs"] == 2
    assert all(s["tokens"] <= 8 and s["exec_ms"] >= 0 and s["gap_ms"] >= 0 for s in steps)
    assert any(s["prefill_tokens"] == 0 for s in steps)
    if Path("/proc/thread-self/schedstat").exists():  # Linux: where the stepping thread's wall time went
        for s in steps:
            wall = s["sched_ms"] + s["exec_ms"] + s["post_ms"]
            assert min(s["run_ms"], s["rq_ms"], s["blocked_ms"], s["other_run_ms"]) >= 0
            # the kernel's counters and the wall clock are read microseconds apart
            assert s["run_ms"] + s["rq_ms"] <= wall + 1.0
        assert sum(s["run_ms"] for s in steps) > 0
        assert all("gap_run_ms" in s for s in steps[1:])
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_log_summary.py"),
                          str(tmp_path / "steps-engine.jsonl")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{len(steps)} steps" in out.stdout and "2 requests" in out.stdout and "decode-eager" in out.stdout
    if Path("/proc/thread-self/schedstat").exists():
        assert "stepping thread inside steps" in out.stdout and "between steps" in out.stdout
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_log_summary import window_stats  # what bench_vllm_cpu.py records per run

    stats = window_stats(str(tmp_path / "steps-engine.jsonl"), steps[0]["t"], steps[-1]["t"])
    assert stats["steps"] == len(steps) and stats["prefill_only_steps"] + stats["mixed_steps"] == 3
    assert stats["multi_thread_steps"] <= len(steps) and stats["decode_seqs_p50"] >= 1
    assert all(s.get("threads", 1) >= 1 for s in steps)
    if Path("/proc/thread-self/schedstat").exists():
        assert stats["step_run_s"] > 0 and stats["gap_blocked_s"] >= 0
    assert window_stats(str(tmp_path / "steps-engine.jsonl"), 0.0, steps[0]["t"] - 1) == {}
