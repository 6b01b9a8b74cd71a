"""One instance's KV event stream, kept in order by its sequence numbers (no I/O: the subscriber feeds it).

vLLM's publisher numbers its batches 0, 1, 2, ... and keeps the last few thousand for replay. A PUB/SUB
stream loses messages (a subscriber that joins late, a full high-water mark), so:
- the next expected number arrives: applied;
- a higher number (a gap): the caller replays from the first missing one; if the replay cannot cover the
  gap (no replay endpoint, no answer, or the buffer no longer holds it), what the index knows of that
  instance is dropped and the stream is followed from there (a resync by clearing);
- a lower number: a duplicate (a batch already applied from a replay), skipped.
A publisher that restarts (its numbering restarts at 0) is seen by the subscriber as a disconnect; it calls
`reset`, which drops the instance's entries so that nothing from its previous life is trusted.

With snapshots (the publisher advertises a `snapshot_endpoint`), vLLM's bootstrap
(`docs/features/kv_events.md`, "Install a snapshot and follow live updates") replaces the replay:
1. live messages `(identity, seq, payload)` are buffered (`live`) until a snapshot is installed; the first
   one tells the subscriber its subscription delivers, and it asks for a snapshot;
2. `install` builds a private index from the snapshot's chunks, then applies the buffered messages of the
   same identity above the snapshot's seq, which must be consecutive from seq + 1, and swaps the private
   index in for this instance's entries at once;
3. then live messages must be consecutive and of the same identity. A gap, a new identity (a restarted
   publisher), or silence past the heartbeat timeout starts the bootstrap again. Until the new snapshot
   is installed the old entries stay (a hint: a stale one costs one cache miss), except after a new
   identity, where they are known to be wrong and are dropped at once;
4. a snapshot that is unavailable (-2: the publisher's recorder is invalid) or fails (bad reply, gap while
   buffering, identity change while buffering) is retried; an unavailable one also clears the instance and
   follows the stream from the newest buffered message, as a replay that cannot cover a gap does.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from pdserve.kv_events.events import EventDecodeError, KVEventBatch, decode_batch
from pdserve.proxy.kv_index import KVIndex

logger = logging.getLogger("pdserve.proxy")

# replay: a gap filled from the replay endpoint; clear: entries dropped, stream followed from there; reset:
# the publisher disconnected; snapshot: a snapshot installed after a gap, a new identity or a silent publisher
RESYNC_KINDS = ("replay", "clear", "reset", "snapshot")
SEQ_BYTES = 8
IDENTITY_BYTES = 16
SNAPSHOT_UNAVAILABLE = -2
MAX_PENDING_BYTES = 64 << 20  # live messages buffered while a snapshot is on its way (vLLM's example's bound)


class InstanceFeed:
    def __init__(self, url: str, index: KVIndex) -> None:
        self.url = url
        self.index = index
        self.next_seq: int | None = None  # None: nothing applied since the (re)connection
        self.batches = 0
        self.events = 0
        self.decode_errors = 0
        self.duplicates = 0
        self.dropped = 0  # live messages dropped on purpose (PDSERVE_CHAOS_KV_EVENTS_DROP)
        self.resyncs: Counter[str] = Counter()
        # snapshot mode: the identity followed, whether a snapshot is installed and followed without a gap,
        # and the live messages buffered meanwhile
        self.publisher_id: bytes | None = None
        self.ready = False
        self.snapshots = 0  # snapshots installed
        self._pending: list[tuple[bytes, int, bytes]] = []
        self._pending_bytes = 0

    def reset(self) -> None:
        """The publisher went away (disconnect, restart): forget all it said."""
        dropped = self.index.clear(self.url)
        if self.next_seq is not None or dropped:
            self.resyncs["reset"] += 1
            logger.info("kv events of %s: publisher disconnected, %d blocks dropped from the index", self.url, dropped)
        self.next_seq = None
        self.publisher_id = None
        self.ready = False
        self._drop_pending()

    # ---- snapshot mode ---------------------------------------------------------------------------
    def live(self, publisher_id: bytes, seq: int, payload: bytes) -> bool:
        """A live message. Returns True when no snapshot is installed (or it no longer follows): the caller
        asks for one unless a request is already out."""
        if self.ready:
            if publisher_id != self.publisher_id:
                self._clear("the publisher restarted (new identity); bootstrapping from a snapshot")
                self.ready = False
            elif self.next_seq is not None and seq < self.next_seq:
                self.duplicates += 1
                return False
            elif seq == self.next_seq:
                self._apply(seq, payload)
                return False
            else:
                logger.warning("kv events of %s: batches %s..%d missed; bootstrapping from a snapshot", self.url,
                               self.next_seq, seq - 1)
                self.ready = False  # the entries stay until the snapshot replaces them
        self._pending.append((publisher_id, seq, payload))
        self._pending_bytes += len(payload)
        if self._pending_bytes > MAX_PENDING_BYTES:
            logger.warning("kv events of %s: over %d MiB buffered waiting for a snapshot; starting over", self.url,
                           MAX_PENDING_BYTES >> 20)
            self._drop_pending()
        return True

    def stale(self, reason: str) -> None:
        """The stream cannot be trusted to be complete (silence past the heartbeat timeout): bootstrap again
        on the next message."""
        if self.ready:
            logger.warning("kv events of %s: %s; bootstrapping from a snapshot", self.url, reason)
            self.ready = False

    def install(self, frames: Sequence[bytes]) -> str | None:
        """A snapshot reply `(seq, identity, chunk...)`. Returns None when installed, else why not (the caller
        asks again on a later message)."""
        if len(frames) < 2 or len(frames[0]) != SEQ_BYTES or len(frames[1]) != IDENTITY_BYTES:
            return self._failed("a malformed snapshot reply")
        seq = int.from_bytes(frames[0], "big", signed=True)
        publisher_id = bytes(frames[1])
        if seq == SNAPSHOT_UNAVAILABLE and self._pending:
            # the publisher's recorder is invalid until it restarts: follow the stream as it comes, as when a
            # replay cannot cover a gap
            pid, first, payload = self._pending[-1]
            self._clear("the publisher's snapshot is unavailable (-2); following the stream from here")
            self._drop_pending()
            self.publisher_id, self.ready = pid, True
            self._apply(first, payload)
            return "snapshot unavailable"
        if seq < -1:
            return self._failed(f"snapshot sequence {seq}")
        if self._pending and self._pending[-1][0] != publisher_id:
            return self._failed("the publisher restarted while its snapshot was on its way")
        private = KVIndex()
        batches: list[KVEventBatch] = []
        try:
            for chunk in frames[2:]:
                private.apply(self.url, decode_batch(chunk))
            expected = seq + 1
            for pid, s, payload in self._pending:
                if pid != publisher_id or s < expected:
                    continue
                if s != expected:
                    return self._failed(f"a gap while buffering (batch {s}, expected {expected})")
                batches.append(decode_batch(payload))
                expected += 1
        except EventDecodeError as exc:
            return self._failed(f"an undecodable snapshot or buffered batch: {exc}")
        for batch in batches:
            private.apply(self.url, batch)
            self.batches += 1
            self.events += len(batch.events)
        self.index.replace(self.url, private)
        self.publisher_id, self.next_seq, self.ready = publisher_id, expected, True
        if self.snapshots:
            self.resyncs["snapshot"] += 1
        self.snapshots += 1
        self._drop_pending()
        logger.info("kv events of %s: snapshot through batch %d installed (%d blocks, %d buffered batches after it)",
                    self.url, seq, self.index.instance_blocks(self.url), len(batches))
        return None

    def _failed(self, reason: str) -> str:
        logger.warning("kv events of %s: snapshot not installed: %s", self.url, reason)
        self._drop_pending()
        return reason

    def _drop_pending(self) -> None:
        self._pending = []
        self._pending_bytes = 0

    def receive(self, seq: int, payload: bytes) -> int | None:
        """A PUB message. Returns the sequence number to replay from (the caller then calls `replayed` or
        `replay_failed`), or None when the message was applied or skipped."""
        if self.next_seq is None:
            if seq > 0:
                return 0  # joined late: what the publisher's buffer holds, from its start
        elif seq < self.next_seq:
            self.duplicates += 1
            return None
        elif seq > self.next_seq:
            return self.next_seq
        self._apply(seq, payload)
        return None

    def replayed(self, start: int, frames: Sequence[tuple[int, bytes]]) -> None:
        """The replay socket's answer to a request from `start`: (seq, payload) in order. (The caller
        counts `resyncs["replay"]` when it replayed to fill a gap rather than to catch up on connecting.)"""
        expected = start if self.next_seq is None else max(start, self.next_seq)
        for seq, payload in frames:
            if seq < expected:
                continue
            if seq > expected and (self.next_seq is not None or expected > 0):
                # The buffer no longer holds what we missed: start over from what it does hold.
                self._clear(f"replay starts at {seq}, needed {expected}")
            elif seq > expected:
                self.next_seq = None  # joined late and the buffer lost the start: nothing to clear
            self._apply(seq, payload)
            expected = seq + 1
        if self.next_seq is None:
            self.next_seq = expected

    def replay_failed(self, seq: int, payload: bytes, reason: str) -> None:
        """No replay: drop what the index knows of the instance and follow the stream from `seq`."""
        if self.next_seq is not None or self.index.instance_blocks(self.url):
            self._clear(reason)
        self._apply(seq, payload)

    def _clear(self, reason: str) -> None:
        dropped = self.index.clear(self.url)
        self.resyncs["clear"] += 1
        logger.warning("kv events of %s: %s; %d blocks dropped from the index", self.url, reason, dropped)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            self.decode_errors += 1
            logger.warning("kv events of %s: batch %d skipped: %s", self.url, seq, exc)
            return
        self.index.apply(self.url, batch)
        self.batches += 1
        self.events += len(batch.events)
