/* Helpers shared by the compiled code: bf16 <-> float and a vectorisable exp. */
#ifndef AIAYN_SIMD_MATH_H
#define AIAYN_SIMD_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as PyTorch's float -> bf16 conversion; NaN stays NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0: Cody-Waite range reduction and Cephes' expf polynomial (relative error
 * ~1e-7), branch-free so that the loop calling it is vectorised. Below -87 it returns
 * exp(-87) ~ 1.6e-38 instead of a smaller number or 0: nothing next to the row's maximum
 * term, which is exp(0) = 1. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

#endif
