"""`pdserve up --ray` on one GPU: a 1P1D whose two instances are Ray actors reserving half of the GPU each
(fractional GPU resources), answering through the proxy.

    python3 benchmarks/ray_gpu_smoke.py --out DIR -- --model Llama-3.1-8B --serve-arg=--load-format ...

What it checks and records (DIR/summary.json, DIR/up.txt, DIR/logs/):
- the app starts on a one-node Ray (`--ray local`) with `--gpus-per-instance 0.5`: each instance's bundle
  reserves {CPU: 1, GPU: 0.5}, and both servers run on the GPU (each is told its share of the GPU's memory);
- greedy answers through the proxy (prefill on one instance, KV read by the decode instance over NIXL,
  CUDA IPC on one GPU) carry the same tokens as the decode instance computing the same prompt alone (its
  own prefill; `--load-format dummy` weights are seeded, so both instances hold the same model);
- the decode instance's NIXL transfer count grew; `pdserve up` stops on SIGTERM and no server is left.
Exit status 0 only if every check held. Needs Ray (`pip install 'pdserve[ray]'`, or the wheel made by
scripts/slim_ray_wheel.py where there is no registry).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

READY_TIMEOUT_S = 400.0
PROMPTS = [
    "The capital of France is",
    "Explain in one paragraph why the sky is blue. " * 8,
    " ".join(f"item{i} costs {i * 7 % 101} dollars;" for i in range(120)),  # ~1000 tokens
]
MAX_TOKENS = 32


def _ready_fields(line: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in shlex.split(line)[1:] if "=" in word)


def _complete(url: str, model: str, prompt: str, *, stream: bool = False) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    t0 = time.monotonic()
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        ch = r.json()["choices"][0]
        return {"token_ids": ch["token_ids"], "text": ch["text"], "prompt_tokens": len(ch["prompt_token_ids"]),
                "seconds": round(time.monotonic() - t0, 3)}
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c.get("text") or "" for c in json.loads(line[6:]).get("choices", []))
    return {"text": text, "seconds": round(time.monotonic() - t0, 3)}


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _gpu_pids() -> dict[int, str]:
    """Processes nvidia-smi sees on the GPUs (pid -> used memory); empty where it cannot tell (sandboxes)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    pids = {}
    for line in out.splitlines():
        pid, _, mem = line.partition(",")
        if pid.strip().isdigit():
            pids[int(pid)] = mem.strip()
    return pids


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gpus-per-instance", default="0.5")
    p.add_argument("up_args", nargs="*", help="more `pdserve up` arguments (after --)")
    args = p.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pdserve", "up", "--ray", "local", "--topology", "1p1d", "--port", "0",
            "--gpus-per-instance", args.gpus_per_instance, "--log-dir", str((out / "logs").absolute()), *args.up_args]
    summary: dict[str, Any] = {"command": shlex.join(argv[1:]), "checks": {}}
    checks = summary["checks"]
    log = open(out / "up.txt", "w")  # noqa: SIM115 - closed at the end
    t0 = time.monotonic()
    up = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        line = None
        while time.monotonic() - t0 < READY_TIMEOUT_S and up.poll() is None and line is None:
            time.sleep(1)
            line = next((x for x in (out / "up.txt").read_text().splitlines() if x.startswith("PDSERVE_READY")), None)
        if line is None:
            summary["error"] = f"no PDSERVE_READY within {READY_TIMEOUT_S:g}s (rc {up.poll()})"
            return 1
        summary["ready_s"] = round(time.monotonic() - t0, 1)
        ready = _ready_fields(line)
        app = httpx.get(ready["autoscaler"] + "/pdserve/app", timeout=10).json()
        summary["instances"] = app["instances"]
        reserves = [x.strip() for x in (out / "up.txt").read_text().splitlines() if "reserves" in x]
        summary["reserves"] = reserves
        checks["fractional_gpu_bundles"] = len(reserves) == 2 and all(
            f"'GPU': {float(args.gpus_per_instance)}" in x for x in reserves)
        on_gpu = _gpu_pids()
        summary["nvidia_smi_compute_apps"] = {str(k): v for k, v in on_gpu.items()}
        servers = [i["server_pid"] for i in app["instances"]]
        if on_gpu:  # (gVisor's nvidia-smi lists no processes: then the servers' logs say where they run)
            checks["both_servers_on_the_gpu"] = all(pid in on_gpu for pid in servers)
        decode_url, model = ready["decode"], ready["model"]
        before = _metric(httpx.get(decode_url + "/metrics", timeout=10).text, "vllm:nixl_xfer_time_seconds_count")
        pd = [_complete(ready["proxy"], model, prompt) for prompt in PROMPTS]
        alone = [_complete(decode_url, model, prompt) for prompt in PROMPTS]
        streamed = _complete(ready["proxy"], model, PROMPTS[1], stream=True)
        after = _metric(httpx.get(decode_url + "/metrics", timeout=10).text, "vllm:nixl_xfer_time_seconds_count")
        summary["requests"] = {"pd": pd, "decode_alone": alone, "pd_streamed": streamed}
        checks["pd_tokens_equal_decode_alone"] = [a["token_ids"] for a in pd] == [b["token_ids"] for b in alone]
        checks["streamed_text_equal"] = streamed["text"] == pd[1]["text"]
        summary["nixl_transfers"] = after - before
        checks["kv_read_over_nixl"] = after - before >= len(PROMPTS)
    except (httpx.HTTPError, KeyError, ValueError) as e:
        body = e.response.text[:500] if isinstance(e, httpx.HTTPStatusError) else ""
        summary["error"] = f"{type(e).__name__}: {e} {body}"
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                rc = up.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                rc = up.wait()
            summary["stop_rc"] = rc
            checks["stopped_cleanly"] = rc == 0 and "stopped." in (out / "up.txt").read_text()
            time.sleep(2)
            left = [pid for pid in (summary.get("instances") and [i["server_pid"] for i in summary["instances"]]
                                    or []) if pid and Path(f"/proc/{pid}").exists()]
            checks["no_server_left"] = not left
        log.close()
        summary["ok"] = bool(checks) and all(checks.values()) and "error" not in summary
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps({k: v for k, v in summary.items() if k != "requests"}, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
