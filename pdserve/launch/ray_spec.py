"""What a Ray deployment is made of, before Ray is touched: instance specs, their Ray resources, the proxy.

`pdserve up --ray` turns the same `LaunchConfig` as `pdserve up` into a `RayAppSpec`: one `InstanceSpec`
per instance (its role, the `pdserve serve` words without host and ports, the Ray resources it reserves)
and the proxy's settings. Host, ports and the side-channel address are only known on the node where Ray
places the instance, so the actor adds them (`serve_argv`). Plain data (JSON-able) so that it travels to
the controller actor unchanged; no `ray` import here.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.launch.config import LaunchConfig, default_log_dir, tp_in_args
from pdserve.launch.spec import KV_SECRET_ENV, UCX_GET_ZCOPY, has_flag, kv_events_config, kv_transfer_config

ROLES = ("prefill", "decode", "collocated")
NAME_SEP = "/"  # Ray actor names: "<app>/inst-<k>", "<app>/proxy", "<app>/controller"


def instance_prefix(app: str) -> str:
    """The name prefix of an app's instance actors; the proxy discovers instances by it."""
    return f"{app}{NAME_SEP}inst-"


def instance_name(app: str, index: int) -> str:
    return f"{instance_prefix(app)}{index}"


def proxy_name(app: str) -> str:
    return f"{app}{NAME_SEP}proxy"


def controller_name(app: str) -> str:
    return f"{app}{NAME_SEP}controller"


def tensor_parallel_size(argv: list[str]) -> int:
    """The TP size in serve arguments (default 1): an instance with TP=N reserves N GPUs in one
    placement-group bundle (its ranks share one node)."""
    return tp_in_args(argv) or 1


@dataclass
class RayOptions:
    """The `--ray` flags of `pdserve up` (see ray_cli.add_ray_arguments)."""

    address: str = "auto"
    namespace: str = "pdserve"
    app: str = "default"
    cpus_per_instance: float = 1.0
    gpus_per_instance: float | None = None  # None: 1 when the cluster has GPUs, else 0 (CPU instances)
    role_resources: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> custom Ray resources
    max_restarts: int = 20
    placement_timeout: float = 120.0
    discovery_interval: float = 1.0
    autoscale: dict[str, Any] | None = None  # AutoscaleConfig fields, None = off

    def validate(self) -> RayOptions:
        if not self.app or NAME_SEP in self.app:
            raise ValueError(f"--app-name {self.app!r}: must be non-empty and without {NAME_SEP!r}")
        if self.cpus_per_instance < 0 or (self.gpus_per_instance is not None and self.gpus_per_instance < 0):
            raise ValueError("--cpus-per-instance and --gpus-per-instance must be >= 0")
        if self.max_restarts < -1:
            raise ValueError("--max-restarts must be >= -1 (-1: unlimited)")
        for name in ("placement_timeout", "discovery_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for role, res in self.role_resources.items():
            if role not in ROLES:
                raise ValueError(f"resources for unknown role {role!r}")
            for key, amount in res.items():
                if key in ("CPU", "GPU", "memory", "object_store_memory"):
                    raise ValueError(f"{role} resources: set {key} with --cpus/--gpus-per-instance, not here")
                if not isinstance(amount, int | float) or amount <= 0:
                    raise ValueError(f"{role} resources: {key} must be a number > 0")
        return self


def parse_resources(text: str, where: str) -> dict[str, float]:
    """`{"prefill_node": 1}` -> {"prefill_node": 1.0} (custom Ray resources, as `ray start --resources`)."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e}); expected e.g. '{{\"prefill_node\": 1}}'") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ValueError(f"{where}: expected a JSON object of resource name -> amount")
    out: dict[str, float] = {}
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: {key} must be a number")
        out[key] = float(value)
    return out


NODE_HOST = "NODE_HOST"  # in a spec's --kv-events-config: the address the instance binds, known on its node


@dataclass
class InstanceSpec:
    """One instance as the Ray actor starts it. `base_argv` lacks --host/--port/side channel (node-local)."""

    role: str  # prefill | decode | collocated
    base_argv: list[str]  # after the interpreter: ["-m", "pdserve", "serve", MODEL, ...]
    env: dict[str, str]
    num_cpus: float
    num_gpus: float
    resources: dict[str, float]
    log_dir: str
    startup_timeout: float
    stop_timeout: float
    python: str = ""  # "" = the actor's interpreter (the node's own)

    @property
    def disaggregated(self) -> bool:
        return self.role in ("prefill", "decode")

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle that reserves this instance's resources on one node."""
        b: dict[str, float] = {"CPU": self.num_cpus}
        if self.num_gpus:
            b["GPU"] = self.num_gpus
        b.update(self.resources)
        return {k: v for k, v in b.items() if v}

    def serve_argv(self, python: str, host: str, port: int, side_channel_host: str) -> list[str]:
        """The full command line on the node: interpreter, host, port, and for P/D roles the side channel
        on the node's reachable address (port 0: the server picks one and reports it in /pdserve/info)."""
        argv = [self.python or python, *self.base_argv, "--host", host, "--port", str(port)]
        # the KV events sockets bind the address the server binds (127.0.0.1 on a local cluster)
        argv = [w.replace(f"tcp://{NODE_HOST}:", f"tcp://{host}:") if argv[i - 1] == "--kv-events-config" else w
                for i, w in enumerate(argv)]
        if self.disaggregated:
            argv += ["--side-channel-host", side_channel_host, "--side-channel-port", "0"]
        return argv


@dataclass
class RayAppSpec:
    app: str
    namespace: str
    model: str
    topology: str
    instances: list[InstanceSpec]  # the initial topology, in order: prefill, decode (or collocated)
    templates: dict[str, InstanceSpec]  # one per role of the topology: what scale-up and role switches start
    proxy: dict[str, Any]  # ProxyConfig fields (host and port chosen by the driver on its node)
    proxy_node_id: str  # the driver's node: the proxy's address stays put when Ray restarts it
    log_dir: str
    max_restarts: int
    placement_timeout: float
    discovery_interval: float
    autoscale: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RayAppSpec:
        d = dict(data)
        d["instances"] = [InstanceSpec(**i) for i in d["instances"]]
        d["templates"] = {r: InstanceSpec(**i) for r, i in d["templates"].items()}
        return cls(**d)


def _instance_spec(cfg: LaunchConfig, opts: RayOptions, role: str, model: str, num_gpus_each: float,
                   log_dir: Path, served_model_name: str | None) -> InstanceSpec:
    pool = cfg.pools[role]
    words = ["-m", "pdserve", "serve", model]
    if role in ("prefill", "decode"):
        words += ["--kv-transfer-config", kv_transfer_config(role, cfg.kv_load_failure_policy, cfg.kv_history)]
    if cfg.kv_events_in(role) and not has_flag(cfg.serve_args + pool.serve_args, "--kv-events-config"):
        words += ["--kv-events-config", kv_events_config(NODE_HOST)]  # the node's address, filled in there
    words += cfg.serve_args + pool.serve_args
    if (pool.tp or 1) > 1 and tp_in_args(words) is None:  # --prefill-tp / --decode-tp
        words += ["--tensor-parallel-size", str(pool.tp)]
    if served_model_name and not has_flag(words, "--served-model-name"):
        words += ["--served-model-name", served_model_name]
    tp = tensor_parallel_size(words)
    if tp > 1 and num_gpus_each and num_gpus_each != int(num_gpus_each):
        raise ValueError("a fractional --gpus-per-instance cannot be combined with --tensor-parallel-size > 1")
    num_gpus = num_gpus_each * tp
    env = dict(pool.env)
    if num_gpus:
        if 0 < num_gpus < 1 and not has_flag(words, "--gpu-memory-utilization"):
            # sharers of one GPU each take their share of its memory (vLLM's reading of the flag)
            words += ["--gpu-memory-utilization", f"{0.9 * num_gpus:.3g}"]
        if role in ("prefill", "decode"):
            env.setdefault(UCX_GET_ZCOPY, "y")  # as `pdserve up`: UCX must not fall back to TCP silently
    else:
        threads = str(max(1, math.floor(opts.cpus_per_instance)))
        env.setdefault("OMP_NUM_THREADS", threads)
        env.setdefault("MKL_NUM_THREADS", threads)
    return InstanceSpec(
        role=role, base_argv=words, env=env, num_cpus=opts.cpus_per_instance, num_gpus=num_gpus,
        resources=dict(opts.role_resources.get(role, {})), log_dir=str(log_dir),
        startup_timeout=cfg.startup_timeout, stop_timeout=cfg.stop_timeout, python=cfg.python,
    )


def build_app_spec(cfg: LaunchConfig, opts: RayOptions, *, model: str, cluster_gpus: float,
                   proxy: dict[str, Any], proxy_node_id: str, served_model_name: str | None = None) -> RayAppSpec:
    """The deployment for `cfg` on a cluster with `cluster_gpus` GPUs in all (decides the default device).
    `served_model_name`: the name clients use when `model` is a path made absolute for the nodes."""
    if cfg.engine != "pdserve":
        raise ValueError("--ray runs pdserve instances only (--engine vllm under Ray is not built)")
    opts.validate()
    gpus_each = opts.gpus_per_instance
    if gpus_each is None:
        gpus_each = 1.0 if cluster_gpus > 0 else 0.0
    topo = cfg.topology
    roles = ([("prefill", topo.num_prefill), ("decode", topo.num_decode)] if topo.disaggregated
             else [("collocated", topo.num_collocated)])
    # the same absolute path on every node (each node writes its own instances' logs there)
    log_dir = (cfg.log_dir or default_log_dir()).expanduser().absolute()
    templates = {role: _instance_spec(cfg, opts, role, model, gpus_each, log_dir, served_model_name)
                 for role, _ in roles}
    if topo.disaggregated:
        # As `pdserve up`: one KV side-channel secret per deployment, in the instances' environment (the
        # side channels listen on the nodes' addresses, which a producer without a secret refuses). The
        # driver's own PDSERVE_KV_SECRET, if any, is the deployment's.
        secret = os.environ.get(KV_SECRET_ENV) or secrets.token_hex(32)
        for template in templates.values():
            template.env.setdefault(KV_SECRET_ENV, secret)
    instances = [templates[role] for role, count in roles for _ in range(count)]
    if opts.autoscale is not None and not topo.disaggregated:
        raise ValueError("--autoscale sizes prefill and decode pools: it needs a P/D topology (e.g. 1p1d)")
    return RayAppSpec(
        app=opts.app, namespace=opts.namespace, model=model, topology=str(topo), instances=instances,
        templates=templates, proxy=proxy, proxy_node_id=proxy_node_id, log_dir=str(log_dir),
        max_restarts=opts.max_restarts, placement_timeout=opts.placement_timeout,
        discovery_interval=opts.discovery_interval, autoscale=opts.autoscale,
    )
