/* y = x W^T + b for bf16 activations and GGUF-quantized weights (Q4_0, Q4_1, Q8_0), read in
 * their quantized form: 4.5 or 8.5 bits a weight instead of bf16's 16.
 *
 * Why: CPU decode streams every weight once a step, so its speed is the weights' bytes over the
 * memory bandwidth. The embedded model's weights are 270 MB in bf16 but 97 MB as shipped
 * (Q4_1 layers, Q8_0 embedding), which also fits the last-level cache of many server CPUs.
 *
 * Same numbers as dequantizing first: each weight is d * q + m computed in float32 (exact:
 * q has at most 8 bits, d is fp16) and rounded to bf16 to nearest even, as the torch loader
 * does; only the float32 summation order differs from a bf16 GEMM.
 *
 * Packed layout (`quant_pack` makes it from GGUF blocks at load time): the weight [N, K] is
 * cut into tiles of 16 output rows x 32 inputs (one GGUF block per row). A tile's 16 "pair rows"
 * r hold, for n = 0..15, the weights (n, 2r) and (n, 2r + 1): exactly one row of the B operand
 * of AMX's TDPBF16PS and one zmm of an AVX512-BF16 dot product. Per tile:
 *   Q4: 16 pair rows x 16 bytes, byte j = value j (low nibble) and value 16 + j (high nibble)
 *       of the row's 32 values; then 16 fp16 scales d and 16 fp16 offsets m (one per n).
 *   Q8: 16 pair rows x 32 int8 values; then 16 fp16 scales d.
 * Threads split the 16-row strips. For a single row of x (DIRECT_ROWS without AMX), each pair
 * row goes from its quants to AVX512-BF16 dot products in registers. More rows need AMX: a strip's K/32 tiles are dequantized once into a per-thread buffer, then multiplied 16
 * rows of x at a time (TDPBF16PS). Without AVX512-BF16 every entry point returns UNSUPPORTED
 * and the caller keeps the dequantized weights.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#if defined(__F16C__)   /* quant_pack's fp16 conversions; cpu_math.h brings it with AVX512-BF16 */
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#endif

enum { KIND_Q4 = 0, KIND_Q8 = 1 };
enum { OK = 0, BAD_SHAPE = 1, UNSUPPORTED = 2, NO_MEMORY = 3 };
#define TILE_BYTES 1024      /* one dequantized 16 x 32 tile: 16 pair rows of 64 bytes */
#define ROWS_PER_PASS 96     /* AMX: 6 accumulator tiles of 16 rows, + 1 for x and 1 for W */
#define PREFETCH_TILES 16     /* the weights stream from DRAM: ask for them this many tiles ahead */
#define DIRECT_ROWS 4        /* up to this many rows of x, no dequantized copy of the weights */
#define DIRECT_ROWS_WITH_AMX 1  /* ... when AMX could take them: SmolLM2's linears at 2-4 rows 13.5-14.7
                                 * ms a step on AMX against 17-22 ms, at 1 row 15 against 13-15 ms */

/* Bytes of one packed tile, as quant_linear_cpu.py lays it out. */
static int64_t packed_tile_bytes(int kind) { return kind == KIND_Q4 ? 16 * 16 + 64 : 16 * 32 + 32; }

/* Bytes of one GGUF block of 32 weights: Q4_0 (gguf_type 0), Q4_1 (1), Q8_0 (2); ggml-common.h. */
static int64_t gguf_block_bytes(int64_t gguf_type) { return gguf_type == 0 ? 18 : gguf_type == 1 ? 20 : 34; }

#if defined(__AVX512BF16__)
/* A tile's scales (and Q4 offsets) spread over the lanes of its pair rows: lane j of the low
 * half is n = j / 2, of the high half n = 8 + j / 2. */
struct tile_scales { __m512 d_lo, d_hi, m_lo, m_hi; };

static inline struct tile_scales tile_scales(const uint8_t *tile, int kind) {
    const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + (kind == KIND_Q4 ? 256 : 512))));
    const __m512 m = kind == KIND_Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 288)))
                                     : _mm512_setzero_ps();
    return (struct tile_scales){_mm512_permutexvar_ps(first, d), _mm512_permutexvar_ps(second, d),
                                _mm512_permutexvar_ps(first, m), _mm512_permutexvar_ps(second, m)};
}

/* Pair row r of a tile as 32 bf16: (n, 2r) and (n, 2r + 1) for n = 0..15. */
static inline __m512bh dequantize_row(const uint8_t *tile, int kind, const struct tile_scales *s, int r) {
    if (kind == KIND_Q4) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tile + 16 * r)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s->d_hi, s->m_hi), _mm512_fmadd_ps(lo, s->d_lo, s->m_lo));
    }
    const int8_t *values = (const int8_t *)(tile + 32 * r);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)values)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(values + 16))));
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s->d_hi), _mm512_mul_ps(lo, s->d_lo));
}

/* Ask for the tile PREFETCH_TILES ahead (in the same strip or the next one: tiles are contiguous). */
static inline void prefetch_ahead(const uint8_t *tile, int64_t tile_bytes) {
    for (int64_t line = 0; line < tile_bytes; line += 64)
        _mm_prefetch((const char *)tile + PREFETCH_TILES * tile_bytes + line, _MM_HINT_T0);
}

/* Dequantize one packed tile into 16 zmm-sized pair rows of bf16 (`out`, 64-byte aligned). */
static inline void dequantize_tile(const uint8_t *tile, int kind, uint16_t *out) {
    const struct tile_scales scales = tile_scales(tile, kind);
    for (int r = 0; r < 16; r++)
        _mm512_store_si512((__m512i *)(out + 32 * r), (__m512i)dequantize_row(tile, kind, &scales, r));
}

/* Dequantize the K/32 tiles of strip `s` into `strip` (K/32 x TILE_BYTES). */
static void dequantize_strip(const uint8_t *packed, int kind, int64_t s, int64_t k_tiles, uint16_t *strip) {
    const int64_t tile_bytes = packed_tile_bytes(kind);
    const uint8_t *tile = packed + s * k_tiles * tile_bytes;
    for (int64_t t = 0; t < k_tiles; t++) {
        prefetch_ahead(tile + t * tile_bytes, tile_bytes);
        dequantize_tile(tile + t * tile_bytes, kind, strip + t * (TILE_BYTES / 2));
    }
}

/* Round 16 float32 sums (+ bias) to bf16 into out. */
static inline void store_row(const float *sums, const uint16_t *bias, uint16_t *out) {
    __m512 value = _mm512_loadu_ps(sums);
    if (bias) value = _mm512_add_ps(value, bf16x16_load(bias, 0xFFFF));
    _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(value));
}

/* A few rows of x (<= DIRECT_ROWS): each pair row goes from the weights to the dot products in
 * registers, never stored; even and odd pair rows sum apart to halve the dependency chains. */
static void multiply_strip_direct(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, int kind,
                                  int64_t s, const uint16_t *bias, uint16_t *out, int64_t n) {
    const int64_t tile_bytes = packed_tile_bytes(kind), k_tiles = k / 32;
    __m512 even[DIRECT_ROWS], odd[DIRECT_ROWS];
    for (int i = 0; i < DIRECT_ROWS; i++) even[i] = odd[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < k_tiles; t++) {
        const uint8_t *tile = packed + (s * k_tiles + t) * tile_bytes;
        prefetch_ahead(tile, tile_bytes);
        const struct tile_scales scales = tile_scales(tile, kind);
        for (int r = 0; r < 16; r += 2) {
            const __m512bh w0 = dequantize_row(tile, kind, &scales, r), w1 = dequantize_row(tile, kind, &scales, r + 1);
            for (int i = 0; i < rows; i++) {
                int32_t pairs[2];
                memcpy(pairs, x + i * k + t * 32 + 2 * r, sizeof pairs);
                even[i] = _mm512_dpbf16_ps(even[i], (__m512bh)_mm512_set1_epi32(pairs[0]), w0);
                odd[i] = _mm512_dpbf16_ps(odd[i], (__m512bh)_mm512_set1_epi32(pairs[1]), w1);
            }
        }
    }
    for (int i = 0; i < rows; i++) {
        float sums[16];
        _mm512_storeu_ps(sums, _mm512_add_ps(even[i], odd[i]));
        store_row(sums, bias ? bias + s * 16 : 0, out + i * n + s * 16);
    }
}

#endif

#if HAVE_AMX
#include "amx_tiles.h"

/* Linux hands out AMX state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM). */
int amx_request(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? OK : UNSUPPORTED;
}

/* AMX: tiles 0-5 accumulate 16 rows each, tile 6 holds 16 rows of x, tile 7 one weight tile.
 * `x` has a multiple of 16 rows (`padded_rows`, zeros past `rows`). */
static void multiply_strip_amx(const uint16_t *x, int64_t rows, int64_t padded_rows, int64_t k,
                               const uint16_t *strip, const uint16_t *bias, uint16_t *out, int64_t n, int64_t n0) {
    float sums[16 * 16] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < padded_rows; m0 += ROWS_PER_PASS) {
        const int tiles = (int)((padded_rows - m0 < ROWS_PER_PASS ? padded_rows - m0 : ROWS_PER_PASS) / 16);
        switch (tiles) {   /* tile numbers must be constants */
        case 6: _tile_zero(5); /* fall through */
        case 5: _tile_zero(4); /* fall through */
        case 4: _tile_zero(3); /* fall through */
        case 3: _tile_zero(2); /* fall through */
        case 2: _tile_zero(1); /* fall through */
        default: _tile_zero(0);
        }
        for (int64_t t = 0; t < k / 32; t++) {
            const uint16_t *a = x + m0 * k + t * 32;
            const int64_t stride = k * 2;
            _tile_loadd(7, strip + t * (TILE_BYTES / 2), 64);
#define ACCUMULATE(I) do { _tile_loadd(6, a + (I) * 16 * k, stride); _tile_dpbf16ps(I, 6, 7); } while (0)
            ACCUMULATE(0);
            if (tiles > 1) ACCUMULATE(1);
            if (tiles > 2) ACCUMULATE(2);
            if (tiles > 3) ACCUMULATE(3);
            if (tiles > 4) ACCUMULATE(4);
            if (tiles > 5) ACCUMULATE(5);
#undef ACCUMULATE
        }
        for (int i = 0; i < tiles; i++) {
            switch (i) {
            case 0: _tile_stored(0, sums, 64); break;
            case 1: _tile_stored(1, sums, 64); break;
            case 2: _tile_stored(2, sums, 64); break;
            case 3: _tile_stored(3, sums, 64); break;
            case 4: _tile_stored(4, sums, 64); break;
            default: _tile_stored(5, sums, 64); break;
            }
            for (int row = 0; row < 16 && m0 + i * 16 + row < rows; row++)
                store_row(sums + 16 * row, bias ? bias + n0 : 0, out + (m0 + i * 16 + row) * n + n0);
        }
    }
}

/* Each thread dequantizes a strip at a time into its buffer, then runs every row of x on it.
 * Tiles load 16 rows of x: other row counts run on a zero-padded copy. */
static int multiply_amx(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *out,
                        int64_t rows, int64_t n, int64_t k, int kind) {
    const int64_t padded_rows = (rows + 15) / 16 * 16;
    uint16_t *padded = 0;
    if (padded_rows != rows) {
        padded = calloc((size_t)(padded_rows * k), sizeof *padded);
        if (!padded) return NO_MEMORY;
        memcpy(padded, x, (size_t)(rows * k) * sizeof *padded);
        x = padded;
    }
    int status = OK;
    #pragma omp parallel
    {
        uint16_t *strip = aligned_alloc(64, k / 32 * TILE_BYTES);
        if (strip) {
            _tile_loadconfig(&TILES_16x64);
        } else {
            #pragma omp atomic write
            status = NO_MEMORY;
        }
        #pragma omp for schedule(static)
        for (int64_t s = 0; s < n / 16; s++) {
            if (!strip) continue;
            dequantize_strip(packed, kind, s, k / 32, strip);
            multiply_strip_amx(x, rows, padded_rows, k, strip, bias, out, n, s * 16);
        }
        if (strip) _tile_release();
        free(strip);
    }
    free(padded);
    return status;
}
#else
int amx_request(void) { return UNSUPPORTED; }
#endif

/* out [rows, n] = x [rows, k] W^T (+ bias [n]), all contiguous; W packed as above, n % 16 == 0,
 * k % 32 == 0. More than DIRECT_ROWS rows need `use_amx` (amx_request() must have succeeded). */
int quant_linear_bf16(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *out,
                      int64_t rows, int64_t n, int64_t k, int64_t kind, int64_t use_amx) {
#if defined(__AVX512BF16__)
    if (n % 16 || k % 32 || (kind != KIND_Q4 && kind != KIND_Q8)) return BAD_SHAPE;
    if (rows <= (use_amx ? DIRECT_ROWS_WITH_AMX : DIRECT_ROWS)) {
        #pragma omp parallel for schedule(static)
        for (int64_t s = 0; s < n / 16; s++)
            multiply_strip_direct(x, rows, k, packed, (int)kind, s, bias, out, n);
        return OK;
    }
#if HAVE_AMX
    if (use_amx) return multiply_amx(x, packed, bias, out, rows, n, k, (int)kind);
#endif
    return UNSUPPORTED;   /* without AMX, more rows are faster on the dequantized weights */
#else
    (void)x; (void)packed; (void)bias; (void)out; (void)rows; (void)n; (void)k; (void)kind; (void)use_amx;
    return UNSUPPORTED;
#endif
}

/* Whether this build can run the kernel (built for a CPU with AVX512-BF16). */
int quant_supported(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* The bf16 weights [n, k] the packed form stands for (tests compare them with the loader's). */
int quant_unpack_bf16(const uint8_t *packed, uint16_t *weight, int64_t n, int64_t k, int64_t kind) {
#if defined(__AVX512BF16__)
    if (n % 16 || k % 32) return BAD_SHAPE;
    uint16_t tile[TILE_BYTES / 2] __attribute__((aligned(64)));
    for (int64_t s = 0; s < n / 16; s++)
        for (int64_t t = 0; t < k / 32; t++) {
            dequantize_tile(packed + (s * (k / 32) + t) * packed_tile_bytes((int)kind), (int)kind, tile);
            for (int r = 0; r < 16; r++)
                for (int j = 0; j < 16; j++) {
                    weight[(s * 16 + j) * k + t * 32 + 2 * r] = tile[32 * r + 2 * j];
                    weight[(s * 16 + j) * k + t * 32 + 2 * r + 1] = tile[32 * r + 2 * j + 1];
                }
        }
    return OK;
#else
    (void)packed; (void)weight; (void)n; (void)k; (void)kind;
    return UNSUPPORTED;
#endif
}

/* GGUF blocks of a Q4_0 (gguf_type 0), Q4_1 (1) or Q8_0 (2) matrix [rows, k] -> its bf16 values,
 * row-major: the loader's dense weights, bit-identical to its torch dequantization (d * q + m is
 * exact in float32, Q4_0's d * (q - 8) as d * q + (-8d) too, then rounded to nearest even) and
 * ~10x faster, which is most of a GGUF model's load time. One thread: the loader dequantizes a
 * tensor on each core at once. */
int quant_dequantize_bf16(const uint8_t *blocks, uint16_t *out, int64_t rows, int64_t k, int64_t gguf_type) {
#if defined(__AVX512BF16__)
    if (k % 32 || gguf_type < 0 || gguf_type > 2) return BAD_SHAPE;
    const int64_t block_bytes = gguf_block_bytes(gguf_type), count = rows * (k / 32);
    const __m512i low_nibble = _mm512_set1_epi32(0x0F);
    for (int64_t b = 0; b < count; b++) {
        const uint8_t *block = blocks + b * block_bytes;
        uint16_t half;
        memcpy(&half, block, 2);
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(half));
        __m512 first, second;   /* values 0..15 and 16..31 of the block */
        if (gguf_type == 2) {
            first = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 2)))), d);
            second = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 18)))), d);
        } else {
            const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + block_bytes - 16)));
            __m512 m;
            if (gguf_type == 1) {
                memcpy(&half, block + 2, 2);
                m = _mm512_set1_ps(_cvtsh_ss(half));
            } else {
                m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
            }
            first = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, low_nibble)), d, m);
            second = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), d, m);
        }
        _mm512_storeu_si512((__m512i *)(out + 32 * b), (__m512i)_mm512_cvtne2ps_pbh(second, first));
    }
    return OK;
#else
    (void)blocks; (void)out; (void)rows; (void)k; (void)gguf_type;
    return UNSUPPORTED;
#endif
}

/* GGUF blocks [n, k/32, block bytes] of a Q4_0 (gguf_type 0), Q4_1 (1) or Q8_0 (2) matrix ->
 * the tiles above ([n/16, k/32, packed_tile_bytes]). Q4_0's d * (q - 8) becomes d * q + (-8d),
 * exact in fp16 and in the kernel's float32. */
int quant_pack(const uint8_t *blocks, uint8_t *tiles, int64_t n, int64_t k, int64_t gguf_type) {
#if defined(__F16C__)
    if (n % 16 || k % 32 || gguf_type < 0 || gguf_type > 2) return BAD_SHAPE;
    const int kind = gguf_type == 2 ? KIND_Q8 : KIND_Q4;
    const int64_t block_bytes = gguf_block_bytes(gguf_type), k_tiles = k / 32;
    const int64_t tile_bytes = packed_tile_bytes(kind);
    #pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < n / 16; s++)
        for (int64_t t = 0; t < k_tiles; t++) {
            uint8_t *tile = tiles + (s * k_tiles + t) * tile_bytes, values[16][32];
            uint16_t *scales = (uint16_t *)(tile + (kind == KIND_Q4 ? 256 : 512)), *offsets = scales + 16;
            for (int j = 0; j < 16; j++) {   /* row s*16 + j: its 32 values and fp16 scale (offset) */
                const uint8_t *block = blocks + ((s * 16 + j) * k_tiles + t) * block_bytes;
                memcpy(&scales[j], block, 2);
                if (kind == KIND_Q8) {
                    memcpy(values[j], block + 2, 32);
                    continue;
                }
                const uint8_t *quants = block + block_bytes - 16;
                for (int i = 0; i < 16; i++) { values[j][i] = quants[i] & 0x0F; values[j][16 + i] = quants[i] >> 4; }
                if (gguf_type == 1) memcpy(&offsets[j], block + 2, 2);
                else offsets[j] = _cvtss_sh(-8.f * _cvtsh_ss(scales[j]), 0);
            }
            for (int r = 0; r < 16; r++)      /* pair row r: word 2j + p is (n = j, k = 2r + p) */
                for (int j = 0; j < 16; j++)
                    for (int p = 0; p < 2; p++) {
                        if (kind == KIND_Q8) tile[32 * r + 2 * j + p] = values[j][2 * r + p];
                        else if (j < 8)  /* words 0..15 in low nibbles, 16..31 in high ones */
                            tile[16 * r + 2 * j + p] = values[j][2 * r + p] | (uint8_t)(values[j + 8][2 * r + p] << 4);
                    }
        }
    return OK;
#else
    (void)blocks; (void)tiles; (void)n; (void)k; (void)gguf_type;
    return UNSUPPORTED;
#endif
}
