"""KV cache events and their wire form, as vLLM publishes them (vllm/distributed/kv_events.py).

vLLM declares the batch and the events as msgspec Structs with `array_like=True, omit_defaults=True` and
the events `tag=True`, so msgpack carries positional arrays, each event led by its class name:

    KVEventBatch     = [ts: float, events: [event, ...], data_parallel_rank: int]
    BlockStored      = ["BlockStored", block_hashes: [u64...], parent_block_hash: u64 | nil,
                        token_ids: [int...], block_size: int, lora_id: nil, medium: str, lora_name: nil]
    BlockRemoved     = ["BlockRemoved", block_hashes: [u64...], medium: str]
    AllBlocksCleared = ["AllBlocksCleared"]

(Trailing fields equal to their defaults — extra_keys, group_idx, ... — are omitted, as msgspec does.)
Block hashes are `block_hash.external_block_hash` values. `medium` names where the blocks live: "GPU" for
the engine's own KV pool (vLLM's name for it, also on a CPU-only instance), "CPU" for the host-memory
offload tier and "DISK" for the disk tier. Torch-free and zmq-free: the proxy decodes with this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

MEDIUM_DEVICE = "GPU"  # the engine's KV pool (vLLM's MEDIUM_GPU)
MEDIUM_HOST = "CPU"  # the host-memory offload tier (vLLM's CPULoadStoreSpec.medium())
MEDIUM_DISK = "DISK"  # the disk tier


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = MEDIUM_DEVICE
    lora_id: int | None = None
    lora_name: str | None = None

    def to_wire(self) -> list[Any]:
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size,
                self.lora_id, self.medium, self.lora_name]


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_DEVICE

    def to_wire(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass
class AllBlocksCleared:
    medium: str | None = None  # not on the wire (vLLM's event has no fields); kept for local bookkeeping

    def to_wire(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventBatch:
    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)
    data_parallel_rank: int | None = 0


def encode_batch(batch: KVEventBatch) -> bytes:
    wire: list[Any] = [float(batch.ts), [e.to_wire() for e in batch.events]]
    if batch.data_parallel_rank is not None:  # omit_defaults: a None rank is left off
        wire.append(batch.data_parallel_rank)
    return msgpack.packb(wire, use_bin_type=True)


class EventDecodeError(ValueError):
    pass


def _field(obj: list | dict, i: int, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return obj[i] if i < len(obj) else default


def _decode_event(raw: Any) -> KVCacheEvent:
    if isinstance(raw, dict):  # a map-form producer (msgspec without array_like): tag under "type"
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise EventDecodeError(f"not an event: {raw!r:.80}")
    if tag == "BlockStored":
        return BlockStored(
            block_hashes=list(_field(raw, 1, "block_hashes", [])), parent_block_hash=_field(raw, 2, "parent_block_hash"),
            token_ids=list(_field(raw, 3, "token_ids", [])), block_size=int(_field(raw, 4, "block_size", 0)),
            lora_id=_field(raw, 5, "lora_id"), medium=_field(raw, 6, "medium"), lora_name=_field(raw, 7, "lora_name"))
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=list(_field(raw, 1, "block_hashes", [])), medium=_field(raw, 2, "medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventDecodeError(f"unknown event type {tag!r}")


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decodes a batch from vLLM or pdserve (array form; map form tolerated; unknown trailing fields
    ignored). Raises EventDecodeError for anything else."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for malformed input
        raise EventDecodeError(f"not msgpack: {e}") from e
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise EventDecodeError(f"not an event batch: {raw!r:.80}")
    if not isinstance(events, list) or not isinstance(ts, int | float):
        raise EventDecodeError("an event batch is [ts, [events...], rank]")
    return KVEventBatch(ts=float(ts), events=[_decode_event(e) for e in events], data_parallel_rank=rank)
