"""The one request pipeline of completions, chat and tokens-only (`/inference/v1/generate`).

A route turns its request into prompts (token ids) and a response view; everything between is here:

    make_choices    sampling fields -> engine parameters, one choice per prompt per n, the P/D lease rule
    respond         submit every engine request (client mistakes the engine finds are 400s, before any
                    byte is sent), then either run to the end and answer the view's JSON body, or stream
                    the view's SSE frames behind `guarded_stream` (late errors as frames, [DONE], cleanup)
    outputs         the choice loop a view's frames iterate: metrics recorded, an engine failure raised

A view only formats: `body(gen)` for the whole response, `frames(gen, recorders)` for the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.api.http import SSE_DONE, until_disconnect
from pdserve.api.openai.errors import APIError, sse_error_frame
from pdserve.api.openai.params import build_sampling_params, sampling_param_name
from pdserve.api.openai.protocol import StreamOptions
from pdserve.api.openai.tokenization import check_prompt_chars
from pdserve.api.pd import PARAMS_LATER, HeldKVParams, KVTransferParams
from pdserve.server.generation import Choice, Generation
from pdserve.server.metrics import RequestRecorder
from pdserve.server.state import ServerState
from pdserve.text.output import OutputProcessor, TextDelta
from pdserve.types.sampling_params import ParamError, child_seed

log = logging.getLogger("pdserve.server")

# Prompts longer than this (characters) are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 4096


async def encode(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    check_prompt_chars(state.tokenizer, text, state.max_model_len)
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return state.tokenizer.encode(text, add_special_tokens)
    return await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens)


def make_choices(state: ServerState, fields: Any, base_id: str, prompts: Sequence[list[int]],
                 max_tokens: Sequence[int], logprobs: int | None, kv: KVTransferParams | None, *,
                 per_prompt_suffix: bool, param_prefix: str = "", detokenize: bool = True,
                 prompt_logprobs: int | None = None) -> list[Choice]:
    """One engine request per prompt per choice (`fields.n`), each with its own sampling parameters (a
    fixed seed gives every choice its own) and output processor. `fields` holds the sampling fields: an
    OpenAI request, or a GenerateRequest's `sampling_params` (then `param_prefix="sampling_params."`).
    `kv`: the body's kv_transfer_params, read once by the route (`KVTransferParams.read`); the engine
    requests carry that object."""
    n = fields.n
    violation = kv.one_lease_violation(len(prompts)) if kv is not None else None
    if violation is not None:
        # Proxies send such requests to one instance without P/D params (pdserve.api.pd.local_only_reason).
        raise APIError(violation, 400, "kv_transfer_params")
    # P/D with n > 1: choice 0 loads the prompt's KV; the others are submitted once it has, as local
    # requests whose prompt hits the loaded full blocks in the prefix cache (shared, ref-counted: a
    # copy-on-write fork; each recomputes only the partial last block).
    # (a held prefix is read once too: choices 1..n-1 find it in the prefix cache)
    fork = kv is not None and kv.loads and n > 1
    if fork and kv.params_later:
        raise APIError(f"kv_transfer_params.{PARAMS_LATER} serves one choice (n = 1): the forks of n > 1 wait for "
                       "a load whose params are here", 400, "kv_transfer_params")
    if fork:
        # The forks wait for choice 0's first output as the sign that the KV is loaded: choice 0 must not
        # start from the producer's first token (that output comes before the load), so it recomputes.
        kv = kv.without_first_token()
    choices: list[Choice] = []
    for i, ids in enumerate(prompts):
        stem = f"{base_id}-{i}" if per_prompt_suffix else base_id
        for j in range(n):
            params = build_sampling_params(fields, max_tokens=max_tokens[i], logprobs=logprobs,
                                           defaults=state.defaults, seed=child_seed(fields.seed, j),
                                           param_prefix=param_prefix, prompt_logprobs=prompt_logprobs)
            engine_id = state.engine_request_id(stem if j == 0 else f"{j}_{stem}")
            processor = OutputProcessor.from_params(state.tokenizer, ids, params, detokenize=detokenize)
            forked = fork and j > 0
            choices.append(Choice(index=i * n + j, prompt_index=i, engine_id=engine_id, prompt_token_ids=ids,
                                  params=params, kv_transfer_params=None if forked else kv,
                                  processor=processor, fork_of=i * n if forked else None))
    return choices


async def start_generation(state: ServerState, raw_request: Any, choices: list[Choice],
                           param_prefix: str = "") -> Generation:
    """Submits the engine requests; client mistakes the engine finds become 400s, a full queue 503."""
    from pdserve.engine.async_engine import EngineDeadError, QueueFullError

    gen = Generation(state.engine, choices)
    try:
        await until_disconnect(raw_request, gen.start())
    except ParamError as e:
        raise APIError(str(e), 400, sampling_param_name(e.param, param_prefix)) from e
    except QueueFullError as e:
        raise APIError(str(e), 503) from e
    except EngineDeadError as e:
        raise APIError(str(e), 500) from e
    except ValueError as e:  # e.g. malformed kv_transfer_params from the KV connector's validation
        raise APIError(str(e), 400, "kv_transfer_params") from e
    return gen


class ResponseView(Protocol):
    """How one route formats what the pipeline produces."""

    def body(self, gen: Generation) -> dict[str, Any]:
        """The whole response, once every choice has finished."""

    def frames(self, gen: Generation, recorders: Recorders) -> AsyncGenerator[str, None]:
        """The SSE frames of a streamed response, iterating `outputs(gen, recorders)` ([DONE] is added)."""


async def respond(state: ServerState, raw_request: Any, choices: list[Choice], view: ResponseView, *,
                  stream: bool, arrival: float, param_prefix: str = "",
                  on_close: Callable[[], None] | None = None) -> Response:
    """Runs the choices and answers: the view's JSON body, or its stream. `on_close` runs once the engine
    requests are over (or could not start)."""
    try:
        gen = await start_generation(state, raw_request, choices, param_prefix)
    except BaseException:
        if on_close is not None:
            on_close()
        raise
    recorders = Recorders(state, choices, arrival)
    if stream and not any(_failed_at_once(c) for c in choices):
        return StreamingResponse(guarded_stream(view.frames(gen, recorders), gen, recorders, on_close),
                                 media_type="text/event-stream")
    # Also a stream whose request already failed with a client-side status (a refused lease, an incompatible
    # producer): known before any byte is sent, so it gets its 4xx (from run_to_end), not a frame in a 200.
    try:
        await run_to_end(gen, recorders, raw_request)
        return JSONResponse(view.body(gen))
    finally:
        if stream:
            await gen.close()
        if on_close is not None:
            on_close()


async def outputs(gen: Generation, recorders: Recorders) -> AsyncIterator[tuple[Choice, TextDelta]]:
    """The choice loop of a stream: `(choice, delta)` as they arrive, merged across choices, each engine
    output recorded in the metrics; a choice the engine failed ends the stream with a 500 frame (raised
    here, written by `guarded_stream`)."""
    async for choice, out, delta in gen:
        recorders.on_output(choice, out, delta.finished)
        if delta.finished and choice.error:
            raise engine_error_response(choice)
        yield choice, delta


def usage(choices: Sequence[Choice], prompts: Sequence[list[int]], n: int,
          kv: KVTransferParams | None) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per choice), as in vLLM."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    cached = sum(c.num_cached_tokens for c in choices if c.index % n == 0)
    if kv is not None and kv.remote_prefill:
        remote = kv.remote_cached_tokens
        if remote is None:  # params delivered later: what the engine had
            remote = next((c.remote_cached_tokens for c in choices if c.remote_cached_tokens is not None), None)
        if remote is not None:
            cached = remote  # D reports P's prefix-cache hits, not its own ~100 % "hit" from the transfer
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def stream_usage(opts: StreamOptions | None) -> tuple[bool, bool]:
    """A stream's usage reporting from its `stream_options`: (a last chunk with the whole usage, every chunk
    with its choice's usage so far); the second only with the first, as in vLLM."""
    include_usage = bool(opts and opts.include_usage)
    return include_usage, bool(include_usage and opts and opts.continuous_usage_stats)


def chunk_tail(choice: Choice, finished: bool, continuous: bool, prompt_ids: list[int]) -> str:
    """The keys an OpenAI stream chunk carries after its choices, as JSON text to append: the held KV's
    `kv_transfer_params` once the choice finished, its usage so far under continuous usage stats."""
    tail = ""
    if finished:
        tail += f', "kv_transfer_params": {json.dumps(held_json(choice.held_kv))}'
    if continuous:
        tail += f', "usage": {json.dumps(usage([choice], [prompt_ids], 1, None))}'
    return tail


def held_json(held: HeldKVParams | None) -> dict[str, Any] | None:
    """A response's `kv_transfer_params`: the KV the engine left held for a peer, as the wire has it. The one
    place the server serialises them (the routes' views, the pin route)."""
    return held.to_json() if held is not None else None


def engine_error(choices: Sequence[Choice]) -> Choice | None:
    """The first choice the engine failed, if any."""
    return next((c for c in choices if c.error), None)


def engine_error_response(choice: Choice) -> APIError:
    """The response for a choice the engine finished with an error: a 4xx naming kv_transfer_params when the
    producer refused the lease they name (forged, replayed, expired, duplicated or mismatched params); a 409
    when this decode instance cannot read its producer's KV at all (an incompatible model, layout or KV cache
    dtype: the deployment is wrong, a retry will not help); else a 500."""
    if choice.kv_rejection is not None and choice.error_status < 500:
        return APIError(f"kv_transfer_params rejected ({choice.kv_rejection}): {choice.error}",
                        choice.error_status, "kv_transfer_params")
    if choice.error_status == 409:
        return APIError(f"KV transfer impossible: {choice.error}", 409, err_type="ConflictError")
    return APIError(f"Internal server error: {choice.error}", 500)


def _failed_at_once(choice: Choice) -> bool:
    """The choice's first output already ended it with a client-side status (known before any byte)."""
    first = choice.first_output
    return (first is not None and first.finished and first.finish_reason == "error"
            and first.error_status < 500)


async def run_to_end(gen: Generation, recorders: Recorders, raw_request: Any) -> None:
    """For a whole (not streamed) response: consumes every output, recording metrics, until the generation
    ends or the client disconnects (the choices left unfinished count as aborted); an engine error is a 500."""

    async def drain() -> None:
        async for choice, out, delta in gen:
            recorders.on_output(choice, out, delta.finished)

    try:
        await until_disconnect(raw_request, drain())
    finally:
        recorders.finish_unfinished(gen.choices)
    failed = engine_error(gen.choices)
    if failed is not None:
        raise engine_error_response(failed)


class Recorders:
    """Metrics recorders for a request's choices, keyed by choice index."""

    def __init__(self, state: ServerState, choices: Sequence[Choice], arrival: float):
        self._recs = {c.index: RequestRecorder(state.metrics, arrival) for c in choices}
        self._done: set[int] = set()

    def on_output(self, choice: Choice, out: Any, finished: bool) -> None:
        rec = self._recs[choice.index]
        rec.on_output(out)
        if finished and choice.index not in self._done:
            self._done.add(choice.index)
            rec.on_finish(out, choice.processor.finish_reason, len(choice.prompt_token_ids),
                          choice.num_output_tokens)

    def finish_unfinished(self, choices: Sequence[Choice]) -> None:
        """Requests cut short by a disconnect count as aborted."""
        for c in choices:
            if c.index not in self._done:
                self._done.add(c.index)
                self._recs[c.index].on_finish(None, "abort", len(c.prompt_token_ids), c.num_output_tokens)


async def guarded_stream(frames: AsyncGenerator[str, None], gen: Generation, recorders: Recorders,
                         on_close: Callable[[], None] | None = None) -> AsyncIterator[str]:
    """A streaming response's SSE frames, then `[DONE]`. After the 200 is out an error can only go in the
    stream: a client mistake found late (APIError) as its OpenAI error body, anything else as a 500 frame.
    However the stream ends (done, error, client gone), unfinished requests are recorded and the engine
    requests closed."""
    try:
        async for frame in frames:
            yield frame
        yield SSE_DONE
    except APIError as e:
        yield sse_error_frame(e.message, e.status, e.param)
        yield SSE_DONE
    except Exception as e:  # noqa: BLE001 - after the 200: the error goes in the stream
        log.exception("internal error in a streamed response")
        yield sse_error_frame(f"Internal server error: {e}", 500)
        yield SSE_DONE
    finally:
        await frames.aclose()
        recorders.finish_unfinished(gen.choices)
        await gen.close()
        if on_close is not None:
            on_close()


def now() -> float:
    return time.monotonic()
