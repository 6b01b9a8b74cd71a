"""What an engine extension (engine/extension.py) asks the step loop to do, all that the loop's one `match`
(`LLMEngine._apply`) knows: the loop owns the scheduler's queues and a request's end; the extension (the P/D half,
engine/pd/) moves its own state (`Request.kv`) and talks to what it drives (the KV connector)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.types.sampling_params import ParamError

if TYPE_CHECKING:
    from pdserve.engine.request import Request
    from pdserve.types.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class _RequestEvent:
    req: Request


class Schedule(_RequestEvent):
    """Admitted: the request joins the scheduler's waiting queue (a remote load is allocated from there)."""

    __slots__ = ()


class FirstTokenAdopted(_RequestEvent):
    """The producer's first token is the request's output 0: a seeded sampler skips the draw it replaces."""

    __slots__ = ()


class Emit(_RequestEvent):
    """The adopted first token goes out now (the producer granted the lease, or the load ended)."""

    __slots__ = ()


class Finish(_RequestEvent):
    """The request ends here, its KV not kept (finish_reason, error and status already set on it)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class LoadEnded(_RequestEvent):
    """The remote read ended, its blocks are the request's again (`Scheduler.end_load`). resume: it runs
    (loaded, or recomputing its prompt here); otherwise a `Finish` for it follows."""

    ok: bool
    resume: bool


@dataclass(frozen=True, slots=True)
class ParamsRefused(_RequestEvent):
    """Params delivered for a waiting decode leg were refused: it ends (as `Finish`) and the delivery is
    answered with `error` (a 400), which the leg's own response repeats."""

    error: ParamError


EngineEvent = Schedule | FirstTokenAdopted | LoadEnded | Emit | Finish | ParamsRefused


class DeliveryRefused(ParamError):
    """What a `ParamsRefused` makes the loop raise to the delivery's caller: the params were refused (a 400), and
    the waiting leg ended with `outputs` (its own response repeats the 400)."""

    def __init__(self, message: str, outputs: list[RequestOutput]):
        super().__init__(message, "kv_transfer_params")
        self.outputs = outputs
