"""`pdserve up` settings: the topology grammar and the optional YAML/TOML file.

A config file holds the same settings as the flags (flags win), plus per-pool settings:

    model: ./my-model              # folder, or a short name (default: the embedded SmolLM2)
    topology: 1p1d                 # collocated:N | 1p1d | XpYd
    engine: pdserve                # or vllm
    gpus: "0,1"                    # or "none"/"auto"
    port: 8192                     # the proxy's; 0 = any free port
    log_dir: ./logs                # default: a new folder under ~/.cache/pdserve/logs/
    startup_timeout: 600
    serve_args: ["--max-model-len", "2048"]       # every instance
    prefill: {serve_args: [...], ports: [8100], side_channel_ports: [5600], env: {KEY: value}, tp: 4}
    decode:  {serve_args: [...], ports: [8200], side_channel_ports: [5601], tp: 2}   # tp: GPUs per instance
    collocated: {serve_args: [...], ports: [8100, 8101]}
    proxy: {args: ["--prefix-affinity"]}
"""

from __future__ import annotations

import os
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINES = ("pdserve", "vllm")
ROLES = ("prefill", "decode", "collocated")

_TOPOLOGY_RE = re.compile(r"^\s*(\d+)\s*p\s*(\d+)\s*d\s*$", re.IGNORECASE)
_COLLOCATED_RE = re.compile(r"^\s*collocated\s*(?::\s*(\d+))?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Topology:
    """`collocated:N` (N full replicas behind the proxy) or `XpYd` (X prefill, Y decode instances)."""

    num_prefill: int
    num_decode: int
    num_collocated: int

    @property
    def disaggregated(self) -> bool:
        return self.num_collocated == 0

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode + self.num_collocated

    def __str__(self) -> str:
        if self.disaggregated:
            return f"{self.num_prefill}p{self.num_decode}d"
        return f"collocated:{self.num_collocated}"


def parse_topology(text: str) -> Topology:
    if m := _COLLOCATED_RE.match(text):
        n = int(m.group(1) or 1)
        if n < 1:
            raise ValueError(f"topology {text!r}: collocated needs at least one replica")
        return Topology(0, 0, n)
    if m := _TOPOLOGY_RE.match(text):
        p, d = int(m.group(1)), int(m.group(2))
        if p < 1 or d < 1:
            raise ValueError(f"topology {text!r}: needs at least one prefill and one decode instance")
        return Topology(p, d, 0)
    raise ValueError(f"topology {text!r}: expected collocated[:N], 1p1d or XpYd (e.g. 2p1d)")


@dataclass
class PoolSettings:
    tp: int | None = None  # tensor-parallel size of each instance of the role (GPUs or CPU processes)
    serve_args: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    side_channel_ports: list[int] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class LaunchConfig:
    model: str | None = None
    topology: Topology = field(default_factory=lambda: Topology(1, 1, 0))
    engine: str = "pdserve"
    host: str = "127.0.0.1"
    port: int | None = None  # proxy port; None = 8192 if free, else any free port; 0 = any free port
    base_port: int | None = None  # instances at base+i (prefill/collocated) and base+100+i (decode)
    gpus: str = "auto"  # "auto" | "none" | "0,1,..."
    cpu_pinning: bool = True  # CPU mode: split the cores among instances
    log_dir: Path | None = None  # None: default_log_dir(), resolved by `pdserve up` before anything starts
    startup_timeout: float = 600.0
    stop_timeout: float = 15.0
    max_restarts: int = 5  # while serving: restarts of one process within restart_window before giving up
    restart_window: float = 600.0
    serve_args: list[str] = field(default_factory=list)
    pools: dict[str, PoolSettings] = field(default_factory=lambda: {r: PoolSettings() for r in ROLES})
    proxy_args: list[str] = field(default_factory=list)
    kv_load_failure_policy: str = "fail"
    # multi-turn over P/D: decode instances keep each finished conversation for the next turn's prefill
    # (vLLM's kv_connector_extra_config.bidirectional_kv_xfer, set on both pools)
    kv_history: bool = False
    # instances publish vLLM-format KV events on ports of their own, and the proxy routes by cached prefix:
    # True in every role, False nowhere, None (default) in each role of more than one instance
    kv_events: bool | None = None
    # "push": NixlPushConnector on both pools and `pdserve proxy --kv-transfer-mode push` (the prefill WRITEs
    # each layer's KV into blocks the decode registered); "pull" (default): NixlConnector, the decode READs
    kv_transfer_mode: str = "pull"
    python: str = ""  # interpreter for `python -m pdserve ...`; "" = this one

    def kv_events_in(self, role: str) -> bool:
        """Whether `role`'s instances publish KV events: as asked, else where the proxy has a choice."""
        if self.kv_events is not None:
            return self.kv_events
        topo = self.topology
        count = {"prefill": topo.num_prefill, "decode": topo.num_decode, "collocated": topo.num_collocated}[role]
        return count > 1

    def validate(self) -> LaunchConfig:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.base_port is not None and not 1024 <= self.base_port <= 65535 - 100 - self.topology.num_instances:
            raise ValueError(f"base port {self.base_port} out of range")
        if self.startup_timeout <= 0 or self.stop_timeout <= 0:
            raise ValueError("startup and stop timeouts must be > 0")
        if self.max_restarts < 0 or self.restart_window <= 0:
            raise ValueError("max_restarts must be >= 0 and restart_window > 0")
        if self.kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError(f"kv_load_failure_policy must be fail or recompute, got {self.kv_load_failure_policy!r}")
        if self.kv_history and not self.topology.disaggregated:
            raise ValueError(f"kv_history (--kv-history) needs prefill and decode instances, not {self.topology}")
        if self.kv_transfer_mode not in ("pull", "push"):
            raise ValueError(f"kv_transfer_mode must be pull or push, got {self.kv_transfer_mode!r}")
        if self.kv_transfer_mode == "push" and self.kv_history and self.engine != "pdserve":
            # vLLM's NixlPushConnectorScheduler refuses bidirectional_kv_xfer (vllm#46473); pdserve's push instances
            # take it (the prefill reads the held history back, then pushes)
            raise ValueError("kv_transfer_mode push with kv_history needs pdserve instances (vLLM's "
                             "NixlPushConnector refuses bidirectional_kv_xfer)")
        counts = {"prefill": self.topology.num_prefill, "decode": self.topology.num_decode,
                  "collocated": self.topology.num_collocated}
        for role, pool in self.pools.items():
            self.tensor_parallel_size(role)  # raises on a bad or contradicted size
            for what, values in (("ports", pool.ports), ("side_channel_ports", pool.side_channel_ports)):
                if values and len(values) != counts[role]:
                    raise ValueError(
                        f"{role}.{what} lists {len(values)} port(s) but the topology {self.topology} has "
                        f"{counts[role]} {role} instance(s)"
                    )
                for p in values:
                    if not 1 <= p <= 65535:
                        raise ValueError(f"{role}.{what}: {p} is not a port")
        return self


    def tensor_parallel_size(self, role: str) -> int:
        """The TP size of each `role` instance: `tp` (--prefill-tp, ...), or a --tensor-parallel-size/-tp in
        its serve arguments; 1 when neither says."""
        pool = self.pools[role]
        from_args = tp_in_args(self.serve_args + pool.serve_args)
        if pool.tp is not None and pool.tp < 1:
            raise ValueError(f"{role} tensor-parallel size must be >= 1, got {pool.tp}")
        if pool.tp is not None and from_args is not None and pool.tp != from_args:
            raise ValueError(f"{role}: tensor-parallel size {pool.tp} but its serve arguments say {from_args}")
        return pool.tp or from_args or 1


def tp_in_args(argv: list[str]) -> int | None:
    """`--tensor-parallel-size N` / `-tp N` / `--tensor-parallel-size=N` in serve arguments (the last one
    wins, as argparse reads them), or None."""
    value = None
    for i, word in enumerate(argv):
        if word in ("--tensor-parallel-size", "-tp") and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(("--tensor-parallel-size=", "-tp=")):
            value = word.split("=", 1)[1]
    if value is None:
        return None
    try:
        tp = int(value)
    except ValueError:
        raise ValueError(f"--tensor-parallel-size {value!r} is not an integer") from None
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
    return tp


def default_log_dir() -> Path:
    """A new folder per run under the user cache (`$PDSERVE_CACHE_DIR`, `$XDG_CACHE_HOME/pdserve` or
    `~/.cache/pdserve`): logs/up-YYYYmmdd-HHMMSS-PID. Never the current directory."""
    from pdserve.cache_dir import cache_dir  # standard library only

    return cache_dir() / "logs" / f"up-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A YAML (.yaml/.yml) or TOML (.toml) mapping; keys may use `-` or `_`."""
    file = Path(path)
    text = file.read_text()
    if file.suffix == ".toml":
        import tomllib

        data = tomllib.loads(text)
    elif file.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        raise ValueError(f"{file}: config file must end in .yaml, .yml or .toml")
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a mapping at the top level")
    return _normalise_keys(data)


def _normalise_keys(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k).replace("-", "_"): (v if str(k) == "env" else _normalise_keys(v)) for k, v in obj.items()}
    return obj


def _args_list(value: Any, where: str) -> list[str]:
    """A list of argv words, from a list or one shell-quoted string."""
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    raise ValueError(f"{where} must be a list of arguments or one string, got {type(value).__name__}")


def _ports(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ValueError(f"{where} must be a port or a list of ports")


_TOP_KEYS = {
    "model", "topology", "engine", "host", "port", "base_port", "gpus", "cpu_pinning", "log_dir",
    "startup_timeout", "stop_timeout", "serve_args", "prefill", "decode", "collocated", "proxy",
    "kv_load_failure_policy", "python", "max_restarts", "restart_window", "kv_history", "kv_events",
    "kv_transfer_mode",
}


def apply_file(cfg: LaunchConfig, data: dict[str, Any], where: str = "config file") -> None:
    """Overlay a loaded config file onto `cfg` (flags are applied afterwards by the caller)."""
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {', '.join(sorted(unknown))} (known: {', '.join(sorted(_TOP_KEYS))})")
    if "model" in data:
        cfg.model = None if data["model"] is None else str(data["model"])
    if "topology" in data:
        cfg.topology = parse_topology(str(data["topology"]))
    for key in ("engine", "host", "gpus", "python", "kv_load_failure_policy", "kv_transfer_mode"):
        if key in data:
            setattr(cfg, key, str(data[key]))
    for key in ("port", "base_port", "max_restarts"):
        if key in data:
            setattr(cfg, key, None if data[key] is None else int(data[key]))
    for key in ("startup_timeout", "stop_timeout", "restart_window"):
        if key in data:
            setattr(cfg, key, float(data[key]))
    for key in ("cpu_pinning", "kv_history", "kv_events"):
        if key in data and not (key == "kv_events" and data[key] is None):
            if not isinstance(data[key], bool):
                raise ValueError(f"{where}: {key} must be true or false")
            setattr(cfg, key, data[key])
    if "log_dir" in data:
        cfg.log_dir = Path(str(data["log_dir"]))
    cfg.serve_args += _args_list(data.get("serve_args"), f"{where}: serve_args")
    for role in ROLES:
        section = data.get(role)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ValueError(f"{where}: {role} must be a mapping")
        bad = set(section) - {"serve_args", "ports", "side_channel_ports", "env", "tp"}
        if bad:
            raise ValueError(f"{where}: {role}: unknown keys {', '.join(sorted(bad))}")
        pool = cfg.pools[role]
        if section.get("tp") is not None:
            pool.tp = int(section["tp"])
        pool.serve_args += _args_list(section.get("serve_args"), f"{where}: {role}.serve_args")
        pool.ports = _ports(section.get("ports"), f"{where}: {role}.ports") or pool.ports
        pool.side_channel_ports = (
            _ports(section.get("side_channel_ports"), f"{where}: {role}.side_channel_ports") or pool.side_channel_ports
        )
        env = section.get("env") or {}
        if not isinstance(env, dict):
            raise ValueError(f"{where}: {role}.env must be a mapping")
        pool.env.update({str(k): str(v) for k, v in env.items()})
    proxy = data.get("proxy")
    if proxy is not None:
        if not isinstance(proxy, dict) or set(proxy) - {"args"}:
            raise ValueError(f"{where}: proxy must be a mapping with an `args` list")
        cfg.proxy_args += _args_list(proxy.get("args"), f"{where}: proxy.args")


def parse_gpus(text: str) -> list[str] | None:
    """`none`/`cpu` -> None (CPU); `0,1` -> ["0", "1"] (ids or UUIDs as CUDA_VISIBLE_DEVICES takes them)."""
    t = text.strip().lower()
    if t in ("none", "cpu", ""):
        return None
    ids = [g.strip() for g in text.split(",") if g.strip()]
    if not ids:
        raise ValueError(f"--gpus {text!r}: expected a comma-separated list like 0,1 or none")
    return ids
