"""`pdserve bench compare`: one workload, a sweep of request rates, several targets, one report.

Targets are URLs of running servers (`--target NAME=URL`) or topologies started with `pdserve up`
(`--launch NAME=TOPOLOGY`, one at a time, stopped after their sweep). Every target sees the same
prompts and arrival times at a given rate; prompts differ between rates (seed + rate index) so a prefix
cache cannot serve a later rate from an earlier one (`--same-prompts-across-rates` turns that off).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from pdserve.bench.launcher import LaunchedTopology, LaunchError
from pdserve.bench.metrics import parse_goodput
from pdserve.bench.options import BenchSpec
from pdserve.bench.plots import make_plots
from pdserve.bench.report import html_report, markdown_report
from pdserve.bench.resources import Resources, inequality
from pdserve.bench.runner import (
    BenchError,
    Target,
    align_prompts,
    benchmark,
    build_requests,
    finalize_result,
    needs_tokenizer,
    resolve_target,
    write_json,
)
from pdserve.bench.summary import RunSummary, rate_label, summarize_result
from pdserve.bench.transfer import NOT_CHECKED, TransferCheck, discover_decode_urls, judge, snapshot
from pdserve.bench.types import SampleRequest
from pdserve.bench.verdict import Verdict, decide, note_resources

AUTO = "auto"
TRANSFER_READ_ERRORS = (aiohttp.ClientError, TimeoutError, RuntimeError, KeyError, TypeError, ValueError)


def unreadable(urls: list[str], err: BaseException) -> TransferCheck:
    """A transfer check that was asked for but could not be read counts as failed: never a silent GO."""
    return TransferCheck(
        "fail", f"cannot read the decode instances' metrics: {type(err).__name__}: {err}", urls
    )


@dataclass
class TargetEntry:
    name: str
    kind: str  # "url" | "launch"
    value: str  # URL or topology


@dataclass
class CompareConfig:
    targets: list[TargetEntry]
    rates: list[float]
    baseline: str
    output_dir: str
    transfer_urls: dict[str, list[str]] = field(default_factory=dict)  # target -> URLs, or [AUTO]
    max_xfer_ms: float = 100.0
    itl_slo_ms: float | None = None
    cdf_rate: float | None = None
    same_prompts: bool = False
    launch_command: list[str] | None = None
    launch_args: list[str] = field(default_factory=list)
    launch_timeout_s: float = 900.0
    min_gain: float = 0.0
    # what each target runs on (None: not known, a running server's URL); planned before anything starts
    resources: dict[str, Resources | None] = field(default_factory=dict)
    allow_unequal: bool = False  # run an unequal comparison anyway (its verdicts say so)


@dataclass
class CompareOutcome:
    runs: list[RunSummary]
    verdicts: list[Verdict]
    files: dict[str, str]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


class Comparison:
    def __init__(self, cfg: CompareConfig, base: BenchSpec) -> None:
        self.cfg = cfg
        self.base = base
        self.runs: list[RunSummary] = []
        self.transfers: dict[str, TransferCheck] = {}
        self._workloads: dict[float, list[SampleRequest]] = {}
        self.runs_dir = os.path.join(cfg.output_dir, "runs")

    # -- one target ---------------------------------------------------------------------------------
    def run_target(self, entry: TargetEntry) -> None:
        try:
            if entry.kind == "launch":
                # `pdserve up` without a model serves the embedded default; so does a launch here.
                from pdserve.model.default_model import DEFAULT_MODEL

                model = self.base.model or DEFAULT_MODEL
                logs = os.path.join(self.cfg.output_dir, "logs")
                extra = list(self.cfg.launch_args)
                if self.cfg.launch_command is None and not any(a.startswith("--log-dir") for a in extra):
                    extra += [
                        "--log-dir",
                        os.path.join(logs, _safe(entry.name)),
                    ]  # instance logs of `pdserve up`
                with LaunchedTopology(
                    entry.name,
                    entry.value,
                    model,
                    os.path.join(logs, f"launch-{_safe(entry.name)}.log"),
                    self.cfg.launch_command,
                    extra,
                    ready_timeout_s=self.cfg.launch_timeout_s,
                ) as url:
                    asyncio.run(self.sweep(entry.name, url))
            else:
                asyncio.run(self.sweep(entry.name, entry.value))
        except (BenchError, LaunchError, OSError, ValueError) as err:
            self._record_failure(entry.name, f"{type(err).__name__}: {err}")

    def _record_failure(self, name: str, message: str) -> None:
        print(f"[{name}] failed: {message}", flush=True)
        done = {r.rate for r in self.runs if r.target == name}
        for rate in self.cfg.rates:
            if rate not in done:
                self.runs.append(RunSummary(name, rate, error=message))

    async def _workload(self, rate: float, target: Target, spec: BenchSpec) -> list[SampleRequest]:
        """The rate's prompts, built once (with the first target's tokenizer) and shared by all targets."""
        if rate not in self._workloads:
            requests = build_requests(spec, target.tokenizer)
            if spec.dataset_name in ("random", "prefix") and not spec.no_align_prompts:
                requests = await align_prompts(
                    target.root_url, target.model_name or target.model_id, requests
                )
            self._workloads[rate] = requests
        return self._workloads[rate]

    def _transfer_urls(self, name: str) -> list[str] | None:
        return self.cfg.transfer_urls.get(name)

    async def sweep(self, name: str, url: str) -> None:
        spec_t = replace(
            self.base, base_url=url.rstrip("/"), label=name, save_result=False, save_detailed=True
        )
        target = await resolve_target(spec_t, needs_tokenizer(spec_t))
        check_urls = self._transfer_urls(name)
        before = None
        if check_urls is not None:
            try:
                if check_urls == [AUTO]:
                    check_urls = await discover_decode_urls(spec_t.root_url)
                    self.cfg.transfer_urls[name] = check_urls
                before = await snapshot(check_urls)
            except TRANSFER_READ_ERRORS as err:
                self.transfers[name] = unreadable(check_urls, err)
        for i, rate in enumerate(self.cfg.rates):
            seed = self.base.seed if self.cfg.same_prompts else self.base.seed + i
            # x-request-ids unique across the whole comparison (a proxy may key state by them)
            prefix = f"{self.base.request_id_prefix}{_safe(name)}-r{i}-"
            spec_r = replace(spec_t, request_rate=rate, seed=seed, request_id_prefix=prefix)
            print(f"\n===== [{name}] request rate {rate_label(rate)} req/s =====", flush=True)
            requests = await self._workload(rate, target, spec_r)
            bench_result = await benchmark(spec_r, target, requests)
            result = finalize_result(spec_r, target, bench_result, time.strftime("%Y%m%d-%H%M%S"))
            result["target"] = name
            result["target_url"] = spec_t.root_url
            path = os.path.join(self.runs_dir, f"{_safe(name)}-{rate_label(rate)}qps.json")
            write_json(path, result)
            self.runs.append(summarize_result(name, rate, result, path))
        if check_urls is not None and before is not None:
            try:
                after = await snapshot(check_urls)
                self.transfers[name] = judge(after.delta(before), self.cfg.max_xfer_ms, check_urls)
            except TRANSFER_READ_ERRORS as err:
                self.transfers[name] = unreadable(check_urls, err)

    # -- everything -----------------------------------------------------------------------------------
    def run(self) -> CompareOutcome:
        os.makedirs(self.runs_dir, exist_ok=True)
        for entry in self.cfg.targets:
            try:
                self.run_target(entry)
            except Exception:  # one broken target must not lose the others' results
                self._record_failure(entry.name, traceback.format_exc(limit=3))
        return self.report()

    def report(self) -> CompareOutcome:
        cfg = self.cfg
        names = [t.name for t in cfg.targets]
        goodput = parse_goodput(self.base.goodput)
        itl_slo = cfg.itl_slo_ms if cfg.itl_slo_ms is not None else goodput.get("tpot")
        verdicts = [
            decide(
                cfg.baseline, name, self.runs, itl_slo, self.transfers.get(name, NOT_CHECKED), cfg.min_gain
            )
            for name in names
            if name != cfg.baseline
        ]
        for v in verdicts:
            pair = {n: cfg.resources.get(n) for n in (v.baseline, v.candidate)}
            note_resources(v, resource_text(pair[v.baseline]), resource_text(pair[v.candidate]), inequality(pair))
        finite = [r for r in cfg.rates if not math.isinf(r)]
        cdf_rate = cfg.cdf_rate if cfg.cdf_rate is not None else (max(finite) if finite else cfg.rates[-1])
        plots = make_plots(
            self.runs,
            names,
            cfg.rates,
            os.path.join(cfg.output_dir, "plots"),
            cdf_rate,
            goodput.get("ttft"),
            itl_slo,
        )
        workload = describe_workload(self.base, cfg)
        config = compare_config_dict(self.base, cfg, itl_slo, cdf_rate)
        files = dict(plots)
        md_path = os.path.join(cfg.output_dir, "results.md")
        with open(md_path, "w", encoding="utf-8") as f:
            f.write(markdown_report(self.runs, names, cfg.rates, verdicts, workload))
        files["markdown"] = md_path
        html_path = os.path.join(cfg.output_dir, "report.html")
        with open(html_path, "w", encoding="utf-8") as f:
            f.write(
                html_report(
                    self.runs,
                    names,
                    cfg.rates,
                    verdicts,
                    plots,
                    workload,
                    config,
                    time.strftime("%Y-%m-%d %H:%M:%S"),
                )
            )
        files["html"] = html_path
        summary_path = os.path.join(cfg.output_dir, "summary.json")
        with open(summary_path, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "config": config,
                    "runs": [r.to_dict() for r in self.runs],
                    "verdicts": [v.to_dict() for v in verdicts],
                    "files": {k: os.path.relpath(v, cfg.output_dir) for k, v in files.items()},
                },
                f,
                indent=2,
            )
        files["summary"] = summary_path
        return CompareOutcome(self.runs, verdicts, files)


def describe_workload(spec: BenchSpec, cfg: CompareConfig) -> str:
    if spec.dataset_name == "random":
        data = (
            f"random prompts of {spec.random_input_len} input / {spec.random_output_len} output tokens "
            f"(range ratio {spec.random_range_ratio:g}, shared prefix {spec.random_prefix_len})"
        )
    elif spec.dataset_name == "prefix":
        data = (
            f"shared-prefix prompts: {spec.num_prefixes} prefixes of {spec.prefix_len} tokens + "
            f"{spec.suffix_len}-token suffixes, {spec.random_output_len} output tokens"
        )
    else:
        data = f"prompts from {os.path.basename(spec.dataset_path or '')}"
    slos = ", ".join(f"{k} {v:g} ms" for k, v in parse_goodput(spec.goodput).items()) or "none"
    fresh = (
        "the same prompts at every rate" if cfg.same_prompts else "fresh prompts per rate (seed + rate index)"
    )
    problem = inequality(cfg.resources)
    equal = f"UNEQUAL ({problem})" if problem else "equal"
    resources = "; ".join(f"{t.name}: {resource_text(cfg.resources.get(t.name))}" for t in cfg.targets)
    return (
        f"Workload: {data}; {spec.num_prompts} requests per run{', ignore_eos' if spec.ignore_eos else ''}; "
        f"burstiness {spec.burstiness:g}; rates {', '.join(rate_label(r) for r in cfg.rates)} req/s; "
        f"goodput SLOs {slos}; {fresh}.\n\nResources ({equal}): {resources}."
    )


def resource_text(resources: Resources | None) -> str:
    return resources.describe() if resources is not None else "not known (a running server: not checked)"


def compare_config_dict(
    spec: BenchSpec, cfg: CompareConfig, itl_slo: float | None, cdf_rate: float
) -> dict[str, Any]:
    return {
        "targets": ", ".join(
            f"{t.name}={'launch ' if t.kind == 'launch' else ''}{t.value}" for t in cfg.targets
        ),
        "baseline (collocated)": cfg.baseline,
        "request rates": ", ".join(rate_label(r) for r in cfg.rates),
        "model": spec.model or "(from /v1/models)",
        "backend": spec.backend,
        "dataset": spec.dataset_name,
        "num prompts per run": spec.num_prompts,
        "max concurrency": spec.max_concurrency,
        "burstiness": spec.burstiness,
        "seed": spec.seed,
        "goodput": " ".join(spec.goodput or []),
        "ITL target (ms)": itl_slo,
        "TTFT CDF rate": rate_label(cdf_rate),
        "transfer check URLs": "; ".join(f"{k}: {', '.join(v)}" for k, v in cfg.transfer_urls.items())
        or "none",
        "max mean transfer time (ms)": cfg.max_xfer_ms,
        "min relative goodput gain": cfg.min_gain,
        **{f"resources: {t.name}": resource_text(cfg.resources.get(t.name)) for t in cfg.targets},
        "resources equal": inequality(cfg.resources) is None,
    }
