"""The KV side channel: a small versioned RPC over TCP between a consumer and a producer.

Wire format: each frame is a 4-byte big-endian length followed by a msgpack map (never pickle), the envelope
`{"v": PROTOCOL_VERSION, "msg": <bytes>, "mac": <bytes or nil>}`. `msg` is itself a msgpack map:

    request  {"op", "to": producer engine id, "ts": wall-clock seconds, "nonce": 16 random bytes, ...fields}
    reply    {"re": the request's nonce, "ok": true, ...fields}  or  {"re", "ok": false, "reason", "error"}

With a deployment secret (`pdserve.kv_transfer.auth`), `mac` signs `msg` (HMAC-SHA256, direction-labelled):
the producer acts only on requests that verify, are fresh and not replayed, and are addressed to it (`to`);
the consumer accepts only replies that verify and answer its own nonce. Every field is type-checked on both
ends; every refusal is counted (`on_refused`) and logged (rate-limited per reason).

Ops (consumer -> producer); every lease op names the lease's own token, which only the prefill response of
that request carried (`remote_lease_token`):
    handshake  {engine_id, compat}                                 -> {engine_id, agent_name, agent_metadata,
                                                                       generation, compat, pool, lease_duration_s}
    claim      {request_id, lease_token, generation, timeout_s}    -> {block_ids, claim_token}
    release    {request_id, lease_token, claim_token}              -> {held_throughout}
    abort      {request_id, lease_token}                           -> {freed}
    heartbeat  {request_ids, lease_tokens}                         -> {unknown}

The client opens one connection per call: calls are rare (a handshake per producer, two calls per request,
a heartbeat batch every few seconds) and a fresh connection can never carry a stale reply or outlive a
restarted producer. Every call has a timeout, so a frozen (SIGSTOPped) producer fails the call, not the caller.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from pdserve.kv_transfer.auth import REPLY, REQUEST, AuthRefused, MessageAuth, ReplayGuard, new_nonce
from pdserve.kv_transfer.compat import PROTOCOL_VERSION
from pdserve.kv_transfer.errors import SideChannelError, SideChannelRefused, SideChannelTimeout
from pdserve.kv_transfer.pool import RemotePool

logger = logging.getLogger("pdserve.kv_transfer")

MAX_FRAME_BYTES = 16 << 20
_HEADER = struct.Struct("!I")
_IDLE_CONNECTION_S = 60.0
_MAX_CONNECTIONS = 512
# The first bytes a ZeroMQ peer sends (ZMTP greeting): a vLLM NixlConnector side channel.
_ZMTP_SIGNATURE = b"\xff\x00\x00\x00"

_Number = (int, float)
ENVELOPE_FIELDS: dict[str, Any] = {"v": int, "msg": bytes}
COMMON_REQUEST_FIELDS: dict[str, Any] = {"op": str, "to": str, "ts": _Number, "nonce": bytes}
REQUEST_FIELDS: dict[str, dict[str, Any]] = {
    "handshake": {"engine_id": str, "compat": dict},
    "claim": {"request_id": str, "lease_token": str, "generation": int, "timeout_s": _Number},
    "release": {"request_id": str, "lease_token": str, "claim_token": str},
    "abort": {"request_id": str, "lease_token": str},
    "heartbeat": {"request_ids": (list, str), "lease_tokens": (list, str)},
    # push mode (pdserve/kv_transfer/push_*.py): the decode registers the blocks it lacks, polls, cancels
    "push_register": {"push_key": str, "generation": int, "engine_id": str, "agent_name": str,
                      "agent_metadata": bytes, "seal_nonce": bytes, "pool": dict, "block_ids": (list, int),
                      "first_block": int, "num_tokens": int, "timeout_s": _Number},
    "push_status": {"push_keys": (list, str)},
    "push_cancel": {"push_key": str},
    # a push's per-block KV digests, fetched by its decode after the WRITEs (pdserve/kv_transfer/digest.py)
    "kv_digests": {"push_key": str},
}
REPLY_FIELDS: dict[str, dict[str, Any]] = {
    "handshake": {
        "engine_id": str,
        "agent_name": str,
        "agent_metadata": bytes,
        "generation": int,
        "compat": dict,
        "pool": dict,
        "lease_duration_s": _Number,
    },
    "claim": {"block_ids": (list, int), "claim_token": str},
    "release": {"held_throughout": bool},
    "abort": {"freed": bool},
    "heartbeat": {"unknown": (list, str)},
    "push_register": {"state": str},
    "push_status": {"states": (list, str), "errors": (list, str)},
    "push_cancel": {"state": str},
    "kv_digests": {"digests": list, "algo": str},
}
POOL_FIELDS: dict[str, Any] = {
    "base_addr": int,
    "length": int,
    "mem_type": str,
    "device_id": int,
    "block_bytes": int,
    "num_blocks": int,
}


class ProtocolError(SideChannelError):
    """A frame or message that does not follow the protocol."""


def _type_ok(value: Any, spec: Any) -> bool:
    if isinstance(spec, tuple) and len(spec) == 2 and spec[0] is list:
        return isinstance(value, list) and all(_type_ok(v, spec[1]) for v in value)
    if (spec is int or spec == _Number) and isinstance(value, bool):
        return False
    return isinstance(value, spec)


def check_fields(msg: Mapping[str, Any], spec: Mapping[str, Any], what: str) -> None:
    for key, typ in spec.items():
        if key not in msg:
            raise ProtocolError(f"{what}: missing field {key!r}")
        if not _type_ok(msg[key], typ):
            raise ProtocolError(f"{what}: field {key!r} has the wrong type ({type(msg[key]).__name__})")


# One tensor-parallel rank in a handshake reply or a push registration: its agent, metadata and pool shard.
RANK_FIELDS: dict[str, Any] = {"agent_name": str, "agent_metadata": bytes, "pool": dict}


def parse_ranks(listed: Any, own_agent: str, what: str) -> list[tuple[str, RemotePool]]:
    """A message's `ranks` (every tensor-parallel rank of the sender, rank 0 first) as (agent name, pool shard):
    rank 0 is the sender's own agent, names are unique and every shard has the same block count. ValueError or
    ProtocolError naming what is wrong."""
    if not isinstance(listed, list) or not listed:
        raise ValueError(f"{what} must be a non-empty list")
    ranks: list[tuple[str, RemotePool]] = []
    for i, entry in enumerate(listed):
        if not isinstance(entry, dict):
            raise ValueError(f"{what}[{i}] is not a map")
        check_fields(entry, RANK_FIELDS, f"{what}[{i}]")
        check_fields(entry["pool"], POOL_FIELDS, f"{what}[{i}].pool")
        ranks.append((entry["agent_name"], RemotePool.from_handshake(entry["pool"])))
    if ranks[0][0] != own_agent:
        raise ValueError(f"{what}[0] is not the sender's own agent")
    if len({name for name, _ in ranks}) != len(ranks):
        raise ValueError(f"{what} repeat an agent name")
    if len({pool.num_blocks for _, pool in ranks}) != 1:
        raise ValueError(f"{what} have different block counts")
    return ranks


def encode_frame(msg: Mapping[str, Any]) -> bytes:
    payload = msgpack.packb(dict(msg), use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    return _HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Incremental decoder: feed bytes, get complete messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            if self._buf[: len(_ZMTP_SIGNATURE)] == _ZMTP_SIGNATURE:
                raise ProtocolError(
                    "peer speaks ZeroMQ (a vLLM NixlConnector side channel?); pdserve cannot exchange KV with it"
                )
            (length,) = _HEADER.unpack_from(self._buf)
            if length > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
            if len(self._buf) < _HEADER.size + length:
                break
            payload = bytes(self._buf[_HEADER.size : _HEADER.size + length])
            del self._buf[: _HEADER.size + length]
            try:
                msg = msgpack.unpackb(payload, raw=False, strict_map_key=True)
            except Exception as exc:  # msgpack raises several unrelated types
                raise ProtocolError(f"undecodable frame: {exc}") from None
            if not isinstance(msg, dict):
                raise ProtocolError("frame is not a map")
            out.append(msg)
        return out


Handler = Callable[[str, dict[str, Any]], dict[str, Any]]
RefusalCounter = Callable[[str], None]

# A refusal reason is logged at once the first time, then at most once per this many seconds (with a count of
# the ones in between): a flood of forged messages must not flood the log.
_REFUSAL_LOG_EVERY_S = 10.0


class _Refusal(Exception):
    def __init__(self, reason: str, message: str, nonce: bytes | None = None, op: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.nonce = nonce
        self.op = op


class _RefusalLog:
    """Counts every refusal and logs it, rate-limited per reason."""

    def __init__(self, counter: RefusalCounter | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._counter = counter
        self._clock = clock
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def note(self, reason: str, peer: str, op: str | None, text: str) -> None:
        if self._counter is not None:
            self._counter(reason)
        now = self._clock()
        with self._lock:
            if now < self._next.get(reason, 0.0):
                self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
                return
            self._next[reason] = now + _REFUSAL_LOG_EVERY_S
            suppressed = self._suppressed.pop(reason, 0)
        more = f" (and {suppressed} more {reason!r} refusals since the last such line)" if suppressed else ""
        logger.warning("KV side channel refused %s from %s (%s): %s%s", op or "a message", peer, reason, text, more)


class _Conn:
    __slots__ = ("sock", "peer", "decoder", "out", "last_active")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.decoder = FrameDecoder()
        self.out = bytearray()
        self.last_active = time.monotonic()


class SideChannelServer:
    """Single-threaded selector server; handlers are short (table lookups), so one thread suffices.

    Binding happens in the constructor so that a taken port fails startup at once with a clear message.
    `engine_id` is the producer this channel serves (requests addressed to another are refused); with `auth`,
    only signed, fresh, never-seen requests reach the handler.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler | None = None,
        *,
        engine_id: str,
        auth: MessageAuth | None = None,
        replay_guard: ReplayGuard | None = None,
        on_refused: RefusalCounter | None = None,
        name: str = "pdserve-kv-side-channel",
    ) -> None:
        self._handler = handler
        self._name = name
        self._engine_id = engine_id
        self._auth = auth
        self._replay = (replay_guard or ReplayGuard()) if auth is not None else None
        self._refusals = _RefusalLog(on_refused)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        # Lets a restarted producer rebind while old connections sit in TIME_WAIT; an active listener on the
        # port still makes bind fail (Linux semantics), which is what we want.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise SideChannelError(
                    f"KV side channel port {port} on {host} is already in use; choose another with "
                    f"--side-channel-port or VLLM_NIXL_SIDE_CHANNEL_PORT"
                ) from None
            raise SideChannelError(f"cannot bind the KV side channel to {host}:{port}: {exc}") from None
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.host = host
        self.port: int = sock.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conns: dict[int, _Conn] = {}

    @property
    def authenticated(self) -> bool:
        return self._auth is not None

    def set_handler(self, handler: Handler) -> None:
        self._handler = handler

    def start(self) -> None:
        if self._handler is None:
            raise RuntimeError("SideChannelServer.start() needs a handler")
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for conn in list(self._conns.values()):
            conn.sock.close()
        self._conns.clear()
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()

    # ---- loop --------------------------------------------------------------------------------------

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, "listen")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._stop.is_set():
                for key, mask in sel.select(timeout=1.0):
                    if key.data == "listen":
                        self._accept(sel)
                    elif key.data == "wake":
                        continue
                    else:
                        self._service(sel, key.data, mask)
                self._close_idle(sel)
        except Exception:
            logger.exception("KV side channel server crashed")
        finally:
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.warning("KV side channel accept failed: %s", exc)
                return
            if len(self._conns) >= _MAX_CONNECTIONS:
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr))
            self._conns[sock.fileno()] = conn
            sel.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn.sock)
        conn.sock.close()

    def _close_idle(self, sel: selectors.BaseSelector) -> None:
        cutoff = time.monotonic() - _IDLE_CONNECTION_S
        for conn in [c for c in self._conns.values() if c.last_active < cutoff]:
            self._drop(sel, conn)

    def _service(self, sel: selectors.BaseSelector, conn: _Conn, mask: int) -> None:
        conn.last_active = time.monotonic()
        if mask & selectors.EVENT_READ:
            try:
                data = conn.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                self._drop(sel, conn)
                return
            if data == b"":
                self._drop(sel, conn)
                return
            if data:
                try:
                    frames = conn.decoder.feed(data)
                except ProtocolError as exc:
                    conn.out += encode_frame(self._refuse(_Refusal("bad_request", str(exc)), conn.peer, None))
                    self._flush(sel, conn)
                    self._drop(sel, conn)
                    return
                for frame in frames:
                    conn.out += encode_frame(self._dispatch(frame, conn.peer))
        self._flush(sel, conn)

    def _flush(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
                del conn.out[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._drop(sel, conn)
                return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        with contextlib.suppress(KeyError, ValueError):
            sel.modify(conn.sock, want, conn)

    # ---- one request -------------------------------------------------------------------------------

    def _seal(self, reply: Mapping[str, Any]) -> dict[str, Any]:
        payload = msgpack.packb(dict(reply), use_bin_type=True)
        mac = self._auth.sign(REPLY, payload) if self._auth is not None else None
        return {"v": PROTOCOL_VERSION, "msg": payload, "mac": mac}

    def _refuse(self, refusal: _Refusal, peer: str, op: str | None) -> dict[str, Any]:
        self._refusals.note(refusal.reason, peer, op, str(refusal))
        return self._seal({"re": refusal.nonce, "ok": False, "reason": refusal.reason, "error": str(refusal)})

    def _open(self, frame: dict[str, Any]) -> dict[str, Any]:
        """The request inside an envelope, once it is known to be acceptable (else `_Refusal`)."""
        version = frame.get("v")
        if version != PROTOCOL_VERSION:
            raise _Refusal(
                "bad_request",
                f"side channel protocol version mismatch: peer speaks {version!r}, this producer {PROTOCOL_VERSION}",
            )
        payload = frame.get("msg")
        if not isinstance(payload, bytes):
            raise _Refusal("bad_request", "envelope lacks the message bytes")
        if self._auth is not None and not self._auth.verify(REQUEST, payload, frame.get("mac")):
            # Says nothing about what would have been accepted: the peer does not hold the secret.
            raise _Refusal(
                "unauthenticated",
                f"this KV side channel requires the deployment secret ({_SECRET_HINT}); the message is not "
                "signed with it",
            )
        try:
            msg = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise _Refusal("bad_request", f"undecodable message: {exc}") from None
        if not isinstance(msg, dict):
            raise _Refusal("bad_request", "message is not a map")
        nonce = msg.get("nonce") if isinstance(msg.get("nonce"), bytes) else None
        op = msg.get("op")
        if op not in REQUEST_FIELDS:
            raise _Refusal("bad_request", f"unknown op {op!r}", nonce)
        try:
            check_fields(msg, COMMON_REQUEST_FIELDS, f"{op} request")
            check_fields(msg, REQUEST_FIELDS[op], f"{op} request")
        except ProtocolError as exc:
            raise _Refusal("bad_request", str(exc), nonce, op) from None
        if msg["to"] != self._engine_id:
            raise _Refusal(
                "wrong_engine", f"this side channel serves engine {self._engine_id!r}, not {msg['to']!r}", nonce, op
            )
        if self._replay is not None:
            try:
                self._replay.check(float(msg["ts"]), msg["nonce"])
            except AuthRefused as exc:
                raise _Refusal(exc.reason, str(exc), nonce, op) from None
        return msg

    def note_refusal(self, reason: str, peer: str, op: str | None, text: str) -> None:
        """Count and log (rate-limited) a refusal a handler answers inside a successful reply (e.g. the
        heartbeat pairs with a wrong lease token)."""
        self._refusals.note(reason, peer, op, text)

    def _dispatch(self, frame: dict[str, Any], peer: str) -> dict[str, Any]:
        op: str | None = None
        nonce: bytes | None = None
        try:
            msg = self._open(frame)
            op, nonce = msg["op"], msg["nonce"]
            msg[PEER_KEY] = peer  # for the handler's own refusal notes
            assert self._handler is not None
            reply = self._handler(op, msg)
        except _Refusal as exc:
            return self._refuse(exc, peer, exc.op or op)
        except ProtocolError as exc:
            return self._refuse(_Refusal("bad_request", str(exc), nonce), peer, op)
        except SideChannelRefused as exc:
            return self._refuse(_Refusal(exc.reason, str(exc), nonce), peer, op)
        except Exception as exc:
            logger.exception("KV side channel handler failed for op %s", op)
            return self._refuse(_Refusal("internal", f"{type(exc).__name__}: {exc}", nonce), peer, op)
        return self._seal({"re": nonce, "ok": True, **reply})


_SECRET_HINT = "PDSERVE_KV_SECRET or kv_connector_extra_config.side_channel_secret"
# The peer's address, added to a request's message for its handler (never a wire field: set after checks).
PEER_KEY = "_peer"


def _connect_host(host: str) -> str:
    # Avoid trying ::1 first for "localhost" when the producer bound IPv4 loopback.
    return "127.0.0.1" if host == "localhost" else host


def call(
    host: str,
    port: int,
    op: str,
    fields: Mapping[str, Any],
    timeout_s: float,
    *,
    to: str,
    auth: MessageAuth | None = None,
) -> dict[str, Any]:
    """One request/reply on a fresh connection to the producer `to`; the exchange is bounded by `timeout_s`.

    With `auth` the request is signed and the reply must be signed with the same secret and answer this
    request's nonce; without it the producer must not require a secret (it refuses otherwise).
    """
    if op not in REQUEST_FIELDS:
        raise ValueError(f"unknown side channel op {op!r}")
    nonce = new_nonce()
    request = {"op": op, "to": to, "ts": time.time(), "nonce": nonce, **fields}
    check_fields(request, REQUEST_FIELDS[op], f"{op} request")
    payload = msgpack.packb(request, use_bin_type=True)
    mac = auth.sign(REQUEST, payload) if auth is not None else None
    frame = encode_frame({"v": PROTOCOL_VERSION, "msg": payload, "mac": mac})
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((_connect_host(host), port), timeout=timeout_s)
    except TimeoutError:
        raise SideChannelTimeout(f"KV side channel {where}: connect timed out after {timeout_s:g}s") from None
    except OSError as exc:
        raise SideChannelError(f"KV side channel {where} unreachable ({op}): {exc}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(frame)
        decoder = FrameDecoder()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
            data = sock.recv(65536)
            if not data:
                raise SideChannelError(f"KV side channel {where} closed the connection during {op}")
            messages = decoder.feed(data)
            if messages:
                envelope = messages[0]
                break
    except TimeoutError:
        raise SideChannelTimeout(
            f"KV side channel {where}: no reply to {op} within {timeout_s:g}s (producer frozen or overloaded?)"
        ) from None
    except ProtocolError as exc:
        raise ProtocolError(f"KV side channel {where}: {exc}") from None
    except OSError as exc:
        raise SideChannelError(f"KV side channel {where} failed during {op}: {exc}") from None
    finally:
        sock.close()
    return _open_reply(envelope, op, nonce, where, auth)


def _open_reply(
    envelope: dict[str, Any], op: str, nonce: bytes, where: str, auth: MessageAuth | None
) -> dict[str, Any]:
    if envelope.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"KV side channel {where} speaks protocol {envelope.get('v')!r}, we speak {PROTOCOL_VERSION}"
        )
    check_fields(envelope, ENVELOPE_FIELDS, f"{op} reply envelope from {where}")
    payload = envelope["msg"]
    if auth is not None and not auth.verify(REPLY, payload, envelope.get("mac")):
        raise SideChannelError(
            f"KV side channel {where}: the reply to {op} is not signed with this deployment's secret (the producer "
            f"has no secret, or another one): give every instance the same {_SECRET_HINT}"
        )
    try:
        reply = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"KV side channel {where}: undecodable reply: {exc}") from None
    if not isinstance(reply, dict):
        raise ProtocolError(f"KV side channel {where}: reply is not a map")
    answers = reply.get("re")
    if reply.get("ok") is not True:
        # An error names our nonce, or none when the producer could not read the request at all; either way it
        # only ever makes the call fail.
        if answers is not None and answers != nonce:
            raise ProtocolError(f"KV side channel {where}: the reply answers another request")
        reason = reply.get("reason") if isinstance(reply.get("reason"), str) else "internal"
        error = reply.get("error") if isinstance(reply.get("error"), str) else "no error text"
        raise SideChannelRefused(reason, f"producer {where} refused {op}: {error}")
    if answers != nonce:
        raise ProtocolError(f"KV side channel {where}: the reply answers another request")
    check_fields(reply, REPLY_FIELDS[op], f"{op} reply from {where}")
    return reply
