/* Q2_K's groups of 8 (Q2_KX8: quant_blocks.h) for omni_qx8_rows (quant_x8.c). A Q2_K weight is
 * (d * a) * q - dmin * b, q in 0..3, with a 4-bit scale a and minimum b per 16 weights: per
 * 32-weight sub-block and row, the two halves' Sum q * x (x rounded to int8, quant_q8.c) are
 * exact in int16 (16 products of at most 3 * 127), times their scales exact in int32 (AVX2: one
 * vpmaddwd a half, the scale in both 16-bit lanes of its row), then d * d_x once in float32; the
 * minimums meet x's sums of 16 (times d_x) in float32. Before this, Q2_K was requantised at load
 * to Q8_0 (quantization/gguf_transcode.py): 3.2x the bytes to read a token, and each weight
 * moved; here the file's own bytes and numbers. (Float activations still take the rewrite.) */
#include "quant_blocks.h"

#define K2_BYTES 672  /* a Q2_KX8 block: 256 columns of 8 rows */

#if defined(__AVX2__)
/* sub-block codes at cs -> its 8 code vectors (vector k: byte 4r + i is row r's weight 4k + i) */
INLINE void k2_codes(const uint8_t *cs, __m256i c[8]) {
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int a = 0; a < 2; a++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(cs + 32 * a));
        c[4 * a] = _mm256_and_si256(v, m3);
        c[4 * a + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 2), m3);
        c[4 * a + 2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m3);
        c[4 * a + 3] = _mm256_and_si256(_mm256_srli_epi16(v, 6), m3);
    }
}

INLINE void k2_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8]) {
    const int nbx = X->K / 32, nbs = X->K / 16;
    const __m128i m4 = _mm_set1_epi8(15);
    __m256 acc[XMB];
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < X->K / 256; b++) {
        const uint8_t *blk = g + (size_t)b * K2_BYTES;
        prefetch_ahead(blk, 160);
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256 dmw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        for (int s = 0; s < 8; s++) {
            const uint8_t *cs = blk + 160 + 64 * s;
            prefetch_ahead(cs, 64);
            /* the 8 rows' scale bytes 2s (bytes 0-7) and 2s + 1 (8-15): each row's scale in both
             * of its 16-bit lanes (sc0, sc1); its minimums as float (dm0, dm1, times dmin) */
            __m128i sv = _mm_loadu_si128((const __m128i *)(blk + 32 + 16 * s));
            __m256i sc0 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_unpacklo_epi8(sv, sv), m4));
            __m256i sc1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_unpackhi_epi8(sv, sv), m4));
            __m128i mn = _mm_and_si128(_mm_srli_epi16(sv, 4), m4);
            __m256 dm0 = _mm256_mul_ps(dmw, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)));
            __m256 dm1 = _mm256_mul_ps(dmw, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mn, 8))));
            __m256i c[8];
            k2_codes(cs, c);
            int xb = 8 * b + s;
            for (int m = 0; m < MB; m++) {
                size_t r = (size_t)(m0 + m);
                int32_t x4[8];
                memcpy(x4, X->q + r * X->K + 32 * xb, 32);
                __m256i h[2];
#pragma GCC unroll 2
                for (int half = 0; half < 2; half++) {
                    h[half] = _mm256_maddubs_epi16(c[4 * half], _mm256_set1_epi32(x4[4 * half]));
#pragma GCC unroll 3
                    for (int k = 1; k < 4; k++)
                        h[half] = _mm256_add_epi16(
                            h[half], _mm256_maddubs_epi16(c[4 * half + k], _mm256_set1_epi32(x4[4 * half + k])));
                }
                __m256i t = _mm256_add_epi32(_mm256_madd_epi16(h[0], sc0), _mm256_madd_epi16(h[1], sc1));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, _mm256_set1_ps(X->d[r * nbx + xb])),
                                         acc[m]);
                acc[m] = _mm256_fnmadd_ps(dm0, _mm256_set1_ps(X->s[r * nbs + 2 * xb]), acc[m]);
                acc[m] = _mm256_fnmadd_ps(dm1, _mm256_set1_ps(X->s[r * nbs + 2 * xb + 1]), acc[m]);
            }
        }
    }
    for (int m = 0; m < MB; m++) _mm256_storeu_ps(out[m], acc[m]);
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
INLINE void k2_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8]) {
    const int nbx = X->K / 32, nbs = X->K / 16;
    float32x4_t acc[XMB][2];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = vdupq_n_f32(0.f);
    for (int b = 0; b < X->K / 256; b++) {
        const uint8_t *blk = g + (size_t)b * K2_BYTES;
        prefetch_ahead(blk, 160);
        float32x4_t dw[2], dmw[2];
        for (int h = 0; h < 2; h++) {
            dw[h] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)blk + 4 * h)));
            dmw[h] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(blk + 16) + 4 * h)));
        }
        for (int s = 0; s < 8; s++) {
            const uint8_t *cs = blk + 160 + 64 * s;
            prefetch_ahead(cs, 64);
            int32x4_t sc[2][2];  /* [half][rows 4h ..] */
            float32x4_t dm[2][2];
            for (int half = 0; half < 2; half++) {
                uint8x8_t v = vld1_u8(blk + 32 + 16 * s + 8 * half);
                uint16x8_t a = vmovl_u8(vand_u8(v, vdup_n_u8(15))), mn = vmovl_u8(vshr_n_u8(v, 4));
                sc[half][0] = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(a)));
                sc[half][1] = vreinterpretq_s32_u32(vmovl_high_u16(a));
                dm[half][0] = vmulq_f32(dmw[0], vcvtq_f32_u32(vmovl_u16(vget_low_u16(mn))));
                dm[half][1] = vmulq_f32(dmw[1], vcvtq_f32_u32(vmovl_high_u16(mn)));
            }
            int8x16_t c[8][2];  /* code vector k for rows 0-3, 4-7 */
            for (int a = 0; a < 2; a++)
                for (int h = 0; h < 2; h++) {
                    uint8x16_t v = vld1q_u8(cs + 32 * a + 16 * h), m3 = vdupq_n_u8(3);
                    c[4 * a][h] = vreinterpretq_s8_u8(vandq_u8(v, m3));
                    c[4 * a + 1][h] = vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(v, 2), m3));
                    c[4 * a + 2][h] = vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(v, 4), m3));
                    c[4 * a + 3][h] = vreinterpretq_s8_u8(vshrq_n_u8(v, 6));
                }
            int xb = 8 * b + s;
            for (int m = 0; m < MB; m++) {
                size_t r = (size_t)(m0 + m);
                int32_t x4[8];
                memcpy(x4, X->q + r * X->K + 32 * xb, 32);
                float d = X->d[r * nbx + xb], s0 = X->s[r * nbs + 2 * xb], s1 = X->s[r * nbs + 2 * xb + 1];
                for (int h = 0; h < 2; h++) {
                    int32x4_t t = vdupq_n_s32(0);
                    for (int half = 0; half < 2; half++) {
                        int16x8_t lo = vdupq_n_s16(0), hi = vdupq_n_s16(0);  /* 4 products of at most 3 * 127 a lane */
                        for (int k = 4 * half; k < 4 * half + 4; k++) {
                            int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(x4[k]));
                            lo = vmlal_s8(lo, vget_low_s8(c[k][h]), vget_low_s8(xv));
                            hi = vmlal_s8(hi, vget_high_s8(c[k][h]), vget_high_s8(xv));
                        }
                        t = vmlaq_s32(t, vpaddlq_s16(vpaddq_s16(lo, hi)), sc[half][h]);
                    }
                    acc[m][h] = vfmaq_f32(acc[m][h], vcvtq_f32_s32(t), vmulq_n_f32(dw[h], d));
                    acc[m][h] = vfmsq_f32(acc[m][h], dm[0][h], vdupq_n_f32(s0));
                    acc[m][h] = vfmsq_f32(acc[m][h], dm[1][h], vdupq_n_f32(s1));
                }
            }
        }
    }
    for (int m = 0; m < MB; m++) vst1q_f32(out[m], acc[m][0]), vst1q_f32(out[m] + 4, acc[m][1]);
}
#else
INLINE void k2_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8]) {
    const int nbx = X->K / 32, nbs = X->K / 16;
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < 8; r++) out[m][r] = 0.f;
    for (int b = 0; b < X->K / 256; b++) {
        const uint8_t *blk = g + (size_t)b * K2_BYTES;
        for (int s = 0; s < 8; s++) {
            const uint8_t *cs = blk + 160 + 64 * s;
            prefetch_ahead(cs, 64);
            int xb = 8 * b + s;
            for (int m = 0; m < MB; m++) {
                size_t row = (size_t)(m0 + m);
                const int8_t *xs = X->q + row * X->K + 32 * xb;
                for (int r = 0; r < 8; r++) {
                    int32_t t = 0;
                    float mins = 0.f;
                    for (int half = 0; half < 2; half++) {
                        uint8_t sb = blk[32 + 8 * (2 * s + half) + r];
                        int32_t h = 0;
                        for (int k = 4 * half; k < 4 * half + 4; k++)
                            for (int i = 0; i < 4; i++) h += ((cs[32 * (k / 4) + 4 * r + i] >> (2 * (k & 3))) & 3) * xs[4 * k + i];
                        t += (sb & 15) * h;
                        mins += (float)(sb >> 4) * X->s[row * nbs + 2 * xb + half];
                    }
                    out[m][r] += (float)t * (f16_to_f32(u16_at(blk + 2 * r)) * X->d[row * nbx + xb]) -
                                 f16_to_f32(u16_at(blk + 16 + 2 * r)) * mins;
                }
            }
        }
    }
}
#endif

ROWS_OF(k2_rows)

x8_group_fn omni_k2x8_group(void) { return k2_rows_n; }
