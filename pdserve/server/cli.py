"""`pdserve serve [MODEL]`: the OpenAI-compatible instance server, with `vllm serve`'s flag names."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from pdserve import frontend_args

log = logging.getLogger("pdserve.server")
_DEAD_EXIT_DELAY_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    frontend_args.add_model_arguments(p)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--prefill-only-chunk-tokens", type=int, default=None, metavar="N",
                   help="a step without decode rows may give one long prompt a chunk of up to N tokens (bigger "
                        "GEMMs, fewer passes over the context); default 32768 on GPU, off on CPU; 0 turns it off")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 128 on CPU, 16 on CUDA, as vLLM)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache storage: auto = the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2 halve the KV "
                        "memory and the P/D transfer bytes (scales computed per token and head, stored in the block)")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--cpu-kv-cache-gb", type=float, default=1.0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch the next decode step before this one's tokens are read (greedy pure-decode graph "
                        "steps; the rest stays synchronous). Default: PDSERVE_ASYNC_SCHEDULING=0/1, else on for CUDA")
    p.add_argument("--attention-backend", default="auto",
                   choices=("auto", "triton", "triton-cudnn", "flashinfer"),
                   help="GPU attention: Triton kernels, with long prefill chunks on cuDNN (triton-cudnn; auto "
                        "picks it where cuDNN's attention runs) or without (triton); flashinfer: prefill steps on "
                        "FlashInfer's paged kernel, decode on Triton (needs the optional flashinfer-python package)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-transfer-config", default=None, help="vLLM's KV transfer JSON")
    p.add_argument("--kv-events-config", default=None,
                   help='vLLM\'s JSON: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
                        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558", "snapshot_endpoint": "tcp://*:5559", '
                        '"topic": ""}: publish the KV pool\'s BlockStored/BlockRemoved/AllBlocksCleared events '
                        '(vLLM\'s wire format) for routers; snapshot_endpoint adds vLLM\'s snapshot service '
                        '(24-byte seq+identity frames, 1 s idle heartbeats)')
    p.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="keep full KV blocks evicted from the KV pool in this many GiB of host memory (pinned on "
                        "CUDA), LRU, and load them back for later prompts with the same prefix (vLLM's flag)")
    p.add_argument("--kv-offloading-backend", default=None, choices=["native"],
                   help="the offload implementation (vLLM's flag): native = pdserve's own host/disk tiers")
    p.add_argument("--kv-offloading-disk-path", default=None, metavar="DIR",
                   help="a disk tier under DIR for blocks the host tier evicts (checksummed files; not kept "
                        "across restarts). Needs --kv-offloading-size and --kv-offloading-disk-size")
    p.add_argument("--kv-offloading-disk-size", type=float, default=None, metavar="GIB",
                   help="bound on the disk tier's files, in GiB (LRU beyond it)")
    p.add_argument("--structured-outputs-config", default=None,
                   help='vLLM\'s JSON: {"backend": "auto"|"guidance", "disable_any_whitespace": bool, '
                        '"disable_additional_properties": bool}. Objects are strict (no unlisted keys unless the '
                        'schema allows them) as with vLLM\'s default backend; "guidance" relaxes that as vLLM\'s '
                        'guidance backend does, unless disable_additional_properties')
    p.add_argument("--speculative-config", default=None,
                   help='vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, '
                        '"prompt_lookup_min": M} drafts K tokens by prompt lookup, {"model": DIR, '
                        '"num_speculative_tokens": K} by a smaller model with the same tokenizer; one step verifies '
                        'them (same tokens under greedy, same distribution under sampling)')
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="B",
                   help="speculation pauses while more than B requests run (the speculative config's "
                        "disable_by_batch_size)")
    p.add_argument("--side-channel-host", default=None,
                   help="KV side-channel host (env VLLM_NIXL_SIDE_CHANNEL_HOST as fallback)")
    p.add_argument("--side-channel-port", type=int, default=None,
                   help="KV side-channel port (env VLLM_NIXL_SIDE_CHANNEL_PORT as fallback)")
    p.add_argument("--insecure-side-channel", action="store_true",
                   help="let a producer's KV side channel listen on a non-loopback address without a deployment "
                        "secret (PDSERVE_KV_SECRET): anyone who reaches it can read the KV cache")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="bound on the waiting queue; requests beyond it get 503")
    p.add_argument("--tokens-only", action="store_true",
                   help="tokens-in/tokens-out engine for a render tier: /inference/v1/generate, no tokenizer")
    p.add_argument("--enable-scale-out", action="store_true",
                   help="also serve /inference/v1/generate and abort_requests on a normal server (else 403)")
    frontend_args.add_frontend_arguments(p)
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks (GPUs) for one instance; each rank beyond the first is a worker process")
    p.add_argument("--distributed-timeout", type=float, default=120.0,
                   help="seconds any tensor-parallel collective may take before the instance fails")
    # Accepted for command-line compatibility with `vllm serve`; they change nothing here.
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--disable-log-requests", action="store_true")
    p.add_argument("--enable-log-requests", action="store_true")
    p.add_argument("--disable-log-stats", action="store_true")


def engine_config(args: argparse.Namespace) -> Any:
    from pdserve.types.engine_config import EngineConfig

    kv = json.loads(args.kv_transfer_config) if args.kv_transfer_config else None
    return EngineConfig(
        model=args.model_flag or args.model_tag,
        served_model_name=(args.served_model_name or [None])[0],
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_only_chunk_tokens=args.prefill_only_chunk_tokens,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_gb=args.cpu_kv_cache_gb,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        attention_backend=args.attention_backend,
        max_waiting_requests=args.max_waiting_requests,
        kv_transfer_config=kv,
        kv_events_config=json.loads(args.kv_events_config) if args.kv_events_config else None,
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_backend=args.kv_offloading_backend,
        kv_offloading_disk_path=args.kv_offloading_disk_path,
        kv_offloading_disk_size=args.kv_offloading_disk_size,
        structured_outputs_config=json.loads(args.structured_outputs_config) if args.structured_outputs_config
        else None,
        speculative_config=speculative_config(args),
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_timeout_s=args.distributed_timeout,
    )


def speculative_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """--speculative-config's JSON, with --speculative-disable-by-batch-size folded in."""
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    if args.speculative_disable_by_batch_size is not None:
        if not spec:
            raise ValueError("--speculative-disable-by-batch-size needs --speculative-config")
        spec = {**spec, "disable_by_batch_size": args.speculative_disable_by_batch_size}
    return spec


def _check_args(args: argparse.Namespace) -> str | None:
    problem = frontend_args.check_frontend_args(args)
    if problem:
        return problem
    if args.tensor_parallel_size < 1:
        return f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}"
    if args.distributed_timeout <= 0:
        return "--distributed-timeout must be positive"
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        return "--max-waiting-requests must be at least 1"
    problem = _json_object_problem("--structured-outputs-config", args.structured_outputs_config)
    if problem:
        return problem
    if any(v is not None for v in (args.kv_offloading_size, args.kv_offloading_backend,
                                   args.kv_offloading_disk_path, args.kv_offloading_disk_size)):
        from pdserve.types.engine_config import EngineConfig

        try:
            EngineConfig(kv_offloading_size=args.kv_offloading_size, kv_offloading_backend=args.kv_offloading_backend,
                         kv_offloading_disk_path=args.kv_offloading_disk_path,
                         kv_offloading_disk_size=args.kv_offloading_disk_size,
                         enable_prefix_caching=args.enable_prefix_caching,
                         tensor_parallel_size=max(args.tensor_parallel_size, 1))
        except ValueError as e:
            return (str(e).replace("kv_offloading_", "--kv-offloading-").replace("prefix caching", "--enable-prefix-caching")
                    .replace("tensor_parallel_size", "--tensor-parallel-size"))
    if args.kv_events_config is not None:
        from pdserve.types.kv_events_config import KVEventsConfig

        try:
            KVEventsConfig.from_json(args.kv_events_config)
        except (ValueError, TypeError) as e:
            return str(e) if str(e).startswith("--kv-events-config") else f"--kv-events-config: {e}"
    if args.speculative_config is not None or args.speculative_disable_by_batch_size is not None:
        from pdserve.types.speculative_config import SpeculativeConfig

        try:
            SpeculativeConfig.parse(speculative_config(args))
        except json.JSONDecodeError as e:
            return f"--speculative-config is not valid JSON: {e}"
        except ValueError as e:  # the message names the key: speculative_config.KEY
            return str(e).replace("speculative_config", "--speculative-config", 1)
    return _json_object_problem("--kv-transfer-config", args.kv_transfer_config)


def _json_object_problem(flag: str, text: str | None) -> str | None:
    """Why a flag's JSON value is not a JSON object (None when it is, or the flag is not given)."""
    if text is None:
        return None
    try:
        if not isinstance(json.loads(text), dict):
            return f"{flag} must be a JSON object"
    except ValueError as e:
        return f"{flag} is not valid JSON: {e}"
    return None


def _prefill_cost_info(engine: Any, kv_cfg: Any) -> dict[str, Any] | None:
    """What this instance's prefill steps cost, measured now (pdserve/engine/prefill_calibration.py), for the
    proxy's multi-turn choice: only a GPU instance that prefills turns reading held histories back (CPU: None)."""
    runner = engine.runner
    if (runner.device.type != "cuda" or kv_cfg is None or not kv_cfg.bidirectional_kv_xfer
            or kv_cfg.kv_role == "kv_consumer"):
        return None
    import torch

    from pdserve.engine.prefill_calibration import measure_prefill_cost

    cost = measure_prefill_cost(engine, torch.cuda.get_device_name(runner.device))
    return cost.as_info() if cost is not None else None


def _gpu_uuid(device: Any) -> str | None:
    if device.type != "cuda":
        return None
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else None


def kv_events_info(publisher: Any, http_host: str, block_size: int) -> dict[str, Any] | None:
    """The KV events endpoints as a router elsewhere reaches them: a wildcard bind address (tcp://*:5557
    binds 0.0.0.0) is replaced by the HTTP --host, or this machine's name when that is a wildcard too."""
    if publisher is None:
        return None
    import socket

    host = http_host if http_host not in ("0.0.0.0", "::", "", "*") else socket.getfqdn()

    def reachable(endpoint: str | None) -> str | None:
        if endpoint is None or not endpoint.startswith("tcp://"):
            return endpoint
        addr, _, port = endpoint[len("tcp://"):].rpartition(":")
        if addr in ("0.0.0.0", "*", "[::]", "::", ""):
            addr = f"[{host}]" if ":" in host else host
        return f"tcp://{addr}:{port}"

    return {
        "endpoint": reachable(publisher.endpoint),
        # "bind": subscribers connect to endpoint; "connect": this instance connects out to a collector
        # bound there (vLLM's convention for another machine's address), which routers cannot subscribe to
        "endpoint_mode": publisher.mode,
        "replay_endpoint": reachable(publisher.replay_endpoint),
        # vLLM's snapshot service: live sequence frames are then 24 bytes (seq + this lifetime's identity)
        "snapshot_endpoint": reachable(publisher.snapshot_endpoint),
        "topic": publisher.config.topic,
        "block_size": block_size,
        # how BlockStored hashes are computed from token ids (pdserve.kv_events.block_hash; ARCHITECTURE.md)
        "block_hash": "sha256_cbor_64bit",
        "format": "vllm",
    }


def build_state(args: argparse.Namespace) -> Any:
    """Loads the model and tokenizer and builds the engine (not started: the app's lifespan starts it)."""
    from prometheus_client import CollectorRegistry

    from pdserve.api.openai.params import GenerationDefaults
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.model.default_model import DEFAULT_MODEL
    from pdserve.server.kv import parse_kv_transfer_config, pd_extension_factory
    from pdserve.server.metrics import ServerMetrics
    from pdserve.server.state import ServerState
    from pdserve.text.output_parsers import ParserConfig
    from pdserve.text.tokenizer import load_tokenizer
    from pdserve.version import __version__

    config = engine_config(args)
    model_arg = config.model
    names = args.served_model_name or [model_arg or DEFAULT_MODEL]
    kv_cfg = parse_kv_transfer_config(args.kv_transfer_config, args.side_channel_host, args.side_channel_port,
                                      args.insecure_side_channel, args.host)
    registry = CollectorRegistry()
    engine = AsyncEngine(config, pd_extension_factory(kv_cfg, registry, names[0]))
    inner = engine.engine
    tokenizer = None if args.tokens_only else load_tokenizer(config.tokenizer or inner.model_dir,
                                                              chat_template=args.chat_template)
    runner = inner.runner
    connector = inner.extension.connector  # the P/D half's (pd_extension_factory)
    cfg = inner.model_cfg
    info = {
        "version": __version__,
        "model": str(model_arg or DEFAULT_MODEL),
        "served_model_name": names[0],
        "dtype": str(runner.dtype).removeprefix("torch."),
        "block_size": runner.block_size,
        "kv_cache_dtype": runner.kv_cache_dtype,
        # which fp8 scales the pool's rows carry: none | dynamic | checkpoint | checkpoint+dynamic
        "kv_cache_scales": runner.kv_scales_source,
        "kv_layout": runner.layout,
        "num_layers": cfg.num_layers,
        "num_kv_heads": cfg.num_kv_heads,
        "tensor_parallel_size": inner.config.tensor_parallel_size,
        "head_dim": cfg.head_dim,
        "max_model_len": inner.max_model_len,
        "device": str(runner.device),
        "kv_role": kv_cfg.kv_role if kv_cfg is not None else None,
        # "push" (NixlPushConnector) or "pull": `pdserve proxy --kv-transfer-mode push` checks its prefills'
        "kv_transfer_mode": kv_cfg.transfer_mode if kv_cfg is not None else None,
        # decode legs may come before their params (pdserve.api.pd.early_decode_params, POST KV_PARAMS_PATH)
        "kv_params_later": bool(connector is not None and connector.can_load),
        # POST /pdserve/kv/pin pins a cached prefix for a peer's prefill (None: this instance pins none)
        "kv_peer_pin": ({"ttl_s": connector.peer_pin_ttl_s, "max_leases": connector.peer_pin_max_leases}
                        if connector is not None and getattr(connector, "peer_pin_max_leases", 0) > 0 else None),
        "engine_id": kv_cfg.engine_id if kv_cfg is not None else None,
        "side_channel_host": kv_cfg.side_channel_host if kv_cfg is not None else None,
        "side_channel_port": getattr(connector, "side_channel_port", None) if connector is not None else None,
        # whether side-channel messages are signed with a deployment secret (the secret itself is never shown)
        "side_channel_auth": kv_cfg.side_channel_secret is not None if kv_cfg is not None else None,
        "kv_buffer_device": (kv_cfg.kv_buffer_device if kv_cfg is not None else None)
        or ("cuda" if runner.device.type == "cuda" else "cpu"),
        "ucx_tls": os.environ.get("UCX_TLS"),
        # which physical GPU this is (preflight's p2p and UCX checks map instances to GPU pairs with it)
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpu_uuid": _gpu_uuid(runner.device),
        "num_gpu_blocks": runner.num_blocks,
        # what the scheduler runs with (`pdserve profile --url` and `pdserve sim` simulate an instance with them)
        "scheduler": {"max_num_seqs": inner.scheduler.max_num_seqs,
                      "max_num_batched_tokens": inner.scheduler.max_num_batched_tokens,
                      "prefill_only_chunk_tokens": inner.scheduler.prefill_only_chunk_tokens,
                      "enable_chunked_prefill": inner.scheduler.enable_chunked_prefill,
                      "enable_prefix_caching": inner.config.enable_prefix_caching},
        "tokens_only": args.tokens_only,
        # where a router subscribes to this instance's KV events (None: not published)
        "kv_events": kv_events_info(inner.kv_events, args.host, runner.block_size),
        # the KV tiers a prefix can be found in, fastest first (the pool, then host memory and disk)
        # multi-turn: the fewest held tokens this prefill instance reads back of a read no pdserve proxy priced
        # (vLLM's rule; a pdserve proxy's read carries its own minimum), and what its prefill steps cost, which
        # the proxy prices recomputing a history with (pdserve/types/prefill_cost.py)
        "kv_recompute_threshold": (connector.kv_recompute_threshold
                                   if connector is not None and kv_cfg is not None and kv_cfg.bidirectional_kv_xfer
                                   else None),
        "prefill_cost": _prefill_cost_info(inner, kv_cfg),
        "kv_tiers": [{"medium": "GPU", "capacity_blocks": runner.num_blocks,
                      "capacity_bytes": runner.num_blocks * runner.block_bytes, "device": str(runner.device)},
                     *(inner.tiers.info() if inner.tiers is not None else [])],
    }
    model_path = str(model_arg) if model_arg and Path(model_arg).is_dir() else str(inner.model_dir)
    metrics = ServerMetrics(names[0], inner.max_model_len, engine.stats, registry=registry)
    return ServerState(
        engine=engine,
        tokenizer=tokenizer,
        served_model_names=list(names),
        model_path=model_path,
        max_model_len=inner.max_model_len,
        vocab_size=cfg.vocab_size,
        defaults=GenerationDefaults.from_model_dir(inner.model_dir),
        metrics=metrics,
        info=info,
        api_key=frontend_args.api_key(args),
        max_request_body_bytes=args.max_request_body_bytes,
        parsers=ParserConfig(args.reasoning_parser, args.tool_call_parser, args.enable_auto_tool_choice),
        tokens_only=args.tokens_only,
        enable_scale_out=args.enable_scale_out,
    )


def _check_ports(args: argparse.Namespace) -> str | None:
    """Why this server could not bind its HTTP port or its KV side channel (a producer's), checked before
    the model is loaded; None when both are free."""
    from pdserve.bindcheck import port_taken
    from pdserve.server.kv import parse_kv_transfer_config

    problem = port_taken(args.host, args.port)
    if problem:
        return f"--port: {problem}"
    try:
        kv_cfg = parse_kv_transfer_config(args.kv_transfer_config, args.side_channel_host, args.side_channel_port,
                                          args.insecure_side_channel, args.host)
    except ValueError as e:
        return f"--kv-transfer-config: {e}"
    if kv_cfg is not None and kv_cfg.is_producer:
        problem = port_taken(kv_cfg.bind_host, kv_cfg.side_channel_port)
        if problem:
            return (f"KV side channel: {problem}; is another prefill instance using it? Give each producer its "
                    "own --side-channel-port (or VLLM_NIXL_SIDE_CHANNEL_PORT)")
    return None


def main(args: argparse.Namespace) -> int:
    frontend_args.configure_logging(args)
    refused = frontend_args.startup_problem("pdserve serve", args, _check_args, _check_ports, log)
    if refused is not None:
        return refused
    from pdserve.engine.runner.tp_executor import WorkerDiedError
    from pdserve.kv_transfer.errors import KVTransferError
    from pdserve.server.app import build_app

    try:
        state = build_state(args)
    except (ValueError, FileNotFoundError, OSError, KVTransferError, WorkerDiedError) as e:  # one line, no traceback
        print(f"pdserve serve: error: {e}", file=sys.stderr)
        return 1
    app = build_app(state)
    log.info("serving %s on http://%s:%d (max_model_len=%d)", state.model_name, args.host, args.port,
             state.max_model_len)
    server = frontend_args.uvicorn_server(app, args, log, timeout_graceful_shutdown=args.shutdown_timeout)

    def engine_died(error: BaseException) -> None:
        # /health answers 503 for a moment (probes see why), then the server exits: a supervisor
        # (`pdserve up`) restarts it, which an instance without a working engine cannot do for itself.
        log.error("the engine has stopped (%s); exiting in %.0f s", error, _DEAD_EXIT_DELAY_S)
        threading.Timer(_DEAD_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True)).start()

    state.engine.on_dead = engine_died
    server.run()
    code = 0 if server.started and state.engine.dead_error is None else 1
    # The engine and the KV connector are already shut down (the app's lifespan). Skip the interpreter's
    # teardown of torch and friends, which takes seconds and holds ports' owners alive for nothing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

