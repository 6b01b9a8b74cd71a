"""Structured outputs: what a grammar costs per decode step, and the grammar engines compared.

1. `--compare` (the choice of engine, ARCHITECTURE.md): llguidance and xgrammar (when importable) over the same
   tokenizer: tokenizer set-up, compile time of each of the 20 test schemas (cold), and the time to fill one
   next-token bitmask while walking each schema's example document token by token.
2. The pdserve path, at batch 1 and 64 (rows with a grammar each, schemas round-robin, documents walked in
   lockstep): `grammar_bias` (fill every row's bitmask on the host, one copy, unpack on the device) and the
   sampler's whole logits adjustment with the grammars against the same batch without them.

    python benchmarks/bench_structured.py [--tokenizer DIR] [--device cpu|cuda] [--compare] [--steps 200]

The default tokenizer is the embedded SmolLM2's (49,152 tokens); mask cost grows with the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from pdserve.engine.request import Request
from pdserve.engine.runner.sampler import Sampler, grammar_bias
from pdserve.structured.grammar import GrammarCompiler
from pdserve.testing.json_schemas import SCHEMAS
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.structured_params import StructuredOutputsParams


def ms(values: list[float]) -> str:
    return f"mean {statistics.fmean(values) * 1e3:.3f} ms, median {statistics.median(values) * 1e3:.3f} ms"


def us(values: list[float]) -> str:
    p99 = sorted(values)[int(0.99 * (len(values) - 1))]
    return (f"mean {statistics.fmean(values) * 1e6:.1f} us, median {statistics.median(values) * 1e6:.1f} us, "
            f"p99 {p99 * 1e6:.1f} us, max {max(values) * 1e6:.0f} us")


def documents(tok: Any) -> list[list[int]]:
    return [tok.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False) for _, _, doc in SCHEMAS]


def compare_engines(tok: Any) -> None:
    docs = documents(tok)
    vocab = tok.vocab_size
    import llguidance
    import llguidance.hf

    t = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tok.hf, vocab)
    print(f"llguidance {llguidance.get_version() if hasattr(llguidance, 'get_version') else ''}: tokenizer "
          f"{(time.perf_counter() - t) * 1e3:.0f} ms")
    buf = torch.empty((1, (vocab + 31) // 32), dtype=torch.int32)
    compile_s: list[float] = []
    templates = []
    for _, schema, _ in SCHEMAS:
        t = time.perf_counter()
        templates.append(llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}), log_level=0))
        compile_s.append(time.perf_counter() - t)
    print(f"  compile (20 schemas, cold): {ms(compile_s)}, max {max(compile_s) * 1e3:.2f} ms")
    for rnd in ("first walk", "second walk"):
        fill_s = []
        for template, ids in zip(templates, docs, strict=True):
            m = template.deep_copy()
            for tid in ids:
                t = time.perf_counter()
                m.unsafe_compute_mask_ptr(buf.data_ptr(), buf.shape[1] * 4)
                fill_s.append(time.perf_counter() - t)
                assert m.consume_token(tid), m.get_error()
        print(f"  mask fill per token, {rnd} ({len(fill_s)} tokens): {us(fill_s)}")
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar: not installed (pip install xgrammar==0.2.8 into another venv to compare)")
        return
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    print(f"xgrammar {getattr(xgr, '__version__', '')}: tokenizer {(time.perf_counter() - t) * 1e3:.0f} ms")
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    compile_s = []
    compiled = []
    for _, schema, _ in SCHEMAS:
        t = time.perf_counter()
        compiled.append(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                     separators=(",", ":")))
        compile_s.append(time.perf_counter() - t)
    print(f"  compile (20 schemas, cold): {ms(compile_s)}, max {max(compile_s) * 1e3:.2f} ms")
    for rnd in ("first walk", "second walk"):
        fill_s, refused = [], []
        for (name, _, _), cg, ids in zip(SCHEMAS, compiled, docs, strict=True):
            m = xgr.GrammarMatcher(cg)
            for tid in ids:
                t = time.perf_counter()
                m.fill_next_token_bitmask(bitmask, 0)
                fill_s.append(time.perf_counter() - t)
                if not m.accept_token(tid):
                    refused.append(name)  # a schema feature it reads differently: the document stops here
                    break
        print(f"  mask fill per token, {rnd} ({len(fill_s)} tokens): {us(fill_s)}"
              + (f"; refused a valid document of: {', '.join(refused)}" if refused else ""))


def path_cost(tok: Any, device: torch.device, batch: int, steps: int) -> None:
    compiler = GrammarCompiler(tok.hf, tok.vocab_size, tok.eos_token_ids, disable_any_whitespace=True)
    specs = [StructuredOutputsParams(json=s) for _, s, _ in SCHEMAS]
    docs = documents(tok)
    params = SamplingParams(temperature=0, structured_outputs=specs[0])
    reqs: list[Request] = []
    cursors: list[list[int]] = []
    for i in range(batch):
        r = Request(f"r{i}", [1, 2, 3], params, frozenset({2}), 4096)
        r.grammar = compiler.compile(specs[i % len(specs)])
        reqs.append(r)
        cursors.append([i % len(specs), 0])
    plain = [Request(f"p{i}", [1, 2, 3], SamplingParams(temperature=0), frozenset({2}), 4096) for i in range(batch)]
    logits = torch.randn(batch, tok.vocab_size, device=device)
    fill_s, with_s, without_s, host_s = [], [], [], []

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    from pdserve.structured.grammar import fill_bitmasks

    host = torch.empty((batch, compiler.words), dtype=torch.int32)
    for step in range(steps + 5):
        t = time.perf_counter()
        fill_bitmasks([r.grammar for r in reqs], host.data_ptr(), compiler.words * 4)
        if step >= 5:
            host_s.append(time.perf_counter() - t)
        sync()
        t0 = time.perf_counter()
        grammar_bias([r.grammar for r in reqs], tok.vocab_size, device)
        sync()
        t1 = time.perf_counter()
        Sampler.adjust(logits, reqs).argmax(dim=-1).tolist()
        t2 = time.perf_counter()
        Sampler.adjust(logits, plain).argmax(dim=-1).tolist()
        t3 = time.perf_counter()
        if step >= 5:  # warm-up steps (first allocations, lazy inits) are not counted
            fill_s.append(t1 - t0)
            with_s.append(t2 - t1)
            without_s.append(t3 - t2)
        for i, r in enumerate(reqs):  # advance along the example documents, restarting finished ones
            doc, pos = cursors[i]
            if pos == len(docs[doc]):
                r.grammar = compiler.compile(specs[doc])
                pos = 0
            assert r.grammar.accept(docs[doc][pos])
            cursors[i][1] = pos + 1
    print(f"batch {batch:>2} on {device.type}: bitmask fill on the host {ms(host_s)}; "
          f"masks (fill + copy + unpack) {ms(fill_s)}; adjust+argmax with "
          f"grammars {ms(with_s)}, without {ms(without_s)}; grammar overhead per step "
          f"{(statistics.fmean(with_s) - statistics.fmean(without_s)) * 1e3:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded SmolLM2's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compare", action="store_true", help="also compare llguidance with xgrammar")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    from pdserve.text.tokenizer import load_tokenizer

    if args.tokenizer is None:
        from pdserve.model.default_model import resolve_model

        args.tokenizer = str(resolve_model(None))
    tok = load_tokenizer(args.tokenizer)
    torch.set_num_threads(1)
    print(f"tokenizer {args.tokenizer}: {tok.vocab_size} tokens; torch threads 1")
    if args.compare:
        compare_engines(tok)
    device = torch.device(args.device)
    for batch in (1, 64):
        path_cost(tok, device, batch, args.steps)


if __name__ == "__main__":
    main()
