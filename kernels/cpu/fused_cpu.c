/* Fused CPU elementwise kernels, one pass each: RMSNorm (+ residual add), SiLU-and-mul, the
 * rotary embedding of q and k in place, the KV-cache store, and a token bitmask on logits.
 *
 * They round exactly where the torch references do (kernels/reference/rms_norm_ref.py,
 * activation_ref.py, rotary_ref.rotate_signed_ref, i.e. Hugging Face's modules in bf16): the
 * residual sum, the normalised value, the SiLU output and each rotary product are rounded to the
 * model dtype before the next operation.
 * Sums of squares are float32 in a different order than torch's (last-bit differences).
 * Built by kernels/cpu/cpu_build.py, called by kernels/cpu/fused_cpu.py; all tensors contiguous rows.
 */
#include <string.h>

#include "cpu_math.h"

/* x / (1 + e^-x), with the exponent kept non-positive on both signs. */
static inline float silu(float x) {
    const float e = exp_nonpositive(-fabsf(x));
    return x >= 0.f ? x / (1.f + e) : x * e / (1.f + e);
}

#define PARALLEL_ELEMENTS 32768  /* below this, waking the second thread costs more than it saves */
#define ID(x) (x)
#define BF16_ROUND(x) bf16_to_float(float_to_bf16(x))

/* out = weight * round(h / rms(h)), h = round(x + residual) (also written to summed) or x. */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                            \
int NAME(const T *x, const T *residual, T *summed, const T *weight, T *out, int64_t rows,     \
         int64_t hidden, float eps) {                                                          \
    _Pragma("omp parallel for if(rows * hidden >= PARALLEL_ELEMENTS)")                       \
    for (int64_t r = 0; r < rows; r++) {                                                       \
        const T *xr = x + r * hidden;                                                          \
        const T *rr = residual ? residual + r * hidden : 0;                                    \
        T *sr = residual ? summed + r * hidden : 0;                                            \
        T *orow = out + r * hidden;                                                            \
        float h[hidden];                                                                       \
        float squares = 0.f;                                                                   \
        if (rr) {                                                                              \
            for (int64_t i = 0; i < hidden; i++) {                                             \
                h[i] = ROUND(LOAD(xr[i]) + LOAD(rr[i]));                                       \
                sr[i] = STORE(h[i]);                                                           \
            }                                                                                  \
        } else {                                                                               \
            for (int64_t i = 0; i < hidden; i++) h[i] = LOAD(xr[i]);                           \
        }                                                                                      \
        for (int64_t i = 0; i < hidden; i++) squares += h[i] * h[i];                           \
        const float inv = 1.f / sqrtf(squares / (float)hidden + eps);                          \
        for (int64_t i = 0; i < hidden; i++)                                                   \
            orow[i] = STORE(LOAD(weight[i]) * ROUND(h[i] * inv));                              \
    }                                                                                          \
    return 0;                                                                                  \
}

/* out[r, i] = round(silu(gate)) * up for x [rows, 2 * inter] = gate | up. */
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE, ROUND)                                        \
int NAME(const T *x, T *out, int64_t rows, int64_t inter) {                                    \
    _Pragma("omp parallel for if(rows * inter >= PARALLEL_ELEMENTS)")                        \
    for (int64_t r = 0; r < rows; r++) {                                                       \
        const T *gate = x + r * 2 * inter, *up = gate + inter;                                 \
        T *orow = out + r * inter;                                                             \
        for (int64_t i = 0; i < inter; i++)                                                    \
            orow[i] = STORE(ROUND(silu(LOAD(gate[i]))) * LOAD(up[i]));                         \
    }                                                                                          \
    return 0;                                                                                  \
}

DEFINE_RMS_NORM(rms_norm_f32, float, ID, ID, ID)
#if defined(__AVX512BF16__)
#define LANES(n, i) ((n) - (i) >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ((n) - (i))) - 1))

/* rms_norm_bf16 16 lanes at a time: the scalar loop's float_to_bf16 (a NaN branch and integer
 * rounding per element) kept the compiler from vectorising it. The summed row is read back as the
 * values to normalise (they are bf16 already), so no float copy of the row is kept. */
int rms_norm_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *summed, const uint16_t *weight,
                  uint16_t *out, int64_t rows, int64_t hidden, float eps) {
    _Pragma("omp parallel for if(rows * hidden >= PARALLEL_ELEMENTS)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * hidden, *h = xr;
        uint16_t *orow = out + r * hidden;
        __m512 squares = _mm512_setzero_ps();
        if (residual) {
            const uint16_t *rr = residual + r * hidden;
            uint16_t *sr = summed + r * hidden;
            for (int64_t i = 0; i < hidden; i += 16) {
                const __mmask16 lanes = LANES(hidden, i);
                const __m512 v = bf16x16_round(_mm512_add_ps(bf16x16_load(xr + i, lanes), bf16x16_load(rr + i, lanes)));
                bf16x16_store(sr + i, lanes, v);
                squares = _mm512_fmadd_ps(v, v, squares);
            }
            h = sr;
        } else {
            for (int64_t i = 0; i < hidden; i += 16) {
                const __m512 v = bf16x16_load(xr + i, LANES(hidden, i));
                squares = _mm512_fmadd_ps(v, v, squares);
            }
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(squares) / (float)hidden + eps));
        for (int64_t i = 0; i < hidden; i += 16) {
            const __mmask16 lanes = LANES(hidden, i);
            bf16x16_store(orow + i, lanes, _mm512_mul_ps(bf16x16_load(weight + i, lanes),
                                                         bf16x16_round(_mm512_mul_ps(bf16x16_load(h + i, lanes), inv))));
        }
    }
    return 0;
}
#else
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_float, float_to_bf16, BF16_ROUND)
#endif
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, ID, ID, ID)
#if defined(__AVX512BF16__)
/* silu_and_mul_bf16 16 lanes at a time (`silu_mul16`): the scalar loop's branches and
 * conversions did not vectorise (1.2 ns an element, a fifth of a 2,048-token prefill's non-GEMM time). */
int silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t inter) {
    _Pragma("omp parallel for if(rows * inter >= PARALLEL_ELEMENTS)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = x + r * 2 * inter, *up = gate + inter;
        uint16_t *orow = out + r * inter;
        for (int64_t i = 0; i < inter; i += 16) {
            const __mmask16 lanes = inter - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (inter - i)) - 1);
            const __m512 y = silu_mul16(bf16x16_load(gate + i, lanes), bf16x16_load(up + i, lanes));
            _mm256_mask_storeu_epi16(orow + i, lanes, (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
    return 0;
}
#else
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, bf16_to_float, float_to_bf16, BF16_ROUND)
#endif

/* x [rows, heads, head_dim] (rows `row_stride` elements apart, heads contiguous) rotated in place:
 * x' = round(round(x * cos) + round(swap(x) * sin)), swap = (x2, x1) of the two halves, with
 * cos and the signed sin (first half negated) [rows, head_dim] per row. */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE, ROUND)                                              \
int NAME(T *x, const T *cos, const T *sin, int64_t rows, int64_t row_stride, int64_t heads,    \
         int64_t head_dim) {                                                                   \
    const int64_t half = head_dim / 2;                                                         \
    _Pragma("omp parallel for if(rows * heads * head_dim >= PARALLEL_ELEMENTS)")             \
    for (int64_t r = 0; r < rows; r++) {                                                       \
        const T *c = cos + r * head_dim, *s = sin + r * head_dim;                              \
        for (int64_t h = 0; h < heads; h++) {                                                  \
            T *v = x + r * row_stride + h * head_dim;                                          \
            for (int64_t i = 0; i < half; i++) {                                               \
                const float x1 = LOAD(v[i]), x2 = LOAD(v[i + half]);                           \
                v[i] = STORE(ROUND(x1 * LOAD(c[i])) + ROUND(x2 * LOAD(s[i])));                 \
                v[i + half] = STORE(ROUND(x2 * LOAD(c[i + half])) + ROUND(x1 * LOAD(s[i + half]))); \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    return 0;                                                                                  \
}

DEFINE_ROTARY(rotary_f32, float, ID, ID, ID)
#if defined(__AVX512BF16__)
/* rotary_bf16 16 lanes at a time, for the same reason as rms_norm_bf16. */
int rotary_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t rows, int64_t row_stride,
                int64_t heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    _Pragma("omp parallel for if(rows * heads * head_dim >= PARALLEL_ELEMENTS)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * head_dim, *s = sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *v = x + r * row_stride + h * head_dim;
            for (int64_t i = 0; i < half; i += 16) {
                const __mmask16 lanes = LANES(half, i);
                const __m512 x1 = bf16x16_load(v + i, lanes), x2 = bf16x16_load(v + i + half, lanes);
                const __m512 first = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(x1, bf16x16_load(c + i, lanes))),
                                                   bf16x16_round(_mm512_mul_ps(x2, bf16x16_load(s + i, lanes))));
                const __m512 second = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(x2, bf16x16_load(c + i + half, lanes))),
                                                    bf16x16_round(_mm512_mul_ps(x1, bf16x16_load(s + i + half, lanes))));
                bf16x16_store(v + i, lanes, first);
                bf16x16_store(v + i + half, lanes, second);
            }
        }
    }
    return 0;
}
#else
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_to_float, float_to_bf16, BF16_ROUND)
#endif

/* Row t of k and v (`row_bytes` each, rows `row_stride` bytes apart) to slot slots[t] of the
 * caches (slot s at byte s * row_bytes); slots < 0 are skipped. Any dtype: rows are copied. */
int store_kv(const char *k, const char *v, const int64_t *slots, char *k_cache, char *v_cache,
             int64_t rows, int64_t row_stride, int64_t row_bytes) {
    _Pragma("omp parallel for if(rows * row_bytes >= 8 * PARALLEL_ELEMENTS)")
    for (int64_t t = 0; t < rows; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row_bytes, k + t * row_stride, (size_t)row_bytes);
        memcpy(v_cache + slots[t] * row_bytes, v + t * row_stride, (size_t)row_bytes);
    }
    return 0;
}

/* The store into an fp8 cache: each row (k, v [rows, row_elements] of T at row_stride elements)
 * quantized to fp8 with its per-tensor inverse scale (float_to_fp8: as kv_cache_ref's
 * quantize_fp8_ref) into slot `slots[t]` (-1 skipped). */
#define DEFINE_STORE_KV_FP8(NAME, T, LOAD, LOAD16)                                              \
int NAME(const T *k, const T *v, const int64_t *slots, uint8_t *k_cache, uint8_t *v_cache,     \
         int64_t rows, int64_t row_stride, int64_t row_elements, int64_t e5m2, float k_inv_scale, \
         float v_inv_scale) {                                                                  \
    _Pragma("omp parallel for if(rows * row_elements >= PARALLEL_ELEMENTS)")                  \
    for (int64_t t = 0; t < rows; t++) {                                                       \
        if (slots[t] < 0) continue;                                                            \
        uint8_t *kc = k_cache + slots[t] * row_elements, *vc = v_cache + slots[t] * row_elements; \
        const T *kr = k + t * row_stride, *vr = v + t * row_stride;                            \
        int64_t i = 0;                                                                         \
        VECTOR_ROW(LOAD16)                                                                     \
        for (; i < row_elements; i++) {                                                        \
            kc[i] = float_to_fp8(LOAD(kr[i]), k_inv_scale, (int)e5m2);                         \
            vc[i] = float_to_fp8(LOAD(vr[i]), v_inv_scale, (int)e5m2);                         \
        }                                                                                      \
    }                                                                                          \
    return 0;                                                                                  \
}

#if defined(__AVX512BF16__)
/* 16 values at a time: 32 rows of 3 x 64 into 30 layers, 1.1 -> 0.5 ms a decode step. */
#define VECTOR_ROW(LOAD16)                                                                      \
        for (; i < row_elements; i += 16) {                                                    \
            const __mmask16 lanes = row_elements - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (row_elements - i)) - 1); \
            fp8x16_store(kc + i, lanes, LOAD16(kr + i, lanes), k_inv_scale, (int)e5m2);        \
            fp8x16_store(vc + i, lanes, LOAD16(vr + i, lanes), v_inv_scale, (int)e5m2);        \
        }
#define F32X16_LOAD(p, lanes) _mm512_maskz_loadu_ps(lanes, p)
#else
#define VECTOR_ROW(LOAD16)
#endif
DEFINE_STORE_KV_FP8(store_kv_fp8_bf16, uint16_t, bf16_to_float, bf16x16_load)
DEFINE_STORE_KV_FP8(store_kv_fp8_f32, float, ID, F32X16_LOAD)

/* A structured-output token bitmask applied to float32 logits (xgrammar's layout: token j is
 * allowed when bit j % 32 of int32 word j / 32 of its row is set): for each i < num_rows,
 * logits[rows[i]][j] = -inf for every disallowed j < vocab, reading bitmask row rows[i], and
 * alive[i] = 1 when an allowed token keeps a logit above -inf (0: the row can sample nothing).
 * Whole words of 32 go through a fixed-length loop the compiler vectorises; xgrammar's CPU
 * kernel tests bit by bit (7.3 ms for 32 rows of 49,152 on one core, this loop 0.33 ms). It
 * takes a second thread only for several milliseconds of work: on a busy 2-core machine the
 * wake-up and barrier cost more than 32 rows do. */
#define BITMASK_PARALLEL_ELEMENTS (1 << 23)
int apply_token_bitmask_f32(float *logits, const int32_t *bitmask, const int64_t *rows, uint8_t *alive,
                            int64_t num_rows, int64_t logits_stride, int64_t mask_stride, int64_t vocab) {
    _Pragma("omp parallel for if(num_rows * vocab >= BITMASK_PARALLEL_ELEMENTS)")
    for (int64_t i = 0; i < num_rows; i++) {
        float *x = logits + rows[i] * logits_stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + rows[i] * mask_stride);
        const int64_t whole = vocab / 32;
        int any = 0;
        for (int64_t w = 0; w < whole; w++) {
            const uint32_t bits = mask[w];
            float *y = x + w * 32;
            if (bits == 0) {
                for (int k = 0; k < 32; k++) y[k] = -INFINITY;
                continue;
            }
            for (int k = 0; k < 32; k++) {
                const int on = (int)((bits >> k) & 1u);
                y[k] = on ? y[k] : -INFINITY;
                any |= y[k] > -INFINITY;
            }
        }
        for (int64_t j = whole * 32; j < vocab; j++) {
            const int on = (int)(((uint32_t)mask[j / 32] >> (j % 32)) & 1u);
            x[j] = on ? x[j] : -INFINITY;
            any |= x[j] > -INFINITY;
        }
        alive[i] = (uint8_t)any;
    }
    return 0;
}

/* Inverse-transform sampling of rows of float32 logits, the Sampler's rule without its passes:
 * token = the first j whose running sum of p_j = e^((x_j - max) * inv_temperature) exceeds
 * uniform * sum(p) (p unnormalised; torch's softmax + cumsum + searchsorted took ~1 ms for 32
 * rows of 49,152, a twentieth of a decode step). Sums of blocks of SAMPLE_BLOCK values go in
 * float32, the running sum over blocks and inside the chosen block in double, so the target is
 * always below the total and found. A token at -inf (masked) or more than 87 below the maximum
 * after temperature gets p = 0 exactly, so a masked token is never drawn. A row that cannot be
 * sampled (every logit -inf, a NaN, or +inf) gets `vocab`, which the caller reports as that row's error. */
#define SAMPLE_BLOCK 64
#define SAMPLE_PARALLEL_ELEMENTS (1 << 16)   /* 2 rows of 49k: a decode step's OpenMP team is still awake */

static inline float sample_weight(float x, float max, float inv_temperature) {
    const float d = (x - max) * inv_temperature;
    return d < -87.0f ? 0.0f : exp_nonpositive(d);   /* -inf: 0; NaN compares false and stays NaN */
}

int sample_rows_f32(const float *logits, const float *inv_temperature, const float *uniform, int64_t *tokens,
                    const int64_t *rows, int64_t num_rows, int64_t stride, int64_t vocab) {
    const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    _Pragma("omp parallel for if(num_rows * vocab >= SAMPLE_PARALLEL_ELEMENTS)")
    for (int64_t i = 0; i < num_rows; i++) {
        const float *x = logits + rows[i] * stride;
        const float t = inv_temperature[i];
        float max = -INFINITY;
        _Pragma("omp simd reduction(max:max)")
        for (int64_t j = 0; j < vocab; j++) max = x[j] > max ? x[j] : max;   /* NaN skipped here ... */
        tokens[i] = vocab;
        if (max == -INFINITY) continue;
        float block_sums[blocks];
        double total = 0.0;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t end = b + 1 < blocks ? (b + 1) * SAMPLE_BLOCK : vocab;
            float sum = 0.0f;
            _Pragma("omp simd reduction(+:sum)")
            for (int64_t j = b * SAMPLE_BLOCK; j < end; j++) sum += sample_weight(x[j], max, t);
            block_sums[b] = sum;
            total += sum;
        }
        if (!(total > 0.0)) continue;   /* ... and caught here: NaN weights, or +inf logits (inf - inf) */
        const double target = (double)uniform[i] * total;
        double before = 0.0;
        int64_t b = 0;
        while (b + 1 < blocks && before + block_sums[b] <= target) before += block_sums[b++];
        const int64_t end = b + 1 < blocks ? (b + 1) * SAMPLE_BLOCK : vocab;
        int64_t last_positive = -1;
        for (int64_t j = b * SAMPLE_BLOCK; j < end; j++) {
            const float p = sample_weight(x[j], max, t);
            if (p <= 0.0f) continue;
            last_positive = j;
            before += p;
            if (before > target) break;
        }
        tokens[i] = last_positive;   /* the block holds the target, so some p > 0: a rounding tail lands here */
    }
    return 0;
}
