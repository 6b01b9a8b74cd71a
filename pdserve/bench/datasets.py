"""Benchmark workloads: vLLM's random dataset, a JSONL file of prompts/conversations, a shared-prefix set.

Random (reference section 11.3): input lengths uniform in [floor(L'(1-r)), ceil(L'(1+r))] with
L' = input_len - the tokenizer's special tokens, outputs in [max(1, floor(O(1-r))), max(1, ceil(O(1+r)))],
a random vocabulary offset per request (so no two prompts share a prefix beyond `--random-prefix-len`),
prompt = non-special tokens at (offset + i + arange(L)) % n_allowed after a shared random prefix,
decoded, re-encoded and adjusted (<= 10 retries) to the target length. Seeded `numpy.default_rng`.
"""

from __future__ import annotations

import json
import math
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdserve.bench.types import SampleRequest

_ALLOWED: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()


def allowed_token_ids(tokenizer: Any) -> np.ndarray:
    """The base vocabulary minus special tokens, in id order.

    Unlike vLLM we also drop tokens that decode to nothing or to U+FFFD on their own (byte pieces of a
    multi-byte character): their text re-encodes as other tokens, so a prompt made of them can be stuck
    off its target length however it is trimmed.
    """
    cached = _ALLOWED.get(tokenizer)
    if cached is not None:
        return cached
    special = {int(i) for i in tokenizer.all_special_ids}
    ids = [i for i in range(int(tokenizer.vocab_size)) if i not in special]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        texts = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    else:
        texts = [tokenizer.decode([i]) for i in ids]
    clean = [i for i, text in zip(ids, texts, strict=True) if text and "\ufffd" not in text]
    allowed = np.array(clean or ids, dtype=np.int64)
    _ALLOWED[tokenizer] = allowed
    return allowed


def decode_to_target_len(
    tokenizer: Any,
    token_ids: list[int],
    target_len: int,
    rng: np.random.Generator,
    allowed: np.ndarray,
    max_retry: int = 10,
) -> tuple[str, list[int], int]:
    """Text whose re-encoding has `target_len` tokens if reachable in `max_retry` adjustments.

    Returns (prompt, its token ids, mismatch); `len(ids) == len(encode(prompt))` always holds.
    """
    remaining = max_retry
    mismatch = 0
    seq = list(token_ids)
    while True:
        prompt = tokenizer.decode(seq)
        seq = tokenizer.encode(prompt, add_special_tokens=False)
        if remaining <= 0:
            mismatch = len(seq) - target_len
            break
        if len(seq) == target_len:
            break
        if len(seq) < target_len:
            extra = allowed[rng.integers(0, len(allowed), size=target_len - len(seq))]
            seq = seq + [int(t) for t in extra]
        else:
            seq = seq[:target_len]
        remaining -= 1
    return prompt, seq, mismatch


def _length_bounds(mean: int, ratio: float, at_least_one: bool) -> tuple[int, int]:
    low = math.floor(mean * (1.0 - ratio))
    high = math.ceil(mean * (1.0 + ratio))
    if at_least_one:
        low, high = max(low, 1), max(high, 1)
    return low, high


def _warn_mismatch(total: int) -> None:
    if total:
        sign = "more" if total > 0 else "fewer"
        print(
            f"WARNING: across all generated prompts there were {abs(total)} {sign} tokens than expected "
            "after decoding and re-encoding (expected with some tokenizers).",
            file=sys.stderr,
        )


def sample_random(
    tokenizer: Any,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("range_ratio must be in [0, 1).")
    rng = np.random.default_rng(seed)
    num_special = int(tokenizer.num_special_tokens_to_add())
    real_input_len = max(0, int(input_len) - num_special)
    in_low, in_high = _length_bounds(real_input_len, range_ratio, at_least_one=False)
    out_low, out_high = _length_bounds(output_len, range_ratio, at_least_one=True)
    if prefix_len + in_low < 1:
        raise ValueError(
            f"--random-input-len is too small: with {num_special} special tokens and range ratio "
            f"{range_ratio} a prompt could have no tokens; increase --random-input-len or --random-prefix-len."
        )
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    offsets = rng.integers(0, int(tokenizer.vocab_size), size=num_requests)
    allowed = allowed_token_ids(tokenizer)
    prefix = (
        [int(t) for t in allowed[rng.integers(0, len(allowed), size=prefix_len)]] if prefix_len > 0 else []
    )
    requests: list[SampleRequest] = []
    mismatch_total = 0
    for i in range(num_requests):
        n = int(input_lens[i])
        inner = allowed[(int(offsets[i]) + i + np.arange(n)) % len(allowed)]
        prompt, ids, mismatch = decode_to_target_len(
            tokenizer, prefix + [int(t) for t in inner], prefix_len + n, rng, allowed
        )
        mismatch_total += mismatch
        requests.append(
            SampleRequest(prompt=prompt, prompt_len=len(ids), expected_output_len=int(output_lens[i]))
        )
    _warn_mismatch(mismatch_total)
    return requests


def sample_shared_prefix(
    tokenizer: Any,
    num_requests: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """`num_prefixes` random prefixes, each request = one of them + its own random suffix, shuffled.

    Request i uses prefix i % num_prefixes, so exactly `num_requests` requests come back (vLLM's
    prefix_repetition drops the remainder); suffixes are fresh per request.
    """
    if num_prefixes < 1:
        raise ValueError("--num-prefixes must be at least 1")
    if num_requests < num_prefixes:
        raise ValueError(f"num_requests ({num_requests}) must be >= num_prefixes ({num_prefixes})")
    if prefix_len + suffix_len < 1:
        raise ValueError("--prefix-len + --suffix-len must be at least 1")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)
    mismatch_total = 0

    def exact(n: int) -> list[int]:
        nonlocal mismatch_total
        if n <= 0:
            return []
        ids = [int(t) for t in allowed[rng.integers(0, len(allowed), size=n)]]
        _, adjusted, mismatch = decode_to_target_len(tokenizer, ids, n, rng, allowed)
        mismatch_total += mismatch
        return adjusted

    prefixes = [exact(prefix_len) for _ in range(num_prefixes)]
    requests: list[SampleRequest] = []
    for i in range(num_requests):
        combined = prefixes[i % num_prefixes] + exact(suffix_len)
        prompt = tokenizer.decode(combined)
        requests.append(
            SampleRequest(prompt=prompt, prompt_len=len(combined), expected_output_len=output_len)
        )
    _warn_mismatch(mismatch_total)
    order = rng.permutation(num_requests)
    return [requests[int(j)] for j in order]


def _validate_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"{where}: each message needs a 'role' and a 'content'")
    return messages


def _messages_text(messages: Sequence[dict[str, Any]]) -> str:
    parts: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(c.get("text", "")) for c in content if isinstance(c, dict))
    return "\n".join(parts)


def load_jsonl(
    path: str,
    num_requests: int,
    default_output_len: int,
    tokenizer: Any | None = None,
    seed: int = 0,
    shuffle: bool = False,
) -> list[SampleRequest]:
    """Lines of `{"prompt": str}` or `{"messages": [...]}`, optional `"output_len"`.

    The file is cycled if it has fewer lines than `num_requests`. `prompt_len` is the local token count
    when a tokenizer is given (the server's usage.prompt_tokens replaces it when streamed back).
    """
    entries: list[SampleRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: invalid JSON ({err})") from err
            if not isinstance(row, dict):
                raise ValueError(f"{where}: each line must be a JSON object")
            output_len = row.get("output_len", default_output_len)
            if not isinstance(output_len, int) or output_len < 1:
                raise ValueError(f"{where}: output_len must be a positive integer")
            messages = None
            if "messages" in row:
                messages = _validate_messages(row["messages"], where)
                text = _messages_text(messages)
            elif isinstance(row.get("prompt"), str):
                text = row["prompt"]
            else:
                raise ValueError(f"{where}: needs a string 'prompt' or a 'messages' list")
            prompt_len = len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else 0
            entries.append(SampleRequest(text, prompt_len, output_len, chat_messages=messages))
    if not entries:
        raise ValueError(f"{path}: no requests")
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(entries))
        entries = [entries[int(j)] for j in order]
    return [entries[i % len(entries)] for i in range(num_requests)]
