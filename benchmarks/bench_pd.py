"""1P1D vs one collocated instance on the same machine, same prompts, one run: TTFT, decode tokens/s,
and the KV handoff (bytes, NIXL READ time, GB/s) read from the decode instance's /metrics.

Requests go one at a time, so each number is the system's own latency, not queueing. The P/D path is
driven exactly as vLLM's toy proxy drives it (prefill leg with max_tokens=1, then the decode leg with the
prefill's kv_transfer_params); TTFT is measured by the client across both legs.

    # CPU (2 cores): SmolLM2 default; prefill pinned to core 0, decode to core 1, collocated gets both
    python benchmarks/bench_pd.py --prompt-len 1024 --output-len 64 --num-requests 8
    # H200: two processes sharing the GPU, Llama-3.1-8B shape with dummy weights
    python benchmarks/bench_pd.py --model pdserve/data/configs/llama-3.1-8b --load-format dummy \
        --prompt-len 8192 --output-len 64 --num-requests 5 --gpu
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from bench_procs import stop, wait_healthy

from pdserve.api.pd import (
    KV_PARAMS_PATH,
    build_decode_body,
    build_prefill_body,
    early_decode_params,
    params_delivery,
    without_first_token,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Instance:
    def __init__(self, name: str, args: argparse.Namespace, logdir: Path, extra: list[str], cpus: set[int] | None,
                 gpu: str | None = None, util: float | None = None):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve", "serve", *([args.model] if args.model else []),
               "--port", str(self.port), "--served-model-name", "bench", "--max-model-len",
               str(args.prompt_len + args.output_len + 64), "--disable-uvicorn-access-log",
               "--load-format", args.load_format, "--no-enable-prefix-caching", *extra, *args.serve_arg]
        if args.gpu:
            cmd += ["--gpu-memory-utilization", str(util or args.gpu_memory_utilization)]
        env = dict(os.environ)
        # the engine's per-request lifecycle (monotonic clock, shared with this client): the breakdown
        self.step_log = logdir / f"{name}-steps.jsonl"
        env["PDSERVE_STEP_LOG"] = str(self.step_log)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        if cpus:
            env["OMP_NUM_THREADS"] = str(len(cpus))
        self.log = open(logdir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)

    def wait(self, timeout: float = 900) -> None:
        try:
            wait_healthy(self.proc, self.url, timeout, self.name)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; see {self.log.name}") from None

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:nixl_") and " " in line and "{" in line:
                name = line.split("{", 1)[0]
                if name.endswith(("_sum", "_count")):
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
                elif name == "vllm:nixl_xfer_time_seconds_bucket" and 'le="0.005"' in line:
                    # READs done within 5 ms (the smallest bucket): tells a slow first READ from a slow mean
                    out["xfer_le_5ms"] = out.get("xfer_le_5ms", 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        stop(self.proc)
        self.log.close()


# One client for every timed request, as a proxy keeps its connections: a fresh httpx client per request
# builds an SSL context (20-50 ms), which would be counted once in collocated TTFT and twice in 1P1D's.
CLIENT = httpx.Client(timeout=600, trust_env=False)


def stream_completion(url: str, body: dict, t0: float, rid: str) -> tuple[float, float, int]:
    """(ttft s, end s, completion tokens), times relative to t0 (a `time.monotonic()` reading)."""
    ttft = None
    tokens = 0
    with CLIENT.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and ttft is None:
                ttft = time.monotonic() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.monotonic() - t0
    assert ttft is not None
    return ttft, end, tokens


def body_for(args: argparse.Namespace, i: int) -> dict:
    # Token-id prompts of exact length, distinct per request so no cache can help.
    ids = [(1000 + 7919 * i + 31 * j) % 30000 + 100 for j in range(args.prompt_len)]
    return {"model": "bench", "prompt": ids, "max_tokens": args.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


@dataclass
class Timed:
    """One timed request: client-side times on the monotonic clock the engines' step logs use."""

    rid: str  # its X-Request-Id (the engines' request ids start with cmpl-<rid>)
    t0: float  # the client starts (collocated: sends the request; P/D: sends the prefill leg)
    ttft: float  # s after t0
    tps: float  # decode tokens/s
    params_at: float | None = None  # P/D: the prefill's params received (s after t0)
    decode_sent: float | None = None  # P/D: the decode leg about to be sent (s after t0)
    early: bool = False  # the decode leg went out with the prefill leg, its params after the prefill


def run_collocated(inst: Instance, args: argparse.Namespace) -> list[Timed]:
    res = []
    for i in range(args.num_requests + 1):
        rid = f"colo-{i}"
        t0 = time.monotonic()
        ttft, end, n = stream_completion(inst.url, body_for(args, i), t0, rid)
        if i > 0:  # the first request warms up
            res.append(Timed(rid, t0, ttft, (n - 1) / (end - ttft)))
    return res


def run_disagg(p: Instance, d: Instance, args: argparse.Namespace, first_token: bool = True,
               offset: int = 0) -> list[Timed]:
    """first_token=False drops the producer's first token from the params, as a vLLM producer sends them:
    the decode instance then recomputes the last prompt token (the A/B of the same servers in one run)."""
    res = []
    for i in range(args.num_requests + 1):
        body = body_for(args, offset + i)
        rid = f"pd{'ft' if first_token else 'rc'}-{i}"
        t0 = time.monotonic()
        params = CLIENT.post(f"{p.url}/v1/completions", json=build_prefill_body(body),
                             headers={"X-Request-Id": rid}).json()["kv_transfer_params"]
        params_at = time.monotonic() - t0
        if not first_token:
            params = without_first_token(params)
        decode_body = build_decode_body(body, params)
        decode_sent = time.monotonic() - t0
        ttft, end, n = stream_completion(d.url, decode_body, t0, rid)
        if i > 0:
            res.append(Timed(rid, t0, ttft, (n - 1) / (end - ttft), params_at, decode_sent))
    return res


def _stream_into(into: dict, url: str, body: dict, t0: float, rid: str) -> None:
    into["out"] = stream_completion(url, body, t0, rid)


def run_early(p: Instance, d: Instance, args: argparse.Namespace, offset: int = 0) -> list[Timed]:
    """The decode leg sent together with the prefill leg (its params come later, `pd.early_decode_params`),
    then the prefill's params delivered to the decode instance (`pd.KV_PARAMS_PATH`), as `pdserve proxy`
    does for pdserve decode instances: the decode leg's HTTP, parsing and admission overlap the prefill."""
    res = []
    for i in range(args.num_requests + 1):
        body = body_for(args, offset + i)
        rid = f"pdearly-{i}"
        got: dict[str, tuple[float, float, int]] = {}
        t0 = time.monotonic()
        leg = threading.Thread(target=_stream_into, args=(got, d.url, build_decode_body(body, early_decode_params(rid)),
                                                          t0, rid))
        # the prefill request serialised before the decode leg's thread starts, so it goes out first (as the
        # proxy sends them)
        prefill = CLIENT.build_request("POST", f"{p.url}/v1/completions", json=build_prefill_body(body),
                                       headers={"X-Request-Id": rid})
        leg.start()
        try:
            params = CLIENT.send(prefill).json()["kv_transfer_params"]
            params_at = time.monotonic() - t0
            CLIENT.post(f"{d.url}{KV_PARAMS_PATH}", json=params_delivery(rid, params)).raise_for_status()
        finally:
            leg.join(600)
        ttft, end, n = got["out"]
        if i > 0:
            res.append(Timed(rid, t0, ttft, (n - 1) / (end - ttft), params_at, 0.0, early=True))
    return res


def lifecycles(inst: Instance) -> dict[str, dict]:
    """The engine's finished-request lines (step log), by the client's request id."""
    out: dict[str, dict] = {}
    if not inst.step_log.exists():
        return out
    for line in inst.step_log.read_text().splitlines():
        rec = json.loads(line)
        rid = rec.get("request")
        if rid and rid.startswith("cmpl-"):
            out[rid[5:]] = rec
    return out


def _find(recs: dict[str, dict], rid: str) -> dict | None:
    return next((r for k, r in recs.items() if k == rid or k.startswith(rid + "-")), None)


def breakdown(rows: list[Timed], engine: dict[str, dict], producer: dict[str, dict] | None = None) -> dict[str, float]:
    """Median ms of each phase from the client's start to its first token. Collocated: ingress (client
    send to engine arrival: HTTP, parsing, validation, the engine thread picking it up), engine (arrival to
    first token), egress (to the client's first chunk). P/D adds the prefill leg's ingress, engine and
    egress (to its params at the client), the client's decode body, and the decode engine's load phases."""
    cols: dict[str, list[float]] = {}

    def put(k: str, v: float | None) -> None:
        if v is not None:
            cols.setdefault(k, []).append(v * 1e3)

    for r in rows:
        d = _find(engine, r.rid)
        if d is None:
            continue
        ms = lambda key, rec=d: None if rec.get(key) is None else rec[key] / 1e3  # noqa: E731
        sent = r.t0 if r.decode_sent is None else r.t0 + r.decode_sent
        if producer is not None and r.params_at is not None:
            pr = _find(producer, r.rid)
            if pr is not None:
                put("P ingress", pr["t"] - r.t0)
                put("P engine", pr["finished_ms"] / 1e3)
                put("P egress", r.t0 + r.params_at - (pr["t"] + pr["finished_ms"] / 1e3))
            if not r.early:
                put("client body", r.decode_sent - r.params_at)
        if r.early:
            # the decode leg arrived during the prefill; what counts is the params' way to the load start
            put("params to load start", d["t"] + ms("load_start_ms") - (r.t0 + r.params_at))
        else:
            put("ingress", d["t"] - sent)
        if d.get("load_start_ms") is not None:
            if not r.early:
                put("to load start", ms("load_start_ms"))
            # from the first token, the lease claim (emitted then) or the READ plus a model step (recompute)
            put("load start to token", ms("first_token_ms") - ms("load_start_ms"))
            put("(READ+release", ms("load_done_ms") - ms("load_start_ms"))
        else:
            put("engine", ms("first_token_ms"))
        put("egress", r.t0 + r.ttft - (d["t"] + ms("first_token_ms")))
    return {k: statistics.median(v) for k, v in cols.items()}


def show_breakdown(name: str, parts: dict[str, float]) -> None:
    """Parts named "(..." overlap the others (shown, not summed)."""
    chain = sum(v for k, v in parts.items() if not k.startswith("("))
    print(f"{name:12} " + ", ".join(f"{k} {v:.2f}" + (")" if k.startswith("(") else "") for k, v in parts.items())
          + f" (ms, p50; chain {chain:.1f})")


def summarize(rows: list[Timed]) -> tuple[float, float]:
    return statistics.median(r.ttft for r in rows), statistics.median(r.tps for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or short name (default: smollm2-135m)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--gpu", action="store_true", help="both instances on GPU 0 (two processes, VRAM transfer)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="per instance (default 0.4 when sharing one GPU, 0.85 with --gpus)")
    ap.add_argument("--gpus", default=None,
                    help="P,D GPU ids, e.g. 0,1: prefill on the first, decode on the second, collocated on "
                         "the first (implies --gpu)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `pdserve serve` argument")
    ap.add_argument("--pd-only", action="store_true",
                    help="skip the collocated instance (A/B runs of 1P1D alone, e.g. bf16 vs fp8 KV)")
    args = ap.parse_args()
    gpus = args.gpus.split(",") if args.gpus else [None, None]
    if args.gpus:
        args.gpu = True
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.85 if args.gpus else 0.4

    ncpu = os.cpu_count() or 2
    half = max(1, ncpu // 2)
    pin = not args.gpu and ncpu >= 2
    logdir = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    print(f"logs in {logdir}", file=sys.stderr)
    kv = '{"kv_connector":"NixlConnector","kv_role":"%s","kv_connector_extra_config":{"transfer_timeout_s":30}}'

    colo_rows: list[Timed] = []
    colo_life: dict[str, dict] = {}
    if not args.pd_only:
        colo = Instance("collocated", args, logdir, [], set(range(ncpu)) if pin else None, gpus[0])
        try:
            colo.wait()
            colo_rows = run_collocated(colo, args)
        finally:
            colo.stop()
        colo_life = lifecycles(colo)
    p = Instance("prefill", args, logdir, ["--kv-transfer-config", kv % "kv_producer", "--side-channel-port", "0"],
                 set(range(half)) if pin else None, gpus[0])
    if args.gpu and not args.gpus:
        # Sharing one GPU: the engine sizes its pool from the device's free memory, so the decode instance
        # starts after the prefill one has taken its share, with a cumulative utilisation.
        p.wait()
    d = Instance("decode", args, logdir, ["--kv-transfer-config", kv % "kv_consumer"],
                 set(range(half, ncpu)) if pin else None, gpus[-1],
                 util=(2 * args.gpu_memory_utilization if args.gpu and not args.gpus else None))
    try:
        p.wait()
        d.wait()
        before = d.metrics()
        pd_rows = run_disagg(p, d, args)
        after = d.metrics()
        recompute_rows = run_disagg(p, d, args, first_token=False, offset=1000)
        early_rows = run_early(p, d, args, offset=2000)
    finally:
        p.stop()
        d.stop()
    p_life, d_life = lifecycles(p), lifecycles(d)

    def delta(k: str) -> float:
        return after.get(k, 0.0) - before.get(k, 0.0)

    n_xfer = delta("vllm:nixl_xfer_time_seconds_count")
    xfer_s = delta("vllm:nixl_xfer_time_seconds_sum") / max(n_xfer, 1)
    xfer_bytes = delta("vllm:nixl_bytes_transferred_sum") / max(n_xfer, 1)
    xfer_slow = n_xfer - delta("xfer_le_5ms")
    c_ttft, c_tps = summarize(colo_rows) if colo_rows else (float("nan"), float("nan"))
    d_ttft, d_tps = summarize(pd_rows)
    r_ttft, r_tps = summarize(recompute_rows)
    e_ttft, e_tps = summarize(early_rows)
    where = (f"GPU: P on GPU {gpus[0]}, D on GPU {gpus[-1]}, collocated on GPU {gpus[0]}" if args.gpus else
             "GPU (two processes sharing one GPU)") if args.gpu else (f"CPU, P on cores 0-{half - 1}, D on {half}-{ncpu - 1}, "
                                                            f"collocated on all {ncpu}")
    print(f"model={args.model or 'smollm2-135m'} prompt={args.prompt_len} out={args.output_len} "
          f"requests={args.num_requests} ({where})")
    print(f"{'':12} {'TTFT p50 ms':>12} {'decode tok/s p50':>17}")
    print(f"{'collocated':12} {c_ttft * 1e3:12.1f} {c_tps:17.1f}")
    print(f"{'1P1D':12} {d_ttft * 1e3:12.1f} {d_tps:17.1f}   (decode starts from the prefill's first token)")
    print(f"{'1P1D recomp':12} {r_ttft * 1e3:12.1f} {r_tps:17.1f}   (first token dropped: a vLLM producer's params)")
    print(f"{'1P1D early':12} {e_ttft * 1e3:12.1f} {e_tps:17.1f}   (decode leg sent with the prefill leg, params after)")
    print(f"TPOT p50 ms: 1P1D {1e3 / d_tps:.2f}, 1P1D recomp {1e3 / r_tps:.2f}, 1P1D early {1e3 / e_tps:.2f}, "
          f"collocated {1e3 / c_tps:.2f}")
    print(f"ratios (1P1D / collocated): TTFT {d_ttft / c_ttft:.2f}x, decode tokens/s {d_tps / c_tps:.2f}x")
    print(f"TTFT added by the handoff: {(d_ttft - c_ttft) * 1e3:+.1f} ms from the first token, "
          f"{(r_ttft - c_ttft) * 1e3:+.1f} ms by recompute, {(e_ttft - c_ttft) * 1e3:+.1f} ms with the early decode leg")
    print(f"KV handoff: {n_xfer:.0f} transfers, {xfer_bytes / 2**20:.1f} MiB each, NIXL READ {xfer_s * 1e3:.2f} ms "
          f"(mean; {xfer_slow:.0f} of them over 5 ms) = {xfer_bytes / max(xfer_s, 1e-9) / 1e9:.2f} GB/s; handoff "
          f"share of collocated TTFT {xfer_s / c_ttft * 100:.1f}%")
    print("where the time to the first token went (client and engines on one monotonic clock):")
    if colo_rows:
        show_breakdown("collocated", breakdown(colo_rows, colo_life))
    show_breakdown("1P1D", breakdown(pd_rows, d_life, p_life))
    show_breakdown("1P1D recomp", breakdown(recompute_rows, d_life, p_life))
    show_breakdown("1P1D early", breakdown(early_rows, d_life, p_life))


if __name__ == "__main__":
    main()
