"""POST /v1/completions: prompts (text or token ids, one or many) -> text, streamed or whole."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from pdserve.api.http import base_request_id, sse
from pdserve.api.openai.errors import bad_request
from pdserve.api.openai.params import (
    check_completion_request,
    completion_prompt_items,
    completion_prompt_logprobs,
    echo_only,
    resolve_max_tokens,
    truncate_prompt,
    validate_token_ids,
)
from pdserve.api.openai.protocol import CompletionRequest
from pdserve.api.pd import KVTransferParams
from pdserve.server.generation import Choice, Generation
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
from pdserve.text.logprobs import LogprobFormatter


async def _prompts(state: ServerState, req: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
    items = completion_prompt_items(req)
    ids_list: list[list[int]] = []
    texts: list[str | None] = []
    for item in items:
        if isinstance(item, str):
            ids = await encode(state, item, req.add_special_tokens)
            if not ids:
                raise bad_request("Prompt cannot be empty.", "prompt")
            texts.append(item)
        else:
            ids = validate_token_ids(list(item), state.vocab_size, "prompt")
            texts.append(None)
        ids_list.append(truncate_prompt(ids, req.truncate_prompt_tokens, state.max_model_len))
    return ids_list, texts


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Any:
    arrival = now()
    model = state.check_model(req.model)
    state.check_accepting()
    check_completion_request(req)
    prompts, texts = await _prompts(state, req)
    requested = 1 if echo_only(req) else req.max_tokens
    max_tokens = [resolve_max_tokens(requested, len(p), state.max_model_len, state.defaults, "max_tokens")
                  for p in prompts]
    request_id = f"cmpl-{base_request_id(raw, req.request_id)}"
    kv = KVTransferParams.read(req.kv_transfer_params) if req.kv_transfer_params is not None else None
    choices = make_choices(state, req, request_id, prompts, max_tokens, req.logprobs, kv,
                           per_prompt_suffix=True, prompt_logprobs=completion_prompt_logprobs(req))
    echo_texts: list[str] = []
    if req.echo:
        echo_texts = [t if t is not None else state.tokenizer.decode(p, skip_special_tokens=False)
                      for p, t in zip(prompts, texts, strict=True)]
    view = _CompletionView(state, req, request_id, model, prompts, echo_texts, kv)
    return await respond(state, raw, choices, view, stream=bool(req.stream), arrival=arrival)


class _CompletionView:
    def __init__(self, state: ServerState, req: CompletionRequest, request_id: str, model: str,
                 prompts: list[list[int]], echo_texts: list[str], kv: KVTransferParams | None):
        self.state = state
        self.req = req
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.prompts = prompts
        self.echo_texts = echo_texts
        self.kv = kv
        self.fmt = LogprobFormatter(state.tokenizer.token_text, bool(req.return_tokens_as_token_ids))
        self.echo_only = echo_only(req)  # max_tokens 0: the engine's one token is left out of the response

    def _logprobs(self, choice: Choice, ids: list[int], lps: list[Any] | None, echo: bool,
                  offset: int) -> dict[str, Any] | None:
        if self.req.logprobs is None or lps is None:
            return None
        if echo:  # the prompt's tokens first, with their logprobs (the first has none)
            prompt = choice.prompt_token_ids
            prompt_lps = choice.prompt_logprobs or [None] * len(prompt)
            return self.fmt.completion([*prompt, *ids], [*prompt_lps, *lps], self.req.logprobs, offset)
        return self.fmt.completion(ids, lps, self.req.logprobs, offset)

    def _generated(self, ids: list[int], lps: list[Any] | None, text: str) -> tuple[list[int], list[Any] | None, str]:
        """What of the engine's output the response shows: nothing for echo with max_tokens 0."""
        return ([], [] if lps is not None else None, "") if self.echo_only else (ids, lps, text)

    # ---- whole response --------------------------------------------------------------------------
    def body(self, gen: Generation) -> dict[str, Any]:
        req = self.req
        out_choices = []
        for c in gen.choices:
            proc = c.processor
            echo = self.echo_texts[c.prompt_index] if req.echo else ""
            ids, lps, text = self._generated(proc.token_ids, proc.logprobs if req.logprobs is not None else None,
                                             proc.text)
            out_choices.append({
                "index": c.index,
                "text": echo + text,
                "logprobs": self._logprobs(c, ids, lps, req.echo or False, 0),
                "finish_reason": proc.finish_reason,
                "stop_reason": proc.stop_reason,
                "prompt_logprobs": None if c.prompt_logprobs is None else self.fmt.prompt(c.prompt_logprobs),
                "token_ids": list(proc.token_ids) if req.return_token_ids else None,
                "prompt_token_ids": c.prompt_token_ids if req.return_token_ids else None,
            })
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": out_choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage(gen.choices, self.prompts, req.n, self.kv),
            "kv_transfer_params": held_json(gen.choices[0].held_kv),
        }

    # ---- stream ----------------------------------------------------------------------------------
    async def frames(self, gen: Generation, recorders: Recorders) -> AsyncIterator[str]:
        req = self.req
        include_usage, continuous = stream_usage(req.stream_options)
        first_sent: set[int] = set()
        text_len: dict[int, int] = {}
        head = f'{{"id": {json.dumps(self.id)}, "object": "text_completion", "created": {self.created}, ' \
               f'"model": {json.dumps(self.model)}, '
        async for c, delta in outputs(gen, recorders):
            token_ids, lps, text = self._generated(delta.token_ids, delta.logprobs, delta.text)
            first = c.index not in first_sent
            if first:
                first_sent.add(c.index)
                if req.echo:
                    text = self.echo_texts[c.prompt_index] + text
            offset = text_len.get(c.index, 0)
            text_len[c.index] = offset + len(text)
            choice: dict[str, Any] = {
                "index": c.index,
                "text": text,
                "logprobs": self._logprobs(c, token_ids, lps, bool(req.echo) and first, offset),
                "finish_reason": delta.finish_reason if delta.finished else None,
                "stop_reason": delta.stop_reason if delta.finished else None,
            }
            if req.return_token_ids:
                choice["token_ids"] = delta.token_ids
                if first:
                    choice["prompt_token_ids"] = c.prompt_token_ids
            tail = chunk_tail(c, delta.finished, continuous, c.prompt_token_ids)
            yield f"data: {head}\"choices\": [{json.dumps(choice)}]{tail}}}\n\n"
        if include_usage:
            final = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                     "choices": [], "usage": usage(gen.choices, self.prompts, req.n, self.kv)}
            yield sse(json.dumps(final))
