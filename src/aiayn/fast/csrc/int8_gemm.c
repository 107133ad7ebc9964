/* Exact int8 x int8 -> int32 products for CPUs without VNNI (see native.py, int8_ops.py).
 *
 * Why: PyTorch's torch._int_mm is oneDNN's s8s8s32 GEMM. With AVX-512 VNNI or AMX it is
 * exact and fast; without them (AVX2-only CPUs: Zen 2/3, Intel client chips; AVX-512
 * CPUs before Cascade Lake) oneDNN adds 128 to one operand to use vpmaddubsw (u8 x s8,
 * pairs summed into a saturating int16): a pair of products reaches (127 + 128) * 127 * 2 =
 * 64,770 > 32,767, so most results come out wrong (measured: 99% of a 64 x 256 x 96
 * product, errors up to 86,105; the same saturation garbles CTranslate2's int8 output on
 * such CPUs). Here the signs move instead: vpmaddubsw(|a|, sign(b, a)) multiplies |a| (u8)
 * by b with a's sign (s8), so each product is a * b and a pair's sum is at most
 * 2 * 127 * 127 = 32,258: no saturation for operands in [-127, 127] (aiayn's quantization
 * never makes -128). vpmaddwd by ones then sums the pairs into int32 exactly, as llama.cpp's
 * AVX2 dot products do.
 *
 * Layout: B (N x K, the layer's weight) is packed once into panels of 8 rows (8 output
 * columns): panel p holds, for each group of 4 k, the 4 bytes of each of its 8 rows, 32
 * bytes (one ymm register) per group, zero-padded to whole panels and groups. A row of A
 * is read 4 bytes at a time and broadcast. The kernel takes 2 rows of A and 4 panels (32
 * columns) at a time in 8 accumulators (a row's broadcast and |a| serve four panels: 3-5%
 * faster than 4 rows x 2 panels on Zen 3); the plain-C path computes the same sums in int32.
 * Every product is exact, so the result does not depend on the path, the blocking or the
 * number of threads.
 *
 * Where every element of A is known to be >= 0 (the FFN's second layer reads max(0, .)
 * quantized: [0, 127]), aiayn_int8_gemm_nonneg skips the signs: a is its own |a|, so
 * vpmaddubsw(a, b) is the same exact sum. On Zen 3 (AVX2) that is 3 vector operations for
 * 32 products instead of 4.25 (abs, sign): measured 1.4x the products a second.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define PANEL 8 /* output columns per panel */

static inline int64_t groups_of(int64_t k) { return (k + 3) / 4; }

/* B (n x k, row stride ldb) into `packed`: ceil(n / 8) panels of ceil(k / 4) groups of 32
 * bytes, then -64 times each column's sum of weights as int32 (padded to whole panels; the
 * starting sums of aiayn_int8_gemm_r7), native.int8_pack sizes it. */
void aiayn_int8_pack(const int8_t *b, int64_t ldb, int64_t n, int64_t k, int8_t *packed) {
    const int64_t g = groups_of(k), panels = (n + PANEL - 1) / PANEL;
    memset(packed, 0, (size_t)(panels * g * 32 + panels * PANEL * 4));
    int32_t *sums = (int32_t *)(packed + panels * g * 32);
    for (int64_t j = 0; j < n; j++) {
        int8_t *panel = packed + (j / PANEL) * g * 32 + (j % PANEL) * 4;
        int32_t sum = 0;
        for (int64_t kk = 0; kk < k; kk++) {
            panel[(kk / 4) * 32 + kk % 4] = b[j * ldb + kk];
            sum += b[j * ldb + kk];
        }
        sums[j] = -64 * sum;
    }
}

/* Four bytes of row `a` from k-group q (zeros past k): the broadcast operand. */
static inline int32_t group_at(const int8_t *a, int64_t q, int64_t k) {
    int32_t v = 0;
    int64_t at = 4 * q, left = k - at;
    memcpy(&v, a + at, (size_t)(left >= 4 ? 4 : left));
    return v;
}

/* Plain C: columns [c0, c0 + nc) of rows [r0, r1). */
static void gemm_plain(const int8_t *a, int64_t lda, int64_t r0, int64_t r1, int64_t k,
                       const int8_t *packed, int64_t c0, int64_t nc, int32_t *c,
                       int64_t ldc) {
    const int64_t g = groups_of(k);
    for (int64_t i = r0; i < r1; i++) {
        const int8_t *ar = a + i * lda;
        for (int64_t j = 0; j < nc; j++) {
            const int64_t col = c0 + j;
            const int8_t *panel = packed + (col / PANEL) * g * 32 + (col % PANEL) * 4;
            int32_t s = 0;
            for (int64_t q = 0; q < g; q++) {
                int8_t av[4];
                int32_t v = group_at(ar, q, k);
                memcpy(av, &v, 4);
                for (int t = 0; t < 4; t++) s += (int32_t)av[t] * (int32_t)panel[q * 32 + t];
            }
            c[(i - r0) * ldc + j] = s;
        }
    }
}

#if defined(__AVX2__)
/* One row's step: acc += pairs of |a| x sign(b, a), summed into int32 (exact, see top).
 * With VNNI (AVX-512 VNNI, AVX-VNNI) one instruction sums the four products of a group
 * straight into int32 (vpdpbusd: no int16 step, no saturation): the same sums. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define STEP(acc, au, av, b, ones) acc = _mm256_dpbusd_epi32(acc, au, _mm256_sign_epi8(b, av))
#elif defined(__AVXVNNI__)
#define STEP(acc, au, av, b, ones) acc = _mm256_dpbusd_avx_epi32(acc, au, _mm256_sign_epi8(b, av))
#else
#define STEP(acc, au, av, b, ones) \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(au, _mm256_sign_epi8(b, av)), ones))
#endif
/* A's bytes known >= 0 (nonneg): `av` is already |a| and `au` is not read (see top). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define STEPU(acc, au, av, b, ones) acc = _mm256_dpbusd_epi32(acc, av, b)
#elif defined(__AVXVNNI__)
#define STEPU(acc, au, av, b, ones) acc = _mm256_dpbusd_avx_epi32(acc, av, b)
#else
#define STEPU(acc, au, av, b, ones) \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(av, b), ones))
#endif
#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* One row's 4 bytes against a 32-byte group: signed A, or A >= 0 (a constant after
 * inlining, so each exported function gets its own loop). */
#define ROW_STEP(nonneg, acc, av, b, ones)                                    \
    do {                                                                    \
        if (nonneg) {                                                       \
            STEPU(acc, av, av, b, ones);                                    \
        } else {                                                            \
            const __m256i au_ = _mm256_abs_epi8(av);                        \
            STEP(acc, au_, av, b, ones);                                    \
        }                                                                   \
    } while (0)

/* 2 rows x 32 columns (panels p .. p + 3), all k groups whole (k % 4 == 0): the common
 * case, written out so that the 8 accumulators stay in registers (with 4 weights, the
 * row's two operands and ones: 15 of the 16). */
ALWAYS_INLINE void tile_2x4(const int8_t *const *ar, const int8_t *p, int64_t g, int32_t *c,
                            int64_t ldc, const int nonneg, const int32_t *init) {
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c02 = c00, c03 = c00;
    if (init) {
        c00 = _mm256_loadu_si256((const __m256i *)init);
        c01 = _mm256_loadu_si256((const __m256i *)(init + 8));
        c02 = _mm256_loadu_si256((const __m256i *)(init + 16));
        c03 = _mm256_loadu_si256((const __m256i *)(init + 24));
    }
    __m256i c10 = c00, c11 = c01, c12 = c02, c13 = c03;
    const int8_t *p0 = p, *p1 = p + g * 32, *p2 = p + 2 * g * 32, *p3 = p + 3 * g * 32;
    const int8_t *a0 = ar[0], *a1 = ar[1];
    for (int64_t q = 0; q < g; q++) {
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(p0 + q * 32));
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(p1 + q * 32));
        const __m256i b2 = _mm256_loadu_si256((const __m256i *)(p2 + q * 32));
        const __m256i b3 = _mm256_loadu_si256((const __m256i *)(p3 + q * 32));
        int32_t v0, v1;
        memcpy(&v0, a0 + 4 * q, 4);
        memcpy(&v1, a1 + 4 * q, 4);
        __m256i av = _mm256_set1_epi32(v0);
        if (nonneg) {
            STEPU(c00, av, av, b0, ones);
            STEPU(c01, av, av, b1, ones);
            STEPU(c02, av, av, b2, ones);
            STEPU(c03, av, av, b3, ones);
            av = _mm256_set1_epi32(v1);
            STEPU(c10, av, av, b0, ones);
            STEPU(c11, av, av, b1, ones);
            STEPU(c12, av, av, b2, ones);
            STEPU(c13, av, av, b3, ones);
        } else {
            __m256i au = _mm256_abs_epi8(av);
            STEP(c00, au, av, b0, ones);
            STEP(c01, au, av, b1, ones);
            STEP(c02, au, av, b2, ones);
            STEP(c03, au, av, b3, ones);
            av = _mm256_set1_epi32(v1);
            au = _mm256_abs_epi8(av);
            STEP(c10, au, av, b0, ones);
            STEP(c11, au, av, b1, ones);
            STEP(c12, au, av, b2, ones);
            STEP(c13, au, av, b3, ones);
        }
    }
    _mm256_storeu_si256((__m256i *)c, c00);
    _mm256_storeu_si256((__m256i *)(c + 8), c01);
    _mm256_storeu_si256((__m256i *)(c + 16), c02);
    _mm256_storeu_si256((__m256i *)(c + 24), c03);
    _mm256_storeu_si256((__m256i *)(c + ldc), c10);
    _mm256_storeu_si256((__m256i *)(c + ldc + 8), c11);
    _mm256_storeu_si256((__m256i *)(c + ldc + 16), c12);
    _mm256_storeu_si256((__m256i *)(c + ldc + 24), c13);
}

/* Any tile at the edges: rows <= 2 x (one or two panels; `cols` of their 16 columns
 * stored), a last partial k group read through group_at. */
ALWAYS_INLINE void tile_edge(const int8_t *const *ar, int rows, const int8_t *p0,
                            const int8_t *p1, int64_t g, int64_t k, int32_t *c, int64_t ldc,
                            int cols, const int nonneg, const int32_t *init) {
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;
    const int64_t full = k / 4;
    for (int r = 0; r < rows; r++) {
        __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0;
        if (init) { /* init holds whole panels: 16 values even where cols < 16 */
            acc0 = _mm256_loadu_si256((const __m256i *)init);
            if (p1) acc1 = _mm256_loadu_si256((const __m256i *)(init + 8));
        }
        for (int64_t q = 0; q < g; q++) {
            int32_t v;
            if (q < full)
                memcpy(&v, ar[r] + 4 * q, 4);
            else
                v = group_at(ar[r], q, k);
            const __m256i av = _mm256_set1_epi32(v);
            ROW_STEP(nonneg, acc0, av, _mm256_loadu_si256((const __m256i *)(p0 + q * 32)), ones);
            if (p1)
                ROW_STEP(nonneg, acc1, av, _mm256_loadu_si256((const __m256i *)(p1 + q * 32)),
                         ones);
        }
        int32_t out[16];
        _mm256_storeu_si256((__m256i *)out, acc0);
        _mm256_storeu_si256((__m256i *)(out + 8), acc1);
        memcpy(c + r * ldc, out, (size_t)cols * sizeof(int32_t));
    }
}
#endif

#if defined(__AVX2__)
ALWAYS_INLINE void gemm_avx2(const int8_t *a, int64_t lda, int64_t r0, int64_t r1, int64_t k,
                             const int8_t *packed, int64_t c0, int64_t c1, int32_t *c,
                             int64_t ldc, const int nonneg, const int32_t *init) {
    const int64_t g = groups_of(k);
    /* columns in blocks whose packed weights (16 KiB) stay in L1 while every row block
     * passes over them; the rows (M x k bytes) are read again per block, from L2 */
    int64_t nb = (16384 / (g * 32 * 4 * PANEL)) * 4 * PANEL;
    if (nb < 4 * PANEL) nb = 4 * PANEL;
    for (int64_t jb = c0; jb < c1; jb += nb) {
    const int64_t jend = jb + nb < c1 ? jb + nb : c1;
    for (int64_t i = r0; i < r1; i += 2) {
        const int rows = (int)(r1 - i < 2 ? r1 - i : 2);
        const int8_t *ar[2];
        for (int r = 0; r < 2; r++) ar[r] = a + (i + (r < rows ? r : 0)) * lda;
        for (int64_t j = jb; j < jend; j += 4 * PANEL) {
            const int cols = (int)(jend - j < 4 * PANEL ? jend - j : 4 * PANEL);
            int32_t *cij = c + (i - r0) * ldc + (j - c0);
            if (rows == 2 && cols == 4 * PANEL && k % 4 == 0) {
                tile_2x4(ar, packed + (j / PANEL) * g * 32, g, cij, ldc, nonneg,
                         init ? init + j : NULL);
                continue;
            }
            for (int64_t h = j; h < j + cols; h += 2 * PANEL) { /* the edges, 16 at a time */
                const int hc = (int)(j + cols - h < 2 * PANEL ? j + cols - h : 2 * PANEL);
                const int8_t *p0 = packed + (h / PANEL) * g * 32;
                const int8_t *p1 = hc > PANEL ? p0 + g * 32 : NULL;
                tile_edge(ar, rows, p0, p1, g, k, cij + (h - j), ldc, hc, nonneg,
                          init ? init + h : NULL);
            }
        }
    }
    }
}
#endif

/* c (rows [r0, r1) x columns [c0, c1), row stride ldc; row r0 at c) = A x B^T for A
 * (m x k, row stride lda) and B packed by aiayn_int8_pack (n columns); c0 a multiple of
 * 8. Rows are taken from r0 so that two threads can split them. */
void aiayn_int8_gemm(const int8_t *a, int64_t lda, int64_t r0, int64_t r1, int64_t k,
                     const int8_t *packed, int64_t c0, int64_t c1, int32_t *c, int64_t ldc) {
    if (r1 <= r0 || c1 <= c0) return;
#if defined(__AVX2__)
    gemm_avx2(a, lda, r0, r1, k, packed, c0, c1, c, ldc, 0, NULL);
#else
    gemm_plain(a, lda, r0, r1, k, packed, c0, c1 - c0, c, ldc);
#endif
}

/* The same for A whose every element is >= 0 (in [0, 127]): no signs to move (see top).
 * A negative element gives a wrong sum: only for rows known non-negative. */
void aiayn_int8_gemm_nonneg(const int8_t *a, int64_t lda, int64_t r0, int64_t r1, int64_t k,
                            const int8_t *packed, int64_t c0, int64_t c1, int32_t *c,
                            int64_t ldc) {
    if (r1 <= r0 || c1 <= c0) return;
#if defined(__AVX2__)
    gemm_avx2(a, lda, r0, r1, k, packed, c0, c1, c, ldc, 1, NULL);
#else
    gemm_plain(a, lda, r0, r1, k, packed, c0, c1 - c0, c, ldc);
#endif
}

/* The plain-C path alone, whatever the build (the tests compare the two). */
void aiayn_int8_gemm_plain(const int8_t *a, int64_t lda, int64_t r0, int64_t r1, int64_t k,
                           const int8_t *packed, int64_t c0, int64_t c1, int32_t *c,
                           int64_t ldc) {
    if (r1 > r0 && c1 > c0) gemm_plain(a, lda, r0, r1, k, packed, c0, c1 - c0, c, ldc);
}

/* A quantized to 7 bits and stored with 64 added (aiayn_quantize_rows_r7: bytes a + 64 in
 * [1, 127] for a in [-63, 63]; B packed for n columns): c = (A - 64) x B^T exactly, as the
 * non-negative product started from -64 times each column's sum of weights (kept after
 * the panels by aiayn_int8_pack). The activations lose a bit against aiayn_int8_gemm's;
 * the products, at the speed of aiayn_int8_gemm_nonneg, stay exact (PyTorch's fbgemm
 * quantizes activations to 7 bits on x86 for the same reason: `reduce_range`). */
void aiayn_int8_gemm_r7(const int8_t *a, int64_t lda, int64_t r0, int64_t r1, int64_t k,
                        const int8_t *packed, int64_t n, int64_t c0, int64_t c1, int32_t *c,
                        int64_t ldc) {
    if (r1 <= r0 || c1 <= c0) return;
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int32_t *start = (const int32_t *)(packed + panels * groups_of(k) * 32);
#if defined(__AVX2__)
    gemm_avx2(a, lda, r0, r1, k, packed, c0, c1, c, ldc, 1, start);
#else
    gemm_plain(a, lda, r0, r1, k, packed, c0, c1 - c0, c, ldc);
    for (int64_t i = 0; i < r1 - r0; i++)
        for (int64_t j = 0; j < c1 - c0; j++) c[i * ldc + j] += start[c0 + j];
#endif
}
