"""Which decode instance holds a conversation's KV (multi-turn over P/D, vLLM's bidirectional_kv_xfer).

A decode instance started with `bidirectional_kv_xfer` keeps a finished decode leg's blocks (prompt + answer)
for `decoder_kv_blocks_ttl` seconds and returns `kv_transfer_params` naming them (in the response, or the
final SSE chunk). The proxy remembers those params under a key of the request's conversation so far; the
next turn of the same conversation (its messages start with the previous turn's messages, or its prompt
with the previous prompt) finds them and its prefill leg carries them: the prefill instance reads that
prefix back instead of recomputing it. No client change is needed.

Keys are prefix hashes, chained so that every prefix of a conversation has one without rehashing it:
chat messages one message at a time, completions prompts in chunks (`_TEXT_CHUNK` characters or
`_IDS_CHUNK` token ids; a prompt is remembered under its last whole chunk). A key only says where to
look: the prefill instance compares the block hashes of its own prompt with the ones the params list and
reads only the blocks that match, so a key that finds another conversation's history (same messages, a
chunk-boundary coincidence) can cost a lookup but never give wrong tokens.

One held history serves one read (its lease is consumed), so `take` removes the entry. The table is
bounded (LRU) and drops entries whose lease has expired. It is one more source of "who holds which
prefix" for the fleet index (issue 18), kept separate and small until that index exists.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.api.pd import (
    held_block_bytes,
    held_expires_at,
    held_num_blocks,
    held_num_tokens,
    names_held_history,
)

_TEXT_CHUNK = 64  # characters of a completions prompt per key step
_IDS_CHUNK = 16  # token ids of a completions prompt per key step (a common KV block)
_MAX_KEYS_PER_BODY = 8192  # bounds the work of one lookup (longer prompts are keyed by their start)


@dataclass(frozen=True)
class HeldHistory:
    params: dict[str, Any]  # the decode instance's kv_transfer_params, verbatim
    decode_url: str
    prompt_tokens: int | None  # the previous turn's prompt length (the prefill that computed it may cache it)

    @property
    def num_tokens(self) -> int:
        return held_num_tokens(self.params)

    @property
    def num_blocks(self) -> int:
        return held_num_blocks(self.params)

    @property
    def block_size(self) -> int | None:
        """Tokens per held block (the holder's block size), when the params say."""
        n = self.num_blocks
        return self.num_tokens // n if n and self.num_tokens % n == 0 else None

    @property
    def block_bytes(self) -> int | None:
        """Bytes of one held block on the wire (all ranks), when the holder says."""
        return held_block_bytes(self.params)

    @property
    def expires_at(self) -> float | None:
        return held_expires_at(self.params)


def held_history_params(params: Any) -> dict[str, Any] | None:
    """The params of a decode response when they name a held history (`pdserve.api.pd.names_held_history`),
    else None."""
    return params if names_held_history(params) else None


def _digest(parent: bytes, part: Any) -> bytes:
    data = json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")
    return hashlib.blake2b(parent + data, digest_size=16).digest()


def conversation_keys(api_path: str, body: dict[str, Any]) -> list[bytes]:
    """The chained prefix keys of a request's conversation, shortest first: key i covers messages[:i+1]
    (chat) or the prompt's first i+1 chunks (completions). Empty when the request has no single
    conversation (several prompts, no messages)."""
    scope = _digest(b"", [api_path, body.get("model"), body.get("cache_salt")])
    keys: list[bytes] = []
    messages = body.get("messages")
    if isinstance(messages, list):
        h = scope
        for message in messages[:_MAX_KEYS_PER_BODY]:
            h = _digest(h, message)
            keys.append(h)
        return keys
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        chunk = _TEXT_CHUNK
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        chunk = _IDS_CHUNK
    else:
        return keys
    h = scope
    for start in range(0, min(len(prompt), chunk * _MAX_KEYS_PER_BODY), chunk):
        part = prompt[start : start + chunk]
        if len(part) < chunk:
            break  # keys cover whole chunks only: the next turn's prompt extends this one past its end
        h = _digest(h, part)
        keys.append(h)
    return keys


class ConversationHistory:
    """Bounded map: conversation prefix key -> the decode instance's held history for it."""

    def __init__(self, max_entries: int = 4096, clock: Callable[[], float] = time.time) -> None:
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[bytes, HeldHistory] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, api_path: str, body: dict[str, Any], params: dict[str, Any], decode_url: str,
                 prompt_tokens: int | None = None) -> bool:
        """Keep a decode response's held-history params under the key of the request's whole conversation.
        For chat the key covers the request's messages (the next turn adds the answer and a new message);
        for completions, the prompt's whole chunks."""
        keys = conversation_keys(api_path, body)
        if not keys or held_history_params(params) is None:
            return False
        key = keys[-1]
        self._entries.pop(key, None)
        self._entries[key] = HeldHistory(params, decode_url, prompt_tokens)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return True

    def take(self, api_path: str, body: dict[str, Any]) -> HeldHistory | None:
        """The held history of the longest earlier turn of this request's conversation, removed from the
        table (a held history serves one read); None when there is none or it has expired."""
        keys = conversation_keys(api_path, body)
        # chat: messages[:-1] at most (the request adds at least one message); completions: any whole chunk
        candidates = keys[:-1] if isinstance(body.get("messages"), list) else keys
        now = self._clock()
        for key in reversed(candidates):
            entry = self._entries.pop(key, None)
            if entry is None:
                continue
            if entry.expires_at is not None and entry.expires_at <= now:
                continue  # its lease is over: the decode instance has freed (or will free) the blocks
            self.hits += 1
            return entry
        self.misses += 1
        return None

    def drop_expired(self) -> int:
        now = self._clock()
        gone = [k for k, e in self._entries.items() if e.expires_at is not None and e.expires_at <= now]
        for k in gone:
            del self._entries[k]
        return len(gone)
