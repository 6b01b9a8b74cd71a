/* pdserve's CPU kernels (float32), built once per machine by pdserve/cpu/native.py and called via ctypes.
 *
 * Plain C with OpenMP: loaded after torch, the library binds to the libgomp that torch already loaded,
 * so its parallel loops run on torch's thread pool; callers pass torch.get_num_threads() (OpenMP's own
 * thread-count setting is per calling thread, and the engine steps in its own thread).
 *
 * Reductions use `omp simd reduction` (vectorised without -ffast-math, which would also switch the whole
 * process to flush-to-zero).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* exp(x) for x <= 0 (softmax after subtracting the max), vectorisable: Cephes' expf polynomial after
 * reducing by n*ln2, scaled by 2^n through the exponent bits; within 2 ulp of expf. Below -87.3 it returns
 * ~1e-38 instead of a denormal or zero, which no sum of >= 1 notices. */
#pragma omp declare simd notinbranch
static inline float pd_expf(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* exp(x) for any x, for SiLU: pd_expf's reduction with the input clamped to float's finite range. */
#pragma omp declare simd notinbranch
static inline float pd_expf_any(float x) {
    x = x > 88.3762626647949f ? 88.3762626647949f : x;
    return pd_expf(x);
}

/* Per-block pieces of the attention, with head_dim a compile-time constant for the common sizes (64, 128):
 * the loops unroll into whole-vector loads and FMAs; other sizes take the generic loops. */
typedef float pd_v16 __attribute__((vector_size(64), aligned(4)));
typedef float pd_v8 __attribute__((vector_size(32), aligned(4)));
typedef float pd_v4 __attribute__((vector_size(16), aligned(4)));

static inline float pd_hsum16(pd_v16 v) {
    pd_v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    pd_v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* Whole-vector helpers (GCC vector extensions; C has no vector ?:, so selects are bit masks). */
typedef int32_t pd_i16 __attribute__((vector_size(64), aligned(4)));
static const pd_i16 pd_iota16 = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

static inline pd_v16 pd_select(pd_i16 mask, pd_v16 a, pd_v16 b) { /* mask lane -1: a, 0: b */
    return (pd_v16)(((pd_i16)a & mask) | ((pd_i16)b & ~mask));
}

/* pd_expf on 16 lanes (same reduction and polynomial) */
static inline pd_v16 pd_expv(pd_v16 x) {
    const pd_v16 lo = x - x - 87.3f;
    x = pd_select(x < lo, lo, x);
    const pd_v16 y = x * 1.44269504088896341f + 0.5f;
    pd_v16 n = __builtin_convertvector(__builtin_convertvector(y, pd_i16), pd_v16); /* toward zero */
    n += __builtin_convertvector(n > y, pd_v16);                                  /* -1 where it rounded up */
    pd_v16 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    pd_v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const pd_i16 bits = (__builtin_convertvector(n, pd_i16) + 127) << 23;
    return p * (pd_v16)bits;
}

static inline float pd_hmax16(pd_v16 v) {
    float m = v[0];
    for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* s[t] <- exp(s[t] - max) for t < n, and 0 for n <= t < n rounded up to 16 (s must hold that many);
 * returns the sum of the numerators. */
static float pd_softmax_numerators(float *s, int n) {
    const pd_v16 neg_inf = (pd_v16){0} - INFINITY;
    pd_v16 mx = neg_inf;
    for (int t = 0; t < n; t += 16) {
        const pd_i16 valid = pd_iota16 + t < n;
        const pd_v16 x = pd_select(valid, *(pd_v16 *)(s + t), neg_inf);
        mx = pd_select(x > mx, x, mx);
    }
    const float m = pd_hmax16(mx);
    pd_v16 sum = (pd_v16){0};
    for (int t = 0; t < n; t += 16) {
        const pd_i16 valid = pd_iota16 + t < n;
        const pd_v16 e = pd_select(valid, pd_expv(*(pd_v16 *)(s + t) - m), (pd_v16){0});
        *(pd_v16 *)(s + t) = e;
        sum += e;
    }
    return pd_hsum16(sum);
}

/* The 16 sums of 16 vectors' lanes at once: lane t of the result is the sum of r[t]'s lanes. A tree of
 * two-vector shuffles and adds (45 operations) where 16 separate horizontal sums take ~110: halves, then
 * quarters, eighths and pairs of two vectors' partial sums share each add; the last shuffle undoes the
 * bit-reversed order the tree leaves the sums in. */
static inline pd_v16 pd_hsum16x16(const pd_v16 r[16]) {
    pd_v16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: r[2i]'s halves added, 8-15: r[2i+1]'s */
        a[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(r[2 * i], r[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int i = 0; i < 4; i++) /* quads: r[4i], r[4i+2], r[4i+1], r[4i+3] */
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++) /* pairs: r[8i + 0, 4, 2, 6, 1, 5, 3, 7] */
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                       31);
    /* lanes: r[0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15] (bit-reversed lane numbers) */
    const pd_v16 d = __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                     __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    return __builtin_shufflevector(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

/* scores[t] = scale * (qh . k_t) for the n keys of one block (rows token_stride apart): 16 keys at a time
 * (their sums reduced together), then one by one */
#define PD_BLOCK_DOTS(D)                                                                                      \
    static void pd_block_dots_##D(const float *qh, const float *k, int64_t token_stride, int n, float scale,  \
                                  float *scores, int head_dim) {                                              \
        (void)head_dim;                                                                                       \
        pd_v16 qv[D / 16];                                                                                    \
        for (int j = 0; j < D / 16; j++) qv[j] = *(const pd_v16 *)(qh + 16 * j);                             \
        int t = 0;                                                                                            \
        for (; t + 16 <= n; t += 16) {                                                                        \
            pd_v16 r[16];                                                                                     \
            for (int i = 0; i < 16; i++) {                                                                    \
                const float *kr = k + (int64_t)(t + i) * token_stride;                                        \
                pd_v16 acc = qv[0] * *(const pd_v16 *)kr;                                                     \
                for (int j = 1; j < D / 16; j++) acc += qv[j] * *(const pd_v16 *)(kr + 16 * j);              \
                r[i] = acc;                                                                                   \
            }                                                                                                 \
            *(pd_v16 *)(scores + t) = pd_hsum16x16(r) * scale;                                                \
        }                                                                                                     \
        for (; t < n; t++) {                                                                                  \
            const float *kr = k + (int64_t)t * token_stride;                                                  \
            pd_v16 acc = qv[0] * *(const pd_v16 *)kr;                                                         \
            for (int j = 1; j < D / 16; j++) acc += qv[j] * *(const pd_v16 *)(kr + 16 * j);                  \
            scores[t] = pd_hsum16(acc) * scale;                                                               \
        }                                                                                                     \
    }
/* acc += sum_t p[t] * v_t over the n values of one block */
#define PD_BLOCK_AXPY(D)                                                                                      \
    static void pd_block_axpy_##D(const float *p, const float *v, int64_t token_stride, int n, float *acc,   \
                                  int head_dim) {                                                             \
        (void)head_dim;                                                                                       \
        pd_v16 a[D / 16];                                                                                     \
        for (int j = 0; j < D / 16; j++) a[j] = *(const pd_v16 *)(acc + 16 * j);                             \
        for (int t = 0; t < n; t++) {                                                                         \
            const float *vr = v + (int64_t)t * token_stride;                                                  \
            for (int j = 0; j < D / 16; j++) a[j] += p[t] * *(const pd_v16 *)(vr + 16 * j);                  \
        }                                                                                                     \
        for (int j = 0; j < D / 16; j++) *(pd_v16 *)(acc + 16 * j) = a[j];                                   \
    }
PD_BLOCK_DOTS(64)
PD_BLOCK_DOTS(128)
PD_BLOCK_AXPY(64)
PD_BLOCK_AXPY(128)

static void pd_block_dots_any(const float *qh, const float *k, int64_t token_stride, int n, float scale,
                              float *scores, int head_dim) {
    for (int t = 0; t < n; t++) {
        const float *kr = k + (int64_t)t * token_stride;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < head_dim; d++) dot += qh[d] * kr[d];
        scores[t] = dot * scale;
    }
}

static void pd_block_axpy_any(const float *p, const float *v, int64_t token_stride, int n, float *acc,
                              int head_dim) {
    for (int t = 0; t < n; t++) {
        const float *vr = v + (int64_t)t * token_stride;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) acc[d] += p[t] * vr[d];
    }
}

/* Paged causal attention for short query runs (decode, and short chunks), reading K/V where they lie in the
 * pool: no gather into a contiguous copy, no padding.
 *
 * Sequence s (for s in seq_ids) owns query rows [query_start_loc[s], query_start_loc[s+1]); they are its
 * last q_len positions out of seq_lens[s], so row j (0-based within the run) sees keys
 * [0, seq_lens[s] - q_len + j]. Key t of sequence s lies in block block_tables[s * table_stride + t / bs]
 * at offset t % bs.
 *
 * q/out: [num_tokens, num_heads, head_dim] with row strides q_row_stride / out_row_stride (elements) and
 * heads contiguous. k_cache/v_cache: per-layer views [num_blocks, block_size, num_kv_heads, head_dim] with
 * element strides (block, token, head); head_dim contiguous. Query head h reads KV head h / (num_heads /
 * num_kv_heads) (GQA).
 */
void pd_paged_attention(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                        int64_t block_stride, int64_t token_stride, int64_t head_stride,
                        const int32_t *block_tables, int64_t table_stride, const int32_t *query_start_loc,
                        const int32_t *seq_lens, const int32_t *seq_ids, int num_selected, int num_heads,
                        int num_kv_heads, int head_dim, int block_size, float scale, float *out,
                        int64_t out_row_stride, int num_threads) {
    const int group = num_heads / num_kv_heads;
    void (*block_dots)(const float *, const float *, int64_t, int, float, float *, int) =
        head_dim == 64 ? pd_block_dots_64 : head_dim == 128 ? pd_block_dots_128 : pd_block_dots_any;
    void (*block_axpy)(const float *, const float *, int64_t, int, float *, int) =
        head_dim == 64 ? pd_block_axpy_64 : head_dim == 128 ? pd_block_axpy_128 : pd_block_axpy_any;

    /* One work item per sequence: each key row (all KV heads, contiguous) is read once for every query
     * head of the row, and each sequence's sums are one thread's, so results do not depend on the
     * thread count. */
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = NULL; /* [num_heads][seq_len rounded up to 16] */
        int64_t scores_cap = 0;
        float *acc = (float *)malloc(sizeof(float) * (size_t)num_heads * (size_t)head_dim);
        float *denom = (float *)malloc(sizeof(float) * (size_t)num_heads);

#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_selected; item++) {
            const int s = seq_ids[item];
            const int row0 = query_start_loc[s];
            const int q_len = query_start_loc[s + 1] - row0;
            const int seq_len = seq_lens[s];
            const int ctx = seq_len - q_len;
            const int64_t srow = (seq_len + 15) / 16 * 16; /* whole vectors for pd_softmax_numerators */
            const int32_t *table = block_tables + (int64_t)s * table_stride;
            if ((int64_t)num_heads * srow > scores_cap) {
                scores_cap = (int64_t)num_heads * srow;
                free(scores);
                scores = (float *)malloc(sizeof(float) * (size_t)scores_cap);
            }
            for (int j = 0; j < q_len; j++) {
                const int n_keys = ctx + j + 1;
                const float *qrow = q + (int64_t)(row0 + j) * q_row_stride;
                /* scores[h][t] = scale * q_h . k_t, block by block */
                for (int t0 = 0; t0 < n_keys; t0 += block_size) {
                    const float *kb = k_cache + (int64_t)table[t0 / block_size] * block_stride;
                    const int n = t0 + block_size < n_keys ? block_size : n_keys - t0;
                    for (int h = 0; h < num_heads; h++)
                        block_dots(qrow + (int64_t)h * head_dim, kb + (int64_t)(h / group) * head_stride,
                                   token_stride, n, scale, scores + (int64_t)h * srow + t0, head_dim);
                }
                /* softmax numerators in place; the denominators divide at the end */
                for (int h = 0; h < num_heads; h++) denom[h] = pd_softmax_numerators(scores + (int64_t)h * srow, n_keys);
                for (int i = 0; i < num_heads * head_dim; i++) acc[i] = 0.0f;
                for (int t0 = 0; t0 < n_keys; t0 += block_size) {
                    const float *vb = v_cache + (int64_t)table[t0 / block_size] * block_stride;
                    const int n = t0 + block_size < n_keys ? block_size : n_keys - t0;
                    for (int h = 0; h < num_heads; h++)
                        block_axpy(scores + (int64_t)h * srow + t0, vb + (int64_t)(h / group) * head_stride,
                                   token_stride, n, acc + (int64_t)h * head_dim, head_dim);
                }
                float *orow = out + (int64_t)(row0 + j) * out_row_stride;
                for (int h = 0; h < num_heads; h++) {
                    const float inv = 1.0f / denom[h];
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) orow[(int64_t)h * head_dim + d] = acc[h * head_dim + d] * inv;
                }
            }
        }
        free(scores);
        free(acc);
        free(denom);
    }
}

/* ---- prefill attention: fresh prompts over their own new K/V rows -------------------------------------
 * Causal attention of prompts with no cached context, reading k/v from the step's new rows (contiguous per
 * prompt), as register-tiled matmuls: scores = q k^T for a block of query rows against 64-key tiles of a
 * transposed copy of the keys (made once per prompt and KV head), an exact two-pass softmax per row, then
 * out = p v. Tiles past a block's last position are skipped (the causal half is not computed). */
#define PF_KEYS 64    /* keys per score tile: 4 vectors of 16 */
#define PF_MR 6       /* query rows per score tile (6 x 4 accumulators) */
#define PF_POS 16     /* query positions per block: PF_POS * group query rows share one pass over the keys */

/* s_r[t0 .. t0+64) = scale * q_r . k_t for 6 query rows; kt: [head_dim][kt_stride] transposed keys */
static inline void pf_qk_tile(const float *const q[PF_MR], const float *kt, int64_t kt_stride, int head_dim,
                              float scale, float *const s[PF_MR], int t0) {
    pd_v16 acc[PF_MR][4];
    for (int r = 0; r < PF_MR; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = (pd_v16){0};
    for (int d = 0; d < head_dim; d++) {
        const float *kd = kt + (int64_t)d * kt_stride + t0;
        pd_v16 k0 = *(const pd_v16 *)kd, k1 = *(const pd_v16 *)(kd + 16), k2 = *(const pd_v16 *)(kd + 32),
               k3 = *(const pd_v16 *)(kd + 48);
        for (int r = 0; r < PF_MR; r++) {
            const float b = q[r][d];
            acc[r][0] += b * k0;
            acc[r][1] += b * k1;
            acc[r][2] += b * k2;
            acc[r][3] += b * k3;
        }
    }
    for (int r = 0; r < PF_MR; r++)
        for (int j = 0; j < 4; j++) *(pd_v16 *)(s[r] + t0 + 16 * j) = acc[r][j] * scale;
}

/* out_r = sum_{t < n} p_r[t] v_t for MR rows, head_dim D (a multiple of 16) as D/16 vectors */
#define PF_PV(D, MR)                                                                                          \
    static inline void pf_pv_##D(const float *const p[MR], const float *v, int64_t v_stride, int n,           \
                                 float *const o[MR], const float inv[MR]) {                                   \
        pd_v16 acc[MR][D / 16];                                                                               \
        for (int r = 0; r < MR; r++)                                                                          \
            for (int j = 0; j < D / 16; j++) acc[r][j] = (pd_v16){0};                                        \
        for (int t = 0; t < n; t++) {                                                                         \
            const float *vt = v + (int64_t)t * v_stride;                                                      \
            pd_v16 vv[D / 16];                                                                                \
            for (int j = 0; j < D / 16; j++) vv[j] = *(const pd_v16 *)(vt + 16 * j);                          \
            for (int r = 0; r < MR; r++) {                                                                    \
                const float b = p[r][t];                                                                      \
                for (int j = 0; j < D / 16; j++) acc[r][j] += b * vv[j];                                      \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < MR; r++)                                                                          \
            for (int j = 0; j < D / 16; j++) *(pd_v16 *)(o[r] + 16 * j) = acc[r][j] * inv[r];                 \
    }
PF_PV(64, 6)
PF_PV(128, 3)

/* Prompt s owns rows [rows[2s], rows[2s+1]) of q ([T, num_heads, head_dim], heads contiguous), k and v
 * ([T, num_kv_heads, head_dim] rows of k_row_stride / v_row_stride, heads contiguous); row j attends to
 * rows 0..j of its prompt. head_dim must be 64 or 128 (the caller checks; other sizes take SDPA). Query
 * head h reads KV head h / (num_heads / num_kv_heads). Each (prompt, KV head) is one thread's work, so
 * results do not depend on the thread count. */
void pd_prefill_attention(const float *q, int64_t q_row_stride, const float *k, int64_t k_row_stride,
                          const float *v, int64_t v_row_stride, const int32_t *rows, int num_seqs,
                          int num_heads, int num_kv_heads, int head_dim, float scale, float *out,
                          int64_t out_row_stride, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int mrv = head_dim == 64 ? 6 : 3; /* rows per p v tile */
    int max_len = 0;
    for (int s = 0; s < num_seqs; s++)
        if (rows[2 * s + 1] - rows[2 * s] > max_len) max_len = rows[2 * s + 1] - rows[2 * s];
    const int64_t kt_stride = ((int64_t)max_len + PF_KEYS - 1) / PF_KEYS * PF_KEYS;
    const int block_rows = PF_POS * group;
#pragma omp parallel num_threads(num_threads)
    {
        float *kt = (float *)aligned_alloc(64, sizeof(float) * (size_t)(head_dim * kt_stride));
        /* scores of one block, plus one spare row that padding rows of a partial tile write into */
        float *scores = (float *)aligned_alloc(64, sizeof(float) * (size_t)((block_rows + 1) * kt_stride));
        float *sums = (float *)malloc(sizeof(float) * (size_t)block_rows);
        float *spare_out = (float *)aligned_alloc(64, sizeof(float) * (size_t)head_dim);
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_seqs * num_kv_heads; item++) {
            const int s = item / num_kv_heads, g = item % num_kv_heads;
            const int row0 = rows[2 * s], n = rows[2 * s + 1] - row0;
            const float *kg = k + (int64_t)row0 * k_row_stride + (int64_t)g * head_dim;
            const float *vg = v + (int64_t)row0 * v_row_stride + (int64_t)g * head_dim;
            const int n_tiles = (n + PF_KEYS - 1) / PF_KEYS;
            for (int d = 0; d < head_dim; d++) {
                float *ktd = kt + (int64_t)d * kt_stride;
                for (int t = 0; t < n; t++) ktd[t] = kg[(int64_t)t * k_row_stride + d];
                for (int t = n; t < n_tiles * PF_KEYS; t++) ktd[t] = 0.0f;
            }
            for (int p0 = 0; p0 < n; p0 += PF_POS) {
                const int p1 = p0 + PF_POS < n ? p0 + PF_POS : n;
                const int m_rows = (p1 - p0) * group; /* query row m: position p0 + m / group, head m % group */
                float *spare = scores + (int64_t)block_rows * kt_stride;
                for (int m0 = 0; m0 < m_rows; m0 += PF_MR) {
                    const float *qr[PF_MR];
                    float *sr[PF_MR];
                    int last_pos = 0;
                    for (int r = 0; r < PF_MR; r++) {
                        const int m = m0 + r < m_rows ? m0 + r : m_rows - 1;
                        const int pos = p0 + m / group;
                        qr[r] = q + (int64_t)(row0 + pos) * q_row_stride + (int64_t)(g * group + m % group) * head_dim;
                        sr[r] = m0 + r < m_rows ? scores + (int64_t)m * kt_stride : spare;
                        last_pos = pos > last_pos ? pos : last_pos;
                    }
                    for (int t0 = 0; t0 <= last_pos; t0 += PF_KEYS)
                        pf_qk_tile(qr, kt, kt_stride, head_dim, scale, sr, t0);
                }
                /* softmax numerators in place, zero past each row's own position up to the block's end */
                for (int m = 0; m < m_rows; m++) {
                    float *sm = scores + (int64_t)m * kt_stride;
                    const int n_keys = p0 + m / group + 1;
                    sums[m] = pd_softmax_numerators(sm, n_keys);
                    for (int t = (n_keys + 15) / 16 * 16; t < p1; t++) sm[t] = 0.0f;
                }
                for (int m0 = 0; m0 < m_rows; m0 += mrv) {
                    const float *pr[6];
                    float *orow[6];
                    float inv[6];
                    int last_pos = 0;
                    for (int r = 0; r < mrv; r++) {
                        const int valid = m0 + r < m_rows;
                        const int m = valid ? m0 + r : m_rows - 1;
                        const int pos = p0 + m / group;
                        pr[r] = scores + (int64_t)m * kt_stride;
                        orow[r] = valid ? out + (int64_t)(row0 + pos) * out_row_stride +
                                              (int64_t)(g * group + m % group) * head_dim
                                        : spare_out;
                        inv[r] = 1.0f / sums[m];
                        last_pos = pos > last_pos ? pos : last_pos;
                    }
                    if (head_dim == 64)
                        pf_pv_64(pr, vg, v_row_stride, last_pos + 1, orow, inv);
                    else
                        pf_pv_128(pr, vg, v_row_stride, last_pos + 1, orow, inv);
                }
            }
        }
        free(kt);
        free(scores);
        free(sums);
        free(spare_out);
    }
}

/* ---- fused small ops: one pass each instead of 5-10 torch ops (and as many Python dispatches) ----------
 * Each runs on one thread below PARALLEL_MIN_ELEMS elements: a decode step's rows are too small for a
 * parallel region to pay for its barrier. Element-wise arithmetic matches torch's rounding (no FMA
 * contraction in these functions); reductions (the RMS) and exp (SiLU) differ from torch in the last bit. */
#define PARALLEL_MIN_ELEMS (1 << 16)
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))

/* out[r] = w * (src[r] * rsqrt(mean(src[r]^2) + eps)), where src = x, or with residual != NULL:
 * residual[r] += x[r] first (in place) and src = residual (vLLM's fused_add_rms_norm). */
NO_CONTRACT void pd_rms_norm(const float *x, int64_t x_stride, float *residual, int64_t res_stride,
                             const float *w, float eps, int64_t rows, int dim, float *out, int64_t out_stride,
                             int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        const float *src = xr;
        if (residual != NULL) {
            float *rr = residual + r * res_stride;
#pragma omp simd
            for (int i = 0; i < dim; i++) rr[i] = rr[i] + xr[i];
            src = rr;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < dim; i++) ss += src[i] * src[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *o = out + r * out_stride;
#pragma omp simd
        for (int i = 0; i < dim; i++) o[i] = w[i] * (src[i] * inv);
    }
}

/* x: [rows, 2n] = [gate | up] -> out[rows, n] = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
 * Whole vectors through pd_expv: gcc left the `omp simd` loop over pd_expf_any scalar (the optimize
 * attribute keeps it from inlining), ~30 cycles an element: 7 ms of a batch-16 SmolLM2 decode step. The
 * element-wise part has no multiply-add to contract, so it rounds as before; exp may differ in the last bit
 * where the polynomial now contracts. */
void pd_silu_and_mul(const float *x, int64_t x_stride, int64_t rows, int n, float *out, int64_t out_stride,
                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * x_stride;
        const float *u = g + n;
        float *o = out + r * out_stride;
        int i = 0;
        for (; i + 16 <= n; i += 16) {
            const pd_v16 gv = *(const pd_v16 *)(g + i);
            pd_v16 e = (pd_v16){0} - gv;
            const pd_v16 hi = e - e + 88.3762626647949f;
            e = pd_select(e > hi, hi, e);
            *(pd_v16 *)(o + i) = (gv / (1.0f + pd_expv(e))) * *(const pd_v16 *)(u + i);
        }
        for (; i < n; i++) o[i] = (g[i] / (1.0f + pd_expf_any(-g[i]))) * u[i];
    }
}

/* Rotate-half RoPE of q ([T, H, D] rows of q_stride, heads contiguous by D) into q_out ([T, H, D]
 * contiguous) and of k into k_out ([T, KVH, D] contiguous), as HF computes it: x * cos + rot(x) * sin,
 * rot(x) = [-x2, x1]. k_out and v ([T, KVH, D], rows of v_stride) are also stored at their slots of the
 * per-layer cache views (block, token, head strides; D contiguous). */
NO_CONTRACT void pd_rope_write_kv(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                                  const float *v, int64_t v_stride, const float *cos, const float *sin,
                                  int64_t cs_stride, int64_t rows, int num_heads, int num_kv_heads, int head_dim,
                                  float *q_out, float *k_out, float *k_cache, float *v_cache,
                                  int64_t block_stride, int64_t token_stride, int64_t head_stride,
                                  const int64_t *slots, int block_size, int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * num_heads * head_dim >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * cs_stride;
        const float *s = sin + t * cs_stride;
        for (int h = 0; h < num_heads + num_kv_heads; h++) {
            const int is_q = h < num_heads;
            const float *src = is_q ? q + t * q_stride + (int64_t)h * head_dim
                                    : k + t * k_stride + (int64_t)(h - num_heads) * head_dim;
            float *dst = is_q ? q_out + (t * num_heads + h) * head_dim
                              : k_out + (t * num_kv_heads + (h - num_heads)) * head_dim;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float a = src[i] * c[i];
                const float b = -src[i + half] * s[i];
                dst[i] = a + b;
                const float a2 = src[i + half] * c[i + half];
                const float b2 = src[i] * s[i + half];
                dst[i + half] = a2 + b2;
            }
        }
        const int64_t slot = slots[t];
        const int64_t base = (slot / block_size) * block_stride + (slot % block_size) * token_stride;
        for (int h = 0; h < num_kv_heads; h++) {
            float *kc = k_cache + base + (int64_t)h * head_stride;
            float *vc = v_cache + base + (int64_t)h * head_stride;
            const float *kr = k_out + (t * num_kv_heads + h) * head_dim;
            const float *vr = v + t * v_stride + (int64_t)h * head_dim;
            for (int i = 0; i < head_dim; i++) {
                kc[i] = kr[i];
                vc[i] = vr[i];
            }
        }
    }
}

/* The OpenMP runtime this library is bound to, to check it is torch's (one thread pool, not two). */
extern int omp_get_max_threads(void);
void *pd_omp_runtime(void) { return (void *)&omp_get_max_threads; }
