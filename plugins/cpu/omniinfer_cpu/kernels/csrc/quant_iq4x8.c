/* The IQ4 groups of 8 (IQ4_NLX8, IQ4_XSX8: quant_blocks.h) for omni_qx8_rows (quant_x8.c):
 * Q4_0X8's nibble chunks, each code looked up in IQ4_VALUES with one table instruction (AVX2's
 * vpshufb, NEON's tbl: the 16 values fit a register), then those signed bytes meet x's rounded
 * block as quant_x8.c's Q8_0X8 codes do, exact in integers per 32 weights; then IQ4_NL's d, or
 * IQ4_XS's d * (scale - 32) of the sub-block, times x's d, in float32. Before these, IQ4_NL and
 * IQ4_XS were rewritten at load as Q8_0 (quantization/gguf_transcode.py): twice the bytes to read
 * a token, and IQ4_XS's scales rounded to float16; here the file's own bytes, nothing rounded
 * but x. (Float activations still take the rewrite: quant.py.) */
#include "quant_blocks.h"

#if defined(__AVX2__)
/* a group's 4 chunks of nibbles at p -> its 8 vectors of IQ4 values v: u, as unsigned bytes (VNNI:
 * v + 128, for vpdpbusd; else |v|, for vpmaddubsw), and (no VNNI) v itself in c for its signs */
INLINE void iq4_codes(const uint8_t *p, __m256i u[8], __m256i c[8]) {
    __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
#if defined(DPBUSD256)
    (void)c;
    x8_nibbles(p, u);
    t = _mm256_xor_si256(t, _mm256_set1_epi8((char)0x80));
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) u[j] = _mm256_shuffle_epi8(t, u[j]);
#else
    x8_nibbles(p, c);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) c[j] = _mm256_shuffle_epi8(t, c[j]), u[j] = _mm256_abs_epi8(c[j]);
#endif
}
/* the 8 rows' Sum v * x over those vectors and x's 32 int8 at x (isum: their sum). VNNI: Sum
 * (v + 128) x - 128 Sum x; else |v| times x with v's sign (a vpmaddubsw pair at most 2 * 127 *
 * 127: one fits int16, so each is widened) */
INLINE __m256i iq4_dot(const __m256i u[8], const __m256i c[8], const int8_t *x, int32_t isum) {
#if defined(DPBUSD256)
    (void)c;
    __m256i s2[2] = {_mm256_set1_epi32(-128 * isum), _mm256_setzero_si256()};
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) s2[j & 1] = DPBUSD256(s2[j & 1], u[j], x4_at(x + 4 * j));
    __m256i s = _mm256_add_epi32(s2[0], s2[1]);
#else
    (void)isum;
    const __m256i one = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        __m256i p = _mm256_maddubs_epi16(u[j], _mm256_sign_epi8(x4_at(x + 4 * j), c[j]));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, one));
    }
#endif
    return s;
}

/* IQ4_NLX8 (xs 0: blocks of 32 columns, 144 bytes: the 8 rows' d, then the codes) or IQ4_XSX8
 * (xs 1: blocks of 256 columns, 1088 bytes: the 8 rows' d and scale bytes, then 8 sub-blocks of
 * codes) */
INLINE void iq4_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8], const int xs) {
    const int nbx = X->K / 32, subs = xs ? 8 : 1, head = xs ? 64 : 16;
    __m256 acc[XMB];
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < nbx / subs; b++) {
        const uint8_t *blk = g + (size_t)b * (head + 128 * subs);
        prefetch_ahead(blk, head);
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        for (int s = 0; s < subs; s++) {
            const uint8_t *cs = blk + head + 128 * s;
            prefetch_ahead(cs, 128);
            __m256 ds = dw;  /* IQ4_XS: d * (scale - 32) */
            if (xs) {
                __m256i sc = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)xs_scales(blk, s)));
                ds = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(_mm256_sub_epi32(sc, _mm256_set1_epi32(32))));
            }
            __m256i u[8], c[8];
            iq4_codes(cs, u, c);
            int xb = subs * b + s;
            for (int m = 0; m < MB; m++) {
                size_t r = (size_t)(m0 + m);
                __m256i t = iq4_dot(u, c, X->q + r * X->K + 32 * xb, X->isum[r * nbx + xb]);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(ds, _mm256_set1_ps(X->d[r * nbx + xb])),
                                         acc[m]);
            }
        }
    }
    for (int m = 0; m < MB; m++) _mm256_storeu_ps(out[m], acc[m]);
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
/* a group's chunks at p as 8 vectors of IQ4 values for rows 0-3 (c[j][0]) and 4-7 (c[j][1]) */
INLINE void iq4_codes_neon(const uint8_t *p, int8x16_t c[8][2]) {
    const int8x16_t t = vld1q_s8(IQ4_VALUES);
    x8_codes_neon(p, NULL, c);
    for (int j = 0; j < 8; j++)
        for (int h = 0; h < 2; h++) c[j][h] = vqtbl1q_s8(t, vreinterpretq_u8_s8(c[j][h]));
}
/* rows 4h .. 4h + 3's Sum v * x (each product at most 127 * 127: widened at once, as Q8_0X8's) */
INLINE int32x4_t iq4_dot_neon(int8x16_t c[8][2], const int8_t *x, int h) {
    int32_t x4[8];
    memcpy(x4, x, 32);
    int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);  /* rows 4h, 4h+1 | 4h+2, 4h+3 */
    for (int j = 0; j < 8; j++) {
        int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(x4[j]));
        lo = vpadalq_s16(lo, vmull_s8(vget_low_s8(c[j][h]), vget_low_s8(xv)));
        hi = vpadalq_s16(hi, vmull_high_s8(c[j][h], xv));
    }
    return vpaddq_s32(lo, hi);
}

INLINE void iq4_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8], const int xs) {
    const int nbx = X->K / 32, subs = xs ? 8 : 1, head = xs ? 64 : 16;
    float32x4_t acc[XMB][2];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = vdupq_n_f32(0.f);
    for (int b = 0; b < nbx / subs; b++) {
        const uint8_t *blk = g + (size_t)b * (head + 128 * subs);
        prefetch_ahead(blk, head);
        float32x4_t dw[2] = {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)blk))),
                             vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)blk + 4)))};
        for (int s = 0; s < subs; s++) {
            const uint8_t *cs = blk + head + 128 * s;
            prefetch_ahead(cs, 128);
            float32x4_t ds[2] = {dw[0], dw[1]};  /* IQ4_XS: d * (scale - 32) */
            if (xs) {
                int16x8_t sc = vsubq_s16(vreinterpretq_s16_u16(vmovl_u8(vcreate_u8(xs_scales(blk, s)))), vdupq_n_s16(32));
                ds[0] = vmulq_f32(dw[0], vcvtq_f32_s32(vmovl_s16(vget_low_s16(sc))));
                ds[1] = vmulq_f32(dw[1], vcvtq_f32_s32(vmovl_high_s16(sc)));
            }
            int8x16_t c[8][2];
            iq4_codes_neon(cs, c);
            int xb = subs * b + s;
            for (int m = 0; m < MB; m++) {
                size_t r = (size_t)(m0 + m);
                float d = X->d[r * nbx + xb];
                for (int h = 0; h < 2; h++) {
                    int32x4_t t = iq4_dot_neon(c, X->q + r * X->K + 32 * xb, h);
                    acc[m][h] = vfmaq_f32(acc[m][h], vcvtq_f32_s32(t), vmulq_n_f32(ds[h], d));
                }
            }
        }
    }
    for (int m = 0; m < MB; m++) vst1q_f32(out[m], acc[m][0]), vst1q_f32(out[m] + 4, acc[m][1]);
}
#else
/* row r's Sum v * x over a group's 32 weights (chunks at cs) */
INLINE int32_t iq4_dot_c(const uint8_t *cs, int r, const int8_t *x) {
    int32_t t = 0;
    for (int c = 0; c < 4; c++)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 4; i++) t += IQ4_VALUES[x8_code(cs, NULL, r, c, h, i)] * x[8 * c + 4 * h + i];
    return t;
}

INLINE void iq4_rows(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8], const int xs) {
    const int nbx = X->K / 32, subs = xs ? 8 : 1, head = xs ? 64 : 16;
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < 8; r++) out[m][r] = 0.f;
    for (int b = 0; b < nbx / subs; b++) {
        const uint8_t *blk = g + (size_t)b * (head + 128 * subs);
        for (int s = 0; s < subs; s++) {
            const uint8_t *cs = blk + head + 128 * s;
            prefetch_ahead(cs, 128);
            uint64_t sc = xs ? xs_scales(blk, s) : 0;
            int xb = subs * b + s;
            for (int m = 0; m < MB; m++) {
                size_t row = (size_t)(m0 + m);
                for (int r = 0; r < 8; r++) {
                    float ds = f16_to_f32(u16_at(blk + 2 * r));
                    if (xs) ds *= (float)((int)((sc >> (8 * r)) & 63) - 32);
                    out[m][r] += (float)iq4_dot_c(cs, r, X->q + row * X->K + 32 * xb) * (ds * X->d[row * nbx + xb]);
                }
            }
        }
    }
}
#endif

GROUP_OF(nl_rows, iq4_rows, 0)
GROUP_OF(xs_rows, iq4_rows, 1)

ROWS_OF(nl_rows)
ROWS_OF(xs_rows)

x8_group_fn omni_iq4x8_group(int kind) { return kind == IQ4_XSX8 ? xs_rows_n : nl_rows_n; }
