"""Derender: generated token ids + the client's original request -> the OpenAI response.

Batch: `generate_response` (completions: `generate_responses`) -> a `ChatCompletionResponse` /
`CompletionResponse` with `content`, `reasoning`, `tool_calls` (and `finish_reason: "tool_calls"` when
tools were called), real logprob values, usage and the engine's `kv_transfer_params`.

Streaming: one call per engine SSE chunk, `{generate_chunk, stream_state, chat_request, ...}` ->
`{chunk, stream_state, finished}`. The state is resumable and bounded (see `choice_stream.py`): unlike
vLLM, nothing is replayed, so the cost of a chunk does not depend on how long the stream already is.

The response id is the render tier's request id (`chatcmpl-…` / `cmpl-…`): the engine's
`generate-tokens-` prefix is removed, so a three-hop answer carries the same id an in-process server
would have given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.api.generate import (
    ChatDerenderRequest,
    ChoiceStreamState,
    CompletionDerenderRequest,
    DerenderStreamState,
    GenerateChoice,
    GenerateTokensResponse,
)
from pdserve.api.http import parse_model
from pdserve.api.openai.errors import bad_request
from pdserve.api.openai.params import completion_prompt_logprobs, stop_list
from pdserve.api.openai.protocol import ChatCompletionRequest, CompletionRequest, chat_role
from pdserve.api.scale_out_routes import GENERATE_ID_PREFIX
from pdserve.render.choice_stream import ChoiceStream, TextOptions, to_engine_logprobs
from pdserve.render.context import RenderContext
from pdserve.render.render import (
    chat_prompt_text,
    check_chat_request,
    check_completion_request,
    refuse_prompt_logprobs,
)
from pdserve.text.chat import message_text
from pdserve.text.logprobs import LogprobFormatter
from pdserve.text.output_parsers import ChatOutputParser, ParserStateError, prompt_tail_text


def response_id(generate_request_id: str) -> str:
    return generate_request_id.removeprefix(GENERATE_ID_PREFIX)


def _check_ids(ctx: RenderContext, ids: Sequence[int], where: str) -> None:
    bad = next((t for t in ids if t >= ctx.vocab_size), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} is out of vocabulary (size {ctx.vocab_size}).", where)


def _check_generate(ctx: RenderContext, resp: GenerateTokensResponse, n: int, where: str) -> None:
    if resp.output_mode != "tokens":
        raise bad_request(f"{where}.output_mode must be 'tokens', got {resp.output_mode!r}.", f"{where}.output_mode")
    seen: set[int] = set()
    for k, choice in enumerate(resp.choices):
        if choice.index >= n or choice.index in seen:
            raise bad_request(f"{where}.choices[{k}].index {choice.index} does not fit the request's n={n}.",
                              f"{where}.choices")
        seen.add(choice.index)
        _check_ids(ctx, choice.token_ids, f"{where}.choices[{k}].token_ids")
        if choice.logprobs is not None:
            if len(choice.logprobs.content) != len(choice.token_ids):
                raise bad_request(f"{where}.choices[{k}].logprobs has {len(choice.logprobs.content)} entries for "
                                  f"{len(choice.token_ids)} tokens.", f"{where}.choices")
            for e in choice.logprobs.content:
                _check_ids(ctx, [e.token_id, *(t.token_id for t in e.top_logprobs)], f"{where}.choices.logprobs")


def _text_options(req: ChatCompletionRequest | CompletionRequest) -> TextOptions:
    return TextOptions(stop=stop_list(req.stop), include_stop_str_in_output=req.include_stop_str_in_output,
                       skip_special_tokens=req.skip_special_tokens, min_tokens=req.min_tokens)


def _process_whole(stream: ChoiceStream, choice: GenerateChoice):
    lps = to_engine_logprobs(choice.logprobs.content) if choice.logprobs is not None else None
    return stream.process(choice.token_ids, lps, True, choice.finish_reason, choice.stop_reason)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


# ---- chat ------------------------------------------------------------------------------------------
@dataclass
class _ChatSetup:
    req: ChatCompletionRequest
    model: str
    use_tools: bool
    role: str
    echo: str
    prompt_ids: list[int] | None
    fmt: LogprobFormatter
    ctx: RenderContext
    _tail: str | None = None
    _tail_known: bool = False

    def prompt_tail(self) -> str | None:
        """The end of the prompt text (for the reasoning parser's start state); only a new stream needs it.
        Without prompt ids the template is rendered again, once, to find it."""
        if not self._tail_known:
            self._tail_known = True
            self._tail = prompt_tail_text(self.ctx.tokenizer, self.prompt_ids)
            if self._tail is None and self.ctx.parsers.reasoning_parser and self.req.messages:
                self._tail = chat_prompt_text(self.ctx, self.req)[-64:]
        return self._tail


def _chat_setup(ctx: RenderContext, body: ChatDerenderRequest) -> _ChatSetup:
    if body.chat_request is None:
        if ctx.parsers.any:
            raise bad_request("chat_request (the original chat completion request) is required to derender on a "
                              "server with a reasoning or tool call parser.", "chat_request")
        req = ChatCompletionRequest.model_construct(messages=[])
    else:
        req = parse_model(ChatCompletionRequest, body.chat_request)
    model = ctx.check_model(body.model or req.model)
    use_tools = check_chat_request(ctx, req)
    prompt_ids = body.prompt_token_ids
    if prompt_ids is not None:
        _check_ids(ctx, prompt_ids, "prompt_token_ids")
    role = chat_role(req) if req.messages else "assistant"
    echo = ""
    if req.echo and req.messages and isinstance(req.messages[-1], dict) and req.messages[-1].get("role") == role:
        echo = message_text(req.messages[-1])
    fmt = LogprobFormatter(ctx.tokenizer.token_text, bool(req.return_tokens_as_token_ids))
    return _ChatSetup(req, model, use_tools, role, echo, prompt_ids, fmt, ctx)


def _new_chat_stream(ctx: RenderContext, s: _ChatSetup, index: int) -> ChoiceStream:
    parser = None
    if ctx.parsers.any:
        parser = ChatOutputParser.new(ctx.parsers, use_tools=s.use_tools, prompt_tail=s.prompt_tail(),
                                      include_reasoning=s.req.include_reasoning)
    return ChoiceStream.new(index, ctx.tokenizer, s.prompt_ids, _text_options(s.req), parser)


def _chat_logprobs(s: _ChatSetup, lps: list[Any] | None) -> dict[str, Any] | None:
    if not s.req.logprobs or lps is None:
        return None
    return s.fmt.chat(lps, s.req.top_logprobs or 0)


def derender_chat(ctx: RenderContext, raw: Any) -> dict[str, Any]:
    body = parse_model(ChatDerenderRequest, raw)
    if body.stream:
        return _derender_chat_chunk(ctx, body)
    resp = body.generate_response
    if resp is None:
        raise bad_request("generate_response is required (or stream: true with generate_chunk).", "generate_response")
    s = _chat_setup(ctx, body)
    _check_generate(ctx, resp, s.req.n, "generate_response")
    choices = []
    completion_tokens = 0
    for choice in sorted(resp.choices, key=lambda c: c.index):
        stream = _new_chat_stream(ctx, s, choice.index)
        delta = _process_whole(stream, choice)
        completion_tokens += len(delta.token_ids)  # accepted ids: a stop string drops the ones after it
        if delta.parsed is not None:
            content = (s.echo + delta.parsed.content) or None
            reasoning = delta.parsed.reasoning or None
            tool_calls = [c.to_message() for c in delta.parsed.tool_calls]
        else:
            content, reasoning, tool_calls = s.echo + delta.text, None, []
        choices.append({
            "index": choice.index,
            "message": {"role": s.role, "content": content, "refusal": None, "annotations": None, "audio": None,
                        "function_call": None, "tool_calls": tool_calls, "reasoning": reasoning,
                        "reasoning_content": reasoning},
            "logprobs": _chat_logprobs(s, delta.logprobs),
            "finish_reason": stream.reported_finish_reason,
            "stop_reason": delta.stop_reason,
            "token_ids": list(delta.token_ids) if s.req.return_token_ids else None,
        })
    prompt_tokens = _prompt_tokens(body.prompt_tokens, s.prompt_ids, resp)
    return {
        "id": response_id(resp.request_id),
        "object": "chat.completion",
        "created": resp.created or int(time.time()),
        "model": s.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(prompt_tokens, completion_tokens),
        "prompt_logprobs": None,
        "prompt_token_ids": (s.prompt_ids or resp.prompt_token_ids) if s.req.return_token_ids else None,
        "kv_transfer_params": resp.kv_transfer_params,
    }


def _prompt_tokens(given: int | None, prompt_ids: list[int] | None, resp: GenerateTokensResponse) -> int:
    if given is not None:
        return given
    if prompt_ids is not None:
        return len(prompt_ids)
    return resp.usage.prompt_tokens if resp.usage is not None else 0


def _resume_streams(ctx: RenderContext, state: DerenderStreamState | None, n: int, *, use_tools: bool,
                    include_reasoning: bool, options: TextOptions, chat: bool) -> dict[int, ChoiceStream]:
    streams: dict[int, ChoiceStream] = {}
    if state is None:
        return streams
    for st in state.choices:
        if st.index >= n or st.index in streams:
            raise bad_request(f"stream_state has a duplicate or out-of-range choice index {st.index}.", "stream_state")
        _check_ids(ctx, st.prev_tokens, "stream_state")
        try:
            streams[st.index] = ChoiceStream.from_state(st, ctx.tokenizer, options, ctx.parsers if chat else None,
                                                        use_tools, include_reasoning)
        except (ValueError, ParserStateError) as e:
            raise bad_request(f"malformed stream_state: {e}", "stream_state") from e
    return streams


def _state_out(streams: dict[int, ChoiceStream], n: int) -> tuple[dict[str, Any], bool]:
    """The state to send back, and whether all n choices are finished (then the caller can abort the engine
    request: a stop string ended the output before the engine did)."""
    states: list[ChoiceStreamState] = [streams[i].to_state() for i in sorted(streams)]
    state = DerenderStreamState(choices=states)
    return state.model_dump(), len(streams) == n and all(s.finished for s in streams.values())


def _derender_chat_chunk(ctx: RenderContext, body: ChatDerenderRequest) -> dict[str, Any]:
    chunk = body.generate_chunk
    if chunk is None:
        raise bad_request("generate_chunk is required with stream: true.", "generate_chunk")
    s = _chat_setup(ctx, body)
    _check_generate(ctx, chunk, s.req.n, "generate_chunk")
    streams = _resume_streams(ctx, body.stream_state, s.req.n, use_tools=s.use_tools,
                              include_reasoning=s.req.include_reasoning, options=_text_options(s.req), chat=True)
    out_choices = []
    for choice in chunk.choices:
        stream = streams.get(choice.index)
        if stream is None:
            stream = streams[choice.index] = _new_chat_stream(ctx, s, choice.index)
        lps = to_engine_logprobs(choice.logprobs.content) if choice.logprobs is not None else None
        was_finished = stream.finished
        d = stream.process(choice.token_ids, lps, choice.finish_reason is not None, choice.finish_reason,
                           choice.stop_reason)
        delta: dict[str, Any] = {}
        if not stream.role_sent:
            stream.role_sent = True
            delta["role"] = s.role
        text = d.parsed.content if d.parsed is not None else d.text
        content = (s.echo if "role" in delta else "") + text
        if content or "role" in delta:
            delta["content"] = content
        if d.parsed is not None and d.parsed.reasoning:
            delta["reasoning"] = delta["reasoning_content"] = d.parsed.reasoning
        if d.parsed is not None and d.parsed.tool_calls:
            delta["tool_calls"] = [c.to_delta() for c in d.parsed.tool_calls]
        finished_now = d.finished and not was_finished
        if was_finished or not (delta or finished_now or d.token_ids):
            continue  # nothing to say for this choice in this chunk
        item: dict[str, Any] = {
            "index": choice.index,
            "delta": delta,
            "logprobs": _chat_logprobs(s, d.logprobs),
            "finish_reason": stream.reported_finish_reason if finished_now else None,
        }
        if finished_now:
            item["stop_reason"] = d.stop_reason
        if s.req.return_token_ids:
            item["token_ids"] = d.token_ids
        out_choices.append(item)
    out: dict[str, Any] = {
        "id": response_id(chunk.request_id),
        "object": "chat.completion.chunk",
        "created": chunk.created or int(time.time()),
        "model": s.model,
        "choices": out_choices,
    }
    if chunk.usage is not None:
        out["usage"] = _usage(_prompt_tokens(body.prompt_tokens, s.prompt_ids, chunk),
                              chunk.usage.completion_tokens)
    if chunk.kv_transfer_params is not None:
        out["kv_transfer_params"] = chunk.kv_transfer_params
    if chunk.prompt_token_ids is not None and s.req.return_token_ids:
        out["prompt_token_ids"] = chunk.prompt_token_ids
    state, finished = _state_out(streams, s.req.n)
    return {"chunk": out, "stream_state": state, "finished": finished}


# ---- completions -----------------------------------------------------------------------------------
def _completion_request(body: CompletionDerenderRequest) -> CompletionRequest:
    if body.completion_request is None:
        return CompletionRequest.model_construct()
    req = parse_model(CompletionRequest, body.completion_request)
    check_completion_request(req)
    refuse_prompt_logprobs(completion_prompt_logprobs(req))
    return req


def _echo_text(ctx: RenderContext, req: CompletionRequest, prompt_index: int, prompt_ids: list[int] | None) -> str:
    prompt = req.prompt
    if isinstance(prompt, str) and prompt_index == 0:
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) and prompt_index < len(prompt):
        return prompt[prompt_index]
    if prompt_ids is None:
        raise bad_request("echo with token-id prompts needs prompt_token_ids to derender.", "prompt_token_ids")
    return ctx.tokenizer.decode(prompt_ids, skip_special_tokens=False)


def _completion_logprobs(fmt: LogprobFormatter, req: CompletionRequest, ids: list[int], lps: list[Any] | None,
                         echo_ids: list[int] | None, offset: int) -> dict[str, Any] | None:
    if req.logprobs is None or lps is None:
        return None
    if echo_ids is not None:
        return fmt.completion([*echo_ids, *ids], [None] * len(echo_ids) + list(lps), req.logprobs, offset)
    return fmt.completion(ids, lps, req.logprobs, offset)


def _prompt_ids_at(ctx: RenderContext, body: CompletionDerenderRequest, i: int) -> list[int] | None:
    ids = body.prompt_token_ids[i] if body.prompt_token_ids is not None and i < len(body.prompt_token_ids) else None
    if ids is not None:
        _check_ids(ctx, ids, f"prompt_token_ids[{i}]")
    return ids


def derender_completion(ctx: RenderContext, raw: Any) -> dict[str, Any]:
    body = parse_model(CompletionDerenderRequest, raw)
    if body.stream:
        return _derender_completion_chunk(ctx, body)
    responses = body.generate_responses
    if responses is None:
        responses = [body.generate_response] if body.generate_response is not None else None
    if not responses:
        raise bad_request("generate_responses is required (or stream: true with generate_chunk).",
                          "generate_responses")
    req = _completion_request(body)
    model = ctx.check_model(body.model or req.model)
    n = req.n
    fmt = LogprobFormatter(ctx.tokenizer.token_text, bool(req.return_tokens_as_token_ids))
    given = body.prompt_tokens if isinstance(body.prompt_tokens, list) else (
        [body.prompt_tokens] if body.prompt_tokens is not None else None)
    choices = []
    prompt_tokens = completion_tokens = 0
    for i, resp in enumerate(responses):
        _check_generate(ctx, resp, n, f"generate_responses[{i}]")
        ids = _prompt_ids_at(ctx, body, i)
        prompt_tokens += _prompt_tokens(given[i] if given is not None and i < len(given) else None, ids, resp)
        echo = _echo_text(ctx, req, i, ids or resp.prompt_token_ids) if req.echo else ""
        for choice in sorted(resp.choices, key=lambda c: c.index):
            stream = ChoiceStream.new(i * n + choice.index, ctx.tokenizer, ids, _text_options(req), None)
            d = _process_whole(stream, choice)
            completion_tokens += len(d.token_ids)
            echo_ids = (ids or resp.prompt_token_ids) if req.echo else None
            choices.append({
                "index": i * n + choice.index,
                "text": echo + d.text,
                "logprobs": _completion_logprobs(fmt, req, list(d.token_ids), d.logprobs, echo_ids, 0),
                "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason,
                "prompt_logprobs": None,
                "token_ids": list(d.token_ids) if req.return_token_ids else None,
                "prompt_token_ids": (ids or resp.prompt_token_ids) if req.return_token_ids else None,
            })
    kv = [r.kv_transfer_params for r in responses]
    first_id = response_id(responses[0].request_id)
    return {
        "id": first_id.removesuffix("-0") if len(responses) > 1 else first_id,
        "object": "text_completion",
        "created": responses[0].created or int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(prompt_tokens, completion_tokens),
        "kv_transfer_params": kv[0] if all(k == kv[0] for k in kv) else None,
    }


def _derender_completion_chunk(ctx: RenderContext, body: CompletionDerenderRequest) -> dict[str, Any]:
    chunk = body.generate_chunk
    if chunk is None:
        raise bad_request("generate_chunk is required with stream: true.", "generate_chunk")
    req = _completion_request(body)
    model = ctx.check_model(body.model or req.model)
    n = req.n
    i = body.prompt_index
    _check_generate(ctx, chunk, n, "generate_chunk")
    ids = _prompt_ids_at(ctx, body, i)
    options = _text_options(req)
    streams = _resume_streams(ctx, body.stream_state, n, use_tools=False, include_reasoning=True,
                              options=options, chat=False)
    fmt = LogprobFormatter(ctx.tokenizer.token_text, bool(req.return_tokens_as_token_ids))
    out_choices = []
    for choice in chunk.choices:
        stream = streams.get(choice.index)
        if stream is None:
            stream = streams[choice.index] = ChoiceStream.new(choice.index, ctx.tokenizer, ids, options, None)
        first = not stream.role_sent
        stream.role_sent = True
        was_finished = stream.finished
        offset = stream.text_len
        lps = to_engine_logprobs(choice.logprobs.content) if choice.logprobs is not None else None
        d = stream.process(choice.token_ids, lps, choice.finish_reason is not None, choice.finish_reason,
                           choice.stop_reason)
        if was_finished:
            continue
        text = d.text
        echo_ids = None
        if first and req.echo:
            echo_ids = ids or chunk.prompt_token_ids
            echo = _echo_text(ctx, req, i, echo_ids)
            text = echo + text
            stream.text_len += len(echo)  # later logprob text offsets count the echoed prompt too
        item: dict[str, Any] = {
            "index": i * n + choice.index,
            "text": text,
            "logprobs": _completion_logprobs(fmt, req, list(d.token_ids), d.logprobs, echo_ids, offset),
            "finish_reason": d.finish_reason if d.finished else None,
            "stop_reason": d.stop_reason if d.finished else None,
        }
        if req.return_token_ids:
            item["token_ids"] = d.token_ids
            if first:
                item["prompt_token_ids"] = ids or chunk.prompt_token_ids
        out_choices.append(item)
    out: dict[str, Any] = {
        "id": response_id(chunk.request_id),
        "object": "text_completion",
        "created": chunk.created or int(time.time()),
        "model": model,
        "choices": out_choices,
    }
    if chunk.usage is not None:
        given = body.prompt_tokens
        if isinstance(given, list):
            given = given[i] if i < len(given) else None
        out["usage"] = _usage(_prompt_tokens(given, ids, chunk), chunk.usage.completion_tokens)
    if chunk.kv_transfer_params is not None:
        out["kv_transfer_params"] = chunk.kv_transfer_params
    state, finished = _state_out(streams, n)
    return {"chunk": out, "stream_state": state, "finished": finished}
