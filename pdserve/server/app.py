"""The FastAPI application: OpenAI routes plus vLLM's utility routes, all errors in OpenAI shape."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from pdserve.api import pd
from pdserve.api.generate import AbortRequestsBody, GenerateRequest
from pdserve.api.http import CLIENT_CLOSED, ClientGone, RequestIdAuthMiddleware, parse_model, read_json
from pdserve.api.openai.errors import add_error_handlers, error_body
from pdserve.api.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    model_list,
)
from pdserve.api.openai.tokenization import detokenize_body, tokenize_body
from pdserve.api.openapi import document_json_bodies
from pdserve.api.scale_out_routes import ABORT_PATH, GENERATE_PATH
from pdserve.server.kv_params import deliver_kv_params
from pdserve.server.kv_pin import pin_prefix
from pdserve.server.serving_chat import create_chat_completion
from pdserve.server.serving_completion import create_completion
from pdserve.server.state import ServerState
from pdserve.server.tokens_only import TokenizerlessGuard, build_router
from pdserve.version import __version__

log = logging.getLogger("pdserve.server")


def build_app(state: ServerState, *, manage_engine: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            await state.engine.start()
        try:
            yield
        finally:
            state.draining = True
            if manage_engine:
                await state.engine.shutdown()

    app = FastAPI(title="pdserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state

    add_error_handlers(app, log)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return JSONResponse(error_body(f"{loc or 'body'}: {first.get('msg', 'invalid request')}", 400, loc), 400)

    async def guarded(request: Request, handler: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await handler()
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    # ---- OpenAI routes -------------------------------------------------------------------------
    async def generation(request: Request, protocol: Any, create: Callable[..., Awaitable[Any]]) -> Any:
        """A generation route: the body read (bounded) and validated as `protocol`, then `create` (guarded)."""
        async def run() -> Any:
            body = await read_json(request, state.max_request_body_bytes)
            return await create(state, parse_model(protocol, body), request)

        return await guarded(request, run)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generation(request, CompletionRequest, create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await generation(request, ChatCompletionRequest, create_chat_completion)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(model_list(state.served_model_names, state.model_path, state.max_model_len,
                                       state.started))

    # ---- utility routes ------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if getattr(state.engine, "dead_error", None) is not None:
            return JSONResponse(error_body("The engine has stopped.", 503), 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.post(pd.KV_PARAMS_PATH)
    async def kv_params(request: Request) -> Any:
        body = await read_json(request, state.max_request_body_bytes)
        return JSONResponse(await deliver_kv_params(state.engine, body, bool(state.info.get("kv_params_later"))))

    @app.post(pd.PIN_PATH)
    async def kv_pin(request: Request) -> Any:
        return await pin_prefix(state.engine, await read_json(request, state.max_request_body_bytes))

    @app.get("/pdserve/info")
    async def info() -> JSONResponse:
        return JSONResponse(state.info)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        async def run() -> Any:
            req = parse_model(TokenizeRequest, await read_json(request, state.max_request_body_bytes))
            state.check_model(req.model)
            return JSONResponse(tokenize_body(state.tokenizer, req, state.max_model_len))

        return await guarded(request, run)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        async def run() -> Any:
            req = parse_model(DetokenizeRequest, await read_json(request, state.max_request_body_bytes))
            state.check_model(req.model)
            return JSONResponse(detokenize_body(state.tokenizer, req, state.tokenizer.vocab_size))

        return await guarded(request, run)

    # Tokens-in/tokens-out routes: enabled by --tokens-only or --enable-scale-out, else 403 as in vLLM.
    app.include_router(build_router(enabled=state.tokens_only or state.enable_scale_out,
                                    tokens_only=state.tokens_only))
    if state.tokenizer is None:
        app.add_middleware(TokenizerlessGuard)  # the text routes answer 400 on a --tokens-only server
    app.add_middleware(RequestIdAuthMiddleware, api_key=state.api_key)
    document_json_bodies(app, {
        "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
        "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
        GENERATE_PATH: GenerateRequest, ABORT_PATH: AbortRequestsBody,
    })
    return app
