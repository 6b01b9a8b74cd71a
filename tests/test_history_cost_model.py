"""The multi-turn pull-or-recompute cost model (issue 42 part 4): the prefill cost an instance measures and
advertises, recompute priced at the margin, the break-even a pull carries (`min_read_tokens`: the proxy's cost
model is the one decider), forced choices."""

from __future__ import annotations

import math

import pytest

from pdserve.api import pd
from pdserve.proxy.history_decision import (
    HistoryPricing,
    RecomputeInfo,
    fleet_prefill_costs,
    new_turn_tokens,
    price_history,
)
from pdserve.types.prefill_cost import PrefillCost, dearest_marginal_s

# The 8B shape's prefill on an H100, put together from issue 42's measurements there: an eager step costs ~15 ms
# whatever its length up to a few hundred tokens (the host launching 32 layers' kernels; BENCHMARKS.md's eager
# decode step 14.8-21 ms), then ~26.5 us a token (an 8192-token prefill in 217 ms)
H100_8B = PrefillCost("NVIDIA H100 80GB HBM3", floor_s=0.015, fixed_s=-0.0047, per_token_s=26.5e-6)
KV_8B = 131072.0  # bytes per token: 32 layers x 2 x 8 heads x 128 x 2 B
CUDA_IPC = 100e9  # the proxy's `cuda-ipc` preset


def pricing(new: int, costs=(H100_8B,), bandwidth=CUDA_IPC, overhead_s=0.007, tps=2000.0) -> HistoryPricing:
    return HistoryPricing(new, KV_8B, bandwidth, overhead_s, tps, tuple(costs))


def test_step_time_has_a_floor_then_a_per_token_line():
    c = H100_8B
    assert c.step_s(0) == 0.0
    assert c.step_s(1) == c.step_s(200) == c.floor_s  # short steps cost the floor
    ridge = c.ridge_tokens()
    assert 700 < ridge < 800
    assert c.step_s(int(ridge) - 1) == c.floor_s
    assert c.step_s(8192) == pytest.approx(-0.0047 + 8192 * 26.5e-6)


def test_marginal_recompute_is_free_under_the_ridge_and_linear_past_it():
    c = H100_8B
    # the H100 run's turns: 139 new tokens; 64 history tokens ride free, 640 cross the ridge by ~30 tokens
    assert c.marginal_s(64, 139) == 0.0
    assert c.marginal_s(640, 139) == pytest.approx((779 - c.ridge_tokens()) * c.per_token_s)
    assert c.marginal_s(640, 139) < 0.001
    # a turn already past the ridge: every history token costs per_token_s
    assert c.marginal_s(100, 1000) == pytest.approx(100 * c.per_token_s)
    for h, new in ((1, 1), (50, 300), (5000, 7), (3000, 3000)):
        assert 0.0 <= c.marginal_s(h, new) <= h * c.per_token_s * (1 + 1e-9)
    assert c.marginal_s(0, 100) == 0.0
    assert c.marginal_s(10, 0) == c.marginal_s(10, 1)  # the last prompt token is always computed


def test_fit_through_measured_steps():
    pts = [(32, 0.0150), (256, 0.0152), (1024, 0.0224), (2048, 0.0495)]
    c = PrefillCost.fit("gpu", pts)
    assert c.floor_s == 0.0150
    assert c.per_token_s == pytest.approx((0.0495 - 0.0224) / 1024)
    assert c.step_s(2048) == pytest.approx(0.0495) and c.step_s(1024) == pytest.approx(0.0224)
    assert c.step_s(256) == c.floor_s  # the line is under the floor there
    assert c.points == tuple(pts)
    # a small model whose every measured step sat on the floor: free within what was measured, not beyond
    flat = PrefillCost.fit("gpu", [(32, 0.008), (1024, 0.0081), (2048, 0.0079)])
    assert flat.step_s(2048) == pytest.approx(0.008) and flat.marginal_s(1000, 32) == 0.0
    assert flat.step_s(4096) == pytest.approx(0.016)
    # too few lengths, a repeated length, a non-positive time: no model
    assert PrefillCost.fit("gpu", [(32, 0.01), (2048, 0.05)]) is None
    assert PrefillCost.fit("gpu", [(32, 0.01), (32, 0.01), (2048, 0.05)]) is None
    assert PrefillCost.fit("gpu", [(32, 0.01), (1024, 0.0), (2048, 0.05)]) is None


def test_the_h100_run_s_turns_are_priced_as_measured():
    """BENCHMARKS.md, "The multi-turn choice on the GPU": 640 held tokens, 139 new, read over CUDA IPC. The first
    (roofline) model predicted recompute ~10 ms and read them (pull 7.8 ms), measured 3.6-5.7 ms against a
    recompute of 0.7-5 ms; priced from the measured step it is recomputed, and a 64-token history too."""
    for tokens in (64, 640):
        d = price_history(tokens + 700, tokens, pricing(139))
        assert (d.decision, d.reason, d.priced_by) == ("recompute", "cost_model", "measured")
        assert d.recompute_ms < 1.0 and d.min_read_tokens is None
    assert price_history(1280, 640, pricing(139)).pull_ms == pytest.approx(7.84, abs=0.01)
    # a long history on the same GPU: recomputing 20k tokens ~510 ms, reading 2.6 GB over CUDA IPC ~33 ms
    d = price_history(20_600, 20_000, pricing(139))
    assert d.decision == "pull"
    assert d.recompute_ms == pytest.approx(H100_8B.marginal_s(20_000, 139) * 1e3)
    assert d.pull_ms == pytest.approx((20_000 * KV_8B / CUDA_IPC + 0.007) * 1e3)


def test_the_break_even_is_the_decision_s_edge():
    """A pull carries `min_read_tokens`: the fewest tokens whose read is predicted faster. The decision is pull
    exactly from there on, so the instance applying it to what it has left to read decides as the proxy did."""
    for p in (pricing(139), pricing(1000), pricing(139, overhead_s=0.0), pricing(139, costs=()),
              pricing(139, bandwidth=10e9), pricing(139, costs=(H100_8B, PrefillCost("b", 0.03, -0.01, 40e-6)))):
        edge = p.break_even(50_000)
        assert edge is not None and 1 <= edge <= 50_000
        for tokens in sorted({1, edge - 1, edge, edge + 1, edge + 16, 2 * edge, 50_000} - {0}):
            d = price_history(tokens + 100, tokens, p)
            assert (d.decision == "pull") == (tokens >= edge), (p, tokens, edge)
            assert d.min_read_tokens == (edge if tokens >= edge else None)
    # at the prefill rate the edge is where the overhead is paid back: 7 ms / (0.5 ms - 1.31 us) per token
    assert pricing(139, costs=()).break_even(1000) == math.floor(0.007 / (1 / 2000 - KV_8B / CUDA_IPC)) + 1
    # a turn of 1000 new tokens is past the ridge: 26.5 us a recomputed token pays back 7 ms of overhead after
    # 7 / (26.5e-3 - 1.31e-3) = 278 tokens; a turn of 139 first fills the floor (604 tokens free), then 310 more
    assert pricing(1000).break_even(50_000) == 278
    assert pricing(139).break_even(50_000) == 914
    # a link slower per token than recomputing: never worth a read
    assert pricing(139, bandwidth=1e9).break_even(50_000) is None


def test_without_a_measured_cost_the_prefill_rate_prices_it():
    d = price_history(600, 100, pricing(130, costs=()))
    assert d.priced_by == "prefill_tps"
    assert d.recompute_ms == pytest.approx(50.0)  # 100 tokens at 2000 tokens/s
    assert d.decision == "pull"  # 50 ms against 7.1 ms
    assert d.min_read_tokens == 15


def test_the_break_even_moves_with_the_link():
    slow = price_history(3000, 2000, pricing(130, bandwidth=1e9))
    fast = price_history(3000, 2000, pricing(130))
    assert slow.decision == "recompute" and fast.decision == "pull"
    assert slow.recompute_ms == fast.recompute_ms


def test_forced_choices_win_and_a_forced_pull_reads_whatever_is_left():
    d = price_history(600, 40, pricing(130), choice="pull")
    assert (d.decision, d.reason, d.min_read_tokens) == ("pull", "forced", 0)
    d = price_history(20_600, 20_000, pricing(130), choice="recompute")
    assert (d.decision, d.reason, d.min_read_tokens) == ("recompute", "forced", None)
    assert d.pull_ms is not None and d.recompute_ms is not None  # still priced, for the log and header


def test_header_carries_the_pricing():
    d = price_history(600, 96, pricing(130))
    h = d.header()
    assert h.startswith("decision=recompute; reason=cost_model; held_tokens=600; tokens=96; ")
    assert "new_tokens=130" in h and "priced_by=measured" in h and "min_read_tokens" not in h
    h = price_history(20_600, 20_000, pricing(130)).header()
    assert "min_read_tokens=" in h


def test_prefill_cost_round_trips_through_info_and_rejects_bad_values():
    c = PrefillCost.fit("NVIDIA H100 80GB HBM3", [(32, 0.015), (256, 0.0151), (1024, 0.0224), (2048, 0.0495)])
    assert PrefillCost.from_info(c.as_info()) == c
    good = H100_8B.as_info()
    assert PrefillCost.from_info(good) == H100_8B
    for bad in (None, [], {}, {**good, "floor_s": 0}, {**good, "per_token_s": -1e-6}, {**good, "fixed_s": "1"},
                {**good, "floor_s": math.inf}, {**good, "per_token_s": True}, {**good, "fixed_s": math.nan}):
        assert PrefillCost.from_info(bad) is None
    assert PrefillCost.from_info({**good, "points": [[32, "x"]]}).points == ()  # the record only
    assert RecomputeInfo.from_info({"prefill_cost": good, "kv_recompute_threshold": 64}) == RecomputeInfo(H100_8B)
    assert RecomputeInfo.from_info({"kv_recompute_threshold": 64}) == RecomputeInfo(None)
    assert RecomputeInfo.from_info(None) == RecomputeInfo()


def test_the_fleet_prices_by_its_dearest_instance():
    class Inst:
        def __init__(self, recompute):
            self.recompute = recompute

    slow = PrefillCost("slow", floor_s=0.010, fixed_s=0.0, per_token_s=50e-6)
    fleet = fleet_prefill_costs([Inst(RecomputeInfo(H100_8B)), Inst(RecomputeInfo(slow)), Inst(None),
                                 Inst(RecomputeInfo())])
    assert fleet == (H100_8B, slow)
    # under the H100's ridge its margin is 0, the slow instance's (ridge 200) is not
    assert slow.marginal_s(300, 100) > 0 == H100_8B.marginal_s(300, 100)
    assert dearest_marginal_s(fleet, 300, 100) == slow.marginal_s(300, 100)
    assert dearest_marginal_s((), 300, 100) == 0.0
    assert fleet_prefill_costs([Inst(None)]) == ()


def test_min_read_tokens_travel_on_a_held_prefix_s_params():
    held = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "e", "remote_request_id": "r",
            "remote_host": "127.0.0.1", "remote_port": 5, "remote_block_ids": [[1, 2]], "remote_num_tokens": 32,
            pd.LEASE_TOKEN: "t", pd.BLOCK_HASHES: ["00", "01"], pd.BLOCK_BYTES: 64}
    assert pd.parse_remote_prefix_params(held).min_read_tokens is None  # not priced: the instance's threshold
    priced = pd.with_min_read_tokens(held, 17)
    assert pd.parse_remote_prefix_params(priced).min_read_tokens == 17
    assert pd.with_min_read_tokens(held, None) == held
    for bad in (-1, 1.5, "17", True):
        with pytest.raises(pd.InvalidKVTransferParams, match="min_read_tokens"):
            pd.parse_remote_prefix_params({**held, pd.MIN_READ_TOKENS: bad})


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
    prefill instance's measured prefill cost; a decode instance's is not read; a vLLM-like instance (no
    /pdserve/info) has none."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from pdserve.proxy.health import HealthChecker
    from pdserve.proxy.pool import Instance

    async def run() -> tuple[Instance, Instance, Instance]:
        info = {"prefill_cost": H100_8B.as_info(), "kv_recompute_threshold": 64}

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
    assert prefill.recompute == RecomputeInfo(H100_8B)
    assert decode.recompute is None
    assert vllm.recompute == RecomputeInfo()
    assert fleet_prefill_costs([prefill, vllm]) == (H100_8B,)


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
