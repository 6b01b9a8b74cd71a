"""The one place the proxy chooses instances: the prefill and the decode instance of every P/D pair, and every
other leg's instance (a request served whole by a decode or a prefill instance, a pass-through route, a peer asked
to pin a prefix).

Every path asks this module: the pull pair's prefill leg and its retries (legs.run_prefill), the decode leg and its
retries (legs.send_decode), the early decode leg (pull_pair.py), the push pair (push_pair.py), the peer a prefill
reads a cached prefix from (peer_pull.py), the pass-through routes (app.passthrough). What it weighs:

- who is available: admitted by the health checker, not ejected, not in an upstream-requested back-off, not already
  tried by this request (a retry's re-choice); with `wait`, a bounded wait (--instance-wait-timeout) for one to be
  admitted instead of an immediate 503;
- the policy among them (pdserve/routing/choice.py, shared with the render tier): least loaded, ties rotated once per
  request; the cheapest by cached prefix when an instance of the pool publishes KV events (kv_routing.py, the fleet
  index); else --prefix-affinity's rendezvous hashing;
- what the leg needs of its instance: an early decode leg goes only to a decode instance that takes its params later;
  a peer to pull from must pin on demand, as must the prefill that reads from it;
- the transfer mode (instance_info.py): a pair is push with push or pull with pull, as each instance's /pdserve/info
  or vLLM's `transfer_mode` param says (or `--kv-transfer-mode`, which overrides them). A prefill instance no decode
  instance pairs with is never chosen; a fleet where no pair is possible gets an error that names the mismatch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.api.pd import PUSH
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.instance_info import Kind, describe, kind, kinds_pair, mode_of, pairs
from pdserve.proxy.kv_fleet import KVFleet
from pdserve.proxy.kv_routing import UNKNOWN, CachedPrefix
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.pool import Instance, Pool, RawKind
from pdserve.proxy.readiness import Readiness


class PairChooser:
    """Chooses every leg's instance from the proxy's two pools (held by ProxyState as `pairing`)."""

    def __init__(self, config: ProxyConfig, prefill: Pool, decode: Pool, metrics: ProxyMetrics,
                 readiness: Readiness, nudge: Callable[[], None], fleet: KVFleet | None) -> None:
        self._config = config
        self._prefill = prefill
        self._decode = decode
        self._metrics = metrics
        self._readiness = readiness
        self._nudge = nudge
        self._fleet = fleet

    async def prefill(self, tried: Sequence[Instance] = (), *, wait: bool, affinity: str | None = None,
                      prefix: CachedPrefix | None = None, like: Instance | None = None) -> Instance | None:
        """The prefill instance of a pair (`tried`: the instances this request's earlier attempts used), one that
        some decode instance pairs with (and, given `like`, of its transfer mode: a retry stays in its mode). It
        computes the prompt, so a first attempt's choice counts in the routing hit rate."""
        exclude = [*tried, *self._unpairable(like)]
        return await self._choose(self._prefill, exclude, wait=wait, affinity=affinity, prefix=prefix, record=True,
                                  first=not tried)

    async def decode(self, tried: Sequence[Instance] = (), *, wait: bool, prefix: CachedPrefix | None = None,
                     computes_prompt: bool = False, role: str = "decode",
                     pair_with: Instance | None = None) -> Instance | None:
        """The instance of a decode leg (or, `role` "prefill", of a request served whole by a prefill instance).
        `computes_prompt`: not a P/D decode leg, the instance computes the prompt itself (its choice counts in the
        routing hit rate). `pair_with`: the leg loads that prefill instance's KV, so only a decode instance that
        pairs with it is chosen."""
        pool = {"decode": self._decode, "prefill": self._prefill}[role]
        exclude = list(tried)
        if pair_with is not None:
            pk = kind(pair_with, self._config.kv_transfer_mode)
            exclude += self._of_kinds(pool, lambda raw: not kinds_pair(pk, self._kind(raw)))
        return await self._choose(pool, exclude, wait=wait, prefix=prefix, record=computes_prompt, first=not tried)

    # ---- transfer modes ------------------------------------------------------------------------------------

    def mode(self, inst: Instance) -> str | None:
        """The instance's transfer mode: --kv-transfer-mode when given, else what was learnt (None: unknown)."""
        return mode_of(inst, self._config.kv_transfer_mode)

    def pairs(self, prefill: Instance, decode: Instance) -> bool:
        return pairs(prefill, decode, self._config.kv_transfer_mode)

    def concurrent_push(self, prefill: Instance) -> bool:
        """Whether a pair with this prefill instance runs as pdserve's push pair (both legs at once, one push
        key: push_pair.py): a pdserve instance in push mode. vLLM's push instances get the legs one after the
        other, the decode's naming the prefill's coordinates from its answer, as vLLM's own push router sends
        them (vllm tests/v1/kv_connector/nixl_integration/toy_push_proxy_server.py)."""
        return self.mode(prefill) == PUSH and prefill.pdserve is not False

    def mismatch(self) -> str | None:
        """Why no P/D pair can be formed (every admitted prefill instance has a transfer mode no decode instance
        pairs with), or None."""
        decodes = self._decode_kinds()
        healthy_kinds = [raw for raw in self._prefill.kinds() if raw[3]]
        if not healthy_kinds or not decodes or any(self._pairs_any(self._kind(raw), decodes)
                                                   for raw in healthy_kinds):
            return None
        healthy = [p for p in self._prefill.instances if p.healthy]
        override = self._config.kv_transfer_mode
        return (f"no decode instance pairs with a prefill instance: a pair needs one transfer mode (push: "
                f"kv_connector NixlPushConnector, pull: NixlConnector) and, for push, two pdserve or two vLLM "
                f"instances; prefill {describe(healthy, override)}; decode "
                f"{describe(list(self._decode.instances), override)}")

    def _unpairable(self, like: Instance | None) -> list[Instance]:
        """Prefill instances not to choose: those no decode instance pairs with, and (given `like`) those of
        another transfer mode than `like`'s."""
        decodes = self._decode_kinds()
        want = self.mode(like) if like is not None else None

        def unwanted(raw: RawKind) -> bool:
            pk = self._kind(raw)
            other_mode = want is not None and pk[0] not in (None, want)
            return bool(decodes and not self._pairs_any(pk, decodes)) or other_mode

        return self._of_kinds(self._prefill, unwanted)

    def _kind(self, raw: RawKind) -> Kind:
        """The pairing kind of instances of this raw kind (pool.py's summary), under --kv-transfer-mode."""
        override = self._config.kv_transfer_mode
        return (override if override is not None else raw[0], raw[1])

    def _decode_kinds(self) -> set[Kind]:
        """The kinds of the decode instances (a handful, however many instances): pairing checks against these."""
        return {self._kind(raw) for raw in self._decode.kinds()}

    @staticmethod
    def _pairs_any(pk: Kind, decodes: set[Kind]) -> bool:
        return any(kinds_pair(pk, dk) for dk in decodes)

    @staticmethod
    def _of_kinds(pool: Pool, test: Callable[[RawKind], bool]) -> list[Instance]:
        """The instances of `pool` (in pool order) whose raw kind passes `test`: asked of the pool's few kinds
        first, so that a fleet where none does costs no scan of its instances."""
        hit = {raw for raw in pool.kinds() if test(raw)}
        return [inst for inst in pool.instances if inst.raw_kind in hit] if hit else []

    async def early_decode(self, body: dict[str, Any], prefill: Instance | None = None) -> Instance | None:
        """The decode instance to send the decode leg to together with the prefill leg: one available now that takes
        its params later (a pdserve one) and pairs with `prefill`, for a request of one plain choice; else None (the
        ordinary order: the decode leg once the prefill answered)."""
        if not self._config.early_decode_leg or body.get("n") not in (None, 1):
            return None
        pool = self._decode
        pk = kind(prefill, self._config.kv_transfer_mode) if prefill is not None else None
        others = self._of_kinds(pool, lambda raw: not raw[2] or (pk is not None and not kinds_pair(pk, self._kind(raw))))
        if len(others) == len(pool):
            return None  # no choice made (choosing rotates ties: the ordinary leg's choice must be the one)
        return await self._choose(pool, others, wait=False, first=not others)

    def peer(self, chosen: Instance, prefix: CachedPrefix) -> Instance | None:
        """The healthy pinning instance (prefill or decode), other than `chosen`, caching the most of the prompt,
        when that is at least --kv-peer-pull-min-tokens more than `chosen` caches (and `chosen` can read it: it
        pins too); the prefill leg then reads that prefix from it (peer_pull.py)."""
        fleet = self._fleet
        if fleet is None or not prefix.token_ids or not fleet.pins(chosen.url):
            return None
        peers = [inst for pool in (self._prefill, self._decode) for inst in pool.instances
                 if inst.url != chosen.url and inst.healthy and fleet.pins(inst.url)]
        best = max(peers, key=prefix.cached_tokens, default=None)
        if best is None:
            return None
        gain = prefix.cached_tokens(best) - prefix.cached_tokens(chosen)
        return best if gain >= max(self._config.kv_peer_pull_min_tokens, 1) else None

    async def _choose(self, pool: Pool, exclude: Sequence[Instance], *, wait: bool, affinity: str | None = None,
                      prefix: CachedPrefix | None = None, record: bool = False, first: bool = True
                      ) -> Instance | None:
        """An available instance of `pool`; with `wait`, up to --instance-wait-timeout for one to be admitted.

        Routing by cached prefix (`prefix`) applies when an instance of the pool publishes KV events; otherwise
        `affinity` (--prefix-affinity), else the least loaded. `record`: this leg computes the prompt, so its choice
        counts in the routing hit rate (first attempts only)."""
        cfg = self._config
        fleet = self._fleet
        routed = fleet is not None and fleet.any_publishing(pool.instances)
        cost = prefix.cost if prefix is not None and routed else None
        inst = await self._when_ready(pool, cfg.instance_wait_timeout if wait else 0.0, list(exclude),
                                      affinity=affinity, affinity_slack=cfg.prefix_affinity_slack, cost=cost,
                                      retry=not first)
        if record and routed and inst is not None and first:
            if prefix is None:
                self._metrics.kv_routed(UNKNOWN, 0, 0)
            else:
                outcome = prefix.outcome(inst, pool.instances, cfg.kv_hit_fraction)
                self._metrics.kv_routed(outcome, prefix.prompt_tokens, prefix.cached_tokens(inst))
        return inst

    async def _when_ready(self, pool: Pool, wait_s: float, exclude: list[Instance], *, affinity: str | None,
                          affinity_slack: int, cost: Callable[[Instance], float] | None,
                          retry: bool) -> Instance | None:
        """`pool.choose(...)`, waiting up to `wait_s` seconds for an instance to become available (readiness.py:
        the health checker is asked for a probe round now, and wakes the waiters when it admits one)."""
        inst = pool.choose(exclude, affinity=affinity, affinity_slack=affinity_slack, cost=cost, retry=retry)
        if inst is not None or wait_s <= 0 or len(pool) == 0:
            return inst
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            self._nudge()
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            backoff = pool.backoff_left()
            await self._readiness.wait(min(remaining, backoff + 0.01) if backoff is not None else remaining)
            inst = pool.choose(exclude, affinity=affinity, affinity_slack=affinity_slack, cost=cost, retry=retry)
            if inst is not None:
                return inst
