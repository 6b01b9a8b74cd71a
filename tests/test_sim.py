"""pdserve sim: exact event orders of small deterministic simulations, and the simulated instance's scheduler
decisions equal to the real engine's for the same request sequence (the same Scheduler code)."""

from __future__ import annotations

import json

import pytest

from pdserve.launch.config import parse_topology
from pdserve.sim.profile import EngineSettings, Handoff, Profile, fit_step_model, prefill_steps, step_features
from pdserve.sim.run import Pools, simulate
from pdserve.sim.workload import Job, load_trace


def toy_profile(**handoff) -> Profile:
    """One second per step plus 0.1 s per token: times are easy to follow by hand."""
    return Profile(name="toy", model="toy", device="cpu", kv_capacity_tokens=64, kv_bytes_per_token=100,
                   engine=EngineSettings(block_size=4, max_num_seqs=8, max_num_batched_tokens=8),
                   step_model={"fixed": 1.0, "tokens": 0.1, "prefill_attention": 0.0, "decode_rows": 0.0,
                               "decode_context": 0.0},
                   handoff=Handoff(**handoff))


def times(run, index: int) -> list[float]:
    return [round(t, 6) for t in run.tracked[index].token_times]


def test_collocated_event_order_is_exact():
    # A (6 in, 3 out) at 0, B (4 in, 2 out) at 0.5: A's prefill alone (6 tokens, 1.6 s); then A's decode beside
    # B's whole prompt (5 tokens, 1.5 s); then both decode (2 tokens, 1.2 s)
    jobs = [Job(0, 0.0, 6, 3, token_ids=[1, 2, 3, 4, 5, 6]), Job(1, 0.5, 4, 2, token_ids=[9, 8, 7, 6])]
    p = toy_profile()
    run = simulate(parse_topology("collocated:1"), Pools.of(p), jobs)
    assert times(run, 0) == [1.6, 3.1, 4.3]
    assert times(run, 1) == [3.1, 4.3]
    inst = run.deployment.instances["collocated-0"]
    assert inst.blocks.num_free_blocks == inst.blocks.num_blocks  # every block back
    assert inst.steps == 3


def test_pd_event_order_is_exact():
    # P: prefill 6 tokens (1.6 s); params at +0.25 -> D allocates and starts the load; the lease is claimed 0.5 s
    # later (2.35): the adopted first token goes out; the READ (6 tokens x 100 B at 600 B/s) ends at 3.35; then
    # D decodes: 1.1 s a step
    jobs = [Job(0, 0.0, 6, 3, token_ids=[1, 2, 3, 4, 5, 6])]
    p = toy_profile(params_s=0.25, claim_s=0.5, link_bytes_per_s=600.0)
    run = simulate(parse_topology("1p1d"), Pools.of(p), jobs)
    assert times(run, 0) == [2.35, 4.45, 5.55]
    pre, dec = run.deployment.instances["prefill-0"], run.deployment.instances["decode-0"]
    assert pre.blocks.num_free_blocks == pre.blocks.num_blocks and not pre.held  # freed when the READ ended
    assert dec.blocks.num_free_blocks == dec.blocks.num_blocks


def test_link_contention_shares_the_rate():
    # two prompts finish their prefills on two prefill instances at once and both READ into one decode
    # instance: each moves at half its link's rate, so both READs take 2 s instead of 1
    jobs = [Job(0, 0.0, 6, 2, token_ids=[1, 2, 3, 4, 5, 6]), Job(1, 0.0, 6, 2, token_ids=[7, 8, 9, 10, 11, 12])]
    p = toy_profile(params_s=0.0, claim_s=0.0, link_bytes_per_s=600.0)
    run = simulate(parse_topology("2p1d"), Pools.of(p), jobs)
    # both tokens out at the claim (1.6); both READs end at 3.6; then one decode step of both (1.2 s)
    assert times(run, 0) == [1.6, 4.8] and times(run, 1) == [1.6, 4.8]


def test_budget_chunks_and_prefix_hits():
    shared = list(range(1, 9))
    jobs = [Job(0, 0.0, 9, 1, token_ids=shared + [50]), Job(1, 10.0, 9, 1, token_ids=shared + [60])]
    run = simulate(parse_topology("collocated:1"), Pools.of(toy_profile()), jobs)
    # A: 9 tokens under a budget of 8: a chunk of 8 (1.8 s), then 1 (1.1 s)
    assert times(run, 0) == [2.9]
    # B at 10: its first 8 tokens (2 blocks) are cached: one step of 1 token (1.1 s)
    assert times(run, 1) == [11.1]


def _sim_state(run) -> list:
    """Everything a run leaves: each client's token times and outcome, and each instance's step count, busy time,
    pool (free queue order, ref counts, cached identities), preemptions and prefix-cache hits."""
    out: list = [[(t.token_times, t.cached_tokens, t.error, t.done, t.finish_time) for t in run.tracked]]
    for name, inst in run.deployment.instances.items():
        b = inst.blocks
        out.append((name, inst.steps, inst.busy_s, list(b.free), b.ref_cnt, b.block_hash, dict(b.cached),
                    inst.scheduler.num_preemptions, b.prefix_hits))
    return out


def test_step_skipping_equals_step_by_step():
    """Skipped decode stretches (instance.py's DecodeRun) leave exactly what every step run as its own event
    leaves, at the end and when stopped half-way: 40 seeded workloads over collocated and P/D topologies, pools small enough to preempt, shared
    prefixes, arrivals at one instant and zero-cost handoffs (coincident events), block sizes 2 to 8."""
    import copy
    import random

    from pdserve.sim import cluster

    cut_short = 0
    real_sync = cluster.Deployment._sync

    def counting_sync(self, inst, now):
        nonlocal cut_short
        cut_short += inst.run is not None
        real_sync(self, inst, now)

    skipped = preempted = 0
    cluster.Deployment._sync = counting_sync
    try:
        for seed in range(40):
            rng = random.Random(seed)
            topo = parse_topology(rng.choice(["collocated:1", "collocated:2", "1p1d", "2p1d", "1p2d"]))
            prof = Profile(name="t", model="t", device="cpu", kv_capacity_tokens=rng.choice([64, 128, 400]),
                           kv_bytes_per_token=100,
                           engine=EngineSettings(block_size=rng.choice([2, 4, 8]), max_num_seqs=rng.choice([2, 4, 8]),
                                                 max_num_batched_tokens=rng.choice([8, 16, 64])),
                           step_model={"fixed": 0.013, "tokens": 0.0011, "prefill_attention": 1e-6,
                                       "decode_rows": 0.0007, "decode_context": 3e-5},
                           handoff=Handoff(params_s=rng.choice([0.0, 0.02]), claim_s=rng.choice([0.0, 0.01]),
                                           link_bytes_per_s=rng.choice([1e4, 1e6])))
            shared = [rng.randrange(1, 50) for _ in range(24)]
            jobs, t = [], 0.0
            for i in range(rng.randrange(3, 25)):
                t += rng.choice([0.0, rng.expovariate(5.0)])
                ids = (shared[: rng.randrange(0, 24)] + [rng.randrange(1, 50) for _ in range(rng.randrange(2, 40))])
                jobs.append(Job(i, t, len(ids[:40]), rng.randrange(1, 60), token_ids=ids[:40]))
            each = simulate(topo, Pools.of(prof), copy.deepcopy(jobs), skip_steps=False)
            skipping = simulate(topo, Pools.of(prof), copy.deepcopy(jobs), skip_steps=True)
            assert _sim_state(skipping) == _sim_state(each), f"seed {seed}"
            # stopped mid-way (`until`): the skipped steps that ended by then are applied, as the events would be
            half = each.sim_s / 2
            assert _sim_state(simulate(topo, Pools.of(prof), copy.deepcopy(jobs), until=half)) == _sim_state(
                simulate(topo, Pools.of(prof), copy.deepcopy(jobs), until=half, skip_steps=False)), f"seed {seed}"
            skipped += each.deployment.events - skipping.deployment.events
            preempted += sum(i.scheduler.num_preemptions for i in each.deployment.instances.values())
    finally:
        cluster.Deployment._sync = real_sync
    assert skipped > 2000 and preempted > 0 and cut_short > 50  # the cases the equality is about did occur


def test_fit_recovers_a_known_model():
    truth = {"fixed": 0.004, "tokens": 2e-5, "prefill_attention": 1e-9, "decode_rows": 1e-5, "decode_context": 3e-8}

    def t(steps):
        return sum(Profile(name="t", model="t", device="x", step_model=truth).step_seconds(s) for s in steps)

    samples = [(prefill_steps(n, c, 8192), t(prefill_steps(n, c, 8192)))
               for n in (1024, 8192, 32768) for c in (0, 4096)]
    for b, ctx in ((1, 128), (16, 16 * 2048), (64, 64 * 4096)):
        f = step_features([(1, ctx // b - 1)] * b)
        samples.append(([f], t([f])))
    coef, res = fit_step_model(samples)
    assert res["max_rel_error"] < 1e-6
    for k, v in truth.items():
        assert coef[k] == pytest.approx(v, rel=1e-4)


def test_trace_columns(tmp_path):
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:50.9951690,396,109\n")
    jobs = load_trace(azure)
    assert [(round(j.arrival, 3), j.prompt_len, j.output_len) for j in jobs] == [(0.0, 374, 44), (4.315, 396, 109)]
    moon = tmp_path / "mooncake.jsonl"
    moon.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 1000, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 3500, "input_length": 1024, "output_length": 5, "hash_ids": [1, 3]}]))
    a, b = load_trace(moon)
    assert (a.arrival, b.arrival) == (0.0, 2.5)
    ha, hb = a.block_hashes(16), b.block_hashes(16)
    assert ha[:32] == hb[:32] and ha[32] != hb[32]  # the first 512 tokens shared, as the trace says


def test_scheduler_decisions_equal_the_engine(tiny_llama):
    """The real engine (tiny model, a pool small enough to preempt, a budget that chunks, a shared prefix) and
    the simulated instance, fed the same requests at the same steps, schedule the same rows every step."""
    from pdserve.engine.engine import LLMEngine
    from pdserve.sim.instance import SimInstance
    from pdserve.types.engine_config import EngineConfig
    from pdserve.types.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", block_size=4, num_gpu_blocks_override=14,
                                    max_num_batched_tokens=16, max_num_seqs=4))
    prompts = [list(range(1, 30)), list(range(1, 21)) + [40, 41, 42], list(range(50, 60)), list(range(60, 75))]
    arrive_at = {0: [0, 1], 2: [2], 3: [3]}  # step index -> prompts added before it
    max_tokens = [12, 9, 20, 6]

    def drive(add, step, has_work, n_steps=200):
        log = []
        for i in range(n_steps):
            for k in arrive_at.get(i, []):
                add(k)
            if not has_work() and i > max(arrive_at):
                break
            log.append(step())
        return log

    real_sched = engine.scheduler.schedule

    def recording():
        out = real_sched()
        recording.last = ([(r.request_id, n) for r, n in out.scheduled], [r.request_id for r in out.preempted])
        return out

    engine.scheduler.schedule = recording
    try:
        def e_add(k):
            engine.add_request(str(k), prompts[k], SamplingParams(max_tokens=max_tokens[k], ignore_eos=True,
                                                                  temperature=0.0))

        def e_step():
            recording.last = ([], [])
            engine.step()
            return recording.last

        real = drive(e_add, e_step, engine.has_unfinished)
    finally:
        engine.shutdown()

    prof = Profile(name="t", model="t", device="cpu", kv_capacity_tokens=14 * 4,
                   engine=EngineSettings(block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                         enable_chunked_prefill=True, enable_prefix_caching=True),
                   step_model={"fixed": 1.0, "tokens": 0, "prefill_attention": 0, "decode_rows": 0,
                               "decode_context": 0})
    inst = SimInstance("i", "collocated", prof)
    from pdserve.engine.pd.kv_handoff import KVHandoff
    from pdserve.engine.request import Request

    def s_add(k):
        inst.add(Request(str(k), list(prompts[k]), SamplingParams(max_tokens=max_tokens[k], ignore_eos=True),
                         frozenset(), 1 << 20, KVHandoff()))

    def s_step():
        res = inst.step()
        if res is None:
            return ([], [])
        inst.commit(res)
        return ([(r.request_id, n) for r, n in res.sched.scheduled], [r.request_id for r in res.sched.preempted])

    sim = drive(s_add, s_step, inst.has_work)
    assert any(p for _, p in real), "the scenario must preempt"
    assert sim == real


def test_multiturn_later_turns_hit_the_prefix_cache():
    """bench's synthetic conversations: a later turn's prompt repeats the earlier turns and the instance's own
    answers, so only the new user message (and the partial block before it) is computed."""
    from pdserve.bench.options import BenchSpec
    from pdserve.sim.instance import OUTPUT_TOKEN
    from pdserve.sim.run import simulate_conversations
    from pdserve.sim.workload import multiturn_conversations

    spec = BenchSpec(dataset_name="multiturn", num_prompts=2, multiturn_turns=3, multiturn_system_len=16,
                     multiturn_user_len=8, multiturn_answer_len=4)
    spec.normalise()
    convs = multiturn_conversations(spec, 1000, OUTPUT_TOKEN)
    prof = toy_profile()
    prof.kv_capacity_tokens = 512
    run = simulate_conversations(parse_topology("collocated:1"), Pools.of(prof), convs, 0.5, None)
    by_turn = {}
    for t in run.tracked:
        by_turn.setdefault(t.turn, []).append(t)
    assert [len(by_turn[k]) for k in range(3)] == [2, 2, 2]
    # turn 1: 16 system + 8 user + 4 answer before its message; the answer's last token was sampled, never
    # computed (no KV), so 27 tokens were: 6 full blocks of 4 cached
    for t in by_turn[1]:
        assert t.job.prompt_len == 36 and t.cached_tokens == 24
    for t in by_turn[2]:  # 36 + 3 answer tokens computed in turn 1: 9 full blocks
        assert t.job.prompt_len == 48 and t.cached_tokens == 36
        prev = next(p for p in by_turn[1] if p.conversation == t.conversation)
        assert t.job.arrival == pytest.approx(prev.finish_time + 0.5)  # sent think-time after the answer


def test_cli_saves_bench_result_fields(tmp_path, capsys):
    """`pdserve sim` with `pdserve bench serve`'s flags, a shipped profile, and vLLM's result JSON fields."""
    from pathlib import Path

    import pdserve
    from pdserve.cli import main

    profile = Path(pdserve.__file__).parent / "data" / "profiles" / "h200-llama3.1-8b-bf16.json"
    rc = main(["sim", "--profile", str(profile), "--topology", "2p2d", "--random-input-len", "2048",
               "--random-output-len", "32", "--num-prompts", "20", "--request-rate", "4", "--goodput", "ttft:2000",
               "tpot:30", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Request goodput (req/s):" in out
    data = json.loads((tmp_path / "r.json").read_text())
    for key in ("median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "request_throughput", "request_goodput",
                "completed", "total_input_tokens"):
        assert key in data
    assert data["completed"] == 20 and data["simulated"]["gpus"] == 4


def test_cli_refuses_a_bad_topology(capsys):
    from pathlib import Path

    import pdserve
    from pdserve.cli import main

    profile = Path(pdserve.__file__).parent / "data" / "profiles" / "h200-llama3.1-8b-bf16.json"
    assert main(["sim", "--profile", str(profile), "--topology", "0p2d", "--num-prompts", "2"]) == 2
    assert "topology" in capsys.readouterr().err


def test_profile_in_process_writes_a_loadable_profile(tiny_llama, tmp_path):
    """`pdserve profile MODEL [serve flags] --out FILE`: the points it measured, a non-negative fit, the pool."""
    from pdserve.cli import main

    out = tmp_path / "p.json"
    rc = main(["profile", str(tiny_llama), "--device", "cpu", "--block-size", "16", "--num-gpu-blocks-override",
               "64", "--prefill-lens", "8,24", "--cached-lens", "0,16", "--decode-batches", "1,2",
               "--decode-contexts", "8", "--decode-steps", "3", "--handoff-claim-ms", "1.5", "--out", str(out)])
    assert rc == 0
    prof = Profile.load(out)
    assert [(p["new"], p["cached"]) for p in prof.prefill_points] == [(8, 0), (24, 0), (8, 16), (24, 16)]
    assert [p["batch"] for p in prof.decode_points] == [1, 2]
    assert all(v >= 0 for v in prof.step_model.values())  # the values are timings: only their sign is checked
    assert prof.kv_capacity_tokens == 64 * 16 and prof.kv_bytes_per_token > 0
    assert prof.engine.block_size == 16 and prof.handoff.claim_s == 0.0015 and prof.handoff.link_bytes_per_s > 0
