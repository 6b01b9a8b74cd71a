"""The command-line flags `pdserve serve` and `pdserve render` share, with `vllm serve`'s names: the model and the
address, the OpenAI frontend's options (chat template, output parsers, API key, request bound) and logging.

A top-level module beside bindcheck.py because both servers use it and neither imports the other (server, render,
proxy and bench import api/, never each other); standard library only, so `pdserve render` stays torch-free.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from pdserve.bindcheck import exposure_warning

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model, where to serve it, and how its text is templated and bounded."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF model folder or embedded model name (default: the embedded smollm2-135m)")
    p.add_argument("--model", dest="model_flag", default=None, help="same as MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template, inline or a file path")
    p.add_argument("--max-model-len", type=int, default=None)


def add_frontend_arguments(p: argparse.ArgumentParser) -> None:
    """Output parsers, the API key, the request body bound and the logging flags."""
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="split <think> reasoning out of chat answers (reasoning_content)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='parse tool calls when a chat request has tools and tool_choice "auto"')
    p.add_argument("--tool-call-parser", default=None, choices=["hermes"])
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 (env VLLM_API_KEY)")
    p.add_argument("--max-request-body-bytes", type=int, default=64 * 1024 * 1024)
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS[:-1])
    p.add_argument("--uvicorn-log-level", default="info", choices=LOG_LEVELS)
    p.add_argument("--disable-uvicorn-access-log", action="store_true")


def configure_logging(args: argparse.Namespace) -> None:
    """The root logger at --log-level, one line a record in the servers' shared format."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)


def check_frontend_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the shared flags, in one line; None when nothing is."""
    if not 0 < args.port < 65536:
        return f"--port must be in 1..65535, got {args.port}"
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        return "--enable-auto-tool-choice requires --tool-call-parser"
    if args.max_request_body_bytes < 1024:
        return "--max-request-body-bytes must be at least 1024"
    return None


def api_key(args: argparse.Namespace) -> str | None:
    """The key clients must send: --api-key, else the environment's VLLM_API_KEY (vLLM's), else none."""
    return args.api_key or os.environ.get("VLLM_API_KEY") or None


def startup_problem(program: str, args: argparse.Namespace, check_args: Callable[[argparse.Namespace], str | None],
                    check_ports: Callable[[argparse.Namespace], str | None], log: logging.Logger) -> int | None:
    """The checks a server runs before anything slow (loading a model), each failure one line on stderr: the exit
    status (2: bad flags, 1: a port it cannot bind), or None to go on. Warns when it would serve other machines
    without an API key."""
    problem = check_args(args)
    if problem:
        print(f"{program}: error: {problem}", file=sys.stderr)
        return 2
    problem = check_ports(args)
    if problem:
        print(f"{program}: error: {problem}", file=sys.stderr)
        return 1
    warning = exposure_warning(program, args.host, api_key(args))
    if warning:
        log.warning(warning)
    return None


def uvicorn_server(app: Any, args: argparse.Namespace, log: logging.Logger, **config: Any) -> Any:
    """The uvicorn server of `app` on --host/--port with the logging flags (`config`: more uvicorn settings).

    uvicorn turns SIGINT/SIGTERM into a graceful shutdown (the app's lifespan stops what it started) and then
    re-raises the signal under the handler installed before it: with the default one the process would die right
    there, so that one is made a no-op and the server exits normally."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=5, lifespan="on", **config,
    ))

    def after_shutdown(signum: int, frame: Any) -> None:
        log.debug("signal %d after shutdown", signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, after_shutdown)
    return server
