"""Pull vs whole-request push vs layer-pipelined push, side by side in one run (issues 34, 41), against collocated.

What the user waits for: TTFT, and the time to the SECOND token (with the first-token handoff a pull decode
emits the prefill's token at once, so TTFT hides the transfer; the second token waits for the KV), each as
added over collocated, and decode tokens/s. Requests go one at a time, distinct prompts (no cache helps).
The client plays the proxy: pull sends the decode leg with the prefill leg and delivers the params after the
prefill (the early decode leg, as `pdserve proxy` does), push sends both legs at once with a push key
(`pdserve proxy --kv-transfer-mode push`). The layer-pipelined prefill is told `push_layerwise_min_tokens: 0`,
so short prompts show what per-layer posting costs there (the threshold's measurement).

Per row it also prints where the push writer's time went (`pdserve:kv_push_writer_*` on the prefill's
/metrics, per timed request: WRITEs posted, descriptors, layers per WRITE, host time building and posting
them, time waiting for the forward's layers, post-to-complete time, and the tail from the prefill finishing to
the completion notification) and the pull decode's READs (`vllm:nixl_*`), and a check: the first request of
every mode at a prompt length has the same prompt, and its tokens are compared with collocated's and across
modes (layer-pipelined and whole-request push must agree exactly: the decode gets the same bytes either way).

CPU box (`--netns`, needs root): the prefill runs in network namespace pdpush-p-<pid>, the decode, the
collocated instance and this client in pdpush-d-<pid>, joined by a veth pair in 10.199.0.0/24 shaped with
`tc qdisc ... tbf` on both ends; `--rate-mbit auto` sets the rate so that one request's KV takes about as
long on the wire as its prefill (measured on the collocated instance first). UCX runs over TCP on the veth
(UCX_TLS=tcp: no shared memory between the namespaces). Namespaces are removed on exit. Each mode gets its
own prefill and decode processes (pinned: prefill core 0, decode core 1, collocated core 0), one mode at a time.
`--tp N` starts every instance, collocated too (so "added over collocated" is the handoff's, not TP's), with
`--tensor-parallel-size N`; on the CPU those instances are not pinned (a TP rank per core, on a 2-core box).
SmolLM2-135M's 9 attention heads and 3 KV heads do not split in 2: `--even-heads-model` builds random weights
of its shape with 12 heads of 48 and 4 KV heads instead (the same linears, the same KV bytes per token).

GPU (`--gpu`, one GPU shared by every instance, NIXL over CUDA IPC): the pull pair (its decode doubles as
the collocated instance: a decode leg without params is served whole) and the push trio (a whole-request
prefill, a layer-pipelined prefill, one decode) start together when the GPU has the memory for five 8B
instances (>= 120 GiB; else the pull pair, then the push trio) and serve every prompt length; then, with
`--tcp-prompt-lens`, the same over UCX on TCP (UCX_TLS=tcp,cuda_copy,self). `--budget-s` (default: the
SECTION_BUDGET_S variable benchmarks/gpu_wave.sh sets) skips what would not finish; results are written
(`--json`) after every row.

    # CPU (SmolLM2 default)
    sudo python benchmarks/bench_pd_push.py --netns --rate-mbit auto --prompt-len 1024 --output-len 32
    # the same with TP=2 on every instance, 3 requests a mode
    sudo python benchmarks/bench_pd_push.py --netns --tp 2 --even-heads-model --prompt-len 1024 --output-len 32 \
        --num-requests 3
    # H200, 8B shape, dummy weights: 256 / 8k / 32k over CUDA IPC, then 8k over UCX TCP
    python benchmarks/bench_pd_push.py --gpu --model Llama-3.1-8B --load-format dummy \
        --prompt-len 8192,32768,256 --tcp-prompt-lens 8192 --output-len 32 --num-requests 2 \
        --serve-arg=--tokenizer --serve-arg=.whl/smol-tok --budget-s 200
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from bench_procs import stop, wait_healthy

from pdserve.api.pd import (
    KV_PARAMS_PATH,
    build_decode_body,
    build_prefill_body,
    early_decode_params,
    params_delivery,
    push_decode_params,
)

NS_PREFIX = "pdpush-"
P_ADDR, D_ADDR = "10.199.0.1", "10.199.0.2"
VETH_P, VETH_D = "pdpush-vp", "pdpush-vd"
CLIENT = httpx.Client(timeout=900, trust_env=False)
MODES = ("pull", "push-request", "push-layer")
TCP_TLS = "tcp,cuda_copy,self"
BIG_GPU_GIB = 120  # five 8B-shape instances at once (16 GB of weights each, KV for a 32k prompt)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


# ---- network namespaces ------------------------------------------------------------------------------------

def make_netns(p_ns: str, d_ns: str) -> None:
    for ns in (p_ns, d_ns):
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "link", "add", VETH_P, "netns", p_ns, "type", "veth", "peer", "name", VETH_D, "netns", d_ns)
    for ns, dev, addr in ((p_ns, VETH_P, P_ADDR), (d_ns, VETH_D, D_ADDR)):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")


def shape(p_ns: str, d_ns: str, mbit: float) -> None:
    """tbf on both ends of the veth: each direction at `mbit`."""
    burst = max(int(mbit * 1e6 / 8 / 250), 16000)  # ~4 ms of data, at least 16 kB
    for ns, dev in ((p_ns, VETH_P), (d_ns, VETH_D)):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit:.3f}mbit",
           "burst", str(burst), "latency", "400ms")


def remove_netns(p_ns: str, d_ns: str) -> None:
    for ns in (p_ns, d_ns):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its end of the veth along


# ---- instances ---------------------------------------------------------------------------------------------

@dataclass
class Spec:
    """One server of a pass: its connector and role (None: collocated), extra connector settings, CPU set."""

    name: str
    connector: str | None = None
    role: str = "collocated"
    extra: dict = field(default_factory=dict)
    cpus: set[int] | None = None


class Instance:
    def __init__(self, spec: Spec, args: argparse.Namespace, logdir: Path, *, ucx_tls: str | None,
                 gpu_mem: float | None, max_model_len: int) -> None:
        self.name = spec.name
        prefill = spec.role == "kv_producer"
        self.host = P_ADDR if (args.netns and prefill) else (D_ADDR if args.netns else "127.0.0.1")
        self.port = free_port()  # in a namespace of its own (--netns) any port is free; else a free one here
        self.url = f"http://{self.host}:{self.port}"
        cmd = [sys.executable, "-m", "pdserve", "serve", *([args.model] if args.model else []), "--host", self.host,
               "--port", str(self.port), "--served-model-name", "bench", "--max-model-len", str(max_model_len),
               "--disable-uvicorn-access-log", "--load-format", args.load_format, "--no-enable-prefix-caching",
               *args.serve_arg]
        env = dict(os.environ, PDSERVE_KV_SECRET=args.secret)
        if spec.connector is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_config(spec.connector, spec.role, **spec.extra)),
                    "--side-channel-host", self.host, "--side-channel-port", str(free_port())]
        if args.tp > 1:
            cmd += ["--tensor-parallel-size", str(args.tp)]
        if gpu_mem is not None:
            cmd += ["--gpu-memory-utilization", f"{gpu_mem:.3f}"]
        if args.gpu:
            cmd += ["--max-num-seqs", str(args.max_num_seqs)]  # one request at a time: fewer graphs to capture
        if args.netns:
            env["UCX_NET_DEVICES"] = VETH_P if prefill else VETH_D
            env.setdefault("UCX_TLS", "tcp")
            cmd = ["ip", "netns", "exec", args.p_ns if prefill else args.d_ns, *cmd]
        if ucx_tls:
            env["UCX_TLS"] = ucx_tls
        if args.ucx_proto_info and spec.connector is not None:
            env["UCX_PROTO_INFO"] = "y"  # UCX logs the protocol it picks (cuda_ipc, or tcp with host staging)
        if spec.cpus:
            env["OMP_NUM_THREADS"] = str(len(spec.cpus))
        self.logpath = logdir / f"{spec.name}.log"
        self.log = open(self.logpath, "wb")  # noqa: SIM115 - closed in stop()
        cpus = spec.cpus
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)

    def wait(self, timeout: float) -> None:
        try:
            wait_healthy(self.proc, self.url, timeout, self.name)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{e}; see {self.logpath}") from None

    def info(self) -> dict:
        return CLIENT.get(f"{self.url}/pdserve/info").json()

    def stop(self) -> None:
        stop(self.proc)
        self.log.close()


def kv_config(connector: str, role: str, **extra) -> dict:
    # slow links: per-transfer deadlines far above any wire time here
    return {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": {
        "transfer_timeout_s": 300.0, "handshake_timeout_s": 30.0, "transfer_min_gbps": 0.001,
        "kv_lease_duration": 600.0, "push_registration_timeout": 600.0, **extra}}


PUSH = "NixlPushConnector"
SPECS = {  # name -> (connector, role, extra)
    "pull-p": ("NixlConnector", "kv_producer", {}),
    "pull-d": ("NixlConnector", "kv_consumer", {}),
    "push-request-p": (PUSH, "kv_producer", {"push_pipeline": "request"}),
    "push-layer-p": (PUSH, "kv_producer", {"push_pipeline": "layer", "push_layerwise_min_tokens": 0}),
    "push-d": (PUSH, "kv_consumer", {}),
}
PAIRS = {"pull": ("pull-p", "pull-d"), "push-request": ("push-request-p", "push-d"),
         "push-layer": ("push-layer-p", "push-d")}


# ---- timing ------------------------------------------------------------------------------------------------

@dataclass
class Timed:
    ttft: float
    t2: float  # the second token
    tps: float  # decode tokens/s after the first token
    prefill: float  # the prefill leg answered (collocated: the first token), s after the start


def stream(url: str, body: dict, t0: float, rid: str, into: dict) -> None:
    times: list[float] = []
    ids: list[int] = []
    with CLIENT.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for ch in chunk.get("choices", []):
                    got = ch.get("token_ids") or []
                    ids.extend(got)
                    n = len(got) or (1 if ch.get("text") else 0)
                    times.extend([time.monotonic() - t0] * n)
    into["times"] = times
    into["ids"] = ids


def timed(times: list[float], prefill: float | None = None) -> Timed:
    assert len(times) >= 3, times
    return Timed(times[0], times[1], (len(times) - 1) / (times[-1] - times[0]),
                 times[0] if prefill is None else prefill)


def body_for(prompt_len: int, output_len: int, i: int) -> dict:
    ids = [(1000 + 7919 * i + 31 * j) % 30000 + 100 for j in range(prompt_len)]
    return {"model": "bench", "prompt": ids, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}


def one_collocated(inst: Instance, body: dict, tag: str) -> tuple[Timed, list[int]]:
    got: dict = {}
    stream(inst.url, body, time.monotonic(), f"colo-{tag}-{uuid.uuid4().hex[:8]}", got)
    return timed(got["times"]), got["ids"]


def one_pull(p: Instance, d: Instance, body: dict, tag: str) -> tuple[Timed, list[int]]:
    rid, got = f"pull-{tag}-{uuid.uuid4().hex[:8]}", {}
    t0 = time.monotonic()
    leg = threading.Thread(target=stream, args=(d.url, build_decode_body(body, early_decode_params(rid)), t0,
                                                rid, got))
    prefill = CLIENT.build_request("POST", f"{p.url}/v1/completions", json=build_prefill_body(body),
                                   headers={"X-Request-Id": rid})
    leg.start()
    try:
        params = CLIENT.send(prefill).json()["kv_transfer_params"]
        prefilled = time.monotonic() - t0
        CLIENT.post(f"{d.url}{KV_PARAMS_PATH}", json=params_delivery(rid, params)).raise_for_status()
    finally:
        leg.join(900)
    return timed(got["times"], prefilled), got["ids"]


def one_push(p: Instance, d: Instance, body: dict, info: dict) -> tuple[Timed, list[int]]:
    key, got = uuid.uuid4().hex, {}
    dparams = push_decode_params(key, engine_id=info["engine_id"], host=info["side_channel_host"],
                                 port=info["side_channel_port"], tp_size=info.get("tensor_parallel_size", 1))
    t0 = time.monotonic()
    leg = threading.Thread(target=stream, args=(d.url, build_decode_body(body, dparams), t0, f"push-{key}", got))
    leg.start()
    try:
        CLIENT.post(f"{p.url}/v1/completions", json=build_prefill_body(body, push_key=key),
                    headers={"X-Request-Id": f"pushp-{key}"}).raise_for_status()
        prefilled = time.monotonic() - t0
    finally:
        leg.join(900)
    return timed(got["times"], prefilled), got["ids"]


def med(xs: list[float]) -> float:
    return statistics.median(xs)


# ---- instrumentation ---------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(url: str) -> dict[str, float]:
    """A server's /metrics, each metric summed over its label sets."""
    out: dict[str, float] = {}
    for line in CLIENT.get(f"{url}/metrics").text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def writer_stats(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    """Per timed request: where the push prefill's WRITE time went (pdserve/kv_transfer/push_stats.py)."""
    def d(name: str) -> float:
        key = f"pdserve:kv_push_writer_{name}_total"
        return after.get(key, 0.0) - before.get(key, 0.0)

    posts = d("posts") or 1.0
    done = d("writes_done") or 1.0
    return {
        "writes": d("posts") / n, "writes_during_prefill": d("posts_during_prefill") / n,
        "descriptors": d("descriptors") / n, "layers_per_write": d("layers") / posts,
        "slabs_per_descriptor": d("block_layers") / (d("descriptors") or 1.0),
        "mib_per_write": d("bytes") / posts / 2**20, "build_ms": d("build_seconds") / n * 1e3,
        "post_ms": d("post_seconds") / n * 1e3, "wait_ms": d("ready_wait_seconds") / n * 1e3,
        "waits": d("ready_waits") / n, "write_ms_avg": d("write_seconds") / done * 1e3,
        "tail_ms": d("tail_seconds") / (d("jobs_done") or 1.0) * 1e3,
    }


def read_stats(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    """Per timed request: the pull decode's NIXL READs (vLLM's nixl metrics)."""
    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    reads = d("vllm:nixl_xfer_time_seconds_count") or 1.0
    return {"reads": d("vllm:nixl_xfer_time_seconds_count") / n,
            "descriptors": d("vllm:nixl_num_descriptors_sum") / n,
            "mib_per_read": d("vllm:nixl_bytes_transferred_sum") / reads / 2**20,
            "post_ms": d("vllm:nixl_post_time_seconds_sum") / n * 1e3,
            "xfer_ms_avg": d("vllm:nixl_xfer_time_seconds_sum") / reads * 1e3}


_UCX_ROW = re.compile(r"^\[\d+\.\d+\] \[[^\]]*\]\s+\|(.*)\|\s*$")


def ucx_protocols(path: Path, limit: int = 12) -> list[str]:
    """The RMA protocols UCX_PROTO_INFO logged (its tables of `remote memory write/read`: which transport, CUDA
    IPC or TCP with host staging, for which sizes), one line per table, deduplicated."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    tables: list[list[str]] = []
    for line in text.splitlines():
        m = _UCX_ROW.match(line)
        if m is None:
            continue
        cells = [c.strip() for c in m.group(1).split("|")]
        if len(cells) == 1 and "cfg#" in cells[0]:
            tables.append([cells[0]])  # a table's first header row names the endpoint configuration
        elif tables:
            tables[-1].append(" ".join(c for c in cells if c))
    out: list[str] = []
    for t in tables:
        if len(t) > 1 and "remote memory" in t[1]:
            rows = [r for r in t[2:] if r and not r.startswith("Range")]
            line = f"{t[1]}: " + "; ".join(rows)
            if line not in out:
                out.append(line)
    return out[:limit]


# ---- one pass: a set of instances serving every prompt length -----------------------------------------------

class StartupFailed(RuntimeError):
    """A server of the pass did not start (on the GPU: perhaps five at once did not fit)."""


class Budget:
    def __init__(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()


def agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens two answers share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run_pass(args: argparse.Namespace, link: str, ucx_tls: str | None, lens: list[int], res: dict,
             budget: Budget, logdir: Path) -> None:
    """Starts the pass's instances (in groups), measures every mode at every length, stops them."""
    modes = [m for m in MODES if m in args.modes]
    names = sorted({n for m in modes for n in PAIRS[m]})
    if args.gpu:
        colo_name = "pull-d" if "pull-d" in names else "push-d"
        together = args.together if args.together is not None else gpu_gib() >= BIG_GPU_GIB
        groups = [names] if together else [[n for n in names if n.startswith("pull")],
                                           [n for n in names if n.startswith("push")]]
        groups = [g for g in groups if g]
    else:  # CPU: one mode at a time, pinned (prefill core 0, decode core 1, collocated core 0) unless TP > 1
        colo_name = "collocated"
        groups = [["collocated"], *[list(PAIRS[m]) for m in modes]]
    out = res["passes"].setdefault(link, {"ucx_tls": ucx_tls, "lengths": {}})
    max_len = max(lens) + args.output_len + 64
    colo_done = False
    for group in groups:
        if budget.left() < args.min_group_s:
            out["skipped"] = f"budget: {budget.left():.0f} s left before starting {group}"
            print(f"[{link}] skipping {group}: {out['skipped']}", flush=True)
            return
        gpu_mem = args.gpu_memory_utilization or (0.9 / max(len(group), 2)) if args.gpu else None
        insts: dict[str, Instance] = {}
        t0 = time.monotonic()
        try:
            for name in group:
                pin = not args.gpu and args.tp == 1
                if name == "collocated":
                    spec = Spec(name, cpus={0} if pin else None)
                else:
                    connector, role, extra = SPECS[name]
                    cpus = ({0} if role == "kv_producer" else {1 % (os.cpu_count() or 1)}) if pin else None
                    spec = Spec(name, connector, role, dict(extra), cpus)
                insts[name] = Instance(spec, args, logdir / link, ucx_tls=ucx_tls, gpu_mem=gpu_mem,
                                       max_model_len=max_len)
            try:
                for inst in insts.values():
                    inst.wait(max(30.0, min(900.0, budget.left())))
            except RuntimeError as exc:
                raise StartupFailed(str(exc)) from None
            started = time.monotonic() - t0
            print(f"[{link}] {', '.join(group)} ready in {started:.0f} s", flush=True)
            out.setdefault("start_s", []).append(round(started, 1))
            if res["kv_bytes_per_token"] is None:
                res["kv_bytes_per_token"] = kv_bytes_per_token(next(iter(insts.values())).info())
            for plen in lens:
                if budget.left() < args.min_row_s:
                    out.setdefault("skipped_lengths", []).append(plen)
                    continue
                row = out["lengths"].setdefault(str(plen), {"modes": {}, "check": {}, "stats": {}})
                run_rows(args, insts, group, colo_name if not colo_done else None, modes, plen, row)
                if args.netns and not colo_done and res.get("link_mbit") is None:
                    set_rate(args, res, plen, row)
                write_json(args, res)
            colo_done = colo_done or colo_name in group
        finally:
            if args.ucx_proto_info:
                for name, inst in insts.items():
                    if name != "collocated":
                        out.setdefault("ucx", {})[name] = ucx_protocols(inst.logpath)
            for inst in insts.values():  # all at once: their graceful drains overlap
                if inst.proc.poll() is None:
                    inst.proc.send_signal(signal.SIGTERM)
            for inst in insts.values():
                inst.stop()


def run_rows(args: argparse.Namespace, insts: dict[str, Instance], group: list[str], colo: str | None,
             modes: list[str], plen: int, row: dict) -> None:
    n = args.num_requests
    check = body_for(plen, args.output_len, 0)  # the same prompt in every mode: its answers are compared
    bodies = [body_for(plen, args.output_len, 1 + i) for i in range(n)]
    if colo in insts:
        inst = insts[colo]
        _, row["check"]["collocated"] = one_collocated(inst, check, "check")
        row["modes"]["collocated"] = [asdict(one_collocated(inst, b, str(i))[0]) for i, b in enumerate(bodies)]
    for mode in modes:
        pname, dname = PAIRS[mode]
        if pname not in group or dname not in group:
            continue
        p, d = insts[pname], insts[dname]
        if mode == "pull":
            def one(b: dict, tag: str, p=p, d=d) -> tuple[Timed, list[int]]:
                return one_pull(p, d, b, tag)
            watch = d
        else:
            info = p.info()

            def one(b: dict, tag: str, p=p, d=d, info=info) -> tuple[Timed, list[int]]:
                return one_push(p, d, b, info)
            watch = p
        try:
            _, row["check"][mode] = one(check, "check")  # also the warm-up
            before = scrape(watch.url)
            row["modes"][mode] = [asdict(one(b, str(i))[0]) for i, b in enumerate(bodies)]
            after = scrape(watch.url)
            row["stats"][mode] = (read_stats if mode == "pull" else writer_stats)(before, after, n)
            print(f"  {plen} tokens, {mode}: done", flush=True)
        except (httpx.HTTPError, AssertionError, KeyError) as exc:  # a failed row: the others still run
            row.setdefault("errors", {})[mode] = f"{type(exc).__name__}: {exc}"
            print(f"  {plen} tokens, {mode}: FAILED {exc}", flush=True)


def set_rate(args: argparse.Namespace, res: dict, plen: int, row: dict) -> None:
    """--netns: shape the veth once collocated's prefill time is known (auto: wire time = prefill time)."""
    prefill_s = med([t["ttft"] for t in row["modes"]["collocated"]])
    mbit = res["kv_bytes_per_token"] * plen * 8 / prefill_s / 1e6 if args.rate_mbit == "auto" \
        else float(args.rate_mbit)
    shape(args.p_ns, args.d_ns, mbit)
    res["link_mbit"] = mbit


def gpu_gib() -> float:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return float(out.split()[0]) / 1024
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0.0


def kv_bytes_per_token(info: dict) -> int:
    """From an instance's /pdserve/info (the 8B shape: 128 KiB in bf16)."""
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}.get(info["kv_cache_dtype"], 1)  # fp8: 1 byte (+ scales)
    return info["num_layers"] * 2 * info["num_kv_heads"] * info["head_dim"] * elem


def write_json(args: argparse.Namespace, res: dict) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))


# ---- report ------------------------------------------------------------------------------------------------

def summarize(row: dict) -> dict[str, dict]:
    base = row["modes"].get("collocated")
    out = {}
    for name, rs in row["modes"].items():
        ttft, t2 = med([t["ttft"] for t in rs]), med([t["t2"] for t in rs])
        r = {"ttft_ms": ttft * 1e3, "t2_ms": t2 * 1e3, "decode_tps": med([t["tps"] for t in rs]),
             "prefill_ms": med([t["prefill"] for t in rs]) * 1e3}
        if base:
            r["ttft_added_ms"] = (ttft - med([t["ttft"] for t in base])) * 1e3
            r["t2_added_ms"] = (t2 - med([t["t2"] for t in base])) * 1e3
            # robust to the prefill's own run-to-run noise: the second token after this mode's prefill leg
            # answered, less collocated's gap from its first token (one decode step)
            r["handoff_ms"] = (med([t["t2"] - t["prefill"] for t in rs]) - med([t["t2"] - t["ttft"] for t in base])) * 1e3
        out[name] = r
    return out


def check_verdict(check: dict[str, list[int]]) -> tuple[list[str], bool]:
    """Lines about the check request's answers, and False when the two push modes disagree (a transport bug:
    the decode must get the same bytes either way)."""
    lines, ok = [], True
    colo = check.get("collocated")
    for mode, ids in check.items():
        if mode != "collocated" and colo is not None:
            lines.append(f"{mode}: {agree(ids, colo)}/{len(colo)} tokens as collocated")
    a, b = check.get("push-layer"), check.get("push-request")
    if a is not None and b is not None:
        ok = a == b
        lines.append(f"push-layer vs push-request: {'identical' if ok else f'DIFFER after {agree(a, b)} tokens'}")
    if a is not None and check.get("pull") is not None:
        lines.append(f"push-layer vs pull: {agree(a, check['pull'])}/{len(a)} tokens agree")
    return lines, ok


def show(res: dict) -> bool:
    ok = True
    for link, p in res["passes"].items():
        for plen, row in p["lengths"].items():
            if not row["modes"]:
                continue
            kv = (res["kv_bytes_per_token"] or 0) * int(plen)
            print(f"\n[{link}] prompt {plen} tokens, output {res['output_len']}, {res['num_requests']} timed requests"
                  f" per mode; KV {kv / 2**20:.1f} MiB per request"
                  + (f"; link {res['link_mbit']:.1f} Mbit/s" if res.get("link_mbit") else ""))
            print(f"{'mode':<14}{'TTFT ms':>10}{'+TTFT ms':>10}{'2nd tok ms':>12}{'+2nd ms':>10}{'decode tok/s':>14}"
                  f"{'prefill ms':>12}{'2nd after prefill, +ms':>24}")
            summary = summarize(row)
            row["summary"] = summary
            for name, r in summary.items():
                print(f"{name:<14}{r['ttft_ms']:>10.0f}{r.get('ttft_added_ms', 0):>10.0f}{r['t2_ms']:>12.0f}"
                      f"{r.get('t2_added_ms', 0):>10.0f}{r['decode_tps']:>14.1f}{r['prefill_ms']:>12.0f}"
                      f"{r.get('handoff_ms', 0):>24.0f}")
            for mode, st in row["stats"].items():
                print(f"  {mode} " + ", ".join(f"{k}={v:.3g}" for k, v in st.items()))
            lines, good = check_verdict(row["check"])
            ok = ok and good
            for line in lines:
                print(f"  check: {line}")
            if res.get("link_mbit") and "collocated" in summary and "pull" in summary and "push-layer" in summary:
                wire = kv * 8 / (res["link_mbit"] * 1e6) * 1e3
                bound = min(wire, summary["collocated"]["ttft_ms"])
                for col, what in (("t2_added_ms", "added over collocated"), ("handoff_ms", "after the prefill leg")):
                    pull, layer = summary["pull"][col], summary["push-layer"][col]
                    print(f"second token, {what}: layer-pipelined push saves {pull - layer:.0f} ms against pull = "
                          f"{(pull - layer) / bound * 100:.0f}% of min(wire, prefill) = {bound:.0f} ms (goal >= 80%)")
        for name, lines in p.get("ucx", {}).items():
            if lines:
                print(f"\n[{link}] UCX_PROTO_INFO, {name}:")
                for line in lines:
                    print(f"  {line}")
        for mode, err in ((m, e) for row in p["lengths"].values() for m, e in row.get("errors", {}).items()):
            print(f"[{link}] {mode} failed: {err}")
        if p.get("error"):
            print(f"[{link}] pass failed: {p['error']}")
        if p.get("skipped") or p.get("skipped_lengths"):
            print(f"[{link}] skipped: {p.get('skipped', '')} {p.get('skipped_lengths', '')}")
    return ok


# ---- main --------------------------------------------------------------------------------------------------

def measure(args: argparse.Namespace) -> dict:
    logdir = Path(tempfile.mkdtemp(prefix="bench-pd-push-"))
    budget = Budget(args.budget_s)
    res = {"prompt_lens": args.prompt_lens, "output_len": args.output_len, "num_requests": args.num_requests,
           "tensor_parallel_size": args.tp,
           "kv_bytes_per_token": None, "link_mbit": None, "logs": str(logdir), "passes": {}}
    first = ("netns" if args.netns else "local") if not args.gpu else "cuda_ipc"
    passes = [(f"ucx_tls={args.ucx_tls}" if args.ucx_tls else first, args.ucx_tls, args.prompt_lens)]
    if args.gpu and args.tcp_prompt_lens:
        passes.append(("tcp", TCP_TLS, args.tcp_prompt_lens))
    for link, tls, lens in passes:
        (logdir / link).mkdir(exist_ok=True)
        for attempt in (1, 2):
            try:
                run_pass(args, link, tls, lens, res, budget, logdir)
                break
            except StartupFailed as exc:
                if attempt == 1 and args.gpu and args.together is not False:
                    # five instances at once did not start: the pull pair, then the push trio (here and after)
                    (logdir / link).rename(logdir / f"{link}-together")  # its logs, for the record
                    (logdir / link).mkdir()
                    print(f"[{link}] did not start together ({exc}; logs in {link}-together); again in two "
                          f"groups", flush=True)
                    args.together = False
                    res["passes"].pop(link, None)
                    continue
                res["passes"].setdefault(link, {"lengths": {}})["error"] = f"StartupFailed: {exc}"
                print(f"[{link}] failed: {exc}", flush=True)
            except Exception as exc:  # noqa: BLE001 - one GPU call: keep what the other passes measured
                res["passes"].setdefault(link, {"lengths": {}})["error"] = f"{type(exc).__name__}: {exc}"
                print(f"[{link}] failed: {exc}", flush=True)
            break
        write_json(args, res)
    return res


def even_heads_model(root: Path) -> Path:
    """SmolLM2-135M's shape (576 wide, 30 layers, MLP 1536, tied embeddings, its tokenizer) with 12 heads of 48
    and 4 KV heads, random weights: splits at TP=2 and 4 with SmolLM2's FLOPs and KV bytes per token."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from server_utils import make_model_dir  # the tests' random Llama builder, SmolLM2's tokenizer copied in

    return make_model_dir(root, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=12, num_key_value_heads=4, tie=True, max_position_embeddings=8192)


def lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or packaged shape (default: the embedded SmolLM2)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--prompt-len", default="1024", help="prompt lengths, comma-separated (in this order)")
    ap.add_argument("--tcp-prompt-lens", default="",
                    help=f"--gpu: then these lengths again with UCX_TLS={TCP_TLS} (e.g. 8192; empty: none)")
    ap.add_argument("--modes", default=",".join(MODES), help="which of pull,push-request,push-layer")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=4, help="timed requests per mode and length (after a check"
                                                                 " request, the same prompt in every mode)")
    ap.add_argument("--tp", type=int, default=1, help="--tensor-parallel-size of every instance (collocated too)")
    ap.add_argument("--even-heads-model", action="store_true",
                    help="random weights of SmolLM2-135M's shape with 12 heads / 4 KV heads (for --tp 2)")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="each instance's share (default: 0.9 / the instances sharing the GPU at once)")
    ap.add_argument("--together", action=argparse.BooleanOptionalAction, default=None,
                    help=f"--gpu: start the pull and push instances at once (default: when the GPU has >= "
                         f"{BIG_GPU_GIB} GiB)")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="--gpu: the servers' (fewer decode graphs)")
    ap.add_argument("--ucx-tls", default=None, help="UCX_TLS for the instances (e.g. tcp,cuda_copy,self)")
    ap.add_argument("--ucx-proto-info", action=argparse.BooleanOptionalAction, default=None,
                    help="UCX_PROTO_INFO=y on the KV instances and print the protocols picked (default: with --gpu)")
    ap.add_argument("--budget-s", type=float, default=float(os.environ["SECTION_BUDGET_S"]) - 10
                    if os.environ.get("SECTION_BUDGET_S") else None,
                    help="wall-clock budget: what would not finish is skipped (default: $SECTION_BUDGET_S - 10)")
    ap.add_argument("--min-group-s", type=float, default=60.0, help="budget needed to start a group of servers")
    ap.add_argument("--min-row-s", type=float, default=15.0, help="budget needed to measure one prompt length")
    ap.add_argument("--netns", action="store_true", help="prefill and decode in two shaped network namespaces")
    ap.add_argument("--rate-mbit", default="auto", help="the veth's rate in Mbit/s, or auto (wire time = prefill)")
    ap.add_argument("--serve-arg", action="append", default=[])
    ap.add_argument("--json", default=None, help="also write the results here (rewritten after every row)")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--p-ns", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--d-ns", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.prompt_lens = lengths(args.prompt_len)
    args.tcp_prompt_lens = lengths(args.tcp_prompt_lens)
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.prompt_lens:
        ap.error(f"unknown modes {bad} (pick from {MODES})" if bad else "no prompt length")
    if args.ucx_proto_info is None:
        args.ucx_proto_info = args.gpu
    args.secret = os.environ.get("PDSERVE_KV_SECRET") or secrets.token_hex(32)
    if args.even_heads_model and args.model is None:  # built once, outside the namespaces (passed in by --model)
        args.model = str(even_heads_model(Path(tempfile.mkdtemp(prefix="bench-pd-push-model-"))))
        sys.argv += ["--model", args.model]
    if args.netns and not args.inside:
        p_ns, d_ns = f"{NS_PREFIX}p-{os.getpid()}", f"{NS_PREFIX}d-{os.getpid()}"
        try:
            make_netns(p_ns, d_ns)
            # this client, the decode and the collocated instance live in the decode's namespace
            rc = subprocess.run(["ip", "netns", "exec", d_ns, sys.executable, *sys.argv, "--inside", "--p-ns", p_ns,
                                 "--d-ns", d_ns], env=dict(os.environ, PDSERVE_KV_SECRET=args.secret)).returncode
        finally:
            remove_netns(p_ns, d_ns)
        sys.exit(rc)
    res = measure(args)
    ok = show(res)
    write_json(args, res)
    if not ok:
        print("CHECK FAILED: layer-pipelined and whole-request push gave different tokens", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
