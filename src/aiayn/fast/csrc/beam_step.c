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
 * aiayn_lse_topk_i32_block scales them into the buffer as it reads them, the same
 * expression as int8_linear.c's dequantize pass, so the results are those of dequantizing
 * first, without writing the float table and reading it back. It takes one block of
 * columns at a time, with a running maximum, sum and top-k per row (the online softmax's
 * rescaling), so that the caller can multiply a block of the layer's columns and consume
 * it while it is still in cache, instead of writing the whole (R, V) int32 table to
 * memory and reading it back (10 MB a step for 256 rows x 10,000 tokens).
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

/* Top-k of buf[0..n), whose column 0 is column c0 of the row, into the sorted val/idx
 * (largest first, already holding the best so far): a chunk is scanned element by element
 * only if one of its values beats the current k-th best, which after the first chunks is
 * rare. Strictly greater: among equal values the lowest column is kept. */
static void topk_scan(const float *buf, int64_t n, int64_t c0, int k, float *val,
                      int64_t *idx) {
    float thr = val[k - 1];
    int64_t j = 0;
    for (; j + CHUNK <= n; j += CHUNK) {
        int any = 0;
#pragma omp simd reduction(| : any)
        for (int t = 0; t < CHUNK; t++) any |= buf[j + t] > thr;
        if (!any) continue;
        for (int t = 0; t < CHUNK; t++)
            if (buf[j + t] > thr) {
                insert(buf[j + t], c0 + j + t, k, val, idx);
                thr = val[k - 1];
            }
    }
    for (; j < n; j++)
        if (buf[j] > thr) {
            insert(buf[j], c0 + j, k, val, idx);
            thr = val[k - 1];
        }
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
    topk_scan(buf, V, 0, k, val, idx);
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

/* One block of columns [c0, c0 + n) of the int32 products for rows [r0, r1): acc (row
 * stride ld) holds the block, col_scale and bias (or NULL) start at column c0. Per row r,
 * m[r] is the running maximum logit, s[r] the sum of exp(x - m[r]) over the columns seen
 * so far, val/idx (R, k) the k largest logits outside `excl` and their columns (raw
 * logits: `last` subtracts the log-sum-exp from them after the final block). Start with
 * m = -inf, s = 0, val = -inf, idx = 0. With one block for all the columns the arithmetic
 * is that of the float rows' row() above after dequantizing (the same results, bit for
 * bit); over several blocks only the order of the sum differs. Equal logits: the lowest
 * column is kept, as there. */
void aiayn_lse_topk_i32_block(const int32_t *acc, int64_t r0, int64_t r1, int64_t n,
                              int64_t ld, int64_t c0, const float *row_scale,
                              const float *col_scale, const float *bias, int k,
                              const int64_t *excl, int n_excl, int last, float *buf,
                              float *m, float *s, float *val, int64_t *idx) {
    for (int64_t r = r0; r < r1; r++) {
        const int32_t *in = acc + r * ld;
        const float sc = row_scale[r];
        float bm = -INFINITY;
        if (bias) {
#pragma omp simd reduction(max : bm)
            for (int64_t j = 0; j < n; j++) {
                float x = (float)in[j] * sc * col_scale[j] + bias[j];
                buf[j] = x;
                bm = x > bm ? x : bm;
            }
        } else {
#pragma omp simd reduction(max : bm)
            for (int64_t j = 0; j < n; j++) {
                float x = (float)in[j] * sc * col_scale[j];
                buf[j] = x;
                bm = x > bm ? x : bm;
            }
        }
        float mr = m[r], sr = s[r];
        if (bm > mr) {
            if (sr > 0.0f) sr *= exp_nonpositive(mr - bm);
            mr = bm;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) sum += exp_nonpositive(buf[j] - mr);
        sr += sum;
        m[r] = mr;
        s[r] = sr;

        for (int e = 0; e < n_excl; e++)
            if (excl[e] >= c0 && excl[e] < c0 + n) buf[excl[e] - c0] = -INFINITY;
        float *v = val + r * k;
        topk_scan(buf, n, c0, k, v, idx + r * k);
        if (last) {
            float lse = mr + logf(sr);
            for (int i = 0; i < k; i++) v[i] -= lse;
        }
    }
}
