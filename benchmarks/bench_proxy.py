"""Proxy overhead: `pdserve proxy` vs vLLM's toy proxy vs calling the backends directly.

Backends are stand-ins (`python -m pdserve.testing.standin`) on 127.0.0.1 that answer at once: the
prefill returns `kv_transfer_params`, the decode streams `--tokens` SSE events and `[DONE]`. So what is
measured is the proxy alone: requests/s at saturation (`--concurrency` streams in flight) and the
latency it adds at concurrency 1 (p50/p99 of request time minus the direct two-leg time, where "direct"
is this client doing the prefill leg then the decode leg itself). Targets are interleaved (one request
each in turn for latency, rounds for saturation) so that other load on the machine hits all alike.

vLLM's toy proxy is not part of this repository. Take it from a vLLM checkout (file
tests/v1/kv_connector/nixl_integration/toy_proxy_server.py of vllm-project/vllm; the numbers in
BENCHMARKS.md used commit 030ea52), outside this repository, then

    python benchmarks/bench_proxy.py --toy-proxy PATH/TO/toy_proxy_server.py

Without --toy-proxy (or when the file is absent) the toy proxy's rows are skipped. It runs with the
fastapi/uvicorn/httpx of this environment, as its own README command does (uvicorn access log on).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdserve.api.pd import build_decode_body, build_prefill_body  # noqa: E402

READY_TIMEOUT_S = 60.0


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(name: str, args: list[str], logdir: Path, ready: str | None, url: str | None = None) -> Server:
    log = logdir / f"{name}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{log.read_text(errors='replace')[-2000:]}")
        if ready is not None:
            match = re.search(ready + r" (http://[\d.]+:\d+)", log.read_text(errors="replace"))
            if match:
                return Server(name, proc, match.group(1), log)
        else:
            assert url is not None
            try:
                with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=0.5):
                    return Server(name, proc, url, log)
            except OSError:
                pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{name} did not become ready:\n{log.read_text(errors='replace')[-2000:]}")


@dataclass
class Result:
    target: str
    latencies_s: list[float] = field(default_factory=list)
    rps: float = 0.0
    cpu_ms_per_request: float | None = None  # the proxy process's CPU time per request at saturation
    errors: int = 0

    def pct(self, q: float) -> float:
        data = sorted(self.latencies_s)
        return data[min(len(data) - 1, int(round(q / 100 * (len(data) - 1))))]


def _body(tokens: int) -> dict[str, Any]:
    return {
        "model": "standin",
        "prompt": "The quick brown fox jumps over the lazy dog. " * 8,
        "max_tokens": tokens,
        "stream": True,
        "temperature": 0.0,
    }


async def _via_proxy(session: aiohttp.ClientSession, url: str, payload: bytes) -> bool:
    async with session.post(
        url + "/v1/completions", data=payload, headers={"Content-Type": "application/json"}
    ) as r:
        data = b"".join([chunk async for chunk in r.content.iter_any()])
        return r.status == 200 and data.endswith(b"data: [DONE]\n\n")


async def _direct(session: aiohttp.ClientSession, p_url: str, d_url: str, body: dict[str, Any]) -> bool:
    headers = {"Content-Type": "application/json", "X-Request-Id": os.urandom(8).hex()}
    async with session.post(
        p_url + "/v1/completions", data=json.dumps(build_prefill_body(body)), headers=headers
    ) as r:
        params = (await r.json())["kv_transfer_params"]
    payload = json.dumps(build_decode_body(body, params))
    async with session.post(d_url + "/v1/completions", data=payload, headers=headers) as r:
        data = b"".join([chunk async for chunk in r.content.iter_any()])
        return r.status == 200 and data.endswith(b"data: [DONE]\n\n")


async def _saturate(one: Any, n: int, concurrency: int) -> tuple[float, int]:
    """(seconds, errors) for n requests with `concurrency` in flight."""
    remaining = n
    errors = 0

    async def worker() -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            try:
                ok = await one()
            except aiohttp.ClientError:
                ok = False
            errors += not ok

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, errors


def _cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), None elsewhere."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _run(
    args: argparse.Namespace, targets: dict[str, str], p_url: str, d_url: str, pids: dict[str, int]
) -> list[Result]:
    """Targets are interleaved (latency: one request each in turn, rotating the order; saturation: rounds)
    so that a change in machine load hits every target alike."""
    body = _body(args.tokens)
    payload = json.dumps(body).encode()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        calls: dict[str, Any] = {"direct (P then D)": lambda: _direct(session, p_url, d_url, body)}
        for name, url in targets.items():
            calls[name] = lambda url=url: _via_proxy(session, url, payload)
        results = {name: Result(name) for name in calls}
        names = list(calls)
        for name in names:
            for _ in range(args.warmup):
                await calls[name]()
        for i in range(args.latency_requests):
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                t0 = time.perf_counter()
                ok = await calls[name]()
                results[name].latencies_s.append(time.perf_counter() - t0)
                results[name].errors += not ok
        per_round = max(1, args.requests // args.rounds)
        elapsed = dict.fromkeys(names, 0.0)
        cpu = dict.fromkeys(names, 0.0)
        for _ in range(args.rounds):
            for name in names:
                cpu0 = _cpu_seconds(pids.get(name))
                seconds, errors = await _saturate(calls[name], per_round, args.concurrency)
                cpu1 = _cpu_seconds(pids.get(name))
                if cpu0 is not None and cpu1 is not None:
                    cpu[name] += cpu1 - cpu0
                elapsed[name] += seconds
                results[name].errors += errors
        for name in names:
            results[name].rps = per_round * args.rounds / elapsed[name]
            if name in pids:
                results[name].cpu_ms_per_request = cpu[name] * 1e3 / (per_round * args.rounds)
    return [results[name] for name in names]


def _table(results: list[Result]) -> str:
    direct = results[0]
    base50, base99 = direct.pct(50), direct.pct(99)
    header = (
        f"{'target':<20} {'req/s @sat':>10} {'CPU ms/req':>10} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'added p50 ms':>12} {'added p99 ms':>12} {'errors':>6}"
    )
    lines = [header]
    for r in results:
        added50 = "" if r is direct else f"{(r.pct(50) - base50) * 1e3:.3f}"
        added99 = "" if r is direct else f"{(r.pct(99) - base99) * 1e3:.3f}"
        cpu = "" if r.cpu_ms_per_request is None else f"{r.cpu_ms_per_request:.3f}"
        lines.append(
            f"{r.target:<20} {r.rps:10.1f} {cpu:>10} {r.pct(50) * 1e3:8.3f} {r.pct(99) * 1e3:8.3f} "
            f"{added50:>12} {added99:>12} {r.errors:6d}"
        )
    ours = next((r for r in results if r.target.startswith("pdserve")), None)
    toy = next((r for r in results if r.target.startswith("vllm toy")), None)
    if ours is not None and toy is not None:
        lines.append("")
        lines.append(f"pdserve / toy requests/s at saturation: {ours.rps / toy.rps:.2f}x")
        if ours.cpu_ms_per_request and toy.cpu_ms_per_request:
            lines.append(
                f"toy / pdserve CPU per request:          {toy.cpu_ms_per_request / ours.cpu_ms_per_request:.2f}x"
            )
        ours_added, toy_added = ours.pct(50) - base50, toy.pct(50) - base50
        if ours_added > 0:
            lines.append(f"toy / pdserve added p50 latency:        {toy_added / ours_added:.2f}x")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--toy-proxy", default=None, help="path of vLLM's toy_proxy_server.py (skipped if absent)"
    )
    parser.add_argument("--requests", type=int, default=3000, help="requests per target at saturation")
    parser.add_argument("--concurrency", type=int, default=64, help="streams in flight at saturation")
    parser.add_argument("--latency-requests", type=int, default=1000, help="sequential requests per target")
    parser.add_argument("--rounds", type=int, default=3, help="saturation rounds, targets interleaved")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=4, help="SSE token events per decode stream")
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args()

    py = sys.executable
    logdir = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    servers: list[Server] = []
    try:
        standin = [py, "-m", "pdserve.testing.standin", "--port", "0"]
        p = _spawn("prefill", standin, logdir, "standin listening on")
        servers.append(p)
        d = _spawn("decode", standin, logdir, "standin listening on")
        servers.append(d)
        ours = _spawn(
            "pdserve-proxy",
            [
                py,
                "-m",
                "pdserve",
                "proxy",
                "--port",
                "0",
                "--prefill",
                p.url,
                "--decode",
                d.url,
                "--log-level",
                "warning",
                "--max-inflight",
                "100000",
            ],
            logdir,
            "pdserve proxy listening on",
        )
        servers.append(ours)
        targets = {"pdserve proxy": ours.url}
        proxies = {"pdserve proxy": ours}
        if args.toy_proxy and Path(args.toy_proxy).is_file():
            port = _free_port()
            p_port, d_port = p.url.rsplit(":", 1)[1], d.url.rsplit(":", 1)[1]
            toy = _spawn(
                "toy-proxy",
                [
                    py,
                    args.toy_proxy,
                    "--port",
                    str(port),
                    "--prefiller-hosts",
                    "127.0.0.1",
                    "--prefiller-ports",
                    p_port,
                    "--decoder-hosts",
                    "127.0.0.1",
                    "--decoder-ports",
                    d_port,
                ],
                logdir,
                None,
                url=f"http://127.0.0.1:{port}",
            )
            servers.append(toy)
            targets["vllm toy proxy"] = toy.url
            proxies["vllm toy proxy"] = toy
        else:
            print(f"toy proxy not found ({args.toy_proxy!r}): its rows are skipped", file=sys.stderr)
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        try:
            pids = {name: server.proc.pid for name, server in proxies.items()}
            results = loop.run_until_complete(_run(args, targets, p.url, d.url, pids))
        finally:
            loop.close()
    finally:
        for server in reversed(servers):
            server.stop()
    print(
        f"# bench_proxy: {args.requests} requests x {args.concurrency} concurrent ({args.rounds} rounds) for req/s; "
        f"{args.latency_requests} sequential per target for latency (interleaved); {args.tokens} SSE tokens per "
        f"stream; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} at the end"
    )
    print(_table(results))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "target": r.target,
                        "rps": r.rps,
                        "cpu_ms_per_request": r.cpu_ms_per_request,
                        "p50_s": r.pct(50),
                        "p99_s": r.pct(99),
                        "errors": r.errors,
                    }
                    for r in results
                ],
                indent=2,
            )
        )
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
