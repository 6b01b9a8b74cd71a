"""`pdserve` command line: each subcommand lives in its own module and is imported lazily."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module defines `add_arguments(parser)` and `main(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("pdserve.generate_cli", "offline generation with the engine"),
    "serve": ("pdserve.server.cli", "OpenAI-compatible instance server (collocated, prefill or decode)"),
    "proxy": ("pdserve.proxy.cli", "the P/D proxy in front of prefill and decode instances"),
    "up": ("pdserve.launch.cli", "launch a local topology (collocated, 1P1D, xPyD) behind the proxy"),
    "preflight": ("pdserve.preflight.cli", "go/no-go checks against a running deployment"),
    "plan": ("pdserve.preflight.plan", "KV transfer arithmetic for a model and prompt length"),
    "bench": ("pdserve.bench.cli", "goodput benchmark client and collocated-vs-disaggregated compare"),
    "render": ("pdserve.render.cli", "GPU-less render tier: templating, tokenisation, parsers"),
    "profile": ("pdserve.sim.profile_cli", "measure an instance's profile (prefill, decode, KV, handoff) for `sim`"),
    "sim": ("pdserve.sim.cli", "simulate a deployment from instance profiles; --search sizes a fleet"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    argv = sys.argv[1:]
    # Only import the module of the subcommand actually used: keeps `pdserve proxy` free of torch.
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args = parser.parse_args()
    if args.version:
        from pdserve.version import __version__

        print(__version__)
        return 0
    if not args.command:
        parser.print_help()
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
