/* omni_qx8_rows: the int8-activation product for Q4_0, Q8_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and
 * Q6_K weights repacked in groups of 8 rows (Q4_0X8 ... Q6_KX8: quant_blocks.h; the K-quants'
 * group functions are quant_kx8.c's), the layout llama.cpp's repacked CPU buffers use the idea of:
 * one 32-bit lane per weight row, so a register of codes meets 4 values of x broadcast to
 * every lane and the 8 rows' sums come out in 8 lanes, scaled by the 8 rows' d at once; no
 * horizontal sums, and a quarter to a half of the per-row path's instructions a weight. Per row
 * the sum is the one quant_q8.c's per-row path computes, exact in integers per block
 * (Q4_0: Sum q * x_q - 8 * Sum x_q), then d_w * d_x once per block (float32); Q4_1's and Q5_1's
 * minimum m adds m times x's rounded block sum.
 *
 * Products: AVX2's vpmaddubsw (Q4_0: summed in int16 over a block, 8 pairs of at most 15 * 127
 * each, below 2^15; Q8_0: |c| times x with c's sign, widened every step) then vpmaddwd; AVX-512
 * VNNI's vpdpbusd (Q8_0 as c + 128, less 128 * Sum x_q); NEON's vmull_s8; else C. */
#include "quant_blocks.h"

#define X_CHUNK_BYTES (32 << 10)

#if defined(__AVX2__)
INLINE void q8_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8]) {
    __m256 acc[XMB];
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < X->K / 32; b++) {
        const uint8_t *blk = g + (size_t)b * 272;
        prefetch_ahead(blk, 272);
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256i c[8], u[8];  /* codes of step j; u: as unsigned (VNNI: c + 128; else |c|) */
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            c[j] = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * j));
#if defined(DPBUSD256)
            u[j] = _mm256_xor_si256(c[j], _mm256_set1_epi8((char)0x80));
#else
            u[j] = _mm256_sign_epi8(c[j], c[j]);
#endif
        }
        for (int m = 0; m < MB; m++) {
            size_t r = (size_t)(m0 + m);
            const int8_t *xb = X->q + r * X->K + 32 * b;
#if defined(DPBUSD256)
            __m256i s2[2] = {_mm256_set1_epi32(-128 * X->isum[r * (X->K / 32) + b]), _mm256_setzero_si256()};
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) s2[j & 1] = DPBUSD256(s2[j & 1], u[j], x4_at(xb + 4 * j));
            __m256i s = _mm256_add_epi32(s2[0], s2[1]);
#else
            __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {  /* |c| times x with c's sign; a pair is at most 2 * 128 * 127 */
                __m256i p = _mm256_maddubs_epi16(u[j], _mm256_sign_epi8(x4_at(xb + 4 * j), c[j]));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
            }
#endif
            __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(X->d[r * (X->K / 32) + b]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, acc[m]);
        }
    }
    for (int m = 0; m < MB; m++) _mm256_storeu_ps(out[m], acc[m]);
}
/* Q4_0X8 (neither), Q4_1X8 (has_min), Q5_0X8 (has_hi), Q5_1X8 (both): the 8 rows' sums of codes
 * times x (5-bit codes with their fifth bits), then Q4_0's or Q5_0's offset (8 or 16 times Sum x_q)
 * or each row's m times x's block sum */
INLINE void qn_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8], const int has_min,
                    const int has_hi) {
    const int bytes = 144 + 16 * has_min + 32 * has_hi, nbx = X->K / 32;
    __m256 acc[XMB];
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < nbx; b++) {
        const uint8_t *blk = g + (size_t)b * bytes, *p = blk + 16 + 16 * has_min;
        prefetch_ahead(blk, bytes);
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256 mw = has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : _mm256_setzero_ps();
        __m256i c[8];
        x8_nibbles(p, c);
        if (has_hi) x5_codes(p + 128, c);
        for (int m = 0; m < MB; m++) {
            size_t r = (size_t)(m0 + m);
            const int8_t *xb = X->q + r * X->K + 32 * b;
            __m256i s = has_hi ? x8_dot5(c, xb) : x8_nibble_dot(c, xb);
            if (!has_min) s = _mm256_add_epi32(s, _mm256_set1_epi32(-(8 << has_hi) * X->isum[r * nbx + b]));
            __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(X->d[r * nbx + b]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, acc[m]);
            if (has_min) acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(X->s32[r * nbx + b]), acc[m]);
        }
    }
    for (int m = 0; m < MB; m++) _mm256_storeu_ps(out[m], acc[m]);
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
INLINE void q8_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8]) {
    float32x4_t acc[XMB][2];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = vdupq_n_f32(0.f);
    for (int b = 0; b < X->K / 32; b++) {
        const uint8_t *blk = g + (size_t)b * 272;
        prefetch_ahead(blk, 272);
        float32x4_t dw[2] = {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)blk))),
                             vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)blk + 4)))};
        for (int m = 0; m < MB; m++) {
            size_t r = (size_t)(m0 + m);
            int32_t x4[8];
            memcpy(x4, X->q + r * X->K + 32 * b, 32);
            float d = X->d[r * (X->K / 32) + b];
            for (int h = 0; h < 2; h++) {
                int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);  /* rows 4h, 4h+1 | 4h+2, 4h+3 */
                for (int j = 0; j < 8; j++) {
                    int8x16_t cv = vld1q_s8((const int8_t *)blk + 16 + 32 * j + 16 * h);
                    int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(x4[j]));
                    lo = vpadalq_s16(lo, vmull_s8(vget_low_s8(cv), vget_low_s8(xv)));
                    hi = vpadalq_s16(hi, vmull_high_s8(cv, xv));
                }
                int32x4_t s = vpaddq_s32(lo, hi);
                acc[m][h] = vfmaq_f32(acc[m][h], vcvtq_f32_s32(s), vmulq_n_f32(dw[h], d));
            }
        }
    }
    for (int m = 0; m < MB; m++) vst1q_f32(out[m], acc[m][0]), vst1q_f32(out[m] + 4, acc[m][1]);
}
INLINE void qn_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8], const int has_min,
                    const int has_hi) {
    const int bytes = 144 + 16 * has_min + 32 * has_hi, nbx = X->K / 32;
    float32x4_t acc[XMB][2];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = vdupq_n_f32(0.f);
    for (int b = 0; b < nbx; b++) {
        const uint8_t *blk = g + (size_t)b * bytes, *p = blk + 16 + 16 * has_min;
        prefetch_ahead(blk, bytes);
        float32x4_t dw[2], mw[2];
        for (int h = 0; h < 2; h++) {
            dw[h] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)blk + 4 * h)));
            mw[h] = has_min ? vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(blk + 16) + 4 * h)))
                            : vdupq_n_f32(0.f);
        }
        int8x16_t c[8][2];
        x8_codes_neon(p, has_hi ? p + 128 : NULL, c);
        for (int m = 0; m < MB; m++) {
            size_t r = (size_t)(m0 + m);
            float d = X->d[r * nbx + b], s32 = X->s32[r * nbx + b];
            for (int h = 0; h < 2; h++) {
                int32x4_t s = x8_dot_neon(c, X->q + r * X->K + 32 * b, h, has_hi);
                if (!has_min) s = vaddq_s32(s, vdupq_n_s32(-(8 << has_hi) * X->isum[r * nbx + b]));
                acc[m][h] = vfmaq_f32(acc[m][h], vcvtq_f32_s32(s), vmulq_n_f32(dw[h], d));
                if (has_min) acc[m][h] = vfmaq_n_f32(acc[m][h], mw[h], s32);
            }
        }
    }
    for (int m = 0; m < MB; m++) vst1q_f32(out[m], acc[m][0]), vst1q_f32(out[m] + 4, acc[m][1]);
}
#else
INLINE void q8_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8]) {
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < 8; r++) out[m][r] = 0.f;
    for (int b = 0; b < X->K / 32; b++) {
        const uint8_t *blk = g + (size_t)b * 272;
        prefetch_ahead(blk, 272);
        for (int m = 0; m < MB; m++) {
            size_t row = (size_t)(m0 + m);
            const int8_t *xb = X->q + row * X->K + 32 * b;
            for (int r = 0; r < 8; r++) {
                int32_t s = 0;
                for (int j = 0; j < 8; j++)
                    for (int i = 0; i < 4; i++) s += (int8_t)blk[16 + 32 * j + 4 * r + i] * xb[4 * j + i];
                out[m][r] += (float)s * (f16_to_f32(u16_at(blk + 2 * r)) * X->d[row * (X->K / 32) + b]);
            }
        }
    }
}
INLINE void qn_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8], const int has_min,
                    const int has_hi) {
    const int bytes = 144 + 16 * has_min + 32 * has_hi, nbx = X->K / 32;
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < 8; r++) out[m][r] = 0.f;
    for (int b = 0; b < nbx; b++) {
        const uint8_t *blk = g + (size_t)b * bytes, *p = blk + 16 + 16 * has_min, *hb = has_hi ? p + 128 : NULL;
        prefetch_ahead(blk, bytes);
        for (int m = 0; m < MB; m++) {
            size_t row = (size_t)(m0 + m);
            const int8_t *xb = X->q + row * X->K + 32 * b;
            for (int r = 0; r < 8; r++) {
                int32_t s = has_min ? 0 : -(8 << has_hi) * X->isum[row * nbx + b];
                for (int c = 0; c < 4; c++)
                    for (int h = 0; h < 2; h++)
                        for (int i = 0; i < 4; i++) s += x8_code(p, hb, r, c, h, i) * xb[8 * c + 4 * h + i];
                out[m][r] += (float)s * (f16_to_f32(u16_at(blk + 2 * r)) * X->d[row * nbx + b]);
                if (has_min) out[m][r] += f16_to_f32(u16_at(blk + 16 + 2 * r)) * X->s32[row * nbx + b];
            }
        }
    }
}
#endif

GROUP_OF(q4_rows, qn_rows, 0, 0)
GROUP_OF(q41_rows, qn_rows, 1, 0)
GROUP_OF(q50_rows, qn_rows, 0, 1)
GROUP_OF(q51_rows, qn_rows, 1, 1)

ROWS_OF(q4_rows)
ROWS_OF(q8_rows)
ROWS_OF(q41_rows)
ROWS_OF(q50_rows)
ROWS_OF(q51_rows)

x8_group_fn omni_x8_group(int kind) {
    return kind == Q8_0X8 ? q8_rows_n : kind == Q4_1X8 ? q41_rows_n : kind == Q5_0X8 ? q50_rows_n
         : kind == Q5_1X8 ? q51_rows_n : kind == Q4_0X8 ? q4_rows_n
         : kind == IQ4_NLX8 || kind == IQ4_XSX8 ? omni_iq4x8_group(kind)
         : kind == Q2_KX8 || kind == Q3_KX8 ? omni_k23x8_group(kind) : omni_kx8_group(kind);
}

void omni_qx8_rows(int kind, const uint8_t *w, const xq *X, void *y, int64_t ldy, int M, int N, int dt,
                   int nthreads) {
    int64_t G = (N + 7) / 8;
    size_t group_bytes = 8 * qrow_bytes(kind, X->K);
    x8_group_fn group = omni_x8_group(kind);
    if (nthreads < 1) nthreads = 1;
    nthreads = threads_for((int64_t)N * X->K, nthreads);
    /* rows of x in chunks of about X_CHUNK_BYTES (they stay in L1 while every group meets them) */
    int mc = X_CHUNK_BYTES / X->K;
    mc = mc < XMB ? XMB : mc - mc % XMB;
#pragma omp parallel num_threads(nthreads)
    {
        int64_t g0, g1;
        thread_share(G, &g0, &g1);
        float out[XMB][8];
        for (int c0 = 0; c0 < M; c0 += mc) {
            int c1 = M - c0 < mc ? M : c0 + mc;
            for (int64_t i = 0; i < n_steps(g0, g1); i++) {
                int64_t g = streamed_unit(i, g0, g1);
                if (g >= g1) continue;
                for (int m0 = c0; m0 < c1; m0 += XMB) {
                    int mb = c1 - m0 < XMB ? c1 - m0 : XMB;
                    group(w + (size_t)g * group_bytes, X, m0, mb, out);
                    for (int m = 0; m < mb; m++)
                        for (int r = 0; r < 8 && 8 * g + r < N; r++)
                            st1(y, dt, (size_t)(m0 + m) * ldy + 8 * g + r, out[m][r]);
                }
            }
        }
    }
}
