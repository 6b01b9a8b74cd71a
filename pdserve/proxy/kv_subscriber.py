"""One instance's KV event subscription: a zmq.asyncio SUB socket on its PUB endpoint, a DEALER for replays.

The sequence logic lives in `InstanceFeed` (pdserve/proxy/kv_feed.py); this module is only the I/O:
- on connecting (ZMQ handshake done) it asks the replay endpoint for everything buffered, so that blocks
  stored before the proxy subscribed are known too (vLLM's publisher keeps the last `buffer_steps` batches);
- a gap in the sequence numbers is filled by a replay, bounded by `replay_timeout` seconds;
- a disconnect (the instance died, restarted, or stopped answering ZMQ heartbeats) drops what the index
  knows of it at once, well before the health checker ejects it, and tells the proxy (`on_disconnect`);
  ZMQ reconnects by itself and the next connection starts a fresh sync.
Replay protocol and frames: vLLM's `vllm/distributed/kv_events.py` (`ZmqEventPublisher._service_replay`).

With a `snapshot_endpoint` the replay is not used: sequence frames carry the publisher's identity (24 bytes)
and the subscriber bootstraps from a snapshot (a DEALER sends `snapshot`, the reply is `(seq, identity,
chunk...)`), as vLLM documents it (`docs/features/kv_events.md`; its example client
`examples/features/kv_events/kv_events_snapshot_subscriber.py`); `InstanceFeed` holds the procedure. A
request gets `SNAPSHOT_TIMEOUT_S`; a publisher silent for `SILENCE_TIMEOUT_S` (it sends a heartbeat every
second) is bootstrapped again on its next message.

Fault injection for tests and benchmarks: `PDSERVE_CHAOS_KV_EVENTS_DROP=P` drops each live message with
probability P on arrival, as a lossy network or a full high-water mark would (counted in `feed.dropped`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.proxy.background import BackgroundTask
from pdserve.proxy.kv_feed import IDENTITY_BYTES, InstanceFeed

logger = logging.getLogger("pdserve.proxy")

SEQ_BYTES = 8
END_SEQ = -1
HEARTBEAT_IVL_MS = 1000  # ZMQ pings the publisher this often ...
HEARTBEAT_TIMEOUT_MS = 3000  # ... and drops the connection when it stays silent this long
RECONNECT_IVL_MS = 200
MAX_REPLAY_FRAMES = 1_000_000  # a bound on one replay answer (vLLM buffers 10,000 batches by default)
SNAPSHOT_TIMEOUT_S = 10.0  # one snapshot request (vLLM's example client's bound)
SILENCE_TIMEOUT_S = 5.0  # no message, heartbeats included, this long: the stream is not trusted (vLLM's example)
CHAOS_DROP_ENV = "PDSERVE_CHAOS_KV_EVENTS_DROP"


def _chaos_drop_rate() -> float:
    raw = os.environ.get(CHAOS_DROP_ENV, "")
    try:
        return min(max(float(raw), 0.0), 1.0) if raw else 0.0
    except ValueError:
        logger.warning("%s=%r is not a probability; ignored", CHAOS_DROP_ENV, raw)
        return 0.0


@dataclass(frozen=True)
class EventEndpoints:
    """Where an instance publishes, as its `/pdserve/info` `kv_events` says."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    block_size: int
    snapshot_endpoint: str | None = None  # vLLM's snapshot service: 24-byte sequence frames, bootstrap by snapshot


def _seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"a sequence frame has {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


class EventSubscriber:
    def __init__(
        self,
        url: str,
        endpoints: EventEndpoints,
        feed: InstanceFeed,
        *,
        replay_timeout: float = 2.0,
        on_disconnect: Callable[[], None] = lambda: None,
    ) -> None:
        self.url = url
        self.endpoints = endpoints
        self.feed = feed
        self.replay_timeout = replay_timeout
        self.on_disconnect = on_disconnect
        self.connected = False
        self.disconnected_since: float | None = time.monotonic()  # None while connected
        self._background = BackgroundTask(self._run, f"pdserve-kv-events-{self.url}")
        self._ctx = zmq.asyncio.Context.instance()
        self._snapshot: zmq.asyncio.Socket | None = None  # a DEALER with a snapshot request out
        self._poller: zmq.asyncio.Poller | None = None
        self._snapshot_deadline = 0.0
        self._last_message = time.monotonic()
        self._drop_rate = _chaos_drop_rate()
        self._rng = random.Random()

    def unreachable_for(self) -> float:
        """Seconds since the connection dropped (or since the start, never connected); 0 while connected."""
        return 0.0 if self.disconnected_since is None else time.monotonic() - self.disconnected_since

    def start(self) -> None:
        self._background.start()

    async def stop(self) -> None:
        await self._background.stop()

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side: the proxy reads as fast as events come
            sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sub.setsockopt(zmq.SUBSCRIBE, self.endpoints.topic.encode())
            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            sub.connect(self.endpoints.endpoint)
            poller = self._poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll(timeout=1000 if self.endpoints.snapshot_endpoint else None))
                if monitor in ready:
                    await self._on_monitor(await monitor.recv_multipart())
                if sub in ready:
                    await self._on_message(await sub.recv_multipart())
                if self._snapshot is not None:
                    await self._poll_snapshot(self._snapshot in ready)
                elif self.endpoints.snapshot_endpoint and self.connected and \
                        time.monotonic() - self._last_message > SILENCE_TIMEOUT_S:
                    self.feed.stale(f"no message for {SILENCE_TIMEOUT_S:g}s (heartbeats are every second)")
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not take the proxy down: routing falls back to load only
            logger.exception("kv events subscriber of %s stopped", self.url)
            self.feed.reset()
        finally:
            self._close_snapshot()
            if monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sub.disable_monitor()
                monitor.close(linger=0)
            sub.close(linger=0)

    async def _on_monitor(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
            self.disconnected_since = None
            logger.info("kv events of %s: subscribed to %s", self.url, self.endpoints.endpoint)
            self._last_message = time.monotonic()
            if self.endpoints.snapshot_endpoint is not None:
                pass  # the first live message (a heartbeat at the latest) starts the bootstrap
            elif self.endpoints.replay_endpoint is not None and self.feed.next_seq is None:
                frames_ = await self._replay(0)
                if frames_ is not None:
                    self.feed.replayed(0, frames_)
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self.disconnected_since = time.monotonic()
            self._close_snapshot()
            self.feed.reset()
            self.on_disconnect()

    async def _on_message(self, frames: list[bytes]) -> None:
        self._last_message = time.monotonic()
        if self._drop_rate and self._rng.random() < self._drop_rate:
            self.feed.dropped += 1
            return
        if len(frames) != 3:
            self.feed.decode_errors += 1
            logger.warning("kv events of %s: a message of %d frames (expected 3) skipped", self.url, len(frames))
            return
        _, seq_frame, payload = frames
        if self.endpoints.snapshot_endpoint is not None:
            if len(seq_frame) != SEQ_BYTES + IDENTITY_BYTES:
                self.feed.decode_errors += 1
                logger.warning("kv events of %s: a %d-byte sequence frame (a publisher serving snapshots sends "
                               "%d)", self.url, len(seq_frame), SEQ_BYTES + IDENTITY_BYTES)
                return
            seq = int.from_bytes(seq_frame[:SEQ_BYTES], "big")
            if self.feed.live(bytes(seq_frame[SEQ_BYTES:]), seq, payload) and self._snapshot is None:
                await self._request_snapshot()
            return
        try:
            seq = _seq(seq_frame)
        except ValueError as exc:
            self.feed.decode_errors += 1
            logger.warning("kv events of %s: %s", self.url, exc)
            return
        start = self.feed.receive(seq, payload)
        if start is None:
            return
        if self.feed.next_seq is not None:  # a gap in a stream we follow (not the first message)
            self.feed.resyncs["replay"] += 1
        replayed = await self._replay(start) if self.endpoints.replay_endpoint is not None else None
        if replayed is None:
            self.feed.replay_failed(seq, payload, f"batches {start}..{seq - 1} missed and not replayed")
            return
        self.feed.replayed(start, replayed)
        if self.feed.next_seq is None or self.feed.next_seq <= seq:
            self.feed.replay_failed(seq, payload, f"the replay did not reach batch {seq}")

    async def _request_snapshot(self) -> None:
        assert self.endpoints.snapshot_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.endpoints.snapshot_endpoint)
            await sock.send(b"snapshot")  # a DEALER's request is the one frame; the reply has no delimiter
        except zmq.ZMQError as exc:
            logger.warning("kv events of %s: snapshot request failed: %s", self.url, exc)
            sock.close(linger=0)
            return
        self._snapshot = sock
        self._snapshot_deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
        if self._poller is not None:
            self._poller.register(sock, zmq.POLLIN)

    async def _poll_snapshot(self, readable: bool) -> None:
        """The snapshot reply, if it came (live messages keep being buffered meanwhile)."""
        assert self._snapshot is not None
        if readable:
            frames = await self._snapshot.recv_multipart()
            self._close_snapshot()
            self.feed.install(frames)
        elif time.monotonic() > self._snapshot_deadline:
            logger.warning("kv events of %s: no snapshot from %s within %.0fs; asking again", self.url,
                           self.endpoints.snapshot_endpoint, SNAPSHOT_TIMEOUT_S)
            self._close_snapshot()

    def _close_snapshot(self) -> None:
        if self._snapshot is not None:
            if self._poller is not None:
                with contextlib.suppress(KeyError):
                    self._poller.unregister(self._snapshot)
            self._snapshot.close(linger=0)
            self._snapshot = None

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every buffered batch from `start` on, or None when the replay endpoint does not answer in time."""
        assert self.endpoints.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        frames: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.endpoints.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big", signed=True)])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.replay_timeout
            while len(frames) < MAX_REPLAY_FRAMES:
                left = deadline - loop.time()
                if left <= 0 or not await dealer.poll(int(left * 1000), zmq.POLLIN):
                    logger.warning("kv events of %s: no replay answer from %s within %.1fs", self.url,
                                   self.endpoints.replay_endpoint, self.replay_timeout)
                    return None
                reply = await dealer.recv_multipart()
                if len(reply) != 3:
                    return None
                seq = _seq(reply[1])
                if seq == END_SEQ:
                    return frames
                frames.append((seq, reply[2]))
            return None
        except (zmq.ZMQError, ValueError) as exc:
            logger.warning("kv events of %s: replay failed: %s", self.url, exc)
            return None
        finally:
            dealer.close(linger=0)
