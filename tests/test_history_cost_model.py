"""The multi-turn pull-or-recompute cost model (issue 42 part 4): the roofline an instance advertises, recompute
priced at the margin, the instance's kv_recompute_threshold applied by the proxy, forced choices."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.preflight.roofline import Roofline, device_rates, device_roofline, model_costs
from pdserve.proxy.history_decision import RecomputeInfo, fleet_recompute_info, new_turn_tokens, price_history

# Llama-3.1-8B on an H200 by this project's figures: 15.0 GB of bf16 weights read a step (the embedding table's
# rows are gathered), ~14 GFLOP per prefill token
H200_8B = Roofline("NVIDIA H200", 15.0e9, 2 * 6.98e9, 3.9e12, 780e12)
KV_8B = 131072.0  # bytes per token: 32 layers x 2 x 8 heads x 128 x 2 B


def test_step_time_is_the_roofline():
    r = H200_8B
    weights_s = r.weight_bytes / r.hbm_bytes_per_s
    assert r.step_s(0) == 0.0
    assert r.step_s(1) == pytest.approx(weights_s)  # one token: reading the weights is the step
    assert r.step_s(100_000) == pytest.approx(100_000 * r.flops_per_token / r.peak_flops)
    ridge = r.ridge_tokens()
    assert 200 < ridge < 230  # an 8B step is compute-bound from ~215 tokens on
    assert r.step_s(int(ridge) - 1) == pytest.approx(weights_s)
    assert r.step_s(int(ridge) + 1000) > weights_s


def test_marginal_recompute_is_nearly_free_under_the_ridge_and_linear_past_it():
    r = H200_8B
    per_token = r.flops_per_token / r.peak_flops
    # a short turn (20 new tokens) with 100 history tokens: the step still only reads the weights
    assert r.marginal_s(100, 20) == 0.0
    # crossing the ridge: only the tokens past it cost
    assert r.marginal_s(400, 20) == pytest.approx((420 - r.ridge_tokens()) * per_token)
    # a turn already compute-bound: every history token costs its FLOPs
    assert r.marginal_s(100, 1000) == pytest.approx(100 * per_token)
    # never more than the history's FLOPs, never negative, 0 for no history
    for h, new in ((1, 1), (50, 300), (5000, 7), (3000, 3000)):
        assert 0.0 <= r.marginal_s(h, new) <= h * per_token * (1 + 1e-9)
    assert r.marginal_s(0, 100) == 0.0
    assert r.marginal_s(10, 0) == r.marginal_s(10, 1)  # the last prompt token is always computed


def test_gpu_prices_recompute_at_the_margin_and_picks_it_for_a_short_history():
    """The issue's case: ~100 history tokens on the 8B shape, the turn's ~130 new tokens. The whole-prompt
    rate (tokens / tps) charged a weight read per history token; the margin charges nothing."""
    d = price_history(600, 96, 130, KV_8B, 30e9, 0.007, 2000.0, roofline=H200_8B)
    assert (d.decision, d.reason, d.priced_by) == ("recompute", "cost_model", "roofline")
    assert d.recompute_ms < 0.5  # 226 tokens: ~10 past the ridge (at 2000 tokens/s these 96 would be 48 ms)
    assert d.pull_ms > 7.0  # the per-read overhead alone
    assert d.new_tokens == 130 and d.tokens == 96 and d.held_tokens == 600
    # a long history on the same GPU: recomputing 20k tokens costs ~360 ms, reading 2.6 GB at 30 GB/s ~94 ms
    d = price_history(20_600, 20_000, 130, KV_8B, 30e9, 0.007, 2000.0, roofline=H200_8B)
    assert d.decision == "pull"
    assert d.recompute_ms == pytest.approx(H200_8B.marginal_s(20_000, 130) * 1e3)
    assert d.pull_ms == pytest.approx((20_000 * KV_8B / 30e9 + 0.007) * 1e3)


def test_without_a_roofline_the_prefill_rate_prices_it():
    d = price_history(600, 100, 130, KV_8B, 30e9, 0.007, 2000.0, roofline=None)
    assert d.priced_by == "prefill_tps"
    assert d.recompute_ms == pytest.approx(50.0)  # 100 tokens at 2000 tokens/s
    assert d.decision == "pull"  # 50 ms against 7.4 ms


def test_the_break_even_moves_with_the_link():
    # between two GPUs of a slow link, reading a mid-size history loses to recomputing it
    slow = price_history(3000, 2000, 130, KV_8B, 1e9, 0.007, 2000.0, roofline=H200_8B)  # 1 GB/s
    fast = price_history(3000, 2000, 130, KV_8B, 100e9, 0.007, 2000.0, roofline=H200_8B)
    assert slow.decision == "recompute" and fast.decision == "pull"
    assert slow.recompute_ms == fast.recompute_ms


def test_the_instance_threshold_is_applied_first_and_forced_choices_win():
    # under the instance's kv_recompute_threshold the instance would not read: the proxy does not ask it to
    d = price_history(600, 40, 130, KV_8B, 30e9, 0.007, 2000.0, roofline=None, threshold=64)
    assert (d.decision, d.reason) == ("recompute", "threshold")
    assert d.pull_ms is not None and d.recompute_ms is not None  # still priced, for the log and header
    d = price_history(600, 64, 130, KV_8B, 30e9, 0.007, 2000.0, roofline=None, threshold=64)
    assert (d.decision, d.reason) == ("pull", "cost_model")
    for forced in ("pull", "recompute"):
        d = price_history(600, 40, 130, KV_8B, 30e9, 0.007, 2000.0, roofline=H200_8B, threshold=64, choice=forced)
        assert (d.decision, d.reason) == (forced, "forced")


def test_header_carries_the_pricing():
    d = price_history(600, 96, 130, KV_8B, 30e9, 0.007, 2000.0, roofline=H200_8B)
    h = d.header()
    assert h.startswith("decision=recompute; reason=cost_model; held_tokens=600; tokens=96; ")
    assert "new_tokens=130" in h and "priced_by=roofline" in h


def test_roofline_round_trips_through_info_and_rejects_bad_values():
    assert Roofline.from_info(H200_8B.as_info()) == H200_8B
    for bad in (None, [], {}, {**H200_8B.as_info(), "peak_flops": 0}, {**H200_8B.as_info(), "weight_bytes": "1"},
                {**H200_8B.as_info(), "hbm_bytes_per_s": math.inf}, {**H200_8B.as_info(), "flops_per_token": True}):
        assert Roofline.from_info(bad) is None
    info = RecomputeInfo.from_info({"roofline": H200_8B.as_info(), "kv_recompute_threshold": 64})
    assert info == RecomputeInfo(H200_8B, 64)
    assert RecomputeInfo.from_info({"kv_recompute_threshold": -1}) == RecomputeInfo(None, None)
    assert RecomputeInfo.from_info(None) == RecomputeInfo()


def test_fleet_takes_the_dearest_recompute_and_the_strictest_threshold():
    class Inst:
        def __init__(self, recompute):
            self.recompute = recompute

    h100 = Roofline("NVIDIA H100 80GB HBM3", 15.0e9, 2 * 6.98e9, *device_rates("NVIDIA H100 80GB HBM3"))
    fleet = fleet_recompute_info([Inst(RecomputeInfo(H200_8B, 0)), Inst(RecomputeInfo(h100, 64)), Inst(None)])
    # the same peak FLOPs: the H200 reads its weights faster, so fewer history tokens ride free in its step
    assert fleet.roofline == H200_8B and fleet.threshold == 64
    slow = Roofline("A100", 15.0e9, 2 * 6.98e9, *device_rates("NVIDIA A100-SXM4-80GB"))
    assert fleet_recompute_info([Inst(RecomputeInfo(H200_8B, 0)), Inst(RecomputeInfo(slow, None))]).roofline == slow
    assert fleet_recompute_info([Inst(None)]) == RecomputeInfo()


def test_device_table_and_dtype():
    assert device_rates("NVIDIA H200")[1] == 780e12
    assert device_rates("NVIDIA H100 NVL") is not None and device_rates("NVIDIA H100 NVL") != device_rates("NVIDIA H200")
    assert device_rates("Some Future GPU") is None
    assert device_roofline("NVIDIA H200", "bfloat16", 1e9, 1e9) is not None
    assert device_roofline("NVIDIA H200", "float32", 1e9, 1e9) is None  # the table is dense bf16/fp16
    assert device_roofline("cpu", "bfloat16", 1e9, 1e9) is None


def test_model_costs_leave_out_the_embedding_and_the_lm_head():
    emb = torch.nn.Embedding(100, 8)
    layer = torch.nn.Linear(8, 16, bias=False)
    head = torch.nn.Linear(8, 100, bias=False)
    named = [("model.embed_tokens.weight", emb.weight), ("model.layers.0.mlp.up_proj.weight", layer.weight),
             ("model.norm.weight", torch.nn.Parameter(torch.ones(8))), ("lm_head.weight", head.weight)]
    weight_bytes, flops = model_costs(named, 100, 8)
    assert weight_bytes == (128 + 8 + 800) * 4  # the embedding's rows are gathered, not the table read
    assert flops == 2 * 128
    tied = [x for x in named if x[0] != "lm_head.weight"]  # a tied table is read whole, as the LM head
    assert model_costs(tied, 100, 8) == ((800 + 128 + 8) * 4, 2 * 128)


def test_new_turn_tokens():
    body = {"messages": [{"role": "system", "content": "s" * 400}, {"role": "user", "content": "u" * 400},
                         {"role": "assistant", "content": "a" * 400}, {"role": "user", "content": "x" * 400}]}
    only_new = new_turn_tokens(body, 10_000)
    assert 100 <= only_new <= 120  # 400 chars / 4 + the message's template tokens, whatever the held count
    assert new_turn_tokens(body, 10_000, prompt_tokens=10_130) == 130  # exact when the prompt's length is known
    assert new_turn_tokens({"prompt": list(range(700))}, 600) == 100
    assert new_turn_tokens({"prompt": list(range(500))}, 600) == 1


def test_the_health_checker_reads_a_prefill_instance_s_recompute_info():
    """A real HTTP server answering /health and /pdserve/info: on admission the proxy's health checker keeps the
    prefill instance's roofline and threshold; a decode instance's are not read; a vLLM-like instance (no
    /pdserve/info) has neither."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from pdserve.proxy.health import HealthChecker
    from pdserve.proxy.pool import Instance

    async def run() -> tuple[Instance, Instance, Instance]:
        info = {"roofline": H200_8B.as_info(), "kv_recompute_threshold": 64}

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def pdserve_info(_: web.Request) -> web.Response:
            return web.json_response(info)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/pdserve/info", pdserve_info)
        bare = web.Application()
        bare.router.add_get("/health", health)
        runners = [web.AppRunner(a) for a in (app, bare)]
        urls = []
        for r in runners:
            await r.setup()
            site = web.TCPSite(r, "127.0.0.1", 0)
            await site.start()
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        try:
            async with aiohttp.ClientSession() as session:
                prefill, decode, vllm = Instance(urls[0], "prefill"), Instance(urls[0], "decode"), Instance(
                    urls[1], "prefill")
                checker = HealthChecker(session, lambda: [], interval=1.0, timeout=5.0, eject_after=3)
                for inst in (prefill, decode, vllm):
                    assert await checker.check(inst)
                return prefill, decode, vllm
        finally:
            for r in runners:
                await r.cleanup()

    prefill, decode, vllm = asyncio.run(run())
    assert prefill.recompute == RecomputeInfo(H200_8B, 64)
    assert decode.recompute is None
    assert vllm.recompute == RecomputeInfo()
    assert fleet_recompute_info([prefill, vllm]) == RecomputeInfo(H200_8B, 64)


def test_the_proxy_cli_takes_the_choice():
    import argparse

    from pdserve.proxy.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert config_from_args(parser.parse_args(base)).kv_history_choice == "cost"
    cfg = config_from_args(parser.parse_args([*base, "--kv-history-choice", "pull"]))
    assert cfg.kv_history_choice == "pull"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--kv-history-choice", "sometimes"])


def test_the_multiturn_benchmark_flags_a_slower_choice_either_way(capsys):
    """benchmarks/bench_multiturn.py's check: a recompute that measured slower than the same turn's read (from
    mode on-pull) is WRONG, as is a pull slower than its recompute; within the tolerance is not; a turn with a
    side unmeasured is unchecked, not right."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_multiturn import check_choices

    def row(conv, turn, decision, pull=None, recompute=None):
        return {"conversation": conv, "turn": turn, "decision": decision, "reason": "cost_model", "tokens": 80,
                "new_tokens": 140, "predicted_pull_ms": 7.5, "predicted_recompute_ms": 0.1,
                "measured_pull_ms": pull, "measured_recompute_ms": recompute}

    on = [row(0, 1, "recompute", recompute=0.4), row(1, 1, "recompute", recompute=9.0),
          row(0, 2, "pull", pull=12.0, recompute=3.0), row(1, 2, "pull", pull=3.5, recompute=3.0),
          row(0, 3, "recompute", recompute=0.2), {**row(1, 3, "p_cache"), "tokens": 0}]
    on_pull = [{"conversation": 0, "turn": 1, "measured_pull_ms": 3.2},
               {"conversation": 1, "turn": 1, "measured_pull_ms": 3.1}]
    rows = check_choices(on, on_pull, tolerance_ms=1.0)
    assert [r["right"] for r in rows] == [True, False, False, True, None, None]
    out = capsys.readouterr().out
    assert out.count("  WRONG") == 2  # the two rows (the summary line says "2 WRONG")
    assert "2 WRONG, 1 unchecked, 1 with nothing to choose" in out
