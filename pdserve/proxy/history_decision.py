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
  p_cache / prefill_cache     the prefill instances' own prefix cache holds all of it (nothing to read)
  none / no_history           no held history found for this conversation
`prefill_cached_tokens` (once the prefill leg answered): prompt tokens the prefill instance did not compute
(its own cache plus what it read back); with `pull`, fewer than `held_tokens` means the prefill instance
declined part of the read (its kv_recompute_threshold, or blocks that no longer match).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

HEADER = "X-PDServe-KV-History"


@dataclass
class HistoryDecision:
    decision: str  # pull | recompute | p_cache | none
    reason: str  # cost_model | size_unknown | prefill_cache | no_history
    held_tokens: int | None = None  # tokens the decode instance holds (previous turn's prompt and answer)
    tokens: int | None = None  # of those, what the prefill instances lack: the tokens the choice is about
    pull_ms: float | None = None  # predicted: their KV over the link plus the per-read overhead
    recompute_ms: float | None = None  # predicted: computing them at the prefill rate
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
