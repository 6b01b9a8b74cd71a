"""One OpenAI endpoint over render + tokens-only engines: `pdserve render MODEL --engine URL`.

`POST /v1/chat/completions` and `/v1/completions` run the three hops in-process on the render server:
render -> `POST {engine}/inference/v1/generate` -> derender, streaming included. With `--prefill URL
--decode URL` it is the disaggregated variant, and the engine is a proxy (pd_proxy.py): render once -> the
proxy's generate route, which runs the prefill leg and the decode leg (its retries, early decode leg, push
pairs and failure policy) and relays the decode leg's answer -> derender. The orchestrator walks no P/D leg
itself.

Beyond a plain relay:

* Stop strings work although the engine has no text: they are taken out of the engine request and
  applied by derender, and the engine request is aborted as soon as derender reports the stop.
* Streamed derender carries `stream_state` from chunk to chunk; the prompt is sent to derender once (its
  last few ids, on the first chunk), and the chat request without its message history, so a chunk costs
  the same whether the prompt has 10 tokens or 10,000 and whether it is the 1st chunk or the 1000th.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from pdserve.api.http import SSE_DONE, merged, sse, until_disconnect
from pdserve.api.openai.errors import APIError, error_body
from pdserve.render.engine_client import EngineLease, EnginePool
from pdserve.render.pd_proxy import ChildProxy
from pdserve.render.workers import RenderWorkers
from pdserve.text.output_parsers import PROMPT_TAIL_TOKENS

log = logging.getLogger("pdserve.render")

@dataclass
class _Leg:
    """One GenerateRequest (one prompt) on its way through the engine."""

    prompt_index: int
    gen: dict[str, Any]  # the rendered GenerateRequest
    url: str = ""
    lease: EngineLease | None = None  # the decode (or collocated) engine's, held until the leg ends
    engine_id: str = ""  # the engine's request id (from its first answer)
    state: dict[str, Any] | None = None
    finished: bool = False  # derender says every choice is finished
    tokens: dict[int, list[int]] = field(default_factory=dict)  # collected per choice (non-stream + stops)
    logprobs: dict[int, list[Any]] = field(default_factory=dict)
    finish: dict[int, tuple[str | None, Any]] = field(default_factory=dict)

    @property
    def prompt_ids(self) -> list[int]:
        return self.gen["token_ids"]

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()


def _slim_chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request as streamed derender needs it: options, not the conversation (the last message
    decides the role and echo)."""
    slim = dict(body)
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        slim["messages"] = messages[-1:]
    return slim


class Orchestrator:
    def __init__(self, workers: RenderWorkers, engines: EnginePool, pd_proxy: ChildProxy | None = None):
        """`engines`: the tokens-only engines, or (P/D) the one proxy `pd_proxy` that splits each request."""
        self.workers = workers
        self.engines = engines
        self.pd_proxy = pd_proxy
        self._background: set[asyncio.Future] = set()

    async def close(self) -> None:
        await self.engines.close()
        if self.pd_proxy is not None:
            self.pd_proxy.stop()

    # ---- shared steps ------------------------------------------------------------------------------
    def _engine_body(self, gen: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(gen)
        body["sampling_params"]["stop"] = []  # applied by derender (the engine has no text)
        body.pop("parse_context", None)
        return body

    def _has_stops(self, leg: _Leg) -> bool:
        return bool(leg.gen["sampling_params"].get("stop"))

    def _derender_chunk_body(self, kind: str, leg: _Leg, chunk: dict[str, Any], client: dict[str, Any],
                             n_prompts: int) -> dict[str, Any]:
        known = {s["index"] for s in (leg.state or {}).get("choices") or []}
        first = any(c.get("index") not in known for c in chunk.get("choices") or [])  # a choice's first chunk
        # The detokeniser and the reasoning parser need only the prompt's last ids, once; a completions echo
        # or return_token_ids needs the whole prompt, once.
        whole = kind != "chat" and bool(client.get("echo") or client.get("return_token_ids"))
        tail = (leg.prompt_ids if whole else leg.prompt_ids[-PROMPT_TAIL_TOKENS:]) if first else None
        body: dict[str, Any] = {"stream": True, "generate_chunk": chunk, "stream_state": leg.state}
        if kind == "chat":
            body.update(chat_request=client, prompt_tokens=len(leg.prompt_ids), prompt_token_ids=tail)
        else:
            ids: list[Any] = [None] * n_prompts
            ids[leg.prompt_index] = tail
            body.update(completion_request=client, prompt_tokens=len(leg.prompt_ids), prompt_index=leg.prompt_index,
                        prompt_token_ids=ids if first else None)
        return body

    async def _derender_chunk(self, kind: str, leg: _Leg, chunk: dict[str, Any], client: dict[str, Any],
                              n_prompts: int) -> dict[str, Any]:
        job = "derender_chat" if kind == "chat" else "derender_completion"
        result = await self.workers.call(job, self._derender_chunk_body(kind, leg, chunk, client, n_prompts))
        leg.state = result["stream_state"]
        leg.finished = bool(result["finished"])
        return result["chunk"]

    async def _engine_chunks(self, leg: _Leg, resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
        """The engine's stream for `leg`, chunk by chunk, until the engine ends it or derender says the leg is
        finished (a stop string) after the caller took a chunk: then the engine request is aborted. Close it
        (contextlib.aclosing) so that a caller that stops early aborts the engine request at once."""
        engine_done = False
        try:
            async for chunk in self.engines.events(resp):
                leg.engine_id = chunk.get("request_id", leg.engine_id)
                yield chunk
                if leg.finished:
                    break
            else:
                engine_done = True
        finally:
            if engine_done:
                resp.close()
            else:
                self._stop_engine(leg, resp)

    def _stop_engine(self, leg: _Leg, resp: aiohttp.ClientResponse) -> None:
        resp.close()  # the engine sees the disconnect and aborts
        if leg.engine_id:
            task = asyncio.ensure_future(self.engines.abort(leg.url, [leg.engine_id]))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # ---- non-streamed answers ------------------------------------------------------------------------
    async def _collect(self, kind: str, leg: _Leg, client: dict[str, Any], n_prompts: int) -> dict[str, Any]:
        """The engine's answer for one leg as a GenerateTokensResponse. With stop strings it streams, lets
        derender watch for them, and aborts the engine at the first stop; the tokens so far are returned."""
        body = self._engine_body(leg.gen)
        self._choose_engine(leg)
        try:
            return await self._collect_from_engine(kind, leg, body, client, n_prompts)
        finally:
            leg.release()

    def _choose_engine(self, leg: _Leg) -> None:
        """The decode (or collocated) engine of this leg, chosen by load (EnginePool.acquire) and held by it."""
        leg.lease = self.engines.acquire(len(leg.prompt_ids))
        leg.url = leg.lease.url

    async def _collect_from_engine(self, kind: str, leg: _Leg, body: dict[str, Any], client: dict[str, Any],
                                   n_prompts: int) -> dict[str, Any]:
        if not self._has_stops(leg):
            return await self.engines.generate(leg.url, body)
        body["stream_options"] = {"include_usage": False, "continuous_usage_stats": False}
        resp = await self.engines.open_stream(leg.url, body)
        slim = _slim_chat_request(client) if kind == "chat" else client
        first: dict[str, Any] | None = None
        async with contextlib.aclosing(self._engine_chunks(leg, resp)) as chunks:
            async for chunk in chunks:
                first = first or chunk
                for c in chunk.get("choices") or []:
                    j = c["index"]
                    leg.tokens.setdefault(j, []).extend(c.get("token_ids") or [])
                    if c.get("logprobs") is not None:
                        leg.logprobs.setdefault(j, []).extend(c["logprobs"].get("content") or [])
                    if c.get("finish_reason") is not None:
                        leg.finish[j] = (c["finish_reason"], c.get("stop_reason"))
                await self._derender_chunk(kind, leg, chunk, slim, n_prompts)
        n = leg.gen["sampling_params"].get("n", 1)
        choices = [{"index": j, "token_ids": leg.tokens.get(j, []),
                    "logprobs": {"content": leg.logprobs[j]} if j in leg.logprobs else None,
                    "finish_reason": leg.finish.get(j, ("abort", None))[0],
                    "stop_reason": leg.finish.get(j, ("abort", None))[1]} for j in range(n)]
        return {"request_id": (first or {}).get("request_id", leg.gen["request_id"]), "output_mode": "tokens",
                "model": (first or {}).get("model"), "created": (first or {}).get("created"), "choices": choices,
                "kv_transfer_params": None}

    # ---- entry points ------------------------------------------------------------------------------
    async def chat(self, raw: Request, body: dict[str, Any]) -> Any:
        gen = await self.workers.call("render_chat", body, raw.headers.get("x-request-id"))
        leg = _Leg(0, gen)
        if gen["stream"]:
            return await self._stream(raw, "chat", [leg], body)

        async def run() -> dict[str, Any]:
            resp = await self._collect("chat", leg, body, 1)
            return await self.workers.call("derender_chat", {
                "generate_response": resp, "prompt_token_ids": leg.prompt_ids, "prompt_tokens": len(leg.prompt_ids),
                "chat_request": body})

        return JSONResponse(await until_disconnect(raw, run()))

    async def completion(self, raw: Request, body: dict[str, Any]) -> Any:
        gens = await self.workers.call("render_completion", body, raw.headers.get("x-request-id"))
        legs = [_Leg(i, g) for i, g in enumerate(gens)]
        if gens[0]["stream"]:
            return await self._stream(raw, "completion", legs, body)

        async def run() -> dict[str, Any]:
            responses = await asyncio.gather(*(self._collect("completion", leg, body, len(legs)) for leg in legs))
            return await self.workers.call("derender_completion", {
                "generate_responses": list(responses), "prompt_token_ids": [leg.prompt_ids for leg in legs],
                "prompt_tokens": [len(leg.prompt_ids) for leg in legs], "completion_request": body})

        return JSONResponse(await until_disconnect(raw, run()))

    # ---- streamed answers --------------------------------------------------------------------------
    async def _open(self, leg: _Leg) -> aiohttp.ClientResponse:
        body = self._engine_body(leg.gen)
        self._choose_engine(leg)
        opts = dict(body.get("stream_options") or {})
        opts["continuous_usage_stats"] = False
        opts["include_usage"] = True  # the orchestrator builds the client's usage chunk itself
        body["stream_options"] = opts
        try:
            return await self.engines.open_stream(leg.url, body)
        except BaseException:
            leg.release()
            raise

    async def _stream(self, raw: Request, kind: str, legs: list[_Leg], client: dict[str, Any]) -> StreamingResponse:
        # Open every engine stream first: an engine error then is still the client's HTTP status.
        opened: list[aiohttp.ClientResponse] = []
        try:
            for leg in legs:
                opened.append(await self._open(leg))
        except BaseException:
            for resp in opened:
                resp.close()
            for leg in legs:
                leg.release()
            raise
        return StreamingResponse(self._relay(kind, legs, opened, client), media_type="text/event-stream")

    async def _derendered(self, kind: str, leg: _Leg, resp: aiohttp.ClientResponse, client: dict[str, Any],
                          n_prompts: int) -> AsyncIterator[dict[str, Any]]:
        async with contextlib.aclosing(self._engine_chunks(leg, resp)) as chunks:
            async for chunk in chunks:
                if chunk.get("choices"):  # else the engine's usage chunk: usage is counted from the state
                    yield await self._derender_chunk(kind, leg, chunk, client, n_prompts)

    async def _relay(self, kind: str, legs: list[_Leg], opened: list[aiohttp.ClientResponse],
                     client: dict[str, Any]) -> AsyncIterator[str]:
        slim = _slim_chat_request(client) if kind == "chat" else client
        streams = [self._derendered(kind, leg, resp, slim, len(legs)) for leg, resp in zip(legs, opened, strict=True)]
        first_id = legs[0].gen["request_id"]
        # One id for the whole answer, as in-process: completions with several prompts render "cmpl-x-0", ...
        shape = _ChunkShape(kind, client, first_id.removesuffix("-0") if len(legs) > 1 else first_id)
        try:
            async with contextlib.aclosing(merged(streams)) as chunks:
                async for chunk in chunks:
                    for frame in shape.frames(chunk):
                        yield frame
            if shape.include_usage:
                yield shape.usage_frame(legs)
            yield SSE_DONE
        except APIError as e:  # an engine's or derender's error, in the stream after the 200
            yield sse(json.dumps(error_body(e.message, e.status, e.param)))
            yield SSE_DONE
        except Exception as e:  # noqa: BLE001 - after the 200: the error goes in the stream
            log.exception("stream relay failed")
            yield sse(json.dumps(error_body(f"Internal server error: {e}", 500)))
            yield SSE_DONE
        finally:
            for leg in legs:
                leg.release()


class _ChunkShape:
    """Turns derendered chunks into the SSE frames an in-process server would send."""

    def __init__(self, kind: str, client: dict[str, Any], response_id: str):
        self.kind = kind
        opts = client.get("stream_options") if isinstance(client.get("stream_options"), dict) else {}
        self.include_usage = bool(opts.get("include_usage"))
        self.return_token_ids = bool(client.get("return_token_ids"))
        self.id = response_id
        self.model = ""
        self.created = int(time.time())

    def frames(self, chunk: dict[str, Any]) -> list[str]:
        chunk["id"] = self.id
        self.model = chunk.get("model", self.model)
        self.created = chunk.get("created") or self.created
        chunk.pop("usage", None)
        if self.kind != "chat":
            return [sse(json.dumps(chunk))] if chunk.get("choices") else []
        frames = []
        rest = []
        for c in chunk.get("choices") or []:
            delta = c["delta"]
            if "role" in delta:  # the role goes first, alone, as in-process servers send it
                role_chunk = {**self._head(), "choices": [{"index": c["index"], "delta": {
                    "role": delta.pop("role"), "content": ""}, "logprobs": None, "finish_reason": None}]}
                if self.return_token_ids and chunk.get("prompt_token_ids") is not None:
                    role_chunk["prompt_token_ids"] = chunk["prompt_token_ids"]
                frames.append(sse(json.dumps(role_chunk)))
                if delta.get("content") == "" and len(delta) == 1:
                    delta.pop("content")
            if delta or c.get("finish_reason") is not None or c.get("logprobs") or c.get("token_ids"):
                rest.append(c)
        if rest:
            body = {**self._head(), "choices": rest}
            if "kv_transfer_params" in chunk:
                body["kv_transfer_params"] = chunk["kv_transfer_params"]
            frames.append(sse(json.dumps(body)))
        return frames

    def _head(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage_frame(self, legs: list[_Leg]) -> str:
        prompt = sum(len(leg.prompt_ids) for leg in legs)
        completion = 0
        for leg in legs:
            states = (leg.state or {}).get("choices") or []
            completion += sum(s.get("num_output_tokens", 0) for s in states)
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
                 "prompt_tokens_details": None}
        return sse(json.dumps({**self._head(), "choices": [], "usage": usage}))
