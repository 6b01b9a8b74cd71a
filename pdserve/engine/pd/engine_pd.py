"""The engine's P/D half as the step loop sees it: the engine extension (engine/extension.py) a server installs.
Each hook moves `Request.kv` (kv_handoff.py) and talks to the connector, and returns the events (engine/events.py)
the loop applies to its own queues and outputs; the loop itself never names kv_transfer_params, leases or loads."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from pdserve.api.pd import HeldKVParams, KVTransferParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.commands import DeliverParams, PinPrefix
from pdserve.engine.events import EngineEvent
from pdserve.engine.extension import Background, LayerHook
from pdserve.engine.pd.admission import Admission
from pdserve.engine.pd.connector_protocol import KVConnectorProtocol
from pdserve.engine.pd.holds import Holds
from pdserve.engine.pd.loads import Loads
from pdserve.engine.request import Request
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.stats import EngineStats
from pdserve.types.outputs import RequestOutput


class EnginePD:
    """Admission (admission.py), the consumer's reads (loads.py), KV kept after a request (holds.py).
    Without a connector only admission applies (every request plain)."""

    def __init__(self, connector: KVConnectorProtocol | None, blocks: BlockManager, loading: Mapping[str, Request],
                 *, vocab_size: int, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.connector = connector
        self.loading = loading  # the scheduler's requests whose KV a read is writing (Scheduler.loading)
        self.admission = Admission(connector, blocks, vocab_size, eos_token_ids)
        consumer = connector.consumer if connector is not None else None
        self.loads = (Loads(connector, consumer, loading, blocks, eos_token_ids)
                      if consumer is not None else None)
        self.holds = Holds(connector, blocks, eos_token_ids, max_model_len)
        # push transfer (NixlPushConnector) on a prefill: what the model calls as each layer of a step finishes
        self.layer_hook: LayerHook | None = (connector.step_hook if getattr(connector, "push_sender", None)
                                             is not None else None)

    def set_wake(self, wake: Callable[[], None]) -> None:
        """The consumer's claims and ended loads call `wake` (from its threads); nothing without a consumer."""
        if self.loads is not None:
            self.loads.consumer.set_notify(wake)

    # ---- requests ------------------------------------------------------------------------------
    def on_added(self, req: Request, payload: object | None) -> list[EngineEvent]:
        """A new request's params (`payload`: KVTransferParams, read at the server's edge) into `req.kv` (raises
        ParamError for a client mistake)."""
        assert payload is None or isinstance(payload, KVTransferParams)
        return self.admission.add(req, payload)

    def on_aborted(self, req: Request) -> bool:
        """True when its read is in flight (it finishes once the read ended: a `Finish` then comes from `poll`),
        False when the loop finishes it now."""
        if req.kv.loading:
            assert self.loads is not None
            self.loads.abort(req)
            return True
        if req.kv.needs_load and self.loads is not None:
            self.loads.consumer.remove_waiting(req.request_id)  # the producer frees its lease early
        self.admission.mailbox.forget(req)
        return False

    def on_finished(self, req: Request, completed: bool) -> bool:
        """Its blocks held for a peer (`completed`: it ended by a stop or its length, and its params ask for it):
        True; else False (the loop frees them)."""
        return self.holds.finished(req, completed)

    def on_output(self, req: Request, out: RequestOutput) -> None:
        """What a response tells of the handoff: the producer's params and a refused lease on the last output,
        the delivered params' prefix hits on every one."""
        if out.finished:
            out.kv_rejection = req.kv.rejection
            out.kv_transfer_params = req.result_kv_transfer_params
        out.remote_cached_tokens = req.remote_cached_tokens

    def call(self, command: object) -> tuple[object, list[EngineEvent]]:
        """The server's P/D commands (engine/commands.py) on the engine thread."""
        match command:
            case DeliverParams(key, params):
                return None, self.deliver_params(key, params)
            case PinPrefix(token_ids, min_tokens):
                return self.pin_cached_prefix(token_ids, min_tokens), []
        raise TypeError(f"the P/D half runs no {type(command).__name__}")

    def deliver_params(self, key: str, kv_transfer_params: KVTransferParams) -> list[EngineEvent]:
        """Params for a decode leg sent before them (raises ParamError when the delivery is refused)."""
        return self.admission.deliver(key, kv_transfer_params)

    def pin_cached_prefix(self, token_ids: Sequence[int], min_tokens: int = 1) -> HeldKVParams | None:
        """A cached prefix held for a peer's prefill: its params, or None (raises holds.PinRefused)."""
        return self.holds.pin_cached_prefix(token_ids, min_tokens)

    # ---- the step --------------------------------------------------------------------------------
    def poll(self) -> list[EngineEvent]:
        """Start of a step: decode legs whose params never came, leases that ended, and
        the reads' claims and outcomes (nothing without a connector)."""
        if self.connector is None:
            return []
        events = self.admission.expired()
        if self.connector.producer is not None:
            self.holds.released(self.connector.producer.poll_released())
        return events + (self.loads.poll() if self.loads is not None else [])

    def before_schedule(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        """Held histories give way to the running and next waiting requests' blocks."""
        self.holds.make_room(running, waiting)

    def after_schedule(self, sched: SchedulerOutput) -> list[EngineEvent]:
        """Reads for the requests allocated, leases freed for prefixes not worth reading."""
        if self.loads is None:
            return []
        self.loads.drop(sched.dropped_loads)
        return self.loads.start(sched.start_loads)

    def background(self) -> Background:
        """A connector's side channel and leases are polled by steps even with no request; held blocks are
        handed back by a step (leases end), reads in flight are polled."""
        held = bool(self.holds.held)
        return Background(steps=self.connector is not None or held, keeps=held, in_flight=bool(self.loading))

    # ---- counts ----------------------------------------------------------------------------------
    def contribute(self, stats: EngineStats) -> EngineStats:
        # filled in on the loop's fresh snapshot (dataclasses.replace would cost ~15 us a turn of the loop)
        stats.num_loading, stats.num_held = len(self.loading), len(self.holds.held)
        stats.num_history, stats.num_awaiting_params = len(self.holds.history), len(self.admission.mailbox)
        return stats

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
