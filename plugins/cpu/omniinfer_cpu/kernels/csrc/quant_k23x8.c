/* The 2- and 3-bit K-quants' groups of 8 (Q2_KX8, Q3_KX8: quant_blocks.h) for omni_qx8_rows
 * (quant_x8.c). A Q2_K weight is (d * a) * q - dmin * b, q in 0..3, with a 4-bit scale a and
 * minimum b per 16 weights; a Q3_K weight (d * (s - 32)) * (v - 4), v in 0..7 (2 bits, and the
 * hmask bit as 4), a 6-bit s per 16 weights. Per 32-weight sub-block and row, each half's Sum v * x
 * (x rounded to int8, quant_q8.c) is exact in int16 (16 products of at most 7 * 127), times its
 * scale exact in int32 (AVX2: one vpmaddwd a half, the scale in both 16-bit lanes of its row),
 * then d * d_x once in float32; the minimums (Q3_K: the offset 4 times the scale) meet x's sums
 * of 16 (times d_x) in float32. Before these, Q2_K was requantised at load to Q8_0 (3.2x the
 * bytes a token, each weight moved) and Q3_K rewritten as Q6_K (1.9x the bytes;
 * quantization/gguf_transcode.py); here the file's own bytes and numbers. (Float activations
 * still take the rewrites.) */
#include "quant_blocks.h"

#define K2_BYTES 672  /* a Q2_KX8 block: 256 columns of 8 rows */
#define K3_BYTES 880  /* a Q3_KX8 block */

/* a sub-block's codes: at cs (three: its hmask bits at cs + 64) */
INLINE const uint8_t *k23_sub(const uint8_t *blk, int s, const int three) {
    return three ? blk + 112 + 96 * s : blk + 160 + 64 * s;
}

#if defined(__AVX2__)
/* sub-block codes at cs -> its 8 code vectors (vector k: byte 4r + i is row r's weight 4k + i);
 * three: with the hmask bit k of byte 4r + i at cs + 64 as 4 */
INLINE void k23_codes(const uint8_t *cs, __m256i c[8], const int three) {
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int a = 0; a < 2; a++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(cs + 32 * a));
        c[4 * a] = _mm256_and_si256(v, m3);
        c[4 * a + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 2), m3);
        c[4 * a + 2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m3);
        c[4 * a + 3] = _mm256_and_si256(_mm256_srli_epi16(v, 6), m3);
    }
    if (three) x8_high_bits(cs + 64, c, 2);
}

/* a Q3_KX8 block's 16 x 8 scales, s - 32 as int8 (byte 8t + r: row r's scale of weights 16t ..
 * 16t + 15), unpacked for all 16 at once (k3_scales' bits, 32 bytes a register) */
INLINE void k3_all_scales(const uint8_t *blk, int8_t out[128]) {
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    __m256i lo[2] = {_mm256_loadu_si256((const __m256i *)(blk + 16)), _mm256_loadu_si256((const __m256i *)(blk + 48))};
    __m256i hi = _mm256_loadu_si256((const __m256i *)(blk + 80));
    for (int q = 0; q < 4; q++) {  /* t = 4q .. 4q + 3: bytes t & 7's nibble t >> 3, byte 8 + t % 4's bits 2q */
        __m256i l = q < 2 ? lo[q] : _mm256_srli_epi16(lo[q - 2], 4);
        __m256i h = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * q), m3);
        __m256i v = _mm256_or_si256(_mm256_and_si256(l, m4), _mm256_slli_epi16(h, 4));
        _mm256_storeu_si256((__m256i *)(out + 32 * q), _mm256_sub_epi8(v, off));
    }
}

INLINE void k23_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8], const int three) {
    const int nbx = X->K / 32, nbs = X->K / 16, bytes = three ? K3_BYTES : K2_BYTES;
    const __m128i m4 = _mm_set1_epi8(15);
    __m256 acc[XMB];
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < X->K / 256; b++) {
        const uint8_t *blk = g + (size_t)b * bytes;
        prefetch_ahead(blk, three ? 112 : 160);
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        /* what multiplies a row's offset term: dmin (times the minimum), or 4 d (times the scale) */
        __m256 ow = three ? _mm256_mul_ps(dw, _mm256_set1_ps(4.0f))
                          : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        int8_t sc3[128];
        if (three) k3_all_scales(blk, sc3);
        for (int s = 0; s < 8; s++) {
            const uint8_t *cs = k23_sub(blk, s, three);
            prefetch_ahead(cs, three ? 96 : 64);
            /* the 8 rows' scales of the halves (bytes 0-7, 8-15; int8: Q2_K's 0..15, Q3_K's -32..31),
             * each in both of its row's 16-bit lanes (sc0, sc1); their offset terms' factors as float
             * (o0, o1: Q2_K's minimums, Q3_K's scales) */
            __m128i sv, mv;
            if (three) {
                sv = mv = _mm_loadu_si128((const __m128i *)(sc3 + 16 * s));
            } else {
                __m128i v = _mm_loadu_si128((const __m128i *)(blk + 32 + 16 * s));
                sv = _mm_and_si128(v, m4), mv = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
            }
            __m256i sc0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sv, sv));
            __m256i sc1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(sv, sv));
            __m256 o0 = _mm256_mul_ps(ow, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(mv)));
            __m256 o1 = _mm256_mul_ps(ow, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(mv, 8))));
            __m256i c[8];
            k23_codes(cs, c, three);
            int xb = 8 * b + s;
            for (int m = 0; m < MB; m++) {
                size_t r = (size_t)(m0 + m);
                const int8_t *x4 = X->q + r * X->K + 32 * xb;
                __m256i h[2];
#pragma GCC unroll 2
                for (int half = 0; half < 2; half++) {
                    h[half] = _mm256_maddubs_epi16(c[4 * half], x4_at(x4 + 16 * half));
#pragma GCC unroll 3
                    for (int k = 1; k < 4; k++)
                        h[half] = _mm256_add_epi16(
                            h[half], _mm256_maddubs_epi16(c[4 * half + k], x4_at(x4 + 16 * half + 4 * k)));
                }
                __m256i t = _mm256_add_epi32(_mm256_madd_epi16(h[0], sc0), _mm256_madd_epi16(h[1], sc1));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, _mm256_set1_ps(X->d[r * nbx + xb])),
                                         acc[m]);
                acc[m] = _mm256_fnmadd_ps(o0, _mm256_set1_ps(X->s[r * nbs + 2 * xb]), acc[m]);
                acc[m] = _mm256_fnmadd_ps(o1, _mm256_set1_ps(X->s[r * nbs + 2 * xb + 1]), acc[m]);
            }
        }
    }
    for (int m = 0; m < MB; m++) _mm256_storeu_ps(out[m], acc[m]);
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
INLINE void k23_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8], const int three) {
    const int nbx = X->K / 32, nbs = X->K / 16, bytes = three ? K3_BYTES : K2_BYTES, off = three ? 32 : 0;
    float32x4_t acc[XMB][2];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = vdupq_n_f32(0.f);
    for (int b = 0; b < X->K / 256; b++) {
        const uint8_t *blk = g + (size_t)b * bytes;
        prefetch_ahead(blk, three ? 112 : 160);
        float32x4_t dw[2], ow[2];
        for (int h = 0; h < 2; h++) {
            dw[h] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)blk + 4 * h)));
            ow[h] = three ? vmulq_n_f32(dw[h], 4.0f)
                          : vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(blk + 16) + 4 * h)));
        }
        for (int s = 0; s < 8; s++) {
            const uint8_t *cs = k23_sub(blk, s, three);
            prefetch_ahead(cs, three ? 96 : 64);
            int32x4_t sc[2][2];  /* [half][rows 4h ..]: the scale, and the offset term's factor */
            float32x4_t o[2][2];
            for (int half = 0; half < 2; half++) {
                uint8x8_t v = three ? vcreate_u8(k3_scales(blk, 2 * s + half)) : vld1_u8(blk + 32 + 16 * s + 8 * half);
                int16x8_t a = vsubq_s16(vreinterpretq_s16_u16(vmovl_u8(three ? v : vand_u8(v, vdup_n_u8(15)))),
                                        vdupq_n_s16((int16_t)off));
                int16x8_t mn = three ? a : vreinterpretq_s16_u16(vmovl_u8(vshr_n_u8(v, 4)));
                sc[half][0] = vmovl_s16(vget_low_s16(a)), sc[half][1] = vmovl_high_s16(a);
                o[half][0] = vmulq_f32(ow[0], vcvtq_f32_s32(vmovl_s16(vget_low_s16(mn))));
                o[half][1] = vmulq_f32(ow[1], vcvtq_f32_s32(vmovl_high_s16(mn)));
            }
            int8x16_t c[8][2];  /* code vector k for rows 0-3, 4-7 */
            for (int h = 0; h < 2; h++) {
                uint8x16_t m3 = vdupq_n_u8(3), hb = three ? vld1q_u8(cs + 64 + 16 * h) : vdupq_n_u8(0);
                for (int k = 0; k < 8; k++) {
                    uint8x16_t v = vld1q_u8(cs + 32 * (k / 4) + 16 * h);
                    uint8x16_t q = vandq_u8(vshlq_u8(v, vdupq_n_s8((int8_t)(-2 * (k & 3)))), m3);
                    q = vorrq_u8(q, vandq_u8(vshlq_u8(hb, vdupq_n_s8((int8_t)(2 - k))), vdupq_n_u8(4)));
                    c[k][h] = vreinterpretq_s8_u8(q);
                }
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
                        int16x8_t lo = vdupq_n_s16(0), hi = vdupq_n_s16(0);  /* 4 products of at most 7 * 127 a lane */
                        for (int k = 4 * half; k < 4 * half + 4; k++) {
                            int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(x4[k]));
                            lo = vmlal_s8(lo, vget_low_s8(c[k][h]), vget_low_s8(xv));
                            hi = vmlal_s8(hi, vget_high_s8(c[k][h]), vget_high_s8(xv));
                        }
                        t = vmlaq_s32(t, vpaddlq_s16(vpaddq_s16(lo, hi)), sc[half][h]);
                    }
                    acc[m][h] = vfmaq_f32(acc[m][h], vcvtq_f32_s32(t), vmulq_n_f32(dw[h], d));
                    acc[m][h] = vfmsq_f32(acc[m][h], o[0][h], vdupq_n_f32(s0));
                    acc[m][h] = vfmsq_f32(acc[m][h], o[1][h], vdupq_n_f32(s1));
                }
            }
        }
    }
    for (int m = 0; m < MB; m++) vst1q_f32(out[m], acc[m][0]), vst1q_f32(out[m] + 4, acc[m][1]);
}
#else
INLINE void k23_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8], const int three) {
    const int nbx = X->K / 32, nbs = X->K / 16, bytes = three ? K3_BYTES : K2_BYTES;
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < 8; r++) out[m][r] = 0.f;
    for (int b = 0; b < X->K / 256; b++) {
        const uint8_t *blk = g + (size_t)b * bytes;
        for (int s = 0; s < 8; s++) {
            const uint8_t *cs = k23_sub(blk, s, three);
            prefetch_ahead(cs, three ? 96 : 64);
            int xb = 8 * b + s;
            for (int m = 0; m < MB; m++) {
                size_t row = (size_t)(m0 + m);
                const int8_t *xs = X->q + row * X->K + 32 * xb;
                for (int r = 0; r < 8; r++) {
                    float dw = f16_to_f32(u16_at(blk + 2 * r));
                    float ow = three ? 4.0f * dw : f16_to_f32(u16_at(blk + 16 + 2 * r));
                    int32_t t = 0;
                    float offs = 0.f;
                    for (int half = 0; half < 2; half++) {
                        int sc, mn;
                        if (three) {
                            sc = mn = (int)((k3_scales(blk, 2 * s + half) >> (8 * r)) & 63) - 32;
                        } else {
                            uint8_t sb = blk[32 + 8 * (2 * s + half) + r];
                            sc = sb & 15, mn = sb >> 4;
                        }
                        int32_t h = 0;
                        for (int k = 4 * half; k < 4 * half + 4; k++)
                            for (int i = 0; i < 4; i++) {
                                int v = (cs[32 * (k / 4) + 4 * r + i] >> (2 * (k & 3))) & 3;
                                if (three) v |= ((cs[64 + 4 * r + i] >> k) & 1) << 2;
                                h += v * xs[4 * k + i];
                            }
                        t += sc * h;
                        offs += (float)mn * X->s[row * nbs + 2 * xb + half];
                    }
                    out[m][r] += (float)t * (dw * X->d[row * nbx + xb]) - ow * offs;
                }
            }
        }
    }
}
#endif

GROUP_OF(k2_rows, k23_rows, 0)
GROUP_OF(k3_rows, k23_rows, 1)

ROWS_OF(k2_rows)
ROWS_OF(k3_rows)

x8_group_fn omni_k23x8_group(int kind) { return kind == Q3_KX8 ? k3_rows_n : k2_rows_n; }
