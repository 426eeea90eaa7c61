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
 *   bt [S, R, N]      B transposed and compacted: column c of shard i holds B[c, i * R + j] at
 *                     row j, so the shards share the R rows (their columns are disjoint)
 *   ranks [S, n]      each slot's rank in each shard, 0 = the adapter leaves that shard alone
 *   bounds [n + 1]    the shards' first output columns, then N
 * The shrink and the expand accumulate in float32; each output element is rounded once, from
 * out + delta. Built by kernels/cpu_build.py, called by kernels/lora_cpu.py.
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_math.h"

#define TOKEN_TILE 8       /* tokens sharing each loaded row of A and of B */
#define COLUMN_CHUNK 256   /* output columns of one expand work item (8 x 256 floats of L1) */
#define PARALLEL_FMAS 65536 /* below this, waking the second thread costs more than it saves */

#define ID(x) (x)

/* Two phases in one parallel region: the shrink fills s [tokens, n * R] (tokens in `order`
 * order), then the expand adds s @ bt into out, work items (slot, token tile, shard, chunk). */
#define DEFINE_LORA(NAME, T, LOAD, STORE)                                                        \
int NAME(const T *x, T *out, const T *a, const T *bt, const int32_t *order,                    \
         const int64_t *slot_starts, const int32_t *ranks, const int64_t *bounds,              \
         int64_t num_slots, int64_t num_shards, int64_t max_rank, int64_t k, int64_t n,        \
         int64_t x_stride, int64_t out_stride) {                                               \
    const int64_t tokens = slot_starts[num_slots] - slot_starts[0];                           \
    const int64_t width = num_shards * max_rank;                                               \
    if (tokens <= 0) return 0;                                                                 \
    /* s, then per thread (TOKEN_TILE + 1) rows of k floats: the tile of x and one row of A */ \
    const int64_t threads = omp_get_max_threads();                                             \
    float *s = malloc((size_t)(tokens * width + threads * (TOKEN_TILE + 1) * k) * sizeof(float)); \
    if (!s) return 1;   /* before any write to out: the caller may fall back */                \
    const int64_t chunks = (n + COLUMN_CHUNK - 1) / COLUMN_CHUNK + num_shards;                 \
    const int64_t tiles = (tokens + TOKEN_TILE - 1) / TOKEN_TILE + num_slots;                 \
    const int64_t fmas = tokens * (k * width + n * max_rank);                                  \
    _Pragma("omp parallel if(fmas >= PARALLEL_FMAS)")                                        \
    {                                                                                          \
        float *xs = s + tokens * width + omp_get_thread_num() * (TOKEN_TILE + 1) * k;         \
        float *af = xs + TOKEN_TILE * k;                                                       \
        /* shrink: one work item per (slot, token tile) */                                     \
        _Pragma("omp for schedule(dynamic)")                                                  \
        for (int64_t item = 0; item < num_slots * tiles; item++) {                             \
            const int64_t slot = item / tiles, tile = item % tiles;                            \
            const int64_t first = slot_starts[slot] + tile * TOKEN_TILE;                       \
            if (first >= slot_starts[slot + 1]) continue;                                      \
            const int64_t count = slot_starts[slot + 1] - first < TOKEN_TILE                   \
                                  ? slot_starts[slot + 1] - first : TOKEN_TILE;                \
            for (int64_t t = 0; t < count; t++) {                                              \
                const T *row = x + (int64_t)order[first + t] * x_stride;                       \
                for (int64_t c = 0; c < k; c++) xs[t * k + c] = LOAD(row[c]);                    \
            }                                                                                  \
            float *srow = s + (first - slot_starts[0]) * width;                                \
            for (int64_t shard = 0; shard < num_shards; shard++) {                             \
                const int64_t rank = ranks[slot * num_shards + shard];                         \
                for (int64_t j = 0; j < max_rank; j++) {                                       \
                    const int64_t r = shard * max_rank + j;                                    \
                    if (j >= rank) {                                                           \
                        for (int64_t t = 0; t < count; t++) srow[t * width + r] = 0.f;         \
                        continue;                                                              \
                    }                                                                          \
                    const T *arow = a + (slot * width + r) * k;                                \
                    for (int64_t c = 0; c < k; c++) af[c] = LOAD(arow[c]);                     \
                    for (int64_t t = 0; t < count; t++) {                                      \
                        float dot = 0.f;                                                       \
                        _Pragma("omp simd reduction(+:dot)")                                  \
                        for (int64_t c = 0; c < k; c++) dot += af[c] * xs[t * k + c];           \
                        srow[t * width + r] = dot;                                             \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        /* expand: one work item per (slot, token tile, column chunk of a shard) */            \
        _Pragma("omp for schedule(dynamic)")                                                  \
        for (int64_t item = 0; item < num_slots * tiles * chunks; item++) {                    \
            const int64_t slot = item / (tiles * chunks);                                      \
            const int64_t tile = item / chunks % tiles, chunk = item % chunks;                 \
            const int64_t first = slot_starts[slot] + tile * TOKEN_TILE;                       \
            if (first >= slot_starts[slot + 1]) continue;                                      \
            const int64_t count = slot_starts[slot + 1] - first < TOKEN_TILE                   \
                                  ? slot_starts[slot + 1] - first : TOKEN_TILE;                \
            /* chunk -> (shard, its columns): chunks are numbered shard by shard */            \
            int64_t shard = 0, skip = chunk;                                                   \
            for (; shard < num_shards; shard++) {                                              \
                const int64_t own = (bounds[shard + 1] - bounds[shard] + COLUMN_CHUNK - 1)     \
                                    / COLUMN_CHUNK;                                            \
                if (skip < own) break;                                                         \
                skip -= own;                                                                   \
            }                                                                                  \
            if (shard == num_shards) continue;                                                 \
            const int64_t rank = ranks[slot * num_shards + shard];                             \
            if (rank == 0) continue;                                                           \
            const int64_t c0 = bounds[shard] + skip * COLUMN_CHUNK;                            \
            const int64_t cols = bounds[shard + 1] - c0 < COLUMN_CHUNK                         \
                                 ? bounds[shard + 1] - c0 : COLUMN_CHUNK;                      \
            const float *srow = s + (first - slot_starts[0]) * width + shard * max_rank;      \
            float acc[TOKEN_TILE][COLUMN_CHUNK];                                               \
            for (int64_t t = 0; t < count; t++)                                                \
                for (int64_t c = 0; c < cols; c++) acc[t][c] = 0.f;                            \
            for (int64_t j = 0; j < rank; j++) {                                               \
                const T *brow = bt + (slot * max_rank + j) * n + c0;                           \
                float bf[COLUMN_CHUNK];                                                        \
                for (int64_t c = 0; c < cols; c++) bf[c] = LOAD(brow[c]);                      \
                for (int64_t t = 0; t < count; t++) {                                          \
                    const float v = srow[t * width + j];                                       \
                    _Pragma("omp simd")                                                       \
                    for (int64_t c = 0; c < cols; c++) acc[t][c] += v * bf[c];                 \
                }                                                                              \
            }                                                                                  \
            for (int64_t t = 0; t < count; t++) {                                              \
                T *orow = out + (int64_t)order[first + t] * out_stride + c0;                   \
                for (int64_t c = 0; c < cols; c++) orow[c] = STORE(LOAD(orow[c]) + acc[t][c]); \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    free(s);                                                                                   \
    return 0;                                                                                  \
}

DEFINE_LORA(lora_add_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_LORA(lora_add_f32, float, ID, ID)
