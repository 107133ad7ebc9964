/* The label-smoothed cross-entropy of a (N, V) logits table, row by row, for training on
 * the CPU (see native.py and loss._smoothed_ce_rows).
 *
 * For each row x (bf16 or float32) with target t: lse = log sum_j exp(x_j), the picked
 * logit x_t and the row sum sum_j x_j (the loss is assembled from these in Python), and,
 * with write_grad, the row overwritten by d loss / d x = softmax(x) - q, where
 * q = (1 - eps) one-hot(t) + eps / V, rounded once to the table's type. A row (V floats)
 * is read into a buffer that stays in cache: one pass for the max, the sum and the picked
 * logit, one for the exponentials, one writing the gradient. PyTorch's version makes
 * 14 operator calls and six passes per 64-row block.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_math.h"

/* buf holds the row as floats; returns lse, sets *total and, with grad, writes softmax - q
 * into buf (the caller stores it). */
static float row(float *buf, int64_t V, int64_t t, float eps, int write_grad, float *total) {
    float m = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : m) reduction(+ : sum)
    for (int64_t j = 0; j < V; j++) {
        m = buf[j] > m ? buf[j] : m;
        sum += buf[j];
    }
    *total = sum;
    float z = 0.0f;
#pragma omp simd reduction(+ : z)
    for (int64_t j = 0; j < V; j++) {
        buf[j] = exp_nonpositive(buf[j] - m);
        z += buf[j];
    }
    if (write_grad) {
        const float inv = 1.0f / z, uniform = eps / (float)V;
#pragma omp simd
        for (int64_t j = 0; j < V; j++) buf[j] = buf[j] * inv - uniform;
        buf[t] -= 1.0f - eps;
    }
    return m + logf(z);
}

/* Rows [r0, r1) of x (row stride ld); target: (N,) int64; buf: V floats of scratch;
 * lse, picked, total: (N,) float32. */
void aiayn_smoothed_ce_f32(float *x, int64_t r0, int64_t r1, int64_t V, int64_t ld,
                           const int64_t *target, float eps, int write_grad, float *buf,
                           float *lse, float *picked, float *total) {
    for (int64_t r = r0; r < r1; r++) {
        float *src = x + r * ld;
        memcpy(buf, src, (size_t)V * sizeof(float));
        picked[r] = buf[target[r]];
        lse[r] = row(buf, V, target[r], eps, write_grad, total + r);
        if (write_grad) memcpy(src, buf, (size_t)V * sizeof(float));
    }
}

void aiayn_smoothed_ce_bf16(uint16_t *x, int64_t r0, int64_t r1, int64_t V, int64_t ld,
                            const int64_t *target, float eps, int write_grad, float *buf,
                            float *lse, float *picked, float *total) {
    for (int64_t r = r0; r < r1; r++) {
        uint16_t *src = x + r * ld;
#pragma omp simd
        for (int64_t j = 0; j < V; j++) buf[j] = bf16_to_float(src[j]);
        picked[r] = buf[target[r]];
        lse[r] = row(buf, V, target[r], eps, write_grad, total + r);
        if (write_grad) {
#pragma omp simd
            for (int64_t j = 0; j < V; j++) src[j] = float_to_bf16(buf[j]);
        }
    }
}
