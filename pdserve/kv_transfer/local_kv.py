"""`LocalKV`: this instance's side of every transfer, built once by the connector and shared by the roles and
transfers over it (the pull reader, the push receiver): the config, the NIXL agent and pool shard of each
tensor-parallel rank, the compatibility dict a handshake compares, the metrics, and the side channel's message
auth. One object instead of the same seven arguments and assignments in every role."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.auth import MessageAuth
from pdserve.kv_transfer.compat import Compat
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.kv_transfer.messages import R, Request
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.nixl_agent import NixlAgent, RankAgent, WorkerRankAgent
from pdserve.kv_transfer.pool import PoolRegion


@dataclass(frozen=True)
class LocalKV:
    config: KVTransferConfig
    agent: NixlAgent  # rank 0's
    region: PoolRegion  # rank 0's pool shard
    compat: Compat
    metrics: TransferMetrics
    auth: MessageAuth | None = None
    # (agent, region) of every tensor-parallel rank, rank 0 (`agent`, `region`) first; the agents of ranks
    # 1..N-1 are handles into their processes (kv_rank.py) with NixlAgent's methods. Empty: rank 0 alone.
    ranks: Sequence[tuple[RankAgent, PoolRegion]] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "compat", dict(self.compat))
        object.__setattr__(self, "ranks", tuple(self.ranks) or ((self.agent, self.region),))

    @property
    def block_size(self) -> int:
        return int(self.compat["block_size"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.compat["num_kv_heads"])

    @property
    def worker_agents(self) -> list[WorkerRankAgent]:
        """Ranks 1..N-1's agents: they progress in their own processes (fast on demand: `boost`)."""
        return cast("list[WorkerRankAgent]", [a for a, _ in self.ranks[1:]])

    def call(self, host: str, port: int, engine_id: str, request: Request[R], timeout_s: float) -> R:
        """One side-channel request to the producer `engine_id` at host:port, signed with this instance's
        auth (side_channel.call)."""
        return side_channel.call(host, port, request, timeout_s, to=engine_id, auth=self.auth)
