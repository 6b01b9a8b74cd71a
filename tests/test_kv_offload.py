"""KV offload tiers (host memory, disk): greedy output with a prefix served from either tier equals
transformers' (and a recompute), a full host tier evicts LRU and keeps serving, and a corrupted or
truncated disk file is detected by its checksum and recomputed, never used."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from engine_utils import hf_greedy, make_engine, run_engine

from pdserve.kv_events.block_hash import block_hashes
from pdserve.types.sampling_params import SamplingParams

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MIB = 1 / 1024  # GiB
TINY_BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # tiny_llama: layers x (K, V) x tokens x KV heads x head dim x fp32


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (length,), generator=g).tolist() for _ in range(n)]


def _engine(model: Path, pool_blocks: int, host_blocks: int, disk: Path | None = None, disk_mib: float = 0.0):
    kw = {}
    if disk is not None:
        kw = {"kv_offloading_disk_path": str(disk), "kv_offloading_disk_size": disk_mib * MIB}
    engine = make_engine(model, block_size=BS, num_gpu_blocks_override=pool_blocks,
                         kv_offloading_size=host_blocks * TINY_BLOCK_BYTES / 1024**3, kv_offloading_backend="native",
                         **kw)
    assert engine.tiers.block_nbytes == TINY_BLOCK_BYTES and engine.tiers.host.num_slots == host_blocks
    return engine


def _tier(engine, medium: str) -> dict:
    return engine.stats().kv_tiers[medium]


def _block_bytes(engine) -> int:
    return engine.tiers.block_nbytes


def _evict_with(engine, seed: int, n: int = 3) -> None:
    """Distinct prompts that push every earlier block out of the small pool."""
    run_engine(engine, _prompts(seed, n, 5 * BS), GREEDY)


def test_prefix_from_host_tier_is_token_exact(tiny_llama):
    engine = _engine(tiny_llama, pool_blocks=12, host_blocks=64)
    prefix = _prompts(1, 1, 4 * BS)[0]
    first, second = prefix + [5, 6, 7], prefix + [9, 8, 7, 6]
    run_engine(engine, [first], GREEDY)
    _evict_with(engine, seed=2)
    assert engine.blocks.find_cached_prefix(engine_req(second)) == []  # no longer in the pool
    hits0, ext0 = _tier(engine, "CPU")["hit_tokens"], engine.blocks.external_hits
    engine.add_request("again", second, GREEDY)
    out = []
    cached = None
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            out.extend(o.new_token_ids)
            cached = o.num_cached_tokens
    assert out == hf_greedy(tiny_llama, [second], 6)[0]
    assert _tier(engine, "CPU")["hit_tokens"] - hits0 == 4 * BS
    assert engine.blocks.external_hits - ext0 == 4 * BS
    assert cached == 4 * BS  # usage.prompt_tokens_details.cached_tokens: not computed, whichever tier
    s = _tier(engine, "CPU")
    assert s["offload_bytes"] > 0 and s["load_bytes"] == 4 * _block_bytes(engine)
    engine.shutdown()


def engine_req(tokens):
    from pdserve.engine.request import Request

    return Request("probe", list(tokens), GREEDY, frozenset(), 4096)


def test_prefix_from_disk_tier_is_token_exact(tiny_llama, tmp_path):
    # host tier of 2 blocks: a 4-block prefix evicted from the pool ends up mostly on disk
    engine = _engine(tiny_llama, pool_blocks=12, host_blocks=2, disk=tmp_path / "kv", disk_mib=1)
    prefix = _prompts(3, 1, 4 * BS)[0]
    run_engine(engine, [prefix + [1, 2, 3]], GREEDY)
    _evict_with(engine, seed=4)
    engine.tiers.disk.flush()
    hashes = block_hashes(prefix, BS)
    on_disk = [h in engine.tiers.disk for h in hashes]
    assert any(on_disk), "nothing reached the disk tier"
    second = prefix + [4, 4, 4]
    hits0 = _tier(engine, "DISK")["hit_tokens"]
    assert run_engine(engine, [second], GREEDY) == hf_greedy(tiny_llama, [second], 6)
    assert _tier(engine, "DISK")["hit_tokens"] - hits0 >= BS
    assert _tier(engine, "DISK")["corrupt_blocks"] == 0
    engine.shutdown()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_disk_block_is_recomputed(tiny_llama, tmp_path, damage):
    engine = _engine(tiny_llama, pool_blocks=12, host_blocks=2, disk=tmp_path / "kv", disk_mib=1)
    prefix = _prompts(5, 1, 4 * BS)[0]
    run_engine(engine, [prefix + [1, 2, 3]], GREEDY)
    _evict_with(engine, seed=6)
    engine.tiers.disk.flush()
    hashes = block_hashes(prefix, BS)
    on_disk = [h for h in hashes if h in engine.tiers.disk]
    assert on_disk
    victim = engine.tiers.disk.path_of(on_disk[0])
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-7] ^= 0x40  # one bit of the payload: only the checksum can tell
    else:
        data = data[: len(data) - 100]
    victim.write_bytes(bytes(data))
    second = prefix + [2, 2, 2]
    assert run_engine(engine, [second], GREEDY) == hf_greedy(tiny_llama, [second], 6)
    assert _tier(engine, "DISK")["corrupt_blocks"] == 1
    assert not victim.exists() and on_disk[0] not in engine.tiers.disk
    engine.shutdown()


def test_full_host_tier_evicts_lru_and_keeps_serving(tiny_llama):
    slots = 6
    engine = _engine(tiny_llama, pool_blocks=12, host_blocks=slots)
    prompts = _prompts(7, 8, 3 * BS + 2)
    for p in prompts:  # each leaves 3 cached blocks; 24 blocks through a 12-block pool and a 6-slot tier
        assert run_engine(engine, [p], GREEDY) == hf_greedy(tiny_llama, [p], 6)
    host = engine.tiers.host
    assert len(host) == slots
    held = {h for p in prompts for h in block_hashes(p, BS) if h in host}
    oldest = set(block_hashes(prompts[0], BS))
    assert held and not (held & oldest)  # the least recently used went first
    # and the tier still serves: a recent prompt evicted from the pool comes back from the host tier
    _evict_with(engine, seed=8)
    recent = next(p for p in reversed(prompts) if block_hashes(p, BS)[0] in host)
    hits0 = _tier(engine, "CPU")["hit_tokens"]
    again = recent[: 3 * BS] + [1, 2]
    assert run_engine(engine, [again], GREEDY) == hf_greedy(tiny_llama, [again], 6)
    assert _tier(engine, "CPU")["hit_tokens"] > hits0
    engine.shutdown()


def test_offloading_config_is_checked(tiny_llama, tmp_path):
    from pdserve.types.engine_config import EngineConfig

    for kw in ({"kv_offloading_backend": "lmcache", "kv_offloading_size": 1.0},
               {"kv_offloading_size": -1.0}, {"kv_offloading_backend": "native"},
               {"kv_offloading_size": 1.0, "kv_offloading_disk_path": str(tmp_path)},
               {"kv_offloading_size": 1.0, "enable_prefix_caching": False}):
        with pytest.raises(ValueError):
            EngineConfig(model=str(tiny_llama), **kw)


# ---- a real server: host and disk tiers, events with their media, usage and metrics ---------------------
def test_server_serves_prefix_from_disk_and_host_tiers(tmp_path):
    import httpx
    import zmq
    from server_utils import MODEL, ServerProcess, make_model_dir, metric_value
    from test_kv_events import VLLM_DECODER, VAllBlocksCleared, VBlockRemoved, VBlockStored

    from pdserve.kv_events.block_hash import external_block_hashes

    model = make_model_dir(tmp_path / "model")
    block_bytes = 2 * 2 * BS * 2 * 16 * 4  # make_model_dir's tiny Llama: same KV shape as tiny_llama
    events = ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", "topic": "t"}')
    srv = ServerProcess(model, tmp_path / "srv.log", "--block-size", str(BS), "--num-gpu-blocks-override", "12",
                        "--max-model-len", "512", "--kv-offloading-size", str(4 * block_bytes / 1024**3),
                        "--kv-offloading-backend", "native", "--kv-offloading-disk-path", str(tmp_path / "kv"),
                        "--kv-offloading-disk-size", str(1 / 1024), "--kv-events-config", events)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    seen: list = []

    def drain(until, timeout_s=30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not until():
            if sub.poll(100):
                _, _, payload = sub.recv_multipart()
                seen.extend(VLLM_DECODER.decode(payload).events)
        return until()

    def complete(prompt):
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                          "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    def on(medium, hashes):
        held: set[int] = set()  # what `medium` holds after every event so far, in order
        for e in seen:
            if isinstance(e, VBlockStored) and e.medium == medium:
                held.update(e.block_hashes)
            elif isinstance(e, VBlockRemoved) and e.medium == medium:
                held.difference_update(e.block_hashes)
        return set(hashes) <= held

    try:
        srv.wait_ready()
        info = httpx.get(f"{srv.url}/pdserve/info", timeout=10).json()
        assert [t["medium"] for t in info["kv_tiers"]] == ["GPU", "CPU", "DISK"]
        assert info["kv_tiers"][1]["capacity_blocks"] == 4 and info["kv_tiers"][2]["checksum"] == "crc32"
        sub.setsockopt(zmq.SUBSCRIBE, b"t")
        sub.connect(info["kv_events"]["endpoint"])
        time.sleep(0.5)
        prefix = _prompts(11, 1, 4 * BS)[0]
        prompt = prefix + [7, 7, 7]
        want = external_block_hashes(prefix, BS)
        reference, cached = complete(prompt)  # computed: the reference
        assert cached == 0
        for p in _prompts(12, 3, 5 * BS):  # push the prefix out of the pool and the 4-block host tier
            complete(p)
        assert drain(lambda: on("DISK", want)), f"prefix not announced on DISK: {seen}\n{srv.log()}"
        text, cached = complete(prompt)
        assert text == reference and cached == 4 * BS
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert metric_value(metrics, 'pdserve:kv_tier_hits_total{engine="0",medium="DISK"') >= 4 * BS
        assert metric_value(metrics, "vllm:external_prefix_cache_hits_total") >= 4 * BS
        assert metric_value(metrics, "vllm:external_prefix_cache_queries_total") >= 4 * BS
        # once more through the host tier: small prompts until the prefix's first block has left the pool
        # for the host tier (the rest may be there or, pushed on by later evictions, on disk)
        for p in _prompts(13, 10, 2 * BS):
            complete(p)
            drain(lambda: False, timeout_s=0.3)
            if on("CPU", want[:1]) and not on("GPU", want[:1]):
                break
        history = [(type(e).__name__, e.medium) for e in seen
                   if not isinstance(e, VAllBlocksCleared) and want[0] in e.block_hashes]
        assert on("CPU", want[:1]) and not on("GPU", want[:1]), " ".join(f"{a}:{b}" for a, b in history)
        hits = metric_value(httpx.get(f"{srv.url}/metrics", timeout=10).text,
                            'pdserve:kv_tier_hits_total{engine="0",medium="CPU"')
        text, cached = complete(prompt)
        assert text == reference and cached == 4 * BS
        assert metric_value(httpx.get(f"{srv.url}/metrics", timeout=10).text,
                            'pdserve:kv_tier_hits_total{engine="0",medium="CPU"') > hits
        assert {e.medium for e in seen if isinstance(e, VBlockStored)} == {"GPU", "CPU", "DISK"}
    finally:
        sub.close(linger=0)
        ctx.term()
        srv.stop()


def test_abort_while_disk_read_parked(tiny_llama, tmp_path):
    engine = _engine(tiny_llama, pool_blocks=12, host_blocks=2, disk=tmp_path / "kv", disk_mib=1)
    prefix = _prompts(21, 1, 4 * BS)[0]
    run_engine(engine, [prefix + [1]], GREEDY)
    _evict_with(engine, seed=22)
    engine.tiers.disk.flush()
    assert block_hashes(prefix, BS)[0] in engine.tiers.disk
    engine.add_request("parked", prefix + [3, 3], GREEDY)
    engine.step()  # starts the disk read and parks the request
    assert "parked" in engine.tier_loader.parked and engine.stats().num_waiting == 1
    out = engine.abort_request("parked")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert not engine.tier_loader.parked and not engine.has_unfinished()
    for _ in range(50):  # the read's result arrives for nobody: ignored
        engine.step()
        if engine.tiers._done.empty() and engine.tiers._reads.empty():
            break
    again = prefix + [3, 3]
    assert run_engine(engine, [again], GREEDY) == hf_greedy(tiny_llama, [again], 6)
    engine.shutdown()


def test_fp8_blocks_served_from_host_and_disk_tiers_are_token_exact(tiny_llama, tmp_path):
    """An fp8 pool's blocks (values and scales inside each block: pdserve.attention.fp8_kv) go to the host
    and disk tiers and come back unchanged: a prefix served from them gives the tokens of an fp8 run that
    computes it."""
    fp8_block = 2 * 2 * BS * 2 * (16 + 2)  # layers x (K, V) x tokens x KV heads x (head dim + 2 scale bytes)
    engine = make_engine(tiny_llama, block_size=BS, num_gpu_blocks_override=12, kv_cache_dtype="fp8",
                         kv_offloading_size=2 * fp8_block / 1024**3, kv_offloading_backend="native",
                         kv_offloading_disk_path=str(tmp_path / "kv"), kv_offloading_disk_size=MIB)
    assert engine.tiers.block_nbytes == fp8_block
    prefix = _prompts(5, 1, 4 * BS)[0]
    second = prefix + [4, 4, 4]
    want = run_engine(make_engine(tiny_llama, kv_cache_dtype="fp8", enable_prefix_caching=False), [second], GREEDY)
    run_engine(engine, [prefix + [1, 2, 3]], GREEDY)
    _evict_with(engine, seed=6)
    engine.tiers.disk.flush()
    assert engine.blocks.find_cached_prefix(engine_req(second)) == []  # no longer in the pool
    hits0 = {m: _tier(engine, m)["hit_tokens"] for m in ("CPU", "DISK")}
    assert run_engine(engine, [second], GREEDY) == want
    assert _tier(engine, "DISK")["hit_tokens"] - hits0["DISK"] >= BS
    assert _tier(engine, "CPU")["hit_tokens"] - hits0["CPU"] + _tier(engine, "DISK")["hit_tokens"] - hits0["DISK"] \
        == 4 * BS
    assert _tier(engine, "DISK")["corrupt_blocks"] == 0
    engine.shutdown()
