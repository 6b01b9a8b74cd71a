"""`/tokenize` and `/detokenize` of the render tier (the same shapes as `pdserve serve`'s)."""

from __future__ import annotations

from typing import Any

from pdserve.api.http import parse_model
from pdserve.api.openai.protocol import DetokenizeRequest, TokenizeRequest
from pdserve.api.openai.tokenization import detokenize_body, tokenize_body
from pdserve.render.context import RenderContext


def tokenize(ctx: RenderContext, body: Any) -> dict[str, Any]:
    req = parse_model(TokenizeRequest, body)
    ctx.check_model(req.model)
    return tokenize_body(ctx.tokenizer, req, ctx.max_model_len)


def detokenize(ctx: RenderContext, body: Any) -> dict[str, Any]:
    req = parse_model(DetokenizeRequest, body)
    ctx.check_model(req.model)
    return detokenize_body(ctx.tokenizer, req, ctx.vocab_size)
