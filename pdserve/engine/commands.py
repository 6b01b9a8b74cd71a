"""What the asyncio side (`AsyncEngine`) asks of the engine thread: one frozen dataclass per command, as the
tensor-parallel rank calls are (`pdserve.parallel.rank_rpc`), put on the thread's queue with the future that
answers it; the thread runs each by its type (`AsyncEngine._run`). And `LoopState`: what the thread's loop reads
of the engine to decide whether to step and how long to sleep, one snapshot (`LLMEngine.loop_state`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.api.pd import KVTransferParams
    from pdserve.types.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class AddRequest:
    """`LLMEngine.add_request`: a request in; its future raises the engine's validation error, if any."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: KVTransferParams | None = None  # read once by the server's route


@dataclass(frozen=True, slots=True)
class DeliverParams:
    """`LLMEngine.deliver_params`: the prefill's params for a decode leg sent before them."""

    key: str
    kv_transfer_params: KVTransferParams


@dataclass(frozen=True, slots=True)
class PinPrefix:
    """`LLMEngine.pin_cached_prefix`: a cached prefix held for a peer's prefill; the future has its params."""

    token_ids: list[int]
    min_tokens: int


@dataclass(frozen=True, slots=True)
class Abort:
    """`LLMEngine.abort_request` (no answer: a client gone, a stop string)."""

    request_id: str


EngineCommand = AddRequest | DeliverParams | PinPrefix | Abort


@dataclass(frozen=True, slots=True)
class LoopState:
    """The engine as the engine thread's loop sees it, read at once."""

    num_queued: int  # requests waiting to be scheduled (the server's queue bound counts them)
    unfinished: bool  # requests in the engine, or a step launched ahead still to be taken in
    num_held: int  # finished requests whose blocks are held for a peer (their leases are reaped by steps)
    num_loading: int  # remote reads in flight
    connector: bool  # a KV connector, whose side channel a step polls even with no request
    schedulable: bool  # the scheduler has requests to run (not only loads or parked reads)
    parked_reads: bool  # disk-tier reads in flight (KV offload)
