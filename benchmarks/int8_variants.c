/* How many vector operations an exact int8 product needs on an AVX2-only CPU: the tile
 * csrc/int8_gemm.c had (4 rows x 16 columns, k in groups of 4; 2 x 32 since) in five
 * variants, timed alone.
 *
 *     cc -O3 -mavx2 -mfma -o /tmp/int8_variants benchmarks/int8_variants.c
 *     for v in 0 1 2 3 4; do /tmp/int8_variants 256 8000 $v; done   # K N variant
 *
 * v0  aiayn_int8_gemm: vpmaddubsw(|a|, sign(b, a)), vpmaddwd by ones, vpaddd (exact)
 * v1  v0 with |a| read from a second buffer (no vpabsb in the loop)
 * v2  a >= 0: vpmaddubsw(a, b) without signs (aiayn_int8_gemm_nonneg; exact for a ReLU's
 *     output, and the op count of CTranslate2's saturating u8 x s8 kernel)
 * v3  v1 with two groups summed in int16 before vpmaddwd (exact only where the weights
 *     are small enough: an upper bound of that trick, not a kernel)
 * v4  int16 operands, vpmaddwd (exact; weights at twice the bytes)
 * M = 64 rows (a batch of 16 at beam 4). Operands are random; the timings do not depend
 * on the values. docs/experiments/2026-12-06-int8-relu-products.md has the figures.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
#define STEP(acc, au, av, b) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(au, _mm256_sign_epi8(b, av)), ones))
#define STEPU(acc, au, b) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(au, b), ones))
/* variant 0: current */
static void t0(const int8_t*const*ar,const int8_t*p0,const int8_t*p1,int64_t g,int32_t*c,int64_t ldc){
 const __m256i ones=_mm256_set1_epi16(1);
 __m256i c00=_mm256_setzero_si256(),c01=c00,c10=c00,c11=c00,c20=c00,c21=c00,c30=c00,c31=c00;
 const int8_t*a0=ar[0],*a1=ar[1],*a2=ar[2],*a3=ar[3];
 for(int64_t q=0;q<g;q++){
  const __m256i b0=_mm256_loadu_si256((const __m256i*)(p0+q*32)),b1=_mm256_loadu_si256((const __m256i*)(p1+q*32));
  int32_t v0,v1,v2,v3;memcpy(&v0,a0+4*q,4);memcpy(&v1,a1+4*q,4);memcpy(&v2,a2+4*q,4);memcpy(&v3,a3+4*q,4);
  __m256i av=_mm256_set1_epi32(v0),au=_mm256_abs_epi8(av);STEP(c00,au,av,b0);STEP(c01,au,av,b1);
  av=_mm256_set1_epi32(v1),au=_mm256_abs_epi8(av);STEP(c10,au,av,b0);STEP(c11,au,av,b1);
  av=_mm256_set1_epi32(v2),au=_mm256_abs_epi8(av);STEP(c20,au,av,b0);STEP(c21,au,av,b1);
  av=_mm256_set1_epi32(v3),au=_mm256_abs_epi8(av);STEP(c30,au,av,b0);STEP(c31,au,av,b1);}
 _mm256_storeu_si256((__m256i*)c,c00);_mm256_storeu_si256((__m256i*)(c+8),c01);
 _mm256_storeu_si256((__m256i*)(c+ldc),c10);_mm256_storeu_si256((__m256i*)(c+ldc+8),c11);
 _mm256_storeu_si256((__m256i*)(c+2*ldc),c20);_mm256_storeu_si256((__m256i*)(c+2*ldc+8),c21);
 _mm256_storeu_si256((__m256i*)(c+3*ldc),c30);_mm256_storeu_si256((__m256i*)(c+3*ldc+8),c31);}
/* variant 1: |a| precomputed in a second buffer (ab) */
static void t1(const int8_t*const*ar,const int8_t*const*ab,const int8_t*p0,const int8_t*p1,int64_t g,int32_t*c,int64_t ldc){
 const __m256i ones=_mm256_set1_epi16(1);
 __m256i c00=_mm256_setzero_si256(),c01=c00,c10=c00,c11=c00,c20=c00,c21=c00,c30=c00,c31=c00;
 for(int64_t q=0;q<g;q++){
  const __m256i b0=_mm256_loadu_si256((const __m256i*)(p0+q*32)),b1=_mm256_loadu_si256((const __m256i*)(p1+q*32));
  int32_t v,u;
#define ROW(r,ca,cb) memcpy(&v,ar[r]+4*q,4);memcpy(&u,ab[r]+4*q,4);{__m256i av=_mm256_set1_epi32(v),au=_mm256_set1_epi32(u);STEP(ca,au,av,b0);STEP(cb,au,av,b1);}
  ROW(0,c00,c01) ROW(1,c10,c11) ROW(2,c20,c21) ROW(3,c30,c31)
 }
 _mm256_storeu_si256((__m256i*)c,c00);_mm256_storeu_si256((__m256i*)(c+8),c01);
 _mm256_storeu_si256((__m256i*)(c+ldc),c10);_mm256_storeu_si256((__m256i*)(c+ldc+8),c11);
 _mm256_storeu_si256((__m256i*)(c+2*ldc),c20);_mm256_storeu_si256((__m256i*)(c+2*ldc+8),c21);
 _mm256_storeu_si256((__m256i*)(c+3*ldc),c30);_mm256_storeu_si256((__m256i*)(c+3*ldc+8),c31);}
/* variant 2: nonneg a, no sign */
static void t2(const int8_t*const*ar,const int8_t*p0,const int8_t*p1,int64_t g,int32_t*c,int64_t ldc){
 const __m256i ones=_mm256_set1_epi16(1);
 __m256i c00=_mm256_setzero_si256(),c01=c00,c10=c00,c11=c00,c20=c00,c21=c00,c30=c00,c31=c00;
 for(int64_t q=0;q<g;q++){
  const __m256i b0=_mm256_loadu_si256((const __m256i*)(p0+q*32)),b1=_mm256_loadu_si256((const __m256i*)(p1+q*32));
  int32_t v;
#define ROWU(r,ca,cb) memcpy(&v,ar[r]+4*q,4);{__m256i au=_mm256_set1_epi32(v);STEPU(ca,au,b0);STEPU(cb,au,b1);}
  ROWU(0,c00,c01) ROWU(1,c10,c11) ROWU(2,c20,c21) ROWU(3,c30,c31)
 }
 _mm256_storeu_si256((__m256i*)c,c00);_mm256_storeu_si256((__m256i*)(c+8),c01);
 _mm256_storeu_si256((__m256i*)(c+ldc),c10);_mm256_storeu_si256((__m256i*)(c+ldc+8),c11);
 _mm256_storeu_si256((__m256i*)(c+2*ldc),c20);_mm256_storeu_si256((__m256i*)(c+2*ldc+8),c21);
 _mm256_storeu_si256((__m256i*)(c+3*ldc),c30);_mm256_storeu_si256((__m256i*)(c+3*ldc+8),c31);}
/* variant 3: fold two groups in int16 (upper bound of the fold trick; signed) */
static void t3(const int8_t*const*ar,const int8_t*const*ab,const int8_t*p0,const int8_t*p1,int64_t g,int32_t*c,int64_t ldc){
 const __m256i ones=_mm256_set1_epi16(1);
 __m256i c00=_mm256_setzero_si256(),c01=c00,c10=c00,c11=c00,c20=c00,c21=c00,c30=c00,c31=c00;
 for(int64_t q=0;q<g;q+=2){
  const __m256i b0=_mm256_loadu_si256((const __m256i*)(p0+q*32)),b1=_mm256_loadu_si256((const __m256i*)(p1+q*32));
  const __m256i d0=_mm256_loadu_si256((const __m256i*)(p0+q*32+32)),d1=_mm256_loadu_si256((const __m256i*)(p1+q*32+32));
  int32_t v,u,v2,u2;
#define ROWF(r,ca,cb) memcpy(&v,ar[r]+4*q,4);memcpy(&u,ab[r]+4*q,4);memcpy(&v2,ar[r]+4*q+4,4);memcpy(&u2,ab[r]+4*q+4,4);{\
 __m256i av=_mm256_set1_epi32(v),au=_mm256_set1_epi32(u),av2=_mm256_set1_epi32(v2),au2=_mm256_set1_epi32(u2);\
 ca=_mm256_add_epi32(ca,_mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(au,_mm256_sign_epi8(b0,av)),_mm256_maddubs_epi16(au2,_mm256_sign_epi8(d0,av2))),ones));\
 cb=_mm256_add_epi32(cb,_mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(au,_mm256_sign_epi8(b1,av)),_mm256_maddubs_epi16(au2,_mm256_sign_epi8(d1,av2))),ones));}
  ROWF(0,c00,c01) ROWF(1,c10,c11) ROWF(2,c20,c21) ROWF(3,c30,c31)
 }
 _mm256_storeu_si256((__m256i*)c,c00);_mm256_storeu_si256((__m256i*)(c+8),c01);
 _mm256_storeu_si256((__m256i*)(c+ldc),c10);_mm256_storeu_si256((__m256i*)(c+ldc+8),c11);
 _mm256_storeu_si256((__m256i*)(c+2*ldc),c20);_mm256_storeu_si256((__m256i*)(c+2*ldc+8),c21);
 _mm256_storeu_si256((__m256i*)(c+3*ldc),c30);_mm256_storeu_si256((__m256i*)(c+3*ldc+8),c31);}
/* int16 operands: panel layout per k-pair p: 8 cols x 2 int16 = 32 bytes */
static void t4(const int16_t*const*ar,const int16_t*p0,const int16_t*p1,int64_t np,int32_t*c,int64_t ldc){
 __m256i c00=_mm256_setzero_si256(),c01=c00,c10=c00,c11=c00,c20=c00,c21=c00,c30=c00,c31=c00;
 for(int64_t p=0;p<np;p++){
  const __m256i b0=_mm256_loadu_si256((const __m256i*)(p0+p*16)),b1=_mm256_loadu_si256((const __m256i*)(p1+p*16));
  int32_t v; __m256i av;
#define R(r,ca,cb) memcpy(&v,ar[r]+2*p,4);av=_mm256_set1_epi32(v);ca=_mm256_add_epi32(ca,_mm256_madd_epi16(av,b0));cb=_mm256_add_epi32(cb,_mm256_madd_epi16(av,b1));
  R(0,c00,c01) R(1,c10,c11) R(2,c20,c21) R(3,c30,c31)
 }
 _mm256_storeu_si256((__m256i*)c,c00);_mm256_storeu_si256((__m256i*)(c+8),c01);
 _mm256_storeu_si256((__m256i*)(c+ldc),c10);_mm256_storeu_si256((__m256i*)(c+ldc+8),c11);
 _mm256_storeu_si256((__m256i*)(c+2*ldc),c20);_mm256_storeu_si256((__m256i*)(c+2*ldc+8),c21);
 _mm256_storeu_si256((__m256i*)(c+3*ldc),c30);_mm256_storeu_si256((__m256i*)(c+3*ldc+8),c31);}
int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s K N variant(0-4)\n", argv[0]);
        return 2;
    }
    const int M = 64, K = atoi(argv[1]), N = atoi(argv[2]), v = atoi(argv[3]);
    const int64_t g = K / 4, np = K / 2;
    int8_t *A = aligned_alloc(64, M * K), *AB = aligned_alloc(64, M * K);
    int8_t *P = aligned_alloc(64, (size_t)N * K);
    int16_t *A16 = aligned_alloc(64, 2 * M * K), *P16 = aligned_alloc(64, (size_t)N * K * 2);
    int32_t *C = aligned_alloc(64, 4 * (size_t)M * N);
    for (int i = 0; i < M * K; i++) A16[i] = A[i] = rand() % 255 - 127, AB[i] = abs(A[i]);
    for (long i = 0; i < (long)N * K; i++) P16[i] = P[i] = rand() % 255 - 127;
    /* column blocks of ~16 KiB of weights (32 KiB for int16), as the kernel */
    int64_t nb = v == 4 ? (32768 / (np * 32 * 16)) * 16 : (16384 / (g * 32 * 16)) * 16;
    if (nb < 16) nb = 16;
    double best = 1e9;
    for (int rep = 0; rep < 7; rep++) {
        const int R = 2000000000LL / ((long)M * K * N) + 1;
        const double t = now();
        for (int r = 0; r < R; r++)
            for (int64_t jb = 0; jb < N; jb += nb)
                for (int i = 0; i < M; i += 4) {
                    const int8_t *ar[4], *ab[4];
                    const int16_t *a16[4];
                    for (int x = 0; x < 4; x++)
                        ar[x] = A + (i + x) * K, ab[x] = AB + (i + x) * K, a16[x] = A16 + (i + x) * K;
                    for (int64_t j = jb; j < jb + nb && j + 16 <= N; j += 16) {
                        int32_t *cij = C + i * N + j;
                        if (v == 4) {
                            const int16_t *p0 = P16 + (j / 8) * np * 16;
                            t4(a16, p0, p0 + np * 16, np, cij, N);
                            continue;
                        }
                        const int8_t *p0 = P + (j / 8) * g * 32, *p1 = p0 + g * 32;
                        if (v == 0) t0(ar, p0, p1, g, cij, N);
                        else if (v == 1) t1(ar, ab, p0, p1, g, cij, N);
                        else if (v == 2) t2(ab, p0, p1, g, cij, N);
                        else t3(ar, ab, p0, p1, g, cij, N);
                    }
                }
        const double dt = (now() - t) / R;
        if (dt < best) best = dt;
    }
    printf("M=%d K=%d N=%d v%d: %.1f us, %.1f GMAC/s\n", M, K, N, v, best * 1e6,
           (double)M * K * N / best / 1e9);
    return 0;
}
