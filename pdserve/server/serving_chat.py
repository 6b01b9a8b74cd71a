"""POST /v1/chat/completions: messages through the model's chat template -> an assistant message."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from pdserve.api.http import base_request_id, sse
from pdserve.api.openai.errors import APIError, bad_request
from pdserve.api.openai.params import (
    check_chat_fields,
    forced_tool_of,
    resolve_max_tokens,
    truncate_prompt,
    validate_token_ids,
)
from pdserve.api.openai.protocol import ChatCompletionRequest, chat_role
from pdserve.api.pd import PROMPT_TOKEN_IDS, KVTransferParams, chat_prompt_ids_allowed
from pdserve.server.generation import Generation
from pdserve.server.pipeline import (
    Recorders,
    chunk_tail,
    encode,
    held_json,
    make_choices,
    now,
    outputs,
    respond,
    stream_usage,
    usage,
)
from pdserve.server.state import ServerState
from pdserve.text.chat import ChatTemplateError, message_text
from pdserve.text.logprobs import LogprobFormatter
from pdserve.text.output_parsers import (
    ChatDelta,
    ChatOutputParser,
    prompt_tail_text,
)
from pdserve.text.tool_parsers import make_tool_call_id

PROMPT_IDS_PARAM = f"kv_transfer_params.{PROMPT_TOKEN_IDS}"


def parsed_delta(parsed: ChatDelta) -> dict[str, Any]:
    """A streamed delta from parsed text: only the parts that have something."""
    message: dict[str, Any] = {}
    if parsed.content:
        message["content"] = parsed.content
    if parsed.reasoning:
        message["reasoning"] = message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [t.to_delta() for t in parsed.tool_calls]
    return message


async def _prompt_ids(state: ServerState, req: ChatCompletionRequest,
                      kv: dict[str, Any] | None) -> list[int]:
    """The engine prompt: a proxy-provided `kv_transfer_params.prompt_token_ids` where the wire contract
    allows them (otherwise they are dropped), or the rendered template."""
    if kv is not None and PROMPT_TOKEN_IDS in kv:
        given = kv.pop(PROMPT_TOKEN_IDS)
        if chat_prompt_ids_allowed(req.messages, req.echo):
            if not isinstance(given, list) or not given:
                raise bad_request("prompt_token_ids must be a non-empty list of token ids.", PROMPT_IDS_PARAM)
            return validate_token_ids(given, state.vocab_size, PROMPT_IDS_PARAM)
    tok = state.tokenizer
    try:
        text = tok.apply_chat_template(
            req.messages, req.add_generation_prompt, req.tools,
            continue_final_message=req.continue_final_message, documents=req.documents,
            chat_template=req.chat_template, **(req.chat_template_kwargs or {}),
        )
    except ChatTemplateError as e:
        raise APIError(str(e), 400, e.param) from e
    ids = await encode(state, text, req.add_special_tokens)
    if not ids:
        raise bad_request("The rendered chat prompt is empty.", "messages")
    return ids


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Any:
    arrival = now()
    model = state.check_model(req.model)
    state.check_accepting()
    use_tools = check_chat_fields(state.parsers, req)
    body_kv = dict(req.kv_transfer_params) if req.kv_transfer_params is not None else None
    ids = truncate_prompt(await _prompt_ids(state, req, body_kv), req.truncate_prompt_tokens, state.max_model_len)
    kv = KVTransferParams.read(body_kv) if body_kv is not None else None  # the one read: typed from here on
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(requested, len(ids), state.max_model_len, state.defaults, param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    request_id = f"chatcmpl-{base_request_id(raw, req.request_id)}"
    choices = make_choices(state, req, request_id, [ids], [max_tokens], logprobs, kv, per_prompt_suffix=False,
                           prompt_logprobs=None if req.stream else req.prompt_logprobs)  # streams carry none
    role = chat_role(req)
    echo = ""
    if req.echo and req.messages and isinstance(req.messages[-1], dict) and req.messages[-1].get("role") == role:
        echo = message_text(req.messages[-1])
    view = _ChatView(state, req, request_id, model, ids, role, echo, kv, use_tools)
    return await respond(state, raw, choices, view, stream=bool(req.stream), arrival=arrival)


class _ChatView:
    def __init__(self, state: ServerState, req: ChatCompletionRequest, request_id: str, model: str,
                 prompt_ids: list[int], role: str, echo: str, kv: KVTransferParams | None, use_tools: bool = False):
        self.req = req
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.prompt_ids = prompt_ids
        self.role = role
        self.echo = echo
        self.kv = kv
        self.fmt = LogprobFormatter(state.tokenizer.token_text, bool(req.return_tokens_as_token_ids))
        self.top = req.top_logprobs or 0
        # Reasoning / tool-call parsers (the render tier's derender uses the same ones): one per choice.
        self.parsers: dict[int, ChatOutputParser] = {}
        # tool_choice "required" / named: the grammar forces the call's JSON; no parser reads it
        self.forced = forced_tool_of(req)
        self.forced_text: dict[int, str] = {}  # streaming: each choice's text so far
        self.forced_ids: dict[int, str] = {}  # streaming, named: each choice's tool call id
        if state.parsers.any and self.forced is None:
            tail = prompt_tail_text(state.tokenizer, prompt_ids)
            self.parsers = {j: ChatOutputParser.new(state.parsers, use_tools=use_tools, prompt_tail=tail,
                                                    include_reasoning=req.include_reasoning) for j in range(req.n)}

    def _logprobs(self, lps: list[Any] | None) -> dict[str, Any] | None:
        if not self.req.logprobs or lps is None:
            return None
        return self.fmt.chat(lps, self.top)

    def body(self, gen: Generation) -> dict[str, Any]:
        req = self.req
        out_choices = []
        for c in gen.choices:
            proc = c.processor
            message: dict[str, Any] = {"role": self.role, "content": self.echo + proc.text, "refusal": None,
                                       "annotations": None, "audio": None, "function_call": None, "tool_calls": [],
                                       "reasoning": None}
            finish_reason = proc.finish_reason
            calls = self.forced.calls(proc.text) if self.forced is not None else None
            if calls is not None:  # vLLM's message for a forced call: empty content, the calls
                message.update(content=self.echo, tool_calls=[t.to_message() for t in calls])
                if self.forced is not None and self.forced.required and finish_reason == "stop":
                    finish_reason = "tool_calls"
            parser = self.parsers.get(c.index)
            if parser is not None:
                parsed = parser.parse(proc.text)
                message.update(content=(self.echo + parsed.content) or None, reasoning=parsed.reasoning or None,
                               reasoning_content=parsed.reasoning or None,
                               tool_calls=[t.to_message() for t in parsed.tool_calls])
                if parser.tools_called and finish_reason is not None:
                    finish_reason = "tool_calls"
            out_choices.append({
                "index": c.index,
                "message": message,
                "logprobs": self._logprobs(proc.logprobs if req.logprobs else None),
                "finish_reason": finish_reason,
                "stop_reason": proc.stop_reason,
                "token_ids": list(proc.token_ids) if req.return_token_ids else None,
            })
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": out_choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage(gen.choices, [self.prompt_ids], req.n, self.kv),
            "prompt_logprobs": (None if gen.choices[0].prompt_logprobs is None
                                else self.fmt.prompt(gen.choices[0].prompt_logprobs)),
            "prompt_token_ids": self.prompt_ids if req.return_token_ids else None,
            "kv_transfer_params": held_json(gen.choices[0].held_kv),
        }

    def _forced_delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A streamed delta of a forced tool call. Named: the arguments as they come (the first delta names the
        call, as vLLM streams it). Required: the calls once the array is complete (at the end; a cut-off array
        is sent as content)."""
        assert self.forced is not None
        so_far = self.forced_text.get(index, "") + text
        self.forced_text[index] = so_far
        if self.forced.name is not None:
            if not text:
                return {}, finish_reason
            if index not in self.forced_ids:
                self.forced_ids[index] = make_tool_call_id()
                call = {"index": 0, "id": self.forced_ids[index], "type": "function",
                        "function": {"name": self.forced.name, "arguments": text}}
            else:
                call = {"index": 0, "function": {"arguments": text}}
            return {"tool_calls": [call]}, finish_reason
        if finish_reason is None:
            return {}, None
        calls = self.forced.calls(so_far)
        if calls is None:
            return ({"content": so_far} if so_far else {}), finish_reason
        return {"tool_calls": [t.to_delta() for t in calls]}, "tool_calls" if finish_reason == "stop" else finish_reason

    def _chunk(self, choices: list[dict[str, Any]], extra: str = "") -> str:
        return (f'data: {{"id": {json.dumps(self.id)}, "object": "chat.completion.chunk", '
                f'"created": {self.created}, "model": {json.dumps(self.model)}, '
                f'"choices": {json.dumps(choices)}{extra}}}\n\n')

    async def frames(self, gen: Generation, recorders: Recorders) -> AsyncIterator[str]:
        req = self.req
        include_usage, continuous = stream_usage(req.stream_options)
        # The role first (one chunk per choice), then the echoed last message if asked.
        for c in gen.choices:
            extra = f', "prompt_token_ids": {json.dumps(self.prompt_ids)}' if req.return_token_ids else ""
            yield self._chunk([{"index": c.index, "delta": {"role": self.role, "content": ""},
                                "logprobs": None, "finish_reason": None}], extra)
            if self.echo:
                yield self._chunk([{"index": c.index, "delta": {"content": self.echo},
                                    "logprobs": None, "finish_reason": None}])
        async for c, delta in outputs(gen, recorders):
            message: dict[str, Any] = {"content": delta.text}
            finish_reason = delta.finish_reason if delta.finished else None
            parser = self.parsers.get(c.index)
            if self.forced is not None:
                message, finish_reason = self._forced_delta(c.index, delta.text, finish_reason)
                if not (message or delta.finished or delta.logprobs or req.return_token_ids):
                    continue
            elif parser is not None:
                parsed = parser.feed(delta.text)
                if delta.finished:
                    parsed += parser.finish()
                    if parser.tools_called:
                        finish_reason = "tool_calls"
                message = parsed_delta(parsed)
                if not (message or delta.finished or delta.logprobs or req.return_token_ids):
                    continue  # text held back by a parser (a partial tag, an open tool call)
            choice: dict[str, Any] = {
                "index": c.index,
                "delta": message,
                "logprobs": self._logprobs(delta.logprobs),
                "finish_reason": finish_reason,
            }
            if delta.finished:
                choice["stop_reason"] = delta.stop_reason
            if req.return_token_ids:
                choice["token_ids"] = delta.token_ids
            yield self._chunk([choice], chunk_tail(c, delta.finished, continuous, self.prompt_ids))
        if include_usage:
            final = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                     "model": self.model, "choices": [],
                     "usage": usage(gen.choices, [self.prompt_ids], req.n, self.kv)}
            yield sse(json.dumps(final))
