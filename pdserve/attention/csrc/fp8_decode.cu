// Paged decode attention over an fp8 KV cache (pdserve/attention/fp8_kv.py's layout), sm_89 and later.
//
// Why a hand-written kernel: the Triton kernel reads the fp8 cache at 4.0 TB/s on an H200 where the bf16
// kernel reaches 4.4 (BENCHMARKS.md, FP8 KV cache, run 6). What is left in its loop is shared-memory round
// trips of q and p that Triton's operand layout for 8-bit tiles forces. Here q stays in registers and the
// 8-bit tiles become matrix-product operands with one conversion instruction per pair of values:
//
// - one warp owns a 16-token chunk at a time (one KV block at block size 16) of one (sequence, kv head). The
//   products are computed transposed, the G <= 8 query heads of the group as the n = 8 columns of m16n8k16:
//   S^T = K . q^T (tokens x heads), then O^T += V^T . P^T (head_dim x heads). So K and V are the "A" operands,
//   16 rows each, with nothing wasted on them, and the output accumulator is 8 m-tiles of 4 registers;
// - K and V bytes go global -> shared by cp.async (a per-warp pipeline of STAGES chunks), shared -> registers
//   by ldmatrix on the *bytes* (an 8x8 b16 matrix is 8 rows of 16 fp8 values: each thread gets 4 consecutive
//   values of one row), and each pair of fp8 values becomes an f16x2 operand register with one
//   cvt.rn.f16x2.e4m3x2 (exact);
// - the 4 values a thread gets are not the ones the mma's fragment layout puts in a thread, so the
//   reduction index is permuted instead of the data: for S^T the head dimension (q is loaded into its
//   fragments in the same permuted order, once), for O^T the token: P^T goes through a 256-byte per-warp
//   buffer (two 4-byte stores per thread) and comes back with one transposing ldmatrix whose row addresses
//   put the tokens in that order;
// - K is stored token-major [kv_heads, block, head_dim], V dim-major [kv_heads, head_dim, block]: both
//   are read as 16-byte rows, K swizzled in shared memory (row stride 128 bytes), V conflict-free as is;
// - each key's scale multiplies its score, each value's scale its probability (the Triton kernel's
//   arithmetic: f16 products of the exact fp8 values, f32 accumulation);
// - the CTA's warps take chunks in turn and combine their (max, sum, acc) through shared memory at the end;
//   a CTA is one split of one (sequence, kv head): with one split it writes the output, else the partial
//   output and log-sum-exp in triton_kernels.decode_attention's format for its merge kernel.
//
// Host side: pdserve/attention/cuda_fp8_decode.py (builds this file with nvcc once per source hash, loads it
// with ctypes, launches on torch's current stream: CUDA graphs capture it like any kernel).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int D = 128;      // head_dim
constexpr int CHUNK = 16;   // tokens per warp iteration
constexpr int K_BYTES = CHUNK * D;
constexpr int V_BYTES = CHUNK * D;
constexpr int SCALE_BYTES = CHUNK * 2;  // one bf16 per token (and kv head)
constexpr int STAGE_BYTES = K_BYTES + V_BYTES + 2 * SCALE_BYTES;
constexpr int PT_BYTES = CHUNK * 8 * 2;  // a warp's P^T buffer: 16 tokens x 8 heads, f16
constexpr unsigned FULL = 0xffffffffu;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t addr, uint32_t& r0, uint32_t& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(addr));
}

// four fp8 values (lowest byte first) -> two f16x2 (values 0, 1 and 2, 3; the lower value in the lower half),
// exact; the halves of the source register are the conversions' 16-bit operands (no shifts)
template <bool E5M2>
__device__ __forceinline__ void fp8x4_to_f16x2x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
  if constexpr (E5M2) {
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e5m2x2 %0, l;\ncvt.rn.f16x2.e5m2x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(four));
  } else {
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(four));
  }
}

// c += a (16x16) . b (16x8): f16 operands, f32 accumulators
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of a 16x16 tile from two ldmatrix registers holding 4 fp8 values each: `top` = row g (the
// fragment's rows 0..7), `bottom` = row g + 8, values 4t..4t+3. Its logical columns 2t, 2t+1 take values
// 4t, 4t+1 and columns 2t+8, 2t+9 values 4t+2, 4t+3: the permutation of the reduction index described above.
template <bool E5M2>
__device__ __forceinline__ void a_fragment(uint32_t top, uint32_t bottom, uint32_t (&a)[4]) {
  fp8x4_to_f16x2x2<E5M2>(top, a[0], a[2]);
  fp8x4_to_f16x2x2<E5M2>(bottom, a[1], a[3]);
}

// The row of token k (0..15) in a warp's P^T buffer: the 8 tokens of each transposing read ({0,1,4,5,8,9,12,13}
// and {2,3,6,7,10,11,14,15}) land in 8 different 16-byte slots of a 128-byte bank line (no conflicts)
__device__ __forceinline__ int pt_row(int k) { return k ^ ((k >> 3) << 1); }

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ float bf16_at(const uint8_t* p) {
  return __uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16);
}

// max (MAX) or sum of x over the 8 lanes with the same t = lane % 4 (the tokens of a head's score column, or a
// head's partial sums)
template <bool MAX>
__device__ __forceinline__ float over_rows(float x) {
#pragma unroll
  for (int mask = 4; mask < 32; mask *= 2) {
    const float y = __shfl_xor_sync(FULL, x, mask);
    x = MAX ? fmaxf(x, y) : x + y;
  }
  return x;
}

struct Params {
  const void* q;
  int64_t q_stride_b, q_stride_h;  // elements
  const uint8_t* k_cache;
  const uint8_t* v_cache;
  int64_t stride_blk;  // bytes between consecutive blocks' regions
  const int64_t* block_tables;  // int64, as the engine's GPU path builds its metadata
  int64_t stride_bt;
  const int64_t* seq_lens;
  void* out;
  int64_t out_stride_b, out_stride_h;  // elements
  float* part_o;    // [B, H, splits, D] when splits > 1
  float* part_lse;  // [B, H, splits]
  int num_heads, kv_heads, block_size, num_splits;
  float scale_log2;  // softmax scale * log2(e)
};

template <typename QT, int G, int WARPS, int STAGES, bool E5M2>
__global__ void __launch_bounds__(WARPS * 32, STAGES <= 3 ? 4 : 2)
    fp8_decode_kernel(const Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int b = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // fragment row group and column pair
  const int seq_len = static_cast<int>(p.seq_lens[b]);
  const int n_chunks = (seq_len + CHUNK - 1) / CHUNK;
  const int per_split = (n_chunks + p.num_splits - 1) / p.num_splits;
  const int c_lo = split * per_split;
  const int c_hi = min(n_chunks, c_lo + per_split);
  const int bs = p.block_size;
  const int64_t* bt_row = p.block_tables + static_cast<int64_t>(b) * p.stride_bt;
  // byte offsets inside a block's region: this head's values, and its scales after all heads' values
  const int64_t head_values = static_cast<int64_t>(kvh) * bs * D;
  const int64_t head_scales = static_cast<int64_t>(p.kv_heads) * bs * D + static_cast<int64_t>(kvh) * bs * 2;

  // q^T as the B fragments of S^T = K . q^T (n = head g), head dimension permuted like K's A fragments: for
  // k-step j, dims 16j + 4t + {0, 1} (logical rows 2t, 2t+1) and 16j + 4t + {2, 3} (logical 2t+8, 2t+9), as f16
  // (exact for bf16 in f16's range). Heads >= G are zero.
  uint32_t qb[8][2];
  {
    const bool real = g < G;
    const QT* qrow = static_cast<const QT*>(p.q) + b * p.q_stride_b + (kvh * G + (real ? g : 0)) * p.q_stride_h;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int d0 = 16 * j + 4 * t;
      float v0 = 0.f, v1 = 0.f, v2 = 0.f, v3 = 0.f;
      if (real) {
        v0 = static_cast<float>(qrow[d0]);  // __half and __nv_bfloat16 convert both ways
        v1 = static_cast<float>(qrow[d0 + 1]);
        v2 = static_cast<float>(qrow[d0 + 2]);
        v3 = static_cast<float>(qrow[d0 + 3]);
      }
      qb[j][0] = pack_f16x2(v0, v1);
      qb[j][1] = pack_f16x2(v2, v3);
    }
  }

  uint8_t* wsmem = smem + warp * STAGES * STAGE_BYTES;
  const uint32_t wbase = smem_addr(wsmem);
  const uint32_t pt_base = smem_addr(smem + WARPS * STAGES * STAGE_BYTES + warp * PT_BYTES);
  const int my_chunks = c_hi - c_lo > warp ? (c_hi - c_lo - warp + WARPS - 1) / WARPS : 0;

  const int bs_shift = 31 - __clz(bs);  // the block size is a power of two, a multiple of 16
  // The block id of this warp's i-th chunk: a global load, made one chunk ahead of its use.
  auto block_of = [&](int i) -> int64_t {
    return i < my_chunks ? bt_row[((c_lo + warp + i * WARPS) * CHUNK) >> bs_shift] : 0;
  };
  // Per-lane parts of a chunk's loads (each matrix is 128 pieces of 16 bytes, 4 per lane). K piece lane + 32r is
  // token row lane / 8 + 4r, column lane % 8: source byte lane * 16 + 512r of the chunk's 16 rows; in shared
  // memory a row's 16-byte columns are XOR-swizzled by row & 7 = (lane >> 3) | 4 (r & 1), so that the 8 rows
  // an ldmatrix reads (0..7 or 8..15) cover the 32 banks once.
  // V piece lane + 32r is head_dim row lane + 32r: its 16 bytes (tokens) sit at (lane + 32r) * block_size.
  const uint32_t k_row0 = (lane / 8) * 128;
  const int k_col = lane % 8;
  // Issues the loads of this warp's i-th chunk (in block `blk`) into `stage`; an empty group past the end keeps
  // the wait counts uniform.
  auto issue = [&](int i, int64_t blk, int stage) {
    if (i < my_chunks) {
      const int in_blk = ((c_lo + warp + i * WARPS) * CHUNK) & (bs - 1);
      const int64_t region = blk * p.stride_blk + head_values;
      const uint8_t* k_src = p.k_cache + region + in_blk * D + lane * 16;
      const uint8_t* v_src = p.v_cache + region + static_cast<int64_t>(lane) * bs + in_blk;
      const uint32_t st = wbase + stage * STAGE_BYTES;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        cp_async16(st + k_row0 + 512 * r + ((k_col ^ ((lane >> 3) | ((r & 1) << 2))) * 16), k_src + 512 * r);
        cp_async16(st + K_BYTES + (lane + 32 * r) * 16, v_src + static_cast<int64_t>(32 * r) * bs);
      }
      if (lane < 4) {  // the 16 tokens' K scales (lanes 0, 1) and V scales (2, 3): 32 bytes each
        const uint8_t* src = (lane < 2 ? p.k_cache : p.v_cache) + blk * p.stride_blk + head_scales + in_blk * 2;
        cp_async16(st + K_BYTES + V_BYTES + (lane / 2) * SCALE_BYTES + (lane % 2) * 16, src + (lane % 2) * 16);
      }
    }
    cp_async_commit();
  };

  // O^T accumulators: m-tile mt holds dims 16mt + g (regs 0, 1) and 16mt + g + 8 (regs 2, 3), heads 2t, 2t + 1
  float acc[8][4];
#pragma unroll
  for (int mt = 0; mt < 8; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
  // heads 2t and 2t + 1: running max (the same in all 8 lanes of the head) and this lane's part of the sum
  float m_run[2] = {-INFINITY, -INFINITY}, l_part[2] = {0.f, 0.f};

  // ldmatrix row addresses that do not depend on the chunk. K: lane L gives row (L % 8) + 8 ((L / 8) & 1) of
  // 16-byte column 2jj + L / 16: matrices (rows 0-7, step 2jj), (8-15, 2jj), (0-7, 2jj+1), (8-15, 2jj+1).
  const int k_row = (lane % 8) + 8 * ((lane / 8) & 1);
  const int k_step_off = lane / 16;
  // P^T buffer [16 tokens][8 heads] f16, one 16-byte row per token (token k in row pt_row(k)): the transposing
  // ldmatrix reads logical row r of matrix 0 from token 4 (r / 2) + r % 2 and of matrix 1 from that token + 2
  // (lanes 0-7 and 8-15 give the rows)
  const int pt_r = lane % 8;
  const uint32_t pt_read = pt_base + pt_row(4 * (pt_r / 2) + (pt_r % 2) + 2 * ((lane / 8) & 1)) * 16;

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue(i, block_of(i), i);
  int64_t blk_ahead = block_of(STAGES - 1);
  int stage = 0;  // chunk i's stage: i % STAGES

  for (int i = 0; i < my_chunks; ++i) {
    __syncwarp();  // every lane is done with the stage the next issue overwrites (read in iteration i - 1)
    issue(i + STAGES - 1, blk_ahead, stage == 0 ? STAGES - 1 : stage - 1);
    blk_ahead = block_of(i + STAGES);
    cp_async_wait<STAGES - 1>();
    __syncwarp();
    const uint32_t st = wbase + stage * STAGE_BYTES;
    const uint8_t* st_ptr = wsmem + stage * STAGE_BYTES;
    stage = stage == STAGES - 1 ? 0 : stage + 1;

    // S^T (tokens x heads): s[0], s[1] = token g, heads 2t, 2t+1; s[2], s[3] = token g + 8; even and odd
    // k-steps accumulate apart (two shorter dependency chains)
    float s[4] = {0.f, 0.f, 0.f, 0.f}, s_odd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int kstep = 2 * jj + k_step_off;
      uint32_t r[4];
      ldmatrix_x4(st + k_row * 128 + ((kstep ^ (k_row & 7)) * 16), r);
      uint32_t a[4];
      a_fragment<E5M2>(r[0], r[1], a);
      mma(s, a, qb[2 * jj][0], qb[2 * jj][1]);
      a_fragment<E5M2>(r[2], r[3], a);
      mma(s_odd, a, qb[2 * jj + 1][0], qb[2 * jj + 1][1]);
    }
    const uint8_t* scales = st_ptr + K_BYTES + V_BYTES;
    const float ks_lo = bf16_at(scales + 2 * g), ks_hi = bf16_at(scales + 2 * (g + 8));
    const float vs_lo = bf16_at(scales + SCALE_BYTES + 2 * g), vs_hi = bf16_at(scales + SCALE_BYTES + 2 * (g + 8));
    const int tok = (c_lo + warp + i * WARPS) * CHUNK + g;
    const float f_lo = tok < seq_len ? ks_lo * p.scale_log2 : 0.f;
    const float f_hi = tok + 8 < seq_len ? ks_hi * p.scale_log2 : 0.f;
    float x[4];
    x[0] = tok < seq_len ? (s[0] + s_odd[0]) * f_lo : -INFINITY;
    x[1] = tok < seq_len ? (s[1] + s_odd[1]) * f_lo : -INFINITY;
    x[2] = tok + 8 < seq_len ? (s[2] + s_odd[2]) * f_hi : -INFINITY;
    x[3] = tok + 8 < seq_len ? (s[3] + s_odd[3]) * f_hi : -INFINITY;
    float m_new[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) m_new[h] = fmaxf(m_run[h], over_rows<true>(fmaxf(x[h], x[h + 2])));  // finite
    if (__any_sync(FULL, m_new[0] != m_run[0] || m_new[1] != m_run[1])) {
      const float alpha[2] = {exp2f(m_run[0] - m_new[0]), exp2f(m_run[1] - m_new[1])};
#pragma unroll
      for (int mt = 0; mt < 8; ++mt) {
        acc[mt][0] *= alpha[0];
        acc[mt][1] *= alpha[1];
        acc[mt][2] *= alpha[0];
        acc[mt][3] *= alpha[1];
      }
      l_part[0] *= alpha[0];
      l_part[1] *= alpha[1];
      m_run[0] = m_new[0];
      m_run[1] = m_new[1];
    }
    float pr[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pr[e] = exp2f(x[e] - m_run[e % 2]);
      l_part[e % 2] += pr[e];
    }
    // P^T with the values' scales, through the warp's buffer: token g's heads 2t, 2t+1 and token g + 8's
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(pt_base + pt_row(g) * 16 + 4 * t),
                 "r"(pack_f16x2(pr[0] * vs_lo, pr[1] * vs_lo)));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(pt_base + pt_row(g + 8) * 16 + 4 * t),
                 "r"(pack_f16x2(pr[2] * vs_hi, pr[3] * vs_hi)));
    __syncwarp();
    uint32_t pb0, pb1;  // B fragment of P^T: head g, logical rows 2t, 2t+1 (tokens 4t, 4t+1) and 2t+8, 2t+9
    ldmatrix_x2_trans(pt_read, pb0, pb1);
#pragma unroll
    for (int nq = 0; nq < 4; ++nq) {
      uint32_t r[4];  // dims 32nq + 8m + g, tokens 4t..4t+3, for m = 0..3
      ldmatrix_x4(st + K_BYTES + (32 * nq + lane) * 16, r);
      uint32_t a[4];
      a_fragment<E5M2>(r[0], r[1], a);
      mma(acc[2 * nq], a, pb0, pb1);
      a_fragment<E5M2>(r[2], r[3], a);
      mma(acc[2 * nq + 1], a, pb0, pb1);
    }
  }
  cp_async_wait<0>();
  l_part[0] = over_rows<false>(l_part[0]);
  l_part[1] = over_rows<false>(l_part[1]);

  // combine the warps: (max, sum) per head and the accumulators of heads < G through shared memory (the
  // pipeline's, now idle)
  __syncthreads();
  float* w_acc = reinterpret_cast<float*>(smem);  // [WARPS][G][D]
  float* w_m = w_acc + WARPS * G * D;             // [WARPS][G]
  float* w_l = w_m + WARPS * G;                   // [WARPS][G]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = 2 * t + h;
    if (head < G) {
#pragma unroll
      for (int mt = 0; mt < 8; ++mt) {
        w_acc[(warp * G + head) * D + 16 * mt + g] = acc[mt][h];
        w_acc[(warp * G + head) * D + 16 * mt + g + 8] = acc[mt][h + 2];
      }
      if (g == 0) {
        w_m[warp * G + head] = m_run[h];
        w_l[warp * G + head] = l_part[h];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += WARPS * 32) {
    const int h = idx / D, d = idx % D;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, w_m[w * G + h]);
    const float m_safe = m == -INFINITY ? 0.f : m;
    float l = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float f = exp2f(w_m[w * G + h] - m_safe);  // 0 for a warp that saw no key
      l += f * w_l[w * G + h];
      o += f * w_acc[(w * G + h) * D + d];
    }
    o = l > 0.f ? o / l : 0.f;
    const int head = kvh * G + h;
    if (p.num_splits == 1) {
      static_cast<QT*>(p.out)[b * p.out_stride_b + head * p.out_stride_h + d] = QT(o);
    } else {
      const int64_t row = (static_cast<int64_t>(b) * p.num_heads + head) * p.num_splits + split;
      p.part_o[row * D + d] = o;
      if (d == 0) p.part_lse[row] = l > 0.f ? m + log2f(l) : -INFINITY;
    }
  }
}

template <typename QT, int G, int WARPS, int STAGES, bool E5M2>
int launch(const Params& p, int batch, cudaStream_t stream) {
  constexpr int smem_pipe = WARPS * (STAGES * STAGE_BYTES + PT_BYTES);
  constexpr int smem_combine = (WARPS * G * D + 2 * WARPS * G) * 4;
  constexpr int smem = smem_pipe > smem_combine ? smem_pipe : smem_combine;
  auto kernel = fp8_decode_kernel<QT, G, WARPS, STAGES, E5M2>;
  // on every call (it is per device, and a host-side setting: legal while a stream is being captured)
  cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr == cudaSuccess) {  // the largest shared memory split, so that 4 CTAs of 51 KB fit on an SM
    attr = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  }
  if (attr != cudaSuccess) return static_cast<int>(attr);
  dim3 grid(batch, p.kv_heads, p.num_splits);
  kernel<<<grid, WARPS * 32, smem, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <typename QT, int WARPS, int STAGES, bool E5M2>
int dispatch_group(const Params& p, int group, int batch, cudaStream_t stream) {
  switch (group) {
    case 1: return launch<QT, 1, WARPS, STAGES, E5M2>(p, batch, stream);
    case 2: return launch<QT, 2, WARPS, STAGES, E5M2>(p, batch, stream);
    case 4: return launch<QT, 4, WARPS, STAGES, E5M2>(p, batch, stream);
    case 8: return launch<QT, 8, WARPS, STAGES, E5M2>(p, batch, stream);
    default: return -1;
  }
}

template <typename QT, bool E5M2>
int dispatch_config(const Params& p, int group, int batch, int stages, cudaStream_t stream) {
  switch (stages) {
    case 2: return dispatch_group<QT, 4, 2, E5M2>(p, group, batch, stream);
    case 3: return dispatch_group<QT, 4, 3, E5M2>(p, group, batch, stream);
    case 4: return dispatch_group<QT, 4, 4, E5M2>(p, group, batch, stream);
    case 6: return dispatch_group<QT, 4, 6, E5M2>(p, group, batch, stream);
    default: return -2;
  }
}

}  // namespace

// The one entry point (ctypes): 0 on success, a cudaError_t, or -1 (unsupported group) / -2 (unsupported
// stage count). q_is_bf16: bfloat16 queries and output, else float16; e5m2: the cache's fp8 format.
extern "C" int pdserve_fp8_decode(const void* q, int64_t q_stride_b, int64_t q_stride_h, const void* k_cache,
                                  const void* v_cache, int64_t stride_blk, const void* block_tables,
                                  int64_t stride_bt, const void* seq_lens, void* out, int64_t out_stride_b,
                                  int64_t out_stride_h, void* part_o, void* part_lse, int batch, int num_heads,
                                  int kv_heads, int block_size, int num_splits, float scale_log2, int q_is_bf16,
                                  int e5m2, int stages, void* stream) {
  Params p{q,
           q_stride_b,
           q_stride_h,
           static_cast<const uint8_t*>(k_cache),
           static_cast<const uint8_t*>(v_cache),
           stride_blk,
           static_cast<const int64_t*>(block_tables),
           stride_bt,
           static_cast<const int64_t*>(seq_lens),
           out,
           out_stride_b,
           out_stride_h,
           static_cast<float*>(part_o),
           static_cast<float*>(part_lse),
           num_heads,
           kv_heads,
           block_size,
           num_splits,
           scale_log2};
  const int group = num_heads / kv_heads;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (q_is_bf16) {
    return e5m2 ? dispatch_config<__nv_bfloat16, true>(p, group, batch, stages, s)
                : dispatch_config<__nv_bfloat16, false>(p, group, batch, stages, s);
  }
  return e5m2 ? dispatch_config<__half, true>(p, group, batch, stages, s)
              : dispatch_config<__half, false>(p, group, batch, stages, s);
}
