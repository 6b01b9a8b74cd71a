"""pdserve sim's routing features, each through the proxy's own code (plan.decide, PairChooser, the fleet index,
the history decision) and the engine's (Holds, Admission, the scheduler's loads): exact event orders of small
deterministic simulations, worked out by hand in the comments (toy profile: 1 s a step + 0.1 s a token, blocks of
4 tokens, 100 bytes of KV a token); and step skipping still equal to step-by-step with each feature on."""

from __future__ import annotations

import copy
import random

import pytest

from pdserve.launch.config import parse_topology
from pdserve.proxy.config import ProxyConfig
from pdserve.sim.instance import OUTPUT_TOKEN
from pdserve.sim.options import SimOptions
from pdserve.sim.profile import EngineSettings, Handoff, Profile
from pdserve.sim.run import Pools, simulate, simulate_conversations
from pdserve.sim.workload import Conversation, Job


def toy(kv_tokens: int = 64, budget: int = 8, **handoff) -> Profile:
    return Profile(name="toy", model="toy", device="cpu", kv_capacity_tokens=kv_tokens, kv_bytes_per_token=100,
                   engine=EngineSettings(block_size=4, max_num_seqs=8, max_num_batched_tokens=budget),
                   step_model={"fixed": 1.0, "tokens": 0.1, "prefill_attention": 0.0, "decode_rows": 0.0,
                               "decode_context": 0.0},
                   handoff=Handoff(**handoff))


def times(t) -> list[float]:
    return [round(x, 6) for x in t.token_times]


def push(pipeline: str, min_tokens: int = 0) -> SimOptions:
    return SimOptions(kv_transfer_mode="push", push_pipeline=pipeline, push_layerwise_min_tokens=min_tokens)


def _pool_back(run) -> None:
    for inst in run.deployment.instances.values():
        assert inst.blocks.num_free_blocks == inst.blocks.num_blocks and not inst.held, inst.name


# ---- push -----------------------------------------------------------------------------------------------------
def test_push_whole_request_event_order():
    # both legs at 0. P computes 6 tokens (1.6 s). D allocates at 0 and registers: at P at 0.5 (claim_s). Whole
    # request: one WRITE of 6 x 100 B when the prefill ends (1.6) at 600 B/s: lands at 2.6, the push completes, D
    # adopts the first token at its next step (2.6) and decodes: 1.1 s a step. (Pull, the same profile: 2.35, 4.45,
    # 5.55: test_sim.py's test_pd_event_order_is_exact.)
    run = simulate(parse_topology("1p1d"), Pools.of(toy(params_s=0.25, claim_s=0.5, link_bytes_per_s=600.0)),
                   [Job(0, 0.0, 6, 3, token_ids=[1, 2, 3, 4, 5, 6])], options=push("request"))
    assert times(run.tracked[0]) == [2.6, 3.7, 4.8]
    _pool_back(run)


@pytest.mark.parametrize(("pipeline", "claim_s", "rate", "expected"), [
    # layer by layer: chunk 1 (8 tokens) runs 0-1.8, chunk 2 (4) 1.8-3.2. Registered at 0.5: chunk 1's 800 B go at
    # once (land 1.3 at 1000 B/s), chunk 2's 400 B at 1.8 (land 2.2); the push completes with the prefill (3.2)
    ("layer", 0.5, 1000.0, [3.2, 4.3, 5.4]),
    # whole request: 1200 B from 3.2, land 4.4
    ("request", 0.5, 1000.0, [4.4, 5.5, 6.6]),
    # layer, registered late (2.0, chunk 2 under way): everything computed so far (12 tokens) goes at once, lands
    # 3.2, with the prefill's end (the step end comes first at one instant: then the WRITE lands, complete)
    ("layer", 2.0, 1000.0, [3.2, 4.3, 5.4]),
    # layer on a slow link (300 B/s): chunk 1's 800 B from 0.5 moved 390 by 1.8; chunk 2's 400 B then share the
    # link (150 B/s each): chunk 2 lands at 1.8 + 400/150 = 4.4667, chunk 1's last 10 B at 300 B/s: 4.5
    ("layer", 0.5, 300.0, [4.5, 5.6, 6.7]),
])
def test_push_layer_by_layer_event_orders(pipeline, claim_s, rate, expected):
    run = simulate(parse_topology("1p1d"), Pools.of(toy(params_s=0.25, claim_s=claim_s, link_bytes_per_s=rate)),
                   [Job(0, 0.0, 12, 3, token_ids=list(range(1, 13)))], options=push(pipeline))
    assert times(run.tracked[0]) == expected
    _pool_back(run)


def test_push_layerwise_min_tokens_and_auto_by_device():
    # a 12-token prompt under push_layerwise_min_tokens (512, the default) is pushed whole, as on a GPU pool
    # ("auto" on a cuda profile): both give the whole-request order
    prof = toy(params_s=0.25, claim_s=0.5, link_bytes_per_s=1000.0)
    job = [Job(0, 0.0, 12, 3, token_ids=list(range(1, 13)))]
    whole = [4.4, 5.5, 6.6]
    assert times(simulate(parse_topology("1p1d"), Pools.of(prof), copy.deepcopy(job),
                          options=SimOptions(kv_transfer_mode="push", push_pipeline="layer")).tracked[0]) == whole
    gpu = copy.deepcopy(prof)
    gpu.device = "cuda:0"
    assert times(simulate(parse_topology("1p1d"), Pools.of(gpu), copy.deepcopy(job),
                          options=push("auto")).tracked[0]) == whole
    assert times(simulate(parse_topology("1p1d"), Pools.of(prof), copy.deepcopy(job),
                          options=push("auto")).tracked[0]) == [3.2, 4.3, 5.4]  # CPU pool: layer by layer


# ---- multi-turn history ---------------------------------------------------------------------------------------
def _conversation() -> list[Conversation]:
    # system 16 tokens, two user messages of 8, answers of 40 (the instance's own token, which turn 2 repeats)
    return [Conversation(0, list(range(1, 17)), [list(range(20, 28)), list(range(30, 38))], 40, OUTPUT_TOKEN)]


def _history_run(history: bool, **opts):
    prof = toy(kv_tokens=256, budget=64, params_s=0.25, claim_s=0.5, link_bytes_per_s=1000.0)
    proxy = ProxyConfig(kv_history_choice=opts.pop("choice", "cost"))
    return simulate_conversations(parse_topology("1p1d"), Pools.of(prof), _conversation(), 1.0, None,
                                  options=SimOptions(kv_history=history, kv_recompute_threshold=0, proxy=proxy,
                                                     **opts))


def test_history_pull_event_order():
    """Turn 1 (24 tokens): P 0-3.4; params at 3.65; D's claim at 4.15 (first token); its READ of 2400 B ends at
    6.55; 39 decode steps to 49.45. D keeps the conversation: 24 + 39 computed tokens, 15 full blocks (60 tokens).
    Turn 2 (72 tokens) at 50.45: the proxy finds the held history (60 tokens; the prefill caches turn 1's prompt, 24)
    and prices 36 tokens: pull. P's Admission matches all 15 held blocks; its scheduler takes its own 24 cached
    tokens and reads 36: claimed at 50.95, 3600 B until 54.55 (the holder's lease ends with it); then 12 tokens
    (2.2 s) to 56.75; params at 57.0; D's own cache holds the 60 tokens: it reads 12, first token at the claim
    (57.5), READ until 58.7, first decode step to 59.8."""
    run = _history_run(True)
    t1, t2 = run.tracked
    assert (t1.history, t2.history) == ("none", "pull")
    assert times(t1)[:2] == [4.15, 7.65] and times(t1)[-1] == 49.45
    assert t2.job.arrival == pytest.approx(50.45) and t2.job.prompt_len == 72
    assert t2.cached_tokens == 24 + 36  # the prefill's own cache and the read
    assert times(t2)[:2] == [57.5, 59.8]
    dep = run.deployment
    assert dep.instances["prefill-0"].connector.prefix_pulls == {}  # nothing declined
    dec = dep.instances["decode-0"]
    # turn 2's conversation was held too, until its lease ended (480 s later: the run drains every event)
    assert not dec.holds.history and not dec.connector.producer.history and dep.now == pytest.approx(t2.finish_time
                                                                                                    + 480.0)
    _pool_back(run)
    # without --kv-history the prefill recomputes the 48 tokens it lacks (5.8 s): params at 56.5, claim 57.0
    plain = _history_run(False)
    assert plain.tracked[1].cached_tokens == 24 and times(plain.tracked[1])[:2] == [57.0, 59.3]


def test_history_recompute_decision_and_expired_lease():
    # forced recompute: the same turn as without history (the prefill computes the 48 tokens)
    rec = _history_run(True, choice="recompute")
    assert rec.tracked[1].history == "recompute" and times(rec.tracked[1])[:2] == [57.0, 59.3]
    # a lease shorter than the think time: the holder frees the blocks at its end, the proxy's map drops it
    short = _history_run(True, decoder_kv_blocks_ttl=0.5)
    assert short.tracked[1].history == "none" and times(short.tracked[1])[:2] == [57.0, 59.3]
    _pool_back(short)


# ---- routing by cached prefix -----------------------------------------------------------------------------------
@pytest.mark.parametrize("topology", ["collocated:2", "2p1d"])
def test_routing_by_cached_prefix_sends_the_prefix_to_its_holder(topology):
    """Two prompts sharing 24 tokens, 20 s apart. With KV events the proxy's index knows who computed the first,
    and the second goes there (6 blocks cached); by load only, the rotation sends it to the other instance."""
    shared = list(range(100, 124))
    jobs = [Job(0, 0.0, 28, 2, token_ids=shared + [1, 2, 3, 4]), Job(1, 20.0, 28, 2, token_ids=shared + [5, 6, 7, 8])]
    prof = toy(kv_tokens=256, budget=64, params_s=0.25, claim_s=0.5, link_bytes_per_s=1000.0)
    routed = simulate(parse_topology(topology), Pools.of(prof), copy.deepcopy(jobs), options=SimOptions(kv_events=True))
    by_load = simulate(parse_topology(topology), Pools.of(prof), copy.deepcopy(jobs),
                       options=SimOptions(kv_events=False))
    assert [t.cached_tokens for t in routed.tracked] == [0, 24]
    assert [t.cached_tokens for t in by_load.tracked] == [0, 0]
    # the second prompt computes 4 tokens instead of 28: 1.4 s instead of 3.8 s
    first = 20.0 + 1.4 if topology.startswith("collocated") else 20.0 + 1.4 + 0.25 + 0.5
    assert times(routed.tracked[1])[0] == pytest.approx(first)
    metrics = routed.deployment.proxy.state.metrics
    assert metrics.kv_outcomes["hit"]._value.get() == 1  # the proxy's own routing outcome for the second


# ---- step skipping with each feature on -------------------------------------------------------------------------
@pytest.mark.parametrize("feature", ["push", "events", "history"])
def test_step_skipping_equals_step_by_step_with_features(feature):
    from tests.test_sim import _sim_state

    decisions: set[str | None] = set()
    for seed in range(12):
        rng = random.Random(seed)
        topo = parse_topology(rng.choice(["1p1d", "2p1d", "1p2d"] + ([] if feature != "events" else ["collocated:2"])))
        prof = Profile(name="t", model="t", device="cpu", kv_capacity_tokens=rng.choice([128, 400]),
                       kv_bytes_per_token=100,
                       engine=EngineSettings(block_size=rng.choice([2, 4]), max_num_seqs=rng.choice([2, 4, 8]),
                                             max_num_batched_tokens=rng.choice([16, 64])),
                       step_model={"fixed": 0.013, "tokens": 0.0011, "prefill_attention": 1e-6,
                                   "decode_rows": 0.0007, "decode_context": 3e-5},
                       handoff=Handoff(params_s=rng.choice([0.0, 0.02]), claim_s=rng.choice([0.0, 0.01]),
                                       link_bytes_per_s=rng.choice([1e4, 1e6])))
        opts = {"push": push(rng.choice(["layer", "request"])), "events": SimOptions(kv_events=True),
                "history": SimOptions(kv_history=True, kv_recompute_threshold=rng.choice([0, 8]))}[feature]
        if feature == "history":
            convs = [Conversation(i, [rng.randrange(1, 50) for _ in range(rng.randrange(8, 24))],
                                  [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 20))] for _ in range(3)],
                                  rng.randrange(2, 30), OUTPUT_TOKEN) for i in range(rng.randrange(2, 5))]
            runs = [simulate_conversations(topo, Pools.of(prof), copy.deepcopy(convs), 0.05, None, skip_steps=skip,
                                           options=opts) for skip in (False, True)]
            decisions.update(t.history for t in runs[0].tracked)
        else:
            shared = [rng.randrange(1, 50) for _ in range(24)]
            jobs, t = [], 0.0
            for i in range(rng.randrange(3, 16)):
                t += rng.choice([0.0, rng.expovariate(5.0)])
                ids = (shared[: rng.randrange(0, 24)] + [rng.randrange(1, 50) for _ in range(rng.randrange(2, 40))])
                jobs.append(Job(i, t, len(ids[:40]), rng.randrange(1, 60), token_ids=ids[:40]))
            runs = [simulate(topo, Pools.of(prof), copy.deepcopy(jobs), skip_steps=skip, options=opts)
                    for skip in (False, True)]
        assert _sim_state(runs[1]) == _sim_state(runs[0]), (feature, seed)
        assert all(t.done and not t.error for t in runs[0].tracked), (feature, seed)
    if feature == "history":
        assert {"pull", "none"} <= decisions, decisions  # held conversations were read back


def test_cli_features(tmp_path, capsys):
    """`pdserve sim` with `pdserve up`'s feature flags: push, and multi-turn with --kv-history (later turns read
    their history back: fewer computed tokens than without)."""
    from pathlib import Path

    import pdserve
    from pdserve.cli import main

    profile = str(Path(pdserve.__file__).parent / "data" / "profiles" / "h200-llama3.1-8b-fp8.json")
    assert main(["sim", "--profile", profile, "--topology", "2p1d", "--dataset-name", "prefix", "--prefix-len", "512",
                 "--suffix-len", "64", "--num-prefixes", "2", "--random-output-len", "8", "--num-prompts", "12",
                 "--request-rate", "4", "--kv-transfer-mode", "push", "--kv-events"]) == 0
    assert "Successful requests:                     12" in capsys.readouterr().out
    computed = {}
    for flag in ([], ["--kv-history"]):
        assert main(["sim", "--profile", profile, "--topology", "1p1d", "--dataset-name", "multiturn",
                     "--num-prompts", "2", "--multiturn-turns", "3", "--multiturn-system-len", "1000",
                     "--multiturn-user-len", "100", "--multiturn-answer-len", "200", "--save-result", "--result-dir",
                     str(tmp_path), "--result-filename", f"mt{len(flag)}.json", *flag]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("2 ")]
        computed[bool(flag)] = float(rows[0][-2])  # turn 2's mean computed prompt tokens
    assert computed[True] < computed[False]


def test_profile_reads_the_servers_scheduler_settings():
    """`pdserve profile --url` and sim_validate simulate an instance with the scheduler settings its /pdserve/info
    says; a server that says none gets pdserve's defaults for its device."""
    from pdserve.sim.profiler import http_settings

    info = {"block_size": 16, "device": "cuda:0", "scheduler": {
        "max_num_seqs": 64, "max_num_batched_tokens": 4096, "prefill_only_chunk_tokens": 0,
        "enable_chunked_prefill": True, "enable_prefix_caching": False}}
    s, read = http_settings(info)
    assert read and (s.block_size, s.max_num_seqs, s.max_num_batched_tokens, s.prefill_only_chunk_tokens,
                     s.enable_prefix_caching) == (16, 64, 4096, 0, False)
    s, read = http_settings({"block_size": 16, "device": "cuda:0"})
    assert not read and s.max_num_batched_tokens == 8192 and s.prefill_only_chunk_tokens > 0
    s, read = http_settings({"block_size": 128, "device": "cpu"})
    assert not read and (s.max_num_batched_tokens, s.prefill_only_chunk_tokens) == (2048, 0)
