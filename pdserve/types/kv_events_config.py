"""`--kv-events-config`: vLLM's KVEventsConfig JSON (vllm/config/kv_events.py), same keys and defaults."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


@dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; default: zmq when events are enabled
    endpoint: str = "tcp://*:5557"  # PUB socket: bound when it has a wildcard (`*`), else connected
    replay_endpoint: str | None = None  # ROUTER socket answering "send me every batch from seq N"
    # ROUTER socket answering "snapshot" with the event-derived cache state (vLLM's docs/features/kv_events.md);
    # turns on 24-byte sequence frames (seq + publisher identity) and 1 s idle heartbeats
    snapshot_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark
    max_queue_size: int = 100_000  # batches queued for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv events publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"kv events {name} must be a positive integer, got {v!r}")
        for name in ("endpoint", "replay_endpoint", "snapshot_endpoint"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v.split("://", 1)[0] in ("tcp", "ipc", "inproc")
                                      and "://" in v):
                raise ValueError(f"kv events {name} must be a tcp://, ipc:// or inproc:// address, got {v!r}")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str | dict[str, Any] | None) -> KVEventsConfig | None:
        """None for no config; ValueError (one readable line) for a malformed one."""
        if text is None:
            return None
        try:
            raw = json.loads(text) if isinstance(text, str) else text
        except ValueError as e:
            raise ValueError(f"--kv-events-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**raw)
