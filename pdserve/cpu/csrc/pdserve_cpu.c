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

/* scores[t] = scale * (qh . k_t) for the n keys of one block (rows token_stride apart) */
#define PD_BLOCK_DOTS(D)                                                                                      \
    static void pd_block_dots_##D(const float *qh, const float *k, int64_t token_stride, int n, float scale,  \
                                  float *scores, int head_dim) {                                              \
        (void)head_dim;                                                                                       \
        pd_v16 qv[D / 16];                                                                                    \
        for (int j = 0; j < D / 16; j++) qv[j] = *(const pd_v16 *)(qh + 16 * j);                             \
        for (int t = 0; t < n; t++) {                                                                         \
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
        float *scores = NULL; /* [num_heads][seq_len] */
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
            const int32_t *table = block_tables + (int64_t)s * table_stride;
            if ((int64_t)num_heads * seq_len > scores_cap) {
                scores_cap = (int64_t)num_heads * seq_len;
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
                                   token_stride, n, scale, scores + (int64_t)h * seq_len + t0, head_dim);
                }
                /* softmax numerators in place; the denominators divide at the end */
                for (int h = 0; h < num_heads; h++) {
                    float *sh = scores + (int64_t)h * seq_len;
                    float m = -INFINITY;
#pragma omp simd reduction(max : m)
                    for (int t = 0; t < n_keys; t++) m = sh[t] > m ? sh[t] : m;
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int t = 0; t < n_keys; t++) {
                        sh[t] = pd_expf(sh[t] - m);
                        sum += sh[t];
                    }
                    denom[h] = sum;
                }
                for (int i = 0; i < num_heads * head_dim; i++) acc[i] = 0.0f;
                for (int t0 = 0; t0 < n_keys; t0 += block_size) {
                    const float *vb = v_cache + (int64_t)table[t0 / block_size] * block_stride;
                    const int n = t0 + block_size < n_keys ? block_size : n_keys - t0;
                    for (int h = 0; h < num_heads; h++)
                        block_axpy(scores + (int64_t)h * seq_len + t0, vb + (int64_t)(h / group) * head_stride,
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

/* x: [rows, 2n] = [gate | up] -> out[rows, n] = silu(gate) * up, silu(g) = g / (1 + exp(-g)). */
NO_CONTRACT void pd_silu_and_mul(const float *x, int64_t x_stride, int64_t rows, int n, float *out,
                                 int64_t out_stride, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * x_stride;
        const float *u = g + n;
        float *o = out + r * out_stride;
#pragma omp simd
        for (int i = 0; i < n; i++) o[i] = (g[i] / (1.0f + pd_expf_any(-g[i]))) * u[i];
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
