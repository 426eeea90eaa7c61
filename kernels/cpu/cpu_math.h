/* Float helpers shared by the CPU kernels of this folder (included, not compiled alone). */
#ifndef KUBEINFER_CPU_MATH_H
#define KUBEINFER_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (isnan(f)) return 0x7FC0;
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* e^x for x <= 0: Cephes' expf polynomial, ~1 ulp, written so the compiler vectorises the
 * loops calling it (libm's expf is scalar and would cost more than the dot products). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* 16 lanes of exp_nonpositive: the same polynomial, n rounded to nearest even instead of half up. */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* The bf16 values of `lanes` (others 0) as float32. */
static inline __m512 bf16x16_load(const uint16_t *p, __mmask16 lanes) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16));
}

/* The 16 lanes of v as bf16 (nearest even) into `lanes` of p. */
static inline void bf16x16_store(uint16_t *p, __mmask16 lanes, __m512 v) {
    _mm256_mask_storeu_epi16(p, lanes, (__m256i)_mm512_cvtneps_pbh(v));
}

/* v rounded to bf16 (nearest even), as float32. */
static inline __m512 bf16x16_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* 16 lanes of round(silu(gate)) * up in float32, gate and up bf16 values (HF's bf16 rounding of
 * the SiLU output). 1 / (1 + e) is a reciprocal estimate refined once by Newton (~1e-7 relative,
 * below bf16's rounding). */
static inline __m512 silu_mul16(__m512 gate, __m512 up) {
    const __m512 minus_abs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(gate),
                                                                  _mm512_set1_epi32((int)0x80000000u)));
    const __m512 e = exp_nonpositive16(minus_abs), d = _mm512_add_ps(e, _mm512_set1_ps(1.0f));
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
    const __mmask16 negative = _mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 silu = bf16x16_round(_mm512_mul_ps(_mm512_mask_mul_ps(gate, negative, gate, e), inv));
    return _mm512_mul_ps(silu, up);
}
#endif

/* The fp8 KV cache (e4m3fn, e5m2; `e5m2` selects). An fp8 byte put in the high bits of an fp16
 * (e5m2 as is; e4m3's 4-bit exponent and 3-bit mantissa moved under fp16's 5-bit exponent) is
 * the fp8 value times 2^-8 (e4m3) or 1 (e5m2), subnormals included: the kernels read fp8 with the
 * fp16 conversion instructions and fold fp8_factor into their scales. */
static inline uint16_t fp8_half_bits(uint8_t x, int e5m2) {
    return e5m2 ? (uint16_t)(x << 8) : (uint16_t)(((x & 0x80) << 8) | ((x & 0x7F) << 7));
}

static inline float fp8_factor(int e5m2) { return e5m2 ? 1.f : 256.f; }

static inline float half_bits_to_float(uint16_t h) {   /* finite fp16 only (what fp8_half_bits gives) */
    const int exponent = (h >> 10) & 31, mantissa = h & 1023;
    const float magnitude = exponent ? ldexpf((float)(1024 + mantissa), exponent - 25) : ldexpf((float)mantissa, -24);
    return h & 0x8000 ? -magnitude : magnitude;
}

/* x / scale in fp8 as `inv_scale` * x: saturated to the largest finite value (as vLLM's kernels),
 * rounded to nearest even (as torch's conversion); NaN stays NaN. */
static inline uint8_t float_to_fp8(float x, float inv_scale, int e5m2) {
    const int mantissa_bits = e5m2 ? 2 : 3, min_exponent = e5m2 ? -14 : -6, bias = e5m2 ? 15 : 7;
    const float largest = e5m2 ? 57344.f : 448.f;
    float a = x * inv_scale;
    uint32_t bits;
    memcpy(&bits, &a, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    if (isnan(a)) return sign | 0x7F;
    a = fabsf(a);
    a = a < largest ? a : largest;
    if (a < ldexpf(1.f, min_exponent))   /* subnormal: multiples of 2^(min_exponent - mantissa_bits) */
        return sign | (uint8_t)rintf(ldexpf(a, mantissa_bits - min_exponent));   /* 2^mantissa_bits: the smallest normal */
    memcpy(&bits, &a, sizeof bits);
    bits += (1u << (22 - mantissa_bits)) - 1 + ((bits >> (23 - mantissa_bits)) & 1);
    const uint32_t exponent = (bits >> 23) - 127 + bias, mantissa = (bits >> (23 - mantissa_bits)) & ((1u << mantissa_bits) - 1);
    return sign | (uint8_t)(exponent << mantissa_bits | mantissa);
}

#if defined(__AVX512BF16__)
/* float_to_fp8 of 16 lanes (`lanes` of them stored to p), bit for bit: the same saturation,
 * nearest-even rounding of normals by the carry trick, and rint of subnormals. */
static inline void fp8x16_store(uint8_t *p, __mmask16 lanes, __m512 x, float inv_scale, int e5m2) {
    const int mantissa_bits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;   /* smallest normal 2^-14 or 2^-6 */
    const __m512 a = _mm512_mul_ps(x, _mm512_set1_ps(inv_scale));
    const __m512i bits = _mm512_castps_si512(a);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
    const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    const __m512 magnitude = _mm512_min_ps(_mm512_abs_ps(a), _mm512_set1_ps(e5m2 ? 57344.f : 448.f));
    const __mmask16 subnormal = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(e5m2 ? 0x1p-14f : 0x1p-6f), _CMP_LT_OQ);
    const __m512i small = _mm512_cvtps_epi32(_mm512_roundscale_ps(   /* multiples of 2^(min_exponent - mantissa_bits) */
        _mm512_mul_ps(magnitude, _mm512_set1_ps(e5m2 ? 0x1p16f : 0x1p9f)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m512i m = _mm512_castps_si512(magnitude);
    m = _mm512_add_epi32(m, _mm512_add_epi32(_mm512_set1_epi32((1 << (22 - mantissa_bits)) - 1),
                                             _mm512_and_si512(_mm512_srli_epi32(m, 23 - mantissa_bits), _mm512_set1_epi32(1))));
    const __m512i exponent = _mm512_sub_epi32(_mm512_srli_epi32(m, 23), _mm512_set1_epi32(127 - bias));
    const __m512i normal = _mm512_or_si512(_mm512_slli_epi32(exponent, mantissa_bits),
                                           _mm512_and_si512(_mm512_srli_epi32(m, 23 - mantissa_bits),
                                                            _mm512_set1_epi32((1 << mantissa_bits) - 1)));
    __m512i q = _mm512_mask_blend_epi32(subnormal, normal, small);
    q = _mm512_mask_blend_epi32(nan, q, _mm512_set1_epi32(0x7F));
    _mm_mask_storeu_epi8(p, lanes, _mm512_cvtepi32_epi8(_mm512_or_si512(q, sign)));
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>

/* 16 fp8 bytes as the 16 fp16s of fp8_half_bits. */
static inline __m256i fp8x16_half_bits(const uint8_t *p, int e5m2) {
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    if (e5m2) return _mm256_slli_epi16(x, 8);
    return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8),
                           _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7F)), 7));
}
#endif

#if defined(__AVX512F__)
/* 16 fp8 values as float32 divided by fp8_factor. */
static inline __m512 fp8x16_load(const uint8_t *p, int e5m2) { return _mm512_cvtph_ps(fp8x16_half_bits(p, e5m2)); }
#endif

/* n fp8 values as float32, each divided by fp8_factor. */
static inline void fp8_row_to_float(const uint8_t *src, float *dst, int64_t n, int e5m2) {
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= n; d += 16) _mm512_storeu_ps(dst + d, fp8x16_load(src + d, e5m2));
#elif defined(__AVX2__) && defined(__F16C__)
    for (; d + 16 <= n; d += 16) {
        const __m256i h = fp8x16_half_bits(src + d, e5m2);
        _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
        _mm256_storeu_ps(dst + d + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    }
#endif
    for (; d < n; d++) dst[d] = half_bits_to_float(fp8_half_bits(src[d], e5m2));
}

#endif
