/* Paged-attention decode for CPUs: one query token per sequence, K/V read in place from the
 * paged cache through the block table (no gathered copy), float32 math, OpenMP over
 * (sequence, KV head) so the query heads sharing a KV head (GQA) read each K/V row once.
 *
 * Layouts (all contiguous): q and out [S, H, D]; k_cache and v_cache [NB, BS, KH, D];
 * block_tables [S, MB] int32; seq_lens [S] int32. A sequence attends to its keys
 * [max(0, len - window), len) (window <= 0: all). Exact two-pass softmax, the same math as
 * kernels/attention_ref.py; built by kernels/cpu_build.py, called by paged_decode_cpu.py.
 */
#include <stdlib.h>

#include "cpu_math.h"

#define MAX_GROUP 32  /* query heads per KV head */
#define MAX_HEAD_DIM 256

/* One (sequence, KV head): its `group` query heads against keys [first, first + count).
 * Always inlined with a literal head_dim where it is common, so the row loops unroll. Keys are
 * walked block by block: no division per key. */
#define DEFINE_TASK(NAME, T, LOAD, STORE)                                                       \
static inline __attribute__((always_inline)) void NAME(                                        \
        const T *q, const T *k_cache, const T *v_cache, const int32_t *table, T *out,          \
        int64_t kv_stride, int group, int64_t head_dim, int64_t block_size, int first,         \
        int count, float scale, float *scores) {                                               \
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];         \
    float best[MAX_GROUP], total[MAX_GROUP];                                                    \
    for (int g = 0; g < group; g++) {                                                           \
        for (int64_t d = 0; d < head_dim; d++) {                                                \
            qf[g][d] = LOAD(q[g * head_dim + d]) * scale;                                       \
            acc[g][d] = 0.f;                                                                    \
        }                                                                                       \
        best[g] = -INFINITY;                                                                    \
    }                                                                                           \
    for (int j = 0; j < count;) {  /* scores [group][count] and their maxima */                 \
        const int pos = first + j;                                                              \
        const int offset = pos % block_size;                                                    \
        const int run = (int)(block_size - offset) < count - j ? (int)(block_size - offset) : count - j; \
        const T *krow = k_cache + ((int64_t)table[pos / block_size] * block_size + offset) * kv_stride; \
        for (int t = 0; t < run; t++, j++, krow += kv_stride) {                                 \
            for (int64_t d = 0; d < head_dim; d++) row[d] = LOAD(krow[d]);                      \
            for (int g = 0; g < group; g++) {                                                   \
                float dot = 0.f;                                                                \
                for (int64_t d = 0; d < head_dim; d++) dot += qf[g][d] * row[d];                \
                scores[(int64_t)g * count + j] = dot;                                           \
                best[g] = dot > best[g] ? dot : best[g];                                        \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int g = 0; g < group; g++) {  /* softmax weights, unnormalised */                      \
        float *w = scores + (int64_t)g * count, sum = 0.f;                                      \
        for (int j = 0; j < count; j++) { w[j] = exp_nonpositive(w[j] - best[g]); sum += w[j]; } \
        total[g] = sum;                                                                         \
    }                                                                                           \
    for (int j = 0; j < count;) {  /* weights times V */                                        \
        const int pos = first + j;                                                              \
        const int offset = pos % block_size;                                                    \
        const int run = (int)(block_size - offset) < count - j ? (int)(block_size - offset) : count - j; \
        const T *vrow = v_cache + ((int64_t)table[pos / block_size] * block_size + offset) * kv_stride; \
        for (int t = 0; t < run; t++, j++, vrow += kv_stride) {                                 \
            for (int64_t d = 0; d < head_dim; d++) row[d] = LOAD(vrow[d]);                      \
            for (int g = 0; g < group; g++) {                                                   \
                const float w = scores[(int64_t)g * count + j];                                 \
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] += w * row[d];                 \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int g = 0; g < group; g++) {                                                           \
        const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;                                \
        for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] = STORE(acc[g][d] * inv);  \
    }                                                                                           \
}

#define DEFINE_DECODE(NAME, TASK, T)                                                            \
int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,          \
         const int32_t *seq_lens, T *out, int64_t num_seqs, int64_t num_heads,                  \
         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,        \
         int64_t window, float scale) {                                                         \
    const int group = num_heads / num_kv_heads;                                                 \
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads) return 1;     \
    int64_t keys = 0;  /* threads only for real work: an idle thread's wake-up costs more */   \
    for (int64_t s = 0; s < num_seqs; s++) keys += seq_lens[s];                                 \
    const int parallel = keys * num_kv_heads >= 4096;                                           \
    int failed = 0;                                                                             \
    _Pragma("omp parallel for schedule(dynamic, 1) if(parallel)")                              \
    for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {                            \
        const int64_t s = task / num_kv_heads, kh = task % num_kv_heads;                        \
        const int len = seq_lens[s];                                                            \
        const int first = (window > 0 && len > window) ? len - window : 0;                      \
        const int count = len - first;                                                          \
        float *scores = malloc(sizeof(float) * (size_t)(count > 0 ? count : 1) * group);        \
        if (!scores) { failed = 1; continue; }                                                  \
        const int64_t head = s * num_heads + kh * group;                                        \
        const T *qs = q + head * head_dim, *ks = k_cache + kh * head_dim, *vs = v_cache + kh * head_dim; \
        const int32_t *table = block_tables + s * max_blocks;                                   \
        T *os = out + head * head_dim;                                                          \
        const int64_t stride = num_kv_heads * head_dim;                                         \
        if (head_dim == 64)                                                                     \
            TASK(qs, ks, vs, table, os, stride, group, 64, block_size, first, count, scale, scores); \
        else if (head_dim == 128)                                                               \
            TASK(qs, ks, vs, table, os, stride, group, 128, block_size, first, count, scale, scores); \
        else                                                                                    \
            TASK(qs, ks, vs, table, os, stride, group, head_dim, block_size, first, count, scale, scores); \
        free(scores);                                                                           \
    }                                                                                           \
    return failed ? 2 : 0;                                                                      \
}

#define IDENTITY(x) (x)
DEFINE_TASK(attend_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_TASK(attend_f32, float, IDENTITY, IDENTITY)
DEFINE_DECODE(paged_decode_bf16, attend_bf16, uint16_t)
DEFINE_DECODE(paged_decode_f32, attend_f32, float)
