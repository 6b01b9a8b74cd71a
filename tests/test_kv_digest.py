"""Per-block KV digests (pdserve/kv_transfer/digest.py): the algorithms, vLLM's encoding and hashing where they
match, the wire field's validation, the config switches. The end-to-end checks on real processes are in
tests/test_kv_digest_e2e.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.api.pd import (
    BLOCK_DIGESTS,
    DIGEST_ALGO,
    HeldKVParams,
    InvalidKVTransferParams,
    parse_remote_prefill_params,
)
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.kv_transfer.digest import VLLM_LANESUM, XXH3_128, BlockDigester, DigestMismatch, digest_blocks

_MASK = (1 << 64) - 1


def _pool(dtype: torch.dtype = torch.bfloat16, blocks: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    shape = (blocks, 3, 2, 16, 2, 8)  # [blocks, layers, K/V, block_size, heads, head_dim]
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=dtype, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _vllm_reference(pool: torch.Tensor, block_ids: list[int]) -> list[str]:
    """vLLM's nixl/digest.py, re-derived in plain Python: per region (one layer's K or V cache, rows of
    [block_size, heads, head_dim] per block) h1 = sum of the int64 lanes, h2 = sum of lane * lane index,
    wrapped to 64 bits; a block's digest sums its regions'."""
    out = []
    for b in block_ids:
        h1 = h2 = 0
        for layer in range(pool.shape[1]):
            for kv in range(2):
                lanes = np.frombuffer(pool[b, layer, kv].contiguous().view(torch.uint8).numpy().tobytes(), "<i8")
                h1 += sum(int(x) for x in lanes)
                h2 += sum(int(x) * i for i, x in enumerate(lanes))
        out.append(f"{h1 & _MASK:x}_{h2 & _MASK:x}")
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_lanesum_is_vllms_hash_over_its_region_rows(dtype: torch.dtype) -> None:
    pool = _pool(dtype)
    assert digest_blocks(pool, [0, 3, 5], VLLM_LANESUM) == _vllm_reference(pool, [0, 3, 5])


@pytest.mark.parametrize("algo", [XXH3_128, VLLM_LANESUM])
def test_one_flipped_byte_changes_the_digest_of_its_block_only(algo: str) -> None:
    pool = _pool()
    before = digest_blocks(pool, range(6), algo)
    assert len(set(before)) == 6
    assert all(len(d.split("_")) == 2 for d in before)
    pool[4].view(-1).view(torch.uint8)[777] ^= 1
    after = digest_blocks(pool, range(6), algo)
    assert [i for i in range(6) if before[i] != after[i]] == [4]


def test_xxh3_is_the_librarys_128_bit_hash_split_in_vllms_encoding() -> None:
    import xxhash

    pool = _pool()
    whole = xxhash.xxh3_128_intdigest(pool[2].contiguous().view(torch.uint8).numpy().tobytes())
    assert digest_blocks(pool, [2], XXH3_128) == [f"{whole >> 64:x}_{whole & _MASK:x}"]
    # numpy pools hash the same bytes
    assert digest_blocks(pool.float().numpy(), [1], XXH3_128) == digest_blocks(pool.float(), [1], XXH3_128)


def test_check_names_the_block_and_reports_what_it_cannot_verify() -> None:
    pool = _pool()
    d = BlockDigester(pool, algo=XXH3_128)
    held = d.held([1, 2, 3])
    assert d.check(held, XXH3_128, src_tp=1, local_ids=[2, 3], positions=[1, 2], what="r") is None
    with pytest.raises(DigestMismatch, match=r"rank 0, block 1 \(local block 4\)"):
        d.check(held, XXH3_128, src_tp=1, local_ids=[4, 3], positions=[1, 2], what="r")
    assert d.check((), None, src_tp=1, local_ids=[1], positions=[0], what="r") == "absent"
    assert d.check(held, XXH3_128, src_tp=2, local_ids=[1], positions=[0], what="r") == "tp_mismatch"  # 1 list
    # (a load from a producer of another TP size: tests/test_kv_digest_split.py)
    assert d.check(held, "md5", src_tp=1, local_ids=[1], positions=[0], what="r") == "algo"


def _params(**extra) -> dict:
    base = HeldKVParams(request_id="r1", block_ids=(4, 5), num_tokens=20, engine_id="e", host="127.0.0.1",
                        port=5600, generation=1, expires_at=0.0, lease_token="t" * 32,
                        block_digests=(("a_b", "c_d"),), digest_algo=XXH3_128).to_json()
    return {**base, **extra}


def test_digests_travel_in_vllms_field_and_are_validated() -> None:
    wire = _params()
    assert wire[BLOCK_DIGESTS] == [["a_b", "c_d"]] and wire[DIGEST_ALGO] == XXH3_128
    parsed = parse_remote_prefill_params(wire)
    assert parsed.block_digests == (("a_b", "c_d"),) and parsed.digest_algo == XXH3_128
    assert parse_remote_prefill_params({k: v for k, v in wire.items() if k != BLOCK_DIGESTS}).block_digests == ()
    for bad in ([["a_b"]], [["a_b", "xyz"]], "a_b", [["a_b", "c_d"], ["a_b", "c_d"]], [["A_B", "c_d"]]):
        with pytest.raises(InvalidKVTransferParams, match=BLOCK_DIGESTS):
            parse_remote_prefill_params(_params(**{BLOCK_DIGESTS: bad}))
    # push params carry none: a push's digests go over the side channel
    assert BLOCK_DIGESTS not in HeldKVParams(request_id="r", block_ids=(1,), num_tokens=1, engine_id="e",
                                             host="h", port=1, generation=1, expires_at=0.0, push=True,
                                             block_digests=(("a_b",),)).to_json()


def test_config_switches() -> None:
    from pdserve.kv_transfer import config as kv_config
    from pdserve.kv_transfer.config import digests_enabled, digests_on

    base = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    auto = KVTransferConfig.from_json(base, env={})  # "auto" by default: decided by the pool's device
    assert auto.enable_kv_digest == "auto" and auto.kv_digest_algo == "auto" and not auto.kv_digest_required
    assert not digests_on("auto", "DRAM")  # a CPU pool: over the 3 % (BENCHMARKS.md, "KV digests")
    assert digests_on("auto", "VRAM") is kv_config.DIGESTS_AUTO_ON_GPU
    assert digests_on(True, "DRAM") and not digests_on(False, "VRAM")
    assert not digests_enabled(None) and not digests_enabled({"kv_connector_extra_config": {}})
    assert digests_enabled({"kv_connector_extra_config": {"enable_kv_digest": True}})
    on = {**base, "kv_connector_extra_config": {"enable_kv_digest": True}}
    assert KVTransferConfig.from_json(on, env={}).enable_kv_digest is True
    assert KVTransferConfig.from_json(on, env={"VLLM_NIXL_DIGEST_FAIL": "1"}).kv_digest_required
    assert KVTransferConfig.from_json(base, env={"VLLM_NIXL_DIGEST_FAIL": "1"}).kv_digest_required  # auto: may be on
    off = {**base, "kv_connector_extra_config": {"enable_kv_digest": False}}
    assert not KVTransferConfig.from_json(off, env={"VLLM_NIXL_DIGEST_FAIL": "1"}).kv_digest_required
    lanes = {**base, "kv_connector_extra_config": {"enable_kv_digest": True, "kv_digest_algo": VLLM_LANESUM}}
    assert KVTransferConfig.from_json(lanes, env={}).kv_digest_algo == VLLM_LANESUM
    for key, bad in (("enable_kv_digest", "yes"), ("kv_digest_required", "auto"), ("kv_digest_algo", "md5")):
        with pytest.raises(ValueError, match=key):
            KVTransferConfig.from_json({**base, "kv_connector_extra_config": {key: bad}}, env={})


def test_auto_digests_follow_the_gpu_decision(monkeypatch) -> None:
    """The one switch the GPU measurement sets (config.DIGESTS_AUTO_ON_GPU) decides "auto" on GPU pools only."""
    from pdserve.kv_transfer import config as kv_config

    for decided in (True, False):
        monkeypatch.setattr(kv_config, "DIGESTS_AUTO_ON_GPU", decided)
        assert kv_config.digests_on("auto", "VRAM") is decided
        assert not kv_config.digests_on("auto", "DRAM")


def test_the_cpu_reference_of_the_gpu_kernel_is_vllms_formula() -> None:
    """lanesum_kernel.lanesum_reference (what the Triton kernel is tested against on the GPU: test_kv_digest_gpu.py)
    equals vLLM's formula re-derived per region, and the torch path."""
    from pdserve.kv_transfer.lanesum_kernel import lanesum_reference, supported

    for dtype in (torch.bfloat16, torch.float32, torch.uint8):
        pool = _pool(dtype)
        rows = pool.view(torch.uint8).reshape(pool.shape[0], -1).numpy()[[0, 3, 5]]
        ref = [f"{a:x}_{b:x}" for a, b in lanesum_reference(rows, 6)]
        assert ref == _vllm_reference(pool, [0, 3, 5]) == digest_blocks(pool, [0, 3, 5], VLLM_LANESUM)
    assert supported(6 * 64, 6) and not supported(6 * 60, 6) and not supported(100, 3)
    with pytest.raises(ValueError, match="whole 8-byte lanes"):
        lanesum_reference(np.zeros((1, 36), dtype=np.uint8), 3)


def test_host_tier_block_changed_in_the_tier_is_dropped_and_recomputed(tiny_llama):
    """The tier loader checks a host-tier block's digest before loading it back: bytes that changed in the
    tier are never used (counted, dropped, the prompt recomputed: the answer equals transformers')."""
    from engine_utils import hf_greedy, make_engine, run_engine

    from pdserve.kv_events.block_hash import block_hashes
    from pdserve.kv_offload.host_tier import HostTier
    from pdserve.kv_transfer.digest import cpu_block_digest
    from pdserve.types.sampling_params import SamplingParams

    bs, greedy = 16, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = make_engine(tiny_llama, block_size=bs, num_gpu_blocks_override=12,
                         kv_offloading_size=64 * 2 * 2 * bs * 2 * 16 * 4 / 1024**3, kv_offloading_backend="native")
    tiers = engine.tiers
    tiers.host = HostTier(tiers.host.num_slots, tiers.block_shape, tiers.pool.dtype, False, digest=cpu_block_digest)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 320, (4 * bs,), generator=g).tolist()
    run_engine(engine, [prefix + [5, 6, 7]], greedy)
    run_engine(engine, [torch.randint(3, 320, (5 * bs,), generator=g).tolist() for _ in range(3)], greedy)
    first = block_hashes(prefix, bs)[0]
    assert first in tiers.host
    tiers.host.data[tiers.host._slot[first]].view(-1)[3] += 1.0  # the tier's copy changes under it
    second = prefix + [9, 8, 7]
    assert run_engine(engine, [second], greedy) == hf_greedy(tiny_llama, [second], 6)
    assert engine.stats().kv_tiers["CPU"]["digest_mismatch_blocks"] == 1
    assert first not in tiers.host
    engine.shutdown()


class _RankShard:
    """Rank 1's shard as the engine process reaches it: `block_digests` (kv_rank.RemoteRankAgent's method,
    here over a pool in this process; the real RPC runs in tests/test_kv_digest_e2e.py's TP=2 pair)."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool

    def block_digests(self, block_ids: list[int], algo: str) -> list[str]:
        return digest_blocks(self.pool, block_ids, algo)


def test_every_rank_is_digested_and_a_bad_block_on_rank_1_is_caught() -> None:
    from pdserve.kv_transfer.kv_rank import BlockDigests, RankKVService

    rank0, rank1 = _pool(), _pool(torch.float32)
    producer = BlockDigester(rank0, [_RankShard(rank1)], algo=XXH3_128)
    held = producer.held([0, 1, 2])
    assert len(held) == 2 and held[1] == tuple(digest_blocks(rank1, [0, 1, 2], XXH3_128))
    consumer = BlockDigester(rank0.clone(), [_RankShard(rank1.clone())], algo=XXH3_128)
    assert consumer.check(held, XXH3_128, src_tp=2, local_ids=[0, 1, 2], positions=[0, 1, 2], what="r") is None
    consumer._ranks[0].pool[2].view(-1)[0] += 1.0
    with pytest.raises(DigestMismatch, match="rank 1, block 2"):
        consumer.check(held, XXH3_128, src_tp=2, local_ids=[0, 1, 2], positions=[0, 1, 2], what="r")
    # the worker rank's handlers digest its own pool, held and as received from another TP size
    from pdserve.kv_transfer.digest_split import Received, SplitLayout
    from pdserve.kv_transfer.head_split import BlockGeometry
    from pdserve.kv_transfer.kv_rank import ReceivedDigests

    service = RankKVService(rank1)
    assert service.handlers()[BlockDigests](BlockDigests((1, 2), XXH3_128)) == list(held[1][1:])
    # rank 1 of a TP=2 decode of a 4-KV-head model (_pool: 2 heads a rank) holds heads 2 and 3: producer ranks 2
    # and 3 of a TP=4 prefill, each whole, re-assembled and hashed
    layout = SplitLayout(BlockGeometry(3 * 2 * 16, (8 * 4,)), 4, 6)
    got = service.handlers()[ReceivedDigests](ReceivedDigests((1, 2), XXH3_128, layout, 1, 2, 4))
    assert got == [Received(2 + h, -1, tuple(digest_blocks(rank1[:, :, :, :, h:h + 1].contiguous(), [1, 2],
                                                            XXH3_128))) for h in (0, 1)]


def test_verify_load_counts_and_applies_the_required_switch() -> None:
    from pdserve.kv_transfer.digest import verify_load
    from pdserve.kv_transfer.metrics import TransferMetrics

    pool = _pool()
    d = BlockDigester(pool, algo=XXH3_128)
    held = d.held([0, 1])
    m = TransferMetrics(model_name="t")
    kw = {"metrics": m, "algo": XXH3_128, "src_tp": 1, "positions": [0, 1], "what": "request r", "where": "read"}
    assert verify_load(d, policy="fail", required=False, expected=held, local_ids=[0, 1], **kw) is None
    bad = verify_load(d, policy="recompute", required=False, expected=held, local_ids=[1, 0], **kw)
    assert bad is not None and "KV digest mismatch for request r: rank 0, block 0" in bad
    assert verify_load(d, policy="fail", required=False, expected=(), local_ids=[0, 1], **kw) is None
    refused = verify_load(d, policy="fail", required=True, expected=(), local_ids=[0, 1], **kw)
    assert refused is not None and "kv_digest_required" in refused
    assert m.snapshot()["digest_verified_blocks"] == 2
    assert m.snapshot()["digest_mismatches"] == 1 and m.snapshot()["digest_unverified"] == 2
    from prometheus_client import generate_latest

    text = generate_latest(m.registry).decode()
    assert 'pdserve:kv_digest_mismatch_total{engine="0",model_name="t",outcome="recomputed",where="read"} 1.0' in text
    assert 'reason="absent"} 2.0' in text


def test_a_held_historys_params_carry_digests_to_the_prefill_that_reads_them_back() -> None:
    from pdserve.api.pd import parse_remote_kv_params

    history = HeldKVParams(request_id="c-history", block_ids=(7, 8), num_tokens=32, engine_id="d", host="h",
                           port=5600, generation=2, expires_at=0.0, lease_token="t" * 32, history=True,
                           block_hashes=("aa", "bb"), block_bytes=64, block_digests=(("1_2", "3_4"),),
                           digest_algo=XXH3_128).to_json()
    parsed = parse_remote_kv_params(history)
    assert parsed.prefix and parsed.block_digests == (("1_2", "3_4"),) and parsed.digest_algo == XXH3_128
