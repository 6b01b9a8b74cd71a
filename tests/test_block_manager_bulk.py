"""The block manager's bulk paths (whole runs of blocks taken, registered and freed by C-level map calls) leave
exactly the pool the block-by-block loops leave: random request sequences with shared prefixes, prefix hits,
partial and whole registrations, releases in any order and a pool small enough to evict cached blocks."""

from __future__ import annotations

import random

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.pd.kv_handoff import KVHandoff
from pdserve.engine.request import Request
from pdserve.types.sampling_params import SamplingParams


def _state(bm: BlockManager, reqs: dict[str, Request]) -> tuple:
    return (list(bm.free), list(bm.ref_cnt), list(bm.block_hash), dict(bm.cached), list(bm.block_meta),
            {rid: (list(r.block_ids), r.num_registered_blocks) for rid, r in reqs.items()})


def test_bulk_paths_leave_the_pool_the_loops_leave() -> None:
    runs = 0
    for seed in range(40):
        rng = random.Random(seed)
        block_size = rng.choice([1, 2, 4])
        num_blocks = rng.choice([40, 80, 200])
        managers = []
        for bulk in (False, True):
            bm = BlockManager(num_blocks, block_size)
            bm.bulk = bulk
            managers.append((bm, {}))
        shared = [rng.randrange(1, 9) for _ in range(60)]
        for step in range(120):
            op = rng.random()
            live = sorted(managers[0][1])
            if op < 0.45 or not live:
                rid = f"r{step}"
                ids = shared[: rng.randrange(0, 60)] + [rng.randrange(1, 9) for _ in range(rng.randrange(1, 40))]
                upto = rng.randrange(1, len(ids) + 1)
                outcome = []
                for bm, reqs in managers:
                    req = Request(rid, list(ids), SamplingParams(max_tokens=4, ignore_eos=True), frozenset(), 1 << 20,
                                  KVHandoff())
                    cached = bm.find_cached_prefix(req)
                    ok = bm.allocate(req, max(upto, len(cached) * block_size + 1), cached)
                    outcome.append(ok)
                    if ok:
                        reqs[rid] = req
                        req.num_computed_tokens = len(cached) * block_size
                assert outcome[0] == outcome[1]
            elif op < 0.8:
                rid = rng.choice(live)
                computed = None
                for bm, reqs in managers:
                    req = reqs[rid]
                    if computed is None:
                        computed = rng.randrange(req.num_computed_tokens,
                                                 min(len(req.block_ids) * block_size, req.num_tokens) + 1)
                    req.num_computed_tokens = computed
                    bm.cache_full_blocks(req)
                runs += computed // block_size - 8 > 0
            else:
                rid = rng.choice(live)
                for bm, reqs in managers:
                    bm.release(reqs.pop(rid))
            assert _state(*managers[0]) == _state(*managers[1]), (seed, step)
    assert runs > 200  # runs long enough for the bulk paths were registered
