"""From a LaunchConfig to concrete processes: ports, GPU or CPU placement, argv, environment, log files.

Nothing here starts a process: `build_deployment` returns specs that `launch_procs` runs and that
`format_shell` prints as an equivalent shell script (`pdserve up --dry-run`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.launch.config import LaunchConfig, default_log_dir, parse_gpus

DEFAULT_PROXY_PORT = 8192
UCX_GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
GPU_MEMORY_UTILIZATION = 0.9  # what one instance alone on a GPU uses (vllm serve's default)
ADMIN_KEY_FILE = "admin-key"  # in the log folder, mode 0600: the proxy's --admin-key (env PDSERVE_ADMIN_KEY)
ADMIN_KEY_ENV = "PDSERVE_ADMIN_KEY"
KV_SECRET_ENV = "PDSERVE_KV_SECRET"  # the KV side channel's deployment secret (pdserve.kv_transfer.auth)


@dataclass
class ProcSpec:
    name: str  # "prefill", "decode-1", "proxy": also the log file's stem
    role: str  # prefill | decode | collocated | proxy
    argv: list[str]
    env: dict[str, str]  # set on top of the inherited environment
    host: str
    port: int
    log_path: Path
    cpus: list[int] | None = None  # CPU affinity (CPU mode)
    gpu: str | None = None  # CUDA_VISIBLE_DEVICES value (GPU mode)
    side_channel_port: int | None = None
    wave: int = 0  # instances of wave k start once every instance of wave k-1 is healthy

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class Deployment:
    instances: list[ProcSpec]
    proxy: ProcSpec
    model: str  # as passed to the instances
    device: str  # "cpu" or "cuda"
    notes: list[str] = field(default_factory=list)
    admin_key_file: Path | None = None  # None: the user gave the proxy its admin key (or none is made)
    # A KV side-channel secret is generated at start and given to every instance by environment (never argv);
    # False: no KV transfer, another engine, or the user's own PDSERVE_KV_SECRET is inherited.
    kv_secret: bool = False

    def role(self, role: str) -> list[ProcSpec]:
        return [s for s in self.instances if s.role == role]


def detect_gpus(env: dict[str, str] | None = None) -> list[str]:
    """GPU ids visible to this process: CUDA_VISIBLE_DEVICES when set, else `nvidia-smi -L`; [] if none."""
    env = dict(os.environ) if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        return [] if not ids or ids[0] == "-1" else ids
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def available_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def split_cpus(cpus: list[int], n: int) -> list[list[int]]:
    """Contiguous, disjoint shares of `cpus` for n instances (sizes differ by at most one); with fewer
    cores than instances each instance gets one core, shared round-robin."""
    if n < 1:
        return []
    if len(cpus) < n:
        return [[cpus[i % len(cpus)]] for i in range(n)]
    base, extra = divmod(len(cpus), n)
    shares, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        shares.append(cpus[start : start + size])
        start += size
    return shares


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (taskset -c syntax)."""
    parts: list[str] = []
    start = prev = None
    for c in sorted(cpus):
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            parts.append(f"{start}-{prev}" if start != prev else str(start))
            start = prev = c
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(parts)


class PortAllocator:
    """Distinct ports on one host: explicit ones are checked free, others come from the OS (port 0).

    The probe sockets stay bound until `close()`, so no two allocations can return the same port.
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self._held: list[socket.socket] = []
        self._taken: set[int] = set()

    def _bind(self, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        if port:
            # an explicit port is free if nothing listens on it (TIME_WAIT leftovers do not count: servers
            # bind with SO_REUSEADDR); free ports from the OS are taken without it, fully unused
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((self.host, port))
        except OSError:
            s.close()
            raise
        return s

    def take(self, port: int | None = None, what: str = "port") -> int:
        if port:
            if port in self._taken:
                raise ValueError(f"{what}: port {port} is used twice in this deployment")
            try:
                s = self._bind(port)
            except OSError as e:
                raise ValueError(f"{what}: port {port} on {self.host} is not free ({e.strerror})") from None
        else:
            s = self._bind(0)
        chosen = s.getsockname()[1]
        self._held.append(s)
        self._taken.add(chosen)
        return chosen

    def try_take(self, port: int) -> int | None:
        try:
            return self.take(port)
        except ValueError:
            return None

    def close(self) -> None:
        for s in self._held:
            s.close()
        self._held.clear()


def kv_transfer_config(role: str, policy: str, history: bool = False, mode: str = "pull") -> str:
    """An instance's --kv-transfer-config; `history`: vLLM's bidirectional transfer for multi-turn (the decode
    instance keeps a finished conversation's blocks, the next turn's prefill reads them back); `mode` "push":
    NixlPushConnector."""
    cfg: dict[str, object] = {
        "kv_connector": "NixlPushConnector" if mode == "push" else "NixlConnector", "kv_role": f"kv_{'producer' if role == 'prefill' else 'consumer'}",
        "kv_load_failure_policy": policy}
    if history:
        cfg["kv_connector_extra_config"] = {"bidirectional_kv_xfer": True}
    return json.dumps(cfg, separators=(",", ":"))


def kv_events_config(host: str) -> str:
    """An instance's --kv-events-config for `pdserve up --kv-events`: vLLM's ZMQ publisher with replay and
    snapshot sockets (a restarted proxy rebuilds its index from the snapshot), all on free ports of `host`
    (instances advertise the bound ports in /pdserve/info, where the proxy finds them)."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{host}:*",
                       "replay_endpoint": f"tcp://{host}:*", "snapshot_endpoint": f"tcp://{host}:*"},
                      separators=(",", ":"))


def _names(role: str, count: int) -> list[str]:
    return [role] if count == 1 else [f"{role}-{i}" for i in range(count)]


def build_deployment(
    cfg: LaunchConfig,
    *,
    gpus: list[str] | None = None,
    cpus: list[int] | None = None,
    model_arg: str | None = None,
    env: dict[str, str] | None = None,
) -> Deployment:
    """Concrete process specs for `cfg`.

    `gpus`: GPU ids (None: from cfg.gpus, "auto" detects); `cpus`: cores to split in CPU mode (default:
    this process's affinity); `model_arg`: what to pass as MODEL (default cfg.model or the embedded name);
    `env`: the environment the children inherit (to avoid overriding a user's UCX settings).
    """
    env = dict(os.environ) if env is None else env
    if cfg.log_dir is None:
        cfg.log_dir = default_log_dir()
    auto = cfg.gpus.strip().lower() == "auto"
    if gpus is None:
        gpus = detect_gpus(env) if auto else (parse_gpus(cfg.gpus) or [])
    device = "cuda" if gpus else "cpu"
    # CPU chosen explicitly on a GPU box: hide the GPUs from the instances
    hide_gpus = device == "cpu" and not auto and bool(detect_gpus(env))
    topo = cfg.topology
    if model_arg is None:
        from pdserve.model.default_model import DEFAULT_MODEL

        model_arg = cfg.model or DEFAULT_MODEL
    python = cfg.python or sys.executable
    notes: list[str] = []

    roles = (
        [("prefill", topo.num_prefill), ("decode", topo.num_decode)]
        if topo.disaggregated
        else [("collocated", topo.num_collocated)]
    )
    ports = PortAllocator(cfg.host)
    try:
        # proxy first so that its well-known default wins over the instances' free ports
        if cfg.port is None:
            proxy_port = ports.try_take(DEFAULT_PROXY_PORT)
            if proxy_port is None:
                proxy_port = ports.take(0)
                notes.append(f"port {DEFAULT_PROXY_PORT} is busy: the proxy listens on {proxy_port}")
        else:
            proxy_port = ports.take(cfg.port, "proxy --port")
        plan: list[tuple[str, str, int, int | None]] = []  # (role, name, port, side channel port)
        for role, count in roles:
            pool = cfg.pools[role]
            for i, name in enumerate(_names(role, count)):
                if pool.ports:
                    port = ports.take(pool.ports[i], f"{name} port")
                elif cfg.base_port is not None:
                    offset = 100 if role == "decode" else 0
                    port = ports.take(cfg.base_port + offset + i, f"{name} port (--base-port)")
                else:
                    port = ports.take(0)
                plan.append((role, name, port, None))
        if topo.disaggregated:
            # every instance on a host needs its own side-channel port (vLLM issue 20965)
            for k, (role, name, port, _) in enumerate(plan):
                pool = cfg.pools[role]
                index = int(name.rsplit("-", 1)[1]) if "-" in name else 0
                if pool.side_channel_ports:
                    sc = ports.take(pool.side_channel_ports[index], f"{name} side-channel port")
                elif cfg.base_port is not None:
                    sc = ports.take(cfg.base_port + 200 + k, f"{name} side-channel port (--base-port)")
                else:
                    sc = ports.take(0)
                plan[k] = (role, name, port, sc)
    finally:
        ports.close()

    tps = [cfg.tensor_parallel_size(role) for role, _, _, _ in plan]
    shares = _rank_shares(cpus if cpus is not None else available_cpus(), tps) if device == "cpu" else []
    gpu_sets = _gpu_sets(gpus, tps, [name for _, name, _, _ in plan]) if device == "cuda" else []
    instances: list[ProcSpec] = []
    for k, (role, name, port, sc) in enumerate(plan):
        pool = cfg.pools[role]
        child_env: dict[str, str] = {}
        spec_cpus: list[int] | None = None
        gpu: str | None = None
        if device == "cuda":
            gpu = gpu_sets[k]  # one GPU per tensor-parallel rank: "2" or "2,3"
            child_env["CUDA_VISIBLE_DEVICES"] = gpu
            if topo.disaggregated and UCX_GET_ZCOPY not in env:
                # without it UCX silently reads over TCP when no NVLink is detected (PCIe-only boxes)
                child_env[UCX_GET_ZCOPY] = "y"
        else:
            if hide_gpus:
                child_env["CUDA_VISIBLE_DEVICES"] = ""
            if cfg.cpu_pinning and shares:
                spec_cpus = shares[k]
                child_env["OMP_NUM_THREADS"] = str(len(spec_cpus))
                child_env["MKL_NUM_THREADS"] = str(len(spec_cpus))
        if sc is not None:
            child_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = cfg.host
            child_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(sc)
        if cfg.engine == "vllm":
            child_env.setdefault("UCX_NET_DEVICES", env.get("UCX_NET_DEVICES", "all"))
            argv = ["vllm", "serve", model_arg, "--host", cfg.host, "--port", str(port)]
            if sc is not None:
                argv += ["--kv-transfer-config", kv_transfer_config(role, cfg.kv_load_failure_policy,
                                                                     cfg.kv_history, cfg.kv_transfer_mode)]
        else:
            argv = [python, "-m", "pdserve", "serve", model_arg, "--host", cfg.host, "--port", str(port)]
            if sc is not None:
                argv += [
                    "--kv-transfer-config", kv_transfer_config(role, cfg.kv_load_failure_policy, cfg.kv_history,
                                                               cfg.kv_transfer_mode),
                    "--side-channel-host", cfg.host, "--side-channel-port", str(sc),
                ]
        if cfg.kv_events_in(role) and not has_flag(cfg.serve_args + pool.serve_args, "--kv-events-config"):
            argv += ["--kv-events-config", kv_events_config(cfg.host)]
        argv += cfg.serve_args + pool.serve_args
        if tps[k] > 1 and not (has_flag(argv, "--tensor-parallel-size") or has_flag(argv, "-tp")):
            argv += ["--tensor-parallel-size", str(tps[k])]
        child_env.update(pool.env)
        instances.append(ProcSpec(name, role, argv, child_env, cfg.host, port, cfg.log_dir / f"{name}.log",
                                  cpus=spec_cpus, gpu=gpu, side_channel_port=sc))

    if device == "cuda":
        _share_gpus(instances, cfg.engine, notes)

    proxy_argv = [python, "-m", "pdserve", "proxy", "--host", cfg.host, "--port", str(proxy_port)]
    prefill = [s.url for s in instances if s.role == "prefill"]
    decode = [s.url for s in instances if s.role in ("decode", "collocated")]
    if prefill:
        proxy_argv += ["--prefill", *prefill]
    proxy_argv += ["--decode", *decode]
    if prefill and cfg.engine == "vllm" and not has_flag(cfg.proxy_args, "--no-disagg-n"):
        proxy_argv.append("--no-disagg-n")  # vLLM's decode instances cannot fork one KV load into n choices
    if prefill and not has_flag(cfg.proxy_args, "--on-prefill-failure"):
        # While a prefill instance is down (restarting), decode instances prefill locally: the deployment
        # keeps answering, and the proxy's retry budget bounds the extra work.
        proxy_argv += ["--on-prefill-failure", "decode-local"]
    proxy_argv += cfg.proxy_args
    proxy = ProcSpec("proxy", "proxy", proxy_argv, {}, cfg.host, proxy_port, cfg.log_dir / "proxy.log")
    user_key = has_flag(cfg.proxy_args, "--admin-key") or bool(env.get(ADMIN_KEY_ENV))
    admin_key_file = None if user_key else cfg.log_dir / ADMIN_KEY_FILE
    user_secret = bool(env.get(KV_SECRET_ENV)) or any(KV_SECRET_ENV in s.env for s in instances)
    kv_secret = topo.disaggregated and cfg.engine == "pdserve" and not user_secret
    return Deployment(instances, proxy, model_arg, device, notes, admin_key_file, kv_secret)


def _rank_shares(cpus: list[int], tps: list[int]) -> list[list[int]]:
    """CPU mode: each instance's cores, in proportion to its tensor-parallel ranks (one process each)."""
    per_rank = split_cpus(cpus, sum(tps))
    out, i = [], 0
    for tp in tps:
        out.append(sorted({c for share in per_rank[i : i + tp] for c in share}))
        i += tp
    return out


def _gpu_sets(gpus: list[str], tps: list[int], names: list[str]) -> list[str]:
    """GPU mode: `tp` consecutive GPUs per instance, round-robin over `gpus` (instances share GPUs when
    there are fewer than all ranks need; an instance's ranks never share one)."""
    sets, cursor = [], 0
    for tp, name in zip(tps, names, strict=True):
        if tp > len(gpus):
            raise ValueError(f"{name} has tensor-parallel size {tp} but --gpus gives {len(gpus)} GPU(s)")
        sets.append(",".join(gpus[(cursor + j) % len(gpus)] for j in range(tp)))
        cursor += tp
    used: dict[str, str] = {}
    for gpu_set in sets:  # sharing is by whole sets (the memory split below); a partial overlap is refused
        for g in gpu_set.split(","):
            if used.setdefault(g, gpu_set) != gpu_set:
                raise ValueError(f"instances on GPUs {used[g]} and {gpu_set} overlap on GPU {g}: give --gpus a "
                                 "multiple of the tensor-parallel sizes, or enough GPUs for every rank")
    return sets


def has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _share_gpus(instances: list[ProcSpec], engine: str, notes: list[str]) -> None:
    """Instances sharing a GPU split its memory, unless their arguments set --gpu-memory-utilization.

    Both engines read the flag as this instance's own fraction of the GPU (pdserve's model_runner: the pool is
    `total x utilization - its own reserved memory`, capped by what is free), so each of n sharers gets 0.9/n:
    together what one instance alone would take, which keeps `pdserve bench compare`'s one-GPU targets equal
    (pdserve.bench.resources). pdserve's sharers still start one after the other (a wave each), so that each
    sees the memory the previous one took as in use.
    """
    by_gpu: dict[str, list[ProcSpec]] = {}
    for spec in instances:
        if spec.gpu is not None:
            by_gpu.setdefault(spec.gpu, []).append(spec)
    for gpu, specs in by_gpu.items():
        if len(specs) < 2 or any(has_flag(s.argv, "--gpu-memory-utilization") for s in specs):
            continue
        n = len(specs)
        for k, spec in enumerate(specs):
            spec.argv += ["--gpu-memory-utilization", f"{GPU_MEMORY_UTILIZATION / n:.3g}"]
            spec.wave = k if engine == "pdserve" else 0
        names = ", ".join(s.name for s in specs)
        how = f"--gpu-memory-utilization {GPU_MEMORY_UTILIZATION / n:.3g} each" + (
            ", started one after the other" if engine == "pdserve" else "")
        notes.append(f"GPU {gpu} is shared by {names}: {how}")


def _shell_line(spec: ProcSpec) -> str:
    words = [f"{k}={shlex.quote(v)}" for k, v in spec.env.items()]
    if spec.cpus is not None:
        words += ["taskset", "-c", cpu_list(spec.cpus)]
    words.append(shlex.join(spec.argv))
    return " ".join(words) + f" \\\n  > {shlex.quote(str(spec.log_path))} 2>&1 &"


def format_shell(dep: Deployment, cfg: LaunchConfig) -> str:
    """An equivalent shell script: instances in the background, wait for /health, then the proxy."""
    lines = [
        "#!/usr/bin/env bash",
        f"# pdserve up --dry-run: topology {cfg.topology}, engine {cfg.engine}, device {dep.device}",
        *[f"# note: {n}" for n in dep.notes],
        "set -euo pipefail",
        f"mkdir -p {shlex.quote(str(cfg.log_dir))}",
        "",
    ]
    if dep.kv_secret:
        lines += [
            "# the instances' KV side channels authenticate each other with a secret of this deployment",
            f"export {KV_SECRET_ENV}=\"$({shlex.quote(sys.executable)} -c 'import secrets; "
            "print(secrets.token_hex(32))')\"",
            "",
        ]
    for wave in sorted({spec.wave for spec in dep.instances}):
        specs = [spec for spec in dep.instances if spec.wave == wave]
        for spec in specs:
            where = f"GPU{'s' if ',' in spec.gpu else ''} {spec.gpu}" if spec.gpu is not None else (
                f"CPUs {cpu_list(spec.cpus)}" if spec.cpus else "CPU")
            extra = f", side channel :{spec.side_channel_port}" if spec.side_channel_port else ""
            lines += [f"# {spec.name}: {spec.url} ({where}{extra})", _shell_line(spec), ""]
        lines.append("# wait until every instance answers GET /health with 200")
        for spec in specs:
            lines.append(f"until curl -sf {spec.url}/health >/dev/null; do sleep 1; done")
        lines.append("")
    lines.append(f"# proxy: clients talk to {dep.proxy.url}")
    if dep.admin_key_file is not None:
        key = shlex.quote(str(dep.admin_key_file))
        lines += [
            "# its admin key (POST /pdserve/instances), readable only by you",
            f"(umask 077 && {shlex.quote(sys.executable)} -c 'import secrets; print(secrets.token_urlsafe(32))' "
            f"> {key})",
            f'{ADMIN_KEY_ENV}="$(cat {key})" \\',
        ]
    lines += [_shell_line(dep.proxy), ""]
    lines.append(f"until curl -sf {dep.proxy.url}/health >/dev/null; do sleep 1; done")
    lines.append(f"echo 'ready: {dep.proxy.url}/v1/completions'")
    return "\n".join(lines) + "\n"
