/* The float sides of an int8 linear layer for CPU decoding (see translate.Int8Linear).
 *
 * y = x W^T + b with W stored as int8 with one scale per output column (s_w) and x
 * quantized per row at run time (s_x): x ~ s_x q_x, W ~ q_W s_w, so
 * y ~ s_x s_w (q_x q_W^T) + b, the integer product done by torch._int_mm (int8 x int8 ->
 * int32; oneDNN's s8 GEMM). These two functions are the passes before and
 * after it: each reads its rows once, where PyTorch ops make four or five passes (absolute
 * value, max, divide, round, cast; cast, two scalings, bias).
 */
#include <math.h>
#include <stdint.h>

/* Rows [r0, r1) of x (row stride ld, k columns) to int8 with `top` steps a side:
 * q = offset + rint(x * top / max|x|), scale = max|x| / top (0 and an all-zero row, q =
 * offset, where the row is all zero). Inlined with constants into the two below. */
static inline __attribute__((always_inline)) void quantize_rows(
    const float *x, int64_t ld, int64_t r0, int64_t r1, int64_t k, int8_t *q, float *scale,
    const float top, const int offset) {
    for (int64_t r = r0; r < r1; r++) {
        const float *row = x + r * ld;
        float m = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < k; j++) {
            const float a = fabsf(row[j]);  /* not fmaxf: gcc called it per element */
            m = a > m ? a : m;
        }
        const float inv = m > 0.0f ? top / m : 0.0f;
        scale[r] = m / top;
        int8_t *out = q + r * k;
#pragma omp simd
        for (int64_t j = 0; j < k; j++)
            out[j] = (int8_t)(offset + (int)rintf(row[j] * inv));
    }
}

/* 8 bits: q = rint(x * 127 / max|x|), scale = max|x| / 127. */
void aiayn_quantize_rows(const float *x, int64_t ld, int64_t r0, int64_t r1, int64_t k,
                         int8_t *q, float *scale) {
    quantize_rows(x, ld, r0, r1, k, q, scale, 127.0f, 0);
}

/* 7 bits for aiayn_int8_gemm_r7: a = rint(x * 63 / max|x|) in [-63, 63], stored as a + 64
 * (in [1, 127]: non-negative, so the products move no signs), scale = max|x| / 63. */
void aiayn_quantize_rows_r7(const float *x, int64_t ld, int64_t r0, int64_t r1, int64_t k,
                            int8_t *q, float *scale) {
    quantize_rows(x, ld, r0, r1, k, q, scale, 63.0f, 64);
}

/* Rows [r0, r1) of the (rows, n) int32 products, in place to float32:
 * y = acc * row_scale[r] * col_scale[j] (+ bias[j] where bias is not NULL), then
 * max(0, y) where relu is not 0 (the FFN's first layer: no pass of its own over the
 * largest activation of a decoding step). */
void aiayn_dequantize_rows(void *acc, int64_t r0, int64_t r1, int64_t n,
                           const float *row_scale, const float *col_scale, const float *bias,
                           int relu) {
    for (int64_t r = r0; r < r1; r++) {
        const int32_t *in = (const int32_t *)acc + r * n;
        float *out = (float *)acc + r * n;
        const float s = row_scale[r];
        if (bias) {
#pragma omp simd
            for (int64_t j = 0; j < n; j++)
                out[j] = (float)in[j] * s * col_scale[j] + bias[j];
        } else {
#pragma omp simd
            for (int64_t j = 0; j < n; j++)
                out[j] = (float)in[j] * s * col_scale[j];
        }
        if (relu) {
#pragma omp simd
            for (int64_t j = 0; j < n; j++)
                out[j] = out[j] < 0.0f ? 0.0f : out[j];  /* a NaN stays NaN, as torch.relu */
        }
    }
}
