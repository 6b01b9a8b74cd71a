"""Async scheduling (pdserve.engine.runner.async_decode): decode steps launched before the previous step's tokens are
read, their input ids taken on the device from that step's argmax.

On the CPU the GPU step path runs with its decode graphs simulated (GpuStepRunner simulate_graphs) over the
torch reference attention, so the pipeline's logic — which steps launch ahead, which rows a step launched ahead
gets, dropping the rows of requests that ended, block allocation ahead, falling back to synchronous steps —
is exercised where no GPU and no Triton exist; on the GPU the same code replays CUDA graphs."""

from __future__ import annotations

import asyncio

import pytest
from engine_utils import hf_greedy, make_engine, mixed_prompts, run_engine

from pdserve.attention.torch_ref import TorchAttention
from pdserve.engine.engine import LLMEngine
from pdserve.engine.runner.async_decode import ASYNC_SCHEDULING_ENV, DEFAULT_ON_CUDA, async_scheduling_enabled
from pdserve.types.engine_config import EngineConfig
from pdserve.types.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def simulate_gpu_path(engine: LLMEngine) -> LLMEngine:
    """The engine's steps through the GPU step path, decode graphs simulated on the CPU (no Triton: the torch
    reference attention, whose decode path reads the sequence lengths on the device as the graphs need)."""
    r = engine.runner
    r.backend = TorchAttention()
    r.model.fused_ops = None
    r.use_gpu_step_runner(simulate_graphs=True)
    return engine


def sim_engine(model_dir, async_on: bool = True, **kw) -> LLMEngine:
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_num_seqs", 4)
    return simulate_gpu_path(make_engine(model_dir, async_scheduling=async_on, **kw))


def assert_pool_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # blocks allocated ahead all came back


def collect(engine: LLMEngine, max_steps: int = 2000, on_step=None) -> dict[str, list]:
    """Steps to the end; per request its outputs in order. Fails on any output after a request's last."""
    outs: dict[str, list] = {}
    for i in range(max_steps):
        if not engine.has_unfinished():
            break
        if on_step is not None:
            on_step(i)
        for o in engine.step():
            seen = outs.setdefault(o.request_id, [])
            assert not (seen and seen[-1].finished), f"output for {o.request_id} after it finished"
            seen.append(o)
    assert not engine.has_unfinished()
    return outs


def tokens_of(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_default_and_switches(monkeypatch):
    monkeypatch.delenv(ASYNC_SCHEDULING_ENV, raising=False)
    assert async_scheduling_enabled(None, "cuda") is DEFAULT_ON_CUDA and not async_scheduling_enabled(None, "cpu")
    monkeypatch.setenv(ASYNC_SCHEDULING_ENV, "0")
    assert not async_scheduling_enabled(None, "cuda")
    assert async_scheduling_enabled(True, "cuda")
    monkeypatch.setenv(ASYNC_SCHEDULING_ENV, "1")
    assert async_scheduling_enabled(None, "cpu") and not async_scheduling_enabled(False, "cpu")

    import argparse

    from pdserve.server.cli import add_arguments, engine_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    for argv, want in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        assert engine_config(p.parse_args(["--model", "x", *argv])).async_scheduling is want


def test_async_decode_is_token_exact_with_transformers(tiny_llama):
    """Batches of 4 and of 1, decodes crossing block ends, every later step launched ahead."""
    prompts = mixed_prompts(320, seed=3, lengths=(3, 17, 40, 64, 5))
    want = hf_greedy(tiny_llama, prompts, 24)
    engine = sim_engine(tiny_llama)
    params = SamplingParams(max_tokens=24, **GREEDY)
    assert run_engine(engine, prompts, params) == want
    ahead = engine.pipeline.num_launched_ahead
    assert ahead >= 20 * 2  # two batches (4 + 1 prompts), ~22 decode steps each launched ahead
    assert [run_engine(engine, [p], params)[0] for p in prompts[:2]] == want[:2]
    assert engine.pipeline.num_launched_ahead >= ahead + 2 * 20
    assert_pool_free(engine)


def test_stops_end_exactly_with_nothing_beyond(tiny_llama):
    """EOS, stop tokens, max_tokens and max_model_len in one batch: each request ends at the same token as a
    synchronous engine, the rows its step launched ahead are dropped, no output follows a finished one."""
    prompts = mixed_prompts(320, seed=5, lengths=(6, 20, 33, 11, 40))
    ref = run_engine(make_engine(tiny_llama), prompts, SamplingParams(max_tokens=20, **GREEDY))
    stop_tok = ref[0][6]  # ends request 0 at its first occurrence
    eos_tok = ref[1][3]  # the model's EOS for request 1 (engine.eos_token_ids set below)
    engine = sim_engine(tiny_llama, max_model_len=48)
    engine.eos_token_ids = frozenset({eos_tok})
    plist = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok]),
        SamplingParams(max_tokens=20, temperature=0.0),  # EOS
        SamplingParams(max_tokens=3, **GREEDY),
        SamplingParams(max_tokens=1, **GREEDY),
        SamplingParams(max_tokens=20, **GREEDY),  # 40 prompt tokens, max_model_len 48: ends by length after 8
    ]
    for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
        engine.add_request(f"q{i}", p, sp)
    outs = collect(engine)
    got = [tokens_of(outs[f"q{i}"]) for i in range(5)]
    assert got[0] == ref[0][: ref[0].index(stop_tok) + 1]
    assert got[1] == ref[1][: ref[1].index(eos_tok) + 1]
    assert got[2] == ref[2][:3] and got[3] == ref[3][:1] and got[4] == ref[4][:8]
    reasons = [(outs[f"q{i}"][-1].finish_reason, outs[f"q{i}"][-1].stop_reason) for i in range(5)]
    assert reasons == [("stop", stop_tok), ("stop", None), ("length", None), ("length", None), ("length", None)]
    assert engine.pipeline.num_launched_ahead > 0
    assert_pool_free(engine)


def test_abort_mid_stream_drops_the_step_in_flight(tiny_llama):
    prompts = mixed_prompts(320, seed=7, lengths=(9, 30, 14))
    want = hf_greedy(tiny_llama, prompts, 16)
    engine = sim_engine(tiny_llama)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, SamplingParams(max_tokens=16, **GREEDY))
    state = {"aborted": None}

    def maybe_abort(_step: int) -> None:
        req = engine.requests.get("a1")
        if state["aborted"] is None and req is not None and len(req.output_token_ids) >= 5:
            assert engine._inflight is not None and req in engine._inflight.reqs  # its next step is running
            state["aborted"] = engine.abort_request("a1")

    outs = collect(engine, on_step=maybe_abort)
    aborted = state["aborted"]
    assert aborted is not None and aborted.finished and aborted.finish_reason == "abort"
    assert outs["a1"][-1].finish_reason != "abort"  # collect saw only the outputs before the abort
    assert tokens_of(outs["a1"]) == want[1][: len(tokens_of(outs["a1"]))] and len(tokens_of(outs["a1"])) == 5
    assert tokens_of(outs["a0"]) == want[0] and tokens_of(outs["a2"]) == want[2]
    assert_pool_free(engine)


def test_arrivals_and_preemption_drain_the_pipeline(tiny_llama):
    """Requests arriving mid-decode and a pool too small for all of them: the step in flight is taken in, the
    scheduler admits and preempts as it does synchronously, and the tokens stay exact."""
    prompts = mixed_prompts(320, seed=9, lengths=(40, 36, 44, 38))
    want = hf_greedy(tiny_llama, prompts, 30)
    engine = sim_engine(tiny_llama, num_gpu_blocks_override=12)  # 192 token slots for 4 x ~70
    params = SamplingParams(max_tokens=30, **GREEDY)
    for i in range(2):
        engine.add_request(f"p{i}", prompts[i], params)

    def arrive(step: int) -> None:
        if step == 8:
            for i in (2, 3):
                engine.add_request(f"p{i}", prompts[i], params)

    outs = collect(engine, on_step=arrive)
    assert [tokens_of(outs[f"p{i}"]) for i in range(4)] == want
    assert engine.stats().num_preemptions > 0
    assert engine.pipeline.num_launched_ahead > 0
    assert_pool_free(engine)


def test_requests_that_need_host_sampling_run_synchronously(tiny_llama):
    """Logprobs, seeded sampling, penalties and min_tokens beside greedy rows: the same tokens and logprobs
    as with async scheduling off; a batch that has such a request never launches ahead."""
    prompts = mixed_prompts(320, seed=11, lengths=(5, 12, 19, 26, 8))
    plist = [
        SamplingParams(max_tokens=10, **GREEDY),
        SamplingParams(max_tokens=10, logprobs=3, **GREEDY),
        SamplingParams(max_tokens=10, temperature=0.8, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=10, repetition_penalty=1.3, **GREEDY),
        SamplingParams(max_tokens=10, min_tokens=6, temperature=0.0),
    ]

    def run(async_on: bool):
        engine = sim_engine(tiny_llama, async_on=async_on, max_num_seqs=8)
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
            engine.add_request(f"s{i}", p, sp)
        return engine, collect(engine)

    ref_engine, ref = run(False)
    engine, got = run(True)
    for i in range(5):
        assert tokens_of(got[f"s{i}"]) == tokens_of(ref[f"s{i}"])
    lps = [lp for o in got["s1"] for lp in o.new_logprobs]
    assert lps == [lp for o in ref["s1"] for lp in o.new_logprobs] and len(lps) == 10
    assert engine.pipeline.num_launched_ahead == 0
    # a greedy request with min_tokens alone: synchronous until min_tokens is reached, launched ahead after
    g = SamplingParams(max_tokens=12, min_tokens=3, temperature=0.0)
    ref_engine.add_request("g", prompts[2], g)
    engine.add_request("g", prompts[2], g)
    assert tokens_of(collect(engine)["g"]) == tokens_of(collect(ref_engine)["g"])
    assert engine.pipeline.num_launched_ahead > 0
    assert_pool_free(engine)


def test_async_engine_streams_and_cancels(tiny_llama):
    """Through AsyncEngine (the server's loop): two streams, one cancelled by its client mid-stream."""
    from pdserve.engine.async_engine import AsyncEngine

    prompts = mixed_prompts(320, seed=13, lengths=(7, 21))
    want = hf_greedy(tiny_llama, prompts, 20)
    engine = sim_engine(tiny_llama)

    async def main():
        ae = AsyncEngine(EngineConfig(), engine=engine)
        await ae.start()
        try:
            async def full():
                return [t async for o in ae.generate("x0", prompts[0], SamplingParams(max_tokens=20, **GREEDY))
                        for t in o.new_token_ids]

            async def cancelled():
                got = []
                async for o in ae.generate("x1", prompts[1], SamplingParams(max_tokens=20, **GREEDY)):
                    got.extend(o.new_token_ids)
                    if len(got) >= 4:
                        break  # the client goes away: the generator's exit aborts the request
                return got

            a, b = await asyncio.wait_for(asyncio.gather(full(), cancelled()), 120)
            for _ in range(200):  # bounded: the abort is handled on the engine thread
                if not engine.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            return a, b
        finally:
            await ae.shutdown()

    a, b = asyncio.run(main())
    assert a == want[0] and b == want[1][: len(b)] and len(b) >= 4
    assert_pool_free(engine)


@pytest.mark.parametrize("arch", ["qwen2"])
def test_async_decode_other_arch(tiny_model_factory, arch):
    model = tiny_model_factory(arch)
    prompts = mixed_prompts(320, seed=15, lengths=(4, 23, 50))
    want = hf_greedy(model, prompts, 18)
    engine = sim_engine(model)
    assert run_engine(engine, prompts, SamplingParams(max_tokens=18, **GREEDY)) == want
    assert engine.pipeline.num_launched_ahead > 0
    assert_pool_free(engine)


def test_stop_strings_end_the_stream_as_without_async():
    """A stop string (found by the caller's text processing, which aborts the request): the same text and
    tokens as with async scheduling off, nothing after the stop (the embedded smollm2-135m: a real tokenizer)."""
    from pdserve.llm import LLM

    def make(async_on: bool) -> LLM:
        llm = LLM("smollm2-135m", device="cpu", num_gpu_blocks_override=64, max_num_seqs=4,
                  async_scheduling=async_on)
        simulate_gpu_path(llm.engine)
        return llm

    prompts = ["The capital of France is", "def fibonacci(n):"]
    sync_llm = make(False)
    free = sync_llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    stops = [r.outputs[0].text[8:12] for r in free]  # from the middle of each greedy text
    params = [SamplingParams(max_tokens=24, temperature=0.0, stop=[s]) for s in stops]
    want = sync_llm.generate(prompts, params, use_tqdm=False)
    llm = make(True)
    got = llm.generate(prompts, params, use_tqdm=False)
    for g, w, s in zip(got, want, stops, strict=True):
        assert (g.outputs[0].text, g.outputs[0].token_ids) == (w.outputs[0].text, w.outputs[0].token_ids)
        assert g.outputs[0].finish_reason == "stop" and g.outputs[0].stop_reason == s and s not in g.outputs[0].text
    assert llm.engine.pipeline.num_launched_ahead > 0
    assert_pool_free(llm.engine)
