/* The K-quants' groups of 8 (Q4_KX8, Q5_KX8, Q6_KX8: quant_blocks.h) for omni_qx8_rows
 * (quant_x8.c): the same integer sums as its Q4_0X8 groups, per 32-weight sub-block, then each
 * row's sub-block scale (Q4_K, Q5_K: d * scale and dmin * minimum; Q6_K: d * scale per 16
 * weights, less 32 times x's sum) for the 8 rows in one vector, where the row-at-a-time dots of
 * quant_q8.c take them a row and a sub-block at a time. */
#include "quant_blocks.h"

/* Q4_KX8: per 256 columns the 8 rows' d and dmin, their 12 scale bytes (byte 8t + r: row r's byte
 * t), then sub-block s's codes as Q4_0X8's (Q5_KX8: and their fifth bits after them, as Q5_0X8's);
 * each row's scale and minimum of sub-block s unpacked for the 8 rows at once, 8 bytes to a
 * 64-bit word (k4_scales) */
INLINE void k4_scales(const uint8_t *blk, int s, uint64_t *sc, uint64_t *mn) {
    const uint64_t m6 = 0x3f3f3f3f3f3f3f3full, m4 = 0x0f0f0f0f0f0f0f0full, m2 = 0x0303030303030303ull;
    uint64_t t[3];  /* the 8 rows' bytes s, s + 4, s + 8 (s < 4) or s - 4, s, s + 4 */
    for (int i = 0; i < 3; i++) memcpy(&t[i], blk + 32 + 8 * ((s & 3) + 4 * i), 8);
    if (s < 4) {
        *sc = t[0] & m6, *mn = t[1] & m6;
    } else {  /* sc = byte s + 4's low nibble, byte s - 4's top 2 bits above; mn = its high nibble, byte s's */
        *sc = (t[2] & m4) | (((t[0] >> 6) & m2) << 4);
        *mn = ((t[2] >> 4) & m4) | (((t[1] >> 6) & m2) << 4);
    }
}

/* Q6_KX8: per 256 columns the 8 rows' d and their 16 scales (byte 16 + 8t + r: row r's scale t),
 * then sub-block s at 144 + 192s: its low 4 bits as Q4_0X8's chunks (128 bytes), then its top 2
 * bits, 2 vectors of 32 bytes (byte 4r + i of vector k holds chunk c = 2k + cc's two weights of
 * that byte: the low nibble's at bits 4cc, 4cc + 1, the high nibble's at 4cc + 2, 4cc + 3) */
#define K6_BYTES 1680

#if defined(__AVX2__)
INLINE void kq_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8], const int hi) {
    __m256 acc[XMB];
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    const int nbx = X->K / 32, sub = 128 + 32 * hi;
    for (int b = 0; b < X->K / 256; b++) {
        const uint8_t *blk = g + (size_t)b * (128 + 8 * sub);
        prefetch_ahead(blk, 128);
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256 dmw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        for (int s = 0; s < 8; s++) {
            const uint8_t *cs = blk + 128 + sub * s;
            prefetch_ahead(cs, sub);
            uint64_t sc, mn;
            k4_scales(blk, s, &sc, &mn);
            __m256 ds = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
            __m256 dm = _mm256_mul_ps(dmw, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
            __m256i c[8];
            x8_nibbles(cs, c);
            if (hi) x5_codes(cs + 128, c);
            int xb = 8 * b + s;
            for (int m = 0; m < MB; m++) {
                size_t r = (size_t)(m0 + m);
                const int8_t *xs = X->q + r * X->K + 32 * xb;
                __m256i t = hi ? x8_dot5(c, xs) : x8_nibble_dot(c, xs);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(ds, _mm256_set1_ps(X->d[r * nbx + xb])),
                                         acc[m]);
                acc[m] = _mm256_fnmadd_ps(dm, _mm256_set1_ps(X->s32[r * nbx + xb]), acc[m]);
            }
        }
    }
    for (int m = 0; m < MB; m++) _mm256_storeu_ps(out[m], acc[m]);
}

/* codes 0..63 of chunk c of a Q6_KX8 sub-block at cs: weights 8c + i (lo) and 8c + 4 + i (hi) */
INLINE void k6_codes(const uint8_t *cs, int c, __m256i *lo, __m256i *hi) {
    const __m256i nib = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
    __m256i l = _mm256_loadu_si256((const __m256i *)(cs + 32 * c));
    __m256i h = _mm256_loadu_si256((const __m256i *)(cs + 128 + 32 * (c / 2)));
    __m256i h0 = c & 1 ? _mm256_srli_epi16(h, 0) : _mm256_slli_epi16(h, 4);  /* bits 4cc.. to 4..5 */
    __m256i h1 = c & 1 ? _mm256_srli_epi16(h, 2) : _mm256_slli_epi16(h, 2);  /* bits 4cc + 2.. to 4..5 */
    *lo = _mm256_or_si256(_mm256_and_si256(l, nib), _mm256_and_si256(h0, top));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), nib), _mm256_and_si256(h1, top));
}

INLINE void k6_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8]) {
    __m256 acc[XMB];
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    const int nbx = X->K / 32;
    for (int b = 0; b < X->K / 256; b++) {
        const uint8_t *blk = g + (size_t)b * K6_BYTES;
        prefetch_ahead(blk, 144);
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        for (int s = 0; s < 8; s++) {
            const uint8_t *cs = blk + 144 + 192 * s;
            prefetch_ahead(cs, 192);
            int xb = 8 * b + s;
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {  /* weights 16 half .. + 15: chunks 2 half, 2 half + 1 */
                int t = 2 * s + half;
                __m128i sc8 = _mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * t));
                __m256 ds = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
                __m256i c[4];
                k6_codes(cs, 2 * half, &c[0], &c[1]);
                k6_codes(cs, 2 * half + 1, &c[2], &c[3]);
                for (int m = 0; m < MB; m++) {
                    size_t r = (size_t)(m0 + m);
                    const int8_t *x4 = X->q + r * X->K + 32 * xb + 16 * half;
#if defined(DPBUSD256)
                    __m256i v = _mm256_setzero_si256();
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++) v = DPBUSD256(v, c[j], x4_at(x4 + 4 * j));
#else  /* a pair of products is at most 2 * 63 * 127: two vpmaddubsw sums fit int16, not four */
                    const __m256i one = _mm256_set1_epi16(1);
                    __m256i v = _mm256_add_epi32(
                        _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(c[0], x4_at(x4)),
                                                           _mm256_maddubs_epi16(c[1], x4_at(x4 + 4))), one),
                        _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(c[2], x4_at(x4 + 8)),
                                                           _mm256_maddubs_epi16(c[3], x4_at(x4 + 12))), one));
#endif
                    /* d * scale * (d_x * Sum q x - 32 * the half's sum of x) */
                    __m256 e = _mm256_fmsub_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(X->d[r * nbx + xb]),
                                               _mm256_set1_ps(32.0f * X->s[r * (X->K / 16) + 2 * xb + half]));
                    acc[m] = _mm256_fmadd_ps(ds, e, acc[m]);
                }
            }
        }
    }
    for (int m = 0; m < MB; m++) _mm256_storeu_ps(out[m], acc[m]);
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
INLINE void kq_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8], const int hi) {
    float32x4_t acc[XMB][2];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = vdupq_n_f32(0.f);
    const int nbx = X->K / 32, sub = 128 + 32 * hi;
    for (int b = 0; b < X->K / 256; b++) {
        const uint8_t *blk = g + (size_t)b * (128 + 8 * sub);
        prefetch_ahead(blk, 128);
        float32x4_t dw[2], dmw[2];
        for (int h = 0; h < 2; h++) {
            dw[h] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)blk + 4 * h)));
            dmw[h] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(blk + 16) + 4 * h)));
        }
        for (int s = 0; s < 8; s++) {
            const uint8_t *cs = blk + 128 + sub * s;
            prefetch_ahead(cs, sub);
            uint64_t sc, mn;
            k4_scales(blk, s, &sc, &mn);
            uint16x8_t sc16 = vmovl_u8(vcreate_u8(sc)), mn16 = vmovl_u8(vcreate_u8(mn));
            float32x4_t ds[2] = {vmulq_f32(dw[0], vcvtq_f32_u32(vmovl_u16(vget_low_u16(sc16)))),
                                 vmulq_f32(dw[1], vcvtq_f32_u32(vmovl_high_u16(sc16)))};
            float32x4_t dm[2] = {vmulq_f32(dmw[0], vcvtq_f32_u32(vmovl_u16(vget_low_u16(mn16)))),
                                 vmulq_f32(dmw[1], vcvtq_f32_u32(vmovl_high_u16(mn16)))};
            int8x16_t c[8][2];  /* codes of 4-weight step j for rows 0-3, 4-7 */
            x8_codes_neon(cs, hi ? cs + 128 : NULL, c);
            int xb = 8 * b + s;
            for (int m = 0; m < MB; m++) {
                size_t r = (size_t)(m0 + m);
                float d = X->d[r * nbx + xb], s32 = X->s32[r * nbx + xb];
                for (int h = 0; h < 2; h++) {
                    int32x4_t t = x8_dot_neon(c, X->q + r * X->K + 32 * xb, h, hi);
                    acc[m][h] = vfmaq_f32(acc[m][h], vcvtq_f32_s32(t), vmulq_n_f32(ds[h], d));
                    acc[m][h] = vfmsq_f32(acc[m][h], dm[h], vdupq_n_f32(s32));
                }
            }
        }
    }
    for (int m = 0; m < MB; m++) vst1q_f32(out[m], acc[m][0]), vst1q_f32(out[m] + 4, acc[m][1]);
}

INLINE void k6_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8]) {
    float32x4_t acc[XMB][2];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = vdupq_n_f32(0.f);
    const int nbx = X->K / 32;
    for (int b = 0; b < X->K / 256; b++) {
        const uint8_t *blk = g + (size_t)b * K6_BYTES;
        prefetch_ahead(blk, 144);
        float32x4_t dw[2] = {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)blk))),
                             vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)blk + 4)))};
        for (int s = 0; s < 8; s++) {
            const uint8_t *cs = blk + 144 + 192 * s;
            prefetch_ahead(cs, 192);
            int xb = 8 * b + s;
            for (int half = 0; half < 2; half++) {
                int t = 2 * s + half;
                int16x8_t sc16 = vmovl_s8(vld1_s8((const int8_t *)blk + 16 + 8 * t));
                float32x4_t ds[2] = {vmulq_f32(dw[0], vcvtq_f32_s32(vmovl_s16(vget_low_s16(sc16)))),
                                     vmulq_f32(dw[1], vcvtq_f32_s32(vmovl_high_s16(sc16)))};
                int8x16_t c[4][2];  /* codes of 4-weight step j (chunk 2 half + j / 2) for rows 0-3, 4-7 */
                for (int k = 0; k < 2; k++) {
                    int cc = 2 * half + k;
                    for (int h = 0; h < 2; h++) {
                        uint8x16_t l = vld1q_u8(cs + 32 * cc + 16 * h);
                        uint8x16_t hb = vld1q_u8(cs + 128 + 32 * (cc / 2) + 16 * h);
                        uint8x16_t top = vdupq_n_u8(0x30);
                        uint8x16_t h0 = cc & 1 ? hb : vshlq_n_u8(hb, 4), h1 = cc & 1 ? vshrq_n_u8(hb, 2) : vshlq_n_u8(hb, 2);
                        c[2 * k][h] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(l, vdupq_n_u8(15)), vandq_u8(h0, top)));
                        c[2 * k + 1][h] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(l, 4), vandq_u8(h1, top)));
                    }
                }
                for (int m = 0; m < MB; m++) {
                    size_t r = (size_t)(m0 + m);
                    int32_t x4[4];
                    memcpy(x4, X->q + r * X->K + 32 * xb + 16 * half, 16);
                    float d = X->d[r * nbx + xb], off = 32.0f * X->s[r * (X->K / 16) + 2 * xb + half];
                    for (int h = 0; h < 2; h++) {
                        int16x8_t lo = vdupq_n_s16(0), hi = vdupq_n_s16(0);  /* 4 products of at most 63 * 127 a lane */
                        for (int j = 0; j < 4; j++) {
                            int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(x4[j]));
                            lo = vmlal_s8(lo, vget_low_s8(c[j][h]), vget_low_s8(xv));
                            hi = vmlal_s8(hi, vget_high_s8(c[j][h]), vget_high_s8(xv));
                        }
                        int32x4_t v = vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi));  /* (widened first) */
                        float32x4_t e = vsubq_f32(vmulq_n_f32(vcvtq_f32_s32(v), d), vdupq_n_f32(off));
                        acc[m][h] = vfmaq_f32(acc[m][h], ds[h], e);
                    }
                }
            }
        }
    }
    for (int m = 0; m < MB; m++) vst1q_f32(out[m], acc[m][0]), vst1q_f32(out[m] + 4, acc[m][1]);
}
#else
INLINE void kq_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8], const int hi) {
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < 8; r++) out[m][r] = 0.f;
    const int nbx = X->K / 32, sub = 128 + 32 * hi;
    for (int b = 0; b < X->K / 256; b++) {
        const uint8_t *blk = g + (size_t)b * (128 + 8 * sub);
        prefetch_ahead(blk, 128);
        for (int s = 0; s < 8; s++) {
            const uint8_t *cs = blk + 128 + sub * s, *hb = hi ? cs + 128 : NULL;
            prefetch_ahead(cs, sub);
            uint64_t sc, mn;
            k4_scales(blk, s, &sc, &mn);
            int xb = 8 * b + s;
            for (int m = 0; m < MB; m++) {
                size_t row = (size_t)(m0 + m);
                const int8_t *xs = X->q + row * X->K + 32 * xb;
                float d = X->d[row * nbx + xb], s32 = X->s32[row * nbx + xb];
                for (int r = 0; r < 8; r++) {
                    int32_t t = 0;
                    for (int c = 0; c < 4; c++)
                        for (int h = 0; h < 2; h++)
                            for (int i = 0; i < 4; i++) t += x8_code(cs, hb, r, c, h, i) * xs[8 * c + 4 * h + i];
                    float ds = f16_to_f32(u16_at(blk + 2 * r)) * (float)((sc >> (8 * r)) & 255);
                    float dm = f16_to_f32(u16_at(blk + 16 + 2 * r)) * (float)((mn >> (8 * r)) & 255);
                    out[m][r] += (float)t * (ds * d) - dm * s32;
                }
            }
        }
    }
}

INLINE void k6_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8]) {
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < 8; r++) out[m][r] = 0.f;
    const int nbx = X->K / 32;
    for (int b = 0; b < X->K / 256; b++) {
        const uint8_t *blk = g + (size_t)b * K6_BYTES;
        prefetch_ahead(blk, 144);
        for (int s = 0; s < 8; s++) {
            const uint8_t *cs = blk + 144 + 192 * s;
            prefetch_ahead(cs, 192);
            int xb = 8 * b + s;
            for (int m = 0; m < MB; m++) {
                size_t row = (size_t)(m0 + m);
                const int8_t *xs = X->q + row * X->K + 32 * xb;
                float d = X->d[row * nbx + xb];
                for (int r = 0; r < 8; r++) {
                    float dw = f16_to_f32(u16_at(blk + 2 * r));
                    for (int half = 0; half < 2; half++) {
                        int32_t t = 0;
                        for (int c = 2 * half; c < 2 * half + 2; c++)
                            for (int i = 0; i < 4; i++) {
                                uint8_t l = cs[32 * c + 4 * r + i], h = cs[128 + 32 * (c / 2) + 4 * r + i];
                                int sh = 4 * (c & 1);
                                t += ((l & 15) | (((h >> sh) & 3) << 4)) * xs[8 * c + i] +
                                     ((l >> 4) | (((h >> (sh + 2)) & 3) << 4)) * xs[8 * c + 4 + i];
                            }
                        float ds = dw * (float)(int8_t)blk[16 + 8 * (2 * s + half) + r];
                        out[m][r] += ds * ((float)t * d - 32.0f * X->s[row * (X->K / 16) + 2 * xb + half]);
                    }
                }
            }
        }
    }
}
#endif

GROUP_OF(k4_rows, kq_rows, 0)
GROUP_OF(k5_rows, kq_rows, 1)

ROWS_OF(k4_rows)
ROWS_OF(k5_rows)
ROWS_OF(k6_rows)

x8_group_fn omni_kx8_group(int kind) {
    return kind == Q6_KX8 ? k6_rows_n : kind == Q5_KX8 ? k5_rows_n : k4_rows_n;
}
