"""The P/D wire protocol as vLLM's proxies speak it: pure functions over request/response JSON.

Prefill leg: the client's body with the 6-key `kv_transfer_params`, `stream=false`, `max_tokens=1`
(`max_completion_tokens=1` when present) and without `stream_options`, `min_tokens`,
`min_completion_tokens`. Decode leg: the client's body plus the prefill's `kv_transfer_params` verbatim.
Chat variant: the prefill is asked for `return_token_ids` and the decode gets `prompt_token_ids` inside
its `kv_transfer_params` (text-only messages, no echo, no batch).
"""

from __future__ import annotations

from typing import Any

# What a prefill leg sends, exactly as vLLM's toy proxy does.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Keys the prefill leg must not carry (they conflict with max_tokens=1 or stream=false).
_PREFILL_DROPPED_KEYS = ("stream_options", "min_tokens", "min_completion_tokens")

CHARS_PER_TOKEN = 4  # cheap prompt-length estimate; good enough for balancing and thresholds
_TOKENS_PER_MESSAGE = 4  # template overhead of one chat message


def wants_chat_token_ids(body: dict[str, Any]) -> bool:
    """Whether a chat request may use the prompt_token_ids hand-off (vLLM honours it only for
    single-conversation, text-only messages without echo)."""
    if body.get("echo"):
        return False
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return False
    for message in messages:
        if not isinstance(message, dict):
            return False  # a batch of conversations (list of lists) or malformed
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            return False
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                return False
    return True


def build_prefill_body(body: dict[str, Any], *, chat_token_ids: bool = False) -> dict[str, Any]:
    """The prefill leg's body (a new dict; `body` is not modified)."""
    prefill = dict(body)
    prefill["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    prefill["stream"] = False
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    for key in _PREFILL_DROPPED_KEYS:
        prefill.pop(key, None)
    if chat_token_ids:
        prefill["return_token_ids"] = True
    return prefill


def prefill_kv_params(response: Any) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill response, or None when it has none (an error, an abort,
    or an instance without a KV connector)."""
    if not isinstance(response, dict):
        return None
    params = response.get("kv_transfer_params")
    if isinstance(params, dict) and params:
        return params
    return None


def prefill_prompt_token_ids(response: dict[str, Any]) -> list[int] | None:
    """The top-level `prompt_token_ids` of a chat prefill response asked with `return_token_ids`,
    validated as vLLM's decode side would (non-empty, non-negative plain ints)."""
    ids = response.get("prompt_token_ids")
    if not isinstance(ids, list) or not ids:
        return None
    for token in ids:
        if type(token) is not int or token < 0:
            return None
    return ids


def build_decode_body(
    body: dict[str, Any],
    kv_params: dict[str, Any],
    *,
    prompt_token_ids: list[int] | None = None,
    remote_host: str | None = None,
) -> dict[str, Any]:
    """The decode leg's body: the client's body plus the prefill's params, copied verbatim except for
    the opt-in `prompt_token_ids` hand-off and `remote_host` rewrite."""
    params = kv_params
    if prompt_token_ids is not None or (remote_host is not None and "remote_host" in kv_params):
        params = dict(kv_params)
        if prompt_token_ids is not None:
            params["prompt_token_ids"] = prompt_token_ids
        if remote_host is not None and "remote_host" in params:
            params["remote_host"] = remote_host
    decode = dict(body)
    decode["kv_transfer_params"] = params
    return decode


def is_batch_prompt(body: dict[str, Any]) -> bool:
    """A completions request with several prompts: one prefill response carries only the first
    prompt's params (vLLM returns `final_res_batch[0]`'s), so such requests cannot be disaggregated
    as one P/D pair."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) <= 1:
        return False
    # A single prompt given as token ids is a flat list of ints.
    return not all(type(x) is int for x in prompt)


def local_only_reason(body: dict[str, Any]) -> str | None:
    """Why a request cannot be served as one P/D pair (a decode instance then serves it whole), or None.

    - several prompts: the prefill response carries only the first prompt's params;
    - n/best_of > 1: every sampled choice would claim the same prefill's KV lease;
    - prompt logprobs (`prompt_logprobs`, or completions `echo` with `logprobs`): they need the prompt's
      logits, which only the prefill instance computed.
    """
    if is_batch_prompt(body):
        return "several prompts"
    for key in ("n", "best_of"):
        value = body.get(key)
        if type(value) is int and value > 1:
            return f"{key} > 1"
    if body.get("prompt_logprobs") is not None or (body.get("echo") and body.get("logprobs") is not None):
        return "prompt logprobs"
    return None


def _text_of_content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"
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
