"""Per-block KV digests: the producer digests the blocks it holds, the consumer digests what arrived and compares.

Mirrors vLLM's prototype (vllm/distributed/kv_transfer/kv_connector/v1/nixl/digest.py; its validation plan is
tests/v1/kv_connector/nixl_integration/kv_digest_validation.md): one 128-bit digest per block, carried in
`kv_transfer_params` as `remote_block_digests`, each digest the string "h1_h2" (two 64-bit halves in lower-case
hex, no padding), checked after the READ; a mismatch is a load failure under `kv_load_failure_policy`.

Two algorithms, named in the params (`kv_digest_algo`, ours; `pdserve.api.pd.DIGEST_ALGO`):
- `xxh3_128` (CPU pools, the default there): xxHash's XXH3 128-bit over the block's bytes (the `xxhash` package,
  ~10 GB/s a core here), h1 the high and h2 the low 64 bits. Not vLLM's hashing: a vLLM consumer would report
  every block as a mismatch, so pdserve only sends it under this name.
- `vllm_lanesum` (CUDA pools, the default there): vLLM's own: per region row, h1 = the wrapped uint64 sum of the
  8-byte lanes, h2 = the wrapped sum of lane * lane index; a block's digest is the sum over its regions. Our
  region rows are a block's (layer, K/V) slabs, which are vLLM's FlashAttention (NHD) region rows, so the
  values match vLLM's for the same bytes there (not checked against a running vLLM). On a GPU the fused kernel of
  `lanesum_kernel`, elsewhere a torch reduction on the pool's device.

Tensor parallelism: each rank digests its own shard (`remote_block_digests[r]` is producer rank r's list; vLLM's
outer list is the KV-cache group, and with one group and one rank the shapes coincide). A consumer verifies
rank d against producer rank d when both sides have the same TP size. With different sizes a consumer rank's
blocks hold a slice of one producer rank's heads, or the heads of several: each consumer rank then digests what
it received in the producer's terms (`digest_split`: lane sums add up per head across consumer ranks; XXH3
re-assembles a producer rank that one consumer rank holds whole, and a producer rank split over several consumer
ranks is "tp_split", unverified: counted, refused when digests are required).

On a CUDA pool the lane sums run as one fused Triton kernel (`lanesum_kernel`), reading each byte once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

    from pdserve.kv_transfer.digest_split import Received, SplitLayout
    from pdserve.kv_transfer.messages import KvDigestsReply
    from pdserve.kv_transfer.metrics import TransferMetrics
    from pdserve.kv_transfer.pool import KVPool

logger = logging.getLogger("pdserve.kv_transfer")

XXH3_128 = "xxh3_128"
VLLM_LANESUM = "vllm_lanesum"
ALGOS = (XXH3_128, VLLM_LANESUM)
_MASK64 = (1 << 64) - 1


class DigestMismatch(Exception):
    """The bytes that arrived are not the bytes the producer held (the message names rank, block, both
    digests)."""


def encode(h1: int, h2: int) -> str:
    return f"{h1 & _MASK64:x}_{h2 & _MASK64:x}"


class DigestingRank(Protocol):
    """A worker rank that digests its own shard (`kv_rank.RemoteRankAgent`)."""

    def block_digests(self, block_ids: list[int], algo: str) -> list[str]: ...

    def received_digests(self, block_ids: list[int], algo: str, layout: SplitLayout, dst_tp: int,
                         src_tp: int) -> list[Received]: ...


def default_algo(pool: KVPool) -> str:
    """The cheap one where the pool lives: XXH3 on the CPU, vLLM's lane sums on a GPU (a device reduction)."""
    return VLLM_LANESUM if getattr(pool, "is_cuda", False) else XXH3_128


def block_rows(pool: KVPool) -> KVPool:
    """The pool as [num_blocks, block_bytes] uint8 (a view: no copy)."""
    if isinstance(pool, np.ndarray):
        return pool.reshape(pool.shape[0], -1).view(np.uint8)
    import torch

    return pool.view(torch.uint8).reshape(pool.shape[0], -1) if pool.dtype != torch.uint8 \
        else pool.reshape(pool.shape[0], -1)


def _xxh3_row(row: np.ndarray) -> str:
    import xxhash

    v = xxhash.xxh3_128_intdigest(row)
    return encode(v >> 64, v)


def xxh3_rows(rows: KVPool) -> list[str]:
    """XXH3-128 of each row of `rows` ([n, bytes] uint8: numpy, or torch on any device: a GPU's rows are
    copied to the host first)."""
    if not isinstance(rows, np.ndarray):
        rows = rows.cpu().numpy()  # a CPU tensor: the same memory
    return [_xxh3_row(row) for row in rows]


def _xxh3(pool: KVPool, block_ids: Sequence[int]) -> list[str]:
    rows = block_rows(pool)
    if not isinstance(rows, np.ndarray):
        rows = rows.numpy()  # a CPU tensor: the same memory
    return [_xxh3_row(rows[int(b)]) for b in block_ids]  # each block hashed in place, no copy


def _regions(pool: KVPool) -> int:
    """A block's (layer, K/V) slabs: vLLM's FlashAttention region rows (pools are [blocks, layers, 2, ...])."""
    return int(pool.shape[1]) * int(pool.shape[2])


def lanesum_torch(pool: KVPool, block_ids: Sequence[int]) -> list[str]:
    """vLLM's lane sums as a torch reduction on the pool's device (an index_select copy, the weighted product,
    the sums): the path for CPU pools and for blocks that are not whole lanes."""
    import torch

    rows = block_rows(pool) if not isinstance(pool, np.ndarray) else torch.from_numpy(block_rows(pool))
    slabs = _regions(pool)
    width = rows.shape[1]
    if width % (slabs * 8):
        slabs = 1  # a slab is not whole lanes (fp8 rows with inline scales): one region, zero-padded
    idx = torch.as_tensor([int(b) for b in block_ids], dtype=torch.long, device=rows.device)
    sel = rows.index_select(0, idx)
    pad = (-width) % 8
    if pad:
        sel = torch.cat([sel, sel.new_zeros((sel.shape[0], pad))], dim=1)
    lanes = sel.contiguous().view(torch.int64).view(len(block_ids), slabs, -1)
    h1 = lanes.sum(dim=(1, 2))  # int64 arithmetic wraps as uint64 would
    weights = torch.arange(lanes.shape[2], dtype=torch.int64, device=rows.device)
    h2 = (lanes * weights).sum(dim=(1, 2))
    return [encode(a, b) for a, b in zip(h1.tolist(), h2.tolist(), strict=True)]


def _lanesum(pool: KVPool, block_ids: Sequence[int]) -> list[str]:
    """On a CUDA pool of whole-lane region rows the fused Triton kernel (lanesum_kernel: one read of each
    byte), else the torch reduction; both give the same values."""
    if getattr(pool, "is_cuda", False) and pool.is_contiguous():
        from pdserve.kv_transfer import lanesum_kernel

        block_bytes = pool[0].numel() * pool.element_size()
        if lanesum_kernel.supported(block_bytes, _regions(pool)):
            return [encode(a, b) for a, b in lanesum_kernel.lanesum_triton(pool, block_ids, _regions(pool))]
    return lanesum_torch(pool, block_ids)


def digest_blocks(pool: KVPool, block_ids: Sequence[int], algo: str) -> list[str]:
    """One digest per block of `pool` ([num_blocks, num_layers, 2, ...], a torch tensor or numpy array)."""
    if not block_ids:
        return []
    if algo == XXH3_128:
        if getattr(pool, "is_cuda", False):  # a CPU producer's digests on a GPU consumer: copy the blocks over
            import torch

            ids = torch.as_tensor([int(b) for b in block_ids], dtype=torch.long, device=pool.device)
            return _xxh3(pool.index_select(0, ids).cpu(), range(len(block_ids)))
        return _xxh3(pool, block_ids)
    if algo == VLLM_LANESUM:
        return _lanesum(pool, block_ids)
    raise ValueError(f"unknown KV digest algorithm {algo!r} (known: {', '.join(ALGOS)})")


def cpu_block_digest(blocks: torch.Tensor, i: int) -> str:
    """Block i of a CPU tensor of blocks (the KV offload host tier's slots)."""
    return digest_blocks(blocks, [i], XXH3_128)[0]


class BlockDigester:
    """Digests of this instance's blocks on every tensor-parallel rank: rank 0's pool is in this process,
    ranks 1..N-1 answer `block_digests` from their own processes (`kv_rank.RemoteRankAgent`). With `layout`,
    a load from a producer of another TP size is checked too (digest_split)."""

    def __init__(self, pool: KVPool, rank_agents: Sequence[DigestingRank] = (), *, algo: str | None = None,
                 layout: SplitLayout | None = None) -> None:
        self._pool = pool
        self._ranks = list(rank_agents)
        self.algo = algo or default_algo(pool)
        self.tp_size = 1 + len(self._ranks)
        self.layout = layout

    def rank_digests(self, rank: int, block_ids: Sequence[int], algo: str | None = None) -> list[str]:
        algo = algo or self.algo
        if rank == 0:
            return digest_blocks(self._pool, block_ids, algo)
        return list(self._ranks[rank - 1].block_digests([int(b) for b in block_ids], algo))

    def received(self, rank: int, block_ids: Sequence[int], algo: str, src_tp: int) -> list[Received]:
        """Rank `rank`'s digests of what it received from producer ranks of TP size `src_tp` (digest_split)."""
        assert self.layout is not None
        if rank == 0:
            from pdserve.kv_transfer.digest_split import received_digests

            return received_digests(self._pool, block_ids, algo, self.layout, dst_rank=0, dst_tp=self.tp_size,
                                    src_tp=src_tp)
        return list(self._ranks[rank - 1].received_digests([int(b) for b in block_ids], algo, self.layout,
                                                           self.tp_size, src_tp))

    def held(self, block_ids: Sequence[int]) -> tuple[tuple[str, ...], ...]:
        """Every rank's digests of `block_ids` (what `remote_block_digests` carries)."""
        return tuple(tuple(self.rank_digests(r, block_ids)) for r in range(self.tp_size))

    def check(
        self, expected: Sequence[Sequence[str]], algo: str | None, *, src_tp: int, local_ids: Sequence[int],
        positions: Sequence[int], what: str,
    ) -> str | None:
        """Compare the local blocks `local_ids` (which received the producer's blocks at `positions` of its
        list) with the producer's digests. Returns None when every rank's blocks match, or why not all could
        be verified ("absent", "tp_mismatch", "tp_split", "algo"); raises DigestMismatch naming the first bad
        block."""
        if not expected:
            return "absent"
        if algo is None:
            algo = VLLM_LANESUM  # a producer that names no algorithm is vLLM's prototype
        if algo not in ALGOS:
            return "algo"
        if len(expected) != src_tp:
            return "tp_mismatch"
        if src_tp != self.tp_size:
            if self.layout is None:
                return "tp_mismatch"
            from pdserve.kv_transfer.digest_split import check_split
            from pdserve.types.tp_layout import kv_heads_per_rank

            received = [self.received(d, local_ids, algo, src_tp) for d in range(self.tp_size)]
            return check_split(expected, received, algo, src_heads=kv_heads_per_rank(src_tp, self.layout.num_kv_heads),
                               local_ids=local_ids, positions=positions, what=what)
        for rank in range(self.tp_size):
            got = self.rank_digests(rank, local_ids, algo)
            want = [expected[rank][i] for i in positions]
            for k, (w, g) in enumerate(zip(want, got, strict=True)):
                if w != g:
                    raise DigestMismatch(
                        f"KV digest mismatch for {what}: rank {rank}, block {positions[k]} (local block "
                        f"{local_ids[k]}), expected {w}, got {g}; the KV that arrived is not the KV the "
                        "producer held")
        return None


def verify_load(
    digester: BlockDigester, *, metrics: TransferMetrics, policy: str, required: bool, expected: Sequence[Sequence[str]],
    algo: str | None, src_tp: int, local_ids: Sequence[int], positions: Sequence[int], what: str, where: str,
) -> str | None:
    """The check after a READ (`where` "read") or a push (`where` "push"), counted in `metrics`: None when the
    load may be used, else the load failure's message (the engine applies `policy`: recompute or fail)."""
    try:
        why = digester.check(expected, algo, src_tp=src_tp, local_ids=local_ids, positions=positions, what=what)
    except DigestMismatch as exc:
        metrics.record_digest_mismatch(where, "recomputed" if policy == "recompute" else "failed")
        logger.error("%s", exc)
        return str(exc)
    if why is None:
        metrics.record_digest_verified(len(local_ids) * digester.tp_size)
        return None
    metrics.record_digest_unverified(why)
    if required:
        return f"the KV of {what} cannot be verified against block digests ({why}); kv_digest_required is set"
    return None


def check_push(fetch: Callable[[], KvDigestsReply], check: Callable[..., str | None], request_id: str,
               blocks: Sequence[int], first_block: int) -> str | None:
    """After a push completed: `fetch` the prefill's digests of the request's blocks (the `kv_digests` side-channel
    op) and `check` (`KVConsumer.check_digests`) the registered `blocks` (request blocks from `first_block`)."""
    from pdserve.kv_transfer.errors import ProtocolError, SideChannelError, SideChannelRefused

    expected: Sequence[Sequence[str]] = ()
    algo: str | None = None
    try:
        reply = fetch()
    except ProtocolError as exc:  # a reply that is no list of digest strings per rank: never "unverified"
        return f"the prefill's KV digests for request {request_id} are malformed: {exc}"
    except SideChannelRefused as exc:
        logger.info("KV digests of the push into request %s not served: %s", request_id, exc)
    except SideChannelError as exc:
        logger.warning("KV digests of the push into request %s not fetched: %s", request_id, exc)
    else:
        need = first_block + len(blocks)
        if not all(len(r) >= need for r in reply.digests):
            return f"the prefill's KV digests for request {request_id} are malformed (too few)"
        expected, algo = reply.digests, reply.algo
    return check(expected, algo, max(len(expected), 1), blocks, range(first_block, first_block + len(blocks)),
                 f"request {request_id}", "push")
