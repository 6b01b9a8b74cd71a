"""Pieces shared by the completions and chat routes: choices, usage, engine errors, sub-request ids."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from pdserve.engine.sampling_params import ParamError
from pdserve.server.errors import APIError, sse_error_frame
from pdserve.server.generation import Choice, Generation
from pdserve.server.http_utils import SSE_DONE, until_disconnect
from pdserve.server.metrics import RequestRecorder
from pdserve.server.params import build_sampling_params, child_seed
from pdserve.server.protocol import _SamplingFields
from pdserve.server.state import ServerState
from pdserve.text.output import OutputProcessor

# Prompts longer than this (characters) are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 4096


async def encode(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return state.tokenizer.encode(text, add_special_tokens)
    return await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens)


def make_choices(state: ServerState, req: _SamplingFields, base_id: str, prompts: Sequence[list[int]],
                 max_tokens: Sequence[int], logprobs: int | None, kv_transfer_params: dict[str, Any] | None,
                 per_prompt_suffix: bool) -> list[Choice]:
    choices: list[Choice] = []
    n = req.n
    if (kv_transfer_params or {}).get("do_remote_prefill") and n * len(prompts) > 1:
        # One producer lease can be claimed once: a second choice would fail its load, or silently
        # recompute the whole prompt. Proxies send such requests to one instance without P/D params.
        raise APIError("kv_transfer_params.do_remote_prefill allows exactly one prompt and n=1 (one remote KV "
                       "lease serves one request)", 400, "kv_transfer_params")
    for i, ids in enumerate(prompts):
        stem = f"{base_id}-{i}" if per_prompt_suffix else base_id
        for j in range(n):
            params = build_sampling_params(req, max_tokens=max_tokens[i], logprobs=logprobs,
                                           defaults=state.defaults, seed=child_seed(req.seed, j))
            engine_id = state.engine_request_id(stem if j == 0 else f"{j}_{stem}")
            processor = OutputProcessor.from_params(state.tokenizer, ids, params)
            choices.append(Choice(index=i * n + j, prompt_index=i, engine_id=engine_id, prompt_token_ids=ids,
                                  params=params, kv_transfer_params=kv_transfer_params, processor=processor))
    return choices


async def start_generation(state: ServerState, raw_request: Any, choices: list[Choice]) -> Generation:
    """Submits the engine requests; client mistakes the engine finds become 400s, a full queue 503."""
    from pdserve.engine.async_engine import EngineDeadError, QueueFullError

    gen = Generation(state.engine, choices)
    try:
        await until_disconnect(raw_request, gen.start())
    except ParamError as e:
        raise APIError(str(e), 400, e.param) from e
    except QueueFullError as e:
        raise APIError(str(e), 503) from e
    except EngineDeadError as e:
        raise APIError(str(e), 500) from e
    except ValueError as e:  # e.g. malformed kv_transfer_params from the KV connector's validation
        raise APIError(str(e), 400, "kv_transfer_params") from e
    return gen


def usage(choices: Sequence[Choice], prompts: Sequence[list[int]], n: int,
          kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per choice), as in vLLM."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    cached = sum(c.num_cached_tokens for c in choices if c.index % n == 0)
    remote = (kv_transfer_params or {}).get("remote_prefill_cached_tokens")
    if (kv_transfer_params or {}).get("do_remote_prefill") and type(remote) is int and remote >= 0:
        cached = remote  # D reports P's prefix-cache hits, not its own ~100 % "hit" from the transfer
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def engine_error(choices: Sequence[Choice]) -> str | None:
    return next((c.error for c in choices if c.error), None)


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
    error = engine_error(gen.choices)
    if error:
        raise APIError(f"Internal server error: {error}", 500)


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


async def guarded_stream(frames: AsyncGenerator[str, None], gen: Generation,
                         recorders: Recorders) -> AsyncIterator[str]:
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
        yield sse_error_frame(f"Internal server error: {e}", 500)
        yield SSE_DONE
    finally:
        await frames.aclose()
        recorders.finish_unfinished(gen.choices)
        await gen.close()


def now() -> float:
    return time.monotonic()
