"""Runs one HTTP request's engine requests (one per prompt per choice) and yields text deltas.

`Generation.start()` submits every engine request and waits for each one's first output, so engine-side
validation errors (and a full queue) surface before any response byte is sent. Iterating then yields
`(choice, RequestOutput, TextDelta)` as outputs arrive, merged across choices. Closing the iteration early
(client gone, task cancelled) aborts every engine request that has not finished.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.http import merged
from pdserve.api.pd import HeldKVParams, KVTransferParams
from pdserve.text.output import OutputProcessor, TextDelta
from pdserve.types.outputs import RequestOutput
from pdserve.types.sampling_params import SamplingParams


@dataclass
class Choice:
    index: int  # the choice index in the response
    prompt_index: int
    engine_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: KVTransferParams | None  # the body's, read once (pipeline.make_choices)
    processor: OutputProcessor
    fork_of: int | None = None  # P/D n > 1: submitted once this choice (the one loading the KV) has output
    # filled while running
    num_cached_tokens: int = 0
    remote_cached_tokens: int | None = None  # the producer's prefix hits, from params delivered later
    held_kv: HeldKVParams | None = None  # the KV it left held for a peer (the response's kv_transfer_params)
    error: str | None = None
    error_status: int = 500  # with `error`: the HTTP status it is answered with
    # The producer refused the lease the kv_transfer_params name (why): the error is the client's, not ours.
    kv_rejection: str | None = None
    finished: bool = False
    # params.prompt_logprobs: per prompt position (the first None), from the engine's first output
    prompt_logprobs: list[Any] | None = None
    first_output: RequestOutput | None = field(default=None, repr=False)

    @property
    def num_output_tokens(self) -> int:
        return len(self.processor.token_ids)


class Generation:
    def __init__(self, engine: Any, choices: list[Choice]):
        self.engine = engine
        self.choices = choices
        self._gens: list[AsyncIterator[RequestOutput]] = []
        self._closed = False

    async def start(self) -> None:
        """Submits all engine requests and waits for each one's first output; raises the first submission
        error (after aborting the others). Forks (`fork_of`) are submitted after the choices they fork
        have their first output, i.e. once the KV they share is loaded."""
        self._gens = [None] * len(self.choices)  # type: ignore[list-item]
        first = [c for c in self.choices if c.fork_of is None]
        await self._submit(first)
        forks = [c for c in self.choices if c.fork_of is not None]
        if not forks:
            return
        failed = {c.index for c in first if c.first_output is not None and c.first_output.finish_reason == "error"}
        for c in forks:
            if c.fork_of in failed:  # the load failed: the request fails with it, nothing to fork
                loader = next(x.first_output for x in first if x.index == c.fork_of)
                assert loader is not None
                c.fork_of = None
                c.finished = True
                c.error = loader.error or "KV load failed"
                c.error_status, c.kv_rejection = loader.error_status, loader.kv_rejection  # the same answer
        await self._submit([c for c in forks if not c.finished])

    async def _submit(self, choices: list[Choice]) -> None:
        slots = [self.choices.index(c) for c in choices]
        for slot, c in zip(slots, choices, strict=True):
            self._gens[slot] = self.engine.generate(c.engine_id, c.prompt_token_ids, c.params,
                                                    kv_transfer_params=c.kv_transfer_params)
        firsts = [asyncio.ensure_future(self._gens[slot].__anext__()) for slot in slots]
        try:
            results = await asyncio.gather(*firsts, return_exceptions=True)
        except BaseException:  # cancelled while waiting (client went away)
            for f in firsts:
                f.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            await self.close()
            raise
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            await self.close()
            if isinstance(error, StopAsyncIteration):
                raise RuntimeError("the engine ended a request without any output")
            raise error
        for choice, first in zip(choices, results, strict=True):
            choice.first_output = first  # type: ignore[assignment]

    def _handle(self, choice: Choice, out: RequestOutput) -> TextDelta:
        delta = choice.processor.process(out)
        choice.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        if out.remote_cached_tokens is not None:
            choice.remote_cached_tokens = out.remote_cached_tokens
        if delta.finished:
            choice.finished = True
            if out.finished:
                choice.held_kv = out.kv_transfer_params
                if out.finish_reason == "error":
                    choice.error = out.error or "the engine failed this request"
                    choice.error_status = out.error_status
                    choice.kv_rejection = out.kv_rejection
        return delta

    async def _one(self, i: int) -> AsyncIterator[tuple[Choice, RequestOutput, TextDelta]]:
        choice, gen = self.choices[i], self._gens[i]
        out = choice.first_output
        choice.first_output = None
        while out is not None:
            delta = self._handle(choice, out)
            yield choice, out, delta
            if delta.finished:
                if not out.finished:  # a stop string: the engine is still generating
                    await self.engine.abort(choice.engine_id)
                    with contextlib.suppress(Exception):
                        await gen.aclose()
                return
            try:
                out = await gen.__anext__()
            except StopAsyncIteration:
                return

    async def __aiter__(self) -> AsyncIterator[tuple[Choice, RequestOutput, TextDelta]]:
        try:
            if len(self.choices) == 1:
                async for item in self._one(0):
                    yield item
                return
            async with contextlib.aclosing(merged([self._one(i) for i in range(len(self.choices))])) as items:
                async for item in items:
                    yield item
        finally:
            await self.close()

    async def close(self) -> None:
        """Aborts whatever is unfinished (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for choice, gen in zip(self.choices, self._gens, strict=False):
            if not choice.finished:
                await self.engine.abort(choice.engine_id)
            with contextlib.suppress(Exception):
                await gen.aclose()
