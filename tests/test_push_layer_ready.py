"""Layer-pipelined push's readiness seam (pdserve/kv_transfer/layer_ready.py, push_sender.py), in one process
with two real NIXL agents over DRAM pools: the writer posts a layer only once its marker says the layer's K/V
is in the pool (on a GPU a CUDA event; here a gate the test opens), so a WRITE reads what the forward wrote,
not what the pool held when the host queued the layer; layers that are ready together go out as one WRITE;
prompts under `push_layerwise_min_tokens` are pushed whole; the GPU step runner (its CPU simulation) calls the
per-layer callback on an eager step and never inside a decode graph. The CUDA event itself is tested where
CUDA exists."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from pdserve.api import pd
from pdserve.engine.pd.kv_handoff import KVHandoff
from pdserve.engine.request import Request
from pdserve.kv_transfer.config import DEFAULT_PUSH_LAYERWISE_MIN_TOKENS, KVTransferConfig
from pdserve.kv_transfer.layer_ready import READY, CudaLayerEvent, marker_for
from pdserve.kv_transfer.messages import PushCancel, PushRegister, PushStatus
from pdserve.kv_transfer.pool import region_of
from pdserve.kv_transfer.push_sender import PushSender, parse_completion_notif
from pdserve.types.sampling_params import SamplingParams

LAYERS, BS, HEADS, DIM = 4, 16, 2, 8
WAIT_S = 20.0


class Gate:
    """A layer's K/V that the test 'computes' later than the host queued it (what a CUDA event stands for)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.waiting = threading.Event()  # the writer is blocked on it

    def ready(self) -> bool:
        return self.open.is_set()

    def wait(self) -> float:
        self.waiting.set()
        t0 = time.perf_counter()
        assert self.open.wait(WAIT_S), "the test never opened the gate"
        return time.perf_counter() - t0


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture
def pair():
    """A prefill-side PushSender and a decode-side agent, each with its own DRAM pool (16 blocks)."""
    from pdserve.kv_transfer.errors import NixlUnavailableError
    from pdserve.kv_transfer.nixl_agent import NixlAgent, load_nixl

    try:
        load_nixl()  # nixl_cu12 here, nixl_cu13 on the GPU machine
    except NixlUnavailableError as exc:
        pytest.skip(f"NIXL is not installed: {exc}")

    shape = (16, LAYERS, 2, BS, HEADS, DIM)
    p_pool, d_pool = torch.zeros(shape), torch.zeros(shape)
    p_agent = NixlAgent(f"p-{uuid.uuid4().hex[:6]}", ("UCX",), {})
    d_agent = NixlAgent(f"d-{uuid.uuid4().hex[:6]}", ("UCX",), {})
    p_agent.register(region_of(p_pool))
    d_region = region_of(d_pool)
    d_agent.register(d_region)
    gates: list[Gate] = []
    released: list[tuple[str, str]] = []

    def marker():  # each layer callback's marker: the next gate the test prepared, else already computed
        return gates.pop(0) if gates else READY

    def make(**kw) -> PushSender:
        kw.setdefault("layerwise", True)
        kw.setdefault("layerwise_min_tokens", 0)
        return PushSender(agent=p_agent, region=region_of(p_pool), num_layers=LAYERS, block_size=BS,
                          transfer_timeout_s=WAIT_S, lease_duration_s=60.0,
                          release_lease=lambda rid, tok: released.append((rid, tok)), auth=None,
                          layer_ready=marker, **kw)

    senders: list[PushSender] = []

    def sender(**kw) -> PushSender:
        senders.append(make(**kw))
        return senders[-1]

    env = {"p_pool": p_pool, "d_pool": d_pool, "d_agent": d_agent, "d_region": d_region, "gates": gates,
           "released": released, "sender": sender}
    try:
        yield env
    finally:
        for s in senders:
            s.shutdown()
        d_agent.close()
        p_agent.close()


def _request(key: str, num_tokens: int, blocks: list[int]) -> Request:
    kv = KVHandoff(send=True, push=pd.parse_push_prefill_params(pd.push_prefill_params(key)))
    req = Request(f"req-{key[:6]}", list(range(1, num_tokens + 1)), SamplingParams(), frozenset(), 4096, kv=kv)
    req.block_ids = list(blocks)
    return req


def _register(env, sender: PushSender, key: str, remote_blocks: list[int], num_tokens: int) -> None:
    msg = PushRegister(pool=env["d_region"].describe(), block_ids=tuple(remote_blocks), first_block=0,
                       num_tokens=num_tokens, engine_id="decode", agent_name=env["d_agent"].name,
                       agent_metadata=env["d_agent"].metadata(), seal_nonce=b"", push_key=key, generation=0,
                       timeout_s=WAIT_S)
    assert sender.handle(msg).state == "registered"


def _compute_layer(pool: torch.Tensor, blocks: list[int], layer: int, seed: int) -> None:
    """What the forward writes for a layer: values the decode can only have if the WRITE read them."""
    for i, b in enumerate(blocks):
        pool[b, layer] = seed * 1000 + layer * 100 + i + 1


def _wait_done(env, sender: PushSender, key: str) -> None:
    notifs: list[bytes] = []

    def done() -> bool:
        for msgs in env["d_agent"].get_notifs().values():  # also progresses the decode's agent
            notifs.extend(msgs)
        return sender.handle(PushStatus(push_keys=(key,))).states == ("done",)

    _until(done, "the push to complete")
    _until(lambda: notifs.extend(m for ms in env["d_agent"].get_notifs().values() for m in ms)
           or any((parse_completion_notif(m) or ("", None))[0] == key for m in notifs), "the completion notification")


def test_cpu_marker_is_ready_and_never_waits() -> None:
    assert READY.ready() and READY.wait() == 0.0
    assert marker_for("DRAM")() is READY


def test_the_writer_posts_a_layer_only_once_its_kv_is_there(pair) -> None:
    """Layer 0's callback runs before its K/V exists (a GPU's host runs ahead of the device): nothing is
    posted until its marker is ready, and the decode gets the values written after the callback."""
    env = pair
    sender = env["sender"]()
    key, local, remote = uuid.uuid4().hex, [3, 4, 5], [9, 10, 11]
    tokens = 3 * BS
    _register(env, sender, key, remote, tokens)
    req = _request(key, tokens, local)
    on_layer = sender.step_hook([(req, tokens)])
    assert on_layer is not None
    gate = Gate()
    env["gates"].append(gate)
    on_layer(0)  # queued; its K/V is not computed yet
    assert gate.waiting.wait(WAIT_S)
    assert sender.stats.snapshot().posts == 0  # the writer waits on the layer, not on anything after it
    _compute_layer(env["p_pool"], local, 0, seed=7)  # the "device" finishes layer 0 only now
    gate.open.set()
    # layer 0 goes out once its marker is ready, before the prefill ends (on a loaded box the writer thread may
    # take a while to run: wait for the post rather than race finish() with it)
    _until(lambda: sender.stats.snapshot().posts >= 1, "layer 0's WRITE")
    for layer in range(1, LAYERS):
        _compute_layer(env["p_pool"], local, layer, seed=7)
        on_layer(layer)
    sender.finish(req.request_id, req.kv.push, local, tokens, (req.request_id, "lease"))
    _wait_done(env, sender, key)
    assert torch.equal(env["d_pool"][remote], env["p_pool"][local])
    assert env["d_pool"][remote].abs().sum() > 0
    snap = sender.stats.snapshot()
    assert snap.ready_waits == 1 and snap.ready_wait_seconds > 0
    assert snap.jobs_done == 1 and snap.posts_during_prefill >= 1  # layer 0 at least went before finish()
    assert snap.layers == LAYERS and snap.block_layers == LAYERS * len(local)
    assert env["released"] == [(req.request_id, "lease")]


def test_layers_ready_together_go_out_as_one_write(pair) -> None:
    """The writer is held on layer 0; layers 1..3 are computed meanwhile: when layer 0 is ready all four go in
    one WRITE, and as they span every layer its descriptors are whole blocks, adjacent ones coalesced."""
    env = pair
    sender = env["sender"]()
    key, local, remote = uuid.uuid4().hex, [0, 1, 2, 3], [4, 5, 6, 7]
    tokens = 4 * BS
    _register(env, sender, key, remote, tokens)
    req = _request(key, tokens, local)
    on_layer = sender.step_hook([(req, tokens)])
    assert on_layer is not None
    gate = Gate()
    env["gates"].append(gate)
    on_layer(0)
    assert gate.waiting.wait(WAIT_S)
    for layer in range(LAYERS):
        _compute_layer(env["p_pool"], local, layer, seed=3)
    for layer in range(1, LAYERS):
        on_layer(layer)
    gate.open.set()
    sender.finish(req.request_id, req.kv.push, local, tokens, (req.request_id, "lease"))
    _wait_done(env, sender, key)
    assert torch.equal(env["d_pool"][remote], env["p_pool"][local])
    snap = sender.stats.snapshot()
    assert (snap.posts, snap.layers, snap.descriptors) == (1, LAYERS, 1)


def test_whole_request_push_is_one_write_of_whole_blocks(pair) -> None:
    """push_pipeline "request" (and a prompt under the layer-by-layer threshold): no per-layer callback, one
    WRITE after the prefill whose descriptors are whole blocks, runs of adjacent blocks coalesced."""
    env = pair
    sender = env["sender"](layerwise=False)
    key, local, remote = uuid.uuid4().hex, [5, 6, 8], [1, 2, 3]  # two runs on the prefill side
    tokens = 3 * BS - 5  # a partial last block
    _register(env, sender, key, remote, tokens)
    req = _request(key, tokens, local)
    assert sender.step_hook([(req, tokens)]) is None
    for layer in range(LAYERS):
        _compute_layer(env["p_pool"], local, layer, seed=5)
    sender.finish(req.request_id, req.kv.push, local, tokens, (req.request_id, "lease"))
    _wait_done(env, sender, key)
    assert torch.equal(env["d_pool"][remote], env["p_pool"][local])
    snap = sender.stats.snapshot()
    assert (snap.posts, snap.posts_during_prefill, snap.layers, snap.descriptors) == (1, 0, LAYERS, 2)


def test_a_registration_after_the_prefill_catches_up_in_one_write(pair) -> None:
    """A short prompt's usual order: the prefill finished (layer by layer, nothing registered yet) before the
    decode's registration came; the catch-up is one WRITE of whole blocks, not one per layer."""
    env = pair
    sender = env["sender"]()
    key, local, remote = uuid.uuid4().hex, [0, 1], [2, 3]
    tokens = 2 * BS
    req = _request(key, tokens, local)
    on_layer = sender.step_hook([(req, tokens)])
    assert on_layer is not None
    for layer in range(LAYERS):
        _compute_layer(env["p_pool"], local, layer, seed=9)
        on_layer(layer)  # nothing is registered: nothing is queued
    sender.finish(req.request_id, req.kv.push, local, tokens, (req.request_id, "lease"))
    _register(env, sender, key, remote, tokens)
    _wait_done(env, sender, key)
    assert torch.equal(env["d_pool"][remote], env["p_pool"][local])
    snap = sender.stats.snapshot()
    assert (snap.posts, snap.layers, snap.descriptors) == (1, LAYERS, 1)


def test_a_registration_mid_forward_waits_for_the_layers_already_queued(pair) -> None:
    """The decode registers while the forward is under way: the catch-up of a layer the host already queued
    waits on that layer's marker too (on a GPU the layer may not have run yet)."""
    env = pair
    sender = env["sender"]()
    key, local, remote = uuid.uuid4().hex, [6, 7], [12, 13]
    tokens = 2 * BS
    req = _request(key, tokens, local)
    on_layer = sender.step_hook([(req, tokens)])
    assert on_layer is not None
    gate = Gate()
    env["gates"].append(gate)
    on_layer(0)  # not registered yet: recorded, nothing queued
    _register(env, sender, key, remote, tokens)  # catches up with layer 0, behind its marker
    assert gate.waiting.wait(WAIT_S)
    assert sender.stats.snapshot().posts == 0
    _compute_layer(env["p_pool"], local, 0, seed=11)
    gate.open.set()
    for layer in range(1, LAYERS):
        _compute_layer(env["p_pool"], local, layer, seed=11)
        on_layer(layer)
    sender.finish(req.request_id, req.kv.push, local, tokens, (req.request_id, "lease"))
    _wait_done(env, sender, key)
    assert torch.equal(env["d_pool"][remote], env["p_pool"][local])


def test_a_cancel_while_the_writer_waits_on_a_layer_posts_nothing(pair) -> None:
    """vLLM#48633 C1 at the new seam: the decode cancels while the writer is blocked on a layer's marker. The
    job reads "ending" (a WRITE may still go out) until the writer let go of the task; then "cancelled", with
    nothing posted and the decode's blocks untouched."""
    env = pair
    sender = env["sender"]()
    key, local, remote = uuid.uuid4().hex, [8, 9], [14, 15]
    tokens = 2 * BS
    _register(env, sender, key, remote, tokens)
    req = _request(key, tokens, local)
    on_layer = sender.step_hook([(req, tokens)])
    assert on_layer is not None
    gate = Gate()
    env["gates"].append(gate)
    on_layer(0)
    assert gate.waiting.wait(WAIT_S)
    assert sender.handle(PushCancel(push_key=key)).state == "ending"
    _compute_layer(env["p_pool"], local, 0, seed=13)
    gate.open.set()

    def states() -> tuple[str, ...]:
        return sender.handle(PushStatus(push_keys=(key,))).states

    _until(lambda: states() == ("cancelled",), "the cancel to settle")
    assert sender.stats.snapshot().posts == 0
    assert env["d_pool"][remote].abs().sum() == 0


def test_short_prompts_are_pushed_whole(pair) -> None:
    env = pair
    sender = env["sender"](layerwise_min_tokens=64)
    for tokens, layered in ((63, False), (64, True)):
        req = _request(uuid.uuid4().hex, tokens, [0, 1, 2, 3])
        assert (sender.step_hook([(req, tokens)]) is not None) is layered


def test_layerwise_threshold_setting() -> None:
    def parse(extra: dict) -> KVTransferConfig:
        return KVTransferConfig.from_json({"kv_connector": "NixlPushConnector", "kv_role": "kv_producer",
                                           "kv_connector_extra_config": extra}, env={})

    assert parse({}).push_layerwise_min_tokens == DEFAULT_PUSH_LAYERWISE_MIN_TOKENS
    assert parse({"push_layerwise_min_tokens": 0}).push_layerwise_min_tokens == 0
    for bad in (-1, 1.5, True, "256"):
        with pytest.raises(ValueError, match="push_layerwise_min_tokens must be an integer >= 0"):
            parse({"push_layerwise_min_tokens": bad})


def test_gpu_step_path_calls_the_layer_hook_on_eager_steps_only(tiny_llama) -> None:
    """The GPU step runner (decode graphs simulated on the CPU): a step with a per-layer callback runs eagerly
    and calls it once per layer in order, even a one-token step that would otherwise replay a graph; tokens are
    the same as without the hook."""
    from engine_utils import make_engine, run_engine
    from test_async_scheduling import simulate_gpu_path

    def run(with_hook: bool) -> tuple[list[int], list[tuple[int, list[int]]], int]:
        engine = simulate_gpu_path(make_engine(tiny_llama, async_scheduling=False, max_num_batched_tokens=32,
                                               max_num_seqs=4))
        calls: list[tuple[int, list[int]]] = []

        def hook(batch):
            if not with_hook:
                return None
            seen: list[int] = []
            calls.append((sum(n for _, n in batch), seen))
            return seen.append

        engine.runner.layer_hook = hook
        out = run_engine(engine, [list(range(3, 43))], SamplingParams(temperature=0.0, max_tokens=6,
                                                                       ignore_eos=True))[0]
        graph_steps = engine.runner.step_timing.graph_steps
        assert (graph_steps == 0) is with_hook  # the decode steps replay graphs unless a callback came
        return out, calls, len(engine.runner.model.layers)

    plain, _, _ = run(False)
    hooked, calls, layers = run(True)
    assert hooked == plain and len(plain) == 6
    assert calls and all(seen == list(range(layers)) for _, seen in calls)
    assert any(n == 1 for n, _ in calls)  # the one-token (decode) steps ran eagerly with the callback


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_layer_event_marks_the_work_queued_before_it() -> None:
    """Recorded behind queued work on the current stream: once `wait` returns, that work is done (the writer's
    guarantee); recording never syncs the host."""
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    marker = marker_for("VRAM", torch.cuda.current_device())()
    assert isinstance(marker, CudaLayerEvent)
    marker.wait()
    assert marker.ready()
    done = torch.cuda.Event()
    done.record()
    assert done.query()  # nothing was queued after the marker: the stream is idle once it passed


def test_writer_counters_are_exposed_as_prometheus_counters() -> None:
    """`pdserve:kv_push_writer_*` as a scrape reads them (what bench_pd_push.py diffs per request)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.kv_transfer.push_stats import PushStats, PushStatsCollector

    stats = PushStats()
    stats.add_post(descriptors=8, layers=4, blocks=2, nbytes=4096, build_s=0.001, post_s=0.002, during_prefill=True)
    stats.add_post(descriptors=1, layers=4, blocks=1, nbytes=2048, build_s=0.0, post_s=0.001, during_prefill=False)
    stats.add_wait(0.0)  # an event that was already complete: not a wait
    stats.add_wait(0.004)
    stats.add_done(0.01)
    stats.add_job(0.02)
    reg = CollectorRegistry()
    reg.register(PushStatsCollector(stats, {"model_name": "m", "engine": "0"}))
    text = generate_latest(reg).decode()
    want = {"posts": 2, "posts_during_prefill": 1, "descriptors": 9, "layers": 8, "block_layers": 12,
            "bytes": 6144, "ready_waits": 1, "writes_done": 1, "jobs_done": 1}
    for name, value in want.items():
        assert f'pdserve:kv_push_writer_{name}_total{{engine="0",model_name="m"}} {float(value)}' in text, name
    assert 'pdserve:kv_push_writer_tail_max_seconds{engine="0",model_name="m"} 0.02' in text
