"""Instance pools: membership, load accounting, health state and the choice of an instance."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from yarl import URL

from pdserve.api.pd import PARAMS_LATER, TRANSFER_MODE
from pdserve.routing.choice import LoadBalancer, LoadIndex

logger = logging.getLogger("pdserve.proxy")

ROLES = ("prefill", "decode")
# What a pool keeps indexes of (Pool._changed): the load the choice weighs, and what makes an instance
# available or pairable. An instance tells its pool whenever one of these is set, however it is set.
_LOAD_FIELDS = frozenset({"in_flight", "outstanding_tokens"})
# (the instance's attributes named after the kv_transfer_params fields they learn: spelled by pdserve.api.pd)
_STATE_FIELDS = frozenset({"healthy", "backoff_until", TRANSFER_MODE, "pdserve", PARAMS_LATER})
_WATCHED = _LOAD_FIELDS | _STATE_FIELDS

# (transfer_mode, pdserve, params_later, healthy): all that pairing and availability read of an instance
RawKind = tuple[str | None, bool | None, bool | None, bool]


def normalize_url(url: str) -> str:
    """`host:port`, `http://host:port`, `http://host:port/v1/` -> `http://host:port` (scheme://authority)."""
    text = url.strip()
    if not text:
        raise ValueError("empty instance URL")
    if "://" not in text:
        text = "http://" + text
    parsed = URL(text)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"bad instance URL {url!r}: expected http://host:port or host:port")
    if parsed.path not in ("", "/", "/v1", "/v1/"):
        raise ValueError(f"bad instance URL {url!r}: give the server root, not a path")
    if parsed.explicit_port is None:
        raise ValueError(f"bad instance URL {url!r}: the port is required")
    host = f"[{parsed.host}]" if ":" in parsed.host else parsed.host
    return f"{parsed.scheme}://{host}:{parsed.explicit_port}"


@dataclass(eq=False)
class Instance:
    """One prefill or decode server and what the proxy knows of it.

    `healthy` starts False: an instance is admitted only by a successful `/health` probe (or a request
    that succeeded), so a proxy started before its instances listen sends them nothing. `backoff_until`
    (monotonic seconds) is set from an upstream `Retry-After`: until then the instance is passed over.
    """

    url: str
    role: str
    healthy: bool = False
    in_flight: int = 0
    outstanding_tokens: int = 0
    consecutive_failures: int = 0
    requests_total: int = 0
    failures_total: int = 0
    ejections_total: int = 0
    last_error: str | None = None
    ever_healthy: bool = False
    backoff_until: float = 0.0
    # A decode instance that takes its leg before the prefill's params (/pdserve/info `kv_params_later`: a
    # pdserve decode instance); None until its info was read (after each admission), False for vLLM's.
    params_later: bool | None = None
    # push mode: a prefill instance's side channel from its /pdserve/info (proxy/push_pair.py); None: unread
    push_info: dict[str, Any] | None = None
    # a prefill instance's measured prefill cost from its /pdserve/info, for the multi-turn
    # pull-or-recompute choice (history_decision.RecomputeInfo); None until read (after each admission)
    recompute: Any = None
    # What the instance is (instance_info.py): a pdserve instance (it has /pdserve/info), and its KV transfer
    # mode, "push" or "pull": from /pdserve/info `kv_transfer_mode`, or for vLLM's instances the `transfer_mode`
    # their prefill answers carry (vllm-project/vllm#50620); None while unknown.
    pdserve: bool | None = None
    transfer_mode: str | None = None
    host: str = field(init=False)
    _endpoints: dict[str, URL] = field(init=False, default_factory=dict, repr=False)
    # Relays reading a response from this instance: told when it is ejected, so that a peer that stopped
    # answering (a cut link, a frozen host) ends its streams with an error instead of holding them until the
    # read timeout.
    _eject_watchers: set[Callable[[str], None]] = field(init=False, default_factory=set, repr=False)
    # the pool that indexes this instance (told of every change to a _WATCHED field); None outside one
    _pool: Pool | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.host = URL(self.url).host or ""
        self.ever_healthy = self.healthy

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _WATCHED:
            pool = self.__dict__.get("_pool")
            if pool is not None:
                pool._changed(self, name)

    @property
    def raw_kind(self) -> RawKind:
        return (self.transfer_mode, self.pdserve, self.params_later, self.healthy)

    def available(self, now: float) -> bool:
        """Admitted and not in an upstream-requested back-off."""
        return self.healthy and now >= self.backoff_until

    def back_off(self, seconds: float) -> None:
        """The instance asked (Retry-After) not to be sent work for `seconds`."""
        self.backoff_until = max(self.backoff_until, time.monotonic() + seconds)
        logger.warning("%s instance %s asked to back off for %.1fs", self.role, self.url, seconds)

    @property
    def state(self) -> str:
        if not self.healthy:
            return "ejected" if self.ever_healthy else "starting"
        return "backoff" if time.monotonic() < self.backoff_until else "healthy"

    def endpoint(self, path: str) -> URL:
        """The URL of `path` on this instance, parsed once (yarl parsing is a visible cost per leg)."""
        url = self._endpoints.get(path)
        if url is None:
            url = self._endpoints[path] = URL(self.url + path)
        return url

    def acquire(self, tokens: int) -> None:
        self.in_flight += 1
        self.outstanding_tokens += tokens
        self.requests_total += 1

    def release(self, tokens: int) -> None:
        self.in_flight -= 1
        self.outstanding_tokens -= tokens

    def record_success(self) -> bool:
        """A request or probe succeeded; returns True when this re-admits an ejected instance."""
        self.consecutive_failures = 0
        if self.healthy:
            return False
        self.healthy = True
        if self.ever_healthy:
            logger.warning("%s instance %s re-admitted", self.role, self.url)
        else:
            logger.info("%s instance %s admitted (first successful probe)", self.role, self.url)
        self.ever_healthy = True
        return True

    def record_failure(self, reason: str, eject_after: int) -> bool:
        """A request or probe failed; returns True when this ejects the instance."""
        self.consecutive_failures += 1
        self.failures_total += 1
        self.last_error = reason
        if self.healthy and self.consecutive_failures >= eject_after:
            self.healthy = False
            self.ejections_total += 1
            logger.warning(
                "%s instance %s ejected after %d consecutive failures (last: %s)",
                self.role,
                self.url,
                self.consecutive_failures,
                reason,
            )
            for watcher in list(self._eject_watchers):
                watcher(f"instance ejected after {self.consecutive_failures} consecutive failures (last: {reason})")
            return True
        return False

    def watch_ejection(self, watcher: Callable[[str], None]) -> Callable[[], None]:
        """Calls `watcher(reason)` if this instance is ejected; returns the function that stops watching."""
        self._eject_watchers.add(watcher)
        return lambda: self._eject_watchers.discard(watcher)

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "state": self.state,
            "in_flight": self.in_flight,
            "outstanding_tokens": self.outstanding_tokens,
            "consecutive_failures": self.consecutive_failures,
            "requests_total": self.requests_total,
            "failures_total": self.failures_total,
            "ejections_total": self.ejections_total,
            "last_error": self.last_error,
            # what the proxy learnt (instance_info.py): its KV transfer mode and engine (None: not known yet)
            "kv_transfer_mode": self.transfer_mode,
            "engine": None if self.pdserve is None else ("pdserve" if self.pdserve else "other"),
        }


class Pool:
    """The instances of one role, and the choice among its available ones (pdserve/routing/choice.py: least
    loaded, ties rotated; or the least `cost`; or prefix affinity by rendezvous hashing)."""

    def __init__(self, role: str, urls: Iterable[str] = (), *, healthy: bool = False) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        self.role = role
        self._instances: list[Instance] = []
        self._balancer = LoadBalancer()
        # indexes kept as instances change (Instance.__setattr__ -> _changed): the instances by load, for the
        # least-loaded choice without a scan, and a summary of their kinds and availability (a handful of
        # distinct values however many instances), which lets the pair chooser skip its scans when every
        # instance pairs alike (proxy/pairing.py)
        self._index: LoadIndex[Instance] = LoadIndex([])
        self._state_dirty = True
        self._kinds: dict[RawKind, int] = {}
        self._latest_backoff = 0.0
        for url in urls:
            self.add(url, healthy=healthy)

    def _changed(self, inst: Instance, name: str) -> None:
        if name in _LOAD_FIELDS:
            self._index.changed(inst)
        else:
            self._state_dirty = True

    def _reindex(self) -> None:
        """After membership changed: a new load index (positions moved) and a new summary."""
        self._index = LoadIndex(self._instances)
        self._state_dirty = True

    def _summary(self) -> None:
        if not self._state_dirty:
            return
        kinds: dict[RawKind, int] = {}
        for inst in self._instances:
            k = inst.raw_kind
            kinds[k] = kinds.get(k, 0) + 1
        self._kinds = kinds
        self._latest_backoff = max((inst.backoff_until for inst in self._instances), default=0.0)
        self._state_dirty = False

    def kinds(self) -> dict[RawKind, int]:
        """How many instances of each (transfer_mode, pdserve, params_later, healthy) the pool has."""
        self._summary()
        return self._kinds

    def all_available(self, now: float) -> bool:
        """Every instance is admitted and none is backing off at `now` (monotonic seconds)."""
        self._summary()
        return now >= self._latest_backoff and all(k[3] for k in self._kinds)

    @property
    def instances(self) -> list[Instance]:
        return list(self._instances)

    def __len__(self) -> int:
        return len(self._instances)

    def healthy_count(self) -> int:
        return sum(1 for inst in self._instances if inst.healthy)

    def backoff_left(self) -> float | None:
        """Seconds until the first admitted instance in back-off is available again; None if none is."""
        now = time.monotonic()
        waits = [inst.backoff_until - now for inst in self._instances if inst.healthy and inst.backoff_until > now]
        return min(waits) if waits else None

    def get(self, url: str) -> Instance | None:
        url = normalize_url(url)
        return next((inst for inst in self._instances if inst.url == url), None)

    def add(self, url: str, *, healthy: bool = False) -> Instance:
        url = normalize_url(url)
        if self.get(url) is not None:
            raise ValueError(f"{self.role} instance {url} is already registered")
        return self.adopt(Instance(url=url, role=self.role, healthy=healthy))

    def adopt(self, inst: Instance) -> Instance:
        """`inst` (built by the caller, e.g. with what its /pdserve/info taught) joins the pool."""
        if inst._pool is not None or self.get(inst.url) is not None:
            raise ValueError(f"{self.role} instance {inst.url} is already registered")
        self._instances.append(inst)
        inst._pool = self
        self._reindex()
        return inst

    def remove(self, url: str) -> Instance | None:
        inst = self.get(url)
        if inst is not None:
            self._instances.remove(inst)
            inst._pool = None
            self._reindex()
        return inst

    def choose(
        self,
        exclude: Iterable[Instance] = (),
        *,
        affinity: str | None = None,
        affinity_slack: int = 0,
        cost: Callable[[Instance], float] | None = None,
        retry: bool | None = None,
    ) -> Instance | None:
        """The instance for the next leg, or None when no instance outside `exclude` is available
        (admitted and not backing off). Callers wait for one (bounded) or answer 503: sending work to
        an instance that failed its probes only turns a clean 503 into a slow 502. The policy among the
        available ones is pdserve/routing/choice.py's (`retry`, by default `exclude` non-empty: a retry of the same
        request)."""
        excluded = set(exclude)
        now = time.monotonic()
        retrying = bool(excluded) if retry is None else retry
        if not excluded and cost is None and affinity is None and self.all_available(now):
            # every instance is a candidate: the load index gives the scan's choice without the scan
            return self._balancer.choose_indexed(self._index, retry=retrying)
        candidates = [inst for inst in self._instances if inst.available(now) and inst not in excluded]
        return self._balancer.choose(candidates, retry=retrying, affinity=affinity, affinity_slack=affinity_slack,
                                     cost=cost)
