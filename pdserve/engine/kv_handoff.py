"""One request's part in a prefill/decode handoff, held in one place: `Request.kv`.

Decode side (the request names a producer's KV in `kv_transfer_params.do_remote_prefill`):

    NONE      no remote KV: a plain request (also: no connector, or an instance that cannot load)
    WAITING   admitted, no local blocks yet; the connector heartbeats the producer's lease
    LOADING   blocks allocated and the NIXL read in flight: the blocks belong to the transfer, so the
              request is never preempted, and an abort only marks it (freed when the read ends)
    LOADED    the prompt's KV (all but the last token) landed in the local blocks; the lease is consumed
    FAILED    the read failed; the request recomputes locally or finishes with an error (policy)

WAITING -> LOADING happens exactly once per request: after it the producer's lease is gone, so whatever
happens later (preemption, re-admission) is local recompute, helped by the local prefix cache. vLLM does
the same by clearing `do_remote_prefill` once a load is scheduled ("Only trigger 1 KV transfer per
request", NixlConnectorScheduler.update_state_after_alloc). Transitions outside this diagram raise:
a bug in the step loop surfaces at once, with its traceback, instead of as a confused transfer.

Producer side (`do_remote_decode`): `send` says the finished request's blocks are held under a lease for a
consumer instead of being freed.

First token (pdserve producers, pdserve/api/pd.py `first_token_fields`): a decode request that adopted the
producer's sampled first token (`first_token`) loads the KV of the whole prompt and starts from that token;
without it (a vLLM producer, or a token it cannot adopt) it loads all but the last prompt token and
recomputes that one for the first token's logits.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.api.pd import FirstToken


class LoadState(enum.Enum):
    NONE = "none"
    WAITING = "waiting"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"


class HandoffStateError(RuntimeError):
    """An impossible P/D transition: an engine bug, never a client mistake."""


@dataclass
class KVHandoff:
    params: Mapping[str, Any] | None = None  # the request's kv_transfer_params, as the client sent them
    load: LoadState = LoadState.NONE
    send: bool = False  # producer: on finishing, hold the blocks for a consumer instead of freeing them
    abort_requested: bool = False  # aborted while LOADING: finish once the read has ended
    rejection: str | None = None  # FAILED because the producer refused the lease the params name (why)
    first_token: FirstToken | None = None  # consumer: the producer's first token, adopted as output 0

    def remote_tokens(self, num_prompt_tokens: int) -> int:
        """Prompt tokens whose KV the load brings: all of them when the first token was adopted, else all
        but the last (recomputed here for the first token's logits)."""
        return num_prompt_tokens if self.first_token is not None else num_prompt_tokens - 1

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None, *, can_load: bool, can_send: bool) -> KVHandoff:
        """Read `kv_transfer_params` once, when the request is added. A role this instance cannot play is
        ignored (plain local prefill / plain finish), as vLLM does without a connector."""
        p = params or {}
        load = LoadState.WAITING if can_load and p.get("do_remote_prefill") else LoadState.NONE
        return cls(params=params, load=load, send=can_send and bool(p.get("do_remote_decode")))

    @property
    def needs_load(self) -> bool:
        """The scheduler must allocate the prompt's blocks and start the (one) remote read."""
        return self.load is LoadState.WAITING

    @property
    def loading(self) -> bool:
        return self.load is LoadState.LOADING

    def _move(self, expected: LoadState, to: LoadState) -> None:
        if self.load is not expected:
            raise HandoffStateError(f"KV handoff: {self.load.value} -> {to.value} (expected {expected.value})")
        self.load = to

    def begin_load(self) -> None:
        self._move(LoadState.WAITING, LoadState.LOADING)

    def end_load(self, ok: bool) -> None:
        self._move(LoadState.LOADING, LoadState.LOADED if ok else LoadState.FAILED)

    def request_abort(self) -> None:
        if not self.loading:
            raise HandoffStateError(f"KV handoff: abort deferred in state {self.load.value}")
        self.abort_requested = True
