"""Which of several available instances takes the next leg: least loaded (legs in flight, then outstanding tokens),
ties rotated once per request; or the least `cost` (routing by cached prefix, pdserve/proxy/kv_routing.py); or prefix
affinity by rendezvous hashing. Who is available (health, back-off, the instances a retry already tried) is the
caller's to say: the candidates are given."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


class Loaded(Protocol):
    """What the policy reads of an instance."""

    url: str
    in_flight: int
    outstanding_tokens: int


L = TypeVar("L", bound=Loaded)


def _rendezvous_score(key_digest: bytes, url: str) -> bytes:
    return hashlib.blake2b(key_digest + url.encode(), digest_size=8).digest()


class LoadBalancer:
    """The choice among candidates, with the rotation that spreads ties across requests."""

    def __init__(self) -> None:
        self._rotation = 0

    def choose(
        self,
        candidates: Sequence[L],
        *,
        retry: bool = False,
        affinity: str | None = None,
        affinity_slack: int = 0,
        cost: Callable[[L], float] | None = None,
    ) -> L | None:
        """The candidate for the next leg (None when there is none). With `cost`, the cheapest (then the fewest
        legs in flight); else the least loaded, or, with `affinity`, the instance its key hashes to while that is
        at most `affinity_slack` legs busier than the least loaded. `retry`: a further attempt of one request,
        which does not advance the rotation (ties rotate once per request, not once per retry)."""
        if not candidates:
            return None
        if cost is not None:
            best = self._least(candidates, lambda inst: (cost(inst), inst.in_flight))
        else:
            best = self._least(candidates, lambda inst: (inst.in_flight, inst.outstanding_tokens))
        if not retry:
            self._rotation += 1
        if cost is not None or affinity is None or len(candidates) == 1:
            return best
        digest = hashlib.blake2b(affinity.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        target = max(candidates, key=lambda inst: _rendezvous_score(digest, inst.url))
        return target if target.in_flight - best.in_flight <= affinity_slack else best

    def _least(self, candidates: Sequence[L], key: Callable[[L], tuple[float, int]]) -> L:
        n = len(candidates)
        start = self._rotation % n
        best = candidates[start]
        best_key = key(best)
        for i in range(1, n):
            inst = candidates[(start + i) % n]
            inst_key = key(inst)
            if inst_key < best_key:
                best, best_key = inst, inst_key
        return best
