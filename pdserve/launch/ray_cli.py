"""`pdserve up --ray [ADDRESS]`: the same topologies as `pdserve up`, placed across a Ray cluster.

    ray start --head --resources '{"prefill_node": 1}'                  # node 1
    ray start --address NODE1:6379 --resources '{"decode_node": 1}'     # node 2
    pdserve up ./model --ray --topology 1p1d \\
        --prefill-resources '{"prefill_node": 1}' --decode-resources '{"decode_node": 1}'    # on node 1
    pdserve up ./model --ray --topology 2p2d --autoscale --max-decode 4 --itl-slo-ms 50 --ttft-slo-ms 2000

This process is the Ray driver: it connects to the cluster (`--ray` alone: the one this node belongs to;
`--ray local`: a new one-node Ray in this process), starts the app's controller actor
(pdserve/launch/ray_app.py) on this node, prints `PDSERVE_READY proxy=URL ...` once every instance and
the proxy answer, then prints what the controller reports (restarts, autoscaling decisions with their
numbers) until Ctrl-C or SIGTERM, which stops the app. If this process dies, Ray takes the app down with
it (it owns the controller, which owns the rest).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pdserve.launch.config import LaunchConfig, parse_topology
from pdserve.launch.ray_spec import RayOptions, build_app_spec, controller_name, parse_resources

POLL_S = 0.5
RAY_MAX_RESTARTS = 20  # default times Ray restarts one instance or the proxy
STOP_GRACE_S = 60.0


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Ray (pdserve up --ray): placement across a cluster, restarts, autoscaling")
    g.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="place the topology on a Ray cluster: ADDRESS of its head (host:6379), 'auto' (default: "
                   "the cluster this node belongs to) or 'local' (a new one-node Ray in this process)")
    g.add_argument("--ray-namespace", default="pdserve", help="Ray namespace of the app's actors (default pdserve)")
    g.add_argument("--app-name", default="default", help="name of this deployment in the namespace (default default)")
    g.add_argument("--cpus-per-instance", type=float, default=1.0, help="Ray CPUs each instance reserves (default 1)")
    g.add_argument("--gpus-per-instance", type=float, default=None,
                   help="Ray GPUs each instance reserves (x its --tensor-parallel-size); fractions share a GPU; "
                   "0 = CPU instances (default: 1 when the cluster has GPUs, else 0)")
    for role in ("prefill", "decode", "collocated"):
        g.add_argument(f"--{role}-resources", default=None, metavar="JSON",
                       help=f"custom Ray resources each {role} instance reserves, e.g. '{{\"{role}_node\": 1}}' "
                       "(nodes offer them with `ray start --resources`)")
    g.add_argument("--placement-timeout", type=float, default=120.0,
                   help="seconds to wait for the cluster to fit an instance's resources (default 120)")
    g.add_argument("--discovery-interval", type=float, default=1.0,
                   help="seconds between the proxy's looks at the instance actors (default 1)")
    g.add_argument("--from-plan", default=None, metavar="FILE",
                   help="start from the split `pdserve plan ... --json` recommends (its ratio.topology)")
    a = parser.add_argument_group("autoscaling (with --ray)")
    a.add_argument("--autoscale", action="store_true",
                   help="add, remove and switch prefill/decode replicas to follow the load")
    for role in ("prefill", "decode"):
        a.add_argument(f"--min-{role}", type=int, default=None, help=f"fewest {role} replicas (default 1)")
        a.add_argument(f"--max-{role}", type=int, default=None,
                       help=f"most {role} replicas (default twice the topology's)")
        a.add_argument(f"--target-ongoing-{role}", type=float, default=None,
                       help=f"{role} legs in flight per replica to aim for (default: no load target)")
    a.add_argument("--ttft-slo-ms", type=float, default=None, help="prefill TTFT SLO at --slo-quantile")
    a.add_argument("--itl-slo-ms", type=float, default=None, help="decode ITL SLO at --slo-quantile")
    a.add_argument("--slo-quantile", type=float, default=0.9, help="quantile compared with the SLOs (default 0.9)")
    a.add_argument("--kv-usage-high", type=float, default=0.9, help="decode KV usage that needs a replica (default 0.9)")
    a.add_argument("--waiting-high", type=float, default=1.0,
                   help="requests waiting per replica (window average) that need a replica (default 1)")
    a.add_argument("--autoscale-interval", type=float, default=2.0, help="seconds between measurements (default 2)")
    a.add_argument("--autoscale-window", type=float, default=20.0, help="seconds of measurements decided on (default 20)")
    a.add_argument("--upscale-delay", type=float, default=10.0,
                   help="seconds a role must want more replicas before one is added (default 10)")
    a.add_argument("--downscale-delay", type=float, default=60.0,
                   help="seconds a role must want fewer replicas before one is removed (default 60)")
    a.add_argument("--no-role-switch", action="store_true",
                   help="never switch a replica between prefill and decode (only add and remove)")
    a.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds a replica being removed gets to finish its requests (default 120)")


def _autoscale(args: argparse.Namespace, cfg: LaunchConfig) -> dict[str, Any] | None:
    from pdserve.autoscale.policy import AutoscaleConfig, RoleLimits

    if not args.autoscale:
        return None
    if not cfg.topology.disaggregated:
        raise ValueError("--autoscale sizes prefill and decode pools: it needs a P/D topology (e.g. 1p1d)")
    counts = {"prefill": cfg.topology.num_prefill, "decode": cfg.topology.num_decode}
    limits = {}
    for role in ("prefill", "decode"):
        slo = args.ttft_slo_ms if role == "prefill" else args.itl_slo_ms
        low = getattr(args, f"min_{role}")
        high = getattr(args, f"max_{role}")
        limits[role] = RoleLimits(
            min_replicas=1 if low is None else low,
            max_replicas=max(2 * counts[role], 1 if low is None else low) if high is None else high,
            target_ongoing=getattr(args, f"target_ongoing_{role}"),
            latency_slo_s=None if slo is None else slo / 1e3,
        )
        if not limits[role].min_replicas <= counts[role] <= limits[role].max_replicas:
            raise ValueError(f"the topology's {counts[role]} {role} instance(s) are outside "
                             f"--min-{role} {limits[role].min_replicas} .. --max-{role} {limits[role].max_replicas}")
    scaling = AutoscaleConfig(
        prefill=limits["prefill"], decode=limits["decode"], quantile=args.slo_quantile,
        kv_usage_high=args.kv_usage_high, waiting_high=args.waiting_high, interval_s=args.autoscale_interval,
        window_s=args.autoscale_window, upscale_delay_s=args.upscale_delay, downscale_delay_s=args.downscale_delay,
        allow_role_switch=not args.no_role_switch, drain_timeout_s=args.drain_timeout,
    ).validate()
    return scaling.to_json()


def options_from_args(args: argparse.Namespace, cfg: LaunchConfig) -> RayOptions:
    role_resources = {}
    for role in ("prefill", "decode", "collocated"):
        text = getattr(args, f"{role}_resources")
        if text:
            role_resources[role] = parse_resources(text, f"--{role}-resources")
    return RayOptions(
        address=args.ray, namespace=args.ray_namespace, app=args.app_name, cpus_per_instance=args.cpus_per_instance,
        gpus_per_instance=args.gpus_per_instance, role_resources=role_resources,
        # `pdserve up`'s --max-restarts; under Ray it counts over the app's life (Ray's max_restarts, -1: always)
        max_restarts=RAY_MAX_RESTARTS if args.max_restarts is None else args.max_restarts,
        placement_timeout=args.placement_timeout, discovery_interval=args.discovery_interval,
        autoscale=_autoscale(args, cfg),
    ).validate()


def topology_from_plan(path: str) -> str:
    """The `ratio.topology` of `pdserve plan ... --json` output."""
    try:
        data = json.loads(Path(path).read_text())
        topology = data["ratio"]["topology"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--from-plan {path}: expected the JSON of `pdserve plan --isl ... --json` "
                         f"with ratio.topology ({type(e).__name__}: {e})") from None
    parse_topology(topology)
    return str(topology)


def _proxy_settings(cfg: LaunchConfig, host: str) -> dict[str, Any]:
    """The proxy's ProxyConfig fields from `--proxy-arg`s (parsed as `pdserve proxy` would), with the
    address chosen on this node. Instance lists are filled in by the controller."""
    import dataclasses

    from pdserve.launch.spec import DEFAULT_PROXY_PORT, PortAllocator
    from pdserve.proxy import cli as proxy_cli

    parser = argparse.ArgumentParser(prog="pdserve proxy", add_help=False)
    proxy_cli.add_arguments(parser)
    ns = parser.parse_args(cfg.proxy_args)
    for flag in ("host", "port", "prefill", "decode"):
        if hasattr(ns, flag):
            raise ValueError(f"--proxy-arg --{flag}: under --ray the proxy's address comes from --host/--port "
                             "and its instances from Ray")
    ns.decode = ["http://placeholder:1"]  # validated here; replaced by the controller
    if cfg.topology.disaggregated and not hasattr(ns, "on_prefill_failure"):
        # as `pdserve up`: while a prefill instance is down (Ray restarting it), decode instances prefill
        # locally; the proxy's retry budget bounds the extra work
        ns.on_prefill_failure = "decode-local"
    values = dataclasses.asdict(proxy_cli.config_from_args(ns))
    ports = PortAllocator(host)
    try:
        if cfg.port is None:
            port = ports.try_take(DEFAULT_PROXY_PORT) or ports.take(0)
        else:
            port = ports.take(cfg.port, "proxy --port")
    finally:
        ports.close()
    values.update(host=host, port=port, prefill=[], decode=[])
    return values


# Ray reads it once, when imported: 0 keeps a one-node cluster on 127.0.0.1 (node IP, GCS, raylet, workers),
# where by default Ray takes the machine's network address and listens on every interface.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def loopback_ray() -> None:
    """`--ray local`: the cluster this process starts (and every process it spawns, which inherit the
    environment) stays on loopback, so the instances, their KV events and the proxy bind 127.0.0.1 too."""
    if "ray" in sys.modules and os.environ.get(RAY_LOOPBACK_ENV) != "0":
        raise RuntimeError("Ray was imported before --ray local could keep it on 127.0.0.1")
    os.environ[RAY_LOOPBACK_ENV] = "0"


def _connect(opts: RayOptions) -> None:
    import ray

    kwargs: dict[str, Any] = {"namespace": opts.namespace, "log_to_driver": False, "logging_level": "WARNING"}
    if opts.address == "local":
        kwargs["include_dashboard"] = False
    else:
        kwargs["address"] = opts.address
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ConnectionError(
            f"cannot connect to Ray at {opts.address!r}: {str(e).rstrip('.')}. Start a cluster first (`ray start --head` on this "
            "node, `ray start --address HEAD:6379` on the others), or use --ray local") from None


class _Stop:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None

    def __enter__(self) -> _Stop:
        self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        self.signum = signum
        self.event.set()

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


def _say(text: str) -> None:
    print(text, flush=True)


def _print_events(events: list[dict[str, Any]]) -> int:
    seq = 0
    for e in events:
        seq = max(seq, e["seq"])
        if e["kind"] == "decision":
            roles = e.get("numbers", {})
            numbers = "; ".join(f"{r}: " + ", ".join(f"{k}={v}" for k, v in n.items() if k not in ("pressure", "holds"))
                                for r, n in roles.items())
            _say(f"autoscale: {e['text']}  [{numbers}]")
        else:
            _say(f"{e['kind']}: {e['text']}")
    return seq


def _ready_line(status: dict[str, Any], log_dir: Path, address: str) -> str:
    insts = status["instances"]
    fields = {
        "proxy": status["proxy"]["url"],
        "prefill": ",".join(i["url"] for i in insts if i["role"] == "prefill"),
        "decode": ",".join(i["url"] for i in insts if i["role"] in ("decode", "collocated")),
        "model": status["model"],
        "ray": address,
        "namespace": status["namespace"],
        "app": status["app"],
        "autoscaler": status["metrics_url"] or "",
        "log_dir": str(log_dir),
        "pid": str(os.getpid()),
    }
    return "PDSERVE_READY " + " ".join(f"{k}={shlex.quote(v)}" for k, v in fields.items() if v)


def _wait(ref: Any, stopping: _Stop, controller: Any, seq: int) -> tuple[Any, int, bool]:
    """ray.get(ref), printing the controller's events meanwhile; (result, last seq, interrupted)."""
    import ray

    while True:
        ready, _ = ray.wait([ref], timeout=POLL_S)
        with contextlib.suppress(ray.exceptions.RayError):
            seq = max(seq, _print_events(ray.get(controller.events.remote(seq), timeout=10)))
        if ready:
            return ray.get(ref), seq, False
        if stopping.event.is_set():
            return None, seq, True


def main(args: argparse.Namespace, cfg: LaunchConfig) -> int:
    """`pdserve up --ray`: `cfg` is the LaunchConfig `pdserve up` built from the same flags."""
    try:
        if args.from_plan:
            if args.topology is not None:
                raise ValueError("give --topology or --from-plan, not both")
            cfg.topology = parse_topology(topology_from_plan(args.from_plan))
        if args.demo or args.dry_run:
            raise ValueError("--demo and --dry-run are not available with --ray")
        for flag, value in (("--gpus", args.gpus), ("--base-port", args.base_port)):
            if value is not None:
                raise ValueError(f"{flag} does not apply under --ray (Ray places instances: see "
                                 "--gpus-per-instance and the role resources; ports are chosen on each node)")
        opts = options_from_args(args, cfg)
    except (ValueError, OSError) as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    if opts.address == "local":
        try:
            loopback_ray()
        except RuntimeError as e:
            print(f"pdserve up: {e}", file=sys.stderr)
            return 2
    try:
        import ray
    except ImportError:
        print("pdserve up: --ray needs Ray: pip install 'pdserve[ray]'", file=sys.stderr)
        return 2
    from pdserve.launch.ray_app import AppController
    from pdserve.model.default_model import DEFAULT_MODEL

    try:
        _connect(opts)
    except ConnectionError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    controller = None
    with _Stop() as stopping:
        try:
            node_ip = ray.util.get_node_ip_address()
            node_id = ray.get_runtime_context().get_node_id()
            address = ray.get_runtime_context().gcs_address
            try:
                ray.get_actor(controller_name(opts.app), namespace=opts.namespace)
                print(f"pdserve up: an app named {opts.app!r} already runs in Ray namespace {opts.namespace!r} "
                      "(choose another --app-name)", file=sys.stderr)
                return 2
            except ValueError:
                pass
            model = served = cfg.model or DEFAULT_MODEL
            if Path(model).expanduser().exists():
                model = str(Path(model).expanduser().absolute())  # the same path must exist on every node
            spec = build_app_spec(cfg, opts, model=model, cluster_gpus=ray.cluster_resources().get("GPU", 0.0),
                                  proxy=_proxy_settings(cfg, args.host or node_ip), proxy_node_id=node_id,
                                  served_model_name=served if served != model else None)
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            _say(f"pdserve up --ray: Ray at {address} ({len(nodes)} nodes), namespace {opts.namespace}, app {opts.app}; "
                 f"topology {cfg.topology}, model {model}")
            for i, inst in enumerate(spec.instances):
                _say(f"  {i}: {inst.role:<10} reserves {inst.bundle()}")
            _say(f"  proxy on this node ({node_ip}), port {spec.proxy['port']}")
            controller = ray.remote(AppController).options(
                name=controller_name(opts.app), namespace=opts.namespace, num_cpus=0, max_concurrency=16,
                max_restarts=0,
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id, soft=True),
            ).remote(spec.to_json())
            t0 = time.monotonic()
            status, seq, interrupted = _wait(controller.start.remote(), stopping, controller, 0)
            if interrupted:
                return 130 if stopping.signum == signal.SIGINT else 143
            proxy = status["proxy"]["url"]
            _say(f"ready in {time.monotonic() - t0:.1f}s. Client endpoint (OpenAI API): {proxy}/v1")
            _say(f"  autoscaler metrics: {status['metrics_url']}/metrics, decisions: "
                 f"{status['metrics_url']}/pdserve/autoscaler" if status["autoscale"] else
                 f"  controller metrics: {status['metrics_url']}/metrics (autoscaling off)")
            _say(_ready_line(status, Path(spec.log_dir), address))
            _say("serving; Ctrl-C stops everything.")
            while not stopping.event.wait(POLL_S):
                try:
                    seq = max(seq, _print_events(ray.get(controller.events.remote(seq), timeout=10)))
                except ray.exceptions.RayActorError as e:
                    print(f"pdserve up: the app's controller died: {e}", file=sys.stderr)
                    return 1
                except ray.exceptions.RayError:
                    continue
            return 0
        except ray.exceptions.RayTaskError as e:
            print(f"pdserve up: {e.cause if e.cause is not None else e}", file=sys.stderr)
            return 1
        except (ValueError, OSError, ray.exceptions.RayError) as e:
            print(f"pdserve up: {e}", file=sys.stderr)
            return 1
        finally:
            if controller is not None:
                _say("stopping the app ...")
                try:
                    ray.get(controller.shutdown.remote(), timeout=STOP_GRACE_S)
                except ray.exceptions.RayError as e:
                    print(f"pdserve up: stopping: {e}", file=sys.stderr)
                ray.kill(controller, no_restart=True)
                _say("stopped.")
            ray.shutdown()
