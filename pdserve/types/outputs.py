"""What the engine reports back per request per step. Token ids only: text lives in pdserve.text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.api.pd import HeldKVParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1-based rank of this token in the full distribution
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() when the engine got the request
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    kv_load_start_time: float | None = None  # consumer: the remote read was started
    kv_load_done_time: float | None = None  # consumer: the remote read ended (or failed)


@dataclass
class RequestOutput:
    """A delta: the tokens generated since the previous output for this request."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    num_output_tokens: int  # total so far, including new_token_ids
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id (or stop string, set by the text layer)
    error: str | None = None  # set when finish_reason == "error"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache or a remote transfer
    # set on the final output of a request whose KV is held for a peer (a prefill leg, a kept history); the
    # response view serialises it (pdserve.server.pipeline.held_json)
    kv_transfer_params: HeldKVParams | None = None
    # a decode leg whose params came later (pdserve.api.pd.early_decode_params): what the delivered params say
    # the producer's prefix cache held (their remote_prefill_cached_tokens), for the response's usage
    remote_cached_tokens: int | None = None
    metrics: RequestMetrics | None = None
    # params.prompt_logprobs: one per prompt position (the first None), on the request's first output only
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # with `error`: the HTTP status it is answered with: 409 when a KV producer's cache cannot be read by this
    # instance, a lease rejection's 4xx (below), else 500
    error_status: int = 500
    # With error: the producer refused the lease the request's kv_transfer_params name (why: a key of
    # pdserve.api.pd.LEASE_REJECTION_STATUS), a client mistake rather than an engine failure.
    kv_rejection: str | None = None
