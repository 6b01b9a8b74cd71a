"""The render server: render/derender routes, vLLM's utility routes, and the optional orchestrator."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from pdserve.api.generate import ChatDerenderRequest, CompletionDerenderRequest
from pdserve.api.http import CLIENT_CLOSED, ClientGone, RequestIdAuthMiddleware, read_json
from pdserve.api.openai.errors import add_error_handlers, error_body
from pdserve.api.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    model_list,
)
from pdserve.api.openapi import document_json_bodies
from pdserve.render.orchestrator import Orchestrator
from pdserve.render.workers import RenderWorkers
from pdserve.version import __version__

log = logging.getLogger("pdserve.render")


def build_app(workers: RenderWorkers, *, orchestrator: Orchestrator | None = None, api_key: str | None = None,
              max_request_body_bytes: int = 64 * 1024 * 1024) -> FastAPI:
    ctx = workers.ctx
    started = time.time()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await workers.start()
        try:
            yield
        finally:
            if orchestrator is not None:
                await orchestrator.close()
            workers.shutdown()

    app = FastAPI(title="pdserve render", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.workers = workers

    add_error_handlers(app, log)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(f"invalid request: {exc.errors()[:1]}", 400), 400)

    async def guarded(request: Request, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        try:
            body = await read_json(request, max_request_body_bytes)
            return await handler(body)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    def job(name: str, with_request_id: bool = False) -> Callable[[Request], Awaitable[Any]]:
        async def route(request: Request) -> Any:
            async def run(body: Any) -> Any:
                args = (body, request.headers.get("x-request-id")) if with_request_id else (body,)
                return JSONResponse(await workers.call(name, *args))

            return await guarded(request, run)

        return route

    app.add_api_route("/v1/chat/completions/render", job("render_chat", True), methods=["POST"])
    app.add_api_route("/v1/completions/render", job("render_completion", True), methods=["POST"])
    app.add_api_route("/v1/chat/completions/derender", job("derender_chat"), methods=["POST"])
    app.add_api_route("/v1/completions/derender", job("derender_completion"), methods=["POST"])
    app.add_api_route("/tokenize", job("tokenize"), methods=["POST"])
    app.add_api_route("/detokenize", job("detokenize"), methods=["POST"])

    if orchestrator is not None:
        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await guarded(request, lambda body: orchestrator.chat(request, body))

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await guarded(request, lambda body: orchestrator.completion(request, body))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(model_list(ctx.config.served_model_names, ctx.config.model_path, ctx.max_model_len,
                                       started))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/pdserve/info")
    async def info() -> JSONResponse:
        pd = orchestrator.pd_proxy if orchestrator is not None else None
        return JSONResponse({
            "version": __version__,
            "role": "render",
            "model": ctx.config.model_path,
            "served_model_name": ctx.model_name,
            "max_model_len": ctx.max_model_len,
            "renderer_num_workers": workers.num_workers,
            "reasoning_parser": ctx.parsers.reasoning_parser,
            "tool_call_parser": ctx.parsers.tool_call_parser,
            "enable_auto_tool_choice": ctx.parsers.enable_auto_tool_choice,
            "engines": pd.decode if pd is not None else orchestrator.engines.urls if orchestrator is not None else None,
            "prefill": pd.prefill if pd is not None else None,
            "pd_proxy": pd.url if pd is not None else None,  # the proxy running this tier's P/D legs (pd_proxy.py)
            # The render tier must never load torch; tests and preflight read this.
            "torch_loaded": "torch" in sys.modules,
            "workers_torch_loaded": await workers.call("torch_loaded"),
        })

    app.add_middleware(RequestIdAuthMiddleware, api_key=api_key)
    document_json_bodies(app, {
        "/v1/chat/completions/render": ChatCompletionRequest, "/v1/completions/render": CompletionRequest,
        "/v1/chat/completions/derender": ChatDerenderRequest, "/v1/completions/derender": CompletionDerenderRequest,
        "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
        "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
    })
    return app
