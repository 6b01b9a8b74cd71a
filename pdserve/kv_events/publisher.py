"""Publishes KV event batches over ZMQ the way vLLM's ZmqEventPublisher does
(vllm/distributed/kv_events.py), so vLLM's subscribers (llm-d, Dynamo, our proxy) read pdserve instances:

- PUB socket, multipart frames `(topic, seq, payload)`: seq an 8-byte big-endian counter from 0 per
  publisher lifetime, payload `events.encode_batch(...)`.
- Optional ROUTER replay socket: a DEALER/REQ client sends `(b"", start_seq as 8 bytes big-endian)` and gets
  `(b"", seq, payload)` for every buffered batch with seq >= start_seq, then `(b"", -1 as 8 signed bytes, b"")`.
- One background thread owns every socket (ZMQ sockets are not thread-safe); `publish` only enqueues.

Snapshots (`snapshot_endpoint`, vLLM's `docs/features/kv_events.md`, "Wire contract"), off unless configured
because they change the live wire form, which consumers must understand first:
- each publisher lifetime has a 16-byte identity (a random UUID); every live and replay data message's
  sequence frame becomes 24 bytes: the 8-byte big-endian seq, then the identity. The replay end marker and
  the numeric replay request stay as they were;
- an idle publisher sends an empty batch (a heartbeat, numbered like any batch) every `HEARTBEAT_S`, so a
  subscriber knows its subscription delivers and sees a lost final batch as a gap;
- a ROUTER socket, always bound (a bind failure fails startup), answers the one-frame request `snapshot`
  (from REQ: `(b"", b"snapshot")`; from DEALER: `(b"snapshot",)`) with `(seq, identity, chunk...)`, the same
  envelope back: `seq` signed 8 bytes, the last batch the state includes (-1: none yet; -2: unavailable,
  no chunks), then the state as `KVEventBatch` chunks (`snapshot.SnapshotRecorder`). The recorder is fed
  on this thread before each batch goes out, so the cut is exact; snapshots are served between batches.

Bind or connect: vLLM binds a wildcard address (`tcp://*:5557`) and connects to any other, expecting a
collector that binds there (llm-d's convention). pdserve follows it for a wildcard and for an address that
is not this machine's, but binds an address of this machine (`tcp://127.0.0.1:5557`, the node's own IP):
connecting there left the documented single-host setup with two connecting ends and no listener, so no
subscriber, our proxy included, ever received a batch. When that bind fails because the port is taken (a
collector on this host bound it first, vLLM's convention), the publisher connects to it as vLLM would.
`mode` says which happened; /pdserve/info advertises it, and a router subscribes only to a bound endpoint.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import threading
import time
import uuid
from collections import deque
from itertools import count
from typing import Any

from pdserve.kv_events.events import KVEventBatch, encode_batch
from pdserve.kv_events.snapshot import SnapshotRecorder
from pdserve.types.kv_events_config import KVEventsConfig

log = logging.getLogger("pdserve.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"snapshot"
SNAPSHOT_NONE = -1  # the publisher has not numbered a batch yet
SNAPSHOT_UNAVAILABLE = -2  # the recorder is invalid (input lost, limits exceeded): restart the publisher
HEARTBEAT_S = 1.0  # an idle publisher's empty batch, with snapshots on (vLLM's interval)


def _binds(endpoint: str) -> bool:
    """vLLM's heuristic: a wildcard, IPv6 any, ipc:// or inproc:// address is bound, anything else connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _open_pub(pub: Any, endpoint: str, zmq: Any) -> str:
    """Binds or connects the PUB socket (see the module's doc); returns "bind" or "connect"."""
    if _binds(endpoint):
        pub.bind(endpoint)
        return "bind"
    try:
        pub.bind(endpoint)  # an address of this machine: subscribers connect here
        return "bind"
    except zmq.ZMQError as e:
        if e.errno not in (errno.EADDRNOTAVAIL, errno.EADDRINUSE, errno.ENODEV):
            raise
        # EADDRNOTAVAIL / ENODEV: another machine's address; EADDRINUSE: a local collector bound it first
    pub.connect(endpoint)
    return "connect"


def _default_replay(endpoint: str, mode: str) -> str | None:
    """Without a `replay_endpoint` (vLLM's default) a subscriber that starts after blocks were stored never
    learns of them: a router put in front of running instances sees none of their cache. A bound tcp:// PUB
    therefore also gets a replay socket on a free port of the same address (pdserve's addition, advertised
    in /pdserve/info; vLLM's subscribers, which do not ask, are unaffected)."""
    if mode != "bind" or not endpoint.startswith("tcp://"):
        return None
    return f"{endpoint.rpartition(':')[0]}:*"


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        import zmq  # only instances that publish need pyzmq loaded

        self._zmq = zmq
        self.config = config
        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._seq = count()
        self._last_seq = -1  # the last batch numbered (a snapshot's resume point); -1: none yet
        self.num_published = 0
        self.num_dropped = 0  # batches refused because the queue was full (the engine never blocks on it)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        self._snapshot = None
        # with snapshots: this lifetime's identity, the recorder of what the events say is held, and when a
        # batch last went out (an idle second sends a heartbeat)
        self.publisher_id: bytes | None = None
        self.recorder: SnapshotRecorder | None = None
        self._last_sent = time.monotonic()
        try:
            self.mode = _open_pub(self._pub, config.endpoint, zmq)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
            self.replay_endpoint: str | None = None
            self.snapshot_endpoint: str | None = None
            replay = config.replay_endpoint or _default_replay(config.endpoint, self.mode)
            if replay is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            if config.snapshot_endpoint is not None:
                self._snapshot = self._ctx.socket(zmq.ROUTER)
                self._snapshot.bind(config.snapshot_endpoint)  # always bound (vLLM: a bind failure fails startup)
                self.snapshot_endpoint = self._snapshot.getsockopt_string(zmq.LAST_ENDPOINT)
                self.publisher_id = uuid.uuid4().bytes
                self.recorder = SnapshotRecorder()
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {config.endpoint} / {config.replay_endpoint} / "
                             f"{config.snapshot_endpoint}: {e}") from None
        log.info("kv events: publishing on %s (%s)%s%s", self.endpoint, "bound: subscribers connect here"
                 if self.mode == "bind" else "connected out to a subscriber that binds there",
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
                 f", snapshots on {self.snapshot_endpoint}" if self.snapshot_endpoint else "")
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    # ---- engine side ---------------------------------------------------------------------------
    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1  # subscribers see the seq gap only if the batch got a seq: it did not
            if self.recorder is not None:  # (a GIL-atomic attribute write; the thread only reads it)
                self.recorder.invalidate("a batch was lost before publication (the publisher's queue was full)")

    def shutdown(self, timeout_s: float = 1.0) -> None:
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout=timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay, self._snapshot):
            if s is not None:
                s.close(linger=0)

    # ---- publisher thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            for sock, serve in ((self._replay, self._serve_replay), (self._snapshot, self._serve_snapshot)):
                if sock is None:
                    continue
                try:
                    while sock.poll(0):
                        serve()
                except self._zmq.ZMQError:
                    log.exception("kv events: a replay or snapshot request failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                if self.publisher_id is not None and time.monotonic() - self._last_sent >= HEARTBEAT_S:
                    self._send(KVEventBatch(ts=time.time(), events=[], data_parallel_rank=self._rank))
                continue
            if batch is None:
                return
            self._send(batch)

    def _seq_frame(self, seq: int) -> bytes:
        frame = seq.to_bytes(8, "big")
        return frame if self.publisher_id is None else frame + self.publisher_id

    def _send(self, batch: KVEventBatch) -> None:
        try:
            seq = next(self._seq)
            payload = encode_batch(batch)
            if self.recorder is not None:
                self.recorder.apply(batch)  # before it goes out: a snapshot is never behind its seq
            self._last_seq = seq
            self._pub.send_multipart((self._topic, self._seq_frame(seq), payload))
            self._buffer.append((seq, payload))
            self._last_sent = time.monotonic()
            self.num_published += 1
        except Exception:  # noqa: BLE001 - a publishing fault must not kill the thread
            log.exception("kv events: publishing a batch failed")
            if self.recorder is not None:
                self.recorder.invalidate("a batch failed to publish")

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._seq_frame(seq), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _serve_snapshot(self) -> None:
        """One snapshot request: `(client, b"", b"snapshot")` from a REQ socket, `(client, b"snapshot")`
        from a DEALER; the reply keeps the request's envelope."""
        assert self._snapshot is not None and self.publisher_id is not None and self.recorder is not None
        frames = self._snapshot.recv_multipart()
        client, envelope, request = frames[0], frames[1:-1], frames[-1] if len(frames) > 1 else b""
        if request != SNAPSHOT_REQUEST or envelope not in ([], [b""]):
            log.warning("kv events: malformed snapshot request (%d frames)", len(frames))
            seq, chunks = SNAPSHOT_UNAVAILABLE, []
        elif self.recorder.invalid is not None:
            log.warning("kv events: snapshot unavailable: %s (restart the instance to recover)", self.recorder.invalid)
            seq, chunks = SNAPSHOT_UNAVAILABLE, []
        else:
            seq = self._last_seq
            chunks = [encode_batch(b) for b in self.recorder.chunks(self._rank)]
        self._snapshot.send_multipart((client, *envelope, seq.to_bytes(8, "big", signed=True), self.publisher_id,
                                       *chunks))
