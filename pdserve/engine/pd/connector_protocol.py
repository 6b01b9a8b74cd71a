"""What the engine needs from a KV connector (`pdserve.kv_transfer.KVConnector` implements it).

Typed here, on the engine's side, so that the engine never imports the transfer stack (NIXL, the side
channel) and a test can check the real connector against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable


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


@runtime_checkable
class KVConnectorProtocol(Protocol):
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

    # ---- consumer ----
    def validate(self, params: Any) -> object:
        """Raise ValueError naming what is wrong with a decode request's kv_transfer_params."""
        ...

    def add_waiting(self, request_id: str, params: Any) -> None: ...

    def remove_waiting(self, request_id: str) -> None: ...

    def start_load(self, request_id: str, params: Any, local_block_ids: Sequence[int], first_block: int = 0,
                   num_tokens: int | None = None) -> None:
        """Start reading into local_block_ids[first_block:]; the outcome comes from `poll_loads`."""
        ...

    def poll_loads(self) -> Sequence[LoadOutcome]: ...

    def poll_claimed(self) -> Sequence[str]:
        """Request ids whose lease the producer granted since the last call (their READ may still be running):
        their params can no longer be refused, so an adopted first token can go out."""
        ...

    def set_notify(self, callback: Callable[[], None] | None) -> None:
        """`callback` (any thread) whenever `poll_claimed` or `poll_loads` has something: the engine wakes."""
        ...

    # ---- producer ----
    def hold(self, request_id: str, block_ids: Sequence[int], num_tokens: int,
             num_cached_tokens: int = 0, params: Any = None) -> dict[str, Any]:
        """Lease the blocks; returns the response's kv_transfer_params (`params`: the request's own, which
        say whether the KV is pushed)."""
        ...

    def send_ended(self, request_id: str) -> None:
        """A prefill leg ended without holding its KV (aborted, failed)."""
        ...

    def cancel_load(self, request_id: str) -> None:
        """The request was aborted while its load runs."""
        ...

    def poll_released(self) -> list[str]:
        """Request ids whose lease ended: their blocks can be freed now."""
        ...

    # ---- multi-turn (bidirectional_kv_xfer) ----
    @property
    def keeps_history(self) -> bool:
        """Decode legs keep their conversation's blocks for the next turn's prefill."""
        ...

    @property
    def kv_recompute_threshold(self) -> int:
        """A peer's prefix with fewer tokens left to read than this is recomputed instead."""
        ...

    def hold_history(self, lease_id: str, block_ids: Sequence[int], num_tokens: int,
                     block_hashes: Sequence[str], duration_s: float | None = None) -> dict[str, Any]:
        """Lease a finished decode leg's full blocks; returns the response's kv_transfer_params."""
        ...

    def evict_history(self, lease_id: str) -> bool:
        """Free a held history now (the engine needs its blocks); False while it is being read."""
        ...

    def decline(self, params: Any) -> None:
        """A peer's lease this instance will not read: let the peer free it now."""
        ...

    def record_prefix_pull(self, outcome: str, tokens: int = 0) -> None: ...

    def shutdown(self) -> None: ...
