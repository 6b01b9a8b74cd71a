"""What the engine's P/D half asks the engine loop to do: it moves `Request.kv` and talks to the connector,
the loop owns the scheduler's queues and a request's end (`LLMEngine._apply` applies these, in order)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.request import Request
    from pdserve.types.sampling_params import ParamError


@dataclass(frozen=True, slots=True)
class Schedule:
    """Admitted: the request joins the scheduler's waiting queue (a remote load is allocated from there)."""

    req: Request


@dataclass(frozen=True, slots=True)
class FirstTokenAdopted:
    """The producer's first token is the request's output 0: a seeded sampler skips the draw it replaces."""

    req: Request


@dataclass(frozen=True, slots=True)
class LoadEnded:
    """The remote read ended, its blocks are the request's again (`Scheduler.end_load`). resume: it runs
    (loaded, or recomputing its prompt here); otherwise a `Finish` for it follows."""

    req: Request
    ok: bool
    resume: bool


@dataclass(frozen=True, slots=True)
class Emit:
    """The adopted first token goes out now (the producer granted the lease, or the load ended)."""

    req: Request


@dataclass(frozen=True, slots=True)
class Finish:
    """The request ends here, its KV not kept (finish_reason, error and status already set on it)."""

    req: Request


@dataclass(frozen=True, slots=True)
class ParamsRefused:
    """Params delivered for a waiting decode leg were refused: it ends (as `Finish`) and the delivery is
    answered with `error` (a 400), which the leg's own response repeats."""

    req: Request
    error: ParamError


PDEvent = Schedule | FirstTokenAdopted | LoadEnded | Emit | Finish | ParamsRefused
