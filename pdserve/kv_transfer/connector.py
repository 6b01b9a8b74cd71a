"""`KVConnector`: the one object the engine holds (see ARCHITECTURE.md, "KV connector"); it implements
`pdserve.engine.pd.connector_protocol.KVConnectorProtocol`.

    connector = KVConnector(config, pool, compat, block_size, registry=metrics_registry, model_name=name)
    # producer (P leg finished by length/stop): keep the blocks, then
    held = connector.producer.hold(request_id, block_ids, num_tokens, num_cached_tokens)  # -> HeldKVParams
    for rid in connector.producer.poll_released(): free the blocks of rid            # every step
    # consumer (D leg), its kv_transfer_params read once (pdserve.api.pd.KVTransferParams):
    load = connector.consumer.parse(params)       # InvalidKVTransferParams (a ValueError) -> HTTP 400
    connector.consumer.add_waiting(request_id, load)  # heartbeats while queued
    connector.consumer.remove_waiting(request_id)     # gave up before loading: producer frees early
    connector.consumer.start_load(request_id, load, local_block_ids, first_block)
    for r in connector.consumer.poll_loads(): r.ok -> num_computed_tokens = len(prompt) - 1; else failure policy
    connector.shutdown()

Roles: kv_producer runs the side channel and leases, kv_consumer loads, kv_both does both with one NIXL agent.
The engine calls each role on its own object (`producer`: `KVProducer`; `consumer`: `KVConsumer`, whose
transfer is a `PullReader`, or a `PushReceiver` in push mode) rather than through this class: the roles already are the engine's API, and a
connector that re-declared every role method would only pass each call through (and grow with every one). What
is the connector's own stays here: building the roles over one NIXL agent and side channel, the policies and
limits that span both roles, metrics, the layer-pipelined push hook, and shutdown.

Tensor parallelism (`tp_size` > 1): `pool` is rank 0's shard and `rank_agents(name, backends, params, loopback,
gpu)` starts the NIXL agents of ranks 1..N-1 over their own shards (in their processes), returning handles
with NixlAgent's methods and a `region`. The side channel, leases and load bookkeeping stay here; the
handshake describes every rank, and each rank's READs run on its own agent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry

from pdserve.api.pd import PUSH
from pdserve.kv_transfer.auth import SECRET_ENV, MessageAuth, ReplayGuard
from pdserve.kv_transfer.compat import HEAD_MAJOR_LAYOUT, POOL_LAYOUT, Compat, normalize_compat
from pdserve.kv_transfer.config import KVTransferConfig, digests_on, is_loopback_host, push_layer_by_layer
from pdserve.kv_transfer.consumer import KVConsumer
from pdserve.kv_transfer.digest import BlockDigester
from pdserve.kv_transfer.digest_split import SplitLayout
from pdserve.kv_transfer.faults import KVFaults
from pdserve.kv_transfer.head_split import block_geometry
from pdserve.kv_transfer.local_kv import LocalKV
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.nixl_agent import (
    NixlAgent,
    RankAgent,
    WorkerRankAgent,
    apply_env_defaults,
    load_nixl,
)
from pdserve.kv_transfer.pool import KVPool, PoolRegion, pretouch, region_of
from pdserve.kv_transfer.producer import KVProducer
from pdserve.kv_transfer.pull_reader import PullReader
from pdserve.kv_transfer.push_receiver import PushReceiver
from pdserve.kv_transfer.push_sender import PushSender, StepRequest
from pdserve.kv_transfer.side_channel import SideChannelServer
from pdserve.types.tp_layout import kv_heads_per_rank

# rank_agents(name prefix, backends, backend params, loopback, gpu) -> the agents of ranks 1..N-1
RankAgentsFactory = Callable[[str, tuple[str, ...], dict, bool, bool], Sequence[WorkerRankAgent]]

logger = logging.getLogger("pdserve.kv_transfer")


def _check_pool_matches(
    region_shape: tuple[int, ...], region_dtype: str, compat: Compat, block_size: int, tp_size: int = 1
) -> None:
    if compat.get("kv_layout", POOL_LAYOUT) == HEAD_MAJOR_LAYOUT:
        _, layers, _, heads, bs, dim = region_shape
    else:
        _, layers, _, bs, heads, dim = region_shape
    expected = {
        "num_layers": layers,
        "block_size": bs,
        "num_kv_heads": heads,
        "head_dim": dim,
        "kv_cache_dtype": region_dtype,
    }
    if compat["kv_scales"] != "none":  # an fp8 pool: uint8 rows of head_dim fp8 values + inline scale bytes
        from pdserve.attention import fp8_kv

        if compat["kv_scales"] != fp8_kv.SCALE_SCHEME:
            raise ValueError(f"unknown kv_scales scheme {compat['kv_scales']!r}")
        expected["head_dim"] = dim - fp8_kv.SCALE_BYTES
        expected["kv_cache_dtype"] = compat["kv_cache_dtype"] if region_dtype == "uint8" else region_dtype
    wanted = dict(compat)
    wanted["num_kv_heads"] = kv_heads_per_rank(tp_size, int(compat["num_kv_heads"]))  # one rank's share
    wrong = [f"{k}: compat={wanted[k]!r} pool={v!r}" for k, v in expected.items() if wanted[k] != v]
    if block_size != bs:
        wrong.append(f"block_size argument {block_size} != pool {bs}")
    if wrong:
        raise ValueError("KV pool does not match the compatibility dict: " + "; ".join(wrong))


class KVConnector:
    def __init__(
        self,
        config: KVTransferConfig,
        pool: KVPool,
        compat: Mapping[str, object],
        block_size: int,
        *,
        registry: CollectorRegistry | None = None,
        model_name: str | None = None,
        engine_label: str = "0",
        tp_size: int = 1,
        rank_agents: RankAgentsFactory | None = None,
    ) -> None:
        self.config = config
        # push vs pull is part of the pairing: the handshake refuses a pair that differs, naming the field
        self.compat = normalize_compat({**compat, "kv_transfer_mode": config.transfer_mode})
        self.region = region_of(pool)
        self.tp_size = tp_size
        if (tp_size > 1) != (rank_agents is not None):
            raise ValueError("a tensor-parallel connector needs its ranks' agents (and only it)")
        _check_pool_matches(self.region.shape, self.region.dtype, self.compat, block_size, tp_size)
        if config.kv_buffer_device is not None:
            want = "VRAM" if config.kv_buffer_device == "cuda" else "DRAM"
            if want != self.region.mem_type:
                raise ValueError(
                    f"kv_buffer_device={config.kv_buffer_device!r} but the KV pool is in {self.region.mem_type}; "
                    "staging through another device is not supported"
                )
        self._pool = pool  # keep the memory alive as long as NIXL has it registered

        apply_env_defaults(
            loopback=is_loopback_host(config.side_channel_host), gpu=self.region.mem_type == "VRAM"
        )
        load_nixl()  # fail with the install hint before binding anything

        self.metrics = TransferMetrics(
            model_name=model_name or str(self.compat["model"]),
            engine=engine_label,
            registry=registry,
            log_interval_s=config.log_stats_interval_s,
        )
        self._server: SideChannelServer | None = None
        self._agent: NixlAgent | None = None
        self._rank_agents: list[WorkerRankAgent] = []  # ranks 1..N-1
        self.producer: KVProducer | None = None
        self.consumer: KVConsumer | None = None
        self.push_sender: PushSender | None = None
        auth = MessageAuth(config.side_channel_secret) if config.side_channel_secret is not None else None
        try:
            if config.is_producer:
                # Bind before the (slower) agent creation so a taken port fails startup at once.
                self._server = SideChannelServer(
                    config.bind_host,
                    config.side_channel_port,
                    engine_id=config.engine_id,
                    auth=auth,
                    replay_guard=ReplayGuard(config.side_channel_max_skew_s),
                    on_refused=self.metrics.record_side_channel_refused,
                )
            pretouch(self.region)
            self._agent = NixlAgent(config.engine_id, config.backends, dict(config.backend_params))
            self._agent.register(self.region)
            if rank_agents is not None:
                self._rank_agents = list(rank_agents(
                    config.engine_id, config.backends, dict(config.backend_params),
                    is_loopback_host(config.side_channel_host), self.region.mem_type == "VRAM"))
                for r, agent in enumerate(self._rank_agents, start=1):
                    _check_pool_matches(tuple(agent.region.shape), agent.region.dtype, self.compat, block_size,
                                        tp_size)
                    if agent.region.num_blocks != self.region.num_blocks:
                        raise ValueError(f"rank {r} has {agent.region.num_blocks} KV blocks, rank 0 "
                                         f"{self.region.num_blocks}")
            ranks: list[tuple[RankAgent, PoolRegion]] = [(self._agent, self.region),
                                                         *((a, a.region) for a in self._rank_agents)]
            kv = LocalKV(config, self._agent, self.region, self.compat, self.metrics, auth, ranks)
            local_heads = kv_heads_per_rank(tp_size, int(self.compat["num_kv_heads"]))
            push = config.transfer_mode == PUSH
            digester = None
            if digests_on(config.enable_kv_digest, self.region.mem_type):
                # the layout lets a consumer check a load from a producer of another TP size (digest_split)
                layout = SplitLayout(block_geometry(self.compat, self.region.block_bytes, local_heads),
                                     int(self.compat["num_kv_heads"]), int(self.compat["num_layers"]) * 2)
                digester = BlockDigester(pool, self._rank_agents, layout=layout,
                                         algo=None if config.kv_digest_algo == "auto" else config.kv_digest_algo)
            if config.is_producer:
                assert self._server is not None
                self.producer = KVProducer(
                    config,
                    server=self._server,
                    agent=self._agent,
                    region=self.region,
                    compat=self.compat,
                    metrics=self.metrics,
                    auth=auth,
                    ranks=ranks,
                    digester=digester,
                    faults=KVFaults.from_env(pool, block_size, digester),  # test-only, by environment
                )
                if push:
                    producer = self.producer
                    self.push_sender = PushSender(
                        agent=self._agent, region=self.region, num_layers=int(self.compat["num_layers"]),
                        block_size=block_size,
                        layerwise=push_layer_by_layer(config.push_pipeline, self.region.mem_type),
                        layerwise_min_tokens=config.push_layerwise_min_tokens,
                        transfer_timeout_s=config.transfer_timeout_s, lease_duration_s=config.kv_lease_duration,
                        release_lease=lambda rid, token: producer.leases.abort(rid, token),
                        extend_lease=lambda rid, token: producer.leases.heartbeat([(rid, token)]), auth=auth,
                        metrics=self.metrics, ranks=ranks,
                        # each rank WRITEs its own KV heads, split as the pull path's READs are (head_split)
                        geometry=block_geometry(self.compat, self.region.block_bytes, local_heads),
                        num_kv_heads=int(self.compat["num_kv_heads"]))
                    producer.push_handler = self.push_sender.handle
                    producer.push_sender = self.push_sender
                    self.push_sender.faults = producer.faults
                self._server.start()
            if config.is_consumer:
                # a push prefill with bidirectional_kv_xfer is a consumer only to READ held histories back: pull
                pushed_into = push and config.kv_role != "kv_producer"
                self.consumer = KVConsumer(kv, PushReceiver if pushed_into else PullReader, digester=digester)
                receiver = self.consumer.transfer
                if isinstance(receiver, PushReceiver) and self.producer is not None:
                    self.producer.push_notif = receiver.on_notif  # kv_both: its progress loop reads the notices
        except BaseException:
            self.shutdown()
            raise
        if config.is_producer and config.side_channel_host in ("0.0.0.0", "::"):
            logger.warning(
                "the KV side channel host %s is advertised to decode instances as remote_host; set "
                "VLLM_NIXL_SIDE_CHANNEL_HOST / --side-channel-host to an address they can reach",
                config.side_channel_host,
            )
        if config.is_producer and auth is None and not config.insecure_side_channel:
            logger.warning(
                "the KV side channel has no secret: any process on this host can obtain the NIXL agent metadata "
                "and read this instance's KV cache; set %s (the same on every instance; `pdserve up` does)",
                SECRET_ENV,
            )
        logger.info(
            "KV connector ready: role=%s engine_id=%s pool=%s %.1f MiB in %d blocks of %d bytes%s%s, "
            "side-channel messages %s",
            config.kv_role,
            config.engine_id,
            self.region.mem_type,
            self.region.length / 2**20,
            self.region.num_blocks,
            self.region.block_bytes,
            f" per rank, {tp_size} tensor-parallel ranks" if tp_size > 1 else "",
            f", side channel {config.side_channel_host}:{self.side_channel_port}" if self._server else "",
            "authenticated (deployment secret)" if auth is not None else "unauthenticated",
        )

    # ---- common ------------------------------------------------------------------------------------

    @property
    def engine_id(self) -> str:
        return self.config.engine_id

    @property
    def can_load(self) -> bool:
        return self.config.is_consumer

    @property
    def can_send(self) -> bool:
        return self.config.is_producer

    @property
    def load_failure_policy(self) -> str:
        return self.config.kv_load_failure_policy

    @property
    def side_channel_authenticated(self) -> bool:
        """Whether side-channel messages are signed with a deployment secret (what /pdserve/info reports)."""
        return self.config.side_channel_secret is not None

    @property
    def side_channel_port(self) -> int | None:
        """The bound port (differs from the configured one when that was 0); None without a producer."""
        return self._server.port if self._server is not None else None

    def shutdown(self) -> None:
        if self.consumer is not None:
            self.consumer.shutdown()
            self.consumer = None
        if self.push_sender is not None:
            self.push_sender.shutdown()
            self.push_sender = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.producer is not None:
            self.producer.shutdown()
            self.producer = None
        for agent in self._rank_agents:
            agent.close()
        self._rank_agents = []
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- both roles ---------------------------------------------------------------------------------

    def step_hook(self, batch: Sequence[tuple[StepRequest, int]]) -> Callable[[int], None] | None:
        """Layer-pipelined push: the callback the model calls after each layer of this step (None: none)."""
        return self.push_sender.step_hook(batch) if self.push_sender is not None else None

    @property
    def keeps_history(self) -> bool:
        """Decode legs keep their conversation's KV for the next turn (bidirectional_kv_xfer)."""
        return self.config.bidirectional_kv_xfer and self.producer is not None

    @property
    def peer_pin_max_leases(self) -> int:
        """Cached prefixes pinned for peers at once (0: this instance pins none). Needs bidirectional_kv_xfer."""
        return self.config.peer_pin_max_leases if self.keeps_history else 0

    @property
    def peer_pin_ttl_s(self) -> float:
        return self.config.peer_pin_ttl_s

    @property
    def kv_recompute_threshold(self) -> int:
        """A peer's prefix shorter than this many tokens is recomputed instead of read (vLLM's default 64)."""
        return self.config.kv_recompute_threshold

    def record_prefix_pull(self, outcome: str, tokens: int = 0) -> None:
        self.metrics.record_prefix_pull(outcome, tokens)

    def num_leases(self) -> int:
        return len(self.producer.leases) if self.producer is not None else 0
