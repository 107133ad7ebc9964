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

#ifdef VW
/* The scores of one float query (dk floats; dk a multiple of VW, at most 128) with VW keys
 * rows[0..VW) of type T, converted as they are read (callers repeat a row for the lanes
 * they do not use): the query held in registers (AVX-512) or read from L1 (AVX2 has 16),
 * each key's products summed in one chain, the VW chains independent, their sums taken
 * together (vsum). */
INLINE vf NAME(scoresv)(const float *q, const T *const *rows, const int dk) {
    vf qv[128 / VW], part[VW];
    for (int c = 0; c < 128 / VW; c++)
        if (VW * c < dk) qv[c] = VLOAD(q + VW * c);
    for (int i = 0; i < VW; i++) {
        vf acc = VZERO();
        for (int c = 0; c < 128 / VW; c++)
            if (VW * c < dk) acc = VFMA(qv[c], LOADV(rows[i] + VW * c), acc);
        part[i] = acc;
    }
    return vsum(part);
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
#ifdef VW
        if (dk % VW == 0 && dk <= 128) {
            /* VW positions at a time: their scores summed together (vsum) */
            const vf vscale = VSET1(scale);
            for (int64_t i0 = 0; i0 < t; i0 += VW) {
                int n = t - i0 < VW ? (int)(t - i0) : VW;
                const T *krow[VW], *rows[VW];
                for (int i = 0; i < n; i++) {
                    krow[i] = pos[i0 + i] + p[i0 + i] * ld + k_off;
                    /* the values, read after the softmax */
                    const char *vrow = (const char *)(krow[i] - k_off + v_off);
                    for (int64_t b = 0; b < (int64_t)(H * dv * sizeof(T)); b += 64)
                        __builtin_prefetch(vrow + b);
                }
                for (int h = 0; h < H; h++) {
                    for (int i = 0; i < VW; i++) rows[i] = krow[i < n ? i : 0] + h * dk;
                    vf sc = VMUL(NAME(scoresv)(qf + h * dk, rows, dk), vscale);
                    VSTORE_N(s + h * t + i0, sc, n);
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
#ifdef VW
        if (dv % VW == 0) {
            /* VW positions at a time; the output's vectors (all heads: one run of H*dv)
             * kept in registers, eight at a time, so that eight chains of products
             * overlap instead of each waiting for the last */
            const int nv = H * dv / VW;
            for (int64_t i0 = 0; i0 < t; i0 += VW) {
                int n = t - i0 < VW ? (int)(t - i0) : VW;
                const T *vrow[VW];
                for (int i = 0; i < n; i++) vrow[i] = pos[i0 + i] + p[i0 + i] * ld + v_off;
                for (int v0 = 0; v0 < nv; v0 += 8) {
                    vf x[8];
                    const float *w[8];
                    for (int v = 0; v < 8; v++)
                        if (v0 + v < nv) {
                            x[v] = VLOAD(acc + VW * (v0 + v));
                            w[v] = s + (VW * (v0 + v) / dv) * t + i0;  /* its head's */
                        }
                    for (int i = 0; i < n; i++)
                        for (int v = 0; v < 8; v++)
                            if (v0 + v < nv)
                                x[v] = VFMA(VSET1(w[v][i]), LOADV(vrow[i] + VW * (v0 + v)),
                                            x[v]);
                    for (int v = 0; v < 8; v++)
                        if (v0 + v < nv) VSTORE(acc + VW * (v0 + v), x[v]);
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
#if defined(VW) && !T_IS_FLOAT
    float kbuf[VW * 128];  /* VW keys (or values) as floats: the vector paths take d <= 128 */
#endif
    for (int64_t a = a0; a < a1; a++) {
        const uint8_t *msk = mask + a * mask_ld;
        for (int h = 0; h < H; h++) {
            const T *kb = k + (a * H + h) * S * dk;
            const T *vb = v + (a * H + h) * S * dv;
            for (int64_t j = 0; j < g; j++)
                NAME(load)(qf + j * dk, q + (a * g + j) * q_ld + (int64_t)h * dk, dk);
#ifdef VW
            if (dk % VW == 0 && dk <= 128) {
                /* VW keys at a time, converted once for the g queries (to floats, hence
                 * the float instantiation's scoresv); masked ones after */
                const vf vscale = VSET1(scale);
                for (int64_t i0 = 0; i0 < S; i0 += VW) {
                    int n = S - i0 < VW ? (int)(S - i0) : VW;
                    const float *rows[VW];
#if T_IS_FLOAT
                    /* float keys are read where they are: no copy */
                    for (int i = 0; i < VW; i++)
                        rows[i] = (const float *)kb + (i0 + (i < n ? i : 0)) * dk;
#else
                    for (int i = 0; i < n; i++) NAME(load)(kbuf + i * dk, kb + (i0 + i) * dk, dk);
                    for (int i = 0; i < VW; i++) rows[i] = kbuf + (i < n ? i : 0) * dk;
#endif
                    for (int64_t j = 0; j < g; j++) {
                        vf sc = VMUL(scoresv_f32(qf + j * dk, rows, dk), vscale);
                        VSTORE_N(s + j * S + i0, sc, n);
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
#ifdef VW
            if (dv % VW == 0 && dv <= 8 * VW) {
                /* VW keys at a time, converted once; a query's output vectors (up to 8)
                 * kept in registers over them, their chains of products overlapping;
                 * masked keys skipped, as below */
                const int nv = dv / VW;
                for (int64_t i0 = 0; i0 < S; i0 += VW) {
                    int n = S - i0 < VW ? (int)(S - i0) : VW;
#if T_IS_FLOAT
                    const float *vals = (const float *)vb + i0 * dv;  /* read in place */
#else
                    const float *vals = kbuf;
                    for (int i = 0; i < n; i++)
                        if (msk[i0 + i]) NAME(load)(kbuf + i * dv, vb + (i0 + i) * dv, dv);
#endif
                    for (int64_t j = 0; j < g; j++) {
                        const float *w = s + j * S + i0;
                        vf x[8];
                        for (int v = 0; v < 8; v++)
                            if (v < nv) x[v] = VLOAD(acc + j * dv + VW * v);
                        for (int i = 0; i < n; i++) {
                            if (!msk[i0 + i]) continue;
                            vf wi = VSET1(w[i]);
                            for (int v = 0; v < 8; v++)
                                if (v < nv) x[v] = VFMA(wi, VLOAD(vals + i * dv + VW * v), x[v]);
                        }
                        for (int v = 0; v < 8; v++)
                            if (v < nv) VSTORE(acc + j * dv + VW * v, x[v]);
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
