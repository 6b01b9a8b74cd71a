"""A request's state as the scheduler sees it: token ids, progress and blocks. No tensors here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.pd import HeldKVParams
from pdserve.engine.pd.kv_handoff import KVHandoff
from pdserve.types.outputs import RequestMetrics, TokenLogprob
from pdserve.types.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks allocated, NIXL read in flight (kv.loading)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    kv: KVHandoff = field(default_factory=KVHandoff)  # its P/D part, the one record of its P/D state (KVState)
    arrival_time: float = field(default_factory=time.monotonic)

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # params.prompt_logprobs: one entry per prompt position computed so far (position 0 has none: None)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens not computed here (prefix cache or transfer); -1 = unset
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks (kv_events.block_hash)
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_tier_hit_tokens: int = 0  # prompt tokens loaded back for it from the offload tiers (host, disk)
    tier_scan: int = -1  # engine.tier_loader: the preemption count at its last tier lookup (-1: none yet)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_status: int = 500  # the HTTP status a server answers `error` with
    num_emitted: int = 0  # output tokens already reported to the caller
    remote_cached_tokens: int | None = None  # delivered params' remote_prefill_cached_tokens (params_later legs)
    metrics: RequestMetrics = field(init=False)
    result_kv_transfer_params: HeldKVParams | None = None  # producer: what a consumer needs to read
    grammar: Any = None  # structured outputs: the request's matcher (pdserve.structured.grammar.Grammar)
    # speculative decoding: draft tokens after its last token that this step verifies (engine.spec_decode);
    # they sit past num_tokens (token_at reads them) and become output only once accepted
    spec_token_ids: list[int] = field(default_factory=list)
    draft_computed_tokens: int = 0  # a draft model's KV: its leading positions computed (spec_decode.draft)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        """Token i of prompt + output, then of the drafts being verified."""
        p = len(self.prompt_token_ids)
        if i < p:
            return self.prompt_token_ids[i]
        i -= p
        out = self.output_token_ids
        return out[i] if i < len(out) else self.spec_token_ids[i - len(out)]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the prompt then the output: token_at over a range, without a call per token."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return list(self.prompt_token_ids[start:end])
        if start >= p:
            return list(self.output_token_ids[start - p:end - p])
        return [*self.prompt_token_ids[start:], *self.output_token_ids[:end - p]]

    @property
    def max_tokens(self) -> int:
        budget = self.max_model_len - self.num_prompt_tokens
        mt = self.params.max_tokens
        return budget if mt is None else min(mt, budget)

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def check_stop(self, token_id: int) -> bool:
        """Called after appending a sampled token: sets finish_reason when the request is done."""
        n = len(self.output_token_ids)
        p = self.params
        if n >= p.min_tokens:
            if token_id in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", token_id
                return True
            if not p.ignore_eos and token_id in self.eos_token_ids:
                self.finish_reason, self.stop_reason = "stop", None
                return True
        if n >= self.max_tokens or self.num_tokens >= self.max_model_len:
            self.finish_reason = "length"
            return True
        return False
