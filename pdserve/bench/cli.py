"""`pdserve bench`: `serve` (the default: flags may follow `bench` directly) and `compare`."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pdserve.bench.options import BenchSpec, add_serve_arguments
from pdserve.bench.runner import BenchError, run_serve
from pdserve.bench.tokenizer import TokenizerError

EPILOG = """\
examples:
  pdserve bench --base-url http://127.0.0.1:8192 --random-input-len 8192 --random-output-len 256 \\
      --request-rate 0.4 --num-prompts 100 --percentile-metrics ttft,tpot,itl \\
      --metric-percentiles 50,99 --goodput ttft:2000 tpot:30
  pdserve bench compare --target collocated=http://127.0.0.1:8000 --target 1p1d=http://127.0.0.1:8192 \\
      --request-rates 0.2,0.4,inf --goodput ttft:2000 tpot:30 --output-dir out/
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdserve.bench.compare_cli import add_compare_arguments

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    add_serve_arguments(parser)
    sub = parser.add_subparsers(dest="bench_command", metavar="{serve,compare}")
    serve = sub.add_parser("serve", help="one run against one server (same flags as `vllm bench serve`)")
    add_serve_arguments(serve)
    compare = sub.add_parser(
        "compare", help="sweep request rates over several targets; tables, plots, HTML report, go/no-go"
    )
    add_compare_arguments(compare)


def main(args: argparse.Namespace) -> int:
    command = getattr(args, "bench_command", None) or "serve"
    try:
        if command == "compare":
            from pdserve.bench.compare_cli import compare_main

            return compare_main(args)
        spec = BenchSpec.from_namespace(args)
        result = asyncio.run(run_serve(spec))
        return 0 if result["completed"] > 0 else 1
    except (BenchError, TokenizerError, ValueError, OSError) as err:
        print(f"pdserve bench: error: {err}", file=sys.stderr)
        return 2
