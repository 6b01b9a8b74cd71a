"""`pdserve render [MODEL]`: the GPU-less render tier (vLLM's `vllm launch render`).

Serves `/v1/{chat/,}completions/render` and `/derender`, `/tokenize`, `/detokenize`, `/v1/models`,
`/health`, `/version`. With `--engine URL` (tokens-only engines) it also serves `/v1/chat/completions` and
`/v1/completions` itself, running render -> engine -> derender; with `--prefill URL --decode URL` it runs
the disaggregated variant through a `pdserve proxy` child (pd_proxy.py). Never imports torch.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from pdserve import frontend_args

log = logging.getLogger("pdserve.render")


def add_arguments(p: argparse.ArgumentParser) -> None:
    frontend_args.add_model_arguments(p)
    p.add_argument("--renderer-num-workers", type=int, default=1,
                   help="CPU workers for templating/tokenisation/detokenisation: 1 = a thread, N > 1 = N processes")
    p.add_argument("--engine", nargs="+", default=None, metavar="URL",
                   help="tokens-only engines: also serve /v1/chat/completions and /v1/completions (three hops)")
    p.add_argument("--prefill", nargs="+", default=None, metavar="URL", help="P/D: prefill engines (with --decode)")
    p.add_argument("--decode", nargs="+", default=None, metavar="URL", help="P/D: decode engines (with --prefill)")
    p.add_argument("--proxy-arg", action="append", default=[], metavar="ARGS",
                   help="P/D: arguments for the `pdserve proxy` child that runs the legs (e.g. "
                        "'--on-prefill-failure retry'); repeatable")
    p.add_argument("--engine-api-key", default=None, help="bearer key the engines require")
    frontend_args.add_frontend_arguments(p)


def _check_args(args: argparse.Namespace) -> str | None:
    problem = frontend_args.check_frontend_args(args)
    if problem:
        return problem
    if args.renderer_num_workers < 1:
        return "--renderer-num-workers must be at least 1"
    if bool(args.prefill) != bool(args.decode):
        return "--prefill and --decode go together"
    if args.engine and args.decode:
        return "use either --engine (collocated) or --prefill/--decode (disaggregated)"
    if args.proxy_arg and not args.decode:
        return "--proxy-arg goes with --prefill/--decode"
    return None


def _check_port(args: argparse.Namespace) -> str | None:
    from pdserve.bindcheck import port_taken

    problem = port_taken(args.host, args.port)
    return f"--port: {problem}" if problem else None


def resolve_model_folder(model: str | None) -> Path:
    if model is not None and Path(model).is_dir():
        return Path(model)
    from pdserve.model.default_model import resolve_model  # torch-free GGUF -> HF conversion

    return Path(resolve_model(model))


def build(args: argparse.Namespace):
    from pdserve.model.default_model import DEFAULT_MODEL
    from pdserve.render.app import build_app
    from pdserve.render.context import RenderConfig
    from pdserve.render.engine_client import EnginePool
    from pdserve.render.orchestrator import Orchestrator
    from pdserve.render.pd_proxy import ChildProxy
    from pdserve.render.workers import RenderWorkers
    from pdserve.text.output_parsers import ParserConfig

    model = args.model_flag or args.model_tag
    folder = resolve_model_folder(model)
    names = args.served_model_name or [model or DEFAULT_MODEL]
    parsers = ParserConfig(args.reasoning_parser, args.tool_call_parser, args.enable_auto_tool_choice)
    config = RenderConfig.from_model_dir(folder, served_model_names=list(names), tokenizer=args.tokenizer,
                                         max_model_len=args.max_model_len, chat_template=args.chat_template,
                                         parsers=parsers)
    workers = RenderWorkers(config, args.renderer_num_workers)
    orchestrator = None
    if args.engine:
        orchestrator = Orchestrator(workers, EnginePool(args.engine, args.engine_api_key))
    elif args.decode:
        # the engine key travels as the proxy's client Authorization, which it forwards to the instances
        pd_proxy = ChildProxy(args.prefill, args.decode, [w for a in args.proxy_arg for w in shlex.split(a)])
        orchestrator = Orchestrator(workers, EnginePool([pd_proxy.start()], args.engine_api_key), pd_proxy)
    app = build_app(workers, orchestrator=orchestrator, api_key=frontend_args.api_key(args),
                    max_request_body_bytes=args.max_request_body_bytes)
    return app, config


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    refused = frontend_args.startup_problem("pdserve render", args, _check_args, _check_port, log)
    if refused is not None:
        return refused
    try:
        app, config = build(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"pdserve render: error: {e}", file=sys.stderr)
        return 1
    log.info("render tier for %s on http://%s:%d (max_model_len=%d, workers=%d)", config.served_model_names[0],
             args.host, args.port, config.max_model_len, args.renderer_num_workers)
    server = frontend_args.uvicorn_server(app, args, log)  # its lifespan stops the render workers
    server.run()
    return 0 if server.started else 1
