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
  recompute / threshold       fewer tokens than the prefill instance's `kv_recompute_threshold` (it would not read)
  pull|recompute / forced     `--kv-history-choice pull|recompute` (benchmarks; both predictions still shown)
  p_cache / prefill_cache     the prefill instances' own prefix cache holds all of it (nothing to read)
  none / no_history           no held history found for this conversation

One decider (issue 42 part 4). The proxy's cost model decides whether a turn reads its history back; the prefill
instance's `kv_recompute_threshold` keeps vLLM's meaning (the fewest held tokens worth a read) and the proxy
applies it first, from the instance's /pdserve/info, so a read the proxy sends is declined for size only where
the instance's own cache holds more than the proxy counted. The instance applies it alone only to reads no pdserve proxy priced (vLLM's proxy, a client
sending held params itself). `recompute_ms` is priced at the margin when the prefill instance advertises its
roofline (`priced_by=roofline`: recomputing the tokens in the same step as the turn's `new_tokens`,
pdserve/preflight/roofline.py), else at `--kv-history-prefill-tps` (`priced_by=prefill_tps`).
`prefill_cached_tokens` (once the prefill leg answered): prompt tokens the prefill instance did not compute
(its own cache plus what it read back); with `pull`, fewer than `held_tokens` means the prefill instance
declined part of the read (its kv_recompute_threshold, or blocks that no longer match).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pdserve.preflight.plan import pull_or_recompute
from pdserve.preflight.roofline import Roofline
from pdserve.proxy.protocol import estimate_prompt_tokens

HEADER = "X-PDServe-KV-History"


@dataclass
class HistoryDecision:
    decision: str  # pull | recompute | p_cache | none
    reason: str  # cost_model | threshold | forced | size_unknown | prefill_cache | no_history
    held_tokens: int | None = None  # tokens the decode instance holds (previous turn's prompt and answer)
    tokens: int | None = None  # of those, what the prefill instances lack: the tokens the choice is about
    pull_ms: float | None = None  # predicted: their KV over the link plus the per-read overhead
    recompute_ms: float | None = None  # predicted: computing them (at the margin with a roofline)
    new_tokens: int | None = None  # the turn's own new prompt tokens (estimated unless the ids are known)
    priced_by: str | None = None  # roofline | prefill_tps
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


def price_history(held_tokens: int, tokens: int, new_tokens: int, bytes_per_token: float, bandwidth_bytes_per_s: float,
                  overhead_s: float, prefill_tps: float, roofline: Roofline | None = None,
                  threshold: int | None = None, choice: str = "cost") -> HistoryDecision:
    """Pull or recompute the `tokens` of a held history of `held_tokens` that the prefill instances lack (> 0),
    for a turn that adds `new_tokens` of its own. `roofline`/`threshold`: the prefill instance's, from its
    /pdserve/info (None: not advertised). `choice`: `cost` decides; `pull`/`recompute` force the decision."""
    recompute_s = roofline.marginal_s(tokens, new_tokens) if roofline is not None else None
    est = pull_or_recompute(tokens, bytes_per_token, bandwidth_bytes_per_s, prefill_tps, overhead_s, recompute_s)
    if choice in ("pull", "recompute"):
        decision, reason = choice, "forced"
    elif threshold is not None and tokens < threshold:
        decision, reason = "recompute", "threshold"
    else:
        decision, reason = ("pull" if est.pull else "recompute"), "cost_model"
    return HistoryDecision(decision, reason, held_tokens, tokens, est.wire_s * 1e3, est.recompute_s * 1e3,
                           new_tokens, "roofline" if roofline is not None else "prefill_tps")


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
    """What a prefill instance's /pdserve/info says about recomputing a history there."""

    roofline: Roofline | None = None
    threshold: int | None = None  # its kv_recompute_threshold (None: it reads no held history, or not pdserve)

    @classmethod
    def from_info(cls, info: Any) -> RecomputeInfo:
        if not isinstance(info, dict):
            return cls()
        t = info.get("kv_recompute_threshold")
        return cls(Roofline.from_info(info.get("roofline")), t if type(t) is int and t >= 0 else None)


def fleet_recompute_info(instances: list[Any]) -> RecomputeInfo:
    """The prefill fleet's figures for a turn whose prefill instance is not chosen yet: the advertised roofline
    whose recompute is dearest at the margin (the highest cost per token past the ridge, then the fewest tokens
    free under it: the choice errs towards reading) and the highest threshold (the strictest instance then
    declines nothing the proxy sends)."""
    infos = [i.recompute for i in instances if getattr(i, "recompute", None) is not None]
    roofs = [x.roofline for x in infos if x.roofline is not None]
    thresholds = [x.threshold for x in infos if x.threshold is not None]
    roof = max(roofs, key=lambda r: (r.flops_per_token / r.peak_flops, -r.ridge_tokens()), default=None)
    return RecomputeInfo(roof, max(thresholds) if thresholds else None)
