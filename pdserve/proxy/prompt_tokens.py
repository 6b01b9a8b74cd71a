"""The prompt token ids of a client request, as the instances will see them (for routing by cached prefix).

Two sources, with the server's defaults for every field (`pdserve/api/openai/protocol.py`):
- a local tokenizer (`pdserve proxy --tokenizer DIR`, torch-free `pdserve.text`): the chat template and
  `encode` exactly as `pdserve serve` applies them (`Tokenizer.encode_chat` for chat);
- otherwise an instance's `POST /tokenize`, which renders `messages` through the same chat template.

Token ids given in the request are used as they are. Anything the proxy cannot reproduce exactly (chat
`documents` through /tokenize, which has no such field; `truncate_prompt_tokens: -1`; a request the instance
will refuse) gives None: the request is then routed without cache knowledge, never wrongly.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

from pdserve.text.chat import ChatTemplateError
from pdserve.text.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("pdserve.proxy")

CHAT_COMPLETIONS = "/v1/chat/completions"
_CHAT_TOKENIZE_FIELDS = ("tools", "chat_template", "chat_template_kwargs")


def _truncated(ids: list[int], body: dict[str, Any]) -> list[int] | None:
    truncate = body.get("truncate_prompt_tokens")
    if truncate is None:
        return ids
    if type(truncate) is int and truncate >= 1:
        return ids[-truncate:]
    return None  # -1 (the instance's max_model_len) or invalid (the instance answers 400)


def given_token_ids(body: dict[str, Any]) -> list[int] | None:
    """A completions prompt given as token ids (a flat list of ints), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(x) is int for x in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        inner = prompt[0]
        if inner and all(type(x) is int for x in inner):
            return inner
    return None


def _single_text_prompt(body: dict[str, Any]) -> str | None:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None


class PromptTokenizer:
    """Token ids of one-prompt completions and chat requests (None when they cannot be known exactly)."""

    def __init__(self, tokenizer_path: str | None, timeout: float) -> None:
        self.local: Tokenizer | None = load_tokenizer(tokenizer_path) if tokenizer_path else None
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    def local_ids(self, api_path: str, body: dict[str, Any]) -> list[int] | None:
        tok = self.local
        assert tok is not None
        if api_path == CHAT_COMPLETIONS:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                return None
            try:
                ids = tok.encode_chat(
                    messages,
                    bool(body.get("add_generation_prompt", True)),
                    body.get("tools"),
                    add_special_tokens=bool(body.get("add_special_tokens", False)),
                    continue_final_message=bool(body.get("continue_final_message", False)),
                    documents=body.get("documents"),
                    chat_template=body.get("chat_template"),
                    **kwargs,
                )
            except (ChatTemplateError, TypeError, ValueError):
                return None  # the instance answers the client's mistake
        else:
            text = _single_text_prompt(body)
            if text is None:
                return None
            ids = tok.encode(text, bool(body.get("add_special_tokens", True)))
        return _truncated(ids, body) if ids else None

    async def remote_ids(
        self, session: aiohttp.ClientSession, url: str, headers: dict[str, str], api_path: str, body: dict[str, Any]
    ) -> list[int] | None:
        """The instance's POST /tokenize for the request's prompt (None on any failure)."""
        request: dict[str, Any] = {}
        if isinstance(body.get("model"), str):
            request["model"] = body["model"]
        if api_path == CHAT_COMPLETIONS:
            if body.get("documents") is not None or not isinstance(body.get("messages"), list):
                return None
            request["messages"] = body["messages"]
            request["add_generation_prompt"] = body.get("add_generation_prompt", True)
            request["continue_final_message"] = body.get("continue_final_message", False)
            request["add_special_tokens"] = body.get("add_special_tokens", False)
            request.update({k: body[k] for k in _CHAT_TOKENIZE_FIELDS if body.get(k) is not None})
        else:
            text = _single_text_prompt(body)
            if text is None:
                return None
            request["prompt"] = text
            request["add_special_tokens"] = body.get("add_special_tokens", True)
        try:
            async with session.post(url + "/tokenize", json=request, headers=headers, timeout=self.timeout) as resp:
                if resp.status != 200:
                    return None
                data = await resp.json()
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            logger.debug("tokenize on %s failed: %s", url, exc)
            return None
        ids = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(ids, list) or not ids or not all(type(x) is int for x in ids):
            return None
        return _truncated(ids, body)
