"""A cached block's identity beyond its hash (torch-free: the block manager keeps one per cached block)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockMeta:
    """What a KV event needs to announce a block: its parent's hash (None for a first block) and tokens."""

    parent: bytes | None
    tokens: tuple[int, ...]
