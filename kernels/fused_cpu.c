/* Fused CPU elementwise kernels: RMSNorm (+ residual add) and SiLU-and-mul, one pass each.
 *
 * They round exactly where the torch references do (kernels/rms_norm_ref.py,
 * activation_ref.py, i.e. Hugging Face's modules in bf16): the residual sum, the normalised
 * value and the SiLU output are each rounded to the model dtype before the next product.
 * Sums of squares are float32 in a different order than torch's (last-bit differences).
 * Built by kernels/cpu_build.py, called by kernels/fused_cpu.py; all tensors contiguous rows.
 */
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

DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_float, float_to_bf16, BF16_ROUND)
DEFINE_RMS_NORM(rms_norm_f32, float, ID, ID, ID)
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, bf16_to_float, float_to_bf16, BF16_ROUND)
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, ID, ID, ID)
