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
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from pdserve.kv_events.events import EventDecodeError, decode_batch
from pdserve.proxy.kv_index import KVIndex

logger = logging.getLogger("pdserve.proxy")

RESYNC_KINDS = ("replay", "clear", "reset")


class InstanceFeed:
    def __init__(self, url: str, index: KVIndex) -> None:
        self.url = url
        self.index = index
        self.next_seq: int | None = None  # None: nothing applied since the (re)connection
        self.batches = 0
        self.events = 0
        self.decode_errors = 0
        self.duplicates = 0
        self.resyncs: Counter[str] = Counter()

    def reset(self) -> None:
        """The publisher went away (disconnect, restart): forget all it said."""
        dropped = self.index.clear(self.url)
        if self.next_seq is not None or dropped:
            self.resyncs["reset"] += 1
            logger.info("kv events of %s: publisher disconnected, %d blocks dropped from the index", self.url, dropped)
        self.next_seq = None

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
