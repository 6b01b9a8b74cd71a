"""Incremental detokenisation with prefix/read offsets, as vLLM does it.

Each step decodes only a small window of ids: `[prefix_offset, read_offset)` (text already emitted, kept
as context so that decoders which look at neighbours, e.g. SentencePiece's leading space, behave) and
`[prefix_offset, end)`. The difference is the new text. A window that ends in U+FFFD is an incomplete
UTF-8 sequence (a character split over byte tokens): nothing is emitted until it completes. The windows
stay a few tokens long, so the work per token is O(1) however long the output grows.
"""

from __future__ import annotations

from typing import Protocol

# How many prompt tokens seed the window, so the first output token decodes with its real context.
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class _WindowDecoder(Protocol):
    special_token_ids: frozenset[int]  # ids a decode with skip_special_tokens leaves out

    def decode_window(self, token_ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: _WindowDecoder, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Skipped ids never enter the window: the decode would drop them anyway, and a long run of them
        # would otherwise widen every later window.
        self._skip: frozenset[int] = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        context = [t for t in prompt_token_ids if t not in self._skip][-INITIAL_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        # Text of [prefix_offset, read_offset), cached so each step decodes one window, not two.
        self._prefix_text = self._decode(0, len(context))

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode_window(self._ids[start:end], self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Adds one token; returns the text it completes ("" while a character is still partial)."""
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._compact()
        return delta

    def flush(self) -> str:
        """At the end of the output: the text still held back (an incomplete character decodes as U+FFFD)."""
        if self._read_offset >= len(self._ids):
            return ""
        new_text = self._decode(self._prefix_offset, len(self._ids))
        delta = new_text[len(self._prefix_text):] if len(new_text) > len(self._prefix_text) else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return delta

    def _compact(self) -> None:
        # Drop ids left of the window so the list does not grow with the output.
        if self._prefix_offset > 64:
            cut = self._prefix_offset
            del self._ids[:cut]
            self._prefix_offset -= cut
            self._read_offset -= cut
