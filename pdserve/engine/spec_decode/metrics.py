"""Speculative decoding counters, as vLLM keeps them (vllm/v1/spec_decode/metrics.py: SpecDecodingStats)
and exports them: vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens and
_num_accepted_tokens_per_pos{position} (Prometheus adds _total to each counter)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_spec_tokens: int  # the configured k: positions 0..k-1
    num_drafts: int = 0  # verify steps of a request with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):  # accepted drafts are always a prefix of the draft
            self.num_accepted_tokens_per_pos[pos] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                               self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verify step, the bonus token included (vLLM's convention)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
