"""The checks of `pdserve preflight`, one function per row (the seed article's preflight.sh, automated).

Each check returns a `Check` (pass / fail / skip, and why). They share a `Target`: the instances found via
the proxy (`GET /pdserve/instances`) or given explicitly, with each one's `/pdserve/info` (or, for a vLLM
instance, `/version` and `/v1/models`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any
from urllib.parse import urlparse

import httpx

from pdserve.api.pd import build_decode_body, build_prefill_body, prefill_kv_params
from pdserve.preflight.metrics import COUNTERS, EXPIRED, FAILED, NixlSnapshot, scrape
from pdserve.preflight.plan import BANDWIDTH_PRESETS, dtype_bytes, parse_bandwidth

PASS, FAIL, SKIP = "pass", "fail", "skip"

# Defaults per path; shown by --help and in the row's detail.
DEFAULT_BANDWIDTH = {"cpu": "cpu-dram", "cuda-same-host": "cuda-ipc", "cuda-cross-host": "rdma-400g"}
DEFAULT_FLOOR_MS = {"cpu": 5.0, "cuda": 1.0}  # fixed cost per transfer (post, completion polling, notify)
DEFAULT_LONG_TOKENS = {"cpu": 1024, "cuda": 8192}

# Fields that must be equal on every instance of a deployment (vLLM's compatibility hash covers the same).
MATCH_FIELDS = ("version", "model_name", "dtype", "kv_cache_dtype", "block_size", "kv_layout", "num_layers",
                "num_kv_heads", "head_dim", "device_type")

_WORD_TEXT = (
    "river stone cloud ember lantern quiet orbit maple harbor signal copper meadow falcon velvet prism anchor "
    "thunder willow cobalt ridge spark canyon harvest marble echo glacier saffron beacon timber violet summit "
    "crystal hollow breeze cedar amber delta fossil garnet island jasmine kernel lagoon mosaic nectar opal "
    "pepper quartz raven sierra tundra umbra vertex walnut zephyr basalt citrus dune fjord grove heron indigo"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass
class Check:
    name: str
    status: str  # pass | fail | skip
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "data": self.data}


@dataclass
class Instance:
    role: str  # prefill | decode
    url: str
    healthy: bool = False
    error: str | None = None
    info: dict[str, Any] | None = None
    engine: str = ""  # "pdserve" (has /pdserve/info) or "vllm"

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or ""

    def field(self, name: str) -> Any:
        info = self.info or {}
        if name == "model_name":
            name_ = info.get("served_model_name") or info.get("model")
            return PurePath(str(name_)).name if name_ else None
        if name == "device_type":
            device = info.get("device")
            return str(device).split(":")[0] if device else None
        return info.get(name)


@dataclass
class Options:
    proxy: str | None = None
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    admin_key: str | None = None
    api_key: str | None = None
    model: str | None = None
    long_prompt_tokens: int | None = None
    long_prompts: int = 3
    bandwidth: str | None = None
    slow_factor: float = 10.0
    max_xfer_ms: float = 100.0
    latency_floor_ms: float | None = None
    prefill_gpu: str | None = None
    decode_gpu: str | None = None
    probe: str = "auto"  # auto | on | off
    timeout: float = 120.0
    seed: int | None = None


@dataclass
class Target:
    instances: list[Instance]
    via_proxy: bool

    def role(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    @property
    def disaggregated(self) -> bool:
        return bool(self.role("prefill"))

    def device(self) -> str:
        devices = {i.field("device_type") for i in self.instances if i.info}
        return "cuda" if "cuda" in devices else "cpu"

    def same_host(self) -> bool:
        hosts = {i.host for i in self.instances}
        loopback = {h for h in hosts if h in ("localhost", "::1") or h.startswith("127.")}
        return len(hosts - loopback) <= (0 if loopback else 1)


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


# --------------------------------------------------------------------------------------------------
# discovery and check 1


def discover(client: httpx.Client, opts: Options) -> tuple[Target | None, Check]:
    """The instances, from the proxy's `GET /pdserve/instances` or the explicit lists; row "instances"."""
    listed: list[tuple[str, str, bool | None]] = []  # (role, url, healthy according to the proxy)
    if opts.proxy and not (opts.prefill or opts.decode):
        url = normalize_url(opts.proxy) + "/pdserve/instances"
        try:
            r = client.get(url, headers=_auth(opts.admin_key))
        except httpx.HTTPError as e:
            return None, Check("instances", FAIL, f"proxy unreachable: GET {url}: {e}")
        if r.status_code in (401, 403):
            return None, Check("instances", FAIL, f"GET {url}: {r.status_code}; pass --admin-key")
        if r.status_code != 200:
            return None, Check("instances", FAIL, f"GET {url}: HTTP {r.status_code} (is this a pdserve proxy?)")
        body = r.json()
        for role in ("prefill", "decode"):
            for item in body.get(role) or []:
                listed.append((role, normalize_url(str(item["url"])), item.get("healthy")))
    else:
        listed = [("prefill", normalize_url(u), None) for u in opts.prefill]
        listed += [("decode", normalize_url(u), None) for u in opts.decode]
    if not any(role == "decode" for role, _, _ in listed):
        return None, Check("instances", FAIL, "no decode instance (give --proxy URL, or --prefill URL --decode URL)")
    instances = []
    for role, url, proxy_healthy in listed:
        inst = Instance(role, url)
        try:
            h = client.get(url + "/health", timeout=5.0)
            inst.healthy = h.status_code == 200
            if not inst.healthy:
                inst.error = f"/health answered {h.status_code}"
        except httpx.HTTPError as e:
            inst.error = f"unreachable ({type(e).__name__}: {e})"
        if inst.healthy:
            _load_info(client, inst)
        if proxy_healthy is False and inst.healthy:
            inst.error = "healthy, but the proxy has it marked unhealthy"
        instances.append(inst)
    target = Target(instances, via_proxy=bool(opts.proxy))
    bad = [i for i in instances if not i.healthy or i.error]
    roles = ", ".join(f"{i.role} {i.url}" for i in instances)
    data = {"instances": [{"role": i.role, "url": i.url, "healthy": i.healthy, "engine": i.engine,
                           "error": i.error} for i in instances]}
    if bad:
        return target, Check("instances", FAIL, "; ".join(f"{i.role} {i.url}: {i.error}" for i in bad), data)
    mode = "disaggregated" if target.disaggregated else "collocated (no prefill pool)"
    return target, Check("instances", PASS, f"{len(instances)} healthy, {mode}: {roles}", data)


def _load_info(client: httpx.Client, inst: Instance) -> None:
    try:
        r = client.get(inst.url + "/pdserve/info", timeout=5.0)
        if r.status_code == 200:
            inst.info, inst.engine = r.json(), "pdserve"
            return
        info: dict[str, Any] = {}
        v = client.get(inst.url + "/version", timeout=5.0)
        if v.status_code == 200:
            info["version"] = "vllm " + str(v.json().get("version"))
        m = client.get(inst.url + "/v1/models", timeout=5.0)
        if m.status_code == 200 and m.json().get("data"):
            card = m.json()["data"][0]
            info["served_model_name"] = card.get("id")
            info["max_model_len"] = card.get("max_model_len")
        inst.info, inst.engine = info, "vllm"
    except (httpx.HTTPError, ValueError) as e:
        inst.error = f"cannot read its info: {e}"


def check_configs(target: Target) -> Check:
    """Row 1: prefill and decode agree on version, model, dtype, block size, layout, shapes; roles fit."""
    insts = [i for i in target.instances if i.info is not None]
    if len(insts) < 1:
        return Check("versions/configs", SKIP, "no reachable instance")
    problems: list[str] = []
    summary: dict[str, Any] = {}
    for name in MATCH_FIELDS:
        values = {i.url: i.field(name) for i in insts if i.field(name) is not None}
        distinct = set(map(str, values.values()))
        if len(distinct) > 1:
            problems.append(f"{name} differs: " + ", ".join(f"{_short(u)}={v}" for u, v in values.items()))
        elif distinct:
            summary[name] = next(iter(values.values()))
    if target.disaggregated:
        for i in insts:
            role = (i.info or {}).get("kv_role")
            if i.engine != "pdserve":
                continue
            want = ("kv_producer", "kv_both") if i.role == "prefill" else ("kv_consumer", "kv_both")
            if role not in want:
                problems.append(f"{i.role} {_short(i.url)} has kv_role={role} (want {' or '.join(want)})")
        channels: dict[tuple[str, Any], str] = {}
        for i in insts:
            info = i.info or {}
            if info.get("side_channel_port") is None:
                continue
            key = (str(info.get("side_channel_host")), info.get("side_channel_port"))
            if key in channels:
                problems.append(f"{_short(i.url)} and {_short(channels[key])} share side channel {key[0]}:{key[1]}")
            channels[key] = i.url
    if any(i.engine == "vllm" for i in insts):
        summary["note"] = "vLLM instances expose no block size/layout over HTTP; their NIXL handshake checks them"
    tp = _tensor_parallel(target, insts, summary, problems) + _kv_scale_sources(insts, summary)
    if problems:
        return Check("versions/configs", FAIL, "; ".join(problems), {"fields": summary})
    shape = ""
    if {"num_layers", "num_kv_heads", "head_dim"} <= summary.keys():
        shape = f", {summary['num_layers']} layers x {summary['num_kv_heads']} KV heads x {summary['head_dim']}"
    detail = ", ".join(f"{k}={summary[k]}" for k in ("version", "model_name", "dtype", "kv_cache_dtype", "block_size",
                                                      "kv_layout", "device_type") if k in summary)
    return Check("versions/configs", PASS, f"match across {len(insts)} instance(s): {detail}{shape}{tp}",
                 {"fields": summary})


def _kv_scale_sources(insts: list[Instance], summary: dict[str, Any]) -> str:
    """Where each fp8 instance's KV scales come from (/pdserve/info kv_cache_scales): informational, never a
    FAIL: every fp8 row carries its own scale, so static (checkpoint) and dynamic instances interoperate
    (ARCHITECTURE.md, "Checkpoint scales"). Returns the text for the PASS line."""
    sources = {i.url: i.field("kv_cache_scales") for i in insts if i.engine == "pdserve"}
    sources = {u: s for u, s in sources.items() if s not in (None, "none")}
    if not sources:
        return ""
    summary["kv_cache_scales"] = {_short(u): s for u, s in sources.items()}
    kinds = sorted(set(sources.values()))
    return f", fp8 scales: {' / '.join(kinds)}" + (" (interoperable)" if len(kinds) > 1 else "")


def _tensor_parallel(target: Target, insts: list[Instance], summary: dict[str, Any], problems: list[str]) -> str:
    """Tensor-parallel sizes may differ between instances (each decode rank reads its KV heads from the
    prefill ranks holding them); each must split the KV heads. Returns the text for the PASS line."""
    sizes = {i.url: int(i.field("tensor_parallel_size") or 1) for i in insts if i.engine == "pdserve"}
    if not sizes or set(sizes.values()) == {1}:
        return ""
    heads = summary.get("num_kv_heads")
    for url, tp in sizes.items():
        if isinstance(heads, int) and heads % tp and tp % heads:
            problems.append(f"{_short(url)} has tensor_parallel_size {tp}, which does not split {heads} KV heads")
    summary["tensor_parallel_size"] = {_short(u): tp for u, tp in sizes.items()}
    by_role = {role: sorted({sizes[i.url] for i in target.role(role) if i.url in sizes})
               for role in ("prefill", "decode")}
    parts = [f"{role} TP {'/'.join(map(str, tps))}" for role, tps in by_role.items() if tps]
    return "; tensor parallel: " + (", ".join(parts) if parts else "/".join(map(str, sorted(set(sizes.values())))))


def _short(url: str) -> str:
    return url.removeprefix("http://")


# --------------------------------------------------------------------------------------------------
# requests (checks 3 and 4)


class Requester:
    """Sends completions through the proxy, or, with explicit instances and no proxy, as the two legs a P/D
    proxy sends (prefill with max_tokens=1 and do_remote_decode, then decode with the returned params)."""

    def __init__(self, client: httpx.Client, opts: Options, target: Target) -> None:
        self.client = client
        self.opts = opts
        self.target = target
        self._rr = 0

    def model(self) -> str | None:
        if self.opts.model:
            return self.opts.model
        d = self.target.role("decode")
        return (d[0].info or {}).get("served_model_name") if d else None

    def complete(self, prompt: str | list[int], max_tokens: int) -> tuple[dict[str, Any], float]:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if (model := self.model()) is not None:
            body["model"] = model
        t0 = time.perf_counter()
        if self.opts.proxy:
            out = self._post(normalize_url(self.opts.proxy) + "/v1/completions", body)
        else:
            out = self._legs(body)
        return out, time.perf_counter() - t0

    def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.client.post(url, json=body, headers=_auth(self.opts.api_key), timeout=self.opts.timeout)
        if r.status_code != 200:
            raise RuntimeError(f"POST {url}: HTTP {r.status_code}: {r.text[:300]}")
        return dict(r.json())

    def _legs(self, body: dict[str, Any]) -> dict[str, Any]:
        prefill, decode = self.target.role("prefill"), self.target.role("decode")
        self._rr += 1
        d = decode[self._rr % len(decode)]
        if not prefill:
            return self._post(d.url + "/v1/completions", body)
        p = prefill[self._rr % len(prefill)]
        p_out = self._post(p.url + "/v1/completions", build_prefill_body(body))
        params = prefill_kv_params(p_out)
        if params is None:
            raise RuntimeError(f"prefill {p.url} returned no kv_transfer_params")
        return self._post(d.url + "/v1/completions", build_decode_body(body, params))


def check_short_request(req: Requester) -> Check:
    """Row 3: one short request end to end."""
    where = "through the proxy" if req.opts.proxy else "as prefill + decode legs"
    try:
        out, elapsed = req.complete("Say hello.", 16)
    except (RuntimeError, httpx.HTTPError, ValueError) as e:
        return Check("short request", FAIL, f"{where}: {e}")
    choices = out.get("choices") or []
    if not choices:
        return Check("short request", FAIL, f"{where}: response without choices: {str(out)[:200]}")
    text = choices[0].get("text") or ""
    finish = choices[0].get("finish_reason")
    tokens = (out.get("usage") or {}).get("completion_tokens")
    if not tokens and not text:
        return Check("short request", FAIL, f"{where}: empty completion (finish_reason={finish})")
    return Check("short request", PASS,
                 f"{where}: {elapsed * 1e3:.0f} ms, {tokens} tokens, finish_reason={finish}: {text[:60]!r}",
                 {"elapsed_s": elapsed, "text": text, "finish_reason": finish})


def long_prompt_ids(client: httpx.Client, target: Target, tokens: int, count: int, seed: int,
                    api_key: str | None = None) -> list[list[int]]:
    """`count` distinct prompts of exactly `tokens` token ids, made by tokenizing random words on an
    instance (`POST /tokenize`), so that no prompt shares a cached prefix with another or an earlier run."""
    rng = random.Random(seed)
    inst = (target.role("prefill") or target.role("decode"))[0]
    prompts = []
    for _ in range(count):
        ids: list[int] = []
        words = max(16, tokens)
        while len(ids) < tokens:
            text = " ".join(rng.choice(_WORDS) for _ in range(words))
            r = client.post(inst.url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                            headers=_auth(api_key), timeout=30.0)
            r.raise_for_status()
            ids += list(r.json()["tokens"])
            words = max(16, tokens - len(ids))
        prompts.append(ids[:tokens])
    return prompts


def _bytes_per_token(info: dict[str, Any]) -> int | None:
    try:
        return int(info["num_layers"]) * 2 * int(info["num_kv_heads"]) * int(info["head_dim"]) * int(
            dtype_bytes(str(info["dtype"])))
    except (KeyError, TypeError, ValueError):
        return None


def _snapshots(client: httpx.Client, insts: list[Instance]) -> dict[str, NixlSnapshot]:
    snaps = {}
    for i in insts:
        try:
            snaps[i.url] = scrape(client, i.url)
        except (httpx.HTTPError, ValueError):
            snaps[i.url] = NixlSnapshot()
    return snaps


@dataclass
class TransferRun:
    before: dict[str, NixlSnapshot]
    after: dict[str, NixlSnapshot]
    prompts: int
    tokens: int
    errors: list[str]


def send_long_prompts(client: httpx.Client, req: Requester, opts: Options, target: Target) -> TransferRun | Check:
    """Send the long prompts one at a time and snapshot every instance's nixl metrics around them."""
    device = target.device()
    tokens = opts.long_prompt_tokens or DEFAULT_LONG_TOKENS[device]
    limits = [int(i.info["max_model_len"]) for i in target.instances if i.info and i.info.get("max_model_len")]
    if limits and tokens > min(limits) - 4:
        tokens = min(limits) - 4
    try:
        seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(2**31)
        prompts = long_prompt_ids(client, target, tokens, opts.long_prompts, seed, opts.api_key)
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return Check("kv transfer time", FAIL, f"cannot build long prompts (POST /tokenize): {e}")
    before = _snapshots(client, target.instances)
    errors = []
    for ids in prompts:
        try:
            req.complete(ids, 2)
        except (RuntimeError, httpx.HTTPError, ValueError) as e:
            errors.append(str(e)[:300])
    after = _snapshots(client, target.instances)
    return TransferRun(before, after, len(prompts), tokens, errors)


def default_bandwidth(target: Target) -> str:
    if target.device() == "cpu":
        return DEFAULT_BANDWIDTH["cpu"]
    return DEFAULT_BANDWIDTH["cuda-same-host" if target.same_host() else "cuda-cross-host"]


def check_transfer_time(run: TransferRun, opts: Options, target: Target) -> Check:
    """Row 4: the decode's measured transfer time vs the KV arithmetic at the expected bandwidth."""
    decodes = target.role("decode")
    deltas = {i.url: run.after[i.url].delta(run.before[i.url]) for i in decodes}
    present = any(run.after[i.url].present for i in decodes)
    transfers = sum(d.transfers for d in deltas.values())
    xfer_sum = sum(d.sums.get("vllm:nixl_xfer_time_seconds", 0.0) for d in deltas.values())
    bytes_sum = sum(d.sums.get("vllm:nixl_bytes_transferred", 0.0) for d in deltas.values())
    bytes_count = sum(d.counts.get("vllm:nixl_bytes_transferred", 0.0) for d in deltas.values())
    failed = sum(d.counter(FAILED) for d in deltas.values())
    bw_name = opts.bandwidth or default_bandwidth(target)
    bw = parse_bandwidth(bw_name)
    floor_ms = opts.latency_floor_ms if opts.latency_floor_ms is not None else DEFAULT_FLOOR_MS[target.device()]
    info = next((i.info for i in decodes if i.info), {}) or {}
    bpt = _bytes_per_token(info)
    arithmetic = bpt * run.tokens if bpt else None
    # A tensor-parallel decode's ranks read their shares side by side, on GPUs over a link each.
    ranks = int(info.get("tensor_parallel_size") or 1) if target.device() == "cuda" else 1
    data: dict[str, Any] = {
        "prompts": run.prompts, "prompt_tokens": run.tokens, "transfers": transfers, "failed": failed,
        "bandwidth": bw_name, "bandwidth_bytes_per_s": bw, "latency_floor_ms": floor_ms,
        "slow_factor": opts.slow_factor, "max_xfer_ms": opts.max_xfer_ms, "bytes_per_token": bpt,
        "errors": run.errors,
    }
    head = f"{run.prompts} prompt(s) x {run.tokens} tokens, one at a time"
    if run.errors:
        return Check("kv transfer time", FAIL, f"{head}: {len(run.errors)} failed: {run.errors[0]}", data)
    if not present:
        return Check("kv transfer time", FAIL, f"{head}: the decode instance(s) export no vllm:nixl_* metrics", data)
    if transfers < 1:
        why = f"{int(failed)} failed transfer(s)" if failed else "none recorded (did the decode pull the KV?)"
        return Check("kv transfer time", FAIL, f"{head}: no successful KV transfer on decode: {why}", data)
    avg_s = xfer_sum / transfers
    avg_bytes = bytes_sum / bytes_count if bytes_count else (arithmetic or 0) * run.prompts / transfers
    expected_s = avg_bytes / ranks / bw + floor_ms / 1e3
    limit_s = min(opts.slow_factor * expected_s, opts.max_xfer_ms / 1e3)
    data.update({"avg_xfer_s": avg_s, "avg_bytes": avg_bytes, "expected_s": expected_s, "limit_s": limit_s,
                 "arithmetic_bytes_per_prompt": arithmetic,
                 "effective_gbps": avg_bytes / avg_s / 1e9 if avg_s > 0 else None})
    rate = f"{avg_bytes / avg_s / 1e9:.2f} GB/s" if avg_s > 0 else "n/a"
    arith = f" (arithmetic {arithmetic / 2**20:.2f} MiB per prompt)" if arithmetic else ""
    detail = (f"{head}: {transfers} transfer(s), avg {avg_s * 1e3:.2f} ms for {avg_bytes / 2**20:.2f} MiB{arith}"
              f" = {rate}; expected {expected_s * 1e3:.2f} ms at {bw_name} ({bw / 1e9:g} GB/s)"
              f"{f' per decode rank x {ranks} ranks' if ranks > 1 else ''} + {floor_ms:g} ms floor")
    if avg_s >= opts.max_xfer_ms / 1e3:
        return Check("kv transfer time", FAIL,
                     f"{detail}; avg >= {opts.max_xfer_ms:g} ms: fix the transport before measuring anything", data)
    if avg_s > opts.slow_factor * expected_s:
        return Check("kv transfer time", FAIL,
                     f"{detail}; more than {opts.slow_factor:g}x the expectation: the KV path is slow", data)
    return Check("kv transfer time", PASS, detail, data)


def counter_snapshots(client: httpx.Client, target: Target) -> dict[str, NixlSnapshot]:
    """Every instance's nixl counters now: taken when preflight starts, so that row 5 judges its own run."""
    return _snapshots(client, target.instances)


def check_counters(before: dict[str, NixlSnapshot], after: dict[str, NixlSnapshot], target: Target) -> Check:
    """Row 5: no lease expired and no transfer or notification failed on any instance *while preflight ran*
    (the seed's step 5). Counts from before the run are reported, never judged: they may be a fault fixed
    since, and a process's totals only grow until it restarts."""
    if not any(s.present for s in after.values()):
        return Check("leases/failures", SKIP, "no instance exports vllm:nixl_* counters")
    problems, earlier = [], []
    deltas, totals = {name: 0.0 for name in COUNTERS}, {name: 0.0 for name in COUNTERS}
    for inst in target.instances:
        snap = after.get(inst.url)
        if snap is None or not snap.present:
            continue
        base = before.get(inst.url) or NixlSnapshot()
        for name in COUNTERS:
            value, delta = snap.counter(name), snap.counter(name) - base.counter(name)
            totals[name] += value
            deltas[name] += delta
            label = f"{inst.role} {_short(inst.url)}: {name.removeprefix('vllm:')}"
            if delta > 0:
                problems.append(f"{label} +{delta:g} during preflight (total {value:g})")
            elif value > 0:
                earlier.append(f"{label}={value:g}")
    data = {k.removeprefix("vllm:"): v for k, v in deltas.items()}
    data["before_preflight"] = {k.removeprefix("vllm:"): totals[k] - deltas[k] for k in COUNTERS}
    if problems:
        hint = " (lease expiries: raise kv_lease_duration or fix slow/failed pulls)" if deltas[EXPIRED] else ""
        return Check("leases/failures", FAIL, "; ".join(problems) + hint, data)
    note = f" (before it, not judged: {'; '.join(earlier)})" if earlier else ""
    return Check("leases/failures", PASS,
                 f"expired leases, failed transfers and notifications during preflight: all 0{note}", data)


def bandwidth_help() -> str:
    return ", ".join(f"{k} {BANDWIDTH_PRESETS[v]} ({v})" for k, v in DEFAULT_BANDWIDTH.items())
