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
    # read once by the server's route; to the engine an opaque payload for its extension (the P/D half)
    kv_transfer_params: KVTransferParams | None = None


@dataclass(frozen=True, slots=True)
class DeliverParams:
    """The prefill's params for a decode leg sent before them: a command of the engine's extension
    (`LLMEngine.call_extension` -> `EnginePD.deliver_params`)."""

    key: str
    kv_transfer_params: KVTransferParams


@dataclass(frozen=True, slots=True)
class PinPrefix:
    """A cached prefix held for a peer's prefill, the future has its params: a command of the engine's extension
    (`LLMEngine.call_extension` -> `EnginePD.pin_cached_prefix`)."""

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
    schedulable: bool  # the scheduler has requests to run (not only work in flight elsewhere)
    background: bool  # steps are wanted even with no request (the extension polls: a KV connector's side channel)
    idle_poll: bool  # between requests, something a step takes in may come (held leases end, reads end): 10 ms
    polled: bool  # work in flight that steps poll (remote reads, disk-tier reads): poll at 1 ms
