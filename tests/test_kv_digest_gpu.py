"""The fused lane-sum kernel (pdserve/kv_transfer/lanesum_kernel.py) on a GPU, against its numpy reference (which
tests/test_kv_digest.py checks against vLLM's formula): pools of the shapes pdserve allocates (16-bit, fp8 values
+ scales), scattered block ids, block offsets past 2**31 bytes; `digest_blocks` on a CUDA pool takes the kernel
and agrees with the torch reduction; the TP-split pieces (digest_split) agree between a GPU pool and its host
copy. Skipped without CUDA (the kernel's logic also runs under Triton's interpreter in tests/test_gpu_kernels.py);
benchmarks/gpu_wave.sh's `suite` section runs this file on the GPU machine."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (the fused lane-sum kernel)", allow_module_level=True)
pytest.importorskip("triton")

from pdserve.kv_transfer import lanesum_kernel  # noqa: E402
from pdserve.kv_transfer.digest import VLLM_LANESUM, XXH3_128, digest_blocks, encode, lanesum_torch  # noqa: E402

DEV = "cuda"


def reference(pool: torch.Tensor, ids: list[int]) -> list[tuple[int, int]]:
    rows = pool.view(torch.uint8).reshape(pool.shape[0], -1)[ids].cpu().numpy()
    return lanesum_kernel.lanesum_reference(rows, pool.shape[1] * pool.shape[2])


def bf16_pool(blocks: int, layers: int = 4, block_size: int = 16, heads: int = 8, dim: int = 128) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(0)
    return torch.randn((blocks, layers, 2, block_size, heads, dim), generator=g, device=DEV).to(torch.bfloat16)


@pytest.mark.parametrize("shape,dtype", [
    ((9, 4, 2, 16, 8, 128), torch.bfloat16),  # Llama-3.1-8B's heads, 4 layers
    ((7, 3, 2, 16, 2, 64), torch.float16),
    ((5, 2, 2, 16, 4, 130), torch.uint8),  # fp8: 128 values + 2 scale bytes a row
    ((6, 2, 2, 3, 1, 8), torch.float32),  # a row shorter than the kernel's tile
])
def test_kernel_equals_the_reference(shape, dtype) -> None:
    g = torch.Generator(device=DEV).manual_seed(1)
    if dtype == torch.uint8:
        pool = torch.randint(0, 256, shape, dtype=dtype, device=DEV, generator=g)
    else:
        pool = torch.randn(shape, generator=g, device=DEV).to(dtype)
    ids = [shape[0] - 1, 0, 2, 2]  # scattered, repeated
    regions = shape[1] * shape[2]
    assert lanesum_kernel.supported(pool[0].numel() * pool.element_size(), regions)
    assert lanesum_kernel.lanesum_triton(pool, ids, regions) == reference(pool, ids)


def test_block_offsets_past_2_gib() -> None:
    """Block ids are widened before they meet the block stride: the last block of a 2.5 GiB pool."""
    pool = torch.zeros((1300, 32, 2, 16, 8, 128), dtype=torch.bfloat16, device=DEV)  # 2 MiB blocks
    pool[-1].normal_()
    pool[-2].normal_()
    ids = [1299, 1298, 0]
    assert lanesum_kernel.lanesum_triton(pool, ids, 64) == reference(pool, ids)


def test_digest_blocks_takes_the_kernel_and_agrees_with_torch_and_the_host(monkeypatch) -> None:
    pool = bf16_pool(12)
    ids = [3, 11, 0]
    calls = []
    real = lanesum_kernel.lanesum_triton
    monkeypatch.setattr(lanesum_kernel, "lanesum_triton", lambda *a: calls.append(1) or real(*a))
    got = digest_blocks(pool, ids, VLLM_LANESUM)
    assert calls, "the CUDA pool did not take the fused kernel"
    assert got == lanesum_torch(pool, ids) == digest_blocks(pool.cpu(), ids, VLLM_LANESUM)
    assert got == [encode(a, b) for a, b in reference(pool, ids)]
    pool[11].view(-1)[5] += 1
    assert digest_blocks(pool, ids, VLLM_LANESUM)[1] != got[1]
    assert digest_blocks(pool, ids, XXH3_128) == digest_blocks(pool.cpu(), ids, XXH3_128)  # a host copy


def test_split_pieces_agree_between_a_gpu_pool_and_its_host_copy() -> None:
    from pdserve.kv_transfer.digest_split import SplitLayout, received_digests
    from pdserve.kv_transfer.head_split import BlockGeometry

    pool = bf16_pool(6, layers=2, heads=2, dim=64)  # a TP=2 rank of a 4-KV-head model
    layout = SplitLayout(BlockGeometry(2 * 2 * 16, (64 * 2,)), 4, 4)
    for algo, src_tp in ((VLLM_LANESUM, 1), (VLLM_LANESUM, 4), (XXH3_128, 4)):
        kw = {"dst_rank": 1, "dst_tp": 2, "src_tp": src_tp}
        assert received_digests(pool, [1, 4], algo, layout, **kw) == \
            received_digests(pool.cpu(), [1, 4], algo, layout, **kw)
