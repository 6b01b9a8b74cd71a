"""The KV side channel: a small versioned RPC over TCP between a consumer and a producer.

Wire format: each message is a 4-byte big-endian length followed by a msgpack map (never pickle)
`{"v": PROTOCOL_VERSION, "op": <op>, ...fields}`; a reply is `{"v", "ok": true, ...fields}` or
`{"v", "ok": false, "reason": <code>, "error": <text>}`. Every field is type-checked on both ends.

Ops (consumer -> producer):
    handshake  {engine_id, compat}                -> {engine_id, agent_name, agent_metadata, generation,
                                                      compat, pool, lease_duration_s}
    claim      {request_id, generation, timeout_s} -> {block_ids, token}
    release    {request_id, token}                 -> {held_throughout}
    abort      {request_id}                        -> {freed}
    heartbeat  {request_ids}                       -> {unknown}

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

from pdserve.kv_transfer.compat import PROTOCOL_VERSION
from pdserve.kv_transfer.errors import SideChannelError, SideChannelRefused, SideChannelTimeout

logger = logging.getLogger("pdserve.kv_transfer")

MAX_FRAME_BYTES = 16 << 20
_HEADER = struct.Struct("!I")
_IDLE_CONNECTION_S = 60.0
_MAX_CONNECTIONS = 512
# The first bytes a ZeroMQ peer sends (ZMTP greeting): a vLLM NixlConnector side channel.
_ZMTP_SIGNATURE = b"\xff\x00\x00\x00"

_Number = (int, float)
REQUEST_FIELDS: dict[str, dict[str, Any]] = {
    "handshake": {"engine_id": str, "compat": dict},
    "claim": {"request_id": str, "generation": int, "timeout_s": _Number},
    "release": {"request_id": str, "token": str},
    "abort": {"request_id": str},
    "heartbeat": {"request_ids": (list, str)},
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
    "claim": {"block_ids": (list, int), "token": str},
    "release": {"held_throughout": bool},
    "abort": {"freed": bool},
    "heartbeat": {"unknown": (list, str)},
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


def _error_reply(reason: str, error: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "ok": False, "reason": reason, "error": error}


Handler = Callable[[str, dict[str, Any]], dict[str, Any]]


class _Conn:
    __slots__ = ("sock", "decoder", "out", "last_active")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = FrameDecoder()
        self.out = bytearray()
        self.last_active = time.monotonic()


class SideChannelServer:
    """Single-threaded selector server; handlers are short (table lookups), so one thread suffices.

    Binding happens in the constructor so that a taken port fails startup at once with a clear message.
    """

    def __init__(
        self, host: str, port: int, handler: Handler | None = None, *, name: str = "pdserve-kv-side-channel"
    ) -> None:
        self._handler = handler
        self._name = name
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
                sock, _ = self._sock.accept()
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
            conn = _Conn(sock)
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
                    messages = conn.decoder.feed(data)
                except ProtocolError as exc:
                    conn.out += encode_frame(_error_reply("bad_request", str(exc)))
                    self._flush(sel, conn)
                    self._drop(sel, conn)
                    return
                for msg in messages:
                    conn.out += encode_frame(self._dispatch(msg))
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

    def _dispatch(self, msg: dict[str, Any]) -> dict[str, Any]:
        version = msg.get("v")
        if version != PROTOCOL_VERSION:
            return _error_reply(
                "bad_request",
                f"side channel protocol version mismatch: peer speaks {version!r}, this producer {PROTOCOL_VERSION}",
            )
        op = msg.get("op")
        if op not in REQUEST_FIELDS:
            return _error_reply("bad_request", f"unknown op {op!r}")
        try:
            check_fields(msg, REQUEST_FIELDS[op], f"{op} request")
            assert self._handler is not None
            reply = self._handler(op, msg)
        except ProtocolError as exc:
            return _error_reply("bad_request", str(exc))
        except SideChannelRefused as exc:
            return _error_reply(exc.reason, str(exc))
        except Exception as exc:
            logger.exception("KV side channel handler failed for op %s", op)
            return _error_reply("internal", f"{type(exc).__name__}: {exc}")
        return {"v": PROTOCOL_VERSION, "ok": True, **reply}


def _connect_host(host: str) -> str:
    # Avoid trying ::1 first for "localhost" when the producer bound IPv4 loopback.
    return "127.0.0.1" if host == "localhost" else host


def call(host: str, port: int, op: str, fields: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """One request/reply on a fresh connection; the whole exchange is bounded by `timeout_s`."""
    if op not in REQUEST_FIELDS:
        raise ValueError(f"unknown side channel op {op!r}")
    request = {"v": PROTOCOL_VERSION, "op": op, **fields}
    check_fields(request, REQUEST_FIELDS[op], f"{op} request")
    frame = encode_frame(request)
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
                reply = messages[0]
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

    if reply.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"KV side channel {where} speaks protocol {reply.get('v')!r}, we speak {PROTOCOL_VERSION}"
        )
    if reply.get("ok") is not True:
        reason = reply.get("reason") if isinstance(reply.get("reason"), str) else "internal"
        error = reply.get("error") if isinstance(reply.get("error"), str) else "no error text"
        raise SideChannelRefused(reason, f"producer {where} refused {op}: {error}")
    check_fields(reply, REPLY_FIELDS[op], f"{op} reply from {where}")
    return reply
