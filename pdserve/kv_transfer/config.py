"""`--kv-transfer-config` parsing (vLLM's JSON keys) plus the side-channel address.

vLLM accepts more keys than we act on (kv_port, kv_rank, ...); those are accepted and ignored so that the
seed articles' command lines work unchanged. Keys nobody knows are logged, not rejected, for the same reason.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.kv_transfer.auth import DEFAULT_MAX_SKEW_S, SECRET_ENV, SECRET_KEY, resolve_secret
from pdserve.types.push_pipeline import (  # noqa: F401 - their home is torch-free (pdserve/sim reads it)
    DEFAULT_PUSH_LAYERWISE_MIN_TOKENS,
    PUSH_PIPELINES,
    push_layer_by_layer,
)

logger = logging.getLogger("pdserve.kv_transfer")

SUPPORTED_CONNECTORS = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")
# vLLM's names (vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_connector.py, pull_connector.py): the
# decode READs (pull, NixlConnector's default) or the prefill WRITEs into blocks the decode registered (push).
PUSH_CONNECTOR = "NixlPushConnector"

# `enable_kv_digest` "auto" (the default) turns the per-block KV digests on where BENCHMARKS.md's measured cost
# ("KV digests") is within the 3 % of the transfer time a default may cost. On a CPU pool it is not: a hash that
# reads every byte costs 28-47 % of a CPU NIXL READ (XXH3, 1k-16k tokens), so off. On a GPU pool the fused lane
# sums' cost is measured by `bench_kv_transfer.py --device cuda --digest both`; this stays False (off) until that
# run shows <= 3 % at 4k tokens (BENCHMARKS.md, "KV digests": the GPU row is not measured yet).
DIGESTS_AUTO_ON_GPU = False
DIGEST_ALGOS = ("auto", "xxh3_128", "vllm_lanesum")  # kv_digest_algo; "auto": digest.default_algo(pool)


def digests_on(setting: bool | str, mem_type: str) -> bool:
    """Whether this instance digests (producer) and checks (consumer) KV blocks: `enable_kv_digest` true or
    false as given; "auto" by where the pool lives (`DIGESTS_AUTO_ON_GPU` on a GPU pool, off on a CPU pool)."""
    if setting == "auto":
        return DIGESTS_AUTO_ON_GPU and mem_type == "VRAM"
    return setting is True


ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("fail", "recompute")
BUFFER_DEVICES = ("cuda", "cpu")

DEFAULT_SIDE_CHANNEL_HOST = "127.0.0.1"
DEFAULT_SIDE_CHANNEL_PORT = 5600
ENV_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
ENV_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"
ENV_LOG_INTERVAL = "VLLM_LOG_STATS_INTERVAL"
ENV_DIGEST_FAIL = "VLLM_NIXL_DIGEST_FAIL"  # vLLM's fail-closed switch for its digest prototype

# Top-level keys of vLLM's KVTransferConfig that we accept without acting on them.
_IGNORED_VLLM_KEYS = frozenset(
    {
        "kv_port",
        "kv_rank",
        "kv_parallel_size",
        "kv_ip",
        "kv_buffer_size",
        "enable_permute_local_kv",
        "kv_connector_module_path",
    }
)
_KNOWN_KEYS = frozenset(
    {
        "kv_connector",
        "kv_role",
        "engine_id",
        "kv_buffer_device",
        "kv_load_failure_policy",
        "kv_connector_extra_config",
    }
)
_KNOWN_EXTRA_KEYS = frozenset(
    {
        "backends",
        "backend_params",
        "kv_lease_duration",
        "transfer_timeout_s",
        "handshake_timeout_s",
        "transfer_min_gbps",
        "num_load_workers",
        SECRET_KEY,
        "side_channel_max_skew_s",
        # bidirectional transfer for multi-turn (vLLM PR 32553): the decode instance keeps a finished
        # conversation's KV for the next turn's prefill, which reads it back
        "bidirectional_kv_xfer",
        "decoder_kv_blocks_ttl",
        "kv_recompute_threshold",
        # pdserve: a peer's prefill may ask this instance to pin cached prefix blocks for a short lease
        "peer_pin_ttl_s",
        "peer_pin_max_leases",
        # push mode (NixlPushConnector): a decode's registration not fulfilled within this many seconds fails
        # and frees its blocks (vLLM's name); `push_pipeline`: "layer" WRITEs each layer's KV of each chunk as
        # it is computed, "request" the whole request after the prefill (vLLM's #35264 behaviour)
        "push_registration_timeout",
        "push_pipeline",
        # per-block KV digests (vLLM's `enable_kv_digest`, nixl/digest.py): the producer digests what it holds,
        # the consumer checks what arrived; `kv_digest_required` (ours; vLLM's VLLM_NIXL_DIGEST_FAIL=1 alike)
        # also fails a load whose params carry no digests it can check
        "enable_kv_digest",
        "kv_digest_required",
        # ours: the producer's digest algorithm ("auto": XXH3-128 on a CPU pool, vLLM's lane sums on a GPU pool);
        # vllm_lanesum also lets a decode of a larger TP size check a CPU prefill's blocks (digest_split)
        "kv_digest_algo",
        "push_layerwise_min_tokens",
        # vLLM keys that have no meaning here (single engine).
        "num_threads",
        "engine_ttl",
        "enforce_handshake_compat",
        "enable_cross_layers_blocks",
    }
)


def _number(extra: Mapping[str, object], key: str, default: float, *, minimum: float = 0.0) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"kv_connector_extra_config.{key} must be a number, got {value!r}")
    if value <= minimum:
        raise ValueError(f"kv_connector_extra_config.{key} must be > {minimum:g}, got {value!r}")
    return float(value)


def _port(value: object, source: str) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{source} must be an integer port, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"{source} must be a port in 0..65535 (0 = any free port), got {value!r}")
    return value


def digests_enabled(raw: Mapping[str, object] | None) -> bool:
    """Whether a raw `--kv-transfer-config` turns the per-block KV digests on for a CPU pool (`enable_kv_digest`
    true; "auto" is off there): also what the KV offload tiers follow for their host tier (a CPU tensor), with
    or without P/D."""
    extra = (raw or {}).get("kv_connector_extra_config") or {}
    return isinstance(extra, Mapping) and digests_on(extra.get("enable_kv_digest", "auto"), "DRAM")


def is_loopback_host(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    engine_id: str
    kv_buffer_device: str | None
    kv_load_failure_policy: str
    backends: tuple[str, ...]
    backend_params: Mapping[str, Mapping[str, str]]
    kv_lease_duration: float
    transfer_timeout_s: float
    handshake_timeout_s: float
    # Floor throughput used to stretch the transfer deadline of big reads (TCP fallback is ~0.5 GB/s).
    transfer_min_gbps: float
    num_load_workers: int
    side_channel_host: str
    side_channel_port: int
    log_stats_interval_s: float = 10.0
    extra_config: Mapping[str, object] = field(default_factory=dict)  # without the secret
    # The deployment secret that authenticates side-channel messages (None: unauthenticated, loopback only
    # unless `insecure_side_channel`). Never in repr: configs get logged.
    side_channel_secret: str | None = field(default=None, repr=False)
    side_channel_max_skew_s: float = DEFAULT_MAX_SKEW_S
    insecure_side_channel: bool = False
    # Multi-turn (vLLM's names and defaults): a decode leg keeps its blocks (prompt + answer) under a lease of
    # decoder_kv_blocks_ttl seconds and returns params for them; a prefill reads such a prefix back unless it
    # is shorter than kv_recompute_threshold tokens. Either way the instance plays both roles (as vLLM's
    # NixlConnector always does): a decode instance serves its histories, a prefill instance reads them.
    bidirectional_kv_xfer: bool = False
    decoder_kv_blocks_ttl: float = 480.0
    kv_recompute_threshold: int = 64
    # Pins on demand (issue 18 part 4, pdserve only): with bidirectional_kv_xfer, POST /pdserve/kv/pin holds
    # the leading cached blocks of a prompt under a history-shaped lease of peer_pin_ttl_s seconds for a peer's
    # prefill to read; at most peer_pin_max_leases at once (0: refused).
    peer_pin_ttl_s: float = 10.0
    peer_pin_max_leases: int = 8
    push_registration_timeout: float = 60.0
    push_pipeline: str = "auto"  # push_layer_by_layer: "layer" on CPU pools, "request" on GPU pools
    # true, false, or "auto" (the default: `digests_on` decides by the pool's device, from BENCHMARKS.md's costs)
    enable_kv_digest: bool | str = "auto"
    kv_digest_required: bool = False
    kv_digest_algo: str = "auto"
    push_layerwise_min_tokens: int = DEFAULT_PUSH_LAYERWISE_MIN_TOKENS

    @property
    def transfer_mode(self) -> str:
        """"push" for NixlPushConnector, "pull" for NixlConnector / NixlPullConnector."""
        return "push" if self.kv_connector == PUSH_CONNECTOR else "pull"

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both") or self.bidirectional_kv_xfer

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both") or self.bidirectional_kv_xfer

    @property
    def bind_host(self) -> str:
        # vLLM binds whatever the env says; "localhost" may resolve to ::1 first, so pin IPv4 loopback.
        return "127.0.0.1" if self.side_channel_host == "localhost" else self.side_channel_host

    @property
    def heartbeat_interval_s(self) -> float:
        return self.kv_lease_duration / 6.0

    @classmethod
    def from_json(
        cls,
        raw: str | Mapping[str, object],
        *,
        side_channel_host: str | None = None,
        side_channel_port: int | str | None = None,
        insecure_side_channel: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> KVTransferConfig:
        """Parse `--kv-transfer-config`; explicit side-channel args win over the env variables.

        A producer without a side-channel secret binds only a loopback address unless `insecure_side_channel`
        (`pdserve serve --insecure-side-channel`) says that an unauthenticated side channel on the network
        is intended."""
        env = os.environ if env is None else env
        if isinstance(raw, str):
            try:
                data = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--kv-transfer-config is not valid JSON: {exc}") from None
        else:
            data = dict(raw)
        if not isinstance(data, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")

        unknown = set(data) - _KNOWN_KEYS - _IGNORED_VLLM_KEYS
        if unknown:
            logger.warning("ignoring unknown --kv-transfer-config keys: %s", ", ".join(sorted(unknown)))

        connector = data.get("kv_connector")
        if connector not in SUPPORTED_CONNECTORS:
            raise ValueError(
                f"kv_connector must be one of {', '.join(SUPPORTED_CONNECTORS)}, got {connector!r}"
            )
        role = data.get("kv_role")
        if role not in ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(ROLES)}, got {role!r}")

        engine_id = data.get("engine_id")
        if engine_id is None:
            engine_id = str(uuid.uuid4())
        elif not isinstance(engine_id, str) or not engine_id or len(engine_id) > 200:
            raise ValueError(f"engine_id must be a non-empty string, got {engine_id!r}")

        device = data.get("kv_buffer_device")
        if device is not None and device not in BUFFER_DEVICES:
            raise ValueError(f"kv_buffer_device must be one of {', '.join(BUFFER_DEVICES)}, got {device!r}")

        policy = data.get("kv_load_failure_policy", "fail")
        if policy not in FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {', '.join(FAILURE_POLICIES)}, got {policy!r}"
            )

        extra = data.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")
        unknown_extra = set(extra) - _KNOWN_EXTRA_KEYS
        if unknown_extra:
            logger.warning(
                "ignoring unknown kv_connector_extra_config keys: %s", ", ".join(sorted(unknown_extra))
            )

        backends = extra.get("backends", ["UCX"])
        if (
            not isinstance(backends, list)
            or not backends
            or not all(isinstance(b, str) and b for b in backends)
        ):
            raise ValueError(
                f"kv_connector_extra_config.backends must be a non-empty list of names, got {backends!r}"
            )
        backend_params = extra.get("backend_params", {})
        if not isinstance(backend_params, dict) or not all(
            isinstance(v, dict) and all(isinstance(k2, str) and isinstance(v2, str) for k2, v2 in v.items())
            for v in backend_params.values()
        ):
            raise ValueError(
                "kv_connector_extra_config.backend_params must map backend name -> {param: string value}"
            )

        workers = extra.get("num_load_workers", 4)
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 64:
            raise ValueError(f"kv_connector_extra_config.num_load_workers must be 1..64, got {workers!r}")

        host = (
            side_channel_host
            if side_channel_host is not None
            else env.get(ENV_HOST, DEFAULT_SIDE_CHANNEL_HOST)
        )
        if not isinstance(host, str) or not host.strip():
            raise ValueError(f"side channel host must be a non-empty string, got {host!r}")
        if side_channel_port is not None:
            port = _port(side_channel_port, "--side-channel-port")
        else:
            port = _port(env.get(ENV_PORT, DEFAULT_SIDE_CHANNEL_PORT), ENV_PORT)

        interval_raw = env.get(ENV_LOG_INTERVAL, "10")
        try:
            interval = float(interval_raw)
        except ValueError:
            raise ValueError(
                f"{ENV_LOG_INTERVAL} must be a number of seconds, got {interval_raw!r}"
            ) from None
        if not interval > 0:
            raise ValueError(f"{ENV_LOG_INTERVAL} must be > 0, got {interval_raw!r}")

        bidirectional = extra.get("bidirectional_kv_xfer", False)
        if not isinstance(bidirectional, bool):
            raise ValueError(f"kv_connector_extra_config.bidirectional_kv_xfer must be true or false, got "
                             f"{bidirectional!r}")
        threshold = extra.get("kv_recompute_threshold", 64)
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"kv_connector_extra_config.kv_recompute_threshold must be an integer >= 0, got "
                             f"{threshold!r}")

        pipeline = extra.get("push_pipeline", "auto")
        if pipeline not in PUSH_PIPELINES:
            raise ValueError(f"kv_connector_extra_config.push_pipeline must be one of {', '.join(PUSH_PIPELINES)}, "
                             f"got {pipeline!r}")
        min_tokens = extra.get("push_layerwise_min_tokens", DEFAULT_PUSH_LAYERWISE_MIN_TOKENS)
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise ValueError(f"kv_connector_extra_config.push_layerwise_min_tokens must be an integer >= 0, got "
                             f"{min_tokens!r}")
        if connector == PUSH_CONNECTOR and bidirectional and role == "kv_both":
            # Push with multi-turn history (vLLM's NixlPushConnectorScheduler refuses it, vllm#46473): the decode
            # keeps each conversation under a lease and the next turn's prefill READs it back, then pushes only
            # the blocks the decode lacks. So a push decode instance (kv_consumer) holds, a push prefill
            # (kv_producer) reads; one instance of both roles would have to be a push decode and a pull reader
            # at once (one consumer role per instance).
            raise ValueError("kv_connector NixlPushConnector with bidirectional_kv_xfer needs kv_role kv_producer "
                             "(prefill: reads held histories back) or kv_consumer (decode: holds them), not "
                             "kv_both")

        digest = {k: extra.get(k, default) for k, default in (("enable_kv_digest", "auto"),
                                                               ("kv_digest_required", False))}
        if not isinstance(digest["enable_kv_digest"], bool) and digest["enable_kv_digest"] != "auto":
            raise ValueError("kv_connector_extra_config.enable_kv_digest must be true, false or \"auto\", got "
                             f"{digest['enable_kv_digest']!r}")
        if not isinstance(digest["kv_digest_required"], bool):
            raise ValueError("kv_connector_extra_config.kv_digest_required must be true or false, got "
                             f"{digest['kv_digest_required']!r}")
        digest_algo = extra.get("kv_digest_algo", "auto")
        if digest_algo not in DIGEST_ALGOS:
            raise ValueError(f"kv_connector_extra_config.kv_digest_algo must be one of {', '.join(DIGEST_ALGOS)}, "
                             f"got {digest_algo!r}")
        if env.get(ENV_DIGEST_FAIL, "0") not in ("", "0"):
            digest["kv_digest_required"] = True

        secret = resolve_secret(extra, env)
        if SECRET_KEY in extra:
            logger.warning(
                "kv_connector_extra_config.%s is visible to every user of this host in the process list; "
                "prefer the environment variable %s",
                SECRET_KEY,
                SECRET_ENV,
            )
        host = host.strip()
        if (role in ("kv_producer", "kv_both") or bidirectional) and secret is None and not is_loopback_host(host):
            if not insecure_side_channel:
                raise ValueError(
                    f"the KV side channel would listen on {host} without authentication: anyone who reaches it "
                    f"could read this instance's KV cache. Set a deployment secret ({SECRET_ENV}, the same on "
                    "every instance), bind a loopback address, or pass --insecure-side-channel on a network "
                    "you trust"
                )
            logger.warning(
                "INSECURE: the KV side channel listens on %s without a secret (--insecure-side-channel): anyone "
                "who reaches it can obtain the NIXL agent metadata and read this instance's KV cache",
                host,
            )

        return cls(
            kv_connector=connector,
            kv_role=role,
            engine_id=engine_id,
            kv_buffer_device=device,
            kv_load_failure_policy=policy,
            backends=tuple(backends),
            backend_params={k: dict(v) for k, v in backend_params.items()},
            kv_lease_duration=_number(extra, "kv_lease_duration", 30.0),
            transfer_timeout_s=_number(extra, "transfer_timeout_s", 2.0),
            handshake_timeout_s=_number(extra, "handshake_timeout_s", 2.0),
            transfer_min_gbps=_number(extra, "transfer_min_gbps", 0.5),
            num_load_workers=workers,
            side_channel_host=host,
            side_channel_port=port,
            log_stats_interval_s=interval,
            extra_config={k: v for k, v in extra.items() if k != SECRET_KEY},
            side_channel_secret=secret,
            side_channel_max_skew_s=_number(extra, "side_channel_max_skew_s", DEFAULT_MAX_SKEW_S),
            insecure_side_channel=insecure_side_channel,
            bidirectional_kv_xfer=bidirectional,
            decoder_kv_blocks_ttl=_number(extra, "decoder_kv_blocks_ttl", 480.0),
            kv_recompute_threshold=threshold,
            peer_pin_ttl_s=_number(extra, "peer_pin_ttl_s", 10.0),
            peer_pin_max_leases=int(_number(extra, "peer_pin_max_leases", 8)),
            push_registration_timeout=_number(extra, "push_registration_timeout", 60.0),
            push_pipeline=pipeline,
            enable_kv_digest=digest["enable_kv_digest"],
            # only where digests are on (a consumer without a digester checks nothing, so requires nothing)
            kv_digest_required=digest["kv_digest_required"] and digest["enable_kv_digest"] is not False,
            kv_digest_algo=digest_algo,
            push_layerwise_min_tokens=min_tokens,
        )
