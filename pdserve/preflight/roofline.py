"""What recomputing history tokens costs a prefill instance, priced at the margin: the roofline an instance
advertises in its /pdserve/info (`roofline`) and the proxy's multi-turn choice prices with (issue 42 part 4).

A prefill step of n tokens reads every weight once and does `flops_per_token` per token, so on a GPU

    time(n) = max(weight_bytes / hbm_bytes_per_s, n * flops_per_token / peak_flops)

and recomputing h history tokens batched with a turn's `new` tokens costs time(new + h) - time(new): nearly
nothing while new + h stays under the ridge point (a step of a few hundred tokens is still bound by reading
the weights), h * flops_per_token / peak_flops at most. The per-token rate that `kv_history_prefill_tps`
assumes (a whole prompt's tokens/s) overprices a short history by that step's weight-reading time.

Not counted: attention over the context (about 7 % of an 8B model's linear FLOPs per token at 2k tokens of
context) and the host's share of a step, which batching the history into the turn's step does not change.

The device figures are what this project measured on the card where it has one (h200-facts.md, BENCHMARKS.md:
weights streamed by the decode GEMVs, the bf16 8192^3 matmul), else the vendor's datasheet derated to what the
same measurements reached on the H200 (85 % of HBM bandwidth, 79 % of dense bf16). An unknown device, a dtype
other than bf16/fp16, or a CPU instance advertises no roofline: the proxy then prices recompute with its
`--kv-history-prefill-tps`. Standard library only (the proxy and the server both import it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# a substring of torch.cuda.get_device_name() -> (HBM bytes/s a prefill step's weight reads reach, dense bf16
# FLOP/s). Checked in this order: "H200" before "H100" (an "NVIDIA H100 NVL" is not an H200).
DEVICE_RATES: tuple[tuple[str, float, float], ...] = (
    ("H200", 3.9e12, 780e12),  # measured: GEMVs 3.86-4.09 TB/s of weights, matmul 770-797 TFLOP/s
    ("H100", 0.85 * 3.35e12, 780e12),  # datasheet HBM3 3.35 TB/s derated; matmul 778-787 TFLOP/s measured here
    ("A100", 0.85 * 2.0e12, 0.79 * 312e12),  # datasheet (80 GB SXM)
    ("L40S", 0.85 * 0.864e12, 0.79 * 362e12),  # datasheet
)
HALF_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class Roofline:
    device: str
    weight_bytes: float  # one rank's weights, read once per step
    flops_per_token: float  # linear layers of one prefill token (2 x their parameters)
    hbm_bytes_per_s: float
    peak_flops: float

    def step_s(self, tokens: int) -> float:
        """One prefill step of `tokens` tokens (0: no step)."""
        if tokens <= 0:
            return 0.0
        return max(self.weight_bytes / self.hbm_bytes_per_s, tokens * self.flops_per_token / self.peak_flops)

    def marginal_s(self, history: int, new: int) -> float:
        """Recomputing `history` tokens in the same step as the turn's `new` tokens (new >= 1: the last prompt
        token is always computed)."""
        if history <= 0:
            return 0.0
        new = max(new, 1)
        return self.step_s(new + history) - self.step_s(new)

    def ridge_tokens(self) -> float:
        """The step size from which a step is compute-bound."""
        return self.weight_bytes / self.hbm_bytes_per_s * self.peak_flops / self.flops_per_token

    def as_info(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_info(cls, info: Any) -> Roofline | None:
        """An instance's /pdserve/info `roofline` (None: absent or malformed: positive finite numbers only)."""
        if not isinstance(info, Mapping):
            return None
        nums = {}
        for name in ("weight_bytes", "flops_per_token", "hbm_bytes_per_s", "peak_flops"):
            v = info.get(name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                return None
            nums[name] = float(v)
        device = info.get("device")
        return cls(device if isinstance(device, str) else "unknown", **nums)


def device_rates(device_name: str) -> tuple[float, float] | None:
    """(HBM bytes/s, bf16 FLOP/s) for a GPU by its name, None when this table has no figures for it."""
    for key, hbm, flops in DEVICE_RATES:
        if key in device_name:
            return hbm, flops
    return None


def device_roofline(device_name: str, dtype: str, weight_bytes: float, flops_per_token: float) -> Roofline | None:
    """The roofline of a model on a GPU (None: a device or dtype without figures, or no weights counted)."""
    rates = device_rates(device_name)
    if rates is None or dtype not in HALF_DTYPES or weight_bytes <= 0 or flops_per_token <= 0:
        return None
    return Roofline(device_name, float(weight_bytes), float(flops_per_token), *rates)


def model_costs(named_params: Any, vocab_size: int, hidden_size: int) -> tuple[float, float]:
    """(weight bytes read per prefill step, linear FLOPs per prefill token) of a model from its named parameters.
    A step reads every weight once but the embedding table, of which it gathers rows (a tied table is read whole
    as the LM head); per token, 2 FLOPs per parameter of the matrices a token goes through, which leaves out the
    embedding and the LM head (a prefill computes logits for its last token only)."""
    params = list(named_params)
    tied = not any("lm_head" in name for name, _ in params)
    read_bytes = 0
    flop_params = 0
    for name, p in params:
        n = p.numel()
        embedding = "embed" in name
        if not embedding or tied:
            read_bytes += n * p.element_size()
        if p.dim() >= 2 and not (embedding or "lm_head" in name or tuple(p.shape) == (vocab_size, hidden_size)):
            flop_params += n
    return float(read_bytes), 2.0 * flop_params
