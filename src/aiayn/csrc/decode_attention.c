/* Eq. 1 for one decoding step on the CPU: one new query per row (see native.py).
 *
 * softmax(q K^T / sqrt(d_k)) V for each row and head, computed in float32 from bf16 or
 * float32 inputs and rounded once, at the end, to the inputs' type. Two cases:
 *
 * - cached (decoder self-attention): row r's key and value at position i are in row
 *   path[r][i] of that position's table, which holds the K and V columns of the step's
 *   fused projection. A beam reordering only permutes the small path table; nothing
 *   cached is copied or moved (PyTorch's version gathers the whole cache into a new
 *   buffer every step).
 * - memory (encoder-decoder attention): the g rows of sentence a attend to its keys and
 *   values (A, H, S, d), stored once per sentence, under its source mask.
 *
 * Written out as loops because a step's attention is thousands of products of one query
 * row (1 x d_k x t): a batched matrix-product call costs ~100-250 us of fixed overhead
 * here, for arithmetic that takes a few. Each row is computed on its own, in the same
 * order whatever the other rows are, so results do not depend on the batch.
 *
 * The kernels are written once (decode_attention_kernels.h) and instantiated for float32
 * and bf16 below.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_math.h"

/* Sizes at most, checked by native.py before calling: d_k and d_v of one head; h*d_k,
 * h*d_v and g*d_v; h and g. */
#define MAX_D 1024
#define MAX_ROW 8192
#define MAX_HEADS 256
/* Positions ahead whose cached rows are prefetched (they lie scattered in memory). */
#define PREFETCH 2

static inline float float_id(float x) { return x; }

static inline __attribute__((always_inline)) float dot_ff(const float *q, const float *k,
                                                           int d) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int j = 0; j < d; j++) s += q[j] * k[j];
    return s;
}

static inline __attribute__((always_inline)) void axpy_ff(float *acc, float w,
                                                           const float *v, int d) {
#pragma omp simd
    for (int j = 0; j < d; j++) acc[j] += w * v[j];
}

/* Softmax of each of `rows` segments of n entries (s[r*n .. r*n+n)), in place, up to the
 * factor inv[r] = 1 / its sum. The exponentials run over all segments as one flat,
 * vectorised loop: a segment is as short as the positions decoded so far or a sentence's
 * source length, too short to fill vectors on its own. At least one entry of each
 * segment is finite; one at -inf adds exp(-87) ~ 1.6e-38 to its sum (exp_nonpositive),
 * nothing next to the largest entry's 1, and the caller gives it no weight. */
static inline void softmax_rows(float *s, int64_t rows, int64_t n, float *inv) {
    for (int64_t r = 0; r < rows; r++) {
        float *x = s + r * n, m = -INFINITY;
        for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
        for (int64_t i = 0; i < n; i++) x[i] -= m;
    }
#pragma omp simd
    for (int64_t i = 0; i < rows * n; i++) s[i] = exp_nonpositive(s[i]);
    for (int64_t r = 0; r < rows; r++) {
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) sum += s[r * n + i];
        inv[r] = 1.0f / sum;
    }
}

#define T float
#define SUFFIX f32
#define LOAD float_id
#define STORE float_id
#include "decode_attention_kernels.h"
#undef T
#undef SUFFIX
#undef LOAD
#undef STORE

#define T uint16_t
#define SUFFIX bf16
#define LOAD bf16_to_float
#define STORE float_to_bf16
#include "decode_attention_kernels.h"
