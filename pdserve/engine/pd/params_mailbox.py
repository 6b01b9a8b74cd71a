"""Decode legs sent before their prefill finished (pdserve/api/pd.py `early_decode_params`): where such a
request waits for its `kv_transfer_params`, and where params that arrive before their leg wait for it.

A proxy that sends the decode leg while the prefill leg runs overlaps the decode leg's HTTP, parsing,
validation and admission with the prefill; the params follow on `POST /pdserve/v1/kv_params` once the
prefill answered. Either may reach the engine first (they are two HTTP requests), so both sides wait here,
under the key the proxy chose. Both waits are bounded: a leg whose params never come ends with an error
(normally the proxy closes the leg first, which aborts it), and params nobody picks up are dropped.

A waiting leg's state is its `Request.kv` (AWAITING_PARAMS, under `kv.params_key`; since its arrival): the
mailbox's own map of legs is that state's index by key, moved together with it, here only.

Engine-thread only (no locking): the engine's P/D half (`admission.py`) calls it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.api.pd import KVTransferParams

if TYPE_CHECKING:
    from pdserve.engine.request import Request

# How long a decode leg waits for its params: longer than any prefill leg (a 128k-token prompt on a busy
# prefill instance), short enough that a proxy gone without closing the leg does not pin the request for ever.
PARAMS_WAIT_S = 600.0
# How long params that came before their decode leg are kept for it (the legs are sent together, so the
# gap is the decode leg's own HTTP and parsing time), and how many at most.
EARLY_PARAMS_KEEP_S = 60.0
MAX_EARLY_PARAMS = 4096


class ParamsMailbox:
    def __init__(self) -> None:
        self._awaiting: dict[str, Request] = {}  # key -> the leg waiting under it (kv AWAITING_PARAMS)
        self._early: dict[str, tuple[KVTransferParams, float]] = {}  # key -> (params, since)

    def __len__(self) -> int:
        return len(self._awaiting)

    def take_early(self, key: str) -> KVTransferParams | None:
        """The params already delivered under `key` (then the leg proceeds at once), else None."""
        item = self._early.pop(key, None)
        return None if item is None else item[0]

    def wait(self, key: str, req: Request) -> None:
        """The decode leg `req` waits for the params delivered under `key`; raises ValueError when another
        leg waits under the same key."""
        if key in self._awaiting:
            raise ValueError(f"another decode leg already waits for the params keyed {key!r}")
        req.kv.await_params(key)
        self._awaiting[key] = req

    def deliver(self, key: str, params: KVTransferParams) -> Request | None:
        """The leg waiting under `key` (no longer indexed here: the caller gives it its params), or None:
        then the params are kept for a leg still to come (ValueError when too many are kept already, or
        params came twice for one key)."""
        req = self._awaiting.pop(key, None)
        if req is not None:
            return req
        self._expire_early()
        if key in self._early:
            raise ValueError(f"params keyed {key!r} were already delivered")
        if len(self._early) >= MAX_EARLY_PARAMS:
            raise ValueError(f"{MAX_EARLY_PARAMS} params wait for their decode legs already")
        self._early[key] = (params, time.monotonic())
        return None

    def forget(self, req: Request) -> None:
        """The request is gone (aborted) while waiting."""
        key = req.kv.params_key
        if req.kv.awaiting_params and key is not None and self._awaiting.get(key) is req:
            del self._awaiting[key]
            req.kv.stop_awaiting()

    def expired(self) -> list[Request]:
        """Legs that waited longer than PARAMS_WAIT_S since they arrived (no longer indexed here); also drops
        stale early params."""
        self._expire_early()
        if not self._awaiting:
            return []
        cutoff = time.monotonic() - PARAMS_WAIT_S
        gone = [self._awaiting.pop(key) for key, req in list(self._awaiting.items()) if req.arrival_time < cutoff]
        for req in gone:
            req.kv.stop_awaiting()
        return gone

    def _expire_early(self) -> None:
        if self._early:
            cutoff = time.monotonic() - EARLY_PARAMS_KEEP_S
            for key in [k for k, (_, since) in self._early.items() if since < cutoff]:
                del self._early[key]
