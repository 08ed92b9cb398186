/* The small-M products' row loops, shared by linear.c and lm_head_q8.c (whose exact pass must
 * compute a row as omni_linear does, bit for bit). */
#ifndef OMNI_LINEAR_H
#define OMNI_LINEAR_H
#include "omni.h"
#include "prefetch.h"

/* ---- linear: small M ----------------------------------------------------------------------- */
/* One weight row at a time, so each thread reads its share of W as one sequential stream (on the
 * development machine one stream per core reaches ~2x the bandwidth of 8 interleaved row streams);
 * the row meets every x row while it is in registers. U independent accumulators per x row, as
 * many as the registers hold beside the weight vector (GEMV_U). */
#if NREGS >= 32
#define GEMV_U(MB) 4
#else
#define GEMV_U(MB) ((MB) <= 3 ? 4 : 2)
#endif

INLINE void gemv_row(const void *x, size_t ldx, const void *w, int dt, int K, int MB, int U,
                     float *out) {
    vf acc[4][4];
#pragma GCC unroll 4
    for (int u = 0; u < U; u++)
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++) acc[u][m] = (vf){0};
    int k = 0;
    for (; k + U * VL <= K; k += U * VL)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            vf wv = ld(w, dt, k + u * VL);
#pragma GCC unroll 4
            for (int m = 0; m < MB; m++) acc[u][m] += wv * ld(x, dt, m * ldx + k + u * VL);
        }
    for (; k + VL <= K; k += VL) {
        vf wv = ld(w, dt, k);
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++) acc[0][m] += wv * ld(x, dt, m * ldx + k);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++) {
#pragma GCC unroll 4
        for (int u = 1; u < U; u++) acc[0][m] += acc[u][m];
        float s = hsum(acc[0][m]);
        for (int kk = k; kk < K; kk++) s += ld1(w, dt, kk) * ld1(x, dt, m * ldx + kk);
        out[m] = s;
    }
}

#if defined(__AVX512BF16__)
/* bfloat16 pairs multiplied exactly and summed in float32 (vdpbf16ps): 32 weights an instruction */
INLINE void gemv_row_bf16(const uint16_t *x, size_t ldx, const uint16_t *w, int K, int MB, int U,
                          float *out) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int u = 0; u < U; u++)
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++) acc[u][m] = _mm512_setzero_ps();
    int k = 0;
    for (; k + U * 32 <= K; k += U * 32)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + u * 32);
#pragma GCC unroll 4
            for (int m = 0; m < MB; m++)
                acc[u][m] = _mm512_dpbf16_ps(acc[u][m], wv,
                                             (__m512bh)_mm512_loadu_si512(x + m * ldx + k + u * 32));
        }
    for (; k + 32 <= K; k += 32) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++)
            acc[0][m] = _mm512_dpbf16_ps(acc[0][m], wv, (__m512bh)_mm512_loadu_si512(x + m * ldx + k));
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++) {
#pragma GCC unroll 4
        for (int u = 1; u < U; u++) acc[0][m] = _mm512_add_ps(acc[0][m], acc[u][m]);
        float s = _mm512_reduce_add_ps(acc[0][m]);
        for (int kk = k; kk < K; kk++) s += ld1(w, BF16, kk) * ld1(x, BF16, m * ldx + kk);
        out[m] = s;
    }
}
#define GEMV_ROW(x, ldx, w, dt, K, MB, U, out) \
    ((dt) == BF16 ? gemv_row_bf16((const uint16_t *)(x), ldx, (const uint16_t *)(w), K, MB, U, out) \
                  : gemv_row(x, ldx, w, dt, K, MB, U, out))
#else
#define GEMV_ROW gemv_row
#endif

/* One row of W dotted with x, as a vector whose lanes still need summing (the K tail is added
 * to lane 0). */
INLINE vf row_vec(const void *x, const void *w, int dt, int K) {
    vf a0 = (vf){0}, a1 = a0, a2 = a0, a3 = a0;
    int k = 0;
#if defined(__AVX512BF16__)
    if (dt == BF16) {
        __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
        const uint16_t *xb = x, *wb = w;
#define DP(acc, i) acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(wb + (i)), \
                                          (__m512bh)_mm512_loadu_si512(xb + (i)))
        for (; k + 128 <= K; k += 128) {
            prefetch_ahead(wb + k, 256);
            DP(b0, k); DP(b1, k + 32); DP(b2, k + 64); DP(b3, k + 96);
        }
        for (; k + 32 <= K; k += 32) DP(b0, k);
#undef DP
        a0 = (vf)_mm512_add_ps(_mm512_add_ps(b0, b1), _mm512_add_ps(b2, b3));
        a1 = a2 = a3 = (vf){0};
    } else
#endif
    {
        for (; k + 4 * VL <= K; k += 4 * VL) {
            prefetch_ahead((const char *)w + k * (dt == F32 ? 4 : 2), 4 * VL * (dt == F32 ? 4 : 2));
            a0 += ld(w, dt, k) * ld(x, dt, k);
            a1 += ld(w, dt, k + VL) * ld(x, dt, k + VL);
            a2 += ld(w, dt, k + 2 * VL) * ld(x, dt, k + 2 * VL);
            a3 += ld(w, dt, k + 3 * VL) * ld(x, dt, k + 3 * VL);
        }
        for (; k + VL <= K; k += VL) a0 += ld(w, dt, k) * ld(x, dt, k);
    }
    vf v = (a0 + a1) + (a2 + a3);
    float tail = 0.f;
    for (; k < K; k++) tail += ld1(w, dt, k) * ld1(x, dt, k);
    v[0] += tail;
    return v;
}

/* One row of x: 16 rows of W at a time, their sums finished together by reduce16. */
INLINE void linear_rows_m1(const void *x, const void *w, const void *bias, void *y, int dt, int K,
                           int n0, int n1) {
    size_t es = dt == F32 ? 4 : 2;
    int n = n0;
    for (; n + VL <= n1; n += VL) {
        vf part[VL];
        for (int r = 0; r < VL; r++) part[r] = row_vec(x, (const char *)w + (size_t)(n + r) * K * es, dt, K);
        vf sums = reduce_lanes(part);
        if (bias) sums += ld(bias, dt, n);
        stv(y, dt, n, sums);
    }
    for (; n < n1; n++) {
        float v = hsum(row_vec(x, (const char *)w + (size_t)n * K * es, dt, K));
        st1(y, dt, n, v + (bias ? ld1(bias, dt, n) : 0.f));
    }
}

/* Rows [n0, n1) of W against every row of x, in groups of up to 4 (a row is still in L1 for
 * the next group). */
INLINE void linear_rows_at(const void *x, size_t ldx, const void *w, const void *bias, void *y,
                           size_t ldy, int dt, int M, int K, int n0, int n1) {
    if (M == 1) {
        linear_rows_m1(x, w, bias, y, dt, K, n0, n1);
        return;
    }
    size_t es = dt == F32 ? 4 : 2;
    float out[4];
    for (int n = n0; n < n1; n++) {
        const char *wn = (const char *)w + (size_t)n * K * es;
        float b = bias ? ld1(bias, dt, n) : 0.f;
        for (int m0 = 0; m0 < M; m0 += 4) {
            int mb = M - m0 < 4 ? M - m0 : 4;
            const char *xm = (const char *)x + (size_t)m0 * ldx * es;
            switch (mb) {
                case 1: GEMV_ROW(xm, ldx, wn, dt, K, 1, GEMV_U(1), out); break;
                case 2: GEMV_ROW(xm, ldx, wn, dt, K, 2, GEMV_U(2), out); break;
                case 3: GEMV_ROW(xm, ldx, wn, dt, K, 3, GEMV_U(3), out); break;
                default: GEMV_ROW(xm, ldx, wn, dt, K, 4, GEMV_U(4), out); break;
            }
            for (int m = 0; m < mb; m++) st1(y, dt, (size_t)(m0 + m) * ldy + n, out[m] + b);
        }
    }
}
/* linear_rows_at with the prefetch target known inside (prefetch.h) */
INLINE void linear_rows(const void *x, size_t ldx, const void *w, const void *bias, void *y,
                        size_t ldy, int dt, int M, int K, int n0, int n1) {
    WITH_PREFETCH_TARGET(linear_rows_at(x, ldx, w, bias, y, ldy, dt, M, K, n0, n1););
}

#endif
