"""The bodies of `/tokenize` and `/detokenize`, shared by `pdserve serve` and the render tier (torch-free)."""

from __future__ import annotations

from typing import Any

from pdserve.api.openai.errors import APIError
from pdserve.api.openai.protocol import DetokenizeRequest, TokenizeRequest
from pdserve.text.chat import ChatTemplateError


def check_prompt_chars(tok: Any, text: str, max_model_len: int, param: str | None = None) -> None:
    """A 400 before tokenizing a text too long to fit in the context however it tokenizes (more than
    max_model_len x the longest vocabulary entry characters): tokenizing megabytes takes seconds of CPU for
    a request that is refused anyway. Applies to truncate_prompt_tokens requests too."""
    limit = max_model_len * tok.max_token_chars
    if len(text) > limit:
        raise APIError(
            f"The prompt has {len(text)} characters; at most {limit} can fit in this model's context of "
            f"{max_model_len} tokens (max_model_len x {tok.max_token_chars}, the longest token in characters).",
            400, param)


def tokenize_body(tok: Any, req: TokenizeRequest, max_model_len: int) -> dict[str, Any]:
    """A prompt, or messages through the chat template, -> their token ids."""
    if req.messages is not None:
        try:
            text = tok.apply_chat_template(
                req.messages, req.add_generation_prompt, req.tools,
                continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                **(req.chat_template_kwargs or {}),
            )
        except ChatTemplateError as e:
            raise APIError(str(e), 400, e.param) from e
        add_special = bool(req.add_special_tokens)
    elif req.prompt is not None:
        text = req.prompt
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
    else:
        raise APIError("Either prompt or messages must be provided.", 400, "prompt")
    check_prompt_chars(tok, text, max_model_len, "messages" if req.messages is not None else "prompt")
    ids = tok.encode(text, add_special)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}


def detokenize_body(tok: Any, req: DetokenizeRequest, vocab_size: int) -> dict[str, Any]:
    """Token ids (each below `vocab_size`, else 400) -> their text, special tokens included."""
    bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(f"Token id {bad} is out of vocabulary", 400, "tokens")
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}
