"""The KV side channel: a small versioned RPC over TCP between a consumer and a producer.

Each frame is a 4-byte big-endian length and an envelope (msgpack, never pickle); the envelope carries one
message, a request or its reply, both typed structs of `messages.py`, whose codec is the only one either end
uses (the wire form is described there).

With a deployment secret (`pdserve.kv_transfer.auth`), the envelope's `mac` signs the message (HMAC-SHA256,
direction-labelled): the producer acts only on requests that verify, are fresh and not replayed, and are
addressed to it (`to`); the consumer accepts only replies that verify and answer its own nonce. Every field is
type-checked on both ends (the structs are the schema); every refusal is counted (`on_refused`) and logged
(rate-limited per reason).

Ops (consumer -> producer; `messages.py` has each request's and reply's fields); every lease op names the
lease's own token, which only the prefill response of that request carried (`remote_lease_token`):
    handshake  agent metadata (sealed), pool geometry, compatibility dict, generation, every TP rank
    claim      -> the leased block ids and a claim token        release  -> whether the lease held throughout
    abort      -> freed                                         heartbeat  -> the leases no longer known
    push_register / push_status / push_cancel / kv_digests: push mode (push_receiver.py -> push_sender.py)

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
from collections.abc import Callable
from typing import cast

import msgspec

from pdserve.kv_transfer.auth import REPLY, REQUEST, AuthRefused, MessageAuth, ReplayGuard, new_nonce
from pdserve.kv_transfer.compat import PROTOCOL_VERSION
from pdserve.kv_transfer.errors import ProtocolError, SideChannelError, SideChannelRefused, SideChannelTimeout
from pdserve.kv_transfer.messages import (
    MalformedMessage,
    R,
    Refusal,
    Reply,
    Request,
    VersionMismatch,
    decode_envelope,
    decode_reply,
    decode_request,
    encode,
    encode_envelope,
)

__all__ = ["MAX_FRAME_BYTES", "FrameDecoder", "ProtocolError", "SideChannelServer", "call", "encode_frame"]

logger = logging.getLogger("pdserve.kv_transfer")

MAX_FRAME_BYTES = 16 << 20
_HEADER = struct.Struct("!I")
_IDLE_CONNECTION_S = 60.0
_MAX_CONNECTIONS = 512
# The first bytes a ZeroMQ peer sends (ZMTP greeting): a vLLM NixlConnector side channel.
_ZMTP_SIGNATURE = b"\xff\x00\x00\x00"


def encode_frame(envelope: bytes) -> bytes:
    """An encoded envelope (`messages.encode_envelope`) with its length prefix."""
    if len(envelope) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(envelope)} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    return _HEADER.pack(len(envelope)) + envelope


class FrameDecoder:
    """Incremental framing: feed bytes, get each complete frame's bytes (an envelope: `messages.decode_envelope`)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
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
            out.append(bytes(self._buf[_HEADER.size : _HEADER.size + length]))
            del self._buf[: _HEADER.size + length]
        return out


# The producer's answer to a request from a peer (its address, for the handler's own refusal notes); raises
# SideChannelRefused to refuse it.
Handler = Callable[[Request[Reply], str], Reply]
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
                    conn.out += self._refuse(_Refusal("bad_request", str(exc)), conn.peer, None)
                    self._flush(sel, conn)
                    self._drop(sel, conn)
                    return
                for frame in frames:
                    conn.out += self._dispatch(frame, conn.peer)
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

    def _seal(self, reply: Reply) -> bytes:
        """A reply as the frame that carries it, signed with a secret."""
        payload = encode(reply)
        mac = self._auth.sign(REPLY, payload) if self._auth is not None else None
        return encode_frame(encode_envelope(payload, mac))

    def _refuse(self, refusal: _Refusal, peer: str, op: str | None) -> bytes:
        self._refusals.note(refusal.reason, peer, op, str(refusal))
        return self._seal(Refusal(re=refusal.nonce, reason=refusal.reason, error=str(refusal)))

    def _open(self, frame: bytes) -> Request[Reply]:
        """The request inside a frame, once it is known to be acceptable (else `_Refusal`)."""
        try:
            envelope = decode_envelope(frame)
        except VersionMismatch as exc:
            raise _Refusal(
                "bad_request",
                f"side channel protocol version mismatch: peer speaks {exc.version!r}, this producer "
                f"{PROTOCOL_VERSION}",
            ) from None
        except ProtocolError as exc:
            raise _Refusal("bad_request", str(exc)) from None
        if self._auth is not None and not self._auth.verify(REQUEST, envelope.msg, envelope.mac):
            # Says nothing about what would have been accepted: the peer does not hold the secret.
            raise _Refusal(
                "unauthenticated",
                f"this KV side channel requires the deployment secret ({_SECRET_HINT}); the message is not "
                "signed with it",
            )
        try:
            request = decode_request(envelope.msg)
        except MalformedMessage as exc:
            raise _Refusal("bad_request", str(exc), exc.nonce, exc.op) from None
        if request.to != self._engine_id:
            raise _Refusal("wrong_engine", f"this side channel serves engine {self._engine_id!r}, not "
                           f"{request.to!r}", request.nonce, request.op)
        if self._replay is not None:
            try:
                self._replay.check(request.ts, request.nonce)
            except AuthRefused as exc:
                raise _Refusal(exc.reason, str(exc), request.nonce, request.op) from None
        return request

    def note_refusal(self, reason: str, peer: str, op: str | None, text: str) -> None:
        """Count and log (rate-limited) a refusal a handler answers inside a successful reply (e.g. the
        heartbeat pairs with a wrong lease token)."""
        self._refusals.note(reason, peer, op, text)

    def _dispatch(self, frame: bytes, peer: str) -> bytes:
        op: str | None = None
        nonce: bytes | None = None
        try:
            request = self._open(frame)
            op, nonce = request.op, request.nonce
            assert self._handler is not None
            reply = self._handler(request, peer)
        except _Refusal as exc:
            return self._refuse(exc, peer, exc.op or op)
        except ProtocolError as exc:
            return self._refuse(_Refusal("bad_request", str(exc), nonce), peer, op)
        except SideChannelRefused as exc:
            return self._refuse(_Refusal(exc.reason, str(exc), nonce), peer, op)
        except Exception as exc:
            logger.exception("KV side channel handler failed for op %s", op)
            return self._refuse(_Refusal("internal", f"{type(exc).__name__}: {exc}", nonce), peer, op)
        if not isinstance(reply, request.reply_type):
            logger.error("KV side channel handler answered %s with a %s", op, type(reply).__name__)
            return self._refuse(_Refusal("internal", f"no {request.reply_type.__name__} for {op}", nonce), peer, op)
        return self._seal(msgspec.structs.replace(reply, re=nonce))


_SECRET_HINT = "PDSERVE_KV_SECRET or kv_connector_extra_config.side_channel_secret"


def _connect_host(host: str) -> str:
    # Avoid trying ::1 first for "localhost" when the producer bound IPv4 loopback.
    return "127.0.0.1" if host == "localhost" else host


def call(
    host: str,
    port: int,
    request: Request[R],
    timeout_s: float,
    *,
    to: str,
    auth: MessageAuth | None = None,
) -> R:
    """One request/reply on a fresh connection to the producer `to`; the exchange is bounded by `timeout_s`.
    The header (`to`, `ts`, a fresh nonce) is filled here; the request is checked as the producer will check it
    (ProtocolError) before it is sent.

    With `auth` the request is signed and the reply must be signed with the same secret and answer this
    request's nonce; without it the producer must not require a secret (it refuses otherwise).
    """
    op = request.op
    nonce = new_nonce()
    payload = encode(msgspec.structs.replace(request, to=to, ts=time.time(), nonce=nonce))
    decode_request(payload)  # our own mistake (a field of the wrong type) fails here, not as a refusal
    mac = auth.sign(REQUEST, payload) if auth is not None else None
    frame = encode_frame(encode_envelope(payload, mac))
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
            frames = decoder.feed(data)
            if frames:
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
    return open_reply(frames[0], request, nonce, where, auth)


def open_reply(frame: bytes, request: Request[R], nonce: bytes, where: str, auth: MessageAuth | None) -> R:
    """The reply in `frame` to `request` (sent with `nonce`): ProtocolError when it is malformed or answers
    another request, SideChannelRefused when the producer refused, SideChannelError when it is not signed."""
    op = request.op
    try:
        envelope = decode_envelope(frame)
    except VersionMismatch as exc:
        raise ProtocolError(f"KV side channel {where} speaks protocol {exc.version!r}, we speak {PROTOCOL_VERSION}") \
            from None
    except ProtocolError as exc:
        raise ProtocolError(f"KV side channel {where}: {op} reply: {exc}") from None
    if auth is not None and not auth.verify(REPLY, envelope.msg, envelope.mac):
        raise SideChannelError(
            f"KV side channel {where}: the reply to {op} is not signed with this deployment's secret (the producer "
            f"has no secret, or another one): give every instance the same {_SECRET_HINT}"
        )
    try:
        reply = decode_reply(envelope.msg, request.reply_type, f"{op} reply")
    except ProtocolError as exc:
        raise ProtocolError(f"KV side channel {where}: {exc}") from None
    if isinstance(reply, Refusal):
        # An error names our nonce, or none when the producer could not read the request at all; either way it
        # only ever makes the call fail.
        if reply.re is not None and reply.re != nonce:
            raise ProtocolError(f"KV side channel {where}: the reply answers another request")
        raise SideChannelRefused(reply.reason, f"producer {where} refused {op}: {reply.error}")
    if reply.re != nonce:
        raise ProtocolError(f"KV side channel {where}: the reply answers another request")
    return cast(R, reply)  # decode_reply decoded request.reply_type, which R names
