"""What a speculative verify step costs on the GPU against a plain decode step (issue 42's goal: K = 4 within
1.15x of a plain graph step at batch 1, 4 and 16), 8B shape with dummy weights:

    python benchmarks/gpu_spec_verify_cost.py --model Llama-3.1-8B --batch 1,4,16 --context 2048 --k 4

The engine is built with ngram speculation (K = --k), so it captures the verify CUDA graphs
(pdserve/engine/runner/verify_graphs.py) beside the decode graphs; PDSERVE_SPEC_VERIFY_GRAPHS=0 builds none
(every verify column is then the eager step). For each batch size, B requests are prefilled to `--context`
tokens, then timed over `--iters` repetitions (each rewrites the same KV slots, so the state stays put):
- plain: the engine's decode step (`ModelRunner.execute`: the CUDA graph, greedy argmax on the device);
- plain eager: the same step without the graph (`execute_logits` with one row each + argmax);
- verify graph: K random drafts per request (none accepted: the cost per step does not depend on it), the
  step as the engine runs it (`ModelRunner.execute_verify`: the verify graph, the rows' argmax read back)
  plus the rejection sampler's greedy accept (`spec_decode.rejection.verify`);
- verify graph, uneven: the same with draft lengths K, K - 1, ..., 0 in turn across the requests (padded to K:
  still one graph; at batch 1 the request has K - 1 drafts);
- verify eager: the same step with the graphs switched off at run time (`GpuStepRunner.verify_graphs_on`).
The ratio verify / plain is the price of speculation per step: speculation wins when the mean acceptance
length (vllm:spec_decode_* on /metrics, `pdserve bench`) exceeds it. A verify column that did not replay a
graph is marked "(eager!)". `--skinny-ab` then recaptures the graphs with PDSERVE_SKINNY_GEMM's kernel for
linears of 2-32 rows (pdserve/engine/runner/skinny_gemm.py, an experiment) and prints the table again. Runs on CPU too (`--device cpu --model DIR`), which checks the script, not the
GPU's numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, iters: int, device: torch.device) -> float:
    """Median ms of fn() over iters calls (after 3 warm-up calls), each ending with a host sync."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def simulate_graphs(runner) -> None:
    """The GPU step path on the CPU, graphs simulated (as tests/test_async_scheduling.simulate_gpu_path)."""
    from pdserve.attention.torch_ref import TorchAttention

    runner.backend = TorchAttention()
    runner.model.fused_ops = None
    runner.use_gpu_step_runner(simulate_graphs=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--simulate-graphs", action="store_true",
                    help="CPU check of the script: the GPU step path with its graphs simulated (torch attention)")
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--skinny-ab", action="store_true",
                    help="then the same with PDSERVE_SKINNY_GEMM's kernel for linears of 2-32 rows (graphs recaptured)")
    args = ap.parse_args()

    from pdserve.engine.engine import LLMEngine
    from pdserve.types.engine_config import EngineConfig

    batches = [int(b) for b in args.batch.split(",")]
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, device=args.device,
                                    max_model_len=args.context + 16 * args.k + 64, max_num_seqs=max(batches),
                                    speculative_config=spec))
    if args.simulate_graphs:
        simulate_graphs(engine.runner)
    gpu = engine.runner.gpu
    g = torch.Generator().manual_seed(0)
    print(f"{args.model} ({args.load_format}), context {args.context}, K = {args.k}, device {engine.runner.device}, "
          f"verify graphs {gpu.verify_graphs if gpu is not None else None}")
    table(engine, batches, args, g)
    if args.skinny_ab and gpu is not None:
        # the A/B of pdserve/engine/runner/skinny_gemm.py: linears of 2-32 rows on its kernel instead of cuBLAS
        import gc

        try:
            from pdserve.engine.runner import skinny_gemm

            skinny_gemm.ENABLED = True
            engine.runner.gpu = None
            gc.collect()
            if engine.runner.device.type == "cuda":
                torch.cuda.empty_cache()
            engine.runner.use_gpu_step_runner(simulate_graphs=args.simulate_graphs)  # every graph recaptured
            print("\nPDSERVE_SKINNY_GEMM=1 (linears of 2-32 rows on skinny_gemm's kernel; graphs recaptured):")
            table(engine, batches, args, g)
        except Exception as e:  # noqa: BLE001 - the experiment must not hide the table above
            print(f"skinny A/B failed: {type(e).__name__}: {e}")


def table(engine, batches: list[int], args: argparse.Namespace, g: torch.Generator) -> None:
    print("| batch | plain step (graph) ms | plain step (eager) ms | verify K+1 rows (graph) ms | verify, uneven "
          "drafts (graph) ms | verify K+1 rows (eager) ms | verify graph / plain | uneven / plain "
          "| verify eager / plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in batches:
        t = measure(engine, b, args, g)
        print(f"| {b} | {t['plain']:.2f} | {t['eager_plain']:.2f} | {t['verify_graph']:.2f}{t['graph_mark']} | "
              f"{t['verify_uneven']:.2f}{t['uneven_mark']} | {t['verify_eager']:.2f} | "
              f"{t['verify_graph'] / t['plain']:.2f} | {t['verify_uneven'] / t['plain']:.2f} | "
              f"{t['verify_eager'] / t['plain']:.2f} |", flush=True)


def measure(engine, b: int, args: argparse.Namespace, g: torch.Generator) -> dict:
    """ms of each step kind for b requests at args.context tokens (see the module's docstring)."""
    from pdserve.engine.spec_decode.rejection import verify
    from pdserve.types.sampling_params import SamplingParams

    runner, vocab = engine.runner, engine.model_cfg.vocab_size
    gpu = runner.gpu
    ids = [f"b{b}-{i}" for i in range(b)]
    for rid in ids:
        engine.add_request(rid, torch.randint(100, vocab, (args.context,), generator=g).tolist(),
                           SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    for _ in range(10 * b + 100):  # bounded: the prompts' prefill chunks, then each has its first token
        engine.step()
        if all(engine.requests[r].output_token_ids for r in ids):
            break
    reqs = [engine.requests[r] for r in ids]
    for r in reqs:
        r.spec_token_ids = []
        assert r.num_computed_tokens == r.num_tokens - 1, "not in the decode phase"
        assert engine.blocks.allocate(r, r.num_tokens + args.k), "the KV pool is too small"
    plain_batch = [(r, 1) for r in reqs]
    out = {"plain": timed(lambda: runner.execute(plain_batch), args.iters, runner.device)}

    def eager_plain():
        _, logits = runner.execute_logits(plain_batch)
        logits.argmax(dim=-1).tolist()

    out["eager_plain"] = timed(eager_plain, args.iters, runner.device)
    drafts = {r.request_id: torch.randint(100, vocab, (args.k,), generator=g).tolist() for r in reqs}
    even = [args.k] * b
    uneven = [max(0, args.k - 1 - i % args.k) if b == 1 else args.k - i % (args.k + 1) for i in range(b)]

    def verify_step(lengths: list[int]):
        for r, n in zip(reqs, lengths, strict=True):
            r.spec_token_ids = drafts[r.request_id][:n]
        got, logits, argmax = runner.execute_verify([(r, 1 + n) for r, n in zip(reqs, lengths, strict=True)])
        verify(runner.sampler, logits, got, argmax)
        for r in reqs:
            r.spec_token_ids = []

    for name, lengths, on in (("verify_graph", even, True), ("verify_uneven", uneven, True),
                              ("verify_eager", even, False)):
        if gpu is not None:
            gpu.verify_graphs_on = on
        before = gpu.verify_graph_steps if gpu is not None else 0
        out[name] = timed(lambda lengths=lengths: verify_step(lengths), args.iters, runner.device)
        replayed = (gpu.verify_graph_steps if gpu is not None else 0) - before
        if name != "verify_eager":
            out[name.replace("verify_", "") + "_mark"] = "" if replayed >= args.iters else " (eager!)"
    if gpu is not None:
        gpu.verify_graphs_on = True
    for rid in ids:
        engine.abort_request(rid)
    return out


if __name__ == "__main__":
    main()
