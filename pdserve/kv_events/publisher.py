"""Publishes KV event batches over ZMQ the way vLLM's ZmqEventPublisher does
(vllm/distributed/kv_events.py), so vLLM's subscribers (llm-d, Dynamo, our proxy) read pdserve instances:

- PUB socket, multipart frames `(topic, seq, payload)`: seq an 8-byte big-endian counter from 0 per
  publisher lifetime, payload `events.encode_batch(...)`.
- Optional ROUTER replay socket: a DEALER/REQ client sends `(b"", start_seq as 8 bytes big-endian)` and gets
  `(b"", seq, payload)` for every buffered batch with seq >= start_seq, then `(b"", -1 as 8 signed bytes, b"")`.
- One background thread owns both sockets (ZMQ sockets are not thread-safe); `publish` only enqueues.

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
from collections import deque
from itertools import count
from typing import Any

from pdserve.kv_events.events import KVEventBatch, encode_batch
from pdserve.types.kv_events_config import KVEventsConfig

log = logging.getLogger("pdserve.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


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
        self.num_published = 0
        self.num_dropped = 0  # batches refused because the queue was full (the engine never blocks on it)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            self.mode = _open_pub(self._pub, config.endpoint, zmq)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
            self.replay_endpoint: str | None = None
            replay = config.replay_endpoint or _default_replay(config.endpoint, self.mode)
            if replay is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {config.endpoint} / {config.replay_endpoint}: "
                             f"{e}") from None
        log.info("kv events: publishing on %s (%s)%s", self.endpoint, "bound: subscribers connect here"
                 if self.mode == "bind" else "connected out to a subscriber that binds there",
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")
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

    def shutdown(self, timeout_s: float = 1.0) -> None:
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout=timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)

    # ---- publisher thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except self._zmq.ZMQError:
                    log.exception("kv events: replay request failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            try:
                seq = next(self._seq)
                payload = encode_batch(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.num_published += 1
            except Exception:  # noqa: BLE001 - a publishing fault must not kill the thread
                log.exception("kv events: publishing a batch failed")

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
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
