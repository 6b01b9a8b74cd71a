"""What the engine needs from a KV connector (`pdserve.kv_transfer.KVConnector` implements it).

Typed here, on the engine's side, so that the engine never imports the transfer stack (NIXL, the side
channel) and a test can check the real connector against it.

Split by role: the connector exposes its `consumer` (decode legs and held prefixes: loads) and `producer`
(prefill legs and held histories: leases) and the engine calls each role directly. One flat protocol would
make the connector re-declare every role method only to pass it through; a role is already the engine's API.
The params cross this seam typed (`pdserve.api.pd`), parsed once: the request's `KVTransferParams` go to a
role's `parse`, and what it returns (`LoadParams`, `PushParams`) is what the other calls take; the producer
answers `HeldKVParams`, serialised to the wire (`to_json`) where the response is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from pdserve.api.pd import FirstToken, HeldKVParams, KVTransferParams, LoadParams, PushParams


class LoadOutcome(Protocol):
    """How one `start_load` ended."""

    @property
    def request_id(self) -> str: ...

    @property
    def ok(self) -> bool: ...

    @property
    def error(self) -> str | None: ...

    @property
    def rejected(self) -> str | None:
        """Why the producer refused the lease the params name (a client error), or None."""
        ...


class KVConsumerRole(Protocol):
    """Requests with `do_remote_prefill` (or naming a peer's held prefix) read their prompt's KV."""

    def parse(self, params: KVTransferParams) -> LoadParams:
        """The load the params name, parsed once; raises ValueError (InvalidKVTransferParams) naming what is
        wrong (a 400)."""
        ...

    def add_waiting(self, request_id: str, params: LoadParams) -> None: ...

    def remove_waiting(self, request_id: str) -> None: ...

    def start_load(self, request_id: str, params: LoadParams, local_block_ids: Sequence[int], first_block: int = 0,
                   num_tokens: int | None = None) -> None:
        """Start reading into local_block_ids[first_block:]; the outcome comes from `poll_loads`."""
        ...

    def cancel_load(self, request_id: str) -> None:
        """The request was aborted while its load runs."""
        ...

    def decline(self, params: LoadParams) -> None:
        """A peer's lease this instance will not read: let the peer free it now."""
        ...

    def poll_loads(self) -> Sequence[LoadOutcome]: ...

    def poll_claimed(self) -> Sequence[str]:
        """Request ids whose lease the producer granted since the last call (their READ may still be running):
        their params can no longer be refused, so an adopted first token can go out."""
        ...

    def set_notify(self, callback: Callable[[], None] | None) -> None:
        """`callback` (any thread) whenever `poll_claimed` or `poll_loads` has something: the engine wakes."""
        ...


class KVProducerRole(Protocol):
    """Requests with `do_remote_decode` keep their blocks for a consumer; decode legs keep their conversation."""

    def parse_prefill_leg(self, params: KVTransferParams) -> PushParams | None:
        """A push-mode prefill leg's pairing key (None: the KV is held for a READ); ValueError when malformed."""
        ...

    def hold(self, request_id: str, block_ids: Sequence[int], num_tokens: int, num_cached_tokens: int = 0,
             push: PushParams | None = None, first_token: FirstToken | None = None) -> HeldKVParams:
        """Lease the blocks (or push them: `push`); returns the response's kv_transfer_params, which carry
        `first_token` (a push also sends it with its completion)."""
        ...

    def send_ended(self, request_id: str) -> None:
        """A prefill leg ended without holding its KV (aborted, failed)."""
        ...

    def poll_released(self) -> list[str]:
        """Request ids whose lease ended: their blocks can be freed now."""
        ...

    def hold_history(self, lease_id: str, block_ids: Sequence[int], num_tokens: int,
                     block_hashes: Sequence[str], duration_s: float | None = None) -> HeldKVParams:
        """Lease a finished decode leg's full blocks; returns the response's kv_transfer_params."""
        ...

    def evict_history(self, lease_id: str) -> bool:
        """Free a held history now (the engine needs its blocks); False while it is being read."""
        ...


@runtime_checkable
class KVConnectorProtocol(Protocol):
    consumer: KVConsumerRole | None  # None: this instance loads no remote KV (kv_producer)
    producer: KVProducerRole | None  # None: this instance holds no KV for others (kv_consumer)

    @property
    def can_load(self) -> bool:
        """Consumer role: requests with `do_remote_prefill` read their prompt's KV from a producer."""
        ...

    @property
    def can_send(self) -> bool:
        """Producer role: requests with `do_remote_decode` keep their blocks for a consumer."""
        ...

    @property
    def load_failure_policy(self) -> str:
        """'fail' (the request ends with an error) or 'recompute' (local prefill instead)."""
        ...

    # ---- multi-turn (bidirectional_kv_xfer) and peer pins: both roles ----
    @property
    def keeps_history(self) -> bool:
        """Decode legs keep their conversation's blocks for the next turn's prefill."""
        ...

    @property
    def kv_recompute_threshold(self) -> int:
        """A peer's prefix with fewer tokens left to read than this is recomputed instead, unless its params carry
        the pricing proxy's own minimum (`pdserve.api.pd.MIN_READ_TOKENS`), which applies then."""
        ...

    @property
    def peer_pin_max_leases(self) -> int:
        """Cached prefixes pinned for peers at once (0: none)."""
        ...

    @property
    def peer_pin_ttl_s(self) -> float: ...

    def record_prefix_pull(self, outcome: str, tokens: int = 0) -> None: ...

    def step_hook(self, batch: Sequence[tuple[Any, int]]) -> Callable[[int], None] | None:
        """Layer-pipelined push: the callback the model calls after each layer of a step (None: none)."""
        ...

    def shutdown(self) -> None: ...
