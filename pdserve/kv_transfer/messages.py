"""The KV side channel's messages (`side_channel.py` carries them): one frozen msgspec struct per request and per
reply, and the one codec that every sender and receiver uses.

On the wire (protocol 2: the maps the untyped side channel sent, with the same keys, order and types, and the
same bytes but for a map header where a field is omitted) each message is a msgpack map of its fields by name,
in the order declared here:

    request  {"op": the struct's tag, "to": producer engine id, "ts": wall-clock seconds, "nonce": 16 bytes,
              ...its fields}
    reply    {"re": the request's nonce, "ok": true, ...its fields}    or  `Refusal`  {"re", "ok": false,
              "reason", "error"}

and travels inside an `Envelope` (`{"v": PROTOCOL_VERSION, "msg": <the message's bytes>, "mac": <bytes or nil>}`),
so that `mac` signs the message's exact bytes (`auth.py`). Fields a peer sends that a struct does not declare are
ignored; a missing field or one of the wrong type (a bool is no int) makes the message malformed: decoding raises
`MalformedMessage` naming the op and the field (msgspec's own words, e.g. "claim request: Expected `int`, got
`bool` - at `$.generation`"), and the producer answers a `bad_request` refusal.

Why msgspec (as vLLM's V1 engine-core messages use, vllm/v1/engine/__init__.py, and its NixlConnector's handshake
did, `NixlAgentMetadata` in vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py): the structs are the
schema, decoding checks every field's type in one pass in C, and a tagged union picks a request's type by its
`op`; a dataclass codec would have had to re-implement that checking (the field-type tables it replaces).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Generic, TypeVar, Union

import msgspec
from msgspec import Struct

from pdserve.kv_transfer.compat import PROTOCOL_VERSION, Compat
from pdserve.kv_transfer.errors import ProtocolError
from pdserve.kv_transfer.pool import RemotePool


class MalformedMessage(ProtocolError):
    """A message that does not decode as the protocol's. `op` and `nonce` when the message named them (a refusal
    then answers that nonce)."""

    def __init__(self, text: str, *, op: str | None = None, nonce: bytes | None = None) -> None:
        super().__init__(text)
        self.op = op
        self.nonce = nonce


class VersionMismatch(ProtocolError):
    """An envelope of another protocol version (`version`: what it said, possibly nothing)."""

    def __init__(self, version: object) -> None:
        super().__init__(f"protocol version {version!r}, not {PROTOCOL_VERSION}")
        self.version = version


class Envelope(Struct, frozen=True):
    v: int
    msg: bytes  # the message, as signed
    mac: bytes | None = None


# ---- parts of messages ----------------------------------------------------------------------------------------


class RankEntry(Struct, frozen=True):
    """One tensor-parallel rank in a handshake reply or a push registration: its agent, its agent metadata
    (sealed with the deployment secret when there is one) and its pool shard."""

    agent_name: str
    agent_metadata: bytes
    pool: RemotePool


def check_ranks(ranks: Sequence[RankEntry], own_agent: str, what: str) -> None:
    """Every tensor-parallel rank of the sender, rank 0 first: rank 0 is the sender's own agent, names are unique
    and every shard has the same block count (ValueError naming what is wrong)."""
    if not ranks:
        raise ValueError(f"{what} must be a non-empty list")
    if ranks[0].agent_name != own_agent:
        raise ValueError(f"{what}[0] is not the sender's own agent")
    if len({r.agent_name for r in ranks}) != len(ranks):
        raise ValueError(f"{what} repeat an agent name")
    if len({r.pool.num_blocks for r in ranks}) != 1:
        raise ValueError(f"{what} have different block counts")


# ---- replies --------------------------------------------------------------------------------------------------


class Reply(Struct, frozen=True, kw_only=True):
    """What every reply starts with; the server fills `re` with the request's nonce."""

    re: bytes | None = None
    ok: bool = True


class Refusal(Reply, frozen=True, kw_only=True):
    """The answer to a request the producer did not act on. `re` is None when it could not read the nonce;
    `reason` is machine-readable (`errors.SideChannelRefused`)."""

    ok: bool = False
    reason: str
    error: str


class HandshakeReply(Reply, frozen=True, kw_only=True):
    engine_id: str
    agent_name: str  # rank 0's
    agent_metadata: bytes  # rank 0's
    generation: int  # the producer's incarnation: a claim must name it
    compat: Compat
    pool: RemotePool  # rank 0's shard
    lease_duration_s: float
    # tensor parallelism: every rank (rank 0's are the fields above); None from a producer that lists none
    tp_size: int = 1
    ranks: tuple[RankEntry, ...] | None = None

    def __post_init__(self) -> None:
        if self.ranks is not None:
            check_ranks(self.ranks, self.agent_name, "handshake ranks")
        if self.tp_size != len(self.all_ranks()):
            raise ValueError(f"handshake says tp_size {self.tp_size} but lists {len(self.all_ranks())} rank(s)")

    def all_ranks(self) -> tuple[RankEntry, ...]:
        return self.ranks or (RankEntry(self.agent_name, self.agent_metadata, self.pool),)


class ClaimReply(Reply, frozen=True, kw_only=True):
    block_ids: tuple[int, ...]
    claim_token: str


class ReleaseReply(Reply, frozen=True, kw_only=True):
    held_throughout: bool  # the lease was held from the claim until now: the bytes READ are good


class AbortReply(Reply, frozen=True, kw_only=True):
    freed: bool


class HeartbeatReply(Reply, frozen=True, kw_only=True):
    unknown: tuple[str, ...]  # request ids not extended (gone, or a wrong lease token)


class PushStateReply(Reply, frozen=True, kw_only=True):
    """The answer to a push registration or cancel: the job's state (`push_sender`)."""

    state: str


class PushStatusReply(Reply, frozen=True, kw_only=True):
    states: tuple[str, ...]
    errors: tuple[str, ...]
    # per push, `api.pd.first_token_fields` of the token the prefill sampled, or None; read leniently by
    # `push_sender.first_token_from` (a malformed one reads as no token, as in the completion notice)
    first_tokens: tuple[dict[str, object] | None, ...] = ()


class KvDigestsReply(Reply, frozen=True, kw_only=True):
    digests: tuple[tuple[str, ...], ...]  # per producer rank, one per block of the request (`digest.py`)
    algo: str


# ---- requests -------------------------------------------------------------------------------------------------

R = TypeVar("R", bound=Reply)


class Request(Struct, Generic[R], frozen=True, kw_only=True, tag_field="op"):
    """What every request starts with; `call` fills the header (`to`, `ts`, `nonce`). A request's type is its
    op (the tag) and names its reply's type (`Request[ClaimReply]`: `reply_type`)."""

    reply_type: ClassVar[type[Reply]]

    to: str = ""
    ts: float = 0.0
    nonce: bytes = b""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            args = getattr(base, "__args__", ())
            if args and isinstance(args[0], type) and issubclass(args[0], Reply):
                cls.reply_type = args[0]

    @property
    def op(self) -> str:
        return op_of(type(self))


def op_of(kind: type[Request[R]]) -> str:
    return str(kind.__struct_config__.tag)


class Handshake(Request[HandshakeReply], frozen=True, kw_only=True, tag="handshake"):
    engine_id: str  # the consumer's
    compat: Compat


class Claim(Request[ClaimReply], frozen=True, kw_only=True, tag="claim"):
    request_id: str
    lease_token: str
    generation: int
    timeout_s: float  # how long the claim may last (the READ's deadline)


class Release(Request[ReleaseReply], frozen=True, kw_only=True, tag="release"):
    request_id: str
    lease_token: str
    claim_token: str


class Abort(Request[AbortReply], frozen=True, kw_only=True, tag="abort"):
    request_id: str
    lease_token: str


class Heartbeat(Request[HeartbeatReply], frozen=True, kw_only=True, tag="heartbeat"):
    request_ids: tuple[str, ...]
    lease_tokens: tuple[str, ...]  # one per request id


# push mode (push_receiver.py -> push_sender.py): the decode registers the blocks it lacks, polls, cancels
class PushRegister(Request[PushStateReply], frozen=True, kw_only=True, tag="push_register", omit_defaults=True):
    push_key: str
    generation: int
    engine_id: str
    agent_name: str  # decode rank 0's
    agent_metadata: bytes  # decode rank 0's, sealed under `seal_nonce` with a secret
    seal_nonce: bytes
    pool: RemotePool  # decode rank 0's shard
    block_ids: tuple[int, ...]  # the decode's blocks for request blocks [first_block, ...)
    first_block: int
    num_tokens: int
    timeout_s: float  # nothing is posted after this
    ranks: tuple[RankEntry, ...] | None = None  # tensor parallelism: every decode rank, rank 0 first (else None)

    def __post_init__(self) -> None:
        if self.ranks is not None:
            check_ranks(self.ranks, self.agent_name, "ranks")

    def all_ranks(self) -> tuple[RankEntry, ...]:
        return self.ranks or (RankEntry(self.agent_name, self.agent_metadata, self.pool),)


class PushStatus(Request[PushStatusReply], frozen=True, kw_only=True, tag="push_status"):
    push_keys: tuple[str, ...]


class PushCancel(Request[PushStateReply], frozen=True, kw_only=True, tag="push_cancel"):
    push_key: str


class KvDigests(Request[KvDigestsReply], frozen=True, kw_only=True, tag="kv_digests"):
    """A push's per-block KV digests, fetched by its decode after the WRITEs (`digest.py`)."""

    push_key: str


REQUEST_TYPES: tuple[type[Request[Reply]], ...] = (
    Handshake, Claim, Release, Abort, Heartbeat, PushRegister, PushStatus, PushCancel, KvDigests)
OPS = frozenset(op_of(t) for t in REQUEST_TYPES)

# ---- the codec ------------------------------------------------------------------------------------------------

_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(Envelope)
_REQUEST = msgspec.msgpack.Decoder(Union[REQUEST_TYPES])  # noqa: UP007 - a runtime tuple of types
_REPLIES: dict[type[Reply], msgspec.msgpack.Decoder] = {}
_REQUEST_HEADER = (("to", ""), ("ts", 0.0), ("nonce", b""))  # what `call` fills, by its unset value


def encode(message: Struct) -> bytes:
    return _ENCODER.encode(message)


def encode_envelope(msg: bytes, mac: bytes | None) -> bytes:
    return _ENCODER.encode(Envelope(PROTOCOL_VERSION, msg, mac))


def _peek(payload: bytes, what: str) -> dict[str, object]:
    """A message that failed typed decoding, as a plain map: enough to say why and whom to answer."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"undecodable {what}: {exc}") from None
    if not isinstance(raw, dict):
        raise MalformedMessage(f"{what} is not a map")
    return raw


def decode_envelope(frame: bytes) -> Envelope:
    """One frame's envelope; VersionMismatch for another protocol (checked first: an older peer's envelope
    may lack today's fields), MalformedMessage otherwise."""
    try:
        envelope = _ENVELOPE.decode(frame)
    except msgspec.MsgspecError as exc:
        version = _peek(frame, "frame").get("v")
        if version != PROTOCOL_VERSION:
            raise VersionMismatch(version) from None
        raise MalformedMessage(f"bad envelope: {exc}") from None
    if envelope.v != PROTOCOL_VERSION:
        raise VersionMismatch(envelope.v)
    return envelope


def decode_request(payload: bytes) -> Request[Reply]:
    """A request of any op, every field checked (MalformedMessage naming the op and field)."""
    try:
        request = _REQUEST.decode(payload)
    except msgspec.MsgspecError as exc:
        raw = _peek(payload, "message")
        nonce = raw.get("nonce")
        nonce = nonce if isinstance(nonce, bytes) else None
        op = raw.get("op")
        if not isinstance(op, str) or op not in OPS:
            raise MalformedMessage(f"unknown op {op!r}", nonce=nonce) from None
        raise MalformedMessage(f"{op} request: {exc}", op=op, nonce=nonce) from None
    for name, unset in _REQUEST_HEADER:
        if getattr(request, name) == unset:
            raise MalformedMessage(f"{request.op} request: missing field {name!r}", op=request.op,
                                   nonce=request.nonce or None)
    return request


def _refusal(raw: dict[str, object]) -> Refusal:
    """An error reply, read leniently: whatever it says, the call fails."""
    re, reason, error = raw.get("re"), raw.get("reason"), raw.get("error")
    return Refusal(re=re if isinstance(re, bytes) else None, reason=reason if isinstance(reason, str) else "internal",
                   error=error if isinstance(error, str) else "no error text")


def decode_reply(payload: bytes, expect: type[R], what: str) -> R | Refusal:
    """A reply of type `expect` (every field checked), or the `Refusal` the producer answered instead;
    MalformedMessage (naming `what`) when it is neither."""
    decoder = _REPLIES.get(expect)
    if decoder is None:
        decoder = _REPLIES[expect] = msgspec.msgpack.Decoder(expect)
    try:
        reply = decoder.decode(payload)
    except msgspec.MsgspecError as exc:
        raw = _peek(payload, what)
        if raw.get("ok") is not True:
            return _refusal(raw)
        raise MalformedMessage(f"{what}: {exc}") from None
    if reply.ok is not True:  # a refusal that happens to carry this reply's fields too
        return _refusal(_peek(payload, what))
    return reply
