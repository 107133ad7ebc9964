/* The decoder's layout for the compiled step (decoder_step.c) and the whole search
 * (beam_search.c); mirrored by decoder_step.py's ctypes structures. */
#ifndef AIAYN_DECODER_STEP_H
#define AIAYN_DECODER_STEP_H
#include <stdint.h>

/* A linear layer y = x W^T + b: float32 (w, n x k, row-major; packed, if not NULL, its
 * panels for gemm_f32_packed) or int8 (packed by aiayn_int8_pack, scale one per output
 * column), its inputs quantized to 8 bits (int8 = 1) or to 7 (INT8_R7: aiayn_int8_gemm_r7). */
#define INT8_R7 2
typedef struct {
    int64_t n, k;
    int int8;
    const float *w;
    const void *packed;
    const float *scale;
    const float *bias; /* or NULL */
} aiayn_linear;

typedef struct {
    aiayn_linear qkv, self_o, cross_q, cross_o, ff1, ff2;
    const float *norm_w[3], *norm_b[3];
    const float *mem_k, *mem_v; /* (A, h, S, d_k), (A, h, S, d_v): this search's */
    aiayn_linear cross_kv;      /* the encoder-decoder attention's keys and values */
} aiayn_decoder_layer;

typedef struct {
    int64_t layers, d_model, h, d_k, d_v, d_ff, vocab, max_positions;
    int pre_norm;
    float eps, emb_scale;
    const float *emb; /* (vocab, d_model) */
    const float *pe;  /* (max_positions, d_model) */
    const float *final_w, *final_b; /* pre-norm's final LayerNorm, else NULL */
    aiayn_linear out;
    int64_t out_block; /* int8 output layer: columns of products per block (a multiple of 8) */
    aiayn_decoder_layer *layer;
} aiayn_decoder;

int64_t aiayn_decoder_workspace(const aiayn_decoder *m, int64_t rows, int64_t t, int64_t g,
                                int64_t s);
void aiayn_decoder_step(const aiayn_decoder *m, const int64_t *tokens, int64_t rows, int64_t t,
                        float *table, const int64_t *tables, int64_t *path, int64_t path_ld,
                        const int64_t *reorder, const uint8_t *mask, int64_t mask_ld,
                        int64_t g, int64_t s, float *logits, int top_k, const int64_t *excl,
                        int n_excl, float *top_val, int64_t *top_idx, float *work);

#endif
