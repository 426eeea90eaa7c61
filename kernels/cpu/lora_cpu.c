/* Multi-LoRA on the CPU: every token's adapter delta added to a layer's output in one call,
 * out[t] += (x[t] @ A[slot].T) @ B[slot].T, each token with its own slot's A and B.
 *
 * Why a kernel: in torch the delta of a step that mixes adapters is either a loop of small
 * matmuls per slot or one masked matmul pair over every slot's matrices; both cost ~300 us a
 * layer in the engine (dispatch, temporaries, every slot's weights for every token) against a
 * few tens of microseconds of arithmetic. Here tokens are taken slot by slot (`order`,
 * `slot_starts`), so each slot's matrices are read once per call for all its tokens, only the
 * ranks an adapter has are computed, and nothing is allocated but the float32 shrink.
 *
 * Layouts (a layer stacking n checkpoint matrices, q|k|v or gate|up, at rank R = max rank):
 *   a  [S, n * R, K]  shard i's A rows are block i of the rank axis (zero-padded past its rank)
 *   bt [S, N / 32, R / 2, 32, 2]  B transposed, compacted and blocked: column c of shard i
 *                     holds B[c, i * R + j] in block c / 32, pair j / 2, lane c % 32, element j % 2,
 *                     so the shards share the rank rows (their columns are disjoint), a block of
 *                     32 columns is R * 32 contiguous values, and a lane holds two ranks' values
 *                     side by side, as vdpbf16ps takes them (N padded to whole blocks, R to even)
 *   ranks [S, n]      each slot's rank in each shard, 0 = the adapter leaves that shard alone
 *   bounds [n + 1]    the shards' first output columns, then N
 * The shrink and the expand accumulate in float32; each output element is rounded once, from
 * out + delta. Two phases in one parallel region: the shrink fills s [tokens, n * R] per (slot,
 * tile of TOKEN_TILE tokens), then the expand adds s @ bt into out per (slot, tile, shard,
 * COLUMN_CHUNK columns). With AVX512-BF16 both phases of the bf16 kernel are register-blocked
 * (vdpbf16ps over 4 rows x 4 tokens for the shrink, over 8 tokens x 32 columns x 2 ranks for
 * the expand, whose s is then rounded to bf16 as torch's bf16 matmul rounds its shrink);
 * elsewhere plain loops the compiler vectorises. In the engine the matrices come from memory each call
 * (the base weights evicted them), so both phases also prefetch the rows they read next.
 * Built by kernels/cpu/cpu_build.py, called by lora_cpu.py.
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_math.h"

#define TOKEN_TILE 8        /* tokens sharing each loaded row of A and of B */
#define COLUMN_CHUNK 256    /* output columns of one expand work item */
#define PARALLEL_FMAS 65536 /* below this, waking the second thread costs more than it saves */
#define PREFETCH_BLOCKS 4   /* how far ahead the expand asks for blocks of B (~100 ns of memory latency) */

#define ID(x) (x)

/* The plain phases, any dtype. shrink: s[t][r] for this tile's `count` tokens (rows of x at
 * `tokens`) and A's rows `rows` (r < rank of its shard, 0 past it); xs: TOKEN_TILE * k floats. */
#define DEFINE_PHASES(SUFFIX, T, LOAD, STORE)                                                     \
static void shrink_##SUFFIX(const T *x, int64_t x_stride, const int32_t *tokens, int64_t count, \
                            const T *a, const int32_t *ranks, int64_t num_shards, int64_t max_rank,\
                            int64_t k, float *s, int64_t width, float *xs) {                    \
    for (int64_t t = 0; t < count; t++) {                                                       \
        const T *row = x + (int64_t)tokens[t] * x_stride;                                      \
        for (int64_t c = 0; c < k; c++) xs[t * k + c] = LOAD(row[c]);                           \
    }                                                                                           \
    for (int64_t shard = 0; shard < num_shards; shard++)                                        \
        for (int64_t j = 0; j < max_rank; j++) {                                                \
            const int64_t r = shard * max_rank + j;                                             \
            const T *arow = a + r * k;                                                          \
            for (int64_t t = 0; t < count; t++) {                                               \
                float dot = 0.f;                                                                \
                if (j < ranks[shard]) {                                                         \
                    _Pragma("omp simd reduction(+:dot)")                                       \
                    for (int64_t c = 0; c < k; c++) dot += LOAD(arow[c]) * xs[t * k + c];       \
                }                                                                               \
                s[t * width + r] = dot;                                                         \
            }                                                                                   \
        }                                                                                       \
}                                                                                               \
/* expand: out[tokens[t]][c0 : c0 + cols] += s[t][0 : rank] @ bt's rows 0 : rank of those columns */ \
static void expand_##SUFFIX(T *out, int64_t out_stride, const int32_t *tokens, int64_t count,  \
                            const float *s, int64_t width, const T *bt, int64_t pairs,         \
                            int64_t rank, int64_t c0, int64_t cols) {                          \
    float acc[TOKEN_TILE][COLUMN_CHUNK];                                                        \
    for (int64_t t = 0; t < count; t++)                                                         \
        for (int64_t c = 0; c < cols; c++) acc[t][c] = 0.f;                                     \
    for (int64_t j = 0; j < rank; j++)                                                          \
        for (int64_t t = 0; t < count; t++) {                                                   \
            const float v = s[t * width + j];                                                   \
            for (int64_t c = 0; c < cols; c++) {                                                \
                const int64_t column = c0 + c;                                                  \
                acc[t][c] += v * LOAD(bt[(((column >> 5) * pairs + (j >> 1)) * 32 + (column & 31)) * 2 + (j & 1)]); \
            }                                                                                   \
        }                                                                                       \
    for (int64_t t = 0; t < count; t++) {                                                       \
        T *orow = out + (int64_t)tokens[t] * out_stride + c0;                                   \
        for (int64_t c = 0; c < cols; c++) orow[c] = STORE(LOAD(orow[c]) + acc[t][c]);          \
    }                                                                                           \
}

#if defined(__AVX512BF16__)
/* shrink, bf16: 4 rows of A x 4 tokens of vdpbf16ps partial sums (32 elements of k a step,
 * products exact in float32), reduced once at the end. A short group repeats its last row or
 * token (computed, not stored), so the block always stays in registers. */
static void shrink_bf16(const uint16_t *x, int64_t x_stride, const int32_t *tokens, int64_t count,
                        const uint16_t *a, const int32_t *ranks, int64_t num_shards, int64_t max_rank,
                        int64_t k, float *s, int64_t width, float *xs) {
    (void)xs;
    for (int64_t shard = 0; shard < num_shards; shard++) {
        const int64_t rank = ranks[shard], first_row = shard * max_rank;
        for (int64_t t = 0; t < count; t++)
            for (int64_t j = rank; j < max_rank; j++) s[t * width + first_row + j] = 0.f;
        for (int64_t j0 = 0; j0 < rank; j0 += 4)
            for (int64_t t0 = 0; t0 < count; t0 += 4) {
                const uint16_t *arow[4], *xrow[4];
                for (int i = 0; i < 4; i++) {
                    arow[i] = a + (first_row + (j0 + i < rank ? j0 + i : rank - 1)) * k;
                    xrow[i] = x + (int64_t)tokens[t0 + i < count ? t0 + i : count - 1] * x_stride;
                }
                __m512 acc[4][4];
                for (int i = 0; i < 4; i++)
                    for (int t = 0; t < 4; t++) acc[i][t] = _mm512_setzero_ps();
                /* the next 4 rows of A (this shard's, else the next shard's first), fetched as
                 * this group streams through its own; the very first group's, all at once */
                const uint16_t *next = a + (j0 + 4 < rank ? first_row + j0 + 4 : first_row + max_rank) * k;
                if (shard == 0 && j0 == 0 && t0 == 0)
                    for (int64_t line = 0; line < 4 * k; line += 32) _mm_prefetch((const char *)(a + line), _MM_HINT_T0);
                for (int64_t c = 0; c < k; c += 32) {
                    if (t0 == 0)
                        for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(next + i * k + c), _MM_HINT_T0);
                    const __mmask32 lanes = k - c >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (k - c)) - 1);
                    __m512bh av[4], xv[4];
                    for (int i = 0; i < 4; i++) {
                        av[i] = (__m512bh)_mm512_maskz_loadu_epi16(lanes, arow[i] + c);
                        xv[i] = (__m512bh)_mm512_maskz_loadu_epi16(lanes, xrow[i] + c);
                    }
                    for (int i = 0; i < 4; i++)
                        for (int t = 0; t < 4; t++) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], av[i], xv[t]);
                }
                for (int i = 0; i < 4 && j0 + i < rank; i++)
                    for (int t = 0; t < 4 && t0 + t < count; t++)
                        s[(t0 + t) * width + first_row + j0 + i] = _mm512_reduce_add_ps(acc[i][t]);
            }
    }
}

/* expand, bf16: 8 tokens x one block of 32 columns of float32 sums in registers, two ranks a
 * vdpbf16ps (each lane's pair of B values against the token's pair of s values rounded to bf16);
 * each pair row of the block is loaded once, and the block PREFETCH_BLOCKS ahead is prefetched.
 * Lanes outside c0 : c0 + cols are masked (a block can straddle two shards or chunks). Missing
 * tokens of a short tile repeat the first (computed, not stored). */
static void expand_bf16(uint16_t *out, int64_t out_stride, const int32_t *tokens, int64_t count,
                        const float *s, int64_t width, const uint16_t *bt, int64_t pairs,
                        int64_t rank, int64_t c0, int64_t cols) {
    const int64_t used = (rank + 1) / 2;
    uint32_t spair[TOKEN_TILE][used];   /* s[t][2p], s[t][2p + 1] as bf16, low half first; 0 past rank */
    for (int t = 0; t < TOKEN_TILE; t++) {
        const float *row = s + (t < count ? t : 0) * width;
        for (int64_t p = 0; p < used; p++)
            spair[t][p] = (uint32_t)float_to_bf16(row[2 * p])
                          | (uint32_t)(2 * p + 1 < rank ? float_to_bf16(row[2 * p + 1]) : 0) << 16;
    }
    const int64_t block_values = pairs * 64;
    for (int64_t block = c0 >> 5; block * 32 < c0 + cols; block++) {
        const int64_t base = block * 32;
        const int64_t from = c0 > base ? c0 - base : 0, to = c0 + cols < base + 32 ? c0 + cols - base : 32;
        const uint32_t lanes = (uint32_t)((to == 32 ? 0xFFFFFFFFu : (1u << to) - 1) & ~((1u << from) - 1));
        const __mmask16 lo = (__mmask16)(lanes & 0xFFFF), hi = (__mmask16)(lanes >> 16);
        const uint16_t *rows = bt + block * block_values;
        if (block == c0 >> 5)   /* a work item's first block: its next blocks are on their way */
            for (int64_t line = 0; line < PREFETCH_BLOCKS * block_values; line += 32)
                _mm_prefetch((const char *)(rows + line), _MM_HINT_T0);
        for (int64_t line = 0; line < used * 64; line += 32)
            _mm_prefetch((const char *)(rows + PREFETCH_BLOCKS * block_values + line), _MM_HINT_T0);
        __m512 acc[TOKEN_TILE][2];
        for (int t = 0; t < TOKEN_TILE; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
        for (int64_t p = 0; p < used; p++) {
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(rows + p * 64);
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(rows + p * 64 + 32);
            for (int t = 0; t < TOKEN_TILE; t++) {
                const __m512bh v = (__m512bh)_mm512_set1_epi32((int)spair[t][p]);
                acc[t][0] = _mm512_dpbf16_ps(acc[t][0], b0, v);
                acc[t][1] = _mm512_dpbf16_ps(acc[t][1], b1, v);
            }
        }
        for (int64_t t = 0; t < count; t++) {
            uint16_t *orow = out + (int64_t)tokens[t] * out_stride + base;
            const __m512 o0 = _mm512_add_ps(bf16x16_load(orow, lo), acc[t][0]);
            const __m512 o1 = _mm512_add_ps(bf16x16_load(orow + 16, hi), acc[t][1]);
            _mm256_mask_storeu_epi16(orow, lo, (__m256i)_mm512_cvtneps_pbh(o0));
            _mm256_mask_storeu_epi16(orow + 16, hi, (__m256i)_mm512_cvtneps_pbh(o1));
        }
    }
}
#else
DEFINE_PHASES(bf16, uint16_t, bf16_to_float, float_to_bf16)
#endif
DEFINE_PHASES(f32, float, ID, ID)

#define DEFINE_LORA(SUFFIX, T)                                                                    \
int lora_add_##SUFFIX(const T *x, T *out, const T *a, const T *bt, const int32_t *order,         \
                      const int64_t *slot_starts, const int32_t *ranks, const int64_t *bounds,   \
                      int64_t num_slots, int64_t num_shards, int64_t max_rank, int64_t k,        \
                      int64_t n, int64_t x_stride, int64_t out_stride) {                         \
    const int64_t tokens = slot_starts[num_slots] - slot_starts[0];                             \
    const int64_t width = num_shards * max_rank;                                                 \
    if (tokens <= 0) return 0;                                                                   \
    /* s, then per thread TOKEN_TILE rows of k floats (the plain shrink's tile of x) */          \
    const int64_t threads = omp_get_max_threads();                                               \
    float *s = malloc((size_t)(tokens * width + threads * TOKEN_TILE * k) * sizeof(float));     \
    if (!s) return 1;   /* before any write to out: the caller falls back */                     \
    const int64_t chunks = (n + COLUMN_CHUNK - 1) / COLUMN_CHUNK + num_shards;                   \
    const int64_t tiles = (tokens + TOKEN_TILE - 1) / TOKEN_TILE + num_slots;                   \
    const int64_t fmas = tokens * (k * width + n * max_rank);                                    \
    const int64_t blocks = (n + 31) / 32, pairs = (max_rank + 1) / 2;   /* of bt */              \
    _Pragma("omp parallel if(fmas >= PARALLEL_FMAS)")                                          \
    {                                                                                            \
        float *xs = s + tokens * width + omp_get_thread_num() * TOKEN_TILE * k;                 \
        _Pragma("omp for schedule(dynamic)")                                                    \
        for (int64_t item = 0; item < num_slots * tiles; item++) {                               \
            const int64_t slot = item / tiles, first = slot_starts[slot] + item % tiles * TOKEN_TILE; \
            if (first >= slot_starts[slot + 1]) continue;                                        \
            const int64_t count = slot_starts[slot + 1] - first < TOKEN_TILE                     \
                                  ? slot_starts[slot + 1] - first : TOKEN_TILE;                  \
            shrink_##SUFFIX(x, x_stride, order + first, count, a + slot * width * k,             \
                            ranks + slot * num_shards, num_shards, max_rank, k,                  \
                            s + (first - slot_starts[0]) * width, width, xs);                    \
        }                                                                                        \
        _Pragma("omp for schedule(dynamic)")                                                    \
        for (int64_t item = 0; item < num_slots * tiles * chunks; item++) {                      \
            const int64_t slot = item / (tiles * chunks), chunk = item % chunks;                 \
            const int64_t first = slot_starts[slot] + item / chunks % tiles * TOKEN_TILE;        \
            if (first >= slot_starts[slot + 1]) continue;                                        \
            const int64_t count = slot_starts[slot + 1] - first < TOKEN_TILE                     \
                                  ? slot_starts[slot + 1] - first : TOKEN_TILE;                  \
            /* chunk -> (shard, its columns): chunks are numbered shard by shard */              \
            int64_t shard = 0, skip = chunk;                                                     \
            for (; shard < num_shards; shard++) {                                                \
                const int64_t own = (bounds[shard + 1] - bounds[shard] + COLUMN_CHUNK - 1)       \
                                    / COLUMN_CHUNK;                                              \
                if (skip < own) break;                                                           \
                skip -= own;                                                                     \
            }                                                                                    \
            if (shard == num_shards || ranks[slot * num_shards + shard] == 0) continue;          \
            const int64_t c0 = bounds[shard] + skip * COLUMN_CHUNK;                              \
            const int64_t cols = bounds[shard + 1] - c0 < COLUMN_CHUNK                           \
                                 ? bounds[shard + 1] - c0 : COLUMN_CHUNK;                        \
            expand_##SUFFIX(out, out_stride, order + first, count,                               \
                            s + (first - slot_starts[0]) * width + shard * max_rank, width,     \
                            bt + slot * blocks * pairs * 64, pairs,                              \
                            ranks[slot * num_shards + shard], c0, cols);                         \
        }                                                                                        \
    }                                                                                            \
    free(s);                                                                                     \
    return 0;                                                                                    \
}

DEFINE_LORA(bf16, uint16_t)
DEFINE_LORA(f32, float)
