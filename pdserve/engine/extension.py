"""The step loop's one seam for what it does not know itself: an engine extension is told of each request's
life (added, aborted, finished, emitting) and of each step (its start, before and after scheduling), and answers
with events that the loop applies to its own queues and outputs (`LLMEngine._apply`, its one `match`).

The engine's P/D half (`pdserve.engine.pd.EnginePD`) is the extension a server installs; an engine built without
one runs `NoExtension`. The engine passes each request's payload (what its caller attached, e.g. a server's typed
`kv_transfer_params`) to `on_added` untouched, and its extension's own commands (`call`) through; it never reads
either. It owns each request's blocks: they are freed at the request's end unless the extension keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdserve.engine.events import Schedule

if TYPE_CHECKING:
    from pdserve.engine.events import EngineEvent
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler import SchedulerOutput
    from pdserve.engine.stats import EngineStats
    from pdserve.types.outputs import RequestOutput

    Event = EngineEvent  # what an extension may ask of the loop (engine/events.py)

# Per step: for the step's batch, a callback the model calls after each of its layers (None: none this step).
LayerHook = Callable[[list], Callable[[int], None] | None]


@dataclass(frozen=True, slots=True)
class Background:
    """What an extension has going on outside the scheduler's queues, as the engine thread's loop needs it."""

    steps: bool  # it wants steps even with no request (something to poll between requests)
    keeps: bool  # blocks of finished requests kept, which a step may hand back (then poll idle at 10 ms)
    in_flight: bool  # work in flight for waiting requests that each step polls (then poll at 1 ms)


NOTHING = Background(False, False, False)


class EngineExtension(Protocol):
    layer_hook: LayerHook | None  # installed on the model runner at start (None: none)

    def set_wake(self, wake: Callable[[], None]) -> None:
        """`wake` (callable from any thread) wakes a loop sleeping between steps when work arrives for a step."""

    def on_added(self, req: Request, payload: object | None) -> Sequence[Event]:
        """A new request with its caller's payload; raises ParamError (a client mistake) before the request is
        registered. Its events usually schedule it."""

    def on_aborted(self, req: Request) -> bool:
        """An abort: True when the extension ends the request later (a Finish event), False: the loop ends it now."""

    def on_finished(self, req: Request, completed: bool) -> bool:
        """The request ended (`completed`: by a stop or its length); True when the extension keeps its blocks,
        False: the loop frees them."""

    def on_output(self, req: Request, out: RequestOutput) -> None:
        """An output of `req` is built: the extension adds its fields."""

    def call(self, command: object) -> tuple[object, Sequence[Event]]:
        """One of the extension's own commands (from the engine thread's queue): its answer and its events."""

    def poll(self) -> Sequence[Event]:
        """A step starts: what came in meanwhile."""

    def before_schedule(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        """Just before scheduling (room made for the step's requests)."""

    def after_schedule(self, sched: SchedulerOutput) -> Sequence[Event]:
        """What the scheduler decided, before the model runs."""

    def background(self) -> Background:
        """For the engine thread's loop: what it must keep stepping or polling for."""

    def contribute(self, stats: EngineStats) -> EngineStats:
        """The engine's stats snapshot (fresh, the extension's to fill in) with the extension's counts."""

    def shutdown(self) -> None:
        """Stops what the extension started."""


class NoExtension:
    """An engine with nothing beside it: every request plain, every finished request's blocks freed."""

    layer_hook: LayerHook | None = None

    def set_wake(self, wake: Callable[[], None]) -> None:
        pass

    def on_added(self, req: Request, payload: object | None) -> Sequence[Event]:
        return (Schedule(req),)

    def on_aborted(self, req: Request) -> bool:
        return False

    def on_finished(self, req: Request, completed: bool) -> bool:
        return False

    def on_output(self, req: Request, out: RequestOutput) -> None:
        pass

    def call(self, command: object) -> tuple[object, Sequence[Event]]:
        raise TypeError(f"this engine has no extension to run {type(command).__name__}")

    def poll(self) -> Sequence[Event]:
        return ()

    def before_schedule(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        pass

    def after_schedule(self, sched: SchedulerOutput) -> Sequence[Event]:
        return ()

    def background(self) -> Background:
        return NOTHING

    def contribute(self, stats: EngineStats) -> EngineStats:
        return stats

    def shutdown(self) -> None:
        pass
