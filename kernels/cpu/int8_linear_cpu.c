/* W8A8 int8 linear on the CPU: y = (x quantized to int8 per token) @ W_int8^T, rescaled, in one
 * call: quantize, VNNI multiply, rescale (+ bias), with no int32 or float32 [M, N] temporaries.
 *
 * Why: the torch form (per-token amax, divide, round, clamp, cast; torch._int_mm; int32 ->
 * float32, two scale products, the cast to bf16) makes five passes over [M, K] or [M, N] around
 * the GEMM, and ran the embedded model's c=32 decode at 0.76-0.94x of its own bf16 weights,
 * although int8 halves the weights' bytes and VNNI doubles the multiply-adds per instruction.
 *
 * Same numbers as that torch form, bit for bit: activations q = round-half-even(x / s) clamped
 * to [-128, 127], s = max(amax(|x|), 1e-10) / 127 per row (dynamic) or the checkpoint's scale
 * (static); the int32 sums are exact; y = bf16(float(sum) * s * w_scale[n]), then + bias rounded
 * again as torch adds a bf16 bias.
 *
 * vpdpbusd multiplies unsigned by signed bytes, so x goes in as q + 128 and each column's
 * 128 * sum(W[n]) is taken off the int32 sum. Packed weights (`int8_pack`): panels of PANEL output
 * columns, [N/PANEL][K/4][PANEL][4] int8 (4 consecutive k of a column in one 32-bit lane), zero-padded;
 * `colsum` [N padded] int32. The microkernel keeps ROWS rows x PANEL columns of int32 sums in registers
 * over all of K; each thread takes a contiguous run of (64-row chunk, panel) items, prefetching ahead.
 * Without AVX512-VNNI every entry point returns UNSUPPORTED and the caller keeps torch.
 * Built by kernels/cpu/cpu_build.py, called by kernels/cpu/int8_linear_cpu.py.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

enum { OK = 0, UNSUPPORTED = 2, NO_MEMORY = 3 };
#ifndef PANEL
/* Output columns of a packed panel (three zmm of int32 sums a row): 48 rather than 32 on an AMD
 * EPYC (Zen 4), alternated, SmolLM2's 120 linears from DRAM: at 32 rows 7.0-7.8 ms against
 * 7.3-8.3, at 64 rows 12.1-13.3 against 13.2-14.1, at 1,024 rows 165-166 against 186-205, at 4
 * and 16 rows level; 64 columns (four zmm) took 9.5 ms at 32 rows. Python's `_PANEL` matches. */
#define PANEL 48
#endif
#ifndef ROWS
/* Rows of x a microkernel call keeps in registers. 4 rather than 8 on an AMD EPYC (Zen 4),
 * alternated: SmolLM2's 120 linears at 32 rows 6.2-7.5 ms against 7.1-8.7 (weights in cache),
 * 7.7-8.8 against 8.2-9.4 (from DRAM); 4,096 x 576 -> 3,072 16.0-16.9 ms against 19.1-19.2. */
#define ROWS 4
#endif
#define VECS (PANEL / 16) /* zmm of int32 sums a row */
#define CHUNK_ROWS 64     /* rows of a work item: its quantized x stays in L2 across panels */
/* How far ahead of the panel being read its thread asks for weights (into the next panel at the
 * end of one): at decode sizes the weights come from DRAM once per step, and a prefetch 1 KB
 * ahead arrived late. SmolLM2's 120 linears at 32 rows, from DRAM: 10.6 ms with 1 KB and
 * (dynamic) items, 9.0 with static items, 8.0 with static items and 16 KB (8.4 at 8 KB, 9.0 at
 * 32 KB); 4 rows 5.7 -> 4.6 ms, 16 rows 7.8 -> 5.1, 64 rows 17.1 -> 14.8. */
#define PREFETCH_BYTES 16384
#define EPS 1e-10f        /* the smallest scale, as quantization/weights.py's _INT8_EPS */

/* Pack W int8 [n, k] (row stride k) into panels, and each column's sum. */
int int8_pack(const int8_t *w, int8_t *packed, int32_t *colsum, int64_t n, int64_t k) {
    const int64_t kp = (k + 3) / 4 * 4, panels = (n + PANEL - 1) / PANEL;
    memset(packed, 0, (size_t)(panels * PANEL * kp));
    memset(colsum, 0, (size_t)(panels * PANEL) * sizeof(int32_t));
    for (int64_t col = 0; col < n; col++) {
        int8_t *panel = packed + (col / PANEL) * PANEL * kp;
        const int64_t lane = col % PANEL;
        int32_t sum = 0;
        for (int64_t i = 0; i < k; i++) {
            panel[(i / 4) * PANEL * 4 + lane * 4 + i % 4] = w[col * k + i];
            sum += w[col * k + i];
        }
        colsum[col] = sum;
    }
    return OK;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
int int8_supported(void) { return 1; }

/* round-half-even(x / s) clamped to [-128, 127], + offset, as 16 bytes. Clamped before the
 * conversion rounds (to nearest even), which gives the same integers as rounding first: the
 * bounds are integers. */
static inline __m128i quantize16(__m512 x, __m512 s, int offset) {
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(x, s), _mm512_set1_ps(-128.f)), _mm512_set1_ps(127.f));
    const __m512i q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(offset)));
}

/* One row of x (float32 or bf16, read as it is: no float copy of the row) as q + offset (128:
 * uint8 for VNNI, padding 128 = q 0 up to kp bytes; 0: int8); returns its scale. The amax keeps
 * four running maxima, so successive loads do not wait on one chain of max instructions. */
#define DEFINE_QUANTIZE_ROW(NAME, T, LOAD16)                                                       \
static float NAME(const T *row, int64_t k, int64_t kp, const float *static_scale, uint8_t *q, int offset) { \
    float scale;                                                                                   \
    if (static_scale) {                                                                            \
        scale = *static_scale;                                                                     \
    } else {                                                                                       \
        __m512 amax[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()}; \
        int64_t i = 0;                                                                             \
        for (; i + 64 <= k; i += 64)                                                               \
            for (int a = 0; a < 4; a++)                                                            \
                amax[a] = _mm512_max_ps(amax[a], _mm512_abs_ps(LOAD16(row + i + 16 * a, (__mmask16)0xFFFF))); \
        for (; i < k; i += 16) {                                                                   \
            const __mmask16 lanes = k - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1); \
            amax[0] = _mm512_max_ps(amax[0], _mm512_abs_ps(LOAD16(row + i, lanes)));              \
        }                                                                                          \
        const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(amax[0], amax[1]),       \
                                                           _mm512_max_ps(amax[2], amax[3])));    \
        scale = (m > EPS ? m : EPS) / 127.0f;                                                      \
    }                                                                                              \
    const __m512 s = _mm512_set1_ps(scale);                                                        \
    int64_t i = 0;                                                                                 \
    for (; i + 16 <= k; i += 16)                                                                   \
        _mm_storeu_si128((__m128i *)(q + i), quantize16(LOAD16(row + i, (__mmask16)0xFFFF), s, offset)); \
    if (i < k) {                                                                                   \
        const __mmask16 lanes = (__mmask16)((1u << (k - i)) - 1);                                  \
        _mm_mask_storeu_epi8(q + i, lanes, quantize16(LOAD16(row + i, lanes), s, offset));        \
    }                                                                                              \
    for (int64_t j = k; j < kp; j++) q[j] = 128;                                                   \
    return scale;                                                                                  \
}
static inline __m512 f32x16_load(const float *p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
DEFINE_QUANTIZE_ROW(quantize_row_f32, float, f32x16_load)
DEFINE_QUANTIZE_ROW(quantize_row_bf16, uint16_t, bf16x16_load)

/* sums[r][v] = the int32 dot products of rows `xq[r]` with the panel's columns 16 v .. 16 v + 15. */
static inline void multiply_rows(const uint8_t *const xq[ROWS], const int8_t *panel, int64_t kp,
                                 __m512i sums[ROWS][VECS]) {
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < VECS; v++) sums[r][v] = _mm512_setzero_si512();
    for (int64_t i = 0; i < kp; i += 4) {
        __m512i w[VECS];
        for (int v = 0; v < VECS; v++) w[v] = _mm512_loadu_si512(panel + i * PANEL + v * 64);
        _mm_prefetch((const char *)(panel + i * PANEL + PREFETCH_BYTES), _MM_HINT_T0);
        for (int r = 0; r < ROWS; r++) {
            int32_t four;
            memcpy(&four, xq[r] + i, sizeof four);
            const __m512i x = _mm512_set1_epi32(four);
            for (int v = 0; v < VECS; v++) sums[r][v] = _mm512_dpbusd_epi32(sums[r][v], x, w[v]);
        }
    }
}

/* float(sum - 128 colsum) * xs, then * ws, for 16 columns: the explicitly rounded products keep
 * torch's order (-fassociative-math may regroup plain ones, which moves the last bit). */
#define NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline __m512 scaled(__m512 v, __m512 x_scale, __m512 w_scale) {
    return _mm512_mul_round_ps(_mm512_mul_round_ps(v, x_scale, NEAREST), w_scale, NEAREST);
}
static inline __m512 rescale(__m512i sum, __m512i correction, float x_scale, __m512 w_scale) {
    return scaled(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, correction)), _mm512_set1_ps(x_scale), w_scale);
}

/* Every row of x quantized (rows of kp bytes) with its scale into scales[r]. */
#define DEFINE_QUANTIZE_ROWS(NAME, T, QUANTIZE_ROW)                                                 \
static int NAME(const T *x, uint8_t *q, float *scales, const float *static_scale, int64_t m, int64_t k, \
                int64_t kp, int64_t x_stride, int offset) {                                       \
    _Pragma("omp parallel for schedule(static) if(m * k >= 16384)")                             \
    for (int64_t r = 0; r < m; r++)                                                              \
        scales[r] = QUANTIZE_ROW(x + r * x_stride, k, kp, static_scale, q + r * kp, offset);     \
    return OK;                                                                                   \
}

#define DEFINE_INT8_LINEAR(NAME, T, QUANTIZE_ROWS, STORE16, LOAD16)                                \
int NAME(const T *x, const int8_t *packed, const int32_t *colsum, const float *w_scale,           \
         const T *bias, T *out, const float *static_scale, int64_t m, int64_t k, int64_t n,      \
         int64_t x_stride, int64_t out_stride) {                                                  \
    const int64_t kp = (k + 3) / 4 * 4, panels = (n + PANEL - 1) / PANEL;                        \
    uint8_t *xq = malloc((size_t)(m * kp));                                                     \
    float *xs = malloc((size_t)m * sizeof(float));                                               \
    if (!xq || !xs || QUANTIZE_ROWS(x, xq, xs, static_scale, m, k, kp, x_stride, 128)) {         \
        free(xq); free(xs); return NO_MEMORY;                                                    \
    }                                                                                            \
    const int64_t chunks = (m + CHUNK_ROWS - 1) / CHUNK_ROWS;                                    \
    /* static: each thread streams one contiguous run of panels, which the hardware prefetcher */ \
    /* follows (dynamic items alternate panels between the threads) */                          \
    _Pragma("omp parallel for schedule(static) if(m * n >= 4096)")                              \
    for (int64_t item = 0; item < chunks * panels; item++) {                                     \
        const int64_t chunk = item / panels, p = item % panels;                                  \
        const int8_t *panel = packed + p * PANEL * kp;                                           \
        const int64_t c0 = p * PANEL, cols = n - c0 < PANEL ? n - c0 : PANEL;                    \
        __mmask16 lanes[VECS];                                                                   \
        __m512i correction[VECS];                                                                \
        __m512 ws[VECS];                                                                         \
        for (int v = 0; v < VECS; v++) {                                                         \
            const int64_t left = cols - 16 * v;                                                  \
            lanes[v] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0; \
            correction[v] = _mm512_slli_epi32(_mm512_loadu_si512(colsum + c0 + 16 * v), 7);    \
            ws[v] = _mm512_maskz_loadu_ps(lanes[v], w_scale + c0 + 16 * v);                      \
        }                                                                                        \
        const int64_t last = (chunk + 1) * CHUNK_ROWS < m ? (chunk + 1) * CHUNK_ROWS : m;        \
        for (int64_t r0 = chunk * CHUNK_ROWS; r0 < last; r0 += ROWS) {                           \
            const uint8_t *xrows[ROWS];                                                          \
            for (int r = 0; r < ROWS; r++) xrows[r] = xq + (r0 + r < last ? r0 + r : r0) * kp;   \
            __m512i sums[ROWS][VECS];                                                            \
            multiply_rows(xrows, panel, kp, sums);                                               \
            for (int r = 0; r < ROWS && r0 + r < last; r++) {                                    \
                T *orow = out + (r0 + r) * out_stride + c0;                                      \
                for (int v = 0; v < VECS; v++) {                                                 \
                    __m512 y = rescale(sums[r][v], correction[v], xs[r0 + r], ws[v]);            \
                    if (bias) y = _mm512_add_ps(ROUND16(y), LOAD16(bias + c0 + 16 * v, lanes[v])); \
                    STORE16(orow + 16 * v, lanes[v], y);                                         \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    free(xq); free(xs);                                                                          \
    return OK;                                                                                   \
}

static inline void f32x16_store(float *p, __mmask16 lanes, __m512 v) { _mm512_mask_storeu_ps(p, lanes, v); }

DEFINE_QUANTIZE_ROWS(quantize_rows_bf16, uint16_t, quantize_row_bf16)
DEFINE_QUANTIZE_ROWS(quantize_rows_f32, float, quantize_row_f32)
#define ROUND16 bf16x16_round
DEFINE_INT8_LINEAR(int8_linear_bf16, uint16_t, quantize_rows_bf16, bf16x16_store, bf16x16_load)
#undef ROUND16
#define ROUND16(v) (v)
DEFINE_INT8_LINEAR(int8_linear_f32, float, quantize_rows_f32, f32x16_store, f32x16_load)
#undef ROUND16

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include "amx_tiles.h"
_Static_assert(PANEL == 48, "the AMX path sums a panel in three tiles");

int int8_amx_supported(void) { return 1; }

/* AMX-INT8: the same panels as tiles (a weight tile is 16 k-quads of one panel's 16 columns: rows
 * PANEL * 4 bytes apart), x quantized to int8 (signed x signed TDPBSSD: no 128 offset, no colsum
 * correction), 16 rows of x a tile. Tiles 0-2 sum one panel's three 16-column groups, tile 3 holds
 * x, tiles 4-6 the weights. The sums are the same int32 as the VNNI path's, so the outputs are too.
 * Needs k % 64 == 0 (a tile row is 64 bytes of k) and the process's AMX permission (amx_request in
 * quant_linear_cpu.c); otherwise UNSUPPORTED and the caller takes the VNNI path. */

/* sums[v] = the 16 rows of `a` (int8, row stride k) times the panel's columns 16 v .. 16 v + 15. */
static inline void amx_panel_sums(const int8_t *a, const int8_t *panel, int64_t k, int32_t sums[VECS][16 * 16]) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2);
    for (int64_t kk = 0; kk < k; kk += 64) {
        _tile_loadd(3, a + kk, k);
        _tile_loadd(4, panel + kk * PANEL, PANEL * 4);
        _tile_loadd(5, panel + kk * PANEL + 64, PANEL * 4);
        _tile_loadd(6, panel + kk * PANEL + 128, PANEL * 4);
        _tile_dpbssd(0, 3, 4);
        _tile_dpbssd(1, 3, 5);
        _tile_dpbssd(2, 3, 6);
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
}

/* x quantized to int8 in whole tiles: rows past m are zeros. NULL without memory. */
#define DEFINE_QUANTIZE_TILES(NAME, T, QUANTIZE_ROWS)                                                \
static int8_t *NAME(const T *x, float **scales, const float *static_scale, int64_t m, int64_t k,     \
                    int64_t x_stride) {                                                            \
    const int64_t rows = (m + 15) / 16 * 16;                                                       \
    int8_t *xq = aligned_alloc(64, (size_t)(rows * k));                                            \
    *scales = malloc((size_t)rows * sizeof(float));                                                \
    if (!xq || !*scales || QUANTIZE_ROWS(x, (uint8_t *)xq, *scales, static_scale, m, k, k, x_stride, 0)) { \
        free(xq); free(*scales); return 0;                                                         \
    }                                                                                              \
    memset(xq + m * k, 0, (size_t)((rows - m) * k));                                               \
    return xq;                                                                                     \
}
DEFINE_QUANTIZE_TILES(quantize_tiles_bf16, uint16_t, quantize_rows_bf16)
DEFINE_QUANTIZE_TILES(quantize_tiles_f32, float, quantize_rows_f32)

/* Work items: (CHUNK_ROWS rows, panel) pairs, as the VNNI path splits them. */
#define AMX_ITEMS(m, panels) (((m) + 15) / 16 * 16 + CHUNK_ROWS - 1) / CHUNK_ROWS * (panels)

static inline void panel_lanes(int64_t cols, __mmask16 lanes[VECS]) {
    for (int v = 0; v < VECS; v++) {
        const int64_t left = cols - 16 * v;
        lanes[v] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
    }
}

#define DEFINE_INT8_LINEAR_AMX(NAME, T, QUANTIZE_TILES, STORE16, LOAD16)                           \
int NAME(const T *x, const int8_t *packed, const int32_t *colsum, const float *w_scale,           \
         const T *bias, T *out, const float *static_scale, int64_t m, int64_t k, int64_t n,      \
         int64_t x_stride, int64_t out_stride) {                                                  \
    (void)colsum;                                                                                \
    if (k % 64) return UNSUPPORTED;                                                              \
    const int64_t blocks = (m + 15) / 16, panels = (n + PANEL - 1) / PANEL;                      \
    float *xs;                                                                                   \
    int8_t *xq = QUANTIZE_TILES(x, &xs, static_scale, m, k, x_stride);                           \
    if (!xq) return NO_MEMORY;                                                                   \
    _Pragma("omp parallel if(m * n >= 4096)")                                                   \
    {                                                                                            \
        int32_t sums[VECS][16 * 16] __attribute__((aligned(64)));                                \
        _tile_loadconfig(&TILES_16x64);                                                          \
        _Pragma("omp for schedule(static)")                                                     \
        for (int64_t item = 0; item < AMX_ITEMS(m, panels); item++) {                            \
            const int64_t chunk = item / panels, p = item % panels, c0 = p * PANEL;              \
            __mmask16 lanes[VECS];                                                               \
            __m512 ws[VECS];                                                                     \
            panel_lanes(n - c0 < PANEL ? n - c0 : PANEL, lanes);                                 \
            for (int v = 0; v < VECS; v++) ws[v] = _mm512_maskz_loadu_ps(lanes[v], w_scale + c0 + 16 * v); \
            const int64_t first = chunk * CHUNK_ROWS / 16;                                       \
            const int64_t last = first + CHUNK_ROWS / 16 < blocks ? first + CHUNK_ROWS / 16 : blocks; \
            for (int64_t b = first; b < last; b++) {                                             \
                amx_panel_sums(xq + b * 16 * k, packed + p * PANEL * k, k, sums);                \
                for (int64_t r = 0; r < 16 && b * 16 + r < m; r++) {                             \
                    T *orow = out + (b * 16 + r) * out_stride + c0;                              \
                    for (int v = 0; v < VECS; v++) {                                             \
                        __m512 y = rescale(_mm512_load_si512(sums[v] + 16 * r), _mm512_setzero_si512(), \
                                           xs[b * 16 + r], ws[v]);                               \
                        if (bias) y = _mm512_add_ps(ROUND16(y), LOAD16(bias + c0 + 16 * v, lanes[v])); \
                        STORE16(orow + 16 * v, lanes[v], y);                                     \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        _tile_release();                                                                         \
    }                                                                                            \
    free(xq); free(xs);                                                                          \
    return OK;                                                                                   \
}
#define ROUND16 bf16x16_round
DEFINE_INT8_LINEAR_AMX(int8_linear_amx_bf16, uint16_t, quantize_tiles_bf16, bf16x16_store, bf16x16_load)
#undef ROUND16
#define ROUND16(v) (v)
DEFINE_INT8_LINEAR_AMX(int8_linear_amx_f32, float, quantize_tiles_f32, f32x16_store, f32x16_load)
#undef ROUND16

/* A gate|up layer on AMX with SiLU-and-mul in the epilogue: out [m, inter] bf16 =
 * silu_and_mul(the bf16 [m, 2 inter] int8_linear_amx_bf16 gives), bit for bit, without writing or
 * reading that [m, 2 inter]. The up columns of gate panel p are in panel p + inter / PANEL, so
 * inter % PANEL == 0 (else UNSUPPORTED); no bias (gate|up layers have none). */
int int8_linear_amx_silu_bf16(const uint16_t *x, const int8_t *packed, const float *w_scale, uint16_t *out,
                              const float *static_scale, int64_t m, int64_t k, int64_t inter, int64_t x_stride,
                              int64_t out_stride) {
    if (k % 64 || inter % PANEL) return UNSUPPORTED;
    const int64_t blocks = (m + 15) / 16, panels = inter / PANEL;
    float *xs;
    int8_t *xq = quantize_tiles_bf16(x, &xs, static_scale, m, k, x_stride);
    if (!xq) return NO_MEMORY;
    #pragma omp parallel if(m * inter >= 2048)
    {
        int32_t gate[VECS][16 * 16] __attribute__((aligned(64)));
        int32_t up[VECS][16 * 16] __attribute__((aligned(64)));
        _tile_loadconfig(&TILES_16x64);
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < AMX_ITEMS(m, panels); item++) {
            const int64_t chunk = item / panels, p = item % panels, c0 = p * PANEL;
            __m512 gs[VECS], us[VECS];
            for (int v = 0; v < VECS; v++) {
                gs[v] = _mm512_loadu_ps(w_scale + c0 + 16 * v);
                us[v] = _mm512_loadu_ps(w_scale + inter + c0 + 16 * v);
            }
            const int64_t first = chunk * CHUNK_ROWS / 16;
            const int64_t last = first + CHUNK_ROWS / 16 < blocks ? first + CHUNK_ROWS / 16 : blocks;
            for (int64_t b = first; b < last; b++) {
                amx_panel_sums(xq + b * 16 * k, packed + p * PANEL * k, k, gate);
                amx_panel_sums(xq + b * 16 * k, packed + (p + panels) * PANEL * k, k, up);
                for (int64_t r = 0; r < 16 && b * 16 + r < m; r++) {
                    const __m512 xscale = _mm512_set1_ps(xs[b * 16 + r]);
                    uint16_t *orow = out + (b * 16 + r) * out_stride + c0;
                    for (int v = 0; v < VECS; v++) {
                        const __m512 g = _mm512_cvtepi32_ps(_mm512_load_si512(gate[v] + 16 * r));
                        const __m512 u = _mm512_cvtepi32_ps(_mm512_load_si512(up[v] + 16 * r));
                        const __m512 y = silu_mul16(bf16x16_round(scaled(g, xscale, gs[v])),
                                                    bf16x16_round(scaled(u, xscale, us[v])));
                        bf16x16_store(orow + 16 * v, (__mmask16)0xFFFF, y);
                    }
                }
            }
        }
        _tile_release();
    }
    free(xq); free(xs);
    return OK;
}
#else
int int8_amx_supported(void) { return 0; }
int int8_linear_amx_bf16(void) { return UNSUPPORTED; }
int int8_linear_amx_f32(void) { return UNSUPPORTED; }
int int8_linear_amx_silu_bf16(void) { return UNSUPPORTED; }
#endif

/* The passes around torch._int_mm, where oneDNN's GEMM beats the panels above (mid-size M): x's
 * rows quantized as the torch form does (weights.py quantize_int8_per_token, or every row with
 * `static_scale`) into int8 q [m, k] and float32 scales [m], one pass instead of six. */
int int8_quantize_bf16(const uint16_t *x, int8_t *q, float *scales, const float *static_scale, int64_t m, int64_t k,
                       int64_t x_stride) {
    return quantize_rows_bf16(x, (uint8_t *)q, scales, static_scale, m, k, k, x_stride, 0);
}
int int8_quantize_f32(const float *x, int8_t *q, float *scales, const float *static_scale, int64_t m, int64_t k,
                      int64_t x_stride) {
    return quantize_rows_f32(x, (uint8_t *)q, scales, static_scale, m, k, k, x_stride, 0);
}

/* out [m, n] = float(acc) * x_scales[r] * w_scale[c] in out's dtype, in torch's order and roundings
 * (`.float().mul_(x_scale).mul_(scale).to(dtype)`), one pass instead of four. A scale step of 0
 * broadcasts its first value (a static or per-tensor scale). */
#define DEFINE_INT8_RESCALE(NAME, T, STORE16)                                                       \
int NAME(const int32_t *acc, const float *x_scales, const float *w_scale, T *out, int64_t m, int64_t n, \
         int64_t x_scale_step, int64_t w_scale_step) {                                            \
    _Pragma("omp parallel for schedule(static) if(m * n >= 65536)")                             \
    for (int64_t r = 0; r < m; r++) {                                                            \
        const __m512 xs = _mm512_set1_ps(x_scales[r * x_scale_step]);                            \
        for (int64_t c = 0; c < n; c += 16) {                                                    \
            const __mmask16 lanes = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1); \
            const __m512 ws = w_scale_step ? _mm512_maskz_loadu_ps(lanes, w_scale + c)          \
                                           : _mm512_set1_ps(w_scale[0]);                         \
            const __m512 v = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(lanes, acc + r * n + c)); \
            STORE16(out + r * n + c, lanes, scaled(v, xs, ws));                                  \
        }                                                                                        \
    }                                                                                            \
    return OK;                                                                                   \
}
DEFINE_INT8_RESCALE(int8_rescale_bf16, uint16_t, bf16x16_store)
DEFINE_INT8_RESCALE(int8_rescale_f32, float, f32x16_store)

/* A gate|up GEMM's products acc [m, 2 * inter] -> out [m, inter] = silu_and_mul of their bf16
 * rescale, bit for bit `int8_rescale_bf16` then fused_cpu's `silu_and_mul_bf16`, in one pass: the
 * bf16 [m, 2 * inter] between them is neither written nor read again (at a 2,048-token prefill
 * of SmolLM2, 12.6 MB a layer each way). */
int int8_rescale_silu_bf16(const int32_t *acc, const float *x_scales, const float *w_scale, uint16_t *out,
                           int64_t m, int64_t inter, int64_t x_scale_step, int64_t w_scale_step) {
    _Pragma("omp parallel for schedule(static) if(m * inter >= 32768)")
    for (int64_t r = 0; r < m; r++) {
        const __m512 xs = _mm512_set1_ps(x_scales[r * x_scale_step]);
        const int32_t *gate = acc + r * 2 * inter, *up = gate + inter;
        for (int64_t c = 0; c < inter; c += 16) {
            const __mmask16 lanes = inter - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (inter - c)) - 1);
            const __m512 gs = w_scale_step ? _mm512_maskz_loadu_ps(lanes, w_scale + c) : _mm512_set1_ps(w_scale[0]);
            const __m512 us = w_scale_step ? _mm512_maskz_loadu_ps(lanes, w_scale + inter + c) : gs;
            const __m512 g = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(lanes, gate + c));
            const __m512 u = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(lanes, up + c));
            const __m512 y = silu_mul16(bf16x16_round(scaled(g, xs, gs)), bf16x16_round(scaled(u, xs, us)));
            bf16x16_store(out + r * inter + c, lanes, y);
        }
    }
    return OK;
}
#else
int int8_supported(void) { return 0; }
int int8_amx_supported(void) { return 0; }
int int8_linear_amx_bf16(void) { return UNSUPPORTED; }
int int8_linear_amx_f32(void) { return UNSUPPORTED; }
int int8_linear_amx_silu_bf16(void) { return UNSUPPORTED; }
int int8_linear_bf16(void) { return UNSUPPORTED; }
int int8_linear_f32(void) { return UNSUPPORTED; }
int int8_quantize_bf16(void) { return UNSUPPORTED; }
int int8_quantize_f32(void) { return UNSUPPORTED; }
int int8_rescale_bf16(void) { return UNSUPPORTED; }
int int8_rescale_f32(void) { return UNSUPPORTED; }
int int8_rescale_silu_bf16(void) { return UNSUPPORTED; }
#endif
