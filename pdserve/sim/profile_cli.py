"""`pdserve profile`: measure one instance and write its profile JSON for `pdserve sim`.

    pdserve profile --url http://127.0.0.1:8000 --out my-instance.json     # a running server
    pdserve profile [MODEL] [serve flags] --out cpu.json                   # an engine built in process

The handoff's fixed cost is not measured by one instance: give --handoff-params-ms (the prefill's params back
through the proxy to the waiting decode leg) and --handoff-claim-ms (the lease claim), e.g. from `benchmarks/
bench_pd.py`'s breakdown; in process the link's rate is a one-thread memory copy's (one host), else
--link-gbytes-per-s.
"""

from __future__ import annotations

import argparse
import sys


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.server.cli import add_arguments as add_serve_arguments

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    add_serve_arguments(p)
    g = p.add_argument_group("profile")
    g.add_argument("--url", default=None, help="profile a running server instead of an engine in process")
    g.add_argument("--out", required=True, help="the profile JSON to write")
    g.add_argument("--name", default=None, help="the profile's name (default: from the model and device)")
    g.add_argument("--prefill-lens", type=_ints, default=None, help="new-token counts (default 32,128,512,1024 "
                   "CPU; 1024,4096,8192,16384 GPU)")
    g.add_argument("--cached-lens", type=_ints, default=None, help="cached-token counts (default 0,<2 blocks>)")
    g.add_argument("--decode-batches", type=_ints, default=None, help="batch sizes (default 1,4,8 CPU; 1,16,64 GPU)")
    g.add_argument("--decode-contexts", type=_ints, default=None, help="context tokens per request (default "
                   "64,512 CPU; 512,4096 GPU)")
    g.add_argument("--decode-steps", type=int, default=12, help="decode steps timed per point (default 12)")
    g.add_argument("--handoff-params-ms", type=float, default=0.0)
    g.add_argument("--handoff-claim-ms", type=float, default=0.0)
    g.add_argument("--link-gbytes-per-s", type=float, default=None)
    g.add_argument("--ingress-ms", type=float, default=None, help="HTTP in (default: measured with --url, else 0)")
    g.add_argument("--egress-ms", type=float, default=None, help="HTTP out (default: measured with --url, else 0)")


def main(args: argparse.Namespace) -> int:
    from pdserve.sim import profiler
    from pdserve.sim.profile import refit

    load_before = profiler.load_average()
    notes: list[str] = []
    if args.url:
        m: profiler.EngineMeasure | profiler.HttpMeasure = profiler.HttpMeasure(args.url, args.model_flag)
        m.run(m._start())
        info = m.info
        settings, read = profiler.http_settings(info)
        gpu = str(info.get("device", "cpu")).startswith("cuda")
        bs = settings.block_size
        if not read:
            notes.append("profiled over HTTP: the scheduler settings are pdserve's defaults for the device, not read "
                         "from the server")
        model, device = str(info.get("model", m.model)), str(info.get("device", "unknown"))
        tp, kv_dtype = int(info.get("tensor_parallel_size", 1)), str(info.get("kv_cache_dtype", "auto"))
    else:
        from pdserve.engine.engine import LLMEngine
        from pdserve.server.cli import engine_config

        cfg = engine_config(args)
        engine = LLMEngine(cfg)
        m = profiler.EngineMeasure(engine)
        gpu = engine.runner.device.type == "cuda"
        settings = m.settings()
        bs = settings.block_size
        model, device = str(cfg.model or engine.model_dir.name), str(engine.runner.device)
        tp, kv_dtype = cfg.tensor_parallel_size, engine.runner.kv_cache_dtype
    prefill_lens = args.prefill_lens or ([1024, 4096, 8192, 16384] if gpu else [32, 128, 512, 1024])
    cached_lens = args.cached_lens if args.cached_lens is not None else [0, 2 * bs]
    batches = args.decode_batches or ([1, 16, 64] if gpu else [1, 4, 8])
    contexts = args.decode_contexts or ([512, 4096] if gpu else [64, 512])
    try:
        if args.url:
            base = m.prefill(1, 0, profiler.np.random.default_rng(1))
        pre, dec = profiler.measure(m, prefill_lens=prefill_lens, cached_lens=cached_lens, decode_batches=batches,
                                    decode_contexts=contexts, decode_steps=args.decode_steps,
                                    log=lambda s: print(s, file=sys.stderr))
    finally:
        if not args.url:
            engine.shutdown()
    kv = m.kv()
    prof = profiler.base_profile(args.name or f"{model}-{device}".replace("/", "_"), model, device, kv, settings,
                                 tp, kv_dtype)
    prof.prefill_points, prof.decode_points = pre, dec
    if args.url:
        # a one-token prompt's TTFT is the HTTP path plus one tiny step: the path, split evenly in/out
        path = profiler.http_path_s(base, dec)
        ingress = egress = path / 2
        for p in pre:
            p["seconds"] = max(p["seconds"] - path, 1e-6)
        notes.append(f"prefill points: TTFT less the HTTP path ({path * 1e3:.1f} ms: a one-token prompt's TTFT "
                     f"{base * 1e3:.1f} ms less one decode step)")
    else:
        ingress = egress = 0.0
    prof.overheads.ingress_s = (args.ingress_ms / 1e3) if args.ingress_ms is not None else ingress
    prof.overheads.egress_s = (args.egress_ms / 1e3) if args.egress_ms is not None else egress
    prof.handoff.params_s = args.handoff_params_ms / 1e3
    prof.handoff.claim_s = args.handoff_claim_ms / 1e3
    if args.link_gbytes_per_s:
        prof.handoff.link_bytes_per_s = args.link_gbytes_per_s * 1e9
    elif not args.url:
        prof.handoff.link_bytes_per_s = profiler.copy_rate()
        notes.append("link rate: a one-thread memory copy in this process (one host)")
    refit(prof)
    notes.append(f"load average before / after: {load_before} / {profiler.load_average()}")
    prof.notes = notes
    prof.source = "pdserve profile " + " ".join(sys.argv[2:])
    prof.save(args.out)
    print(f"wrote {args.out}: step model {prof.step_model}, fit {prof.fit_residuals}")
    return 0
