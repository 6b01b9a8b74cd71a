"""The fragment arithmetic of pdserve/attention/csrc/fp8_decode.cu, checked in numpy without a GPU.

One warp's 16-token chunk as the kernel moves it: cp.async placement (with the K swizzle), ldmatrix (plain and
transposing) and mma.m16n8k16's fragment layouts as the PTX ISA defines them, the permuted reduction indices,
the P^T buffer's row order. S^T = K . q^T and O^T += V^T . (P * v_scale)^T must equal plain matrix products, for
1, 2, 4 and 8 query heads per KV head, and every ldmatrix must read 8 distinct 16-byte bank slots. The index
expressions are copied from the kernel by hand: change them together.

    python benchmarks/lab/fp8_decode_fragments.py
"""

from __future__ import annotations

import numpy as np

D, CHUNK = 128, 16
K_BYTES = CHUNK * D


def pt_row(k: int) -> int:
    return k ^ ((k >> 3) << 1)


def place_chunk(k_codes: np.ndarray, v_codes: np.ndarray) -> np.ndarray:
    """The stage's K and V bytes where the kernel's cp.async copies put them."""
    smem = np.zeros(2 * K_BYTES, dtype=np.uint8)
    k_flat = k_codes.reshape(-1)
    for lane in range(32):
        for r in range(4):
            dst = (lane // 8) * 128 + 512 * r + (((lane % 8) ^ ((lane >> 3) | ((r & 1) << 2))) * 16)
            src = lane * 16 + 512 * r
            smem[dst:dst + 16] = k_flat[src:src + 16]
            piece = lane + 32 * r
            smem[K_BYTES + piece * 16:K_BYTES + piece * 16 + 16] = v_codes[piece]
    return smem


def ldmatrix_x4(smem: np.ndarray, addrs: list[int]) -> list[list[np.ndarray]]:
    """Per lane, 4 registers of 4 bytes: matrix m's row lane // 4 (address from lane 8m + row), bytes 4 (lane % 4)."""
    for m in range(4):
        slots = sorted((addrs[8 * m + r] % 128) // 16 for r in range(8))
        assert slots == list(range(8)), f"bank conflict: {slots}"
    return [[smem[addrs[8 * m + lane // 4] + 4 * (lane % 4):][:4] for m in range(4)] for lane in range(32)]


def ldmatrix_x2_trans(buf: np.ndarray, rows: list[int]) -> list[list[np.ndarray]]:
    """Per lane, 2 registers of 2 f16: elements (row 2t, col g) and (row 2t + 1, col g) of matrix m (8 heads per
    row; row addresses in elements, from lanes 8m + row)."""
    for m in range(2):
        slots = sorted((rows[8 * m + r] * 2 % 128) // 16 for r in range(8))
        assert slots == list(range(8)), f"bank conflict: {slots}"
    out = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        out.append([np.array([buf[rows[8 * m + 2 * t] + g], buf[rows[8 * m + 2 * t + 1] + g]]) for m in range(2)])
    return out


def a_fragment(table: np.ndarray, top: np.ndarray, bottom: np.ndarray) -> list[np.ndarray]:
    """a_fragment(): a[0] = values 0, 1 of the top row, a[1] of the bottom row, a[2], a[3] values 2, 3."""
    return [table[top[0:2]], table[bottom[0:2]], table[top[2:4]], table[bottom[2:4]]]


def mma(c: np.ndarray, a: list[list[np.ndarray]], b: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """c[lane] (4 accumulators) += A . B, from the lanes' fragments (PTX ISA layouts of m16n8k16, f16)."""
    am, bm = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        am[g, 2 * t:2 * t + 2] = a[lane][0]
        am[g + 8, 2 * t:2 * t + 2] = a[lane][1]
        am[g, 2 * t + 8:2 * t + 10] = a[lane][2]
        am[g + 8, 2 * t + 8:2 * t + 10] = a[lane][3]
        bm[2 * t:2 * t + 2, g] = b[lane][0]
        bm[2 * t + 8:2 * t + 10, g] = b[lane][1]
    cm = am @ bm
    for lane in range(32):
        g, t = lane // 4, lane % 4
        c[lane] += [cm[g, 2 * t], cm[g, 2 * t + 1], cm[g + 8, 2 * t], cm[g + 8, 2 * t + 1]]


def check(group: int, rng: np.random.Generator) -> None:
    table = rng.standard_normal(256)  # the fp8 codes' values (any table: the test is about indices)
    k_codes = rng.integers(0, 256, (CHUNK, D), dtype=np.uint8)  # token-major
    v_codes = rng.integers(0, 256, (D, CHUNK), dtype=np.uint8)  # dim-major
    q = rng.standard_normal((group, D))
    v_scale = rng.random(CHUNK) + 0.5
    smem = place_chunk(k_codes, v_codes)

    qb = np.zeros((32, 8, 2, 2))  # the kernel's qb[j][0..1] per lane
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for j in range(8):
            d0 = 16 * j + 4 * t
            if g < group:
                qb[lane, j, 0], qb[lane, j, 1] = q[g, d0:d0 + 2], q[g, d0 + 2:d0 + 4]
    s = np.zeros((32, 4))
    for jj in range(4):
        addrs = []
        for lane in range(32):
            k_row, kstep = (lane % 8) + 8 * ((lane // 8) & 1), 2 * jj + lane // 16
            addrs.append(k_row * 128 + ((kstep ^ (k_row & 7)) * 16))
        regs = ldmatrix_x4(smem, addrs)
        for half in range(2):
            a = [a_fragment(table, regs[lane][2 * half], regs[lane][2 * half + 1]) for lane in range(32)]
            mma(s, a, [(qb[lane, 2 * jj + half, 0], qb[lane, 2 * jj + half, 1]) for lane in range(32)])
    want_s = table[k_codes] @ q.T  # [tokens, heads]
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i, (tok, h) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
            assert abs(s[lane][i] - (want_s[tok, h] if h < group else 0.0)) < 1e-9, (group, lane, i)

    p = rng.random((CHUNK, 8))  # probabilities [token, head]
    p[:, group:] = 0
    buf = np.zeros(CHUNK * 8)  # the P^T buffer, f16 elements, one row of 8 heads per token (in row pt_row(token))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for tok in (g, g + 8):
            buf[pt_row(tok) * 8 + 2 * t:pt_row(tok) * 8 + 2 * t + 2] = p[tok, 2 * t:2 * t + 2] * v_scale[tok]
    rows = [pt_row(4 * ((lane % 8) // 2) + (lane % 2) + 2 * ((lane // 8) & 1)) * 8 for lane in range(32)]
    pb = ldmatrix_x2_trans(buf, rows)
    acc = np.zeros((8, 32, 4))
    for nq in range(4):
        regs = ldmatrix_x4(smem, [K_BYTES + (32 * nq + lane) * 16 for lane in range(32)])
        for half in range(2):
            a = [a_fragment(table, regs[lane][2 * half], regs[lane][2 * half + 1]) for lane in range(32)]
            mma(acc[2 * nq + half], a, [(pb[lane][0], pb[lane][1]) for lane in range(32)])
    want_o = table[v_codes] @ (p * v_scale[:, None])  # [head_dim, heads]
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for mt in range(8):
            cells = [(16 * mt + g, 2 * t), (16 * mt + g, 2 * t + 1), (16 * mt + g + 8, 2 * t), (16 * mt + g + 8, 2 * t + 1)]
            for i, (d, h) in enumerate(cells):
                assert abs(acc[mt][lane][i] - want_o[d, h]) < 1e-9, (group, lane, mt, i)


def main() -> None:
    rng = np.random.default_rng(1)
    for group in (1, 2, 4, 8):
        check(group, rng)
        print(f"{group} query heads per KV head: S^T and O^T fragments match, no bank conflicts")


if __name__ == "__main__":
    main()
