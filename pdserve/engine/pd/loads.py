"""A consumer's remote reads: started for the requests the scheduler allocated (`start_loads`), their
claims and outcomes polled from the consumer role, and the one place a read ends (`_ended`): loaded, aborted
meanwhile, refused by the producer (the client's mistake), or failed (then the policy: recompute or fail).
The scheduler's `loading` is the index of the requests in KVState.LOADING; it is only read here."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

from pdserve.api.pd import FirstToken, PushParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.events import Emit, EngineEvent, Finish, LoadEnded
from pdserve.engine.pd.connector_protocol import KVConnectorProtocol, KVConsumerRole
from pdserve.engine.pd.first_token import adopt_first_token
from pdserve.engine.request import Request

log = logging.getLogger("pdserve.engine")


class Loads:
    def __init__(self, connector: KVConnectorProtocol, consumer: KVConsumerRole, loading: Mapping[str, Request],
                 blocks: BlockManager, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.connector = connector  # the failure policy and the prefix-pull counters
        self.consumer = consumer  # the reads
        self.loading = loading  # the scheduler's: request id -> request whose blocks a read is filling
        self.blocks = blocks
        self.block_size = blocks.block_size
        # blocks of failed loads that may still be written (a push whose prefill fell silent): freed at the time
        # given, not with their request
        self.quarantined: list[tuple[float, list[int]]] = []
        self.eos_token_ids = eos_token_ids  # a push's first token is adopted under the request's stop rules

    def drop(self, reqs: Iterable[Request]) -> None:
        """Prefix loads the scheduler found not worth reading: the holder frees its lease now."""
        for req in reqs:
            self.consumer.remove_waiting(req.request_id)
            self.connector.record_prefix_pull("declined")

    def start(self, reqs: Iterable[Request]) -> list[EngineEvent]:
        """Start the reads of requests whose blocks the scheduler allocated; a read that cannot start ends
        at once (its events)."""
        events: list[EngineEvent] = []
        for req in reqs:
            assert req.kv.remote is not None  # parsed at admission
            first_block = req.num_computed_tokens // self.block_size
            req.metrics.kv_load_start_time = time.monotonic()
            try:
                # Tokens [0, len - 1) come from the producer and the last prompt token is recomputed here for
                # the first token's logits; with an adopted first token (or one a push may bring) the whole
                # prompt comes from the producer.
                self.consumer.start_load(req.request_id, req.kv.remote, list(req.block_ids), first_block,
                                         num_tokens=req.kv.load_tokens(req.num_prompt_tokens))
            except Exception as e:  # noqa: BLE001 - any connector failure goes through the failure policy
                # Not a transfer outcome but a refusal to start: log where it came from.
                log.exception("request %s: the KV load could not start", req.request_id)
                self.consumer.remove_waiting(req.request_id)  # stop heartbeats; the producer frees early
                events += self._ended(req, ok=False, error=f"KV load could not start: {e}")
        return events

    def poll(self) -> list[EngineEvent]:
        """Claims (an adopted first token goes out) and outcomes of the reads in flight."""
        events: list[EngineEvent] = []
        self._free_quarantined(time.monotonic())
        # results first, then claims: a load's claim is queued before its result, so every result polled
        # here has its claim polled too, and a claim is seen before the result of the same load
        results = self.consumer.poll_loads()
        for rid in self.consumer.poll_claimed():
            req = self.loading.get(rid)
            if req is not None and req.kv.first_token is not None and not req.kv.first_token_sent \
                    and not req.kv.abort_requested:
                # The producer granted the lease: the params can no longer be refused (a refusal is the
                # client's 4xx, which must come before any byte), only the READ can still fail. The adopted
                # token goes out now, while the READ runs, instead of after it (2.5-3 ms for 8k tokens of an
                # 8B model on an H200); if the READ fails, `_ended` recomputes after it or ends the stream
                # with the error, as for any failure after the first token.
                events += self._send_first_token(req)
        ended: set[str] = set()  # the events apply after this poll: a second result for a read is stale
        for res in results:
            req = self.loading.get(res.request_id)
            if req is None or res.request_id in ended:
                log.warning("KV load result for request %s, which is not loading; ignored", res.request_id)
                continue
            ended.add(res.request_id)
            req.error_status = getattr(res, "error_status", 500)  # the HTTP status a failure is answered with
            if res.ok:
                self._adopt_pushed_first_token(req, getattr(res, "first_token", None))
            elif getattr(res, "quarantine_until", None) is not None:
                self._quarantine(req, res.quarantine_until)
            events += self._ended(req, ok=res.ok, error=res.error or "KV transfer failed",
                                  rejected=getattr(res, "rejected", None))
        return events

    def abort(self, req: Request) -> None:
        """Aborted while its read runs: the read may still be writing into its blocks, so they are freed
        only when it ends (`_ended` finishes it then)."""
        req.kv.request_abort()
        self.consumer.cancel_load(req.request_id)  # a pending push stops; its blocks come back quiesced

    def _quarantine(self, req: Request, until: float) -> None:
        """The blocks the failed load was filling leave the request (which is answered, or recomputes into new
        blocks) and are freed at `until`, when nothing can land in them any more; the local prefix-cache hit
        before them stays the request's."""
        first_block = req.num_computed_tokens // self.block_size
        tail = list(req.block_ids[first_block:])
        if not tail:
            return
        req.block_ids = req.block_ids[:first_block]
        req.num_registered_blocks = min(req.num_registered_blocks, first_block)
        self.quarantined.append((until, tail))
        log.warning("request %s: %d blocks kept out of the pool for %.0f s (a WRITE may still land in them)",
                    req.request_id, len(tail), max(0.0, until - time.monotonic()))

    def _free_quarantined(self, now: float) -> None:
        if not self.quarantined:
            return
        due = [blocks for until, blocks in self.quarantined if until <= now]
        if due:
            self.quarantined = [(u, b) for u, b in self.quarantined if u > now]
            for blocks in due:
                self.blocks.free_blocks(blocks)

    def _adopt_pushed_first_token(self, req: Request, first: FirstToken | None) -> None:
        """A push that completed with the prefill's first token: adopted now (the whole prompt was written), so
        the first token and every prompt position's KV come from one prefill forward, as in a pull."""
        remote = req.kv.remote
        if (first is None or req.kv.first_token is not None or req.kv.abort_requested
                or not isinstance(remote, PushParams) or not remote.adopt_first_token or req.output_token_ids):
            return
        adopt_first_token(req, first, self.eos_token_ids)

    @staticmethod
    def _send_first_token(req: Request) -> list[EngineEvent]:
        req.metrics.first_token_time = req.metrics.last_token_time = time.monotonic()
        req.kv.first_token_sent = True
        return [Emit(req)]

    def _ended(self, req: Request, ok: bool, error: str, rejected: str | None = None) -> list[EngineEvent]:
        """The one place a remote read ends: loaded, aborted meanwhile, refused by the producer (the client's
        mistake: finished with the reason), or failed (then the policy, which is for transport failures)."""
        req.metrics.kv_load_done_time = time.monotonic()
        prefix_gone = False
        if req.kv.prefix_tokens is not None and not req.kv.abort_requested:
            if ok:
                read = req.kv.prefix_tokens - req.num_computed_tokens
                self.connector.record_prefix_pull("loaded", read)
                started = req.metrics.kv_load_start_time
                log.info("request %s: read %d held prompt tokens back in %.1f ms (not recomputed)", req.request_id,
                         read, (req.metrics.kv_load_done_time - started) * 1e3 if started is not None else -1.0)
            else:
                if rejected is not None:
                    # a held prefix that is gone (expired, evicted, its holder restarted): not the client's
                    # mistake, and nothing was read: compute it here
                    log.info("request %s: the held prefix is not available (%s); computing it",
                             req.request_id, error)
                    rejected, prefix_gone = None, True
                fallback = prefix_gone or self.connector.load_failure_policy == "recompute"
                self.connector.record_prefix_pull("recomputed" if fallback else "failed")
        recompute = not ok and rejected is None and (
            prefix_gone or self.connector.load_failure_policy == "recompute")
        if req.kv.first_token is not None and not req.kv.first_token_sent and not ok and not recompute:
            # the request ends here without its adopted token ever having been sent: it ends with none
            req.output_token_ids.clear()
            req.output_logprobs.clear()
        if req.kv.abort_requested:
            return [LoadEnded(req, ok, resume=False), Finish(req)]
        if ok:
            req.num_cached_tokens = req.kv.remote_tokens(req.num_prompt_tokens)
            events: list[EngineEvent] = [LoadEnded(req, ok=True, resume=True)]
            if req.kv.first_token is not None and not req.kv.first_token_sent:
                events += self._send_first_token(req)
            return events
        if rejected is not None:
            # Forged, replayed, expired or duplicated params: answered as the client's error, never recomputed
            # (that would hide it) and never logged as an engine failure.
            log.info("request %s: kv_transfer_params refused by the producer: %s", req.request_id, error)
            req.kv.rejection = rejected
            req.finish_reason = "error"
            req.error = error
            return [LoadEnded(req, ok=False, resume=False), Finish(req)]
        if recompute:
            # (an adopted first token stays: the recompute continues after it, as a seeded run would)
            log.warning("request %s: %s; recomputing the prompt locally", req.request_id, error)
            req.num_cached_tokens = req.num_computed_tokens  # the local prefix-cache hit stays valid
            return [LoadEnded(req, ok=False, resume=True)]
        log.error("request %s: %s", req.request_id, error)
        req.finish_reason = "error"
        req.error = error
        return [LoadEnded(req, ok=False, resume=False), Finish(req)]
