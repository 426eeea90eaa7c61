/* Paged-attention prefill for CPUs with AMX or AVX512-BF16: the query tokens of each sequence (a fresh prompt
 * or a chunk after its cached prefix) against all the sequence's keys in the paged cache, causal,
 * as flash attention (online softmax; the score matrix is never whole). bf16 in and out, float32
 * sums, head_dim 64 or 128.
 *
 * Why: torch's CPU SDPA runs these at ~160 GFLOP/s (4 x 544-token prompts: 8.5 ms a layer), and a
 * chunk after a cached prefix first needs a gathered, padded copy of its K/V and a mask.
 *
 * Per sequence and KV head, the keys are first packed into AMX's B-operand layout (pairs of
 * values adjacent): K as [16-key block][32-dim chunk][16 dim pairs][16 keys][2], V as [32-key
 * block][16-dim block][16 key pairs][16 dims][2], zeros past the sequence's end. Then each task
 * (sequence, query head, 16 queries) walks the 32-key blocks its queries can see: S = Q K^T in
 * two accumulator tiles, the online softmax on S in AVX-512, O += P V one 16-dim tile at a time.
 *
 * Layouts: q [T, q_row_stride] with head h at h * head_dim; out [T, H, D] contiguous; caches
 * [NB, BS, KH, D]; block_tables [S, max_blocks] int32; seq_lens, query_lens, query_starts [S]
 * int32 (a sequence's queries are its last query_lens[s] positions, rows from query_starts[s]).
 * Without AMX (an AMD EPYC, or the avx512 build) the same walk runs its products on vdpbf16ps
 * (see the second attend_block). Built by kernels/cpu/cpu_build.py, called by paged_prefill_cpu.py;
 * an AMX build's caller must hold the process's AMX permission (quant_linear_cpu.amx_available()). An fp8 cache (paged_prefill_bf16_fp8)
 * is packed as bf16 (every fp8 value is exact in bf16), its scales folded into the scores and the output.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

enum { OK = 0, BAD_SHAPE = 1, UNSUPPORTED = 2, NO_MEMORY = 3 };

#if defined(__AVX512BF16__)
#define MAX_HEAD_DIM 128

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include "amx_tiles.h"
#else
#define HAVE_AMX 0
#endif

/* How the cache holds values: bf16, or fp8 (e4m3fn / e5m2) whose values, exact in bf16, are
 * packed as fp8_row_to_float reads them (the scales are folded into the scores and the output). */
enum { CACHE_BF16 = -1, CACHE_E4M3 = 0, CACHE_E5M2 = 1 };

/* Key `key`'s row of KV head `kv_head` in a sequence's cache (of `value_bytes` per value), or
 * NULL past its end (packed as zeros). */
static inline const uint8_t *head_row(const uint8_t *cache, const int32_t *table, int key, int len, int64_t kv_head,
                                      int64_t head_dim, int64_t block_size, int64_t row_elements, int64_t value_bytes) {
    if (key >= len) return 0;
    return cache + (((int64_t)table[key / block_size] * block_size + key % block_size) * row_elements
                    + kv_head * head_dim) * value_bytes;
}

/* 32 values of a key's row (dims [32 c, 32 c + 32)) as bf16, zeros for a key past the sequence's end. */
static inline __m512i row_chunk(const uint8_t *row, int64_t c, int format) {
    if (!row) return _mm512_setzero_si512();
    if (format == CACHE_BF16) return _mm512_loadu_si512(row + c * 64);
    const __m512 low = _mm512_cvtph_ps(fp8x16_half_bits(row + c * 32, format));
    const __m512 high = _mm512_cvtph_ps(fp8x16_half_bits(row + c * 32 + 16, format));
    return (__m512i)_mm512_cvtne2ps_pbh(high, low);
}

/* Keys [32 kb, 32 kb + 32) of one sequence and KV head into the packed K and V layouts above, at
 * k_block and v_block (32 x head_dim values each).
 * V's pairs come from one two-source word permute per 16 dims: fifteen 32-token chunks over
 * 544-token contexts and a 200-token one, 4.8 ms a layer against 5.3 with a scalar loop. */
static void pack_block(const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *table, int len,
                       int kb, int64_t kv_head, int64_t head_dim, int64_t block_size, int64_t row_elements,
                       int format, uint16_t *k_block, uint16_t *v_block) {
    const int64_t value_bytes = format == CACHE_BF16 ? 2 : 1;
    const int64_t chunks = head_dim / 32;
    uint32_t *k_pairs = (uint32_t *)k_block;   /* two 16-key blocks */
    __m512i first_half, second_half;   /* word 2n <- first key's dim n, 2n + 1 <- second key's */
    {
        uint16_t low[32], high[32];
        for (int n = 0; n < 16; n++) {
            low[2 * n] = (uint16_t)n, low[2 * n + 1] = (uint16_t)(32 + n);
            high[2 * n] = (uint16_t)(16 + n), high[2 * n + 1] = (uint16_t)(48 + n);
        }
        first_half = _mm512_loadu_si512(low);
        second_half = _mm512_loadu_si512(high);
    }
    for (int pair = 0; pair < 16; pair++) {
        const int key = kb * 32 + 2 * pair;
#define ROW(cache, at) head_row(cache, table, at, len, kv_head, head_dim, block_size, row_elements, value_bytes)
        const uint8_t *k0 = ROW(k_cache, key), *k1 = ROW(k_cache, key + 1);
        const uint8_t *v0 = ROW(v_cache, key), *v1 = ROW(v_cache, key + 1);
#undef ROW
        const int half = 2 * pair / 16, in_half = 2 * pair % 16;   /* K: 16-key block 2 kb + half */
        for (int64_t c = 0; c < chunks; c++) {
            uint32_t first[16], second[16];
            _mm512_storeu_si512(first, row_chunk(k0, c, format));
            _mm512_storeu_si512(second, row_chunk(k1, c, format));
            uint32_t *to = k_pairs + (half * chunks + c) * 256 + in_half;
            for (int r = 0; r < 16; r++) {
                to[r * 16] = first[r];
                to[r * 16 + 1] = second[r];
            }
            const __m512i a = row_chunk(v0, c, format), b = row_chunk(v1, c, format);   /* V: dim blocks 2c, 2c + 1 */
            _mm512_storeu_si512(v_block + ((2 * c) * 16 + pair) * 32, _mm512_permutex2var_epi16(a, first_half, b));
            _mm512_storeu_si512(v_block + ((2 * c + 1) * 16 + pair) * 32, _mm512_permutex2var_epi16(a, second_half, b));
        }
    }
}

/* The softmax's reference maximum of a row moves only when a score passes it by this much: P
 * then stays below e^8 (no overflow in float32 or bf16), the result is the same (softmax does not
 * depend on the shift), and O rarely needs rescaling. exp_nonpositive16 is exact to ~1 ulp up to
 * e^88 too: its range reduction does not depend on the sign. */
#define RESCALE_MARGIN 8.f

/* The online softmax over one 32-key block kb of a task's 16 query rows (`rows` real ones, from
 * position first_pos): raw scores [16][32] in, bf16 probabilities [16][32] out; keys later than a
 * row's query are masked. Updates the rows' running maximum (`best`), sum (`total`) and the factor
 * their output must be scaled by (`correction`); returns whether any row needs it. */
static inline int softmax_block(const float *scores, uint16_t *probs, float *best, float *total, float *correction,
                                int kb, int first_pos, int last_pos, int rows, float scale) {
    const __m512 scale16 = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-INFINITY);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int masked = kb * 32 + 31 > first_pos;  /* some key here is later than some query */
    int rescale = 0;
    for (int r = 0; r < 16; r++) {
        const int pos = r < rows ? first_pos + r : last_pos;
        __m512 low = _mm512_mul_ps(_mm512_load_ps(scores + 32 * r), scale16);
        __m512 high = _mm512_mul_ps(_mm512_load_ps(scores + 32 * r + 16), scale16);
        __mmask16 see_low = 0xFFFF, see_high = 0xFFFF;
        if (masked) {
            const __m512i visible = _mm512_set1_epi32(pos - kb * 32);
            see_low = _mm512_cmple_epi32_mask(lane, visible);
            see_high = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), visible);
            low = _mm512_mask_mov_ps(minus_inf, see_low, low);
            high = _mm512_mask_mov_ps(minus_inf, see_high, high);
        }
        const float top = _mm512_reduce_max_ps(_mm512_max_ps(low, high));
        correction[r] = 1.f;
        if (top > best[r] + RESCALE_MARGIN) {   /* first block (best -inf, key 0 seen) or a jump */
            correction[r] = best[r] == -INFINITY ? 0.f : exp_nonpositive(best[r] - top);
            rescale |= best[r] != -INFINITY;
            best[r] = top;
        }
        const __m512 shift = _mm512_set1_ps(best[r]);
        const __m512 p_low = _mm512_maskz_mov_ps(see_low, exp_nonpositive16(_mm512_sub_ps(low, shift)));
        const __m512 p_high = _mm512_maskz_mov_ps(see_high, exp_nonpositive16(_mm512_sub_ps(high, shift)));
        total[r] = total[r] * correction[r] + _mm512_reduce_add_ps(_mm512_add_ps(p_low, p_high));
        _mm512_store_si512((__m512i *)(probs + 32 * r), (__m512i)_mm512_cvtne2ps_pbh(p_high, p_low));
    }
    return rescale;
}

/* A task's start: its query rows (zeros past `rows`), no maximum, sum or output yet. */
static inline void start_task(const uint16_t *q, int64_t q_row_stride, int64_t head, int64_t head_dim, int i0, int rows,
                              uint16_t *queries, float *best, float *total, float acc[16][MAX_HEAD_DIM]) {
    memset(queries, 0, 16 * MAX_HEAD_DIM * sizeof(uint16_t));
    for (int r = 0; r < rows; r++)
        memcpy(queries + r * head_dim, q + (int64_t)(i0 + r) * q_row_stride + head * head_dim, head_dim * 2);
    for (int r = 0; r < 16; r++) {
        best[r] = -INFINITY;
        total[r] = 0.f;
        for (int64_t d = 0; d < head_dim; d++) acc[r][d] = 0.f;
    }
}

/* A task's end: each row's output divided by its softmax sum (and scaled by `out_factor`), in bf16. */
static inline void finish_task(float acc[16][MAX_HEAD_DIM], const float *total, uint16_t *out, int64_t num_heads,
                               int64_t head, int64_t head_dim, int i0, int rows, float out_factor) {
    for (int r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(out_factor / total[r]);
        uint16_t *row = out + ((int64_t)(i0 + r) * num_heads + head) * head_dim;
        for (int64_t d = 0; d < head_dim; d += 16)
            _mm256_storeu_si256((__m256i *)(row + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[r] + d), inv)));
    }
}

#if HAVE_AMX
/* Tiles: 0-1 scores (keys 0-15, 16-31 of a block), 2 queries / probabilities, 3 keys / values,
 * 4-7 O += P V for 4 blocks of 16 dims. With head_dim 64 those four hold all of O for the whole
 * walk (stored only to rescale and at the end); with 128, each key block's P V is added to O in
 * memory. */
static inline void values_into_tiles(const uint16_t *v_block) {
    _tile_loadd(3, v_block, 64);
    _tile_dpbf16ps(4, 2, 3);
    _tile_loadd(3, v_block + 512, 64);
    _tile_dpbf16ps(5, 2, 3);
    _tile_loadd(3, v_block + 1024, 64);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(3, v_block + 1536, 64);
    _tile_dpbf16ps(7, 2, 3);
}

static inline void store_value_tiles(float *to, int64_t stride_bytes) {
    _tile_stored(4, to, stride_bytes);
    _tile_stored(5, to + 16, stride_bytes);
    _tile_stored(6, to + 32, stride_bytes);
    _tile_stored(7, to + 48, stride_bytes);
}

/* One task: queries [i0, i0 + 16) (of q_len) of head `head`; its KV head's 32-key block kb is
 * packed at k_packed + block_at[kb] (and v_packed + block_at[kb]). */
static void attend_block(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_packed,
                         const uint16_t *v_packed, const int64_t *block_at, uint16_t *out, int64_t num_heads,
                         int64_t head, int64_t head_dim, int len, int q_len, int i0, float scale, float out_factor) {
    const int64_t chunks = head_dim / 32, dim_blocks = head_dim / 16;
    const int resident = head_dim == 64;          /* O lives in tiles 4-7 */
    uint16_t queries[16 * MAX_HEAD_DIM] __attribute__((aligned(64)));
    uint16_t probs[16 * 32] __attribute__((aligned(64)));
    float scores[16 * 32] __attribute__((aligned(64)));
    float values[16 * 64] __attribute__((aligned(64)));
    float acc[16][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float best[16], total[16], correction[16];
    const int rows = q_len - i0 < 16 ? q_len - i0 : 16;
    start_task(q, q_row_stride, head, head_dim, i0, rows, queries, best, total, acc);
    if (resident) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
    }
    const int first_pos = len - q_len + i0;           /* position of the task's first query */
    const int last_pos = first_pos + rows - 1;
    for (int kb = 0; kb * 32 <= last_pos; kb++) {
        _tile_zero(0);
        _tile_zero(1);
        const uint16_t *k_block = k_packed + block_at[kb];
        for (int64_t c = 0; c < chunks; c++) {
            _tile_loadd(2, queries + c * 32, head_dim * 2);
            _tile_loadd(3, k_block + c * 512, 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_loadd(3, k_block + (chunks + c) * 512, 64);
            _tile_dpbf16ps(1, 2, 3);
        }
        _tile_stored(0, scores, 128);
        _tile_stored(1, scores + 16, 128);
        const int rescale = softmax_block(scores, probs, best, total, correction, kb, first_pos, last_pos, rows, scale);
        if (rescale && resident) store_value_tiles(acc[0], MAX_HEAD_DIM * 4);
        if (rescale)
            for (int r = 0; r < 16; r++) {
                const __m512 factor = _mm512_set1_ps(correction[r]);
                for (int64_t d = 0; d < head_dim; d += 16)
                    _mm512_store_ps(acc[r] + d, _mm512_mul_ps(_mm512_load_ps(acc[r] + d), factor));
            }
        if (rescale && resident) {
            _tile_loadd(4, acc[0], MAX_HEAD_DIM * 4);
            _tile_loadd(5, acc[0] + 16, MAX_HEAD_DIM * 4);
            _tile_loadd(6, acc[0] + 32, MAX_HEAD_DIM * 4);
            _tile_loadd(7, acc[0] + 48, MAX_HEAD_DIM * 4);
        }
        _tile_loadd(2, probs, 64);
        const uint16_t *v_block = v_packed + block_at[kb];
        if (resident) {
            values_into_tiles(v_block);
            continue;
        }
        for (int64_t db = 0; db < dim_blocks; db += 4) {
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            values_into_tiles(v_block + db * 512);
            store_value_tiles(values, 256);
            for (int r = 0; r < rows; r++)
                for (int d = 0; d < 64; d += 16)
                    _mm512_store_ps(acc[r] + db * 16 + d, _mm512_add_ps(_mm512_load_ps(acc[r] + db * 16 + d),
                                                                        _mm512_load_ps(values + 64 * r + d)));
        }
    }
    if (resident) store_value_tiles(acc[0], MAX_HEAD_DIM * 4);
    finish_task(acc, total, out, num_heads, head, head_dim, i0, rows, out_factor);
}
#else
/* One task without AMX: the same walk, with the products on AVX512-BF16's vdpbf16ps, which takes
 * the packed layouts as they are: a K row of the packed block is one dim pair of 16 keys (S for 8
 * queries x 32 keys stays in 16 registers over the dims), a V row one key pair of 16 dims (O += P V
 * for 4 queries x 16 dims in 4 registers over the block's 16 key pairs). O lives in `acc`. */
static void attend_block(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_packed,
                         const uint16_t *v_packed, const int64_t *block_at, uint16_t *out, int64_t num_heads,
                         int64_t head, int64_t head_dim, int len, int q_len, int i0, float scale, float out_factor) {
    const int64_t chunks = head_dim / 32, dim_blocks = head_dim / 16;
    uint16_t queries[16 * MAX_HEAD_DIM] __attribute__((aligned(64)));
    uint16_t probs[16 * 32] __attribute__((aligned(64)));
    float scores[16 * 32] __attribute__((aligned(64)));
    float acc[16][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float best[16], total[16], correction[16];
    const int rows = q_len - i0 < 16 ? q_len - i0 : 16;
    const int groups8 = (rows + 7) / 8, groups4 = (rows + 3) / 4;   /* query rows computed: 8 or 4 at a time */
    start_task(q, q_row_stride, head, head_dim, i0, rows, queries, best, total, acc);
    memset(scores, 0, sizeof scores);   /* rows past groups8 * 8 are never computed */
    const uint32_t *query_pairs = (const uint32_t *)queries, *prob_pairs = (const uint32_t *)probs;
    const int64_t pairs_per_row = head_dim / 2;
    const int first_pos = len - q_len + i0;
    const int last_pos = first_pos + rows - 1;
    for (int kb = 0; kb * 32 <= last_pos; kb++) {
        const uint16_t *k_block = k_packed + block_at[kb];
        for (int g = 0; g < groups8; g++) {
            __m512 s[8][2];
            for (int r = 0; r < 8; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
            for (int64_t pair = 0; pair < pairs_per_row; pair++) {
                const int64_t c = pair / 16, in_chunk = pair % 16;
                const __m512bh k0 = (__m512bh)_mm512_load_si512(k_block + (c * 16 + in_chunk) * 32);
                const __m512bh k1 = (__m512bh)_mm512_load_si512(k_block + ((chunks + c) * 16 + in_chunk) * 32);
                for (int r = 0; r < 8; r++) {
                    const __m512bh qq = (__m512bh)_mm512_set1_epi32((int)query_pairs[(g * 8 + r) * pairs_per_row + pair]);
                    s[r][0] = _mm512_dpbf16_ps(s[r][0], qq, k0);
                    s[r][1] = _mm512_dpbf16_ps(s[r][1], qq, k1);
                }
            }
            for (int r = 0; r < 8; r++) {
                _mm512_store_ps(scores + 32 * (g * 8 + r), s[r][0]);
                _mm512_store_ps(scores + 32 * (g * 8 + r) + 16, s[r][1]);
            }
        }
        const int rescale = softmax_block(scores, probs, best, total, correction, kb, first_pos, last_pos, rows, scale);
        if (rescale)
            for (int r = 0; r < rows; r++) {
                const __m512 factor = _mm512_set1_ps(correction[r]);
                for (int64_t d = 0; d < head_dim; d += 16)
                    _mm512_store_ps(acc[r] + d, _mm512_mul_ps(_mm512_load_ps(acc[r] + d), factor));
            }
        const uint16_t *v_block = v_packed + block_at[kb];
        for (int64_t db = 0; db < dim_blocks; db++)
            for (int g = 0; g < groups4; g++) {
                float *o_rows = acc[g * 4] + db * 16;
                __m512 o0 = _mm512_load_ps(o_rows), o1 = _mm512_load_ps(o_rows + MAX_HEAD_DIM),
                       o2 = _mm512_load_ps(o_rows + 2 * MAX_HEAD_DIM), o3 = _mm512_load_ps(o_rows + 3 * MAX_HEAD_DIM);
                const uint32_t *p = prob_pairs + g * 4 * 16;
                for (int kp = 0; kp < 16; kp++) {
                    const __m512bh v = (__m512bh)_mm512_load_si512(v_block + (db * 16 + kp) * 32);
                    o0 = _mm512_dpbf16_ps(o0, (__m512bh)_mm512_set1_epi32((int)p[kp]), v);
                    o1 = _mm512_dpbf16_ps(o1, (__m512bh)_mm512_set1_epi32((int)p[16 + kp]), v);
                    o2 = _mm512_dpbf16_ps(o2, (__m512bh)_mm512_set1_epi32((int)p[32 + kp]), v);
                    o3 = _mm512_dpbf16_ps(o3, (__m512bh)_mm512_set1_epi32((int)p[48 + kp]), v);
                }
                _mm512_store_ps(o_rows, o0);
                _mm512_store_ps(o_rows + MAX_HEAD_DIM, o1);
                _mm512_store_ps(o_rows + 2 * MAX_HEAD_DIM, o2);
                _mm512_store_ps(o_rows + 3 * MAX_HEAD_DIM, o3);
            }
    }
    finish_task(acc, total, out, num_heads, head, head_dim, i0, rows, out_factor);
}
#endif

/* For each sequence s and 32-key block kb, the sequence whose packing of that block s reads
 * (`source[first_block[s] + kb]`): an earlier one whose block table maps those 32 keys to the same
 * cache blocks (a prompt prefix shared through the prefix cache), both holding all 32 keys, or s
 * itself. Shared blocks are then packed once: sixteen 32-token chunks over four shared 512-token
 * prefixes packed 4 x 512 + 16 x 32 keys instead of 16 x 544. Costs O(sequences^2) compares of
 * block-table entries per call, each layer again (the tables are the same for all layers). */
static void find_sources(const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs,
                         int64_t max_blocks, int64_t block_size, const int64_t *first_block, int32_t *source) {
    for (int64_t s = 0; s < num_seqs; s++) {
        const int32_t *table = block_tables + s * max_blocks;
        const int64_t entries = (seq_lens[s] + block_size - 1) / block_size;
        int64_t partner = -1, common = 0;   /* the earlier sequence sharing the most leading entries */
        for (int64_t t = 0; t < s; t++) {
            const int32_t *other = block_tables + t * max_blocks;
            const int64_t limit = entries < (seq_lens[t] + block_size - 1) / block_size
                                      ? entries : (seq_lens[t] + block_size - 1) / block_size;
            int64_t n = 0;
            while (n < limit && other[n] == table[n]) n++;
            if (n > common) common = n, partner = t;
            if (common == entries) break;   /* all of s is shared: no better partner */
        }
        for (int64_t kb = 0; kb < first_block[s + 1] - first_block[s]; kb++) {
            const int64_t last_key = kb * 32 + 31;
            const int shared = partner >= 0 && last_key < seq_lens[s] && last_key < seq_lens[partner] &&
                               last_key / block_size < common;
            source[first_block[s] + kb] = shared ? source[first_block[partner] + kb] : (int32_t)s;
        }
    }
}

/* Index of (sequence s, KV head, 32-key block kb) in the per-sequence [kv head][kb] layout that
 * block_at and the packed K and V share; first_block[s] is s's first 32-key block. */
static inline int64_t block_index(const int64_t *first_block, int64_t s, int64_t kv_head, int64_t kb,
                                  int64_t num_kv_heads) {
    return first_block[s] * num_kv_heads + kv_head * (first_block[s + 1] - first_block[s]) + kb;
}

/* `format`: CACHE_BF16 or an fp8 one; the scores are scaled by `scale`, the output by `out_factor`. */
static int prefill(const uint16_t *q, const uint8_t *k_cache, const uint8_t *v_cache,
                   const int32_t *block_tables, const int32_t *seq_lens, const int32_t *query_lens,
                   const int32_t *query_starts, uint16_t *out, int64_t q_row_stride, int64_t max_blocks,
                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size, int format, float scale, float out_factor) {
    if ((head_dim != 64 && head_dim != 128) || num_heads % num_kv_heads) return BAD_SHAPE;
    for (int64_t s = 0; s < num_seqs; s++)
        if (query_lens[s] < 1 || query_lens[s] > seq_lens[s]) return BAD_SHAPE;
    const int64_t group = num_heads / num_kv_heads, row_elements = num_kv_heads * head_dim;
    const int64_t block_elements = 32 * head_dim;   /* one KV head's packed 32-key block, K or V */
    /* Per sequence: its first 32-key block's index (first_block), its first task (tasks_at). */
    int64_t *first_block = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    int64_t *tasks_at = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (!first_block || !tasks_at) { free(first_block); free(tasks_at); return NO_MEMORY; }
    first_block[0] = tasks_at[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        first_block[s + 1] = first_block[s] + (seq_lens[s] + 31) / 32;
        tasks_at[s + 1] = tasks_at[s] + num_heads * ((query_lens[s] + 15) / 16);
    }
    const int64_t blocks = first_block[num_seqs];
    int32_t *source = malloc(sizeof(int32_t) * (size_t)blocks);
    int64_t *owned = malloc(sizeof(int64_t) * (size_t)blocks);    /* blocks to pack: s * 2^32 + kb */
    int64_t *block_at = malloc(sizeof(int64_t) * (size_t)(blocks * num_kv_heads));   /* [(s, kv head), kb] */
    uint16_t *k_packed = aligned_alloc(64, (size_t)(blocks * num_kv_heads * block_elements * 2 + 64));
    uint16_t *v_packed = aligned_alloc(64, (size_t)(blocks * num_kv_heads * block_elements * 2 + 64));
    int status = source && owned && block_at && k_packed && v_packed ? OK : NO_MEMORY;
    if (status == OK) {
        find_sources(block_tables, seq_lens, num_seqs, max_blocks, block_size, first_block, source);
        int64_t num_owned = 0;
        for (int64_t s = 0; s < num_seqs; s++)
            for (int64_t kb = 0; kb < first_block[s + 1] - first_block[s]; kb++) {
                const int64_t from = source[first_block[s] + kb];
                for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++)
                    block_at[block_index(first_block, s, kv_head, kb, num_kv_heads)] =
                        block_index(first_block, from, kv_head, kb, num_kv_heads) * block_elements;
                if (from == s) owned[num_owned++] = s << 32 | kb;
            }
        #pragma omp parallel
        {
            #pragma omp for schedule(static)
            for (int64_t item = 0; item < num_owned * num_kv_heads; item++) {   /* (owned block, KV head) */
                const int64_t s = owned[item / num_kv_heads] >> 32, kb = owned[item / num_kv_heads] & 0xFFFFFFFF;
                const int64_t kv_head = item % num_kv_heads;
                const int64_t at = block_index(first_block, s, kv_head, kb, num_kv_heads) * block_elements;
                pack_block(k_cache, v_cache, block_tables + s * max_blocks, seq_lens[s], (int)kb, kv_head, head_dim,
                           block_size, row_elements, format, k_packed + at, v_packed + at);
            }
#if HAVE_AMX
            _tile_loadconfig(&TILES_16x64);
#endif
            #pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < tasks_at[num_seqs]; task++) {   /* (sequence, head, 16 queries) */
                int64_t s = 0;
                while (task >= tasks_at[s + 1]) s++;
                const int64_t per_head = (query_lens[s] + 15) / 16, local = task - tasks_at[s];
                const int64_t head = local / per_head;
                const int64_t *at = block_at + block_index(first_block, s, head / group, 0, num_kv_heads);
                attend_block(q + (int64_t)query_starts[s] * q_row_stride, q_row_stride, k_packed, v_packed, at,
                             out + (int64_t)query_starts[s] * num_heads * head_dim, num_heads, head, head_dim,
                             seq_lens[s], query_lens[s], (int)(local % per_head * 16), scale, out_factor);
            }
#if HAVE_AMX
            _tile_release();
#endif
        }
    }
    free(k_packed);
    free(v_packed);
    free(block_at);
    free(owned);
    free(source);
    free(first_block);
    free(tasks_at);
    return status;
}

/* What this build runs: 2 AMX tiles (the caller must hold the process's AMX permission), 1 AVX512-BF16. */
int paged_prefill_kind(void) { return HAVE_AMX ? 2 : 1; }

int paged_prefill_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int32_t *block_tables, const int32_t *seq_lens, const int32_t *query_lens,
                       const int32_t *query_starts, uint16_t *out, int64_t q_row_stride, int64_t max_blocks,
                       int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, float scale) {
    return prefill(q, (const uint8_t *)k_cache, (const uint8_t *)v_cache, block_tables, seq_lens, query_lens,
                   query_starts, out, q_row_stride, max_blocks, num_seqs, num_heads, num_kv_heads, head_dim,
                   block_size, CACHE_BF16, scale, 1.f);
}

/* bf16 queries over fp8 caches (e4m3fn, or e5m2 when `e5m2`) holding K / k_scale and V / v_scale. */
int paged_prefill_bf16_fp8(const uint16_t *q, const uint8_t *k_cache, const uint8_t *v_cache,
                           const int32_t *block_tables, const int32_t *seq_lens, const int32_t *query_lens,
                           const int32_t *query_starts, uint16_t *out, int64_t q_row_stride, int64_t max_blocks,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, int64_t e5m2, float scale, float k_scale, float v_scale) {
    return prefill(q, k_cache, v_cache, block_tables, seq_lens, query_lens, query_starts, out, q_row_stride,
                   max_blocks, num_seqs, num_heads, num_kv_heads, head_dim, block_size, (int)e5m2,
                   scale * k_scale * fp8_factor((int)e5m2), v_scale * fp8_factor((int)e5m2));
}
#else
int paged_prefill_kind(void) { return 0; }   /* no AVX512-BF16: every call says UNSUPPORTED */

int paged_prefill_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int32_t *block_tables, const int32_t *seq_lens, const int32_t *query_lens,
                       const int32_t *query_starts, uint16_t *out, int64_t q_row_stride, int64_t max_blocks,
                       int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, float scale) {
    (void)q; (void)q_row_stride; (void)k_cache; (void)v_cache; (void)block_tables; (void)max_blocks;
    (void)seq_lens; (void)query_lens; (void)query_starts; (void)out; (void)num_seqs; (void)num_heads;
    (void)num_kv_heads; (void)head_dim; (void)block_size; (void)scale;
    return UNSUPPORTED;
}

int paged_prefill_bf16_fp8(const uint16_t *q, const uint8_t *k_cache, const uint8_t *v_cache,
                           const int32_t *block_tables, const int32_t *seq_lens, const int32_t *query_lens,
                           const int32_t *query_starts, uint16_t *out, int64_t q_row_stride, int64_t max_blocks,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, int64_t e5m2, float scale, float k_scale, float v_scale) {
    (void)e5m2; (void)k_scale; (void)v_scale;   /* the bf16 stub says UNSUPPORTED */
    return paged_prefill_bf16(q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, block_tables, seq_lens,
                              query_lens, query_starts, out, q_row_stride, max_blocks, num_seqs, num_heads,
                              num_kv_heads, head_dim, block_size, scale);
}
#endif
