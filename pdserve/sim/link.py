"""KV READs on shared links: each instance has one link (its NIC, or on one host its copy engine) of the
profile's measured rate; the READs in flight through a link share it equally, and a READ moves at the smaller
of its two ends' shares (the producer's link and the consumer's). Rates are recomputed whenever a READ starts
or ends, so a burst of handoffs to one decode instance slows each of them, as on the wire."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class Read:
    src: str
    dst: str
    remaining: float  # bytes
    on_done: Callable[[float], None]
    rate: float = 0.0
    version: int = 0


class Links:
    def __init__(self, rate_of: Callable[[str], float],
                 schedule: Callable[[float, Callable[[float], None]], None]) -> None:
        self._rate_of = rate_of  # instance name -> its link's bytes/s
        self._schedule = schedule  # (at time, callback): the event loop's
        self._active: list[Read] = []
        self._t = 0.0
        self.bytes_moved = 0.0

    def start(self, now: float, src: str, dst: str, nbytes: float, on_done: Callable[[float], None]) -> None:
        self._advance(now)
        self._active.append(Read(src, dst, float(nbytes), on_done))
        self._reschedule(now)

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def _advance(self, now: float) -> None:
        dt = now - self._t
        if dt > 0:
            for r in self._active:
                moved = min(r.remaining, r.rate * dt)
                r.remaining -= moved
                self.bytes_moved += moved
        self._t = now

    def _reschedule(self, now: float) -> None:
        count: dict[str, int] = {}
        for r in self._active:
            count[r.src] = count.get(r.src, 0) + 1
            count[r.dst] = count.get(r.dst, 0) + 1
        for r in self._active:
            r.rate = min(self._rate_of(r.src) / count[r.src], self._rate_of(r.dst) / count[r.dst])
            r.version += 1
            eta = now + (r.remaining / r.rate if r.rate > 0 else 0.0)
            self._schedule(eta, self._finisher(r, r.version))

    def _finisher(self, r: Read, version: int) -> Callable[[float], None]:
        def done_at(now: float) -> None:
            if r.version != version or r not in self._active:
                return  # rescheduled since: a later event finishes it
            self._advance(now)
            self._active.remove(r)
            self._reschedule(now)
            r.on_done(now)

        return done_at
