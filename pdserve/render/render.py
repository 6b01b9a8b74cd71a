"""Render: an OpenAI chat/completions request -> `GenerateRequest`(s) for `/inference/v1/generate`.

The prompt and the sampling parameters are computed with the in-process server's own functions
(`pdserve.api.openai.params`, the tokenizer's chat template), so the engine sees exactly the token ids and
parameters it would see behind `pdserve serve`. `kv_transfer_params` are hoisted to the top level;
`parse_context` carries what derender needs to know about tools and reasoning.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from pdserve.api.http import parse_model
from pdserve.api.openai.errors import APIError, bad_request, not_supported
from pdserve.api.openai.params import (
    build_sampling_params,
    check_chat_fields,
    check_completion_request,
    completion_prompt_items,
    completion_prompt_logprobs,
    forced_tool_of,
    resolve_max_tokens,
    truncate_prompt,
    validate_token_ids,
)
from pdserve.api.openai.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from pdserve.api.openai.tokenization import check_prompt_chars
from pdserve.api.pd import PROMPT_TOKEN_IDS
from pdserve.render.context import RenderContext
from pdserve.text.chat import ChatTemplateError
from pdserve.text.output_parsers import prompt_tail_text
from pdserve.text.reasoning import prompt_opens_reasoning
from pdserve.types.sampling_params import SamplingParams


def base_id(header_request_id: str | None, body_request_id: str | None) -> str:
    return header_request_id or body_request_id or uuid.uuid4().hex


def sampling_params_dict(params: SamplingParams, n: int) -> dict[str, Any]:
    return {**dataclasses.asdict(params), "n": n}


def _hoisted_kv(req: _SamplingFields) -> dict[str, Any] | None:
    if req.kv_transfer_params is None:
        return None
    kv = dict(req.kv_transfer_params)
    # The proxy's chat hand-off saves a decode instance the tokenisation; the render tier has already
    # tokenised, so the ids are dropped rather than sent to the engine.
    kv.pop(PROMPT_TOKEN_IDS, None)
    return kv


def refuse_prompt_logprobs(wanted: int | None) -> None:
    """Prompt logprobs (`prompt_logprobs`, completions `echo` with `logprobs`) are computed by `pdserve serve`
    but do not travel through `/inference/v1/generate` yet: a 400 rather than a response without them."""
    if wanted is not None:
        raise not_supported("prompt_logprobs", " through the render tier (send the request to `pdserve serve` or "
                            "the proxy; completions echo with logprobs needs them too)")


def check_chat_request(ctx: RenderContext, req: ChatCompletionRequest) -> bool:
    """Validations shared by render and derender; returns whether the output is parsed for tool calls."""
    refuse_prompt_logprobs(req.prompt_logprobs)
    use_tools = check_chat_fields(ctx.parsers, req)
    if forced_tool_of(req) is not None:  # derender would show the forced call's JSON as content
        raise not_supported("tool_choice", " (\"required\" or a named function) through the render tier; send "
                            "the request to `pdserve serve` or the proxy")
    return use_tools


def chat_prompt_text(ctx: RenderContext, req: ChatCompletionRequest) -> str:
    try:
        return ctx.tokenizer.apply_chat_template(
            req.messages, req.add_generation_prompt, req.tools,
            continue_final_message=req.continue_final_message, documents=req.documents,
            chat_template=req.chat_template, **(req.chat_template_kwargs or {}),
        )
    except ChatTemplateError as e:
        raise APIError(str(e), 400, e.param) from e


def _history_tool_calls(messages: list[dict[str, Any]]) -> int:
    return sum(len(m.get("tool_calls") or []) for m in messages
               if isinstance(m, dict) and isinstance(m.get("tool_calls"), list))


def render_chat(ctx: RenderContext, body: Any, header_request_id: str | None = None) -> dict[str, Any]:
    req = parse_model(ChatCompletionRequest, body)
    model = ctx.check_model(req.model)
    check_chat_request(ctx, req)
    text = chat_prompt_text(ctx, req)
    check_prompt_chars(ctx.tokenizer, text, ctx.max_model_len, "messages")
    ids = ctx.tokenizer.encode(text, req.add_special_tokens)
    if not ids:
        raise bad_request("The rendered chat prompt is empty.", "messages")
    ids = truncate_prompt(ids, req.truncate_prompt_tokens, ctx.max_model_len)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(requested, len(ids), ctx.max_model_len, ctx.defaults, param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = build_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, defaults=ctx.defaults,
                                   seed=req.seed)
    reasoning_ended = None
    if ctx.parsers.reasoning_parser:
        reasoning_ended = not prompt_opens_reasoning(prompt_tail_text(ctx.tokenizer, ids))
    return {
        "request_id": f"chatcmpl-{base_id(header_request_id, req.request_id)}",
        "token_ids": ids,
        "sampling_params": sampling_params_dict(params, req.n),
        "model": model,
        "stream": bool(req.stream),
        "stream_options": req.stream_options.model_dump() if req.stream_options else None,
        "kv_transfer_params": _hoisted_kv(req),
        "output_mode": "tokens",
        "return_token_ids": req.return_token_ids,
        "cache_salt": req.cache_salt,
        "priority": req.priority,
        "reasoning_ended": reasoning_ended,
        "parse_context": {
            "tools": req.tools,
            "tool_choice": req.tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls,
            "include_reasoning": req.include_reasoning,
            "chat_template_kwargs": req.chat_template_kwargs,
            "history_tool_call_cnt": _history_tool_calls(req.messages),
        },
    }


def completion_prompts(ctx: RenderContext, req: CompletionRequest) -> list[list[int]]:
    items = completion_prompt_items(req)
    out: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            check_prompt_chars(ctx.tokenizer, item, ctx.max_model_len, "prompt")
            ids = ctx.tokenizer.encode(item, req.add_special_tokens)
            if not ids:
                raise bad_request("Prompt cannot be empty.", "prompt")
        else:
            ids = validate_token_ids(list(item), ctx.vocab_size, "prompt")
        out.append(truncate_prompt(ids, req.truncate_prompt_tokens, ctx.max_model_len))
    return out


def render_completion(ctx: RenderContext, body: Any, header_request_id: str | None = None) -> list[dict[str, Any]]:
    req = parse_model(CompletionRequest, body)
    model = ctx.check_model(req.model)
    check_completion_request(req)
    refuse_prompt_logprobs(completion_prompt_logprobs(req))
    prompts = completion_prompts(ctx, req)
    base = f"cmpl-{base_id(header_request_id, req.request_id)}"
    kv = _hoisted_kv(req)
    out = []
    for i, ids in enumerate(prompts):
        max_tokens = resolve_max_tokens(req.max_tokens, len(ids), ctx.max_model_len, ctx.defaults, "max_tokens")
        params = build_sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, defaults=ctx.defaults,
                                       seed=req.seed)
        out.append({
            "request_id": base if len(prompts) == 1 else f"{base}-{i}",
            "token_ids": ids,
            "sampling_params": sampling_params_dict(params, req.n),
            "model": model,
            "stream": bool(req.stream),
            "stream_options": req.stream_options.model_dump() if req.stream_options else None,
            "kv_transfer_params": kv,
            "output_mode": "tokens",
            "return_token_ids": req.return_token_ids,
            "cache_salt": req.cache_salt,
            "priority": req.priority,
        })
    return out
