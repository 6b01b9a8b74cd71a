"""Producer-side lease table: which finished prefill requests still hold KV blocks, and until when.

Life of a lease:

    hold ──▶ HELD ──claim──▶ CLAIMED ──release──▶ freed (held_throughout=True)
               │  ▲ heartbeat      │
               │  └────────────────┘ (heartbeats only matter while HELD)
               ├──abort──▶ freed (consumer gave up before reading)
               ├──evict──▶ freed, remembered as expired (the engine needed the blocks: history leases)
               └──expiry──▶ freed, counted        CLAIMED ──claim deadline──▶ freed, counted

"Freed" means the request id is queued for the engine (`poll_released`), which then frees the blocks.
Blocks are only ever freed through this table, so a release that finds its lease still CLAIMED proves the
blocks were untouched for the whole read: that is the `held_throughout` answer the consumer relies on.

Every lease has a random token, handed out once by `hold` (it travels in the prefill response's
`kv_transfer_params` as `remote_lease_token`). Claim, release, abort and heartbeat act on a lease only with
its token: knowing a request id is not enough to claim, free or pin someone else's KV (`bad_token`).

Two kinds of lease share the table: a prefill leg's blocks for its decode instance (`kv_lease_duration`,
extended by the consumer's heartbeats) and a decode instance's conversation history for the next turn's
prefill (`decoder_kv_blocks_ttl`, vLLM's name: the next turn is the client's, so nobody heartbeats it until
a prefill queues to read it). Each lease carries its own duration.
"""

from __future__ import annotations

import enum
import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

logger = logging.getLogger("pdserve.kv_transfer")

# How many recently expired request ids are remembered to tell "expired" from "unknown" and to count late
# claims/releases/notifications once per request.
_EXPIRED_MEMORY = 10_000


class LeaseState(enum.Enum):
    HELD = "held"
    CLAIMED = "claimed"


class ClaimRefused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


LEASE_TOKEN_BYTES = 24


@dataclass
class Lease:
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: float
    token: str
    duration_s: float = 0.0  # what a heartbeat extends by (2/3 of it)
    history: bool = False  # a decode instance's conversation history (not a prefill leg's blocks)
    state: LeaseState = LeaseState.HELD
    claim_token: str | None = None
    claim_deadline: float | None = None
    read_notified: bool = False


class LeaseTable:
    """Thread-safe: the engine thread holds/polls, the side-channel and progress threads do the rest."""

    def __init__(
        self,
        duration_s: float,
        *,
        claim_margin_s: float = 1.0,
        max_claim_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        on_expired: Callable[[str], None] | None = None,
        on_late: Callable[[str], None] | None = None,
        on_history_end: Callable[[str], None] | None = None,
    ) -> None:
        """on_expired: a prefill leg's lease expired; on_history_end(outcome): a history lease ended
        (pulled, aborted, evicted or expired); on_late: something arrived for an expired lease."""
        if duration_s <= 0:
            raise ValueError("lease duration must be > 0")
        self.duration_s = duration_s
        self._claim_margin_s = claim_margin_s
        self._max_claim_timeout_s = max_claim_timeout_s
        self._clock = clock
        self._on_expired = on_expired
        self._on_late = on_late
        self._on_history_end = on_history_end
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        # request id -> [its lease token, whether a late event was already counted for it].
        self._expired: OrderedDict[str, list] = OrderedDict()
        self._released: list[str] = []
        self._num_claimed = 0
        self.num_expired = 0
        self.num_after_expiry = 0

    # ---- engine side -------------------------------------------------------------------------------

    def hold(self, request_id: str, block_ids: Sequence[int], num_tokens: int, *,
             duration_s: float | None = None, history: bool = False) -> str:
        """Start a lease (of the table's duration unless `duration_s`); returns its token (only the request's
        own response carries it)."""
        duration = self.duration_s if duration_s is None else float(duration_s)
        if duration <= 0:
            raise ValueError("lease duration must be > 0")
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a KV lease")
            token = secrets.token_urlsafe(LEASE_TOKEN_BYTES)
            self._leases[request_id] = Lease(
                request_id, tuple(int(b) for b in block_ids), num_tokens, self._clock() + duration, token,
                duration, history,
            )
            self._expired.pop(request_id, None)
            return token

    def poll_released(self) -> list[str]:
        with self._lock:
            out, self._released = self._released, []
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    @property
    def num_claimed(self) -> int:
        return self._num_claimed  # an int read is atomic; used by the progress loop without the lock

    def get(self, request_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(request_id)

    # ---- consumer side (via the side channel) ------------------------------------------------------

    def heartbeat(self, leases: Iterable[tuple[str, str]]) -> tuple[list[str], list[str]]:
        """Extend HELD leases, given as (request id, lease token), to max(old, now + 2/3 duration).

        Returns (ids this table does not hold, ids whose token is wrong); neither is extended. One wrong pair
        never affects the others: a batch may mix a consumer's honest leases with a client's forged ones.
        """
        unknown: list[str] = []
        refused: list[str] = []
        with self._lock:
            now = self._clock()
            for rid, token in leases:
                lease = self._leases.get(rid)
                if lease is None:
                    unknown.append(rid)
                elif not _same(lease.token, token):
                    refused.append(rid)
                elif lease.state is LeaseState.HELD:
                    # vLLM extends by duration*2//3 (integer seconds); float keeps sub-second leases useful.
                    lease.expires_at = max(lease.expires_at, now + lease.duration_s * 2.0 / 3.0)
        return unknown, refused

    def claim(self, request_id: str, token: str, timeout_s: float) -> tuple[tuple[int, ...], str]:
        """HELD -> CLAIMED for one read of at most `timeout_s`; returns (block ids, claim token)."""
        with self._lock:
            now = self._clock()
            lease = self._leases.get(request_id)
            if lease is not None and not _same(lease.token, token):
                raise ClaimRefused("bad_token", _BAD_TOKEN.format(request_id))
            if lease is not None and lease.state is LeaseState.HELD and lease.expires_at <= now:
                # The reaper has not run yet, but the lease is over: never hand out expiring blocks.
                self._free_expired_locked(lease)
                lease = None
            if lease is None:
                self._refuse_missing_locked(request_id, token, "claim")
            assert lease is not None
            if lease.state is LeaseState.CLAIMED:
                raise ClaimRefused(
                    "already_claimed", f"KV lease of request {request_id!r} is already claimed"
                )
            timeout_s = min(max(float(timeout_s), 0.0), self._max_claim_timeout_s)
            lease.state = LeaseState.CLAIMED
            lease.claim_token = secrets.token_hex(8)
            lease.claim_deadline = now + timeout_s + self._claim_margin_s
            self._num_claimed += 1
            return lease.block_ids, lease.claim_token

    def release(self, request_id: str, token: str, claim_token: str) -> bool:
        """End a claimed read; True iff the blocks stayed held from the claim until now."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                if self._expired_token_locked(request_id, token):
                    self._count_late_locked(request_id, "release")
                return False
            if not _same(lease.token, token):
                raise ClaimRefused("bad_token", _BAD_TOKEN.format(request_id))
            if lease.state is not LeaseState.CLAIMED or not _same(lease.claim_token or "", claim_token):
                # Not this caller's claim (e.g. a duplicate decode request): leave the lease alone.
                logger.warning("KV release for request %s without its claim; ignored", request_id)
                return False
            self._free_locked(lease)
            self._history_ended_locked(lease, "pulled")
            return True

    def abort(self, request_id: str, token: str) -> bool:
        """The consumer gave up before reading: free a HELD lease now. A CLAIMED one is left to its reader."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            if not _same(lease.token, token):
                raise ClaimRefused("bad_token", _BAD_TOKEN.format(request_id))
            if lease.state is not LeaseState.HELD:
                return False
            self._free_locked(lease)
            self._history_ended_locked(lease, "aborted")
            return True

    def evict(self, request_id: str) -> bool:
        """The engine needs the blocks back (a history lease under memory pressure): free a HELD lease now.
        A CLAIMED one is being read and stays. A later claim is refused as `expired`, as after its TTL."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.state is not LeaseState.HELD:
                return False
            self._free_locked(lease)
            self._remember_expired_locked(lease)
            self._history_ended_locked(lease, "evicted")
            return True

    def note_read_notification(self, request_id: str) -> None:
        """The NIXL notification of a finished READ arrived."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.read_notified = True
            elif request_id in self._expired:
                # NIXL notifications are not authenticated; a forged one can only add to this count.
                self._count_late_locked(request_id, "read notification")

    # ---- reaper ------------------------------------------------------------------------------------

    def reap(self) -> list[str]:
        """Free HELD leases past expiry and CLAIMED leases past their claim deadline."""
        with self._lock:
            now = self._clock()
            over = [
                lease
                for lease in self._leases.values()
                if (lease.state is LeaseState.HELD and lease.expires_at <= now)
                or (
                    lease.state is LeaseState.CLAIMED
                    and lease.claim_deadline is not None
                    and lease.claim_deadline <= now
                )
            ]
            for lease in over:
                self._free_expired_locked(lease)
            return [lease.request_id for lease in over]

    # ---- internals ---------------------------------------------------------------------------------

    def _free_locked(self, lease: Lease) -> None:
        del self._leases[lease.request_id]
        if lease.state is LeaseState.CLAIMED:
            self._num_claimed -= 1
        self._released.append(lease.request_id)

    def _free_expired_locked(self, lease: Lease) -> None:
        was_claimed = lease.state is LeaseState.CLAIMED
        self._free_locked(lease)
        self._remember_expired_locked(lease)
        if lease.history:
            # the client did not come back within decoder_kv_blocks_ttl: normal, the next turn recomputes
            logger.info("Releasing the held history KV blocks of request %s (TTL over)", lease.request_id)
            self._history_ended_locked(lease, "expired")
            return
        self.num_expired += 1
        logger.warning(
            "Releasing expired KV blocks for request %s (%s)",
            lease.request_id,
            "claimed but never released in time" if was_claimed else "never claimed",
        )
        if self._on_expired is not None:
            self._on_expired(lease.request_id)

    def _history_ended_locked(self, lease: Lease, outcome: str) -> None:
        if lease.history and self._on_history_end is not None:
            self._on_history_end(outcome)

    def _remember_expired_locked(self, lease: Lease) -> None:
        self._expired[lease.request_id] = [lease.token, False]
        while len(self._expired) > _EXPIRED_MEMORY:
            self._expired.popitem(last=False)

    def _expired_token_locked(self, request_id: str, token: str) -> bool:
        """Whether `request_id`'s lease expired recently and `token` was its token."""
        entry = self._expired.get(request_id)
        return entry is not None and _same(entry[0], token)

    def _refuse_missing_locked(self, request_id: str, token: str, what: str) -> None:
        entry = self._expired.get(request_id)
        if entry is not None and not _same(entry[0], token):
            raise ClaimRefused("bad_token", _BAD_TOKEN.format(request_id))
        if entry is not None:
            self._count_late_locked(request_id, what)
            raise ClaimRefused("expired", f"KV lease of request {request_id!r} expired before the {what}")
        raise ClaimRefused("unknown", f"no KV lease for request {request_id!r} (never held or already freed)")

    def _count_late_locked(self, request_id: str, what: str) -> None:
        entry = self._expired[request_id]
        if entry[1]:
            return
        entry[1] = True
        self.num_after_expiry += 1
        logger.error(
            "Late %s for request %s whose KV lease already expired; its blocks may have been reused",
            what,
            request_id,
        )
        if self._on_late is not None:
            self._on_late(request_id)


_BAD_TOKEN = "the lease token does not match the KV lease of request {!r}"


def _same(expected: str, given: str) -> bool:
    """Token comparison in constant time (no timing hints about how much of a guess was right)."""
    return hmac.compare_digest(expected.encode(), given.encode())
