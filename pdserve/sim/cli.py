"""`pdserve sim`: a deployment simulated from instance profiles, reported as `pdserve bench serve` reports a
measured one (and `--search`: the best split for a GPU budget; pdserve/sim/search.py).

    pdserve sim --profile cpu-smollm2-1core --topology 1p1d --random-input-len 256 --random-output-len 32 \\
        --request-rate 0.2 --num-prompts 50 --goodput ttft:5000 tpot:500
    pdserve sim --profile h200-llama3.1-8b-fp8 --search --gpus 8 --random-input-len 32000 \\
        --random-output-len 400 --goodput ttft:2500 tpot:45 --plot search.png
"""

from __future__ import annotations

import argparse
import math
import sys

from pdserve.bench.options import BenchSpec, add_serve_arguments
from pdserve.launch.config import parse_topology
from pdserve.sim.options import SimOptions
from pdserve.sim.profile import Profile
from pdserve.types.push_pipeline import DEFAULT_PUSH_LAYERWISE_MIN_TOKENS, PUSH_PIPELINES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    g = parser.add_argument_group("simulation")
    g.add_argument("--profile", required=True,
                   help="instance profile JSON (`pdserve profile --out`), or a shipped one's name: "
                        "h200-llama3.1-8b-bf16, h200-llama3.1-8b-fp8, cpu-smollm2-1core")
    g.add_argument("--prefill-profile", default=None, help="the prefill instances' profile (default --profile)")
    g.add_argument("--decode-profile", default=None, help="the decode instances' profile (default --profile)")
    g.add_argument("--topology", default="1p1d", help="as `pdserve up`: collocated[:N] | 1p1d | XpYd (default 1p1d)")
    for role in ("prefill", "decode", "collocated"):
        g.add_argument(f"--{role}-tp", type=int, default=None, metavar="N",
                       help=f"tensor-parallel size of each {role} instance (a TP=1 profile is scaled: an estimate)")
    g.add_argument("--tp-efficiency", type=float, default=0.9,
                   help="for TP sizes derived from a TP=1 profile: speed-up = TP x this (default 0.9; an assumption)")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="a trace file (CSV/JSONL: arrival, input and output tokens; Azure or Mooncake columns) "
                        "instead of --dataset-name")
    g.add_argument("--trace-time-unit", choices=("auto", "s", "ms"), default="auto")
    g.add_argument("--vocab-size", type=int, default=32000, help="token ids the synthetic prompts draw from")
    f = parser.add_argument_group("deployment features (pdserve up's, serve's kv_connector_extra_config and "
                                  "pdserve proxy's names and defaults)")
    f.add_argument("--kv-transfer-mode", choices=("pull", "push"), default="pull",
                   help="pull: the decode READs the prompt's KV; push: the prefill WRITEs it (both legs at once)")
    f.add_argument("--push-pipeline", choices=PUSH_PIPELINES, default="auto",
                   help="push: WRITE layer by layer as chunks are computed, or the whole request after the prefill "
                        "(auto: layer on CPU profiles, request on GPU profiles)")
    f.add_argument("--push-layerwise-min-tokens", type=int, default=DEFAULT_PUSH_LAYERWISE_MIN_TOKENS,
                   help="push: shorter prompts are pushed whole")
    f.add_argument("--kv-history", action="store_true",
                   help="multi-turn over P/D: decode instances keep each conversation and the proxy has the next "
                        "turn's prefill read it back when that is cheaper (bidirectional_kv_xfer)")
    f.add_argument("--decoder-kv-blocks-ttl", type=float, default=480.0, help="--kv-history: a held history's lease")
    f.add_argument("--kv-recompute-threshold", type=int, default=64,
                   help="--kv-history: fewer held tokens left to read are recomputed")
    f.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=None,
                   help="instances publish KV events and the proxy routes by cached prefix (default: in each role "
                        "of more than one instance, as pdserve up; needs prompts with token ids, not a trace)")
    for name, kind, what in (("--kv-history-bandwidth", str, "the history decision's link (pdserve plan preset)"),
                             ("--kv-history-prefill-tps", float, "the history decision's recompute rate"),
                             ("--kv-history-overhead-s", float, "the history decision's fixed cost of a read"),
                             ("--kv-history-choice", str, "cost | pull | recompute"),
                             ("--kv-overlap-weight", float, "routing by cached prefix: tokens saved per token of load"),
                             ("--disagg-threshold-tokens", int, "conditional disaggregation: fewer uncached prompt "
                                                                "tokens are served by a decode instance whole")):
        f.add_argument(name, type=kind, default=None, help=f"the proxy's {name}: {what}")
    f.add_argument("--no-early-decode-leg", action="store_true", help="the proxy's --no-early-decode-leg")
    s = parser.add_argument_group("search (--search)")
    s.add_argument("--search", action="store_true", help="search P:D split and TP per pool under --gpus")
    s.add_argument("--gpus", type=int, default=8, help="GPU budget of --search (default 8)")
    s.add_argument("--tp-sizes", default="1", help="TP sizes --search tries per pool (default 1; e.g. 1,2,4)")
    s.add_argument("--request-rates", default=None,
                   help="comma list of rates --search sweeps (default: doubling from 0.25 until goodput falls)")
    s.add_argument("--search-duration", type=float, default=120.0,
                   help="--search: at least this many seconds of arrivals at each rate (default 120)")
    s.add_argument("--top", type=int, default=5, help="configurations --search prints (default 5)")
    s.add_argument("--plot", default=None, help="--search: goodput-vs-rate plot file (PNG)")
    add_serve_arguments(parser)


def sim_options(args: argparse.Namespace) -> SimOptions:
    """The deployment's features from the flags (options.py); the proxy's own flags into its ProxyConfig."""
    from pdserve.proxy.config import ProxyConfig

    cfg = ProxyConfig(early_decode_leg=not args.no_early_decode_leg)
    for name in ("kv_history_bandwidth", "kv_history_prefill_tps", "kv_history_overhead_s", "kv_history_choice",
                 "kv_overlap_weight", "disagg_threshold_tokens"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    return SimOptions(kv_transfer_mode=args.kv_transfer_mode, push_pipeline=args.push_pipeline,
                      push_layerwise_min_tokens=args.push_layerwise_min_tokens, kv_history=args.kv_history,
                      decoder_kv_blocks_ttl=args.decoder_kv_blocks_ttl,
                      kv_recompute_threshold=args.kv_recompute_threshold, kv_events=args.kv_events,
                      proxy=cfg).validate()


def _spec(args: argparse.Namespace) -> BenchSpec:
    spec = BenchSpec.from_namespace(args)
    if args.trace:
        spec.dataset_name = "trace"
    return spec


def main(args: argparse.Namespace) -> int:
    try:
        base = Profile.load(args.profile)
        prefill = Profile.load(args.prefill_profile) if args.prefill_profile else None
        decode = Profile.load(args.decode_profile) if args.decode_profile else None
        spec = _spec(args)
        args.sim_options = sim_options(args)
        if args.search:
            from pdserve.sim.search import search_main

            return search_main(args, spec, base, prefill, decode)
        topo = parse_topology(args.topology)
        return run_one(args, spec, topo, base, prefill, decode)
    except (ValueError, OSError) as err:
        print(f"pdserve sim: error: {err}", file=sys.stderr)
        return 2


def jobs_for(args: argparse.Namespace, spec: BenchSpec, block_sizes: set[int]):
    from pdserve.sim.workload import bench_jobs, load_trace

    if args.trace:
        return load_trace(args.trace, spec.num_prompts, args.trace_time_unit)
    tokenizer = None
    if spec.dataset_name == "jsonl" and spec.tokenizer:
        from pdserve.bench.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(spec.tokenizer)
    return bench_jobs(spec, args.vocab_size, tokenizer)


def run_one(args: argparse.Namespace, spec: BenchSpec, topo, base: Profile, prefill: Profile | None,
            decode: Profile | None) -> int:
    from pdserve.bench.runner import result_path, write_json
    from pdserve.sim.report import bench_result
    from pdserve.sim.run import Pools, simulate

    pools = Pools.of(base, prefill=prefill, decode=decode, tp_efficiency=args.tp_efficiency,
                     tp={"prefill": args.prefill_tp, "decode": args.decode_tp, "collocated": args.collocated_tp})
    if spec.dataset_name == "multiturn" and not args.trace:
        return run_multiturn(args, spec, topo, pools, base)
    jobs = jobs_for(args, spec, {pools.prefill.engine.block_size, pools.decode.engine.block_size})
    unit = "GPUs" if base.device.startswith("cuda") else "devices"
    print(f"Simulating {topo} ({pools.gpus(topo)} {unit}) with profile {base.name}: {len(jobs)} requests, "
          f"request rate {spec.request_rate if not args.trace else 'from the trace'}")
    for note in {n for p in (pools.prefill, pools.decode, pools.collocated) for n in p.notes if "DERIVED" in n}:
        print(f"NOTE: {note}")
    run = simulate(topo, pools, jobs, options=args.sim_options)
    print(f"Simulated {run.sim_s:.2f} s in {run.wall_s:.2f} s of wall time ({run.deployment.events} events)")
    result, _ = bench_result(spec, run.tracked, base.model, str(topo))
    result["simulated"] = {"topology": str(topo), "profile": base.name, "gpus": pools.gpus(topo),
                           "wall_s": run.wall_s, "events": run.deployment.events,
                           "preemptions": sum(i.scheduler.num_preemptions
                                              for i in run.deployment.instances.values())}
    if spec.save_result:
        path = result_path(spec, base.model, f"sim-{topo}".replace(":", "x"))
        write_json(path, result)
        print(f"Saved result to {path}")
    return 0 if result["completed"] > 0 else 1


def run_multiturn(args: argparse.Namespace, spec: BenchSpec, topo, pools, base: Profile) -> int:
    """Conversations turn by turn, reported by bench/multiturn.py's own per-turn table and JSON."""
    from pdserve.bench import multiturn as mt
    from pdserve.bench.runner import result_path, write_json
    from pdserve.sim.instance import OUTPUT_TOKEN
    from pdserve.sim.run import simulate_conversations
    from pdserve.sim.workload import multiturn_conversations

    convs = multiturn_conversations(spec, args.vocab_size, OUTPUT_TOKEN)
    print(f"Simulating {topo} with profile {base.name}: {len(convs)} conversations of {spec.multiturn_turns} turns")
    run = simulate_conversations(topo, pools, convs, spec.multiturn_think_time, spec.max_concurrency,
                                 options=args.sim_options)
    results = [mt.TurnResult(t.conversation, t.turn, t.done and not t.error and bool(t.token_times),
                             ttft=(t.token_times[0] - t.job.arrival) if t.token_times else 0.0,
                             latency=(t.token_times[-1] - t.job.arrival) if t.token_times else 0.0,
                             prompt_tokens=t.job.prompt_len, cached_tokens=t.cached_tokens,
                             completion_tokens=len(t.token_times), error=t.error)
               for t in run.deployment.tracked]
    summary = mt.summarize_turns(results)
    print(mt.format_turns(summary, run.sim_s))
    opts = mt.MultiTurnOptions(spec.multiturn_turns, spec.multiturn_system_len, spec.multiturn_user_len,
                               spec.multiturn_answer_len, spec.multiturn_think_time)
    result = {"date": "simulated", "label": spec.label, "model_id": base.model,
              **mt.result_json(summary, results, run.sim_s, opts)}
    if not spec.save_detailed:
        result.pop("requests")
    if spec.save_result:
        path = result_path(spec, base.model, f"sim-{topo}".replace(":", "x"))
        write_json(path, result)
        print(f"Saved result to {path}")
    return 0 if result["completed"] > 0 else 1


def parse_rates(text: str | None) -> list[float] | None:
    if not text:
        return None
    return [math.inf if r.strip() == "inf" else float(r) for r in text.split(",") if r.strip()]
