"""The engine's P/D seams (pdserve/engine/pd/connector_protocol.py) on the simulated clock, so that the engine's
own `Holds` (a prefill leg's blocks held for its decode instance; a decode leg's conversation held for the next
turn, `decoder_kv_blocks_ttl`, evicted oldest first when the pool runs short) and `Admission` (a held prefix
matched block by block against the prompt, under `kv_recompute_threshold`) run unchanged in a simulated instance.

Nothing moves bytes here and no lease has a token worth checking: the cluster (cluster.py) schedules the claims,
READs and WRITEs on the links and ends the leases (`Holds.released`) when they are read, expire or are evicted.
What the producer answers is the real `HeldKVParams`, so the proxy's conversation map and history decision read
the params a real decode instance returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.pd import FirstToken, HeldKVParams, KVTransferParams, LoadParams, PushParams

SIM_HOST = "sim"  # what the params name as a side channel (the cluster finds the holder by its engine id)
SIM_LEASE_TOKEN = "sim-lease"


@dataclass
class HistoryLease:
    """A held conversation (or pinned prefix) on one instance: being read, it cannot be evicted."""

    lease_id: str
    expires_at: float
    reading: bool = False


class SimProducer:
    """KVProducerRole: leases issued at the simulated clock's time, their params in the real wire shape."""

    def __init__(self, engine_id: str, clock: Callable[[], float], *, ttl_s: float, block_bytes: int,
                 tp_size: int = 1, push: bool = False,
                 on_history: Callable[[HistoryLease], None] = lambda lease: None) -> None:
        self.engine_id = engine_id
        self.clock = clock
        self.ttl_s = ttl_s
        self.block_bytes = block_bytes  # one block on the wire, all ranks (BLOCK_BYTES)
        self.tp_size = tp_size
        self.push = push
        self.on_history = on_history  # the cluster schedules the lease's expiry
        self.history: dict[str, HistoryLease] = {}

    def _params(self, request_id: str, block_ids: Sequence[int], num_tokens: int, **kw: Any) -> HeldKVParams:
        return HeldKVParams(request_id=request_id, block_ids=tuple(block_ids), num_tokens=num_tokens,
                            engine_id=self.engine_id, host=SIM_HOST, port=1, generation=0,
                            lease_token=SIM_LEASE_TOKEN, tp_size=self.tp_size, **kw)

    def parse_prefill_leg(self, params: KVTransferParams) -> PushParams | None:
        return params.parse_push_prefill() if self.push else None

    def hold(self, request_id: str, block_ids: Sequence[int], num_tokens: int, num_cached_tokens: int = 0,
             push: PushParams | None = None, first_token: FirstToken | None = None) -> HeldKVParams:
        return self._params(request_id, block_ids, num_tokens, expires_at=self.clock() + self.ttl_s,
                            num_cached_tokens=num_cached_tokens, push=push is not None, first_token=first_token)

    def send_ended(self, request_id: str) -> None:
        pass

    def poll_released(self) -> list[str]:
        return []  # the cluster ends leases itself (Holds.released), at the instant they end

    def hold_history(self, lease_id: str, block_ids: Sequence[int], num_tokens: int, block_hashes: Sequence[str],
                     duration_s: float | None = None) -> HeldKVParams:
        expires = self.clock() + (self.ttl_s if duration_s is None else duration_s)
        lease = self.history[lease_id] = HistoryLease(lease_id, expires)
        self.on_history(lease)
        return self._params(lease_id, block_ids, num_tokens, expires_at=expires, history=True,
                            block_hashes=tuple(block_hashes), block_bytes=self.block_bytes)

    def evict_history(self, lease_id: str) -> bool:
        lease = self.history.get(lease_id)
        if lease is not None and lease.reading:
            return False
        self.history.pop(lease_id, None)
        return True


class SimConsumer:
    """KVConsumerRole as Admission calls it: the params parsed as the real consumer parses them; a declined
    held prefix handed to the cluster (its holder frees the lease). The loads themselves are the cluster's."""

    def __init__(self, on_decline: Callable[[LoadParams], None]) -> None:
        self.on_decline = on_decline

    def parse(self, params: KVTransferParams) -> LoadParams:
        return params.parse_load(push=False)

    def add_waiting(self, request_id: str, params: LoadParams) -> None:
        pass

    def remove_waiting(self, request_id: str) -> None:
        pass

    def decline(self, params: LoadParams) -> None:
        self.on_decline(params)


@dataclass
class SimConnector:
    """KVConnectorProtocol's settings side: the roles, and vLLM's bidirectional_kv_xfer knobs."""

    producer: SimProducer
    consumer: SimConsumer
    keeps_history: bool = False
    kv_recompute_threshold: int = 64
    load_failure_policy: str = "recompute"
    peer_pin_max_leases: int = 0  # peer pins are not simulated (ARCHITECTURE.md, "Simulator and profiles")
    peer_pin_ttl_s: float = 10.0
    prefix_pulls: dict[str, int] = field(default_factory=dict)

    @property
    def can_load(self) -> bool:
        return True

    @property
    def can_send(self) -> bool:
        return True

    def record_prefix_pull(self, outcome: str, tokens: int = 0) -> None:
        self.prefix_pulls[outcome] = self.prefix_pulls.get(outcome, 0) + 1

    def step_hook(self, batch: Sequence[tuple[Any, int]]) -> None:
        return None

    def shutdown(self) -> None:
        pass
