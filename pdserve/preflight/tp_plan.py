"""`pdserve plan --prefill-tp P --decode-tp D`: what a P/D handoff between tensor-parallel instances moves.

Each decode rank reads its own KV heads (pdserve/types/tp_layout.py's `head_sources`, the mapping vLLM's
NIXL connector uses) from the prefill ranks that hold them, over its own link, in parallel with the other
decode ranks. So the wire time is the largest rank's bytes over one link, and a decode TP above the
number of KV heads moves the replicated heads once per rank that stores them. Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pdserve.types.tp_layout import head_sources, kv_head_start, kv_heads_per_rank


@dataclass(frozen=True)
class RankReads:
    decode_rank: int
    sources: list[tuple[int, int, int]]  # (prefill rank, first global KV head, number of heads)
    bytes: int

    def describe(self) -> str:
        parts = [f"head{'s' if n > 1 else ''} {h}{f'-{h + n - 1}' if n > 1 else ''} from prefill rank {p}"
                 for p, h, n in self.sources]
        return f"decode rank {self.decode_rank} reads " + ", ".join(parts)


@dataclass(frozen=True)
class TPPlan:
    prefill_tp: int
    decode_tp: int
    num_kv_heads: int
    ranks: list[RankReads]
    whole_blocks: bool  # every read moves whole blocks (same heads on both sides); else strided head slices
    piece_bytes: int  # a strided descriptor's piece: one row's heads (0 with whole blocks)
    pieces_per_block: int

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.ranks)

    @property
    def max_rank_bytes(self) -> int:
        return max(r.bytes for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(total_bytes=self.total_bytes, max_rank_bytes=self.max_rank_bytes)
        return out


def check_kv_split(tp: int, num_kv_heads: int, role: str) -> None:
    if tp < 1:
        raise ValueError(f"--{role}-tp must be >= 1, got {tp}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"--{role}-tp {tp} and {num_kv_heads} KV heads: one must divide the other")


def make_tp_plan(*, num_layers: int, num_kv_heads: int, head_dim: int, elem_bytes: float, prompt_len: int,
                 block_size: int, prefill_tp: int, decode_tp: int) -> TPPlan:
    """The reads of a prompt of `prompt_len` tokens from P to D (bytes of the tokens, as the plan's prompt
    bytes; the last block's unused slots travel too, at most block_size - 1 tokens more)."""
    check_kv_split(prefill_tp, num_kv_heads, "prefill")
    check_kv_split(decode_tp, num_kv_heads, "decode")
    tokens = prompt_len
    head_token_bytes = int(num_layers * 2 * head_dim * elem_bytes)  # K and V of one head, one token
    ranks, whole = [], True
    for d in range(decode_tp):
        segments = head_sources(num_kv_heads, d, decode_tp, prefill_tp)
        sources = [(s.src_rank, kv_head_start(s.src_rank, prefill_tp, num_kv_heads) + s.src_head, s.count)
                   for s in segments]
        heads = sum(s.count for s in segments)
        whole = whole and len(segments) == 1 and segments[0].count == kv_heads_per_rank(prefill_tp, num_kv_heads) \
            == kv_heads_per_rank(decode_tp, num_kv_heads)
        ranks.append(RankReads(d, sources, heads * head_token_bytes * tokens))
    piece = 0 if whole else int(min(s[2] for r in ranks for s in r.sources) * head_dim * elem_bytes)
    return TPPlan(prefill_tp, decode_tp, num_kv_heads, ranks, whole, piece,
                  0 if whole else num_layers * 2 * block_size)


def format_tp_plan(plan: TPPlan, links: list[tuple[str, float]], fmt_bytes, fmt_duration) -> list[str]:
    """Lines for `pdserve plan`'s text output (links: (name, bytes per second))."""
    p, d, k = plan.prefill_tp, plan.decode_tp, plan.num_kv_heads
    lines = [
        f"tensor parallel:  prefill TP={p}, decode TP={d}; {k} KV heads: {kv_heads_per_rank(p, k)} per prefill "
        f"rank, {kv_heads_per_rank(d, k)} per decode rank" + (" (replicated)" if d > k else ""),
    ]
    lines += [f"  {r.describe()}: {fmt_bytes(r.bytes)}" for r in plan.ranks]
    lines.append(f"  all decode ranks: {fmt_bytes(plan.total_bytes)}; the largest rank: "
                 f"{fmt_bytes(plan.max_rank_bytes)}")
    if plan.whole_blocks:
        lines.append("  descriptors: whole blocks, rank to rank (one per run of consecutive blocks)")
    else:
        lines.append(f"  descriptors: one strided descriptor per block run and prefill rank, expanded by NIXL into "
                     f"{plan.pieces_per_block:,} pieces of {plan.piece_bytes:,} B per block (a head slice of each "
                     "token row)")
    lines.append("  wire time with one link per decode rank (the ranks read in parallel):")
    for name, rate in links:
        lines.append(f"  {name:>14}:  {fmt_duration(plan.max_rank_bytes / rate)}")
    return lines
