"""The engine's P/D half, as the step loop calls it: each call moves `Request.kv` (kv_handoff.py) and talks to
the connector, and returns the events (events.py) the loop applies to its own queues and outputs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from pdserve.api.pd import HeldKVParams, KVTransferParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.pd.admission import Admission
from pdserve.engine.pd.connector_protocol import KVConnectorProtocol
from pdserve.engine.pd.events import PDEvent
from pdserve.engine.pd.holds import Holds
from pdserve.engine.pd.loads import Loads
from pdserve.engine.request import Request


class EnginePD:
    """Admission (admission.py), the consumer's reads (loads.py), KV kept after a request (holds.py).
    Without a connector only admission (every request plain) and freeing finished requests' blocks apply."""

    def __init__(self, connector: KVConnectorProtocol | None, blocks: BlockManager, loading: Mapping[str, Request],
                 *, vocab_size: int, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.connector = connector
        self.admission = Admission(connector, blocks, vocab_size, eos_token_ids)
        consumer = connector.consumer if connector is not None else None
        self.loads = (Loads(connector, consumer, loading, blocks, eos_token_ids)
                      if consumer is not None else None)
        self.holds = Holds(connector, blocks, eos_token_ids, max_model_len)
        # push transfer (NixlPushConnector) on a prefill: what the model calls as each layer of a step finishes
        self.layer_hook = connector.step_hook if getattr(connector, "push_sender", None) is not None else None

    def set_notify(self, wake: Callable[[], None]) -> None:
        """The consumer's claims and ended loads call `wake` (from its threads); nothing without a consumer."""
        if self.loads is not None:
            self.loads.consumer.set_notify(wake)

    # ---- requests in ---------------------------------------------------------------------------
    def add(self, req: Request, kv_transfer_params: KVTransferParams | None) -> list[PDEvent]:
        """A new request's params (read at the server's edge) into `req.kv` (raises ParamError for a client
        mistake)."""
        return self.admission.add(req, kv_transfer_params)

    def deliver_params(self, key: str, kv_transfer_params: KVTransferParams) -> list[PDEvent]:
        """Params for a decode leg sent before them (raises ParamError when the delivery is refused)."""
        return self.admission.deliver(key, kv_transfer_params)

    def abort(self, req: Request) -> bool:
        """A request is aborted: True when its read is in flight (it finishes once the read ended: a
        `Finish` then comes from `poll`), False when the loop finishes it now."""
        if req.kv.loading:
            assert self.loads is not None
            self.loads.abort(req)
            return True
        if req.kv.needs_load and self.loads is not None:
            self.loads.consumer.remove_waiting(req.request_id)  # the producer frees its lease early
        self.admission.mailbox.forget(req)
        return False

    # ---- the step --------------------------------------------------------------------------------
    def poll(self) -> list[PDEvent]:
        """Start of a step: decode legs whose params never came, leases that ended, and
        the reads' claims and outcomes (nothing without a connector)."""
        if self.connector is None:
            return []
        events = self.admission.expired()
        if self.connector.producer is not None:
            self.holds.released(self.connector.producer.poll_released())
        return events + (self.loads.poll() if self.loads is not None else [])

    def make_room(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        """Before scheduling: held histories give way to the running and next waiting requests' blocks."""
        self.holds.make_room(running, waiting)

    def start_loads(self, started: Iterable[Request], dropped: Iterable[Request]) -> list[PDEvent]:
        """After scheduling: reads for the requests allocated, leases freed for prefixes not worth reading."""
        if self.loads is None:
            return []
        self.loads.drop(dropped)
        return self.loads.start(started)

    def finished(self, req: Request, hold: bool) -> None:
        """A request ended: its blocks held for a peer (`hold`: it ended by a stop or its length, and its
        params ask for it) or freed."""
        self.holds.finished(req, hold)

    def pin_cached_prefix(self, token_ids: Sequence[int], min_tokens: int = 1) -> HeldKVParams | None:
        """A cached prefix held for a peer's prefill: its params, or None (raises holds.PinRefused)."""
        return self.holds.pin_cached_prefix(token_ids, min_tokens)

    # ---- counts ----------------------------------------------------------------------------------
    @property
    def num_awaiting_params(self) -> int:
        return len(self.admission.mailbox)

    @property
    def num_held(self) -> int:
        return len(self.holds.held)

    @property
    def num_history(self) -> int:
        return len(self.holds.history)
