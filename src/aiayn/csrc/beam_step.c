/* The beam step's normaliser and top-k for the CPU, one row at a time (see native.py).
 *
 * For each row of next-token logits x (bf16 or float32): lse = log sum_j exp(x_j) over
 * every column, and the k largest x_j among the columns not excluded, largest first,
 * returned as x_j - lse with their columns. A row (10,000 bf16 logits: 20 KB) is read
 * from memory once into a float32 buffer that stays in L1/L2 cache; the max, the sum of
 * exponentials and the top-k scan then run over that buffer.
 *
 * For int8 decoding (translate.Int8Linear as the output layer) the rows arrive as the
 * int32 products of the quantized layer, with a scale per row and per column:
 * aiayn_lse_topk_i32 scales them into the buffer as it reads them, the same expression as
 * int8_linear.c's dequantize pass, so the results are those of dequantizing first, without
 * writing the float table and reading it back (10 MB a step for 256 rows x 10,000 tokens).
 *
 * Built with -O3 -march=native -fopenmp-simd (the loops marked simd are vectorised, their
 * reductions reordered). Every row is computed on its own, in the same order whatever the
 * other rows are, so results do not depend on the batch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_math.h"

#define CHUNK 64

/* Insert (v, col) into the sorted list val[0..k-1] (largest first), dropping the last. */
static inline void insert(float v, int64_t col, int k, float *val, int64_t *idx) {
    int p = k - 1;
    while (p > 0 && val[p - 1] < v) {
        val[p] = val[p - 1];
        idx[p] = idx[p - 1];
        p--;
    }
    val[p] = v;
    idx[p] = col;
}

static void row(float *buf, int64_t V, int k, const int64_t *excl, int n_excl,
                float *val, int64_t *idx) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < V; j++) m = buf[j] > m ? buf[j] : m;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < V; j++) s += exp_nonpositive(buf[j] - m);
    float lse = m + logf(s);

    for (int e = 0; e < n_excl; e++) buf[excl[e]] = -INFINITY;
    for (int i = 0; i < k; i++) {
        val[i] = -INFINITY;
        idx[i] = 0;
    }
    /* Top-k: a chunk is scanned element by element only if one of its values beats the
     * current k-th best, which after the first chunks is rare. Strictly greater: among
     * equal values the lowest column is kept. */
    float thr = -INFINITY;
    int64_t j = 0;
    for (; j + CHUNK <= V; j += CHUNK) {
        int any = 0;
#pragma omp simd reduction(| : any)
        for (int t = 0; t < CHUNK; t++) any |= buf[j + t] > thr;
        if (!any) continue;
        for (int t = 0; t < CHUNK; t++)
            if (buf[j + t] > thr) {
                insert(buf[j + t], j + t, k, val, idx);
                thr = val[k - 1];
            }
    }
    for (; j < V; j++)
        if (buf[j] > thr) {
            insert(buf[j], j, k, val, idx);
            thr = val[k - 1];
        }
    for (int i = 0; i < k; i++) val[i] -= lse;
}

/* Rows [r0, r1) of x (row stride ld elements) into rows [r0, r1) of val and idx, both
 * (R, k); buf: V floats of scratch, one buffer per concurrent call. */
void aiayn_lse_topk_bf16(const uint16_t *x, int64_t r0, int64_t r1, int64_t V, int64_t ld,
                         int k, const int64_t *excl, int n_excl, float *buf, float *val,
                         int64_t *idx) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *src = x + r * ld;
#pragma omp simd
        for (int64_t j = 0; j < V; j++) buf[j] = bf16_to_float(src[j]);
        row(buf, V, k, excl, n_excl, val + r * k, idx + r * k);
    }
}

void aiayn_lse_topk_f32(const float *x, int64_t r0, int64_t r1, int64_t V, int64_t ld,
                        int k, const int64_t *excl, int n_excl, float *buf, float *val,
                        int64_t *idx) {
    for (int64_t r = r0; r < r1; r++) {
        memcpy(buf, x + r * ld, (size_t)V * sizeof(float));
        row(buf, V, k, excl, n_excl, val + r * k, idx + r * k);
    }
}

/* As above for int32 products acc (row stride ld) of an int8 layer: logit x_j =
 * acc_j * row_scale[r] * col_scale[j] (+ bias[j] where bias is not NULL), computed as
 * aiayn_dequantize_rows computes it. */
void aiayn_lse_topk_i32(const int32_t *acc, int64_t r0, int64_t r1, int64_t V, int64_t ld,
                        const float *row_scale, const float *col_scale, const float *bias,
                        int k, const int64_t *excl, int n_excl, float *buf, float *val,
                        int64_t *idx) {
    for (int64_t r = r0; r < r1; r++) {
        const int32_t *in = acc + r * ld;
        const float s = row_scale[r];
        if (bias) {
#pragma omp simd
            for (int64_t j = 0; j < V; j++) buf[j] = (float)in[j] * s * col_scale[j] + bias[j];
        } else {
#pragma omp simd
            for (int64_t j = 0; j < V; j++) buf[j] = (float)in[j] * s * col_scale[j];
        }
        row(buf, V, k, excl, n_excl, val + r * k, idx + r * k);
    }
}
