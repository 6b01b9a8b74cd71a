"""`pdserve proxy`: the production P/D proxy in front of vLLM-compatible prefill and decode instances.

Precedence of settings: built-in defaults < environment (PDSERVE_API_KEY, PDSERVE_ADMIN_KEY,
PDSERVE_UPSTREAM_API_KEY) < --config FILE < command-line flags.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from typing import Any

from pdserve.bindcheck import exposure_warning
from pdserve.proxy.config import PREFILL_FAILURE_POLICIES, ProxyConfig, load_config_file

SHUTDOWN_GRACE_S = 10.0
_ENV_KEYS = {
    "api_key": "PDSERVE_API_KEY",
    "admin_key": "PDSERVE_ADMIN_KEY",
    "upstream_api_key": "PDSERVE_UPSTREAM_API_KEY",
}
_D = ProxyConfig()  # defaults, quoted in the help texts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    s = argparse.SUPPRESS  # unset flags stay absent, so --config values are not overridden by defaults
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--host", default=s, help=f"bind address (default {_D.host})")
    parser.add_argument(
        "--port", type=int, default=s, help=f"bind port, 0 picks a free one (default {_D.port})"
    )
    parser.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        default=s,
        metavar="URL",
        help="prefill instance(s), http://host:port or host:port; none = collocated mode over the decode pool",
    )
    parser.add_argument(
        "--decode", nargs="+", action="extend", default=s, metavar="URL", help="decode instance(s)"
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="YAML (.yaml/.yml) or TOML (.toml) file of these settings",
    )
    parser.add_argument("--api-key", default=s, help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument(
        "--admin-key",
        default=s,
        help="enable POST /pdserve/instances (add/remove instances) for 'Authorization: Bearer KEY'; "
        "without it that route is off (403)",
    )
    parser.add_argument(
        "--upstream-api-key",
        default=s,
        help="send 'Authorization: Bearer KEY' to instances; without it the client's Authorization header "
        "is forwarded unless --api-key is set",
    )
    parser.add_argument(
        "--on-prefill-failure",
        choices=PREFILL_FAILURE_POLICIES,
        default=s,
        help="when the prefill leg fails or returns no kv_transfer_params: retry = try other prefill "
        "instances (--prefill-retries) then answer 502; fail = answer 502 at once; decode-local = retry, "
        f"then let a decode instance prefill locally (default {_D.on_prefill_failure})",
    )
    parser.add_argument(
        "--prefill-retries",
        type=int,
        default=s,
        help=f"other prefill instances to try (default {_D.prefill_retries})",
    )
    parser.add_argument(
        "--decode-retries",
        type=int,
        default=s,
        help="other decode instances to try when a decode leg cannot connect (any failure before a byte "
        f"was relayed on non-disaggregated paths) (default {_D.decode_retries})",
    )
    parser.add_argument(
        "--disagg-threshold-tokens",
        type=int,
        default=s,
        help="prompts estimated below N tokens go straight to a decode instance (default 0 = always disaggregate)",
    )
    parser.add_argument(
        "--no-kv-routing",
        dest="kv_routing",
        action="store_false",
        default=s,
        help="do not route by cached prefix. By default the proxy subscribes to the KV events of every instance "
        "whose /pdserve/info advertises them (pdserve serve --kv-events-config), keeps a fleet-wide index of "
        "cached blocks, and sends each request to the instance with the lowest cost = --kv-overlap-weight x "
        "uncached prompt tokens + outstanding tokens (prefill instances in P/D, decode instances when they "
        "compute the prompt); instances without events are routed as before",
    )
    parser.add_argument(
        "--kv-overlap-weight",
        type=float,
        default=s,
        help="weight of the uncached prompt tokens against the instance's outstanding tokens; 0 = load only "
        f"(default {_D.kv_overlap_weight:g})",
    )
    parser.add_argument(
        "--kv-hit-fraction",
        type=float,
        default=s,
        help="for pdserve_proxy_kv_routed_requests_total{outcome=hit}: the chosen instance holds at least this "
        f"share of the longest prefix cached in the pool (default {_D.kv_hit_fraction:g})",
    )
    parser.add_argument(
        "--tokenizer",
        default=s,
        metavar="PATH",
        help="the model's tokenizer (HF folder or tokenizer.json) for computing prompt block hashes locally; "
        "without it the proxy asks an instance's POST /tokenize (one extra local round trip per request)",
    )
    parser.add_argument(
        "--prefix-affinity",
        action="store_true",
        default=s,
        help="consistent prefill choice by prompt prefix, for instances that publish no KV events",
    )
    parser.add_argument(
        "--prefix-affinity-chars",
        type=int,
        default=s,
        help=f"prefix length hashed (default {_D.prefix_affinity_chars})",
    )
    parser.add_argument(
        "--prefix-affinity-slack",
        type=int,
        default=s,
        help="use the affine instance unless it has more than N requests in flight above the least loaded "
        f"(default {_D.prefix_affinity_slack})",
    )
    parser.add_argument(
        "--rewrite-remote-host",
        action="store_true",
        default=s,
        help="replace remote_host in the prefill's kv_transfer_params by the host the proxy reached it at",
    )
    parser.add_argument(
        "--no-disagg-n",
        dest="disagg_n",
        action="store_false",
        default=s,
        help="serve n > 1 requests on one decode instance (needed in front of vLLM decode instances, which "
             "cannot fork one KV load into n choices)",
    )
    parser.add_argument(
        "--no-chat-token-ids",
        dest="chat_token_ids",
        action="store_false",
        default=s,
        help="do not hand the prefill's prompt_token_ids to the decode leg of chat requests",
    )
    parser.add_argument(
        "--no-early-decode-leg",
        dest="early_decode_leg",
        action="store_false",
        default=s,
        help="send the decode leg only once the prefill answered (default: pdserve decode instances get it "
             "with the prefill leg and its kv_transfer_params afterwards, overlapping its parsing with the "
             "prefill)",
    )
    parser.add_argument(
        "--kv-transfer-mode",
        choices=("pull", "push"),
        default=argparse.SUPPRESS,
        help="override the transfer mode learnt from each instance (pdserve's /pdserve/info, the transfer_mode of "
             "vLLM's prefill answers; unset by default): pull, the decode instance READs the KV after the "
             "prefill; push (kv_connector NixlPushConnector), the prefill WRITEs the KV into blocks the decode "
             "registered (a pdserve pair's legs go out at once, vLLM's one after the other)",
    )
    parser.add_argument(
        "--no-kv-history",
        dest="kv_history",
        action="store_false",
        default=s,
        help="do not hand a conversation's history held by a decode instance (bidirectional_kv_xfer) to the "
             "next turn's prefill: it recomputes the history",
    )
    parser.add_argument(
        "--kv-history-max-entries",
        type=int,
        default=s,
        help=f"conversations whose held history the proxy remembers (LRU; default {_D.kv_history_max_entries})",
    )
    parser.add_argument(
        "--kv-history-bandwidth",
        default=s,
        help="link between instances for the pull-or-recompute arithmetic, as `pdserve plan --bandwidth` "
             f"(default {_D.kv_history_bandwidth})",
    )
    parser.add_argument(
        "--kv-history-prefill-tps",
        type=float,
        default=s,
        help="prefill tokens/s of one instance for the same arithmetic, where no prefill instance advertises the "
             "prefill_cost it measured in its /pdserve/info (CPU and vLLM instances; a GPU instance's recompute "
             f"is priced at the margin from it) (default {_D.kv_history_prefill_tps:g})",
    )
    parser.add_argument(
        "--kv-history-choice",
        choices=("cost", "pull", "recompute"),
        default=s,
        help="cost: the arithmetic above decides each turn; pull / recompute: always that, the predictions still "
             f"reported (for benchmarks) (default {_D.kv_history_choice})",
    )
    parser.add_argument(
        "--kv-history-overhead-s",
        type=float,
        default=s,
        help="fixed cost in seconds of one read back for the same arithmetic: side-channel claim, transfer setup "
             f"and release (default {_D.kv_history_overhead_s:g})",
    )
    parser.add_argument(
        "--no-kv-peer-pull",
        dest="kv_peer_pull",
        action="store_false",
        default=s,
        help="never ask a peer instance to pin a cached prefix the chosen prefill instance lacks (default: "
             "ask instances whose /pdserve/info has kv_peer_pin, when the arithmetic above says reading is cheaper)",
    )
    parser.add_argument(
        "--kv-peer-pull-min-tokens",
        type=int,
        default=s,
        help="a peer must cache this many more prompt tokens than the chosen prefill instance to be asked "
             f"(default {_D.kv_peer_pull_min_tokens}, vLLM's kv_recompute_threshold)",
    )
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=s,
        help=f"client requests in flight before 503 (default {_D.max_inflight})",
    )
    parser.add_argument(
        "--connect-timeout", type=float, default=s, help=f"seconds (default {_D.connect_timeout})"
    )
    parser.add_argument(
        "--prefill-timeout",
        type=float,
        default=s,
        help=f"seconds for a whole prefill leg (default {_D.prefill_timeout})",
    )
    parser.add_argument(
        "--decode-timeout",
        type=float,
        default=s,
        help=f"seconds without a byte from the decode leg (default {_D.decode_timeout})",
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=s,
        help=f"seconds between /health probes (default {_D.health_interval})",
    )
    parser.add_argument(
        "--health-timeout", type=float, default=s, help=f"seconds (default {_D.health_timeout})"
    )
    parser.add_argument(
        "--eject-after",
        type=int,
        default=s,
        help=f"consecutive failures (probes or requests) before ejection (default {_D.eject_after})",
    )
    parser.add_argument(
        "--instance-wait-timeout",
        type=float,
        default=s,
        help="seconds a request waits for an instance when none is ready (starting, ejected, backing off) "
        f"before 503 with Retry-After (default {_D.instance_wait_timeout:g})",
    )
    parser.add_argument(
        "--retry-budget-ratio",
        type=float,
        default=s,
        help="retries (and decode-local fallbacks) allowed per client request, as a fraction of traffic "
        f"(default {_D.retry_budget_ratio:g})",
    )
    parser.add_argument(
        "--retry-budget-min-per-s",
        type=float,
        default=s,
        help=f"retries per second allowed whatever the traffic (default {_D.retry_budget_min_per_s:g})",
    )
    parser.add_argument(
        "--retry-budget-burst",
        type=float,
        default=s,
        help=f"most retries the budget can save up (default {_D.retry_budget_burst:g})",
    )
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default=s,
        help=f"(default {_D.log_level})",
    )


class BindError(Exception):
    """The proxy cannot listen on its address (one line for the user, no traceback)."""


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    values: dict[str, Any] = {}
    for name, env in _ENV_KEYS.items():
        if os.environ.get(env):
            values[name] = os.environ[env]
    config_file = getattr(args, "config", None)
    if config_file:
        values.update(load_config_file(config_file))
    for f in dataclasses.fields(ProxyConfig):
        if hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return ProxyConfig(**values).validate()


async def serve(config: ProxyConfig) -> None:
    from aiohttp import web

    from pdserve.proxy.app import create_app

    app = create_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=4096)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise BindError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    warning = exposure_warning("pdserve proxy", config.host, config.api_key)
    if warning:
        logging.getLogger("pdserve.proxy").warning(warning)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    mode = "disaggregated" if config.prefill else "collocated"
    for host, port, *_ in runner.addresses:
        # Printed whatever the log level: launchers and tests read the bound port from this line.
        print(
            f"pdserve proxy listening on http://{host}:{port} (prefill: {', '.join(config.prefill) or '-'}; "
            f"decode: {', '.join(config.decode)}; mode: {mode})",
            file=sys.stderr,
            flush=True,
        )
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"pdserve proxy: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(serve(config))
    except BindError as exc:
        print(f"pdserve proxy: {exc}", file=sys.stderr)
        return 1
    finally:
        loop.close()
    return 0
