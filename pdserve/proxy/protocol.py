"""What the proxy reads from a client body to route it: prompt-length and output-length estimates, and
the prefix-affinity key. The P/D legs themselves are built by `pdserve.api.pd` (the wire contract)."""

from __future__ import annotations

from typing import Any

CHARS_PER_TOKEN = 4  # cheap prompt-length estimate; good enough for balancing and thresholds
_TOKENS_PER_MESSAGE = 4  # template overhead of one chat message


def _text_of_content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        )
    return ""


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A cheap prompt-length estimate: characters / 4 for text, exact for token ids."""
    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, str):
            return len(prompt) // CHARS_PER_TOKEN + 1
        if isinstance(prompt, list):
            if all(type(x) is int for x in prompt):
                return len(prompt)
            total = 0
            for item in prompt:
                if isinstance(item, str):
                    total += len(item) // CHARS_PER_TOKEN + 1
                elif isinstance(item, list):
                    total += len(item)
            return total
        return 0
    messages = body.get("messages")
    if isinstance(messages, list):
        total = 0
        for message in messages:
            if isinstance(message, dict):
                total += len(_text_of_content(message.get("content"))) // CHARS_PER_TOKEN
                total += _TOKENS_PER_MESSAGE
        return total
    return 0


def max_output_tokens(body: dict[str, Any]) -> int:
    """The requested output length (0 when unspecified)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if type(value) is int and value > 0:
            return value
    return 0


def affinity_key(body: dict[str, Any], n_chars: int) -> str | None:
    """The first `n_chars` characters of the prompt (or of the role-tagged messages): requests sharing
    a prefix map to the same prefill instance, whose prefix cache then hits."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:n_chars]
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first[:n_chars]
        ids = first if isinstance(first, list) else prompt
        # Token ids: about CHARS_PER_TOKEN characters each.
        return ",".join(str(x) for x in ids[: max(1, n_chars // CHARS_PER_TOKEN)])
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        parts: list[str] = []
        size = 0
        for message in messages:
            if not isinstance(message, dict):
                break
            text = f"{message.get('role', '')}\x00{_text_of_content(message.get('content'))}\x01"
            parts.append(text)
            size += len(text)
            if size >= n_chars:
                break
        return "".join(parts)[:n_chars]
    return None
