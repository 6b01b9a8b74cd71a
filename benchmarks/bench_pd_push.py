"""Pull vs whole-request push vs layer-pipelined push, side by side in one run (issue 34), against collocated.

What the user waits for: TTFT, and the time to the SECOND token (with the first-token handoff a pull decode
emits the prefill's token at once, so TTFT hides the transfer; the second token waits for the KV), each as
added over collocated, and decode tokens/s. Requests go one at a time, distinct prompts (no cache helps).
Each mode gets its own prefill and decode processes (started, measured, stopped); the client plays the
proxy: pull sends the decode leg with the prefill leg and delivers the params after the prefill (the early
decode leg, as `pdserve proxy` does), push sends both legs at once with a push key (`pdserve proxy
--kv-transfer-mode push`).

CPU box (`--netns`, needs root): the prefill runs in network namespace pdpush-p-<pid>, the decode, the
collocated instance and this client in pdpush-d-<pid>, joined by a veth pair in 10.199.0.0/24 shaped with
`tc qdisc ... tbf` on both ends; `--rate-mbit auto` sets the rate so that one request's KV takes about as
long on the wire as its prefill (measured on the collocated instance first). UCX runs over TCP on the veth
(UCX_TLS=tcp: no shared memory between the namespaces). Namespaces are removed on exit.

    # CPU (SmolLM2 default; prefill on core 0, decode on core 1, collocated on core 0)
    sudo python benchmarks/bench_pd_push.py --netns --rate-mbit auto --prompt-len 1024 --output-len 32
    # H200, one GPU shared (NIXL over CUDA IPC), 8B shape, dummy weights
    python benchmarks/bench_pd_push.py --gpu --model Llama-3.1-8B --load-format dummy \
        --prompt-len 8192 --output-len 64 --num-requests 5
    # H200 with UCX on TCP (no GPUDirect): add --ucx-tls tcp,cuda_copy,self
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
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
    push_decode_params,
)

NS_PREFIX = "pdpush-"
P_ADDR, D_ADDR = "10.199.0.1", "10.199.0.2"
VETH_P, VETH_D = "pdpush-vp", "pdpush-vd"
CLIENT = httpx.Client(timeout=900, trust_env=False)


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

class Instance:
    def __init__(self, name: str, args: argparse.Namespace, logdir: Path, *, kv: dict | None = None,
                 role: str = "collocated", cpus: set[int] | None = None) -> None:
        self.name = name
        self.host = P_ADDR if (args.netns and role == "prefill") else (D_ADDR if args.netns else "127.0.0.1")
        self.port = free_port()  # in a namespace of its own (--netns) any port is free; else a free one here
        self.url = f"http://{self.host}:{self.port}"
        cmd = [sys.executable, "-m", "pdserve", "serve", *([args.model] if args.model else []), "--host", self.host,
               "--port", str(self.port), "--served-model-name", "bench", "--max-model-len",
               str(args.prompt_len + args.output_len + 64), "--disable-uvicorn-access-log",
               "--load-format", args.load_format, "--no-enable-prefix-caching", *args.serve_arg]
        env = dict(os.environ, PDSERVE_KV_SECRET=args.secret)
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv), "--side-channel-host", self.host,
                    "--side-channel-port", str(free_port())]
        if args.gpu:
            cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        if args.netns:
            env["UCX_NET_DEVICES"] = VETH_P if role == "prefill" else VETH_D
            env.setdefault("UCX_TLS", "tcp")
            cmd = ["ip", "netns", "exec", args.p_ns if role == "prefill" else args.d_ns, *cmd]
        if args.ucx_tls:
            env["UCX_TLS"] = args.ucx_tls
        if cpus:
            env["OMP_NUM_THREADS"] = str(len(cpus))
        self.log = open(logdir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)

    def wait(self) -> None:
        try:
            wait_healthy(self.proc, self.url, 900, self.name)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; see {self.log.name}") from None

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


# ---- timing ------------------------------------------------------------------------------------------------

@dataclass
class Timed:
    ttft: float
    t2: float  # the second token
    tps: float  # decode tokens/s after the first token
    prefill: float  # the prefill leg answered (collocated: the first token), s after the start


def stream(url: str, body: dict, t0: float, rid: str, into: dict) -> None:
    times: list[float] = []
    with CLIENT.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for ch in chunk.get("choices", []):
                    n = len(ch.get("token_ids") or []) or (1 if ch.get("text") else 0)
                    times.extend([time.monotonic() - t0] * n)
    into["times"] = times


def timed(times: list[float], prefill: float | None = None) -> Timed:
    assert len(times) >= 3, times
    return Timed(times[0], times[1], (len(times) - 1) / (times[-1] - times[0]),
                 times[0] if prefill is None else prefill)


def body_for(args: argparse.Namespace, i: int) -> dict:
    ids = [(1000 + 7919 * i + 31 * j) % 30000 + 100 for j in range(args.prompt_len)]
    return {"model": "bench", "prompt": ids, "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}


def run_collocated(inst: Instance, args: argparse.Namespace, offset: int) -> list[Timed]:
    out = []
    for i in range(args.num_requests + 1):
        got: dict = {}
        stream(inst.url, body_for(args, offset + i), time.monotonic(), f"colo-{offset + i}", got)
        if i:
            out.append(timed(got["times"]))
    return out


def run_pull(p: Instance, d: Instance, args: argparse.Namespace, offset: int) -> list[Timed]:
    out = []
    for i in range(args.num_requests + 1):
        body, rid, got = body_for(args, offset + i), f"pull-{offset + i}", {}
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
        if i:
            out.append(timed(got["times"], prefilled))
    return out


def run_push(p: Instance, d: Instance, args: argparse.Namespace, offset: int) -> list[Timed]:
    info = p.info()
    out = []
    for i in range(args.num_requests + 1):
        body, key, got = body_for(args, offset + i), uuid.uuid4().hex, {}
        dparams = push_decode_params(key, engine_id=info["engine_id"], host=info["side_channel_host"],
                                     port=info["side_channel_port"])
        t0 = time.monotonic()
        leg = threading.Thread(target=stream, args=(d.url, build_decode_body(body, dparams), t0, f"push-{key}", got))
        leg.start()
        try:
            CLIENT.post(f"{p.url}/v1/completions", json=build_prefill_body(body, push_key=key),
                        headers={"X-Request-Id": f"pushp-{key}"}).raise_for_status()
            prefilled = time.monotonic() - t0
        finally:
            leg.join(900)
        if i:
            out.append(timed(got["times"], prefilled))
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs)


# ---- main --------------------------------------------------------------------------------------------------

def measure(args: argparse.Namespace) -> dict:
    logdir = Path(tempfile.mkdtemp(prefix="bench-pd-push-"))
    gpu = args.gpu
    one = None if gpu else {0}
    two = None if gpu else {1 % (os.cpu_count() or 1)}
    results: dict[str, list[Timed]] = {}
    colo = Instance("collocated", args, logdir, cpus=one)
    try:
        colo.wait()
        results["collocated"] = run_collocated(colo, args, 0)
        info = colo.info()
    finally:
        colo.stop()
    bpt = info["num_layers"] * 2 * info["num_kv_heads"] * info["head_dim"] * (4 if info["dtype"] == "float32" else 2)
    kv_bytes = bpt * args.prompt_len
    prefill_s = med([t.ttft for t in results["collocated"]])
    mbit = None
    if args.netns:
        mbit = kv_bytes * 8 / prefill_s / 1e6 if args.rate_mbit == "auto" else float(args.rate_mbit)
        shape(args.p_ns, args.d_ns, mbit)
    modes = [("pull", "NixlConnector", {}, run_pull),
             ("push-request", "NixlPushConnector", {"push_pipeline": "request"}, run_push),
             ("push-layer", "NixlPushConnector", {"push_pipeline": "layer"}, run_push)]
    for k, (name, connector, extra, run) in enumerate(modes, start=1):
        p = Instance(f"{name}-prefill", args, logdir, kv=kv_config(connector, "kv_producer", **extra),
                     role="prefill", cpus=one)
        d = Instance(f"{name}-decode", args, logdir, kv=kv_config(connector, "kv_consumer"), role="decode",
                     cpus=two)
        try:
            p.wait()
            d.wait()
            results[name] = run(p, d, args, 1000 * k)
        finally:
            p.stop()
            d.stop()
    base = results["collocated"]
    rows = {}
    for name, rs in results.items():
        rows[name] = {
            "ttft_ms": med([t.ttft for t in rs]) * 1e3,
            "t2_ms": med([t.t2 for t in rs]) * 1e3,
            "ttft_added_ms": (med([t.ttft for t in rs]) - med([t.ttft for t in base])) * 1e3,
            "t2_added_ms": (med([t.t2 for t in rs]) - med([t.t2 for t in base])) * 1e3,
            "decode_tps": med([t.tps for t in rs]),
            # robust to the prefill's own run-to-run noise (a shared box): the second token after this mode's
            # prefill leg answered, less collocated's gap from its first token (one decode step)
            "prefill_ms": med([t.prefill for t in rs]) * 1e3,
            "handoff_ms": (med([t.t2 - t.prefill for t in rs]) - med([t.t2 - t.ttft for t in base])) * 1e3,
        }
    return {"prompt_len": args.prompt_len, "output_len": args.output_len, "num_requests": args.num_requests,
            "kv_bytes_per_request": kv_bytes, "collocated_prefill_ms": prefill_s * 1e3,
            "link_mbit": mbit, "wire_ms": kv_bytes * 8 / (mbit * 1e6) * 1e3 if mbit else None,
            "logs": str(logdir), "modes": rows}


def show(res: dict) -> None:
    print(f"\nprompt {res['prompt_len']} tokens, output {res['output_len']}, {res['num_requests']} requests per mode;"
          f" KV {res['kv_bytes_per_request'] / 2**20:.1f} MiB per request; collocated prefill "
          f"{res['collocated_prefill_ms']:.0f} ms" + (f"; link {res['link_mbit']:.1f} Mbit/s (wire "
                                                       f"{res['wire_ms']:.0f} ms)" if res["link_mbit"] else ""))
    print(f"{'mode':<14}{'TTFT ms':>10}{'+TTFT ms':>10}{'2nd tok ms':>12}{'+2nd ms':>10}{'decode tok/s':>14}"
          f"{'prefill ms':>12}{'2nd after prefill, +ms':>24}")
    for name, r in res["modes"].items():
        print(f"{name:<14}{r['ttft_ms']:>10.0f}{r['ttft_added_ms']:>10.0f}{r['t2_ms']:>12.0f}{r['t2_added_ms']:>10.0f}"
              f"{r['decode_tps']:>14.1f}{r['prefill_ms']:>12.0f}{r['handoff_ms']:>24.0f}")
    bound = min(res["wire_ms"] or 0.0, res["collocated_prefill_ms"])
    if bound:
        for col, what in (("t2_added_ms", "added over collocated"), ("handoff_ms", "after the prefill leg")):
            pull, layer = res["modes"]["pull"][col], res["modes"]["push-layer"][col]
            print(f"second token, {what}: layer-pipelined push saves {pull - layer:.0f} ms against pull = "
                  f"{(pull - layer) / bound * 100:.0f}% of min(wire, prefill) = {bound:.0f} ms (goal >= 80%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=4)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--ucx-tls", default=None, help="UCX_TLS for the instances (e.g. tcp,cuda_copy,self)")
    ap.add_argument("--netns", action="store_true", help="prefill and decode in two shaped network namespaces")
    ap.add_argument("--rate-mbit", default="auto", help="the veth's rate in Mbit/s, or auto (wire time = prefill)")
    ap.add_argument("--serve-arg", action="append", default=[])
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--p-ns", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--d-ns", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.secret = os.environ.get("PDSERVE_KV_SECRET") or secrets.token_hex(32)
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
    show(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
