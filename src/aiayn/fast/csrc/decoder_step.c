/* One incremental decoding step of the whole decoder stack in one call (see decoder_step.py).
 *
 * Why: at batch 1 a step of a small model (Transformer-Tiny: 4 layers, d_model 128, beam 4)
 * is ~50 PyTorch operators of a few microseconds of arithmetic each, plus the Python
 * between them; the interpreter and the operators' fixed costs, not the arithmetic, set
 * the time (measured: docs/performance.md, "A step at batch 1"). Here the step is plain C
 * over weights laid out once at load: the embedding and positional encoding, for each
 * layer the fused Q/K/V projection, Eq. 1 over the cached keys and values
 * (aiayn_cached_attention), the output projection, the encoder-decoder attention
 * (aiayn_memory_attention), the FFN, the three LayerNorms (post-norm, the paper's, or
 * pre-norm with the stack's final norm), then the output projection and the beam's
 * normaliser and top-k (aiayn_lse_topk_*), or the logits themselves.
 *
 * The layers are float32 (products in the loops below) or int8 (inference.Int8Linear's
 * arithmetic: the rows quantized by aiayn_quantize_rows, the exact int8 products of
 * aiayn_int8_gemm, aiayn_dequantize_rows; so an int8 layer's outputs are bit for bit
 * those of the PyTorch path). The cache layout is the PyTorch path's PathKVCache with
 * the layers side by side: step i's table holds, per row, every layer's fused projection
 * (L x h*(2 d_k + d_v) floats), and path[r][i] is the row of step i's table that holds row r's
 * position i, so a beam reordering permutes the small path table only.
 *
 * Each row is computed on its own, in the same order whatever the other rows are, so the
 * results do not depend on the batch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "decoder_step.h"

/* Products and sums rounded one at a time, as PyTorch's separate operators round them
 * (no fused multiply-add where the compiler would contract one). */
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))

/* The kernels this step calls, compiled into the same library. */
void aiayn_quantize_rows(const float *x, int64_t ld, int64_t r0, int64_t r1, int64_t k,
                         int8_t *q, float *scale);
void aiayn_dequantize_rows(void *acc, int64_t r0, int64_t r1, int64_t n,
                           const float *row_scale, const float *col_scale, const float *bias,
                           int relu);
void aiayn_int8_gemm(const int8_t *a, int64_t lda, int64_t r0, int64_t r1, int64_t k,
                     const int8_t *packed, int64_t c0, int64_t c1, int32_t *c, int64_t ldc);
void aiayn_int8_gemm_nonneg(const int8_t *a, int64_t lda, int64_t r0, int64_t r1, int64_t k,
                            const int8_t *packed, int64_t c0, int64_t c1, int32_t *c,
                            int64_t ldc);
void aiayn_quantize_rows_r7(const float *x, int64_t ld, int64_t r0, int64_t r1, int64_t k,
                            int8_t *q, float *scale);
void aiayn_int8_gemm_r7(const int8_t *a, int64_t lda, int64_t r0, int64_t r1, int64_t k,
                        const int8_t *packed, int64_t n, int64_t c0, int64_t c1, int32_t *c,
                        int64_t ldc);
void aiayn_cached_attention_f32(const float *q, int64_t q_ld, const float *const *pos,
                                int64_t ld, int64_t k_off, int64_t v_off, const int64_t *path,
                                int64_t path_ld, int64_t t, int64_t r0, int64_t r1, int h,
                                int d_k, int d_v, float scale, float *scratch, float *out,
                                int64_t out_ld);
void aiayn_memory_attention_f32(const float *q, int64_t q_ld, const float *k, const float *v,
                                const uint8_t *mask, int64_t mask_ld, int64_t a0, int64_t a1,
                                int64_t g, int64_t s, int h, int d_k, int d_v, float scale,
                                float *scratch, float *out, int64_t out_ld);
void aiayn_lse_topk_f32(const float *x, int64_t r0, int64_t r1, int64_t V, int64_t ld, int k,
                        const int64_t *excl, int n_excl, float *buf, float *val, int64_t *idx);
void aiayn_lse_topk_i32_block(const int32_t *acc, int64_t r0, int64_t r1, int64_t n,
                              int64_t ld, int64_t c0, const float *row_scale,
                              const float *col_scale, const float *bias, int k,
                              const int64_t *excl, int n_excl, int last, float *buf, float *m,
                              float *s, float *val, int64_t *idx);

/* Floats of workspace `aiayn_decoder_step` needs for `rows` rows at step t (0-based) over
 * sources of s positions with g rows a sentence. */
int64_t aiayn_decoder_workspace(const aiayn_decoder *m, int64_t rows, int64_t t, int64_t g,
                                int64_t s) {
    int64_t D = m->d_model, hk = m->h * m->d_k, hv = m->h * m->d_v;
    int64_t wide = 2 * hk + hv;
    if (m->d_ff > wide) wide = m->d_ff;
    if (D > wide) wide = D;
    if (hv > wide) wide = hv;
    int64_t out_cols = m->out.int8 ? m->out_block : m->vocab;
    int64_t acc = rows * (wide > out_cols ? wide : out_cols);
    int64_t attn = m->h * (t + 1) > g * s ? m->h * (t + 1) : g * s;
    return 4 * rows * wide      /* x, normed, attention out, hidden */
           + acc                /* products / logits */
           + (rows * wide) / 4 + 1 /* int8 rows */
           + rows               /* row scales */
           + 2 * attn           /* attention scratch */
           + m->vocab           /* lse buffer */
           + 2 * rows           /* running max and sum */
           + 2 * rows * (t + 1) /* path copy (int64) */
           + (t + 1) * 2        /* position pointers */
           + 64;
}

/* float32 products on weights packed in panels of 8 output columns, k-major
 * (packed[(p * k + i) * 8 + c] = W[8p + c][i], zero past n): each step of i broadcasts one
 * input value per row against 16 columns, no horizontal sums, the panels read once per
 * block of 4 rows (GCC vector extensions: AVX2/AVX-512 or SSE, by the build). */
typedef float v8f __attribute__((vector_size(32), aligned(4)));

static void gemm_f32_packed(const float *x, int64_t ldx, int64_t rows, int64_t k,
                            const float *packed, int64_t n, float *y, int64_t ldy) {
    const int64_t panels = (n + 7) / 8;
    for (int64_t p = 0; p < panels; p += 2) {
        const int two = p + 1 < panels;
        const float *w0 = packed + p * k * 8, *w1 = two ? w0 + k * 8 : w0;
        for (int64_t r = 0; r < rows; r += 4) {
            const int64_t nr = rows - r < 4 ? rows - r : 4;
            v8f acc[4][2];
            memset(acc, 0, sizeof acc);
            const float *x0 = x + r * ldx;
            if (nr == 4) {
                const float *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
                for (int64_t i = 0; i < k; i++) {
                    const v8f a = *(const v8f *)(w0 + i * 8), b = *(const v8f *)(w1 + i * 8);
                    acc[0][0] += x0[i] * a, acc[0][1] += x0[i] * b;
                    acc[1][0] += x1[i] * a, acc[1][1] += x1[i] * b;
                    acc[2][0] += x2[i] * a, acc[2][1] += x2[i] * b;
                    acc[3][0] += x3[i] * a, acc[3][1] += x3[i] * b;
                }
            } else {
                for (int64_t i = 0; i < k; i++) {
                    const v8f a = *(const v8f *)(w0 + i * 8), b = *(const v8f *)(w1 + i * 8);
                    for (int64_t rr = 0; rr < nr; rr++) {
                        const float xv = x0[rr * ldx + i];
                        acc[rr][0] += xv * a, acc[rr][1] += xv * b;
                    }
                }
            }
            for (int64_t rr = 0; rr < nr; rr++) {
                float *yr = y + (r + rr) * ldy;
                for (int h = 0; h < 1 + two; h++)
                    for (int c = 0; c < 8; c++) {
                        const int64_t col = (p + h) * 8 + c;
                        if (col < n) yr[col] = acc[rr][h][c];
                    }
            }
        }
    }
}

#define RELU_OUT 1  /* linear's flags: y = max(0, x W^T + b) */
#define NONNEG_IN 2 /* x >= 0 (a ReLU's output): int8 products without signs to move */

/* y (rows x n, row stride ldy) = x (rows x k, stride ldx) W^T + b (flags above). */
static void linear(const aiayn_linear *L, const float *x, int64_t ldx, int64_t rows, float *y,
                   int64_t ldy, int flags, int8_t *q, float *row_scale, int32_t *acc) {
    const int64_t n = L->n, k = L->k;
    const int relu = flags & RELU_OUT;
    if (L->int8) {
        if (flags & NONNEG_IN) { /* 8 bits whatever L->int8: [0, 127] moves no signs */
            aiayn_quantize_rows(x, ldx, 0, rows, k, q, row_scale);
            aiayn_int8_gemm_nonneg(q, k, 0, rows, k, L->packed, 0, n, acc, n);
        } else if (L->int8 == INT8_R7) {
            aiayn_quantize_rows_r7(x, ldx, 0, rows, k, q, row_scale);
            aiayn_int8_gemm_r7(q, k, 0, rows, k, L->packed, n, 0, n, acc, n);
        } else {
            aiayn_quantize_rows(x, ldx, 0, rows, k, q, row_scale);
            aiayn_int8_gemm(q, k, 0, rows, k, L->packed, 0, n, acc, n);
        }
        aiayn_dequantize_rows(acc, 0, rows, n, row_scale, L->scale, L->bias, relu);
        const float *f = (const float *)acc;
        if (f != y || ldy != n)
            for (int64_t r = 0; r < rows; r++) memcpy(y + r * ldy, f + r * n, (size_t)n * 4);
        return;
    }
    if (L->packed) {
        gemm_f32_packed(x, ldx, rows, k, (const float *)L->packed, n, y, ldy);
    } else {
        /* float32 unpacked: four output columns at a time, each weight row read once */
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) {
            const float *w0 = L->w + j * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
            for (int64_t r = 0; r < rows; r++) {
                const float *xr = x + r * ldx;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int64_t i = 0; i < k; i++) {
                    s0 += xr[i] * w0[i];
                    s1 += xr[i] * w1[i];
                    s2 += xr[i] * w2[i];
                    s3 += xr[i] * w3[i];
                }
                float *yr = y + r * ldy + j;
                yr[0] = s0, yr[1] = s1, yr[2] = s2, yr[3] = s3;
            }
        }
        for (; j < n; j++) {
            const float *w0 = L->w + j * k;
            for (int64_t r = 0; r < rows; r++) {
                const float *xr = x + r * ldx;
                float s0 = 0.0f;
#pragma omp simd reduction(+ : s0)
                for (int64_t i = 0; i < k; i++) s0 += xr[i] * w0[i];
                y[r * ldy + j] = s0;
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * ldy;
        if (L->bias) {
#pragma omp simd
            for (int64_t c = 0; c < n; c++) yr[c] += L->bias[c];
        }
        if (relu) {
#pragma omp simd
            for (int64_t c = 0; c < n; c++) yr[c] = yr[c] < 0.0f ? 0.0f : yr[c];
        }
    }
}

/* out = LayerNorm(x (+ add)) per row of D (out may be x), written as PyTorch's CPU kernel
 * writes it: (x * rstd + (-mean * rstd)) * w + b, rstd = 1 / sqrt(var + eps) (its mean
 * and variance sum in another order: the last bits may differ). */
NO_CONTRACT static void layer_norm(const float *x, const float *add, int64_t rows, int64_t D,
                                   const float *w, const float *b, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * D;
        float *o = out + r * D;
        if (add) {
            const float *ar = add + r * D;
#pragma omp simd
            for (int64_t i = 0; i < D; i++) o[i] = xr[i] + ar[i];
            xr = o;
        }
        float mean = 0.0f;
#pragma omp simd reduction(+ : mean)
        for (int64_t i = 0; i < D; i++) mean += xr[i];
        mean /= (float)D;
        float var = 0.0f;
#pragma omp simd reduction(+ : var)
        for (int64_t i = 0; i < D; i++) var += (xr[i] - mean) * (xr[i] - mean);
        const float rstd = 1.0f / sqrtf(var / (float)D + eps), shift = -mean * rstd;
#pragma omp simd
        for (int64_t i = 0; i < D; i++) o[i] = (xr[i] * rstd + shift) * w[i] + b[i];
    }
}

NO_CONTRACT static void add_into(float *x, const float *y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* A sublayer's input (section 3.1's residual connections): x itself (post-norm, the
 * paper's) or LayerNorm j of x written to `normed` (pre-norm). */
static const float *sublayer_in(const aiayn_decoder *m, const aiayn_decoder_layer *ly, int j,
                                const float *x, int64_t rows, float *normed) {
    if (!m->pre_norm) return x;
    layer_norm(x, NULL, rows, m->d_model, ly->norm_w[j], ly->norm_b[j], m->eps, normed);
    return normed;
}

/* The residual around a sublayer of output y: x = LayerNorm_j(x + y) (post-norm) or
 * x = x + y (pre-norm). */
static void sublayer_out(const aiayn_decoder *m, const aiayn_decoder_layer *ly, int j, float *x,
                         const float *y, int64_t rows) {
    if (m->pre_norm)
        add_into(x, y, rows * m->d_model);
    else
        layer_norm(x, y, rows, m->d_model, ly->norm_w[j], ly->norm_b[j], m->eps, x);
}

/* The position-wise feed-forward sublayer with its residual, LayerNorm j; `inner` holds
 * rows x d_ff, `y` rows x d_model. */
static void ffn_sublayer(const aiayn_decoder *m, const aiayn_decoder_layer *ly, int j, float *x,
                         int64_t rows, float *normed, float *inner, float *y, int8_t *q,
                         float *row_scale, int32_t *acc) {
    const int64_t D = m->d_model;
    const float *in = sublayer_in(m, ly, j, x, rows, normed);
    linear(&ly->ff1, in, D, rows, inner, m->d_ff, RELU_OUT, q, row_scale, acc);
    linear(&ly->ff2, inner, m->d_ff, rows, y, D, NONNEG_IN, q, row_scale, acc);
    sublayer_out(m, ly, j, x, y, rows);
}

/* x = the rows' token embeddings * sqrt(d_model) + PE(t), as model.Embeddings. */
NO_CONTRACT static void embed(const aiayn_decoder *m, const int64_t *tokens, int64_t rows,
                              int64_t t, float *x) {
    const int64_t D = m->d_model;
    for (int64_t r = 0; r < rows; r++) {
        const float *e = m->emb + tokens[r] * D, *p = m->pe + t * D;
        float *xr = x + r * D;
#pragma omp simd
        for (int64_t i = 0; i < D; i++) xr[i] = e[i] * m->emb_scale + p[i];
    }
}

/* One step for `rows` rows at position t (0-based: t positions are cached).
 *
 * tokens: (rows,) the newest token of each row. table: this step's (rows, L * h(2d_k + d_v))
 * floats,
 * written here; tables: t + 1 addresses, step i's table (tables[t] == table). path:
 * (>= rows, path_ld) int64, rows of the previous step's rows, first t columns valid;
 * reorder: (rows,) which previous row each row continues (NULL: row r continues row r);
 * column t is set here. mask: (rows, s) bytes, row stride mask_ld, 1 = may attend (the g
 * rows of a sentence share it). Then either logits (rows, vocab) are written (logits not
 * NULL, top_k >= 0), the decoder's last output (rows, d_model) (logits not NULL, top_k < 0:
 * `decode_hidden`), or each row's top_k best log-probabilities outside `excl` and their
 * tokens. work: aiayn_decoder_workspace floats. */
void aiayn_decoder_step(const aiayn_decoder *m, const int64_t *tokens, int64_t rows, int64_t t,
                        float *table, const int64_t *tables, int64_t *path, int64_t path_ld,
                        const int64_t *reorder, const uint8_t *mask, int64_t mask_ld,
                        int64_t g, int64_t s, float *logits, int top_k, const int64_t *excl,
                        int n_excl, float *top_val, int64_t *top_idx, float *work) {
    const int64_t D = m->d_model, L = m->layers, H = m->h;
    const int64_t hk = H * m->d_k, hv = H * m->d_v, w3 = 2 * hk + hv, ld = L * w3;
    int64_t wide = w3;
    if (m->d_ff > wide) wide = m->d_ff;
    if (D > wide) wide = D;
    if (hv > wide) wide = hv;
    const int64_t out_cols = m->out.int8 ? m->out_block : m->vocab;
    const int64_t attn = H * (t + 1) > g * s ? H * (t + 1) : g * s;

    float *x = work, *normed = x + rows * wide, *att = normed + rows * wide;
    float *hid = att + rows * wide, *accf = hid + rows * wide;
    int32_t *acc = (int32_t *)accf;
    int8_t *q = (int8_t *)(accf + rows * (wide > out_cols ? wide : out_cols));
    float *row_scale = (float *)q + (rows * wide) / 4 + 1;
    float *scratch = row_scale + rows, *buf = scratch + 2 * attn;
    float *run_m = buf + m->vocab, *run_s = run_m + rows;
    int64_t *path_copy = (int64_t *)(((uintptr_t)(run_s + rows) + 63) & ~(uintptr_t)63);
    const float **pos = (const float **)(path_copy + rows * (t + 1));

    /* the path: rows follow their hypotheses, then this step's row of each is itself */
    if (reorder && t > 0) {
        for (int64_t r = 0; r < rows; r++)
            memcpy(path_copy + r * t, path + reorder[r] * path_ld, (size_t)t * 8);
        for (int64_t r = 0; r < rows; r++)
            memcpy(path + r * path_ld, path_copy + r * t, (size_t)t * 8);
    }
    for (int64_t r = 0; r < rows; r++) path[r * path_ld + t] = r;
    for (int64_t i = 0; i <= t; i++) pos[i] = (const float *)(intptr_t)tables[i];

    embed(m, tokens, rows, t, x);
    const float scale = 1.0f / sqrtf((float)m->d_k);
    for (int64_t l = 0; l < L; l++) {
        const aiayn_decoder_layer *ly = m->layer + l;
        float *qkv = table + l * w3;
        /* masked self-attention over the cache */
        const float *in = sublayer_in(m, ly, 0, x, rows, normed);
        linear(&ly->qkv, in, D, rows, qkv, ld, 0, q, row_scale, acc);
        aiayn_cached_attention_f32(qkv, ld, pos, ld, l * w3 + hk, l * w3 + 2 * hk, path,
                                   path_ld, t + 1, 0, rows, (int)H, (int)m->d_k, (int)m->d_v,
                                   scale, scratch, att, hv);
        linear(&ly->self_o, att, hv, rows, hid, D, 0, q, row_scale, acc);
        sublayer_out(m, ly, 0, x, hid, rows);
        /* encoder-decoder attention */
        in = sublayer_in(m, ly, 1, x, rows, normed);
        linear(&ly->cross_q, in, D, rows, hid, hk, 0, q, row_scale, acc);
        aiayn_memory_attention_f32(hid, hk, ly->mem_k, ly->mem_v, mask, g * mask_ld, 0,
                                   rows / g, g, s, (int)H, (int)m->d_k, (int)m->d_v, scale,
                                   scratch, att, hv);
        linear(&ly->cross_o, att, hv, rows, hid, D, 0, q, row_scale, acc);
        sublayer_out(m, ly, 1, x, hid, rows);
        ffn_sublayer(m, ly, 2, x, rows, normed, att, hid, q, row_scale, acc);
    }
    if (m->final_w) layer_norm(x, NULL, rows, D, m->final_w, m->final_b, m->eps, x);

    /* the output layer */
    const aiayn_linear *o = &m->out;
    const int64_t V = m->vocab;
    if (logits && top_k < 0) {
        memcpy(logits, x, (size_t)(rows * D) * sizeof(float));
        return;
    }
    if (logits) {
        linear(o, x, D, rows, logits, V, 0, q, row_scale, (int32_t *)logits);
        return;
    }
    if (!o->int8) {
        linear(o, x, D, rows, accf, V, 0, q, row_scale, acc);
        aiayn_lse_topk_f32(accf, 0, rows, V, V, top_k, excl, n_excl, buf, top_val, top_idx);
        return;
    }
    /* int8: the products a block of columns at a time, scaled as read (Int8Linear.lse_topk) */
    const int r7 = o->int8 == INT8_R7;
    if (r7)
        aiayn_quantize_rows_r7(x, D, 0, rows, D, q, row_scale);
    else
        aiayn_quantize_rows(x, D, 0, rows, D, q, row_scale);
    for (int64_t r = 0; r < rows; r++) {
        run_m[r] = -INFINITY;
        run_s[r] = 0.0f;
        for (int i = 0; i < top_k; i++) top_val[r * top_k + i] = -INFINITY, top_idx[r * top_k + i] = 0;
    }
    const int64_t block = m->out_block;
    for (int64_t c0 = 0; c0 < V; c0 += block) {
        const int64_t c1 = c0 + block < V ? c0 + block : V, n = c1 - c0;
        if (r7)
            aiayn_int8_gemm_r7(q, D, 0, rows, D, o->packed, V, c0, c1, acc, n);
        else
            aiayn_int8_gemm(q, D, 0, rows, D, o->packed, c0, c1, acc, n);
        aiayn_lse_topk_i32_block(acc, 0, rows, n, n, c0, row_scale, o->scale + c0,
                                 o->bias ? o->bias + c0 : NULL, top_k, excl, n_excl, c1 == V,
                                 buf, run_m, run_s, top_val, top_idx);
    }
}

/* ------------------------------------------------------------------ the encoder
 * The encoder of a small batch in one call, with the same layers: an encoder is an
 * aiayn_decoder whose layers use qkv, self_o, ff1, ff2 and norms 0 and 1 (vocab and the
 * output layer unused). Self-attention over a sentence's own positions is the memory
 * attention with every position of the sentence as a query (g = S), its keys and values
 * laid out (A, h, S, d) first. */

static int64_t widest(const aiayn_decoder *m) {
    int64_t hk = m->h * m->d_k, hv = m->h * m->d_v, wide = 2 * hk + hv;
    if (m->d_ff > wide) wide = m->d_ff;
    if (m->d_model > wide) wide = m->d_model;
    return wide;
}

/* Floats of workspace aiayn_encode needs for A sentences of S positions. */
int64_t aiayn_encoder_workspace(const aiayn_decoder *m, int64_t A, int64_t S) {
    const int64_t rows = A * S, wide = widest(m);
    return 5 * rows * wide               /* normed, qkv, attention out, hidden, products */
           + (rows * wide) / 4 + 1       /* int8 rows */
           + rows                        /* row scales */
           + A * m->h * S * (m->d_k + m->d_v) /* keys and values, by head */
           + 2 * S * S                   /* attention scratch */
           + 64;
}

/* qkv rows (A*S, ld) -> k (A, H, S, dk) and v (A, H, S, dv), from columns k_off, v_off. */
static void by_head(const float *qkv, int64_t ld, int64_t k_off, int64_t v_off, int64_t A,
                    int64_t S, int64_t H, int64_t dk, int64_t dv, float *k, float *v) {
    for (int64_t a = 0; a < A; a++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t p = 0; p < S; p++) {
                const float *row = qkv + (a * S + p) * ld;
                memcpy(k + ((a * H + h) * S + p) * dk, row + k_off + h * dk, (size_t)dk * 4);
                memcpy(v + ((a * H + h) * S + p) * dv, row + v_off + h * dv, (size_t)dv * 4);
            }
}

/* out (A*S, d_model) = the encoder's output for tokens (A, S); mask (A, S) bytes, 1 = a
 * real position. Padded positions are computed as PyTorch computes them (their outputs
 * are never attended to). work: aiayn_encoder_workspace floats. */
void aiayn_encode(const aiayn_decoder *m, const int64_t *tokens, int64_t A, int64_t S,
                  const uint8_t *mask, float *out, float *work) {
    const int64_t D = m->d_model, H = m->h, dk = m->d_k, dv = m->d_v;
    const int64_t hk = H * dk, hv = H * dv, w3 = 2 * hk + hv, rows = A * S;
    const int64_t wide = widest(m);
    float *x = out, *normed = work, *qkv = normed + rows * wide, *att = qkv + rows * wide;
    float *hid = att + rows * wide, *accf = hid + rows * wide;
    int32_t *acc = (int32_t *)accf;
    int8_t *q = (int8_t *)(accf + rows * wide);
    float *row_scale = (float *)q + (rows * wide) / 4 + 1;
    float *k = row_scale + rows, *v = k + A * H * S * dk, *scratch = v + A * H * S * dv;
    for (int64_t a = 0; a < A; a++)
        for (int64_t p = 0; p < S; p++) embed(m, tokens + a * S + p, 1, p, x + (a * S + p) * D);
    const float scale = 1.0f / sqrtf((float)dk);
    for (int64_t l = 0; l < m->layers; l++) {
        const aiayn_decoder_layer *ly = m->layer + l;
        const float *in = sublayer_in(m, ly, 0, x, rows, normed);
        linear(&ly->qkv, in, D, rows, qkv, w3, 0, q, row_scale, acc);
        by_head(qkv, w3, hk, 2 * hk, A, S, H, dk, dv, k, v);
        aiayn_memory_attention_f32(qkv, w3, k, v, mask, S, 0, A, S, S, (int)H, (int)dk,
                                   (int)dv, scale, scratch, att, hv);
        linear(&ly->self_o, att, hv, rows, hid, D, 0, q, row_scale, acc);
        sublayer_out(m, ly, 0, x, hid, rows);
        ffn_sublayer(m, ly, 1, x, rows, normed, att, hid, q, row_scale, acc);
    }
    if (m->final_w) layer_norm(x, NULL, rows, D, m->final_w, m->final_b, m->eps, x);
}

/* Floats of workspace aiayn_memory_kv needs for A sentences of S positions. */
int64_t aiayn_memory_kv_workspace(const aiayn_decoder *m, int64_t A, int64_t S) {
    const int64_t rows = A * S, n = m->h * (m->d_k + m->d_v), w = n > m->d_model ? n : m->d_model;
    return 2 * rows * w + (rows * w) / 4 + 1 + rows + 64;
}

/* Every decoder layer's encoder-decoder keys and values of memory (A*S, d_model): layer
 * l's into k + l*A*H*S*dk (A, H, S, dk) and v + l*A*H*S*dv (A, H, S, dv). */
void aiayn_memory_kv(const aiayn_decoder *m, const float *memory, int64_t A, int64_t S,
                     float *k, float *v, float *work) {
    const int64_t D = m->d_model, H = m->h, dk = m->d_k, dv = m->d_v, rows = A * S;
    const int64_t n = H * (dk + dv), w = n > D ? n : D;
    float *kv = work, *accf = kv + rows * w;
    int32_t *acc = (int32_t *)accf;
    int8_t *q = (int8_t *)(accf + rows * w);
    float *row_scale = (float *)q + (rows * w) / 4 + 1;
    for (int64_t l = 0; l < m->layers; l++) {
        linear(&m->layer[l].cross_kv, memory, D, rows, kv, n, 0, q, row_scale, acc);
        by_head(kv, n, 0, H * dk, A, S, H, dk, dv, k + l * A * H * S * dk,
                v + l * A * H * S * dv);
    }
}
