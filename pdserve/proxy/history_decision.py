"""What the proxy decided for one turn of a conversation whose earlier turn a decode instance holds (multi-turn
over P/D, `bidirectional_kv_xfer`), told to the client with the answer instead of silently:

- in the response header `X-PDServe-KV-History` (streamed or not), e.g.
  `decision=pull; reason=cost_model; held_tokens=368; tokens=82; pull_ms=2.8; recompute_ms=41`;
- in a whole (non-streamed) JSON answer as `kv_transfer_params.kv_history` (the same fields), beside the
  params vLLM's decode instances return there, when a held history was found (an answer without one keeps
  vLLM's body unchanged: `kv_transfer_params` null or the decode instance's own);
- in the proxy's log (one line per turn) and `pdserve_proxy_kv_history_total{choice}`.

decision / reason:
  pull / cost_model           reading the held KV is predicted faster than recomputing the tokens it adds
  pull / size_unknown         the holder gave no block size in bytes (a vLLM decode instance): read, as vLLM
  recompute / cost_model      recomputing is predicted faster (`pull_or_recompute`, `pdserve plan`'s arithmetic)
  pull|recompute / forced     `--kv-history-choice pull|recompute` (benchmarks; both predictions still shown)
  p_cache / prefill_cache     the prefill instances' own prefix cache holds all of it (nothing to read)
  none / no_history           no held history found for this conversation

One decider (issue 42 part 4): the proxy's cost model. It prices the tokens the prefill instances lack both ways and
also finds the turn's break-even, `min_read_tokens` (the fewest of them worth a read: pull iff tokens >=
min_read_tokens), which a pull's prefill leg carries (`pdserve.api.pd.MIN_READ_TOKENS`); the reading instance
applies it where it would apply its own `kv_recompute_threshold`, to the tokens left to read once its own prefix
cache is counted (exact there, estimated here). The instance's configured threshold applies only to reads no
pdserve proxy priced (vLLM's proxy, a client sending held params itself); the proxy does not read it.
`recompute_ms` is priced at the margin when the prefill instances advertise their measured `prefill_cost`
(`priced_by=measured`: the turn's `new_tokens` and the history in one step, pdserve/types/prefill_cost.py;
the dearest instance's when several do), else at `--kv-history-prefill-tps` (`priced_by=prefill_tps`).
`prefill_cached_tokens` (once the prefill leg answered): prompt tokens the prefill instance did not compute
(its own cache plus what it read back); with `pull`, fewer than `held_tokens` means the prefill instance
declined part of the read (fewer than min_read_tokens left to read, or blocks that no longer match).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pdserve.preflight.plan import PullChoice, pull_or_recompute
from pdserve.proxy.protocol import estimate_prompt_tokens
from pdserve.types.prefill_cost import PrefillCost, dearest_marginal_s

HEADER = "X-PDServe-KV-History"


@dataclass
class HistoryDecision:
    decision: str  # pull | recompute | p_cache | none
    reason: str  # cost_model | forced | size_unknown | prefill_cache | no_history
    held_tokens: int | None = None  # tokens the decode instance holds (previous turn's prompt and answer)
    tokens: int | None = None  # of those, what the prefill instances lack: the tokens the choice is about
    pull_ms: float | None = None  # predicted: their KV over the link plus the per-read overhead
    recompute_ms: float | None = None  # predicted: computing them (at the margin with a measured prefill cost)
    new_tokens: int | None = None  # the turn's own new prompt tokens (estimated unless the ids are known)
    priced_by: str | None = None  # measured | prefill_tps
    min_read_tokens: int | None = None  # a pull: the fewest tokens worth reading (the break-even), sent along
    prefill_cached_tokens: int | None = None  # measured: prompt tokens the prefill leg did not compute

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items() if v is not None}

    def header(self) -> str:
        return "; ".join(f"{k}={v}" for k, v in self.as_dict().items())

    def note_prefill(self, prefill_response: dict[str, Any] | None) -> None:
        usage = (prefill_response or {}).get("usage")
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(cached) is int:
            self.prefill_cached_tokens = cached


@dataclass(frozen=True)
class HistoryPricing:
    """What one turn's read and recompute cost, as functions of how many held tokens are in question."""

    new_tokens: int  # the turn's own prompt tokens, computed in the same step as a recomputed history
    bytes_per_token: float
    bandwidth_bytes_per_s: float
    overhead_s: float  # per read
    prefill_tps: float  # the rate without a measured prefill cost
    costs: tuple[PrefillCost, ...] = ()  # the prefill instances' measured costs (empty: priced at prefill_tps)

    def at(self, tokens: int) -> PullChoice:
        recompute_s = dearest_marginal_s(self.costs, tokens, self.new_tokens) if self.costs else None
        return pull_or_recompute(tokens, self.bytes_per_token, self.bandwidth_bytes_per_s, self.prefill_tps,
                                 self.overhead_s, recompute_s)

    def break_even(self, tokens: int) -> int | None:
        """The fewest of `tokens` held tokens whose read is predicted faster than their recompute (None: not even
        all of them). A read costs a fixed overhead plus a rate, a recompute (a convex step time's margin, or a
        rate) nothing or more per token the more there are: their difference changes sign at most once, so a
        bisection finds it."""
        if tokens <= 0 or not self.at(tokens).pull:
            return None
        lo, hi = 0, tokens  # not worth it at lo (nothing to read), worth it at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.at(mid).pull:
                hi = mid
            else:
                lo = mid
        return hi


def price_history(held_tokens: int, tokens: int, pricing: HistoryPricing, choice: str = "cost") -> HistoryDecision:
    """Pull or recompute the `tokens` of a held history of `held_tokens` that the prefill instances lack (> 0).
    `choice`: `cost` decides; `pull`/`recompute` force the decision. A pull carries its `min_read_tokens` (0 when
    forced: read whatever is left)."""
    est = pricing.at(tokens)
    if choice in ("pull", "recompute"):
        decision, reason = choice, "forced"
        min_read = 0 if choice == "pull" else None
    else:
        decision, reason = ("pull" if est.pull else "recompute"), "cost_model"
        min_read = pricing.break_even(tokens) if est.pull else None
    return HistoryDecision(decision, reason, held_tokens, tokens, est.wire_s * 1e3, est.recompute_s * 1e3,
                           pricing.new_tokens, "measured" if pricing.costs else "prefill_tps", min_read)


def new_turn_tokens(body: dict[str, Any], held_tokens: int, prompt_tokens: int | None = None) -> int:
    """The turn's own prompt tokens: exact from the prompt's length when known (token ids), else estimated
    (proxy/protocol.py's characters / 4) from what follows the conversation's last answer. At least 1."""
    if prompt_tokens is not None:
        return max(prompt_tokens - held_tokens, 1)
    messages = body.get("messages")
    if isinstance(messages, list):
        last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                   default=-1)
        return max(estimate_prompt_tokens({"messages": messages[last + 1:]}), 1)
    return max(estimate_prompt_tokens(body) - held_tokens, 1)


@dataclass
class RecomputeInfo:
    """What a prefill instance's /pdserve/info says about recomputing a history there: its measured prefill
    cost (None: not advertised: a CPU or vLLM instance, or one that reads no held history)."""

    cost: PrefillCost | None = None

    @classmethod
    def from_info(cls, info: Any) -> RecomputeInfo:
        if not isinstance(info, dict):
            return cls()
        return cls(PrefillCost.from_info(info.get("prefill_cost")))


def fleet_prefill_costs(instances: list[Any]) -> tuple[PrefillCost, ...]:
    """The prefill instances' advertised costs, for a turn whose prefill instance is not chosen yet (priced by the
    dearest: `HistoryPricing.at`)."""
    infos = [getattr(i, "recompute", None) for i in instances]
    return tuple(x.cost for x in infos if x is not None and x.cost is not None)
