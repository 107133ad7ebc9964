/* Dropout multipliers for training on the CPU (see native.py and model.Dropout).
 *
 * Element i of a mask is kept when its 16-bit uniform draw u_i >= round(p * 65536), so p is
 * applied to within 2^-16, and the multiplier is then 1 / (1 - p), else 0. The draws come
 * from a counter-based generator: block b of four elements takes the four 16-bit lanes of
 * SplitMix64's output for the counter seed + b * golden-ratio (Steele, Lea and Flood 2014;
 * the seed is drawn from PyTorch's generator per mask, so torch.manual_seed and the
 * checkpointed generator state still decide every mask). Each block is computed on its own,
 * so the loop vectorises and a mask does not depend on how its blocks are split between
 * threads. PyTorch's CPU generator (a Mersenne Twister, one number at a time on one thread)
 * is the slow path this replaces (measured: docs/performance.md, "Compiled dropout").
 */
#include <stdint.h>

static inline uint64_t splitmix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

#define GOLDEN 0x9E3779B97F4A7C15ull

/* Blocks [b0, b1) of out, four elements each: scale where kept, else 0. */
void aiayn_dropout_f32(uint64_t seed, int64_t b0, int64_t b1, uint32_t threshold, float scale,
                       float *out) {
#pragma omp simd
    for (int64_t b = b0; b < b1; b++) {
        uint64_t z = splitmix64(seed + (uint64_t)b * GOLDEN);
        for (int l = 0; l < 4; l++)
            out[4 * b + l] = ((z >> (16 * l)) & 0xFFFFu) >= threshold ? scale : 0.0f;
    }
}

/* The same draws, bf16 multipliers (`scale` is the bf16 bit pattern of 1 / (1 - p)). */
void aiayn_dropout_bf16(uint64_t seed, int64_t b0, int64_t b1, uint32_t threshold,
                        uint16_t scale, uint16_t *out) {
#pragma omp simd
    for (int64_t b = b0; b < b1; b++) {
        uint64_t z = splitmix64(seed + (uint64_t)b * GOLDEN);
        for (int l = 0; l < 4; l++)
            out[4 * b + l] = ((z >> (16 * l)) & 0xFFFFu) >= threshold ? scale : 0;
    }
}
