"""`pdserve preflight`: go/no-go checks of a running P/D deployment, before any benchmark.

    pdserve preflight --proxy http://127.0.0.1:8192
    pdserve preflight --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --json

The rows follow the seed article's preflight.sh, stopping nowhere (every row is reported):
  instances         every instance answers /health (found via the proxy's GET /pdserve/instances)
  versions/configs  prefill and decode agree on version, model, dtype, block size, KV layout and shapes
  gpu p2p           peer-to-peer between the prefill and decode GPUs (NVML, else nvidia-smi topo -p2p r)
  ucx transport     the transport a NIXL READ takes between them (probe with UCX_PROTO_INFO=y)
  short request     one short completion end to end
  kv transfer time  a few long prompts one at a time; decode's measured transfer time vs the KV arithmetic
  leases/failures   lease expiries and failed transfers are zero
Exit code 0 = GO (no row failed), 1 = NO-GO, 2 = bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx

from pdserve.preflight.checks import (
    DEFAULT_FLOOR_MS,
    DEFAULT_LONG_TOKENS,
    FAIL,
    PASS,
    SKIP,
    Check,
    Options,
    Requester,
    Target,
    bandwidth_help,
    check_configs,
    check_counters,
    check_short_request,
    check_transfer_time,
    counter_snapshots,
    discover,
    send_long_prompts,
)

ROWS = ("instances", "versions/configs", "gpu p2p", "ucx transport", "short request", "kv transfer time",
        "leases/failures")


def _gpu_of(target: Target, role: str, explicit: str | None) -> list[list[str] | None]:
    """Physical GPU ids of each instance of `role`, one per tensor-parallel rank: --prefill-engine/runner/--decode-gpu
    (comma list, one GPU per instance, by position), else what the instance reports (`cuda_visible_devices`
    and its TP size in /pdserve/info: rank r on the r-th visible GPU), else unknown (None)."""
    insts = target.role(role)
    given = [g.strip() for g in explicit.split(",")] if explicit else []
    out: list[list[str] | None] = []
    for k, inst in enumerate(insts):
        if k < len(given):
            out.append([given[k]])
            continue
        info = inst.info or {}
        visible = info.get("cuda_visible_devices")
        device = str(info.get("device") or "")
        tp = int(info.get("tensor_parallel_size") or 1)
        if visible:
            ids = [v.strip() for v in str(visible).split(",") if v.strip()]
            index = int(device.split(":")[1]) if ":" in device and device.split(":")[1].isdigit() else 0
            out.append(ids[index : index + tp] if index + tp <= len(ids) else None)
        else:
            out.append(None)
    return out


def _pairs(target: Target, opts: Options) -> tuple[list[tuple[str, str]], str | None]:
    """Distinct (prefill GPU, decode GPU) pairs that KV moves over (with tensor parallelism: each decode
    rank's GPU and the GPUs of the prefill ranks it reads from), or why they are unknown."""
    from pdserve.types.tp_layout import head_sources

    p_gpus, d_gpus = _gpu_of(target, "prefill", opts.prefill_gpu), _gpu_of(target, "decode", opts.decode_gpu)
    if None in p_gpus or None in d_gpus:
        return [], ("cannot tell which physical GPUs the instances use (they report only their device index "
                    "under their own CUDA_VISIBLE_DEVICES); pass --prefill-gpu and --decode-gpu")
    heads = next((int(i.info["num_kv_heads"]) for i in target.instances if i.info and i.info.get("num_kv_heads")), 1)
    pairs: set[tuple[str, str]] = set()
    for p_ranks in p_gpus:
        for d_ranks in d_gpus:
            assert p_ranks is not None and d_ranks is not None
            for d, d_gpu in enumerate(d_ranks):
                for seg in head_sources(heads, d, len(d_ranks), len(p_ranks)):
                    pairs.add((p_ranks[seg.src_rank], d_gpu))
    return sorted(pairs), None


def _local_gpu_pairs(row: str, target: Target, opts: Options, collocated: str, on_cpu: str,
                     other_hosts: str) -> list[tuple[str, str]] | Check:
    """The (prefill GPU, decode GPU) pairs on this host that a GPU-path row checks, or the row's SKIP (with its
    own wording of why) where KV moves by no GPU pair here: collocated, on CPU, across hosts, or GPUs unknown."""
    if not target.disaggregated:
        return Check(row, SKIP, collocated)
    if target.device() == "cpu":
        return Check(row, SKIP, on_cpu)
    if not target.same_host():
        return Check(row, SKIP, other_hosts)
    pairs, why = _pairs(target, opts)
    return Check(row, SKIP, why) if why else pairs


def check_gpu_p2p(target: Target, opts: Options) -> Check:
    from pdserve.preflight.gpu import p2p_status

    pairs = _local_gpu_pairs(
        "gpu p2p", target, opts, "collocated deployment: no KV moves between instances",
        "instances run on CPU (device=cpu): KV moves through host memory, there is no GPU peer-to-peer path to check",
        "prefill and decode are on different hosts: KV crosses the network (RDMA), not GPU peer-to-peer; see the kv "
        "transfer time row")
    if isinstance(pairs, Check):
        return pairs
    results = [(p, d, p2p_status(p, d)) for p, d in pairs]
    data = {"pairs": [{"prefill_gpu": p, "decode_gpu": d, "status": r.status, "source": r.source}
                      for p, d, r in results]}
    detail = "; ".join(r.detail for _, _, r in results)
    if any(r.status == "not-ok" for _, _, r in results):
        return Check("gpu p2p", FAIL, detail + ": KV will move by a slower path (expect ~1 s transfers)", data)
    if any(r.status == "unknown" for _, _, r in results):
        return Check("gpu p2p", SKIP, detail, data)
    return Check("gpu p2p", PASS, detail, data)


def check_ucx_transport(target: Target, opts: Options) -> Check:
    from pdserve.preflight.gpu import run_probe

    if opts.probe == "off":
        return Check("ucx transport", SKIP, "probe disabled (--probe off)")
    pairs = _local_gpu_pairs(
        "ucx transport", target, opts, "collocated deployment: no KV transfer",
        "instances run on CPU: UCX moves host memory (cma/shared memory or tcp); the kv transfer time row measures it",
        "instances on different hosts: the probe runs on one host only")
    if isinstance(pairs, Check):
        return pairs
    env: dict[str, str] = {}
    info = next((i.info for i in target.role("decode") if i.info), {}) or {}
    if info.get("ucx_tls"):
        env["UCX_TLS"] = str(info["ucx_tls"])
    if all(i.engine == "pdserve" for i in target.instances):
        # pdserve instances set it for GPU pools unless the environment says otherwise (kv_transfer.nixl_agent)
        env.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y"))
    rows, worst = [], PASS
    data: dict[str, Any] = {"pairs": []}
    for p, d in pairs:
        res = run_probe(p, d, env)
        status, why = res.verdict()
        rows.append(f"GPU {p} -> GPU {d}: {why}")
        data["pairs"].append({"prefill_gpu": p, "decode_gpu": d, "status": status, "transports": res.transports,
                              "gbps": res.gbps, "env": res.env})
        if status == FAIL or (status == SKIP and worst == PASS):
            worst = status
    if worst == SKIP and opts.probe == "on":
        worst = FAIL  # asked for explicitly: not being able to probe is a failure
    return Check("ucx transport", worst, "; ".join(rows), data)


def run_checks(opts: Options) -> list[Check]:
    checks: list[Check] = []
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        target, row = discover(client, opts)
        checks.append(row)
        if target is None:
            checks += [Check(name, SKIP, "no deployment to check") for name in ROWS[1:]]
            return checks
        baseline = counter_snapshots(client, target)  # row 5 judges what happens from here on
        checks.append(check_configs(target))
        checks.append(check_gpu_p2p(target, opts))
        checks.append(check_ucx_transport(target, opts))
        req = Requester(client, opts, target)
        if checks[1].status == FAIL and target.disaggregated:
            # a KV transfer between mismatched instances can only fail (and count as a failure on decode)
            why = "versions/configs failed: a transfer between these instances would be refused"
            checks += [Check("short request", SKIP, why), Check("kv transfer time", SKIP, why),
                       check_counters(baseline, counter_snapshots(client, target), target)]
            return checks
        short = check_short_request(req)
        checks.append(short)
        if not target.disaggregated:
            checks.append(Check("kv transfer time", SKIP, "collocated deployment: no KV transfer"))
        elif short.status == FAIL:
            checks.append(Check("kv transfer time", SKIP, "the short request failed"))
        else:
            result = send_long_prompts(client, req, opts, target)
            if isinstance(result, Check):
                checks.append(result)
            else:
                checks.append(check_transfer_time(result, opts, target))
        checks.append(check_counters(baseline, counter_snapshots(client, target), target))
    return checks


_COLOURS = {PASS: "\033[32m", FAIL: "\033[31m", SKIP: "\033[33m"}


def format_table(checks: list[Check], colour: bool) -> str:
    lines = []
    for c in checks:
        tag = c.status.upper()
        if colour:
            tag = f"{_COLOURS[c.status]}{tag}\033[0m"
        lines.append(f"  {tag:<{4 + (9 if colour else 0)}}  {c.name:<17} {c.detail}")
    return "\n".join(lines)


def verdict(checks: list[Check]) -> tuple[bool, str]:
    failed = [c.name for c in checks if c.status == FAIL]
    if failed:
        also = f" (also failing: {', '.join(failed[1:])})" if failed[1:] else ""
        return False, f"NO-GO: fix {failed[0]} first{also}"
    if any(c.name == "kv transfer time" and c.status == PASS for c in checks):
        return True, "GO: the split is sound; benchmark goodput against a collocated baseline on the same hardware"
    return True, "GO: nothing failed (no KV transfer was checked: see the skipped rows)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--proxy", default=None, help="the proxy URL; its GET /pdserve/instances lists the instances")
    parser.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                        help="prefill instance(s), instead of discovery via the proxy")
    parser.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL", help="decode instance(s)")
    parser.add_argument("--admin-key", default=os.environ.get("PDSERVE_ADMIN_KEY"),
                        help="Bearer key for the proxy's /pdserve/instances (env PDSERVE_ADMIN_KEY)")
    parser.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                        help="Bearer key for /v1 requests (env PDSERVE_API_KEY)")
    parser.add_argument("--model", default=None, help="model name for requests (default: the decode's served name)")
    parser.add_argument("--long-prompt-tokens", type=int, default=None,
                        help="tokens per long prompt (default {cpu} on CPU, {cuda} on GPU; capped by max_model_len)"
                        .format(**DEFAULT_LONG_TOKENS))
    parser.add_argument("--long-prompts", type=int, default=3, help="how many long prompts (default 3)")
    parser.add_argument("--bandwidth", default=None,
                        help="expected KV link rate, e.g. 100GB/s or 400Gb/s (default by path: "
                        + bandwidth_help() + ")")
    parser.add_argument("--slow-factor", type=float, default=10.0,
                        help="fail when a transfer takes more than this times the expectation (default 10)")
    parser.add_argument("--max-xfer-ms", type=float, default=100.0,
                        help="fail when the average transfer takes this long whatever the size: the seed's "
                        "'hundreds of milliseconds' (default 100)")
    parser.add_argument("--latency-floor-ms", type=float, default=None,
                        help="fixed cost per transfer added to the expectation (default {cpu:g} ms CPU, "
                        "{cuda:g} ms GPU)".format(**DEFAULT_FLOOR_MS))
    parser.add_argument("--prefill-gpu", default=None, help="physical GPU id(s) of the prefill instance(s), e.g. 0")
    parser.add_argument("--decode-gpu", default=None, help="physical GPU id(s) of the decode instance(s), e.g. 1")
    parser.add_argument("--probe", choices=("auto", "on", "off"), default="auto",
                        help="run the NIXL READ probe between the GPUs (auto: when on one host with GPUs)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default 120)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the long prompts (default random)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def options_from_args(args: argparse.Namespace) -> Options:
    if not args.proxy and not args.decode:
        raise ValueError("give --proxy URL, or --prefill URL... --decode URL...")
    if args.long_prompts < 1 or (args.long_prompt_tokens is not None and args.long_prompt_tokens < 16):
        raise ValueError("--long-prompts must be >= 1 and --long-prompt-tokens >= 16")
    if args.slow_factor <= 0 or args.max_xfer_ms <= 0 or args.timeout <= 0:
        raise ValueError("--slow-factor, --max-xfer-ms and --timeout must be > 0")
    if args.bandwidth:
        from pdserve.preflight.plan import parse_bandwidth

        parse_bandwidth(args.bandwidth)
    return Options(
        proxy=args.proxy, prefill=list(args.prefill), decode=list(args.decode), admin_key=args.admin_key,
        api_key=args.api_key, model=args.model, long_prompt_tokens=args.long_prompt_tokens,
        long_prompts=args.long_prompts, bandwidth=args.bandwidth, slow_factor=args.slow_factor,
        max_xfer_ms=args.max_xfer_ms, latency_floor_ms=args.latency_floor_ms, prefill_gpu=args.prefill_gpu,
        decode_gpu=args.decode_gpu, probe=args.probe, timeout=args.timeout, seed=args.seed,
    )


def main(args: argparse.Namespace) -> int:
    try:
        opts = options_from_args(args)
    except ValueError as e:
        print(f"pdserve preflight: {e}", file=sys.stderr)
        return 2
    checks = run_checks(opts)
    ok, text = verdict(checks)
    if args.json:
        print(json.dumps({"verdict": "go" if ok else "no-go", "ok": ok, "summary": text,
                          "target": {"proxy": opts.proxy, "prefill": opts.prefill, "decode": opts.decode},
                          "checks": [c.to_json() for c in checks]}, indent=2))
    else:
        where = opts.proxy or f"prefill {' '.join(opts.prefill) or '-'} / decode {' '.join(opts.decode)}"
        print(f"pdserve preflight: {where}")
        print(format_table(checks, sys.stdout.isatty()))
        print(text)
    return 0 if ok else 1
