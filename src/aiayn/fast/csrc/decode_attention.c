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
 * row (1 x d_k x t): a batched matrix-product call's fixed overhead is many times the
 * arithmetic here (measured: docs/performance.md). Each row is computed on its own, in
 * the same order whatever the other rows are, so results do not depend on the batch.
 *
 * On AVX-512 CPUs (VW = 16 lanes) and AVX2 ones (VW = 8), for head sizes that are
 * multiples of VW (up to 128), keys and values are taken VW at a time: the VW dot
 * products of a block are summed together (vsum) instead of one horizontal sum each, and
 * each output vector stays in a register over the block's VW weighted values, several
 * vectors' chains of products overlapping (before: the horizontal sums and one
 * accumulator in memory were most of the time; measured: docs/performance.md, "C decoding
 * attention"). Other sizes and CPUs take the plain loops, which the compiler vectorises
 * for what it targets. The order of additions does not depend on a key's place in a
 * block, so the results still do not depend on the batch or the padding.
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define INLINE_V static inline __attribute__((always_inline))
#endif

#if defined(__AVX512F__)
/* AVX-512: VW = 16 float lanes. */
#define VW 16
typedef __m512 vf;
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VFMA _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
#define VSTORE_N(p, x, n) _mm512_mask_storeu_ps(p, (__mmask16)((1u << (n)) - 1u), x)

/* The sums of 16 vectors at once, lane i of the result = sum of v[i]'s 16 lanes: four
 * levels of shuffles and adds (46 instructions, independent across vectors) instead of a
 * horizontal reduction per vector (a dependent chain of ~10 each). Every vector is summed
 * in the same order whatever its slot, so a score does not depend on where its key falls
 * in a block (nor on the batch or the padding). */
INLINE_V vf vsum(const vf *v) {
    __m512 w[8], u[4], z[2];
    for (int i = 0; i < 8; i++)  /* halves: v[i] in blocks 0-1, v[i+8] in blocks 2-3 */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                             _mm512_shuffle_f32x4(v[i], v[i + 8], 0xee));
    for (int i = 0; i < 4; i++)  /* blocks: v[i], v[i+8], v[i+4], v[i+12] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88),
                             _mm512_shuffle_f32x4(w[i], w[i + 4], 0xdd));
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[i], u[i + 2]),
                             _mm512_unpackhi_ps(u[i], u[i + 2]));
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x44),
                             _mm512_shuffle_ps(z[0], z[1], 0xee));
    /* lane p now holds the sum of v[perm[p]]; perm is its own inverse */
    const __m512i perm = _mm512_set_epi32(15, 13, 14, 12, 7, 5, 6, 4, 11, 9, 10, 8,
                                          3, 1, 2, 0);
    return _mm512_permutexvar_ps(perm, r);
}

INLINE_V vf loadv_bf16(const uint16_t *p) {
    __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 and FMA: VW = 8 float lanes, the same blocks at half the width. */
#define VW 8
typedef __m256 vf;
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VFMA _mm256_fmadd_ps
#define VMUL _mm256_mul_ps
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
#define VSTORE_N(p, x, n) \
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), \
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), x)

/* The sums of 8 vectors at once, lane i = sum of v[i]'s 8 lanes: three levels of
 * horizontal adds and one cross-half add, ((a0+a1)+(a2+a3)) + ((a4+a5)+(a6+a7)) for
 * every vector whatever its slot (as above: no dependence on a key's place). */
INLINE_V vf vsum(const vf *v) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0 = [v0..v3 low-half sums | v0..v3 high-half sums], u1 the same for v4..v7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

INLINE_V vf loadv_bf16(const uint16_t *p) {
    __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}
#endif

#ifdef VW
INLINE_V vf loadv_f32(const float *p) { return VLOAD(p); }
#endif

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
#define LOADV loadv_f32
#define T_IS_FLOAT 1
#include "decode_attention_kernels.h"
#undef T_IS_FLOAT
#undef T
#undef SUFFIX
#undef LOAD
#undef STORE
#undef LOADV

#define T uint16_t
#define SUFFIX bf16
#define LOAD bf16_to_float
#define STORE float_to_bf16
#define LOADV loadv_bf16
#define T_IS_FLOAT 0
#include "decode_attention_kernels.h"
#undef T_IS_FLOAT
