"""One request's part in a prefill/decode handoff, held in one place: `Request.kv`, one state machine
(`KVState`). Every other structure that lists requests by P/D state is an index of it, kept by the one
module that moves the state: the params mailbox (AWAITING_PARAMS, `params_mailbox.py`), the scheduler's
`loading` (LOADING, `engine/scheduler.py`), the held leases and histories (HELD, HISTORY, `holds.py`).

Decode side (the request names a producer's KV in `kv_transfer_params.do_remote_prefill`):

    NONE      no remote KV: a plain request (also: no connector, or an instance that cannot load)
    AWAITING_PARAMS  a decode leg sent before its prefill finished (`pdserve.api.pd.early_decode_params`):
              tracked by the engine, not scheduled, until its params are delivered under `params_key`
              (then it starts again from the delivered params; ended without them: NONE)
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
consumer instead of being freed: HELD, until the lease ends (RELEASED: the blocks are back in the pool).

Multi-turn (vLLM's `bidirectional_kv_xfer`): on such an instance a decode leg (`do_remote_prefill`) ends with
`keep_history`: its full blocks (prompt and answer) are held for the next turn's prefill instead of being
freed (HISTORY, until evicted or its lease ends: RELEASED; a cached prefix pinned for a peer is one too). That
prefill's params name them (`pdserve.api.pd.KVTransferParams.prefix`): the same load state machine reads only a
PREFIX of its prompt (`prefix_tokens`, the leading blocks whose hashes match its own prompt's) and the rest is
computed here as any prompt is. A prefix that is gone (expired, evicted, a dead holder refused) is recomputed,
never the client's error; `drop_load` (WAITING -> NONE) is a prefix not worth reading once the local prefix
cache is known (it covers it, or what is left is under the params' `min_read_tokens`, else the instance's
`kv_recompute_threshold`).

First token (pdserve producers, pdserve/api/pd.py `first_token_fields`): a decode request that adopted the
producer's sampled first token (`first_token`) loads the KV of the whole prompt and starts from that token;
without it (a vLLM producer, or a token it cannot adopt) it loads all but the last prompt token and
recomputes that one for the first token's logits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.api.pd import FirstToken, KVTransferParams, LoadParams, PushParams


class KVState(enum.Enum):
    NONE = "none"
    AWAITING_PARAMS = "awaiting_params"
    WAITING = "waiting"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"
    HELD = "held"
    HISTORY = "history"
    RELEASED = "released"


# the states a finished request's blocks may be kept from (HELD, HISTORY): whatever its load did
_ENDED_LOAD = (KVState.NONE, KVState.LOADED, KVState.FAILED)


class HandoffStateError(RuntimeError):
    """An impossible P/D transition: an engine bug, never a client mistake."""


@dataclass
class KVHandoff:
    remote: LoadParams | None = None  # consumer: what the load reads, parsed once (set at admission)
    push: PushParams | None = None  # producer, push mode: the prefill leg's pairing key (set at admission)
    state: KVState = KVState.NONE
    send: bool = False  # producer: on finishing, hold the blocks for a consumer instead of freeing them
    abort_requested: bool = False  # aborted while LOADING: finish once the read has ended
    rejection: str | None = None  # FAILED because the producer refused the lease the params name (why)
    first_token: FirstToken | None = None  # consumer: the producer's first token, adopted as output 0
    first_token_sent: bool = False  # that token went out (the lease was granted, or the load ended)
    keep_history: bool = False  # decode leg, bidirectional instance: hold prompt + answer for the next turn
    prefix: bool = False  # the params name a peer's held prefix of the prompt (not a decode leg's whole prompt)
    prefix_tokens: int | None = None  # a prefix load: how many leading prompt tokens it reads (whole blocks)
    # fewer tokens left to read are recomputed instead: the proxy's min_read_tokens, else kv_recompute_threshold
    prefix_min_tokens: int = 0
    params_key: str | None = None  # AWAITING_PARAMS: the key its params are delivered under

    def remote_tokens(self, num_prompt_tokens: int) -> int:
        """Prompt tokens whose KV the load brings: a prefix load's `prefix_tokens`; all of them when the first
        token was adopted, else all but the last (recomputed here for the first token's logits)."""
        if self.prefix_tokens is not None:
            return self.prefix_tokens
        return num_prompt_tokens if self.first_token is not None else num_prompt_tokens - 1

    def load_tokens(self, num_prompt_tokens: int) -> int:
        """Prompt tokens the load asks the producer for: `remote_tokens`, except that a push decode leg that
        may adopt the first token its push's completion brings has the whole prompt written (the prefill
        computed it all); declined at completion, the last token is recomputed here into its own slot."""
        remote = self.remote
        if isinstance(remote, PushParams) and remote.adopt_first_token and self.prefix_tokens is None:
            return num_prompt_tokens
        return self.remote_tokens(num_prompt_tokens)

    @classmethod
    def from_params(cls, params: KVTransferParams | None, *, can_load: bool, can_send: bool,
                    keeps_history: bool = False) -> KVHandoff:
        """What the request's params (read at the edge) ask of this instance. A role this instance cannot play is
        ignored (plain local prefill / plain finish), as vLLM does without a connector. `keeps_history`: the
        instance keeps decode legs' conversations (bidirectional_kv_xfer). The params themselves are parsed
        once admission knows the role applies (`remote`, `push`)."""
        p = params or KVTransferParams()
        prefix = can_load and p.prefix
        state = KVState.WAITING if can_load and (p.remote_prefill or prefix) else KVState.NONE
        keep = keeps_history and can_send and p.remote_prefill
        return cls(state=state, send=can_send and p.remote_decode, keep_history=keep, prefix=prefix)

    @property
    def needs_load(self) -> bool:
        """The scheduler must allocate the prompt's blocks and start the (one) remote read."""
        return self.state is KVState.WAITING

    @property
    def loading(self) -> bool:
        return self.state is KVState.LOADING

    @property
    def awaiting_params(self) -> bool:
        return self.state is KVState.AWAITING_PARAMS

    def _move(self, expected: KVState | tuple[KVState, ...], to: KVState) -> None:
        ok = self.state in expected if isinstance(expected, tuple) else self.state is expected
        if not ok:
            names = "/".join(e.value for e in expected) if isinstance(expected, tuple) else expected.value
            raise HandoffStateError(f"KV handoff: {self.state.value} -> {to.value} (expected {names})")
        self.state = to

    def await_params(self, key: str) -> None:
        """A decode leg whose params come later: it waits for them under `key`."""
        self._move(KVState.WAITING, KVState.AWAITING_PARAMS)
        self.params_key = key

    def stop_awaiting(self) -> None:
        """A leg that waited for its params ended without them (aborted, or they never came)."""
        self._move(KVState.AWAITING_PARAMS, KVState.NONE)
        self.params_key = None

    def drop_load(self) -> None:
        """A prefix not worth reading (known at admission): the request computes its prompt as a plain one."""
        self._move(KVState.WAITING, KVState.NONE)

    def begin_load(self) -> None:
        self._move(KVState.WAITING, KVState.LOADING)

    def end_load(self, ok: bool) -> None:
        self._move(KVState.LOADING, KVState.LOADED if ok else KVState.FAILED)

    def request_abort(self) -> None:
        if not self.loading:
            raise HandoffStateError(f"KV handoff: abort deferred in state {self.state.value}")
        self.abort_requested = True

    def hold(self) -> None:
        """Finished prefill leg: its blocks are leased to a consumer."""
        self._move(_ENDED_LOAD, KVState.HELD)

    def keep_as_history(self) -> None:
        """Finished decode leg (or a pinned prefix): its full blocks are held for a later prefill."""
        self._move(_ENDED_LOAD, KVState.HISTORY)

    def release(self) -> None:
        """The lease (or the history) ended: the blocks go back to the pool."""
        self._move((KVState.HELD, KVState.HISTORY), KVState.RELEASED)
