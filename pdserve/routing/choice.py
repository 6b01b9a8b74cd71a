"""Which of several available instances takes the next leg: least loaded (legs in flight, then outstanding tokens),
ties rotated once per request; or the least `cost` (routing by cached prefix, pdserve/proxy/kv_routing.py); or prefix
affinity by rendezvous hashing. Who is available (health, back-off, the instances a retry already tried) is the
caller's to say: the candidates are given.

`LoadIndex` gives the same least-loaded choice among all members of a fixed list without scanning them: a pool
of hundreds of instances (a simulated 1,000-GPU fleet, pdserve/sim) would otherwise pay a scan per leg."""

from __future__ import annotations

import hashlib
import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar


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

    def choose_indexed(self, index: LoadIndex[L], *, retry: bool = False) -> L | None:
        """`choose(index.members, retry=retry)` (least loaded, no cost, no affinity) from the index: the same
        instance, and the same rotation after it."""
        n = len(index)
        if n == 0:
            return None
        best = index.least(self._rotation % n)
        if not retry:
            self._rotation += 1
        return best

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


class LoadIndex(Generic[L]):
    """The members of a fixed ordered list grouped by load (in_flight, outstanding_tokens), so that the least
    loaded one, ties broken by the rotation (`LoadBalancer._least`: the first at or after position `start`,
    wrapping), is found in O(log n) instead of a scan. The owner calls `changed(member)` whenever a member's
    load may have changed; groups are brought up to date at the next `least` (a leg's acquire and release cost
    a set insertion each)."""

    def __init__(self, members: Sequence[L]) -> None:
        self.members = list(members)
        self._pos = {id(m): i for i, m in enumerate(self.members)}
        self._key: list[tuple[int, int]] = []
        self._groups: dict[tuple[int, int], list[int]] = {}  # load -> positions holding it, ascending
        for i, m in enumerate(self.members):
            key = (m.in_flight, m.outstanding_tokens)
            self._key.append(key)
            self._groups.setdefault(key, []).append(i)
        self._heap = list(self._groups)  # the loads with a group (and stale ones, dropped when met)
        heapq.heapify(self._heap)
        self._dirty: set[int] = set()

    def __len__(self) -> int:
        return len(self.members)

    def changed(self, member: L) -> None:
        self._dirty.add(self._pos[id(member)])

    def _flush(self) -> None:
        groups, keys, members = self._groups, self._key, self.members
        for i in self._dirty:
            m = members[i]
            new = (m.in_flight, m.outstanding_tokens)
            old = keys[i]
            if new == old:
                continue
            group = groups[old]
            del group[bisect_left(group, i)]
            if not group:
                del groups[old]
            keys[i] = new
            group = groups.get(new)
            if group is None:
                groups[new] = [i]
                heapq.heappush(self._heap, new)
            else:
                insort(group, i)
        self._dirty.clear()
        if len(self._heap) > 2 * len(groups) + 64:  # stale loads kept a while: rebuild, amortised O(1)
            self._heap = list(groups)
            heapq.heapify(self._heap)

    def least(self, start: int) -> L:
        """The member the scan from `start` would choose: the least load, then the first position at or after
        `start` (wrapping)."""
        if self._dirty:
            self._flush()
        heap, groups = self._heap, self._groups
        while heap[0] not in groups:
            heapq.heappop(heap)
        group = groups[heap[0]]
        j = bisect_left(group, start)
        return self.members[group[j] if j < len(group) else group[0]]
