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

/* v rounded to bf16 (nearest even), as float32. */
static inline __m512 bf16x16_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
#endif

#endif
