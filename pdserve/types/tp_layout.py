"""How a decoder splits over tensor-parallel ranks (Megatron-style), and which producer ranks hold the KV
heads a consumer rank needs when prefill and decode run different TP sizes. Torch-free: the KV-transfer
side, preflight and plan use it too.

Per rank r of T (model totals H attention heads, K KV heads, I intermediate, V vocabulary):
- attention heads [r*H/T, (r+1)*H/T) (qkv column-parallel, o_proj row-parallel);
- KV heads [r*K/T, (r+1)*K/T) when T <= K; when T > K each rank keeps one KV head, r*K//T, replicated on
  T/K ranks (vLLM's rule: its query heads all map to that head);
- MLP columns [r*I/T, (r+1)*I/T) of gate and up, the same rows of down (row-parallel);
- vocabulary rows [r*ceil(V/T), ...) of the embedding and the LM head (the last rank's slice may be short;
  its padding rows are zero and cut off the gathered logits).
"""

from __future__ import annotations

from dataclasses import dataclass


class TensorParallelError(ValueError):
    """A tensor-parallel size this model (or this machine) cannot run."""


def check_tensor_parallel(tp: int, *, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Raises TensorParallelError naming the first shape that `tp` does not split."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TensorParallelError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if num_heads % tp:
        raise TensorParallelError(
            f"tensor_parallel_size {tp} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise TensorParallelError(
            f"tensor_parallel_size {tp} and the model's {num_kv_heads} KV heads: one must divide the other "
            "(KV heads are split across ranks, or replicated when there are fewer of them than ranks)")
    if intermediate_size % tp:
        raise TensorParallelError(
            f"tensor_parallel_size {tp} does not divide the model's MLP intermediate size {intermediate_size}")


def kv_heads_per_rank(tp: int, num_kv_heads: int) -> int:
    return max(1, num_kv_heads // tp)


def kv_head_start(rank: int, tp: int, num_kv_heads: int) -> int:
    """The first (global) KV head of `rank`; with replication (tp > num_kv_heads) its only head."""
    return rank * num_kv_heads // tp


@dataclass(frozen=True)
class TPShard:
    """One rank's share of the model's shapes."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    @property
    def heads(self) -> int:
        return self.num_heads // self.size

    @property
    def head_start(self) -> int:
        return self.rank * self.heads

    @property
    def kv_heads(self) -> int:
        return kv_heads_per_rank(self.size, self.num_kv_heads)

    @property
    def kv_start(self) -> int:
        return kv_head_start(self.rank, self.size, self.num_kv_heads)

    @property
    def intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def inter_start(self) -> int:
        return self.rank * self.intermediate

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return min(self.vocab_size, self.rank * self.vocab_per_rank)

    @property
    def vocab_end(self) -> int:
        return min(self.vocab_size, self.vocab_start + self.vocab_per_rank)


def single_rank(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int) -> TPShard:
    return TPShard(0, 1, num_heads, num_kv_heads, intermediate_size, vocab_size)


# ---- KV heads across different TP sizes (P/D) ----------------------------------------------------------
@dataclass(frozen=True)
class HeadSegment:
    """`count` consecutive KV heads that a consumer rank takes from one producer rank: the producer's local
    heads [src_head, src_head + count) land in the consumer's local heads [dst_head, dst_head + count)."""

    src_rank: int
    src_head: int
    dst_head: int
    count: int


def head_sources(num_kv_heads: int, dst_rank: int, dst_tp: int, src_tp: int) -> list[HeadSegment]:
    """Where consumer rank `dst_rank` (of `dst_tp`) reads each of its KV heads from, among `src_tp` producer
    ranks. Mirrors vLLM's mapping (vllm/distributed/kv_transfer/kv_connector/v1/nixl/tp_mapping.py,
    `compute_tp_mapping`): with dst_tp >= src_tp one producer rank, `dst_rank * src_tp // dst_tp`, holds all
    of them; with src_tp > dst_tp they come from ranks from `dst_rank * src_tp // dst_tp` on, and a head
    that several producer ranks hold (replicated KV heads) is read once, from the first of them."""
    first = dst_rank * src_tp // dst_tp
    n_src = kv_heads_per_rank(src_tp, num_kv_heads)
    start = kv_head_start(dst_rank, dst_tp, num_kv_heads)
    segments: list[HeadSegment] = []
    for dst in range(kv_heads_per_rank(dst_tp, num_kv_heads)):
        g = start + dst
        holders = [p for p in range(src_tp)
                   if kv_head_start(p, src_tp, num_kv_heads) <= g < kv_head_start(p, src_tp, num_kv_heads) + n_src]
        src_rank = next((p for p in holders if p >= first), holders[0])
        src = g - kv_head_start(src_rank, src_tp, num_kv_heads)
        last = segments[-1] if segments else None
        if last is not None and last.src_rank == src_rank and last.src_head + last.count == src \
                and last.dst_head + last.count == dst:
            segments[-1] = HeadSegment(src_rank, last.src_head, last.dst_head, last.count + 1)
        else:
            segments.append(HeadSegment(src_rank, src, dst, 1))
    return segments
