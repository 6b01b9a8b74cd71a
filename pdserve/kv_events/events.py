"""KV cache events and their wire form, as current vLLM publishes them (vllm/distributed/kv_events.py after
vllm#42892, "[KV Events] Switch event structs from array to map encoding").

vLLM declares the events as msgspec Structs with `omit_defaults=True, tag=True` and, since #42892, without
`array_like`: each event is a msgpack map keyed by field name, its class name under "type". The batch
envelope stays positional, as vLLM 0.26 publishes it and as Dynamo's and llm-d's decoders require:

    KVEventBatch     = [ts: float, [event, ...], data_parallel_rank: int]
    BlockStored      = {"type": "BlockStored", "block_hashes": [u64...], "parent_block_hash": u64 | nil,
                        "token_ids": [int...], "block_size": int, "lora_id": nil, "medium": str,
                        "lora_name": nil, "extra_keys": [nil per block], "group_idx": 0,
                        "kv_cache_spec_kind": "full_attention"}
    BlockRemoved     = {"type": "BlockRemoved", "block_hashes": [u64...], "medium": str, "group_idx": 0}
    AllBlocksCleared = {"type": "AllBlocksCleared"}

Consumers select fields by name and ignore unknown ones (llm-d-kv-cache#661, Dynamo's zmq_wire decoder).
`decode_batch` reads this form, the positional form of vLLM before #42892 (`["BlockStored", hashes,
parent, tokens, block_size, lora_id, medium, lora_name, ...]`), and a map-form envelope.
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
KV_GROUP = 0  # vLLM's KV cache group index: pdserve's models have one group, of full attention
KV_SPEC_KIND = "full_attention"


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = MEDIUM_DEVICE
    lora_id: int | None = None
    lora_name: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": self.block_hashes, "parent_block_hash": self.parent_block_hash,
                "token_ids": self.token_ids, "block_size": self.block_size, "lora_id": self.lora_id,
                "medium": self.medium, "lora_name": self.lora_name,
                # no multimodal, LoRA or salt keys in any block (vLLM lists one entry per block)
                "extra_keys": [None] * len(self.block_hashes), "group_idx": KV_GROUP, "kv_cache_spec_kind": KV_SPEC_KIND}


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_DEVICE

    def to_wire(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium, "group_idx": KV_GROUP}


@dataclass
class AllBlocksCleared:
    medium: str | None = None  # not on the wire (vLLM's event has no fields); kept for local bookkeeping

    def to_wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


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
    if isinstance(raw, dict):  # current vLLM (#42892): a map, the tag under "type"
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:  # vLLM before #42892: a tagged positional array
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
    """Decodes a batch from vLLM (either event form, either envelope) or pdserve; unknown fields are
    ignored. Raises EventDecodeError for anything else."""
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
