"""Block digests across different tensor-parallel sizes: a consumer rank checks the bytes it received in the
producer's terms.

A producer digests each of its ranks' blocks as that rank holds them (`remote_block_digests[s]`: rank s's heads,
laid out by `head_split.BlockGeometry` for s's head count). When the consumer runs another TP size, a consumer
rank's block holds a slice of heads of one producer rank (decode TP > prefill TP) or the heads of several
(decode TP < prefill TP), placed at other offsets (`head_split.plan_rank_reads` moves them). Each consumer rank
digests what it received, piece by piece, so that the pieces add up to the producer's digests:

- `vllm_lanesum` decomposes: a block's (h1, h2) is a sum over its 8-byte lanes of (lane, lane * index), the
  index counted in the producer's (layer, K/V) region row. So each consumer rank sums, per producer head it holds,
  its lanes weighted by the index that lane had in the producer's block (`Received` with a head); the checker adds
  the heads of each producer rank, whichever consumer ranks hold them, and compares with that rank's digest.
  Every byte every consumer rank received is counted; a head that several consumer ranks hold (fewer KV heads
  than ranks: replicated) must arrive equal on each. Needs every head's piece to be whole lanes (`_lane_fields`).
- `xxh3_128` does not decompose: a consumer rank that holds all the heads of a producer rank re-assembles that
  rank's block (its heads in the producer's order and layout: a copy) and hashes it (`Received` without a head:
  the whole rank). A producer rank whose heads are split over several consumer ranks (decode TP > prefill TP)
  cannot be checked this way: those pieces come back without digests and the load counts as unverified
  ("tp_split"; a producer with `kv_digest_algo: vllm_lanesum` makes it checkable).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.kv_transfer.digest import VLLM_LANESUM, XXH3_128, DigestMismatch, encode, xxh3_rows
from pdserve.kv_transfer.head_split import BlockGeometry
from pdserve.types.tp_layout import head_sources, kv_heads_per_rank

if TYPE_CHECKING:
    import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SplitLayout:
    """What digesting a block in another TP size's terms needs (the same on both sides: the compatibility dict)."""

    geometry: BlockGeometry
    num_kv_heads: int
    regions: int  # a block's (layer, K/V) region rows: the rows vLLM's lane sums index lanes in


@dataclass(frozen=True)
class Received:
    """A consumer rank's digests, one per block, of what it received from producer rank `src_rank`: of its head
    `src_head` (lane sums, partial), or of the whole rank (`src_head` -1, re-assembled); no digests: not
    checkable with this algorithm."""

    src_rank: int
    src_head: int
    digests: tuple[str, ...]


def received_digests(pool: torch.Tensor, block_ids: Sequence[int], algo: str, layout: SplitLayout, *, dst_rank: int,
                     dst_tp: int, src_tp: int) -> list[Received]:
    """Consumer rank `dst_rank`'s digests of its blocks `block_ids` (in `pool`, torch, any device), in the terms of
    producer ranks of TP size `src_tp`."""
    import torch

    from pdserve.kv_transfer.digest import block_rows

    k = layout.num_kv_heads
    segments = head_sources(k, dst_rank, dst_tp, src_tp)
    dst_heads, src_heads = kv_heads_per_rank(dst_tp, k), kv_heads_per_rank(src_tp, k)
    g = layout.geometry
    n = len(block_ids)
    ids = torch.as_tensor([int(b) for b in block_ids], dtype=torch.long, device=pool.device)
    units = block_rows(pool).index_select(0, ids).view(n, g.units_per_block, g.unit_bytes(dst_heads))
    src_of = {}  # local head -> (producer rank, its head there)
    for seg in segments:
        for c in range(seg.count):
            src_of[seg.dst_head + c] = (seg.src_rank, seg.src_head + c)
    if algo == VLLM_LANESUM:
        if not _lane_fields(g, layout.regions, src_heads):
            return [Received(s, h, ()) for s, h in src_of.values()]
        h1, h2 = _head_lanesums(units, g, layout.regions, dst_heads, src_heads, [src_of[j][1] for j in range(dst_heads)])
        return [Received(s, h, tuple(encode(a, b) for a, b in zip(h1[j], h2[j], strict=True)))
                for j, (s, h) in sorted(src_of.items())]
    if algo != XXH3_128:
        raise ValueError(f"unknown KV digest algorithm {algo!r}")
    out = []
    for s in sorted({s for s, _ in src_of.values()}):
        local = {h: j for j, (r, h) in src_of.items() if r == s}
        if len(local) != src_heads:
            out.append(Received(s, -1, ()))  # part of rank s: the rest is on other consumer ranks
            continue
        order = torch.as_tensor([local[h] for h in range(src_heads)], dtype=torch.long, device=pool.device)
        parts = []
        for f, hb in enumerate(g.field_head_bytes):
            off = g.field_offset(f, dst_heads)
            field = units[:, :, off:off + dst_heads * hb].reshape(n, g.units_per_block, dst_heads, hb)
            parts.append(field.index_select(2, order).reshape(n, g.units_per_block, src_heads * hb))
        whole = torch.cat(parts, dim=2).reshape(n, -1)
        out.append(Received(s, -1, tuple(xxh3_rows(whole))))
    return out


def _lane_fields(g: BlockGeometry, regions: int, src_heads: int) -> bool:
    """Every head's piece of every field is whole lanes, and so are the producer's region rows."""
    return (all(hb % 8 == 0 for hb in g.field_head_bytes) and g.units_per_block % regions == 0
            and (g.units_per_block // regions * g.unit_bytes(src_heads)) % 8 == 0)


def _head_lanesums(units: torch.Tensor, g: BlockGeometry, regions: int, dst_heads: int, src_heads: int,
                   src_head_of: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Per local head j and block: (sum of its lanes, sum of lane * the lane's index in the producer's region
    row), the head placed at producer head src_head_of[j]."""
    import torch

    n, num_units, _ = units.shape
    dev = units.device
    per_region = num_units // regions  # units in one region row (token rows of a token-major pool; else 1)
    src_unit = g.unit_bytes(src_heads)
    u = torch.arange(num_units, dtype=torch.int64, device=dev)
    src_head = torch.as_tensor(list(src_head_of), dtype=torch.int64, device=dev)
    h1 = torch.zeros((n, dst_heads), dtype=torch.int64, device=dev)
    h2 = torch.zeros((n, dst_heads), dtype=torch.int64, device=dev)
    for f, hb in enumerate(g.field_head_bytes):
        off = g.field_offset(f, dst_heads)
        lanes = units[:, :, off:off + dst_heads * hb].contiguous().view(torch.int64)
        lanes = lanes.view(n, num_units, dst_heads, hb // 8)
        # the lane's index in the producer's row: its unit's place in the row, the field, then head and lane
        base = ((u % per_region) * src_unit + g.field_offset(f, src_heads)) // 8
        weight = base[:, None] + torch.arange(hb // 8, dtype=torch.int64, device=dev)[None, :]
        s1 = lanes.sum(dim=(1, 3))
        s2 = (lanes * weight[None, :, None, :]).sum(dim=(1, 3)) + s1 * (src_head * (hb // 8))[None, :]
        h1 += s1
        h2 += s2
    return h1.T.tolist(), h2.T.tolist()


def check_split(expected: Sequence[Sequence[str]], received: Sequence[Sequence[Received]], algo: str, *,
                src_heads: int, local_ids: Sequence[int], positions: Sequence[int], what: str) -> str | None:
    """Compare what every consumer rank received (`received[d]`: rank d's `received_digests`) with the producer's
    digests (`expected[s][position]`). None when every byte checked out; "tp_split" when some could not be
    checked (xxh3 over a split producer rank); raises DigestMismatch at the first bad block."""
    unchecked = False
    heads: dict[tuple[int, int], tuple[int, tuple[str, ...]]] = {}
    for d, pieces in enumerate(received):
        for p in pieces:
            if not p.digests:
                unchecked = True
            elif p.src_head < 0:
                _compare(expected, p.src_rank, p.digests, local_ids, positions, what, f"consumer rank {d}")
            else:
                seen = heads.setdefault((p.src_rank, p.src_head), (d, p.digests))
                if seen[1] != p.digests:
                    k = next(i for i, (a, b) in enumerate(zip(seen[1], p.digests, strict=True)) if a != b)
                    raise DigestMismatch(
                        f"KV digest mismatch for {what}: producer rank {p.src_rank}'s head {p.src_head} of block "
                        f"{positions[k]} (local block {local_ids[k]}) differs between consumer ranks {seen[0]} and "
                        f"{d}, which both hold it; the KV that arrived is not the KV the producer held")
    if algo == VLLM_LANESUM:
        for s in sorted({s for s, _ in heads}):
            if any((s, h) not in heads for h in range(src_heads)):
                unchecked = True
                continue
            sums = [(sum(_halves(heads[(s, h)][1][k])[0] for h in range(src_heads)) & _MASK64,
                     sum(_halves(heads[(s, h)][1][k])[1] for h in range(src_heads)) & _MASK64)
                    for k in range(len(local_ids))]
            holders = sorted({heads[(s, h)][0] for h in range(src_heads)})
            _compare(expected, s, [encode(a, b) for a, b in sums], local_ids, positions, what,
                     f"consumer rank{'s' if len(holders) > 1 else ''} {', '.join(map(str, holders))}")
    return "tp_split" if unchecked else None


def _halves(digest: str) -> tuple[int, int]:
    a, b = digest.split("_")
    return int(a, 16), int(b, 16)


def _compare(expected: Sequence[Sequence[str]], src_rank: int, got: Sequence[str], local_ids: Sequence[int],
             positions: Sequence[int], what: str, where: str) -> None:
    for k, g in enumerate(got):
        w = expected[src_rank][positions[k]]
        if w != g:
            raise DigestMismatch(
                f"KV digest mismatch for {what}: producer rank {src_rank}, block {positions[k]} (local block "
                f"{local_ids[k]}, as {where} received it), expected {w}, got {g}; the KV that arrived is not "
                "the KV the producer held")
