"""The proxy's instance choice through its indexes (pool.py's load index and kind summary, pairing.py's use of
them) picks exactly what the scan of every instance picked: random pools (transfer modes, engines, early-leg
support, health, back-off, loads set by legs and directly) and random requests (retries, exclusions, pairs),
the new code and the old scan side by side on mirrored state."""

from __future__ import annotations

import asyncio
import random
import time

from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.instance_info import kind, kinds_pair
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.pairing import PairChooser
from pdserve.proxy.pool import Instance, Pool
from pdserve.proxy.readiness import Readiness
from pdserve.routing.choice import LoadBalancer, LoadIndex


class ScanPool(Pool):
    """Pool.choose as it was before the index: every available instance scanned."""

    def choose(self, exclude=(), *, affinity=None, affinity_slack=0, cost=None, retry=None):
        excluded = set(exclude)
        now = time.monotonic()
        candidates = [inst for inst in self._instances if inst.available(now) and inst not in excluded]
        return self._balancer.choose(candidates, retry=bool(excluded) if retry is None else retry, affinity=affinity,
                                     affinity_slack=affinity_slack, cost=cost)


class ScanChooser(PairChooser):
    """PairChooser's methods as they were before the kind summary: a scan of each pool's instances."""

    async def prefill(self, tried=(), *, wait, affinity=None, prefix=None, like=None):
        exclude = [*tried, *self._old_unpairable(like)]
        return await self._choose(self._prefill, exclude, wait=wait, affinity=affinity, prefix=prefix, record=True,
                                  first=not tried)

    async def decode(self, tried=(), *, wait, prefix=None, computes_prompt=False, role="decode", pair_with=None):
        pool = {"decode": self._decode, "prefill": self._prefill}[role]
        exclude = list(tried)
        if pair_with is not None:
            exclude += [d for d in pool.instances if not self.pairs(pair_with, d)]
        return await self._choose(pool, exclude, wait=wait, prefix=prefix, record=computes_prompt, first=not tried)

    def mismatch(self):
        healthy = [p for p in self._prefill.instances if p.healthy]
        decodes = self._old_decode_kinds()
        if not healthy or not decodes or any(self._old_pairs_any(p, decodes) for p in healthy):
            return None
        return "mismatch"

    def _old_unpairable(self, like):
        decodes = self._old_decode_kinds()
        want = self.mode(like) if like is not None else None

        def other_mode(p: Instance) -> bool:
            return want is not None and self.mode(p) not in (None, want)

        return [p for p in self._prefill.instances
                if (decodes and not self._old_pairs_any(p, decodes)) or other_mode(p)]

    def _old_decode_kinds(self):
        return {kind(d, self._config.kv_transfer_mode) for d in self._decode.instances}

    def _old_pairs_any(self, prefill, decodes):
        pk = kind(prefill, self._config.kv_transfer_mode)
        return any(kinds_pair(pk, dk) for dk in decodes)

    async def early_decode(self, body, prefill=None):
        if not self._config.early_decode_leg or body.get("n") not in (None, 1):
            return None
        pool = self._decode
        others = [inst for inst in pool.instances if not inst.params_later
                  or (prefill is not None and not self.pairs(prefill, inst))]
        if len(others) == len(pool):
            return None
        return await self._choose(pool, others, wait=False, first=not others)


def _world(pool_cls, n_p: int, n_d: int, override: str | None):
    p, d = pool_cls("prefill"), pool_cls("decode")
    for i in range(n_p):
        p.add(f"http://p{i}:1")
    for i in range(n_d):
        d.add(f"http://d{i}:1")
    cfg = ProxyConfig(kv_transfer_mode=override)
    chooser_cls = ScanChooser if pool_cls is ScanPool else PairChooser
    return p, d, chooser_cls(cfg, p, d, ProxyMetrics(lambda: [p, d]), Readiness(), lambda: None, None)


def _mirror(worlds, j: int, op: str, value) -> None:
    """The same change to instance j (prefill instances first, then decode) of every world."""
    for p, d, _ in worlds:
        inst = (p.instances + d.instances)[j]
        if op in ("acquire", "release"):
            getattr(inst, op)(value)
        else:
            setattr(inst, op, value)


def _url(inst: Instance | None) -> str | None:
    return None if inst is None else inst.url


def _run(coro):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def test_load_index_equals_the_scan_on_random_loads() -> None:
    """LoadIndex.least(start) is LoadBalancer._least's choice over all members, for random loads with many
    ties (small values), after every change."""

    class M:
        def __init__(self, url: str) -> None:
            self.url, self.in_flight, self.outstanding_tokens = url, 0, 0

    rng = random.Random(1)
    for trial in range(60):
        members = [M(f"m{i}") for i in range(rng.randrange(1, 30))]
        index = LoadIndex(members)
        scan = LoadBalancer()
        for _ in range(200):
            m = rng.choice(members)
            m.in_flight = rng.randrange(0, 3)
            m.outstanding_tokens = rng.choice([0, 0, 5, 7, rng.randrange(100)])
            index.changed(m)
            start = rng.randrange(len(members))
            scan._rotation = start
            expected = scan._least(members, lambda x: (x.in_flight, x.outstanding_tokens))
            assert index.least(start) is expected, trial


def test_pool_and_pair_choices_equal_the_scan() -> None:
    rng = random.Random(7)
    checked = indexed = 0
    for trial in range(150):
        n_p, n_d = rng.randrange(0, 6), rng.randrange(0, 8)
        override = rng.choice([None, None, "push", "pull"])
        worlds = [_world(ScanPool, n_p, n_d, override), _world(Pool, n_p, n_d, override)]
        uniform = rng.random() < 0.5  # often one kind everywhere: the fast paths

        for step in range(60):
            total = n_p + n_d
            if total:
                j = rng.randrange(total)
                r = rng.random()
                if r < 0.35:
                    _mirror(worlds, j, "acquire", rng.choice([0, 10, 10, 100, rng.randrange(1000)]))
                elif r < 0.5:
                    _mirror(worlds, j, "release", rng.choice([0, 10, 100]))
                elif r < 0.6:
                    _mirror(worlds, j, "in_flight", rng.randrange(3))
                elif r < 0.8 or step == 0:
                    for field, choices in (("healthy", [True, True, True, False]),
                                           ("transfer_mode", [None, "push", "pull"]),
                                           ("pdserve", [None, True, False]),
                                           ("params_later", [None, True, False])):
                        for k in (range(total) if step == 0 else [j]):  # every instance gets a state first
                            value = choices[0] if uniform and field != "healthy" else rng.choice(choices)
                            _mirror(worlds, k, field, value)
                elif r < 0.85:
                    _mirror(worlds, j, "backoff_until", time.monotonic() + (30.0 if rng.random() < 0.5 else -1.0))
            # the same questions of both worlds
            what = rng.randrange(5)
            answers = []
            for p, d, chooser in worlds:
                tried_p = [p.instances[k] for k in range(n_p) if rng_bits(trial, step, k)]
                like = p.instances[0] if n_p and step % 3 == 0 else None
                pair_with = p.instances[step % n_p] if n_p and step % 2 == 0 else None
                if what == 0:
                    answers.append(_url(_run(chooser.prefill(tried_p, wait=False, like=like))))
                elif what == 1:
                    answers.append(_url(_run(chooser.decode(wait=False, pair_with=pair_with))))
                elif what == 2:
                    answers.append(_url(_run(chooser.early_decode({"n": 1}, pair_with))))
                elif what == 3:
                    answers.append(chooser.mismatch() is None)
                else:
                    answers.append(_url(d.choose(retry=step % 4 == 0)))
            assert answers[0] == answers[1], (trial, step, what, answers)
            checked += 1
            indexed += worlds[1][1].all_available(time.monotonic())
    assert checked == 150 * 60 and indexed > 1000  # the index path was taken often


def rng_bits(trial: int, step: int, k: int) -> bool:
    """A deterministic subset of instances a retry already tried (the same in both worlds)."""
    return (trial * 31 + step * 7 + k * 3) % 11 == 0
