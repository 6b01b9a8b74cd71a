"""A chaos soak over a `PDCluster`: bounded load through the proxy while an injector runs faults on a schedule;
every answer is checked.

Load: `requests` completions at a fixed `rate` (request i starts at i / rate, whatever came before), each a
greedy prompt drawn from a fixed set, streamed or not, sent from the client host. Every 200 answer's token ids
are compared with the collocated reference's for that prompt. A request that gets no byte for `hung_s`
seconds is counted hung (the client gives up on it then).

Faults, round-robin, one at a time, every `fault_every_s` seconds, each held `fault_hold_s` seconds:
  cut-decode / cut-prefill   the host's link down (`ip link set DEV down` on its switch port), then up
  long-cut-decode / long-cut-prefill
                             the same, held `long_hold_s` instead: longer than the proxy's ejection bound
                             (`ejection_bound_s`), so the proxy ejects the host while requests are on it, and
                             re-admits it after the link is back
  slow-link                  a prefill or decode host behind tbf at `slow_rate`, then unshaped
  kill-instance              SIGKILL of an instance, then restarted (what `pdserve up`'s supervisor does)
  restart-proxy              the proxy stopped (SIGTERM) and started again

Faults that make wrong KV (test-only, in the prefill processes: pdserve/kv_transfer/faults.py, turned on by
`kv_fault_env`): a byte flipped in a held block, blocks reassigned before a late READ. The digests
(`enable_kv_digest`) must catch every victim: `kv_victims` (the faults' log: wrong bytes a decode read) against
`kv_caught` (the decodes' "KV digest mismatch" log lines), and no answer may be wrong.

Counts (`SoakResult`): completed (200 and exact), clean errors (an error status, an SSE error frame, a refused
connection while the proxy restarts), corrupted (200 with wrong tokens), hung, leaked (after the load and a
quiescence wait: every instance's /metrics back to idle: no used KV blocks, held leases, running, waiting or
params-awaiting requests), and the worst time from a fault's start to an error it caused (an error's time
minus the latest fault start before it, or its request's start when that is later).
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.health import FAST_INTERVAL_S
from pdserve.testing.pd_cluster import Node, PDCluster, answer_token_ids, completion_body

FAULTS = ("cut-decode", "slow-link", "cut-prefill", "kill-instance", "restart-proxy", "long-cut-decode",
          "long-cut-prefill")


def ejection_bound_s(cfg: ProxyConfig | None = None) -> float:
    """The longest a silent host stays admitted by a proxy with `cfg` (its defaults: 13 s), when no request
    fails on it first: the cut lands just after a probe round, the next round comes `health_interval` later and
    waits out `health_timeout`, then the failed-probe rounds come `FAST_INTERVAL_S` after each other's end, up to
    `eject_after` failures (pdserve/proxy/health.py)."""
    cfg = cfg or ProxyConfig()
    first = cfg.health_interval + cfg.health_timeout
    return first + (cfg.eject_after - 1) * (FAST_INTERVAL_S + cfg.health_timeout)


@dataclass
class SoakConfig:
    requests: int = 2000
    rate: float = 8.0  # requests started per second
    fault_every_s: float = 10.0
    fault_hold_s: float = 5.0
    long_hold_s: float = ejection_bound_s() + 7.0  # the long cuts' hold: past the ejection bound
    faults: tuple[str, ...] = FAULTS
    slow_rate: str = "10mbit"
    hung_s: float = 30.0
    max_tokens: tuple[int, int] = (4, 24)
    num_prompts: int = 16
    stream_share: float = 0.5
    seed: int = 0
    max_workers: int = 64  # client threads (a request waits for one: the start times stay bounded, not exact)


@dataclass
class SoakResult:
    requests: int = 0
    completed: int = 0
    clean_errors: int = 0
    corrupted: int = 0
    hung: int = 0
    leaked: int = 0
    faults_injected: int = 0
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    worst_fault_to_error_s: float = 0.0
    wall_s: float = 0.0
    leak_details: list[str] = field(default_factory=list)
    corrupted_examples: list[str] = field(default_factory=list)
    kv_faults_injected: dict[str, int] = field(default_factory=dict)  # by kind
    kv_victims: dict[str, int] = field(default_factory=dict)  # by kind: wrong bytes a decode read
    kv_caught: int = 0  # digest mismatches the decodes logged

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def kv_fault_env(log_path: Path, seed: int, **rates: float) -> dict[str, str]:
    """The prefill instances' environment for the test-only KV faults (flip, reassign: per-request odds)."""
    from pdserve.kv_transfer.faults import ENV

    return {ENV: json.dumps({**rates, "seed": seed, "log": str(log_path)})}


def count_kv_faults(result: SoakResult, fault_log: Path, decode_logs: list[Path]) -> None:
    """Fill the KV fault counts from the faults' log and the decodes' logs."""
    if fault_log.exists():
        for line in fault_log.read_text().splitlines():
            e = json.loads(line)
            counts = result.kv_victims if e["victim"] else result.kv_faults_injected
            if e["victim"] or e.get("phase") == "held" or e["kind"] == "stale_push":
                counts[e["kind"]] = counts.get(e["kind"], 0) + 1
    caught: set[str] = set()  # one request is logged by several layers: count it once
    for p in decode_logs:
        if p.exists():
            caught.update(f"{p}:{m}" for m in re.findall(r"KV digest mismatch for request (\S+):",
                                                          p.read_text(errors="replace")))
    result.kv_caught = len(caught)


def soak_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "river", "stone", "cloud", "seven", "orange", "signal", "quiet", "market", "engine", "north"]
    return [" ".join(rng.choice(words) + str(rng.randrange(50)) for _ in range(rng.randrange(3, 160)))
            for _ in range(n)]


class _Ledger:
    """Thread-safe counts, and the fault start times errors are measured from."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.result = SoakResult()
        self.fault_starts: list[float] = []

    def fault(self, kind: str) -> None:
        with self.lock:
            self.fault_starts.append(time.monotonic())
            self.result.faults_injected += 1
            self.result.faults_by_kind[kind] = self.result.faults_by_kind.get(kind, 0) + 1

    def error(self, kind: str, started: float) -> None:
        now = time.monotonic()
        with self.lock:
            self.result.clean_errors += 1
            self.result.errors_by_kind[kind] = self.result.errors_by_kind.get(kind, 0) + 1
            before = [t for t in self.fault_starts if t <= now]
            if before:
                since = now - max(before[-1], started)
                self.result.worst_fault_to_error_s = max(self.result.worst_fault_to_error_s, since)


def _one_request(cluster: PDCluster, body: dict, expected: list[int], hung_s: float, ledger: _Ledger) -> None:
    stream = bool(body["stream"])
    started = time.monotonic()
    timeout = httpx.Timeout(connect=10.0, read=hung_s, write=10.0, pool=10.0)
    try:
        with cluster.client(), httpx.Client(timeout=timeout) as http, \
                http.stream("POST", f"{cluster.proxy.url}/v1/completions", json=body) as resp:
            data = b"".join(resp.iter_bytes())
            outcome = answer_token_ids(resp.status_code, data, stream)
    except httpx.ReadTimeout:
        with ledger.lock:
            ledger.result.hung += 1
        return
    except httpx.ConnectError:
        ledger.error("proxy_unreachable", started)
        return
    except httpx.HTTPError as exc:  # the proxy's connection broke (it was restarted mid-answer)
        ledger.error(f"transport:{type(exc).__name__}", started)
        return
    if isinstance(outcome, str):
        kind = outcome.split(":", 1)[0]
        ledger.error(kind, started)
    elif outcome == expected:
        with ledger.lock:
            ledger.result.completed += 1
    else:
        with ledger.lock:
            ledger.result.corrupted += 1
            if len(ledger.result.corrupted_examples) < 5:
                ledger.result.corrupted_examples.append(f"{body['prompt'][:40]!r}: {outcome} != {expected}")


class _Injector:
    def __init__(self, cluster: PDCluster, cfg: SoakConfig, ledger: _Ledger, rng: random.Random) -> None:
        self.cluster, self.cfg, self.ledger, self.rng = cluster, cfg, ledger, rng
        self.stop = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        i = 0
        if not self.cfg.faults:  # only the in-process KV faults, or none
            return
        while not self.stop.wait(self.cfg.fault_every_s):
            kind = self.cfg.faults[i % len(self.cfg.faults)]
            i += 1
            try:
                self.inject(kind)
            except Exception as exc:  # noqa: BLE001 - reported with the result, the soak goes on
                self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")

    def _hold(self, undo: Callable[[], None], seconds: float) -> None:
        try:
            self.stop.wait(seconds)
        finally:
            undo()

    def inject(self, kind: str) -> None:
        c, bed = self.cluster, self.cluster.bed
        pick: Callable[[list[Node]], Node] = self.rng.choice
        if kind in ("cut-decode", "cut-prefill", "long-cut-decode", "long-cut-prefill"):
            node = pick(c.decode if kind.endswith("decode") else c.prefill)
            bed.partition(node.host)
            self.ledger.fault(kind)
            self._hold(lambda: bed.heal(node.host),
                       self.cfg.long_hold_s if kind.startswith("long-") else self.cfg.fault_hold_s)
        elif kind == "slow-link":
            node = pick([*c.prefill, *c.decode])
            bed.shape(node.host, self.cfg.slow_rate)
            self.ledger.fault(kind)
            self._hold(lambda: bed.unshape(node.host), self.cfg.fault_hold_s)
        elif kind == "kill-instance":
            node = pick([*c.prefill, *c.decode])
            assert node.proc is not None
            self.ledger.fault(kind)
            node.proc.stop(sig=9)
            c.restart(node)  # waits until it answers /health again
        elif kind == "restart-proxy":
            self.ledger.fault(kind)
            c.restart(c.proxy)
        else:
            raise ValueError(f"unknown fault {kind!r}")


def run_soak(cluster: PDCluster, cfg: SoakConfig, log: Callable[[str], None] = lambda _: None) -> SoakResult:
    rng = random.Random(cfg.seed)
    prompts = soak_prompts(cfg.num_prompts, cfg.seed)
    plan = [(rng.randrange(len(prompts)), rng.randint(*cfg.max_tokens), rng.random() < cfg.stream_share)
            for _ in range(cfg.requests)]
    log(f"reference answers for {len(prompts)} prompts from the collocated instance")
    # Greedy with ignore_eos: the answer of m tokens is the first m of the longest one.
    longest = cfg.max_tokens[1]
    references: list[list[int]] = []
    with cluster.client(), httpx.Client(timeout=120) as http:
        for prompt in prompts:
            r = http.post(f"{cluster.collocated.url}/v1/completions", json=completion_body(prompt, longest, False))
            got = answer_token_ids(r.status_code, r.content, False)
            if isinstance(got, str):
                raise RuntimeError(f"the collocated reference failed: {got}")
            references.append(got)
    expected = {(p, m): references[p][:m] for p, m, _ in plan}
    ledger = _Ledger()
    injector = _Injector(cluster, cfg, ledger, random.Random(cfg.seed + 1))
    faults = threading.Thread(target=injector.run, name="chaos-injector", daemon=True)
    t0 = time.monotonic()
    faults.start()
    try:
        with ThreadPoolExecutor(cfg.max_workers, thread_name_prefix="chaos-client") as pool:
            futures = []
            for i, (p, m, stream) in enumerate(plan):
                delay = t0 + i / cfg.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                body = completion_body(prompts[p], m, stream)
                futures.append(pool.submit(_one_request, cluster, body, expected[(p, m)], cfg.hung_s, ledger))
                if i and i % 250 == 0:
                    r = ledger.result
                    log(f"{i} sent: completed {r.completed}, errors {r.clean_errors}, corrupted {r.corrupted}, "
                        f"hung {r.hung}, faults {r.faults_injected}")
            for f in futures:
                f.result()
    finally:
        injector.stop.set()
        faults.join(timeout=600)
    result = ledger.result
    result.requests = cfg.requests
    result.wall_s = round(time.monotonic() - t0, 1)
    result.worst_fault_to_error_s = round(result.worst_fault_to_error_s, 2)
    if injector.errors:
        result.leak_details.extend(f"injector: {e}" for e in injector.errors)
    # Quiesce: every host reachable again, then every instance back to idle.
    for host in cluster.bed.hosts:
        cluster.bed.heal(host)
        cluster.bed.unshape(host)
    cluster.wait_ready(cluster.nodes)
    problems = cluster.idle_problems(timeout=60)
    result.leaked = len(problems)
    result.leak_details.extend(problems)
    return result
