/* The decoding attention kernels for one element type T (included by decode_attention.c
 * with T, SUFFIX, LOAD (T -> float), STORE (float -> T) and T_IS_FLOAT (1 when T is float:
 * rows are then read in place instead of converted into a buffer) defined). */

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define NAME(f) CAT(f, SUFFIX)
#define INLINE static inline __attribute__((always_inline))

INLINE float NAME(dot)(const float *q, const T *k, int d) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int j = 0; j < d; j++) s += q[j] * LOAD(k[j]);
    return s;
}

INLINE void NAME(axpy)(float *acc, float w, const T *v, int d) {
#pragma omp simd
    for (int j = 0; j < d; j++) acc[j] += w * LOAD(v[j]);
}

INLINE void NAME(load)(float *dst, const T *src, int d) {
#pragma omp simd
    for (int j = 0; j < d; j++) dst[j] = LOAD(src[j]);
}

INLINE void NAME(store)(T *dst, const float *acc, float inv, int d) {
#pragma omp simd
    for (int j = 0; j < d; j++) dst[j] = STORE(acc[j] * inv);
}

#ifdef __AVX512F__
/* The scores of one float query (dk floats; dk a multiple of 16, at most 128) with 16 keys
 * rows[0..16) of type T, converted as they are read (callers repeat a row for the lanes
 * they do not use): the query held in registers, each key's products summed in one chain,
 * the 16 chains independent, their sums taken together (sum16). */
INLINE __m512 NAME(scores16)(const float *q, const T *const *rows, const int dk) {
    __m512 qv[8], part[16];
    for (int c = 0; c < 8; c++)
        if (16 * c < dk) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int i = 0; i < 16; i++) {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < 8; c++)
            if (16 * c < dk) acc = _mm512_fmadd_ps(qv[c], LOAD16(rows[i] + 16 * c), acc);
        part[i] = acc;
    }
    return sum16(part);
}
#endif

INLINE void NAME(cached)(const T *q, int64_t q_ld, const T *const *pos, int64_t ld,
                         int64_t k_off, int64_t v_off, const int64_t *path, int64_t path_ld,
                         int64_t t, int64_t r0, int64_t r1, int H, const int dk, const int dv,
                         float scale, float *s, T *out, int64_t out_ld) {
    /* Row by row, all heads at once: a position's keys (then values) of all heads are one
     * contiguous run of its table row, read once. s: (H, t) scores, then weights. */
    float qf[MAX_ROW], acc[MAX_ROW], inv[MAX_HEADS];
    for (int64_t r = r0; r < r1; r++) {
        const int64_t *p = path + r * path_ld;
        NAME(load)(qf, q + r * q_ld, H * dk);
#ifdef __AVX512F__
        if (dk % 16 == 0 && dk <= 128) {
            /* 16 positions at a time: their scores summed together (sum16) */
            const __m512 vscale = _mm512_set1_ps(scale);
            for (int64_t i0 = 0; i0 < t; i0 += 16) {
                int n = t - i0 < 16 ? (int)(t - i0) : 16;
                const T *krow[16], *rows[16];
                for (int i = 0; i < n; i++) {
                    krow[i] = pos[i0 + i] + p[i0 + i] * ld + k_off;
                    /* the values, read after the softmax */
                    const char *vrow = (const char *)(krow[i] - k_off + v_off);
                    for (int64_t b = 0; b < (int64_t)(H * dv * sizeof(T)); b += 64)
                        __builtin_prefetch(vrow + b);
                }
                for (int h = 0; h < H; h++) {
                    for (int i = 0; i < 16; i++) rows[i] = krow[i < n ? i : 0] + h * dk;
                    __m512 sc = _mm512_mul_ps(NAME(scores16)(qf + h * dk, rows, dk), vscale);
                    _mm512_mask_storeu_ps(s + h * t + i0, (__mmask16)((1u << n) - 1u), sc);
                }
            }
        } else
#endif
        for (int64_t i = 0; i < t; i++) {
            if (i + PREFETCH < t) {
                const char *next = (const char *)(pos[i + PREFETCH] + p[i + PREFETCH] * ld);
                for (int64_t b = 0; b < (int64_t)(H * (dk + dv) * sizeof(T)); b += 64)
                    __builtin_prefetch(next + k_off * (int64_t)sizeof(T) + b);
            }
            const T *krow = pos[i] + p[i] * ld + k_off;
            for (int h = 0; h < H; h++)
                s[h * t + i] = NAME(dot)(qf + h * dk, krow + h * dk, dk) * scale;
        }
        softmax_rows(s, H, t, inv);
        for (int j = 0; j < H * dv; j++) acc[j] = 0.0f;
#ifdef __AVX512F__
        if (dv % 16 == 0) {
            /* 16 positions at a time; the output's vectors (all heads: one run of H*dv)
             * kept in registers, eight at a time, so that eight chains of products
             * overlap instead of each waiting for the last */
            const int nv = H * dv / 16;
            for (int64_t i0 = 0; i0 < t; i0 += 16) {
                int n = t - i0 < 16 ? (int)(t - i0) : 16;
                const T *vrow[16];
                for (int i = 0; i < n; i++) vrow[i] = pos[i0 + i] + p[i0 + i] * ld + v_off;
                for (int v0 = 0; v0 < nv; v0 += 8) {
                    __m512 x[8];
                    const float *w[8];
                    for (int v = 0; v < 8; v++)
                        if (v0 + v < nv) {
                            x[v] = _mm512_loadu_ps(acc + 16 * (v0 + v));
                            w[v] = s + (16 * (v0 + v) / dv) * t + i0;  /* its head's */
                        }
                    for (int i = 0; i < n; i++)
                        for (int v = 0; v < 8; v++)
                            if (v0 + v < nv)
                                x[v] = _mm512_fmadd_ps(_mm512_set1_ps(w[v][i]),
                                                       LOAD16(vrow[i] + 16 * (v0 + v)), x[v]);
                    for (int v = 0; v < 8; v++)
                        if (v0 + v < nv) _mm512_storeu_ps(acc + 16 * (v0 + v), x[v]);
                }
            }
        } else
#endif
        for (int64_t i = 0; i < t; i++) {
            const T *vrow = pos[i] + p[i] * ld + v_off;
            for (int h = 0; h < H; h++)
                NAME(axpy)(acc + h * dv, s[h * t + i], vrow + h * dv, dv);
        }
        for (int h = 0; h < H; h++)
            NAME(store)(out + r * out_ld + h * dv, acc + h * dv, inv[h], dv);
    }
}

/* Rows [r0, r1). q: (R, H*dk), row stride q_ld. pos[i]: position i's table, row stride
 * ld; head h's key at columns k_off + h*dk, its value at v_off + h*dv (the K columns
 * precede the V columns). path: (R, t), row stride path_ld. s: H*t floats of scratch.
 * out: (R, H*dv), row stride out_ld. */
void NAME(aiayn_cached_attention)(const T *q, int64_t q_ld, const T *const *pos, int64_t ld,
                                  int64_t k_off, int64_t v_off, const int64_t *path,
                                  int64_t path_ld, int64_t t, int64_t r0, int64_t r1, int H,
                                  int dk, int dv, float scale, float *s, T *out,
                                  int64_t out_ld) {
#define CALL(DK, DV) NAME(cached)(q, q_ld, pos, ld, k_off, v_off, path, path_ld, t, r0, r1, \
                                  H, DK, DV, scale, s, out, out_ld)
    /* the common head sizes as constants: loops the compiler unrolls into whole vectors */
    if (dk == 64 && dv == 64) CALL(64, 64);
    else if (dk == 32 && dv == 32) CALL(32, 32);
    else if (dk == 128 && dv == 128) CALL(128, 128);
    else CALL(dk, dv);
#undef CALL
}

INLINE void NAME(memory)(const T *q, int64_t q_ld, const T *k, const T *v,
                         const uint8_t *mask, int64_t mask_ld, int64_t a0, int64_t a1,
                         int64_t g, int64_t S, int H, const int dk, const int dv, float scale,
                         float *s, T *out, int64_t out_ld) {
    /* Sentence by sentence and head by head, its g queries at once: each key and value
     * row is converted once for g products. s: (g, S) scores, then weights. */
    float qf[MAX_ROW], acc[MAX_ROW], inv[MAX_HEADS], row[MAX_D];
#if defined(__AVX512F__) && !T_IS_FLOAT
    float kbuf[16 * 128];  /* 16 keys (or values) as floats: the AVX-512 paths take d <= 128 */
#endif
    for (int64_t a = a0; a < a1; a++) {
        const uint8_t *msk = mask + a * mask_ld;
        for (int h = 0; h < H; h++) {
            const T *kb = k + (a * H + h) * S * dk;
            const T *vb = v + (a * H + h) * S * dv;
            for (int64_t j = 0; j < g; j++)
                NAME(load)(qf + j * dk, q + (a * g + j) * q_ld + (int64_t)h * dk, dk);
#ifdef __AVX512F__
            if (dk % 16 == 0 && dk <= 128) {
                /* 16 keys at a time, converted once for the g queries (to floats, hence
                 * the float instantiation's scores16); masked ones after */
                const __m512 vscale = _mm512_set1_ps(scale);
                for (int64_t i0 = 0; i0 < S; i0 += 16) {
                    int n = S - i0 < 16 ? (int)(S - i0) : 16;
                    const float *rows[16];
#if T_IS_FLOAT
                    /* float keys are read where they are: no copy */
                    for (int i = 0; i < 16; i++)
                        rows[i] = (const float *)kb + (i0 + (i < n ? i : 0)) * dk;
#else
                    for (int i = 0; i < n; i++) NAME(load)(kbuf + i * dk, kb + (i0 + i) * dk, dk);
                    for (int i = 0; i < 16; i++) rows[i] = kbuf + (i < n ? i : 0) * dk;
#endif
                    for (int64_t j = 0; j < g; j++) {
                        __m512 sc = _mm512_mul_ps(scores16_f32(qf + j * dk, rows, dk), vscale);
                        _mm512_mask_storeu_ps(s + j * S + i0, (__mmask16)((1u << n) - 1u), sc);
                    }
                }
                for (int64_t i = 0; i < S; i++)
                    if (!msk[i])
                        for (int64_t j = 0; j < g; j++) s[j * S + i] = -INFINITY;
            } else
#endif
            for (int64_t i = 0; i < S; i++) {
                if (!msk[i]) {
                    for (int64_t j = 0; j < g; j++) s[j * S + i] = -INFINITY;
                    continue;
                }
                NAME(load)(row, kb + i * dk, dk);
                for (int64_t j = 0; j < g; j++)
                    s[j * S + i] = dot_ff(qf + j * dk, row, dk) * scale;
            }
            softmax_rows(s, g, S, inv);
            for (int j = 0; j < g * dv; j++) acc[j] = 0.0f;
#ifdef __AVX512F__
            if (dv % 16 == 0 && dv <= 128) {
                /* 16 keys at a time, converted once; a query's output vectors (up to 8)
                 * kept in registers over them, their chains of products overlapping;
                 * masked keys skipped, as below */
                const int nv = dv / 16;
                for (int64_t i0 = 0; i0 < S; i0 += 16) {
                    int n = S - i0 < 16 ? (int)(S - i0) : 16;
#if T_IS_FLOAT
                    const float *vals = (const float *)vb + i0 * dv;  /* read in place */
#else
                    const float *vals = kbuf;
                    for (int i = 0; i < n; i++)
                        if (msk[i0 + i]) NAME(load)(kbuf + i * dv, vb + (i0 + i) * dv, dv);
#endif
                    for (int64_t j = 0; j < g; j++) {
                        const float *w = s + j * S + i0;
                        __m512 x[8];
                        for (int v = 0; v < 8; v++)
                            if (v < nv) x[v] = _mm512_loadu_ps(acc + j * dv + 16 * v);
                        for (int i = 0; i < n; i++) {
                            if (!msk[i0 + i]) continue;
                            __m512 wi = _mm512_set1_ps(w[i]);
                            for (int v = 0; v < 8; v++)
                                if (v < nv)
                                    x[v] = _mm512_fmadd_ps(
                                        wi, _mm512_loadu_ps(vals + i * dv + 16 * v), x[v]);
                        }
                        for (int v = 0; v < 8; v++)
                            if (v < nv) _mm512_storeu_ps(acc + j * dv + 16 * v, x[v]);
                    }
                }
            } else
#endif
            for (int64_t i = 0; i < S; i++) {
                if (!msk[i]) continue;
                NAME(load)(row, vb + i * dv, dv);
                for (int64_t j = 0; j < g; j++) axpy_ff(acc + j * dv, s[j * S + i], row, dv);
            }
            for (int64_t j = 0; j < g; j++)
                NAME(store)(out + (a * g + j) * out_ld + (int64_t)h * dv, acc + j * dv, inv[j],
                            dv);
        }
    }
}

/* Sentences [a0, a1), each with rows a*g .. a*g+g-1 of q (R, H*dk), row stride q_ld.
 * k: (A, H, S, dk), v: (A, H, S, dv), contiguous. mask: sentence a's S bytes at
 * mask + a*mask_ld, nonzero = may attend (at least one). s: g*S floats of scratch. */
void NAME(aiayn_memory_attention)(const T *q, int64_t q_ld, const T *k, const T *v,
                                  const uint8_t *mask, int64_t mask_ld, int64_t a0,
                                  int64_t a1, int64_t g, int64_t S, int H, int dk, int dv,
                                  float scale, float *s, T *out, int64_t out_ld) {
#define CALL(DK, DV) NAME(memory)(q, q_ld, k, v, mask, mask_ld, a0, a1, g, S, H, DK, DV, \
                                  scale, s, out, out_ld)
    if (dk == 64 && dv == 64) CALL(64, 64);
    else if (dk == 32 && dv == 32) CALL(32, 32);
    else if (dk == 128 && dv == 128) CALL(128, 128);
    else CALL(dk, dv);
#undef CALL
}

#undef INLINE
#undef NAME
#undef CAT
#undef CAT_
