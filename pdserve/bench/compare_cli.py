"""Arguments of `pdserve bench compare` and their translation into a `CompareConfig`."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

from pdserve.bench.compare import AUTO, CompareConfig, Comparison, TargetEntry
from pdserve.bench.options import BenchSpec, add_target_arguments, add_workload_arguments
from pdserve.bench.resources import HOW_TO_EQUALISE, Resources, inequality, planned
from pdserve.bench.summary import rate_label

DEFAULT_COMPARE_GOODPUT = ["ttft:2000", "tpot:30"]  # the seed article's SLOs


class _TargetAction(argparse.Action):
    """`--target NAME=URL` and `--launch NAME=TOPOLOGY` append to one ordered list."""

    def __init__(self, option_strings: Sequence[str], dest: str, kind: str = "url", **kwargs: Any) -> None:
        self.kind = kind
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        name, sep, value = str(values).partition("=")
        if not sep or not name or not value:
            parser.error(f"{option_string} expects NAME=VALUE, got {values!r}")
        entries = list(getattr(namespace, self.dest, None) or [])
        if any(e.name == name for e in entries):
            parser.error(f"target name {name!r} used twice")
        if self.kind == "url" and not value.startswith(("http://", "https://")):
            value = f"http://{value}"
        entries.append(TargetEntry(name, self.kind, value))
        setattr(namespace, self.dest, entries)


def parse_rates(text: str) -> list[float]:
    rates: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        rate = float(part)
        if not rate > 0:
            raise ValueError(f"request rates must be positive (or inf), got {part}")
        if rate not in rates:
            rates.append(rate)
    if not rates:
        raise ValueError("--request-rates is empty")
    return rates


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("compare")
    g.add_argument(
        "--target",
        action=_TargetAction,
        dest="targets",
        kind="url",
        metavar="NAME=URL",
        help="a running OpenAI-compatible server (repeatable)",
    )
    g.add_argument(
        "--launch",
        action=_TargetAction,
        dest="targets",
        kind="launch",
        metavar="NAME=TOPOLOGY",
        help="start `pdserve up --topology TOPOLOGY --model MODEL --port P` for this target, wait "
        "for /health, SIGTERM it after its sweep (repeatable; e.g. collocated:2, 1p1d, 2P2D)",
    )
    g.add_argument("--request-rates", default="0.2,0.4,inf", help="comma list of req/s; inf = all at once")
    g.add_argument(
        "--baseline",
        default=None,
        help='the collocated target of the go/no-go rule (default: "collocated" if named, else the '
        "first target)",
    )
    g.add_argument("--output-dir", default=None, help="default: bench-compare-YYYYmmdd-HHMMSS")
    g.add_argument(
        "--transfer-check-url",
        action="append",
        default=[],
        metavar="[NAME=]URL|auto",
        help="decode instance whose /metrics (vllm:nixl_*) is read before/after the target's sweep; "
        "'auto' asks the target's /pdserve/instances (our proxy) for its decode instances",
    )
    g.add_argument(
        "--max-xfer-ms",
        type=float,
        default=100.0,
        help="transfer check fails above this mean KV transfer time (default 100)",
    )
    g.add_argument(
        "--itl-slo",
        type=float,
        default=None,
        metavar="MS",
        help="p99 ITL target of the rule (default: the --goodput tpot value)",
    )
    g.add_argument(
        "--min-goodput-gain",
        type=float,
        default=0.05,
        help="relative goodput gain the rule requires (default 0.05: a few percent with a few dozen "
        "requests is noise, not an improvement; 0 = any improvement)",
    )
    g.add_argument(
        "--cdf-rate", default=None, help="rate of the TTFT CDF plot (default: highest finite rate)"
    )
    g.add_argument(
        "--same-prompts-across-rates",
        action="store_true",
        help="reuse one prompt set for every rate (only with prefix caching disabled!)",
    )
    g.add_argument("--launch-cmd", default=None, help="launcher command (default: python -m pdserve up)")
    g.add_argument(
        "--launch-args",
        default="",
        help="extra `pdserve up` arguments, e.g. --launch-args=\"--gpus 0 --serve-arg='--max-model-len 4096'\"",
    )
    g.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for /health")
    g.add_argument(
        "--allow-unequal-resources",
        action="store_true",
        help="run even when the launched targets get different GPUs or GPU memory (or CPU cores); by "
        "default such a comparison is refused, since the resources alone can decide it",
    )
    add_target_arguments(parser, with_address=False)
    add_workload_arguments(parser)


def _transfer_urls(
    values: Sequence[str], targets: Sequence[TargetEntry], baseline: str
) -> dict[str, list[str]]:
    names = {t.name for t in targets}
    candidates = [t.name for t in targets if t.name != baseline]
    out: dict[str, list[str]] = {}
    for value in values:
        name, sep, url = value.partition("=")
        if sep and name in names:
            owners = [name]
        else:
            url = value
            if url != AUTO and len(candidates) != 1:
                raise ValueError(f"--transfer-check-url {value}: several candidate targets; use NAME=URL")
            owners = candidates
        for owner in owners:
            if url == AUTO:
                out[owner] = [AUTO]
            else:
                out.setdefault(owner, [])
                if out[owner] == [AUTO]:
                    raise ValueError(f"--transfer-check-url: {owner} has both auto and explicit URLs")
                out[owner].append(url)
    return out


def build_config(args: argparse.Namespace) -> tuple[CompareConfig, BenchSpec]:
    targets: list[TargetEntry] = list(getattr(args, "targets", None) or [])
    if not targets:
        raise ValueError("compare needs at least one --target NAME=URL or --launch NAME=TOPOLOGY")
    names = [t.name for t in targets]
    baseline = args.baseline or ("collocated" if "collocated" in names else names[0])
    if baseline not in names:
        raise ValueError(f"--baseline {baseline!r} is not one of the targets ({', '.join(names)})")
    rates = parse_rates(args.request_rates)
    cdf_rate = float(args.cdf_rate) if args.cdf_rate is not None else None
    if cdf_rate is not None and cdf_rate not in rates:
        raise ValueError(f"--cdf-rate {args.cdf_rate} is not one of --request-rates")
    spec = BenchSpec.from_namespace(args)
    if not spec.goodput:
        spec.goodput = list(DEFAULT_COMPARE_GOODPUT)
        print(
            f"note: no --goodput given; using the seed article's SLOs {' '.join(spec.goodput)}",
            file=sys.stderr,
        )
    wanted = [float(p) for p in spec.metric_percentiles.split(",") if p.strip()]
    spec.metric_percentiles = ",".join(f"{p:g}" for p in sorted(set(wanted) | {50.0, 99.0}))
    metrics = [m for m in (spec.percentile_metrics or "").split(",") if m]
    spec.percentile_metrics = ",".join(dict.fromkeys(["ttft", "tpot", "itl", *metrics]))
    out_dir = args.output_dir or f"bench-compare-{time.strftime('%Y%m%d-%H%M%S')}"
    resources = target_resources(targets, spec.model, args)
    problem = inequality(resources)
    if problem and not args.allow_unequal_resources:
        raise ValueError(f"the targets' resources differ: {problem}. {HOW_TO_EQUALISE}")
    if problem:
        print(f"warning: the targets' resources differ ({problem}); every verdict will say so", file=sys.stderr)
    cfg = CompareConfig(
        targets=targets,
        rates=rates,
        baseline=baseline,
        output_dir=out_dir,
        transfer_urls=_transfer_urls(args.transfer_check_url, targets, baseline),
        max_xfer_ms=args.max_xfer_ms,
        itl_slo_ms=args.itl_slo,
        cdf_rate=cdf_rate,
        same_prompts=args.same_prompts_across_rates,
        launch_command=shlex.split(args.launch_cmd) if args.launch_cmd else None,
        launch_args=shlex.split(args.launch_args),
        launch_timeout_s=args.launch_timeout,
        min_gain=args.min_goodput_gain,
        resources=resources,
        allow_unequal=args.allow_unequal_resources,
    )
    return cfg, spec


def target_resources(
    targets: Sequence[TargetEntry], model: str | None, args: argparse.Namespace
) -> dict[str, Resources | None]:
    """Each launched target's planned resources (`pdserve up`'s own placement of its arguments); None for a
    URL target or a custom --launch-cmd (whose placement is its own)."""
    from pdserve.model.default_model import DEFAULT_MODEL

    out: dict[str, Resources | None] = {}
    for t in targets:
        if t.kind != "launch" or args.launch_cmd:
            out[t.name] = None
            continue
        try:
            out[t.name] = planned(t.value, model or DEFAULT_MODEL, shlex.split(args.launch_args))
        except SystemExit as exc:  # argparse of `pdserve up` rejected the arguments
            raise ValueError(f"--launch {t.name}={t.value}: `pdserve up` rejects --launch-args "
                             f"{args.launch_args!r}") from exc
    return out


def compare_main(args: argparse.Namespace) -> int:
    cfg, spec = build_config(args)
    os.makedirs(cfg.output_dir, exist_ok=True)
    outcome = Comparison(cfg, spec).run()
    print("\n" + "=" * 50)
    for v in outcome.verdicts:
        print(f"Verdict {v.candidate} vs {v.baseline}: {v.decision}")
        for reason in v.reasons:
            print(f"  - {reason}")
    for key in ("markdown", "html", "summary"):
        print(f"{key}: {outcome.files[key]}")
    failed = sorted({f"{r.target}@{rate_label(r.rate)}" for r in outcome.runs if not r.ok})
    if failed:
        print(f"runs without a successful request: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
