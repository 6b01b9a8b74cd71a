"""The KV side channel's typed messages and their one codec (pdserve/kv_transfer/messages.py): every request and
reply survives a round trip, the wire form is the documented msgpack map, and malformed or unknown messages are
refused with errors that name the op and the field."""

from __future__ import annotations

import re

import msgpack
import msgspec
import pytest

from pdserve.kv_transfer.compat import PROTOCOL_VERSION, make_compat
from pdserve.kv_transfer.messages import (
    OPS,
    REQUEST_TYPES,
    Abort,
    AbortReply,
    Claim,
    ClaimReply,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatReply,
    KvDigests,
    KvDigestsReply,
    MalformedMessage,
    PushCancel,
    PushRegister,
    PushStateReply,
    PushStatus,
    PushStatusReply,
    RankEntry,
    Refusal,
    Release,
    ReleaseReply,
    Reply,
    Request,
    VersionMismatch,
    decode_envelope,
    decode_reply,
    decode_request,
    encode,
    encode_envelope,
)
from pdserve.kv_transfer.pool import RemotePool

POOL = RemotePool(base_addr=1 << 40, length=64 * 4096, mem_type="VRAM", device_id=1, block_bytes=4096, num_blocks=64)
SHARD = RemotePool(base_addr=2 << 40, length=64 * 4096, mem_type="VRAM", device_id=2, block_bytes=4096, num_blocks=64)
COMPAT = make_compat(model="m", dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64)
HEADER = {"to": "prefill-0", "ts": 1234.5, "nonce": b"n" * 16}
RANKS = (RankEntry("agent-0", b"meta-0", POOL), RankEntry("agent-1", b"meta-1", SHARD))

REQUESTS: list[Request[Reply]] = [
    Handshake(engine_id="decode-0", compat=COMPAT, **HEADER),
    Claim(request_id="r", lease_token="lt", generation=7, timeout_s=2.5, **HEADER),
    Release(request_id="r", lease_token="lt", claim_token="ct", **HEADER),
    Abort(request_id="r", lease_token="lt", **HEADER),
    Heartbeat(request_ids=("a", "b"), lease_tokens=("x", "y"), **HEADER),
    PushRegister(push_key="k", generation=7, engine_id="decode-0", agent_name="agent-0", agent_metadata=b"meta-0",
                 seal_nonce=b"s" * 16, pool=POOL, block_ids=(3, 1, 2), first_block=1, num_tokens=60, timeout_s=30.0,
                 **HEADER),
    PushRegister(push_key="k", generation=7, engine_id="decode-0", agent_name="agent-0", agent_metadata=b"meta-0",
                 seal_nonce=b"s" * 16, pool=POOL, block_ids=(3,), first_block=0, num_tokens=10, timeout_s=30.0,
                 ranks=RANKS, **HEADER),
    PushStatus(push_keys=("k", "j"), **HEADER),
    PushCancel(push_key="k", **HEADER),
    KvDigests(push_key="k", **HEADER),
]
REPLIES: list[Reply] = [
    HandshakeReply(re=b"n" * 16, engine_id="prefill-0", agent_name="agent-0", agent_metadata=b"meta-0", generation=7,
                   compat=COMPAT, pool=POOL, lease_duration_s=30.0, tp_size=2, ranks=RANKS),
    HandshakeReply(re=b"n" * 16, engine_id="prefill-0", agent_name="agent-0", agent_metadata=b"meta-0", generation=7,
                   compat=COMPAT, pool=POOL, lease_duration_s=30.0),
    ClaimReply(re=b"n" * 16, block_ids=(4, 5), claim_token="ct"),
    ReleaseReply(re=b"n" * 16, held_throughout=True),
    AbortReply(re=b"n" * 16, freed=False),
    HeartbeatReply(re=b"n" * 16, unknown=("a",)),
    PushStateReply(re=b"n" * 16, state="registered"),
    PushStatusReply(re=b"n" * 16, states=("done", "pending"), errors=("", ""),
                    first_tokens=({"first_token_id": 42}, None)),
    KvDigestsReply(re=b"n" * 16, digests=(("1_2", "3_4"), ("5_6", "7_8")), algo="xxh3_128"),
]


def test_every_op_has_a_request_type_and_its_reply_type() -> None:
    assert {type(r) for r in REQUESTS} == set(REQUEST_TYPES)
    assert len(OPS) == len(REQUEST_TYPES)
    for kind in REQUEST_TYPES:
        assert issubclass(kind.reply_type, Reply) and kind.reply_type is not Reply
    assert Claim.reply_type is ClaimReply and PushRegister.reply_type is PushCancel.reply_type is PushStateReply


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.op)
def test_requests_round_trip(request_: Request[Reply]) -> None:
    assert decode_request(encode(request_)) == request_


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_replies_round_trip(reply: Reply) -> None:
    assert decode_reply(encode(reply), type(reply), "test reply") == reply


@pytest.mark.parametrize("message", [*REQUESTS, *REPLIES], ids=lambda m: type(m).__name__)
def test_the_bytes_are_what_msgpack_python_packs_for_the_same_map(message: Request[Reply] | Reply) -> None:
    """The dict-based side channel before the typed messages packed each map with msgpack-python; with the same
    keys in the same order (below), msgspec writes the same bytes (str/bin types, int widths, float64), but for
    the length header of a map it omitted a field from."""
    payload = encode(message)
    repacked = msgpack.packb(msgpack.unpackb(payload), use_bin_type=True)
    if message.__struct_config__.omit_defaults and len(msgpack.unpackb(payload)) < 16:
        # omitting fields, msgspec writes a map16 header (it counts the entries afterwards): the same map
        assert payload[0] == 0xDE and payload[3:] == repacked[1:]
    else:
        assert payload == repacked


def test_the_wire_form_is_the_documented_map() -> None:
    """What older peers and raw-frame tools read: a msgpack map by field name, the op (or re/ok) first."""
    claim = msgpack.unpackb(encode(REQUESTS[1]))
    assert list(claim) == ["op", "to", "ts", "nonce", "request_id", "lease_token", "generation", "timeout_s"]
    assert claim["op"] == "claim" and claim["nonce"] == b"n" * 16 and claim["generation"] == 7
    # a push registration without tensor parallelism carries no `ranks` (as before the messages were typed)
    assert "ranks" not in msgpack.unpackb(encode(REQUESTS[5]))
    assert [r["agent_name"] for r in msgpack.unpackb(encode(REQUESTS[6]))["ranks"]] == ["agent-0", "agent-1"]
    reply = msgpack.unpackb(encode(REPLIES[2]))
    assert list(reply) == ["re", "ok", "block_ids", "claim_token"] and reply["ok"] is True
    refusal = msgpack.unpackb(encode(Refusal(re=None, reason="expired", error="lease expired")))
    assert refusal == {"re": None, "ok": False, "reason": "expired", "error": "lease expired"}
    pool = msgpack.unpackb(encode(REPLIES[0]))["pool"]
    assert list(pool) == ["base_addr", "length", "mem_type", "device_id", "block_bytes", "num_blocks"]
    envelope = msgpack.unpackb(encode_envelope(b"msg", None))
    assert envelope == {"v": PROTOCOL_VERSION, "msg": b"msg", "mac": None}


def test_a_peer_s_extra_fields_are_ignored_and_ints_read_as_floats() -> None:
    raw = {**msgpack.unpackb(encode(REQUESTS[1])), "timeout_s": 3, "from_a_newer_peer": [1, 2]}
    claim = decode_request(msgpack.packb(raw))
    assert isinstance(claim, Claim) and claim.timeout_s == 3.0


def _request(**fields: object) -> bytes:
    return msgpack.packb({"op": "claim", **HEADER, "request_id": "r", "lease_token": "lt", "generation": 1,
                          "timeout_s": 2.0, **fields})


@pytest.mark.parametrize(("payload", "text", "op"), [
    (_request(op="steal"), "unknown op 'steal'", None),
    (msgpack.packb({**HEADER, "request_id": "r"}), "unknown op None", None),
    (_request(generation=True), "claim request: Expected `int`, got `bool` - at `$.generation`", "claim"),
    (_request(request_id=5), "claim request: Expected `str`, got `int` - at `$.request_id`", "claim"),
    (_request(timeout_s="soon"), "claim request: Expected `float`, got `str` - at `$.timeout_s`", "claim"),
    (msgpack.packb({"op": "abort", **HEADER, "request_id": "r"}),
     "abort request: Object missing required field `lease_token`", "abort"),
    (_request(nonce=b""), "claim request: missing field 'nonce'", "claim"),
    (msgpack.packb({k: v for k, v in msgpack.unpackb(_request()).items() if k != "to"}),
     "claim request: missing field 'to'", "claim"),
    (msgpack.packb([1, 2]), "message is not a map", None),
    (b"\xc1", "undecodable message", None),
])
def test_malformed_requests_are_refused_naming_op_and_field(payload: bytes, text: str, op: str | None) -> None:
    with pytest.raises(MalformedMessage) as exc:
        decode_request(payload)
    assert text in str(exc.value)
    assert exc.value.op == op
    if payload not in (b"\xc1", msgpack.packb([1, 2])) and text != "claim request: missing field 'nonce'":
        assert exc.value.nonce == HEADER["nonce"]  # the refusal answers it


def test_messages_that_cannot_be_are_malformed() -> None:
    base = msgpack.unpackb(encode(REQUESTS[6]))  # a TP=2 registration
    for change, text in (
        ({"pool": {**base["pool"], "mem_type": "HBM"}}, "unknown memory type 'HBM' - at `$.pool`"),
        ({"pool": {**base["pool"], "num_blocks": 10**9}}, "geometry is inconsistent"),
        ({"agent_name": "agent-1"}, "ranks[0] is not the sender's own agent"),
        ({"ranks": [base["ranks"][0], base["ranks"][0]]}, "ranks repeat an agent name"),
        ({"ranks": [base["ranks"][0], {**base["ranks"][1], "pool": {**base["ranks"][1]["pool"], "num_blocks": 32}}]},
         "ranks have different block counts"),
        ({"ranks": []}, "ranks must be a non-empty list"),
        ({"block_ids": [1, "2"]}, "Expected `int`, got `str` - at `$.block_ids[1]`"),
    ):
        with pytest.raises(MalformedMessage, match=f"push_register request: .*{re.escape(text)}"):
            decode_request(msgpack.packb({**base, **change}))
    hello = msgpack.unpackb(encode(REPLIES[0]))
    with pytest.raises(MalformedMessage, match="handshake says tp_size 3 but lists 2 rank"):
        decode_reply(msgpack.packb({**hello, "tp_size": 3}), HandshakeReply, "handshake reply")
    with pytest.raises(MalformedMessage, match="handshake ranks\\[0\\] is not the sender's own agent"):
        decode_reply(msgpack.packb({**hello, "ranks": hello["ranks"][::-1]}), HandshakeReply, "handshake reply")


def test_a_reply_is_its_type_or_a_refusal() -> None:
    refused = decode_reply(msgpack.packb({"re": b"n", "ok": False, "reason": "expired", "error": "gone"}),
                           ClaimReply, "claim reply")
    assert refused == Refusal(re=b"n", reason="expired", error="gone")
    # a refusal's fields are read leniently: whatever it says, the call fails
    odd = decode_reply(msgpack.packb({"ok": "no", "reason": 7}), ClaimReply, "claim reply")
    assert odd == Refusal(re=None, reason="internal", error="no error text")
    # ok, but not this op's reply
    with pytest.raises(MalformedMessage, match="claim reply: Object missing required field `block_ids`"):
        decode_reply(encode(REPLIES[3]), ClaimReply, "claim reply")
    with pytest.raises(MalformedMessage, match="release reply: Expected `bool`, got `str`"):
        decode_reply(msgpack.packb({"re": b"n", "ok": True, "held_throughout": "yes"}), ReleaseReply, "release reply")
    with pytest.raises(MalformedMessage, match="undecodable claim reply"):
        decode_reply(b"\xc1", ClaimReply, "claim reply")


def test_envelopes_check_the_version_first() -> None:
    env = decode_envelope(encode_envelope(b"payload", b"mac"))
    assert (env.v, env.msg, env.mac) == (PROTOCOL_VERSION, b"payload", b"mac")
    with pytest.raises(VersionMismatch) as exc:
        decode_envelope(msgpack.packb({"v": 1, "op": "claim"}))  # protocol 1 had no envelope
    assert exc.value.version == 1
    with pytest.raises(VersionMismatch):
        decode_envelope(msgpack.packb({"v": 3, "msg": b"", "mac": None}))
    with pytest.raises(MalformedMessage, match="bad envelope: Expected `bytes`, got `str` - at `\\$.msg`"):
        decode_envelope(msgpack.packb({"v": PROTOCOL_VERSION, "msg": "text"}))
    for frame, text in ((b"\xc1", "undecodable frame"), (msgpack.packb("x"), "frame is not a map")):
        with pytest.raises(MalformedMessage, match=text):
            decode_envelope(frame)


def test_structs_are_frozen() -> None:
    with pytest.raises(AttributeError):
        REQUESTS[1].request_id = "other"  # type: ignore[misc]
    assert msgspec.structs.replace(REQUESTS[1], nonce=b"m" * 16).nonce == b"m" * 16
