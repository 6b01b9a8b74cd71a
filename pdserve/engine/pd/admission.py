"""Admission of a request that names remote KV: its `kv_transfer_params` read into `Request.kv` and checked,
a decode leg sent before its params parked in the mailbox until they come, the producer's first token
adopted, a peer's held prefix matched against the prompt, and the consumer told to keep the lease alive."""

from __future__ import annotations

import logging

from pdserve.api import pd
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.events import EngineEvent, Finish, FirstTokenAdopted, ParamsRefused, Schedule
from pdserve.engine.pd.connector_protocol import KVConnectorProtocol
from pdserve.engine.pd.first_token import adopt_first_token
from pdserve.engine.pd.kv_handoff import KVHandoff
from pdserve.engine.pd.params_mailbox import PARAMS_WAIT_S, ParamsMailbox
from pdserve.engine.request import Request
from pdserve.types.sampling_params import ParamError

log = logging.getLogger("pdserve.engine")


class Admission:
    def __init__(self, connector: KVConnectorProtocol | None, blocks: BlockManager, vocab_size: int,
                 eos_token_ids: frozenset[int]) -> None:
        self.connector = connector
        self.blocks = blocks
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.mailbox = ParamsMailbox()  # consumer: decode legs sent before their params, and vice versa

    def _handoff(self, params: pd.KVTransferParams, can_load: bool) -> KVHandoff:
        conn = self.connector
        return KVHandoff.from_params(params, can_load=can_load,
                                     can_send=conn is not None and conn.can_send,
                                     keeps_history=conn is not None and conn.keeps_history)

    def add(self, req: Request, params: pd.KVTransferParams | None) -> list[EngineEvent]:
        """A new request's P/D part into `req.kv`: its events (it is scheduled, or nothing while it awaits its
        params). Raises ParamError for a client mistake, before anything is registered."""
        conn = self.connector
        params = params or pd.KVTransferParams()  # a plain request
        kv = self._handoff(params, can_load=conn is not None and conn.can_load)
        later = None
        if kv.needs_load and req.params.prompt_logprobs is not None:
            raise ParamError("prompt_logprobs need the logits of every prompt position, which a request that "
                             "reads its prompt's KV from another instance does not compute", "prompt_logprobs")
        if kv.needs_load:
            try:
                later = params.params_later_key()
            except ValueError as e:
                raise ParamError(str(e), "kv_transfer_params") from e
            if later is not None:
                early = self.mailbox.take_early(later)
                if early is not None:  # the params came first: an ordinary decode leg
                    params, later = early, None
                    kv = self._handoff(early, can_load=True)
        if kv.send:
            assert conn is not None and conn.producer is not None
            try:
                kv.push = conn.producer.parse_prefill_leg(params)
            except ValueError as e:
                raise ParamError(str(e), "kv_transfer_params") from e
        first = None if later is not None else self._check_remote_params(kv, params)
        req.kv = kv
        if later is not None:
            try:
                self.mailbox.wait(later, req)
            except ValueError as e:
                raise ParamError(str(e), "kv_transfer_params") from e
            return []  # admitted (blocks, load) once its params are delivered
        return self._admit(req, first)

    def _check_remote_params(self, kv: KVHandoff, params: pd.KVTransferParams) -> pd.FirstToken | None:
        """A decode leg's params, parsed once into `kv.remote`: the first token they carry (None without one),
        or ParamError."""
        if not kv.needs_load:
            return None
        assert self.connector is not None and self.connector.consumer is not None
        try:
            kv.remote = self.connector.consumer.parse(params)
        except ValueError as e:  # InvalidKVTransferParams: its message names the field
            raise ParamError(str(e), "kv_transfer_params") from e
        first = None if kv.prefix else kv.remote.first_token
        vocab = self.vocab_size
        if first is not None and first.token_id >= vocab:
            raise ParamError(f"kv_transfer_params.{pd.FIRST_TOKEN_ID} {first.token_id} is out of vocabulary "
                             f"(size {vocab})", "kv_transfer_params")
        return first

    def _admit(self, req: Request, first: pd.FirstToken | None) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        if first is not None and adopt_first_token(req, first, self.eos_token_ids):
            events.append(FirstTokenAdopted(req))
        if req.kv.prefix:
            assert isinstance(req.kv.remote, pd.RemotePrefillParams)
            self._match_prefix(req, req.kv.remote)
        if req.kv.needs_load:
            assert self.connector is not None and self.connector.consumer is not None and req.kv.remote is not None
            # last: nothing after it can refuse the request
            self.connector.consumer.add_waiting(req.request_id, req.kv.remote)
        events.append(Schedule(req))
        return events

    def deliver(self, key: str, params: pd.KVTransferParams) -> list[EngineEvent]:
        """The prefill's params for the decode leg waiting under `key` (`pd.early_decode_params`): its events,
        `ParamsRefused` for params this instance refuses; or kept for a leg still to come (no events). Raises
        ParamError when the delivery itself is refused (no leg is affected)."""
        try:
            req = self.mailbox.deliver(key, params)
        except ValueError as e:
            raise ParamError(str(e), "kv_transfer_params") from e
        if req is None:
            return []
        assert self.connector is not None
        req.kv = self._handoff(params, can_load=True)
        try:
            if not req.kv.needs_load:
                raise ParamError("kv_transfer_params: the delivered params are no decode leg's "
                                 "(do_remote_prefill missing)", "kv_transfer_params")
            first = self._check_remote_params(req.kv, params)
        except ParamError as e:
            req.finish_reason, req.error, req.error_status = "error", str(e), 400
            req.kv.rejection = "invalid"
            return [ParamsRefused(req, e)]
        if params.remote_cached_tokens is not None:
            # the server's usage has only the leg's params_later marker
            req.remote_cached_tokens = params.remote_cached_tokens
        return self._admit(req, first)

    def expired(self) -> list[EngineEvent]:
        """Decode legs whose params did not come in time: they end with a 504."""
        events: list[EngineEvent] = []
        for req in self.mailbox.expired():
            req.finish_reason, req.error_status = "error", 504
            req.error = f"the decode leg's kv_transfer_params did not arrive within {PARAMS_WAIT_S:.0f} s"
            events.append(Finish(req))
        return events

    def _match_prefix(self, req: Request, remote: pd.RemotePrefillParams) -> None:
        """A peer's held prefix: read the leading blocks whose hashes equal this prompt's (the same tokens at
        the same positions), leaving at least the last prompt token to compute. None matching: the peer
        frees its lease now and the prompt is computed here."""
        assert self.connector is not None
        bs = self.blocks.block_size
        limit = min(len(remote.block_hashes), len(remote.remote_block_ids),
                    (remote.remote_num_tokens or 0) // bs, (req.num_prompt_tokens - 1) // bs)
        ours = self.blocks.block_hashes(req, limit * bs) if limit > 0 else []
        k = 0
        while k < limit and pd.wire_block_hash(ours[k]) == remote.block_hashes[k]:
            k += 1
        if k == 0:
            log.info("request %s: the held prefix %s matches none of this prompt's blocks; computing it",
                     req.request_id, remote.remote_request_id)
            req.kv.drop_load()
            assert self.connector.consumer is not None
            self.connector.consumer.decline(remote)
            self.connector.record_prefix_pull("declined")
            return
        req.kv.prefix_tokens = k * bs
        # the proxy's break-even when a pdserve proxy priced this read (one decider: its cost model), else this
        # instance's kv_recompute_threshold (vLLM's rule for reads nobody priced)
        req.kv.prefix_min_tokens = (remote.min_read_tokens if remote.min_read_tokens is not None
                                    else self.connector.kv_recompute_threshold)
