/* Paged-attention decode for CPUs: one query token per sequence, K/V read in place from the
 * paged cache through the block table (no gathered copy), float32 math, OpenMP over sequences
 * (or (sequence, KV head) pairs when there are few); the query heads sharing a KV head (GQA)
 * read each K/V row once.
 *
 * Layouts: q [S, H, D] with each sequence's heads contiguous and its rows `q_stride` elements
 * apart (a view into the fused q|k|v output needs no copy); out [S, H, D], k_cache and v_cache
 * [NB, BS, KH, D] contiguous;
 * block_tables [S, MB] int32; seq_lens [S] int32. A sequence attends to its keys
 * [max(0, len - window), len) (window <= 0: all). Exact two-pass softmax, the same math as
 * kernels/reference/attention_ref.py; built by kernels/cpu/cpu_build.py, called by paged_decode_cpu.py.
 * bf16 with head_dim 64 or 128 on AVX512-BF16 machines takes the intrinsics path at the end
 * (measured 1.3-1.5x the portable loop: 21 vs 32 ns per key and KV head on one thread).
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_math.h"

#define MAX_GROUP 32  /* query heads per KV head */
#define MAX_HEAD_DIM 256

/* Ask for this head's rows of the walk's next block (if any) while the current one is read:
 * blocks lie anywhere in the pool, so the hardware prefetcher cannot guess the next one. At 32
 * sequences x 200 tokens this took decode attention from 5-7 to 8-10 GB/s of K/V. */
static inline void prefetch_next_block(const void *cache, const int32_t *table, int block, int first, int count,
                                       int64_t block_size, int64_t row_bytes, int64_t head_bytes) {
    if (block >= (first + count - 1) / block_size) return;
    const char *base = (const char *)cache + (int64_t)table[block + 1] * block_size * row_bytes;
    for (int64_t r = 0; r < block_size; r++)
        for (int64_t b = 0; b < head_bytes; b += 64) __builtin_prefetch(base + r * row_bytes + b);
}

/* While a thread works on one sequence, the K and V rows of the next sequence it will take are
 * asked for into L2, a few lines for every row it reads: without it each sequence's first read of
 * a block waits on DRAM (30 layers of 32 sequences x 200 keys: 6.5 ms a step from DRAM, 2.2 with
 * everything in cache). All at once at the start of a task instead, the requests queue up and
 * the core waits on them (that gained nothing for bf16). 32 x 200 x 30 on huge pages, alternated:
 * bf16 6.4-6.7 -> 5.2-5.4 ms a step; fp8 5.5-6.1 -> 4.2-4.3. Thread-local, so that every task
 * variant's row loops advance it. */
typedef struct {
    const char *k, *v;          /* the caches */
    const int32_t *table;       /* the next sequence's block table */
    int64_t block_bytes, offset;
    int block, end;             /* the next block to ask for, and one past its last */
    int per_read, every, countdown;  /* lines asked for per row read, or one line every `every` reads */
} NextSequence;
static __thread NextSequence next_sequence;

static inline void prefetch_next_sequence(int rows) {
    NextSequence *n = &next_sequence;
    if (n->block >= n->end) return;
    int lines = rows * n->per_read;
    if (n->every > 1) {
        for (lines = 0, n->countdown -= rows; n->countdown <= 0; n->countdown += n->every) lines++;
    }
    for (int i = 0; i < lines && n->block < n->end; i++) {
        const int64_t at = (int64_t)n->table[n->block] * n->block_bytes + n->offset;
        __builtin_prefetch(n->k + at, 0, 2);
        __builtin_prefetch(n->v + at, 0, 2);
        if ((n->offset += 64) >= n->block_bytes) {
            n->offset = 0;
            n->block++;
        }
    }
}

/* Keys [first, first + count) of one block-table walk: calls BODY with `row` at each key
 * (`head_bytes` of it are read). */
#define FOR_EACH_ROW(T, cache, row, head_bytes, BODY)                                              \
    for (int j = 0; j < count;) {                                                               \
        const int pos = first + j;                                                              \
        const int offset = pos % block_size;                                                    \
        const int run = (int)(block_size - offset) < count - j ? (int)(block_size - offset) : count - j; \
        const T *row = cache + ((int64_t)table[pos / block_size] * block_size + offset) * kv_stride; \
        prefetch_next_block(cache, table, pos / block_size, first, count, block_size,          \
                            kv_stride * (int64_t)sizeof(T), head_bytes);                        \
        for (int t = 0; t < run; t++, j++, row += kv_stride) { prefetch_next_sequence(1); BODY } \
    }

/* Each head's scores [group][count] -> its unnormalised softmax weights in place, their sums into
 * total: exp(score - the head's best). */
static inline void softmax_weights(float *scores, int group, int count, const float *best, float *total) {
    for (int g = 0; g < group; g++) {
        float *w = scores + (int64_t)g * count, sum = 0.f;
        for (int j = 0; j < count; j++) { w[j] = exp_nonpositive(w[j] - best[g]); sum += w[j]; }
        total[g] = sum;
    }
}

/* How a cache's values turn into the float32 value of the model: bf16 and float32 as they are;
 * fp8 (read as fp8_row_to_float) times k_factor for K (folded into the queries) and v_factor
 * for V (folded into the output), its per-tensor scale times fp8_factor. */
typedef struct {
    int e5m2;
    float k_factor, v_factor;
} KVFormat;

static const KVFormat PLAIN = {0, 1.f, 1.f};

/* One (sequence, KV head): its `group` query heads against keys [first, first + count).
 * Always inlined with a literal head_dim where it is common, so the row loops unroll. Keys are
 * walked block by block: no division per key. LOAD_ROW(dst, src, n) reads n cache values as float. */
#define DEFINE_TASK(NAME, T, C, LOAD, STORE, LOAD_ROW)                                          \
static inline __attribute__((always_inline)) void NAME(                                        \
        const T *q, const C *k_cache, const C *v_cache, const int32_t *table, T *out,          \
        int64_t kv_stride, int group, int64_t head_dim, int64_t block_size, int first,         \
        int count, float scale, float *scores, const KVFormat *format) {                       \
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];         \
    float best[MAX_GROUP], total[MAX_GROUP];                                                    \
    const float q_scale = scale * format->k_factor;                                             \
    (void)format->e5m2;                                                                         \
    for (int g = 0; g < group; g++) {                                                           \
        for (int64_t d = 0; d < head_dim; d++) {                                                \
            qf[g][d] = LOAD(q[g * head_dim + d]) * q_scale;                                     \
            acc[g][d] = 0.f;                                                                    \
        }                                                                                       \
        best[g] = -INFINITY;                                                                    \
    }                                                                                           \
    FOR_EACH_ROW(C, k_cache, krow, head_dim * (int64_t)sizeof(C), {  /* scores [group][count], maxima */ \
        LOAD_ROW(row, krow, head_dim);                                                          \
        for (int g = 0; g < group; g++) {                                                       \
            float dot = 0.f;                                                                    \
            for (int64_t d = 0; d < head_dim; d++) dot += qf[g][d] * row[d];                    \
            scores[(int64_t)g * count + j] = dot;                                               \
            best[g] = dot > best[g] ? dot : best[g];                                            \
        }                                                                                       \
    })                                                                                          \
    softmax_weights(scores, group, count, best, total);                                         \
    FOR_EACH_ROW(C, v_cache, vrow, head_dim * (int64_t)sizeof(C), {  /* weights times V */    \
        LOAD_ROW(row, vrow, head_dim);                                                          \
        for (int g = 0; g < group; g++) {                                                       \
            const float w = scores[(int64_t)g * count + j];                                     \
            for (int64_t d = 0; d < head_dim; d++) acc[g][d] += w * row[d];                     \
        }                                                                                       \
    })                                                                                          \
    for (int g = 0; g < group; g++) {                                                           \
        const float inv = (total[g] > 0.f ? 1.f / total[g] : 0.f) * format->v_factor;           \
        for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] = STORE(acc[g][d] * inv);  \
    }                                                                                           \
}

/* A task is one sequence, all its KV heads, once there are enough sequences to keep the threads
 * busy (SEQUENCES_PER_THREAD each): its block rows (every head's slice, adjacent in memory) are
 * then read by one core, whose prefetchers fetch the whole row. 32 sequences x 200 tokens x 30
 * layers, 2 threads, alternated: 12.9-19.0 ms a step against 15.4-21.1 with (sequence, head)
 * tasks, which fewer sequences still use. */
#define SEQUENCES_PER_THREAD 4

#define DEFINE_DECODE(NAME, TASK, T, C)                                                         \
static int NAME(const T *q, const C *k_cache, const C *v_cache, const int32_t *block_tables,   \
         const int32_t *seq_lens, T *out, int64_t q_stride, int64_t num_seqs, int64_t num_heads,  \
         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,        \
         int64_t window, float scale, const KVFormat *format) {                                 \
    const int group = num_heads / num_kv_heads;                                                 \
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads) return 1;     \
    int64_t keys = 0;  /* threads only for real work: an idle thread's wake-up costs more */   \
    for (int64_t s = 0; s < num_seqs; s++) keys += seq_lens[s];                                 \
    const int parallel = keys * num_kv_heads >= 4096;                                           \
    const int64_t heads_per_task =                                                              \
        num_seqs >= SEQUENCES_PER_THREAD * omp_get_max_threads() ? num_kv_heads : 1;             \
    /* whole sequences: runs of up to 8 per grab, so a thread's next sequence is mostly its own */ \
    int64_t run = heads_per_task == num_kv_heads ? num_seqs / (2 * omp_get_max_threads()) : 1;  \
    run = run < 1 ? 1 : run > 8 ? 8 : run;                                                      \
    int failed = 0;                                                                             \
    _Pragma("omp parallel for schedule(dynamic, run) if(parallel)")                            \
    for (int64_t task = 0; task < num_seqs * num_kv_heads / heads_per_task; task++) {           \
        const int64_t s = task * heads_per_task / num_kv_heads;                                 \
        const int len = seq_lens[s];                                                            \
        const int first = (window > 0 && len > window) ? len - window : 0;                      \
        const int count = len - first;                                                          \
        float *scores = malloc(sizeof(float) * (size_t)(count > 0 ? count : 1) * group);        \
        if (!scores) { failed = 1; continue; }                                                  \
        const int32_t *table = block_tables + s * max_blocks;                                   \
        const int64_t stride = num_kv_heads * head_dim;                                         \
        next_sequence.end = 0;                                                                  \
        if (heads_per_task == num_kv_heads && (s + 1) % run && s + 1 < num_seqs && count > 0) {  \
            const int next_len = seq_lens[s + 1];                                               \
            const int next_first = (window > 0 && next_len > window) ? next_len - window : 0;   \
            const int64_t block_bytes = block_size * stride * (int64_t)sizeof(C);               \
            const int64_t blocks = next_len > next_first ? (next_len - 1) / block_size + 1 - next_first / block_size : 0; \
            const int64_t reads = 2 * (int64_t)count * num_kv_heads;   /* K and V rows, per head */ \
            const int64_t lines = blocks * block_bytes / 64 > 0 ? blocks * block_bytes / 64 : 1;    \
            next_sequence = (NextSequence){(const char *)k_cache, (const char *)v_cache,        \
                                           table + max_blocks, block_bytes, 0,                  \
                                           next_first / (int)block_size, next_first / (int)block_size + (int)blocks, \
                                           (int)(lines >= reads ? lines / reads : 1),           \
                                           (int)(lines >= reads ? 1 : reads / lines), 0};      \
        }                                                                                       \
        for (int64_t kh = task * heads_per_task % num_kv_heads, end = kh + heads_per_task; kh < end; kh++) { \
            const int64_t head = s * num_heads + kh * group;                                    \
            const T *qs = q + s * q_stride + kh * group * head_dim;                              \
            const C *ks = k_cache + kh * head_dim, *vs = v_cache + kh * head_dim;               \
            T *os = out + head * head_dim;                                                      \
            if (head_dim == 64)                                                                 \
                TASK(qs, ks, vs, table, os, stride, group, 64, block_size, first, count, scale, scores, format); \
            else if (head_dim == 128)                                                           \
                TASK(qs, ks, vs, table, os, stride, group, 128, block_size, first, count, scale, scores, format); \
            else                                                                                \
                TASK(qs, ks, vs, table, os, stride, group, head_dim, block_size, first, count, scale, scores, format); \
        }                                                                                       \
        free(scores);                                                                           \
    }                                                                                           \
    return failed ? 2 : 0;                                                                      \
}

#define IDENTITY(x) (x)
#define LOAD_BF16_ROW(dst, src, n) for (int64_t d = 0; d < (n); d++) (dst)[d] = bf16_to_float((src)[d])
#define LOAD_F32_ROW(dst, src, n) for (int64_t d = 0; d < (n); d++) (dst)[d] = (src)[d]
#define LOAD_FP8_ROW(dst, src, n) fp8_row_to_float((src), (dst), (n), format->e5m2)
DEFINE_TASK(attend_bf16_scalar, uint16_t, uint16_t, bf16_to_float, float_to_bf16, LOAD_BF16_ROW)
DEFINE_TASK(attend_f32, float, float, IDENTITY, IDENTITY, LOAD_F32_ROW)
DEFINE_TASK(attend_bf16_fp8_scalar, uint16_t, uint8_t, bf16_to_float, float_to_bf16, LOAD_FP8_ROW)
DEFINE_TASK(attend_f32_fp8, float, uint8_t, IDENTITY, IDENTITY, LOAD_FP8_ROW)

#if defined(__AVX512F__) && defined(__AVX512BF16__)

/* The 16 horizontal sums of s[0..15], in order, in one vector: 15 lane-shuffling adds instead of
 * 16 reductions, each a long dependent chain. */
static inline __m512 sum_each_16(const __m512 *s) {
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: keys 2i, 2i+1 interleaved, 2 partial sums each */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: keys 4i..4i+3, that lane's sum */
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)  /* 128-bit lanes 0+1 and 2+3 of quads 2i, 2i+1 */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

/* Scores of query heads [g0, g0 + G) against every key, and their maxima; G and CHUNKS literal,
 * so the loops unroll and q stays in registers. vdpbf16ps multiplies bf16 pairs exactly and sums
 * in float32; keys go 16 at a time where a block holds 16 more (one at a time elsewhere). */
static inline __attribute__((always_inline)) void scores_bf16(
        const uint16_t *q, const uint16_t *k_cache, const int32_t *table, int64_t kv_stride,
        int g0, const int G, const int CHUNKS, int64_t block_size, int first, int count, float scale,
        float *scores, float *best) {
    __m512bh qv[4][MAX_HEAD_DIM / 32];
    __m512 top[4];
    float top1[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < CHUNKS; c++) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + (g0 + g) * CHUNKS * 32 + c * 32);
        top[g] = _mm512_set1_ps(-INFINITY);
    }
    for (int j = 0; j < count;) {
        const int pos = first + j;
        const int offset = pos % block_size;
        const int run = (int)(block_size - offset) < count - j ? (int)(block_size - offset) : count - j;
        const uint16_t *krow = k_cache + ((int64_t)table[pos / block_size] * block_size + offset) * kv_stride;
        prefetch_next_block(k_cache, table, pos / block_size, first, count, block_size, kv_stride * 2, CHUNKS * 64);
        int t = 0;
        for (; t + 16 <= run; t += 16, j += 16, krow += 16 * kv_stride) {
            prefetch_next_sequence(16);
            for (int g = 0; g < G; g++) {
                __m512 sums[16];
                for (int k = 0; k < 16; k++) {
                    const uint16_t *row = krow + k * kv_stride;
                    sums[k] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], (__m512bh)_mm512_loadu_si512(row));
                    for (int c = 1; c < CHUNKS; c++)
                        sums[k] = _mm512_dpbf16_ps(sums[k], qv[g][c], (__m512bh)_mm512_loadu_si512(row + c * 32));
                }
                const __m512 dots = _mm512_mul_ps(sum_each_16(sums), scale16);
                _mm512_storeu_ps(scores + (int64_t)(g0 + g) * count + j, dots);
                top[g] = _mm512_max_ps(top[g], dots);
            }
        }
        for (; t < run; t++, j++, krow += kv_stride) {
            prefetch_next_sequence(1);
            for (int g = 0; g < G; g++) {
                __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], (__m512bh)_mm512_loadu_si512(krow));
                for (int c = 1; c < CHUNKS; c++)
                    sum = _mm512_dpbf16_ps(sum, qv[g][c], (__m512bh)_mm512_loadu_si512(krow + c * 32));
                const float dot = _mm512_reduce_add_ps(sum) * scale;
                scores[(int64_t)(g0 + g) * count + j] = dot;
                top1[g] = dot > top1[g] ? dot : top1[g];
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const float wide = _mm512_reduce_max_ps(top[g]);
        best[g0 + g] = wide > top1[g] ? wide : top1[g];
    }
}

/* out rows [g0, g0 + G) = normalised weights x V: G * LANES float32 accumulators in registers. */
static inline __attribute__((always_inline)) void weighted_values_bf16(
        const uint16_t *v_cache, const int32_t *table, uint16_t *out, int64_t kv_stride, int g0,
        const int G, const int LANES, int64_t block_size, int first, int count,
        const float *scores, const float *total) {
    __m512 acc[4][MAX_HEAD_DIM / 16];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < LANES; c++) acc[g][c] = _mm512_setzero_ps();
    FOR_EACH_ROW(uint16_t, v_cache, vrow, LANES * 32, {
        __m512 vf[MAX_HEAD_DIM / 16];
        for (int c = 0; c < LANES; c++) vf[c] = bf16x16_load(vrow + c * 16, 0xFFFF);
        for (int g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(scores[(int64_t)(g0 + g) * count + j]);
            for (int c = 0; c < LANES; c++) acc[g][c] = _mm512_fmadd_ps(w, vf[c], acc[g][c]);
        }
    })
    for (int g = 0; g < G; g++) {
        const float sum = total[g0 + g];
        const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
        for (int c = 0; c < LANES; c++)  /* round to nearest even, as float_to_bf16 */
            _mm256_storeu_si256((void *)(out + (g0 + g) * LANES * 16 + c * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv)));
    }
}

/* Query heads in runs of up to 4 with a literal run length: each run reads the K/V rows once. */
#define FOR_EACH_HEAD_RUN(CALL)                                                                 \
    for (int g0 = 0; g0 < group; g0 += 4) {                                                     \
        switch (group - g0) {                                                                   \
            case 1: CALL(1); break;                                                             \
            case 2: CALL(2); break;                                                             \
            case 3: CALL(3); break;                                                             \
            default: CALL(4);                                                                   \
        }                                                                                       \
    }

/* The bf16 task with AVX512-BF16, head_dim 64 or 128 (literal): the same two-pass softmax as the
 * scalar task, 4-5x fewer instructions per key. */
static inline __attribute__((always_inline)) void attend_bf16_avx512(
        const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
        uint16_t *out, int64_t kv_stride, int group, const int head_dim, int64_t block_size,
        int first, int count, float scale, float *scores) {
    float best[MAX_GROUP], total[MAX_GROUP];
#define SCORES(G) scores_bf16(q, k_cache, table, kv_stride, g0, G, head_dim / 32, block_size, first, \
                              count, scale, scores, best)
    FOR_EACH_HEAD_RUN(SCORES)
#undef SCORES
    softmax_weights(scores, group, count, best, total);
#define VALUES(G) weighted_values_bf16(v_cache, table, out, kv_stride, g0, G, head_dim / 16, block_size, \
                                       first, count, scores, total)
    FOR_EACH_HEAD_RUN(VALUES)
#undef VALUES
}

static __attribute__((noinline)) void attend_bf16(
        const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
        uint16_t *out, int64_t kv_stride, int group, int64_t head_dim, int64_t block_size,
        int first, int count, float scale, float *scores, const KVFormat *format) {
    if (head_dim == 64)
        attend_bf16_avx512(q, k_cache, v_cache, table, out, kv_stride, group, 64, block_size,
                           first, count, scale, scores);
    else if (head_dim == 128)
        attend_bf16_avx512(q, k_cache, v_cache, table, out, kv_stride, group, 128, block_size,
                           first, count, scale, scores);
    else
        attend_bf16_scalar(q, k_cache, v_cache, table, out, kv_stride, group, head_dim, block_size,
                           first, count, scale, scores, format);
}

/* 32 e4m3 values as bf16, exactly: the magnitude bits moved under bf16's exponent, which is
 * rebased (+120), the eight subnormals (exponent 0) from a table, the sign on top. */
static inline __m512i e4m3x32_to_bf16(const uint8_t *p) {
    static const uint16_t subnormals[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    __m512i v = _mm512_add_epi16(_mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x7F)), 4),
                                 _mm512_set1_epi16(120 << 7));
    v = _mm512_mask_permutexvar_epi16(v, _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x78)), x,
                                      _mm512_loadu_si512(subnormals));
    return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
}

/* A key row of an fp8 cache (head_dim values) as the scores read it: e4m3 as exact bf16, e5m2
 * as float32 over fp8_factor. */
static inline __attribute__((always_inline)) void fp8_key_row(void *row, const uint8_t *src, const int head_dim,
                                                               const int e5m2) {
    if (e5m2)
        for (int c = 0; c < head_dim / 16; c++) _mm512_store_ps((float *)row + c * 16, fp8x16_load(src + c * 16, 1));
    else
        for (int c = 0; c < head_dim / 32; c++) _mm512_store_si512((uint16_t *)row + c * 32, e4m3x32_to_bf16(src + c * 32));
}

/* Query head g's products with a converted key row, in 16 partial sums: vdpbf16ps against bf16
 * queries (e4m3), float32 FMAs against float32 queries (e5m2). */
static inline __attribute__((always_inline)) __m512 key_products(const void *q, const void *row, int g,
                                                                  const int head_dim, const int e5m2) {
    __m512 sum = _mm512_setzero_ps();
    if (e5m2) {
        const float *qf = (const float *)q + g * head_dim;
        for (int c = 0; c < head_dim / 16; c++)
            sum = _mm512_fmadd_ps(_mm512_loadu_ps(qf + c * 16), _mm512_load_ps((const float *)row + c * 16), sum);
    } else {
        const uint16_t *qb = (const uint16_t *)q + g * head_dim;
        for (int c = 0; c < head_dim / 32; c++)
            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(qb + c * 32),
                                   (__m512bh)_mm512_load_si512((const uint16_t *)row + c * 32));
    }
    return sum;
}

/* Scores (times `scale`) of every query head against every key of an fp8 cache, and their
 * maxima. Each run of 16 keys is converted once (into `rows`, in L1) and then read by every
 * query head: the conversion, not the multiply, is the cost of an fp8 key. e4m3 keys meet the
 * bf16 queries `q` [group][head_dim] in vdpbf16ps, 32 products an instruction; e5m2 keys meet
 * float32 queries. head_dim and e5m2 literal, so the branches fold away. */
static inline __attribute__((always_inline)) void scores_fp8(
        const void *q, const uint8_t *k_cache, const int32_t *table, int64_t kv_stride, int group,
        const int head_dim, const int e5m2, int64_t block_size, int first, int count, float scale,
        float *scores, float *best) {
    float rows[16][MAX_HEAD_DIM] __attribute__((aligned(64)));   /* float32, or bf16 in each row's first half */
    __m512 top[MAX_GROUP];
    float top1[MAX_GROUP];
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int g = 0; g < group; g++) {
        top[g] = _mm512_set1_ps(-INFINITY);
        top1[g] = -INFINITY;
    }
    for (int j = 0; j < count;) {
        const int pos = first + j;
        const int offset = pos % block_size;
        const int run = (int)(block_size - offset) < count - j ? (int)(block_size - offset) : count - j;
        const uint8_t *krow = k_cache + ((int64_t)table[pos / block_size] * block_size + offset) * kv_stride;
        prefetch_next_block(k_cache, table, pos / block_size, first, count, block_size, kv_stride, head_dim);
        int t = 0;
        for (; t + 16 <= run; t += 16, j += 16, krow += 16 * kv_stride) {
            prefetch_next_sequence(16);
            for (int k = 0; k < 16; k++) fp8_key_row(rows[k], krow + k * kv_stride, head_dim, e5m2);
            for (int g = 0; g < group; g++) {
                __m512 sums[16];
                for (int k = 0; k < 16; k++) sums[k] = key_products(q, rows[k], g, head_dim, e5m2);
                const __m512 dots = _mm512_mul_ps(sum_each_16(sums), scale16);
                _mm512_storeu_ps(scores + (int64_t)g * count + j, dots);
                top[g] = _mm512_max_ps(top[g], dots);
            }
        }
        for (; t < run; t++, j++, krow += kv_stride) {
            prefetch_next_sequence(1);
            fp8_key_row(rows[0], krow, head_dim, e5m2);
            for (int g = 0; g < group; g++) {
                const float dot = _mm512_reduce_add_ps(key_products(q, rows[0], g, head_dim, e5m2)) * scale;
                scores[(int64_t)g * count + j] = dot;
                top1[g] = dot > top1[g] ? dot : top1[g];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const float wide = _mm512_reduce_max_ps(top[g]);
        best[g] = wide > top1[g] ? wide : top1[g];
    }
}

/* out rows [g0, g0 + G) = normalised weights x V of an fp8 cache, times v_factor: each V row
 * converted once for the G heads, G * VECS float32 accumulators in registers. */
static inline __attribute__((always_inline)) void weighted_values_fp8(
        const uint8_t *v_cache, const int32_t *table, uint16_t *out, int64_t kv_stride, int g0,
        const int G, const int VECS, int64_t block_size, int first, int count, int e5m2,
        const float *scores, const float *total, float v_factor) {
    __m512 acc[4][MAX_HEAD_DIM / 16];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < VECS; c++) acc[g][c] = _mm512_setzero_ps();
    FOR_EACH_ROW(uint8_t, v_cache, vrow, VECS * 16, {
        __m512 vf[MAX_HEAD_DIM / 16];
        for (int c = 0; c < VECS; c++) vf[c] = fp8x16_load(vrow + c * 16, e5m2);
        for (int g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(scores[(int64_t)(g0 + g) * count + j]);
            for (int c = 0; c < VECS; c++) acc[g][c] = _mm512_fmadd_ps(w, vf[c], acc[g][c]);
        }
    })
    for (int g = 0; g < G; g++) {
        const float sum = total[g0 + g];
        const __m512 inv = _mm512_set1_ps((sum > 0.f ? 1.f / sum : 0.f) * v_factor);
        for (int c = 0; c < VECS; c++)  /* round to nearest even, as float_to_bf16 */
            _mm256_storeu_si256((void *)(out + (g0 + g) * VECS * 16 + c * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv)));
    }
}

/* The bf16-query task over an fp8 cache with AVX-512, head_dim 64 or 128 (literal): the scalar
 * task's two-pass softmax with each fp8 row converted 16 values to an instruction pair. */
static inline __attribute__((always_inline)) void attend_bf16_fp8_avx512(
        const uint16_t *q, const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *table,
        uint16_t *out, int64_t kv_stride, int group, const int head_dim, int64_t block_size,
        int first, int count, float scale, float *scores, const KVFormat *format) {
    float qf[MAX_GROUP * MAX_HEAD_DIM] __attribute__((aligned(64)));
    float best[MAX_GROUP], total[MAX_GROUP];
    const float q_scale = scale * format->k_factor;
    if (format->e5m2) {
        for (int64_t i = 0; i < group * head_dim; i++) qf[i] = bf16_to_float(q[i]);
        scores_fp8(qf, k_cache, table, kv_stride, group, head_dim, 1, block_size, first, count, q_scale, scores, best);
    } else {   /* exact bf16 keys: k_factor's fp8_factor is for the fp16 reading only */
        scores_fp8(q, k_cache, table, kv_stride, group, head_dim, 0, block_size, first, count,
                   q_scale / fp8_factor(0), scores, best);
    }
    softmax_weights(scores, group, count, best, total);
#define VALUES(G) weighted_values_fp8(v_cache, table, out, kv_stride, g0, G, head_dim / 16, block_size, \
                                      first, count, format->e5m2, scores, total, format->v_factor)
    FOR_EACH_HEAD_RUN(VALUES)
#undef VALUES
}

static __attribute__((noinline)) void attend_bf16_fp8(
        const uint16_t *q, const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *table,
        uint16_t *out, int64_t kv_stride, int group, int64_t head_dim, int64_t block_size,
        int first, int count, float scale, float *scores, const KVFormat *format) {
    if (head_dim == 64)
        attend_bf16_fp8_avx512(q, k_cache, v_cache, table, out, kv_stride, group, 64, block_size,
                               first, count, scale, scores, format);
    else if (head_dim == 128)
        attend_bf16_fp8_avx512(q, k_cache, v_cache, table, out, kv_stride, group, 128, block_size,
                               first, count, scale, scores, format);
    else
        attend_bf16_fp8_scalar(q, k_cache, v_cache, table, out, kv_stride, group, head_dim, block_size,
                               first, count, scale, scores, format);
}
#else
#define attend_bf16 attend_bf16_scalar
#define attend_bf16_fp8 attend_bf16_fp8_scalar
#endif

DEFINE_DECODE(decode_bf16, attend_bf16, uint16_t, uint16_t)
DEFINE_DECODE(decode_f32, attend_f32, float, float)
DEFINE_DECODE(decode_bf16_fp8, attend_bf16_fp8, uint16_t, uint8_t)
DEFINE_DECODE(decode_f32_fp8, attend_f32_fp8, float, uint8_t)

/* The entry points: q and out of the model's dtype, caches of it or fp8 (e4m3fn, or e5m2 when
 * `e5m2`) with per-tensor K and V scales. */
#define DEFINE_ENTRY(NAME, DECODE, T)                                                           \
int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,          \
         const int32_t *seq_lens, T *out, int64_t q_stride, int64_t num_seqs, int64_t num_heads,  \
         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, int64_t window, \
         float scale) {                                                                         \
    return DECODE(q, k_cache, v_cache, block_tables, seq_lens, out, q_stride, num_seqs, num_heads, num_kv_heads, \
                  head_dim, block_size, max_blocks, window, scale, &PLAIN);                     \
}
#define DEFINE_FP8_ENTRY(NAME, DECODE, T)                                                       \
int NAME(const T *q, const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *block_tables, \
         const int32_t *seq_lens, T *out, int64_t q_stride, int64_t num_seqs, int64_t num_heads,  \
         int64_t num_kv_heads,                                                                  \
         int64_t head_dim, int64_t block_size, int64_t max_blocks, int64_t window, int64_t e5m2, \
         float scale, float k_scale, float v_scale) {                                           \
    const KVFormat format = {(int)e5m2, k_scale * fp8_factor((int)e5m2), v_scale * fp8_factor((int)e5m2)}; \
    return DECODE(q, k_cache, v_cache, block_tables, seq_lens, out, q_stride, num_seqs, num_heads, num_kv_heads, \
                  head_dim, block_size, max_blocks, window, scale, &format);                    \
}
DEFINE_ENTRY(paged_decode_bf16, decode_bf16, uint16_t)
DEFINE_ENTRY(paged_decode_f32, decode_f32, float)
DEFINE_FP8_ENTRY(paged_decode_bf16_fp8, decode_bf16_fp8, uint16_t)
DEFINE_FP8_ENTRY(paged_decode_f32_fp8, decode_f32_fp8, float)
