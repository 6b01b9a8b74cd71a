"""Speculative decoding's acceptance over a benchmark run, as `vllm bench serve` reports it: the server's
`vllm:spec_decode_*` counters read from /metrics before and after the run, the difference printed and saved
under vLLM's result keys (spec_decode_acceptance_rate in %, _acceptance_length with the bonus token,
_num_drafts, _draft_tokens, _accepted_tokens, _per_position_acceptance_rates). A server without the
counters (speculation off, or no /metrics) gives nothing."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.bench.transfer import metrics_url

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?\s*$")  # name{labels} value [timestamp]
_PREFIX = "vllm:spec_decode_"
_POSITION = 'position="'


@dataclass
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: dict[int, float] = field(default_factory=dict)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted,
                            {p: n - other.per_pos.get(p, 0.0) for p, n in self.per_pos.items()})

    def result_keys(self) -> dict[str, Any]:
        """vLLM's keys; empty when no draft was verified."""
        if self.drafts <= 0:
            return {}
        return {
            "spec_decode_acceptance_rate": 100.0 * self.accepted / max(self.draft_tokens, 1.0),
            "spec_decode_acceptance_length": 1.0 + self.accepted / self.drafts,
            "spec_decode_num_drafts": int(self.drafts),
            "spec_decode_draft_tokens": int(self.draft_tokens),
            "spec_decode_accepted_tokens": int(self.accepted),
            "spec_decode_per_position_acceptance_rates": [self.per_pos[p] / self.drafts for p in sorted(self.per_pos)],
        }


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The counters summed over label sets (several engines, one per label); None when absent."""
    out = SpecCounters()
    found = False
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or not m.group(1).startswith(_PREFIX):
            continue
        name, labels, value = m.group(1).removesuffix("_total"), m.group(2) or "", float(m.group(3))
        found = True
        if name == f"{_PREFIX}num_drafts":
            out.drafts += value
        elif name == f"{_PREFIX}num_draft_tokens":
            out.draft_tokens += value
        elif name == f"{_PREFIX}num_accepted_tokens":
            out.accepted += value
        elif name == f"{_PREFIX}num_accepted_tokens_per_pos" and _POSITION in labels:
            pos = int(labels.split(_POSITION, 1)[1].split('"', 1)[0])
            out.per_pos[pos] = out.per_pos.get(pos, 0.0) + value
    return out if found else None


async def read_spec_counters(root_url: str) -> SpecCounters | None:
    """None when the server has no /metrics or no speculative decoding counters."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session, \
                session.get(metrics_url(root_url)) as resp:
            if resp.status != 200:
                return None
            return parse_spec_counters(await resp.text())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def format_spec_block(keys: dict[str, Any]) -> str:
    rates = ", ".join(f"{r:.3f}" for r in keys["spec_decode_per_position_acceptance_rates"])
    return "\n".join([
        "{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"),
        "{:<40} {:<10.2f}".format("Acceptance rate (%):", keys["spec_decode_acceptance_rate"]),
        "{:<40} {:<10.2f}".format("Acceptance length:", keys["spec_decode_acceptance_length"]),
        "{:<40} {:<10}".format("Drafts:", keys["spec_decode_num_drafts"]),
        "{:<40} {:<10}".format("Draft tokens:", keys["spec_decode_draft_tokens"]),
        "{:<40} {:<10}".format("Accepted tokens:", keys["spec_decode_accepted_tokens"]),
        f"Per-position acceptance rate: {rates}",
        "=" * 50,
    ])
