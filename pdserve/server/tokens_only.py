"""Tokens-in/tokens-out engine routes (vLLM's scale-out API, section 10.2 of the protocol notes).

* `POST /inference/v1/generate`: `GenerateRequest` -> `GenerateTokensResponse`, or SSE chunks with
  token-id deltas. `kv_transfer_params` behave exactly as on the OpenAI routes (a prefill leg returns the
  final output's params; a decode leg loads the remote KV first).
* `POST /inference/v1/abort_requests` (and the legacy `POST /abort_requests` on a `--tokens-only`
  server): `{"request_ids": [...]}` -> 200; the requests finish with `finish_reason: "abort"`.

Decisions where vLLM leaves room:

* Stop strings need text, which the engine does not have: 400 (use `stop_token_ids`). `output_mode`
  other than "tokens" is refused on a `--tokens-only` server; on a normal server with
  `--enable-scale-out`, "text" adds each choice's `text` (and then stop strings work), "derender" is
  refused (use the render tier's `/derender`).
* A prefill leg (`kv_transfer_params.do_remote_decode`) with `stream: true` is refused (400): streamed
  chunks never carry `kv_transfer_params`, so the caller could never hand the held blocks to a decode
  instance and they would stay pinned until the lease expires.
* Logprobs carry real values: `{"content": [{"token_id", "logprob", "rank", "top_logprobs": [...]}]}`.
* Omitted sampling fields get the model's generation_config defaults, like the OpenAI routes; an omitted
  `max_tokens` is the room left in the context.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.api.generate import AbortRequestsBody, GenerateRequest, GenerateSamplingParams
from pdserve.api.http import CLIENT_CLOSED, ClientGone, parse_model, read_json, sse
from pdserve.api.openai.errors import APIError, bad_request, error_body, error_response, not_supported
from pdserve.api.openai.params import MAX_N, resolve_max_tokens, stop_list, truncate_prompt
from pdserve.api.pd import KVTransferParams
from pdserve.api.scale_out_routes import ABORT_PATH, GENERATE_ID_PREFIX, GENERATE_PATH, LEGACY_ABORT_PATH
from pdserve.server.generation import Choice, Generation
from pdserve.server.pipeline import (
    Recorders,
    held_json,
    make_choices,
    now,
    outputs,
    respond,
    stream_usage,
    usage,
)
from pdserve.server.state import ServerState
from pdserve.text.logprobs import clamp

SAMPLING_PREFIX = "sampling_params."  # where this route's sampling fields live, for error params


# Routes that need text; a --tokens-only server has no tokenizer (vLLM: skip_tokenizer_init).
TEXT_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})


class TokenizerlessGuard:
    """Pure ASGI: on a server without a tokenizer, the text routes answer 400 instead of failing inside."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in TEXT_PATHS:
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(
            f"{scope.get('path')} needs a tokenizer, and this server runs --tokens-only: send token ids to "
            f"{GENERATE_PATH}, or put a render tier (pdserve render MODEL --engine URL) in front.", 400)).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def forbidden() -> JSONResponse:
    body = error_body("The scale-out API (/inference/v1/*) is disabled; start the server with --enable-scale-out "
                      "or --tokens-only.", 403, None, "PermissionDeniedError")
    return JSONResponse(body, 403)


# ---- request -> engine parameters --------------------------------------------------------------------
def _check_request(sp: GenerateSamplingParams, text_mode: bool) -> None:
    """What this route refuses before any engine parameter is built (the rest is the shared pipeline's)."""
    for name in ("bad_words", "prompt_logprobs"):
        if getattr(sp, name):
            raise not_supported(f"sampling_params.{name}")
    if not 1 <= sp.n <= MAX_N:
        raise bad_request(f"sampling_params.n must be in 1..{MAX_N}, got {sp.n}.", "sampling_params.n")
    if stop_list(sp.stop) and not text_mode:
        raise bad_request("Stop strings are not supported in tokens mode (the engine works on token ids, not "
                          "text); use sampling_params.stop_token_ids.", "sampling_params.stop")


def tokens_logprobs(lps: list[Any] | None, num_top: int | None) -> dict[str, Any] | None:
    if lps is None or num_top is None:
        return None
    content = []
    for lp in lps:
        top = [{"token_id": tid, "logprob": clamp(value), "rank": r}
               for r, (tid, value) in enumerate(lp.top[:num_top], start=1)]
        content.append({"token_id": lp.token_id, "logprob": clamp(lp.logprob), "rank": lp.rank, "top_logprobs": top})
    return {"content": content}


class _Running:
    """External request id ("generate-tokens-…") -> engine ids of its choices, for abort_requests."""

    def __init__(self) -> None:
        self._ids: dict[str, list[str]] = {}

    def add(self, external: str, engine_ids: list[str]) -> None:
        self._ids.setdefault(external, []).extend(engine_ids)

    def remove(self, external: str, engine_ids: list[str]) -> None:
        ids = self._ids.get(external)
        if ids is None:
            return
        for e in engine_ids:
            if e in ids:
                ids.remove(e)
        if not ids:
            del self._ids[external]

    def lookup(self, request_id: str) -> list[str]:
        return list(self._ids.get(request_id) or self._ids.get(GENERATE_ID_PREFIX + request_id) or [request_id])


# ---- the route handlers ------------------------------------------------------------------------------
class TokensRoutes:
    def __init__(self, get_state: Callable[[Request], ServerState], *, enabled: bool, tokens_only: bool):
        self.get_state = get_state
        self.enabled = enabled
        self.tokens_only = tokens_only
        self.running = _Running()

    async def generate(self, raw: Request) -> Any:
        if not self.enabled:
            return forbidden()
        state = self.get_state(raw)
        arrival = now()
        body = await read_json(raw, state.max_request_body_bytes)
        req = parse_model(GenerateRequest, body)
        model = state.check_model(req.model)
        state.check_accepting()
        text_mode = req.output_mode == "text"
        if req.output_mode != "tokens" and self.tokens_only:
            raise bad_request(f"output_mode {req.output_mode!r} needs a tokenizer; this server runs --tokens-only "
                              "(only 'tokens' is accepted).", "output_mode")
        if req.output_mode == "derender":
            raise not_supported("output_mode 'derender'", "; derender with the render tier (pdserve render)")
        sp = req.sampling_params
        _check_request(sp, text_mode)
        kv = KVTransferParams.read(req.kv_transfer_params) if req.kv_transfer_params is not None else None
        if req.stream and kv is not None and kv.remote_decode:
            raise bad_request("A prefill leg (kv_transfer_params.do_remote_decode) must use stream: false: streamed "
                              "chunks do not carry kv_transfer_params.", "stream")
        ids = list(req.token_ids)
        bad = next((t for t in ids if t >= state.vocab_size), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of vocabulary (size {state.vocab_size}).", "token_ids")
        ids = truncate_prompt(ids, sp.truncate_prompt_tokens, state.max_model_len)
        max_tokens = resolve_max_tokens(sp.max_tokens, len(ids), state.max_model_len, state.defaults,
                                        "sampling_params.max_tokens")
        external = GENERATE_ID_PREFIX + (raw.headers.get("x-request-id") or req.request_id)
        raw.state.request_id = external
        choices = make_choices(state, sp, external, [ids], [max_tokens], sp.logprobs, kv, per_prompt_suffix=False,
                               param_prefix=SAMPLING_PREFIX, detokenize=text_mode)
        engine_ids = [c.engine_id for c in choices]
        self.running.add(external, engine_ids)
        view = _GenerateView(req, external, model, ids, text_mode, kv)
        return await respond(state, raw, choices, view, stream=req.stream, arrival=arrival,
                             param_prefix=SAMPLING_PREFIX, on_close=lambda: self.running.remove(external, engine_ids))

    async def abort(self, raw: Request) -> Any:
        if not self.enabled:
            return forbidden()
        state = self.get_state(raw)
        body = await read_json(raw, state.max_request_body_bytes)
        req = parse_model(AbortRequestsBody, body)
        aborted = []
        for rid in req.request_ids:
            for engine_id in self.running.lookup(rid):
                await state.engine.abort(engine_id)
                aborted.append(engine_id)
        return JSONResponse({"request_ids": req.request_ids, "num_aborted": len(aborted)})


async def _guard(handler: Callable[[Request], Any], request: Request) -> Any:
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)


def build_router(get_state: Callable[[Request], ServerState] | None = None, *, enabled: bool,
                 tokens_only: bool) -> APIRouter:
    """The scale-out routes. `enabled=False` (a normal server without `--enable-scale-out`) answers 403."""
    routes = TokensRoutes(get_state or (lambda r: r.app.state.server), enabled=enabled, tokens_only=tokens_only)
    router = APIRouter()

    @router.post(GENERATE_PATH)
    async def generate(request: Request) -> Any:
        return await _guard(routes.generate, request)

    @router.post(ABORT_PATH)
    async def abort_requests(request: Request) -> Any:
        return await _guard(routes.abort, request)

    if tokens_only:
        @router.post(LEGACY_ABORT_PATH)
        async def legacy_abort_requests(request: Request) -> Any:
            return await _guard(routes.abort, request)

    return router


# ---- responses ---------------------------------------------------------------------------------------
class _GenerateView:
    def __init__(self, req: GenerateRequest, external: str, model: str, prompt_ids: list[int], text_mode: bool,
                 kv: KVTransferParams | None):
        self.req = req
        self.id = external
        self.model = model
        self.created = int(time.time())
        self.prompt_ids = prompt_ids
        self.text_mode = text_mode
        self.kv = kv
        self.mode = req.output_mode
        self.num_top = req.sampling_params.logprobs

    def _choice(self, c: Choice, token_ids: list[int], lps: list[Any] | None, finished: bool,
                finish_reason: str | None, stop_reason: Any, text: str | None) -> dict[str, Any]:
        item: dict[str, Any] = {
            "index": c.index,
            "finish_reason": finish_reason if finished else None,
            "stop_reason": stop_reason if finished else None,
            "token_ids": token_ids,
            "logprobs": tokens_logprobs(lps, self.num_top),
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": None,
        }
        if self.text_mode:
            item["text"] = text
        return item

    def body(self, gen: Generation) -> dict[str, Any]:
        choices = []
        for c in gen.choices:
            p = c.processor
            lps = list(p.logprobs) if self.num_top is not None else None
            choices.append(self._choice(c, list(p.token_ids), lps, True, p.finish_reason, p.stop_reason,
                                        p.text if self.text_mode else None))
        return {
            "request_id": self.id,
            "model": self.model,
            "created": self.created,
            "output_mode": self.mode,
            "choices": choices,
            "usage": self._usage(gen.choices, self.kv),
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": self.prompt_ids if self.req.return_token_ids else None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": held_json(gen.choices[0].held_kv),
            "ec_transfer_params": None,
        }

    def _usage(self, choices: list[Choice], kv: KVTransferParams | None) -> dict[str, Any]:
        """The usage of `choices` in the generate route's keys: the counts, no prompt_tokens_details."""
        u = usage(choices, [self.prompt_ids], len(choices), kv)
        return {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {"request_id": self.id, "model": self.model, "created": self.created, "output_mode": self.mode,
                "choices": choices, **extra}
        return sse(json.dumps(body))

    async def frames(self, gen: Generation, recorders: Recorders) -> AsyncIterator[str]:
        include_usage, continuous = stream_usage(self.req.stream_options)
        first = True
        async for c, delta in outputs(gen, recorders):
            lps = delta.logprobs if self.num_top is not None else None
            item = self._choice(c, delta.token_ids, lps, delta.finished, delta.finish_reason, delta.stop_reason,
                                delta.text if self.text_mode else None)
            extra: dict[str, Any] = {}
            if first and self.req.return_token_ids:
                extra["prompt_token_ids"] = self.prompt_ids
            first = False
            if continuous:
                extra["usage"] = self._usage([c], None)
            yield self._chunk([item], **extra)
        if include_usage:
            yield self._chunk([], usage=self._usage(gen.choices, self.kv))
