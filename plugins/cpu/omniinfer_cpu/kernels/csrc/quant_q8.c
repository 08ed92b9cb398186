/* omni_qlinear's int8-activation path (a kind code with QACT_INT8 set), as llama.cpp's q8 dot
 * products: each row of x is rounded to int8 in blocks of 32 (d = max |x| / 127, q = round(x / d),
 * ties to even), and every weight block meets it in integer multiply-adds, one float multiply per
 * 32 weights. The integer sums are exact; what differs from the float path is the rounding of x
 * (an error of up to 1/254 of its block's largest value per element), not the weights.
 * Offsets (Q4_0's 8, Q6_K's 32, Q4_K's minimums) are taken out of the sum with the rounded x's own
 * sums, so the result is exactly Sum w * (d_x * q_x) in exact arithmetic up to float32 rounding of
 * the per-block products.
 *
 * Integer products: on x86, 32 bytes at a time, AVX2's vpmaddubsw + vpmaddwd (unsigned weight
 * codes times signed x; Q8_0's signed codes through vpsignb), or AVX-512 VNNI's vpdpbusd where the
 * level has it; on Arm, NEON's widening vmull_s8 / vpadalq_s16 (the baseline armv8-a level: no
 * sdot); elsewhere plain C. No sum can overflow: a pair of products is at most 2 * 128 * 127. */
#include "quant_blocks.h"

#define QMB 4  /* x rows a weight block meets while it is in registers */

/* ---- 32 bytes of weight codes, and their products with 32 int8 of x ------------------------- */
#if defined(__AVX2__)
typedef __m256i q32;  /* 32 codes */
typedef __m256 qacc;  /* float partial sums */
typedef __m256i qsum; /* int32 partial sums of one block */
INLINE q32 q32_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE q32 q32_and(q32 v, int m) { return _mm256_and_si256(v, _mm256_set1_epi8((char)m)); }
INLINE q32 q32_shr(q32 v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }
INLINE q32 q32_or_shl4(q32 lo, q32 hi) { return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)); }
/* 16 bytes of nibbles -> 32 codes: the low nibbles, then the high ones (Q4_0's order) */
INLINE q32 q32_nibbles16(const uint8_t *p) {
    __m128i t = _mm_loadu_si128((const __m128i *)p);
    return q32_and(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), 15);
}
/* codes 0..127 times x */
INLINE qsum dot_u(q32 w, q32 x) {
#if defined(DPBUSD256)
    return DPBUSD256(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}
/* signed codes times x: |w| times x with w's sign */
INLINE qsum dot_s(q32 w, q32 x) { return dot_u(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
/* codes 0..127 times x, the first 16 products times s0 and the last 16 times s1 */
INLINE qsum dot_u_scaled(q32 w, q32 x, int s0, int s1) {
    __m256i s = _mm256_set_m128i(_mm_set1_epi16((short)s1), _mm_set1_epi16((short)s0));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), s);
}
INLINE qacc qacc_zero(void) { return _mm256_setzero_ps(); }
INLINE qacc qacc_fma(qacc a, qsum s, float d) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d), a); }
INLINE float qacc_sum(qacc a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
typedef int8x16x2_t q32;
typedef float32x4_t qacc;
typedef int32x4_t qsum;
INLINE q32 q32_load(const void *p) { return vld1q_s8_x2((const int8_t *)p); }
INLINE q32 q32_and(q32 v, int m) {
    int8x16_t k = vdupq_n_s8((int8_t)m);
    return (q32){{vandq_s8(v.val[0], k), vandq_s8(v.val[1], k)}};
}
INLINE q32 q32_shr(q32 v, int n) {  /* byte lanes, logical */
    int8x16_t c = vdupq_n_s8((int8_t)-n);
    return (q32){{vreinterpretq_s8_u8(vshlq_u8(vreinterpretq_u8_s8(v.val[0]), c)),
                  vreinterpretq_s8_u8(vshlq_u8(vreinterpretq_u8_s8(v.val[1]), c))}};
}
INLINE q32 q32_or_shl4(q32 lo, q32 hi) {
    return (q32){{vorrq_s8(lo.val[0], vshlq_n_s8(hi.val[0], 4)), vorrq_s8(lo.val[1], vshlq_n_s8(hi.val[1], 4))}};
}
INLINE q32 q32_nibbles16(const uint8_t *p) {
    uint8x16_t t = vld1q_u8(p);
    return (q32){{vreinterpretq_s8_u8(vandq_u8(t, vdupq_n_u8(15))), vreinterpretq_s8_u8(vshrq_n_u8(t, 4))}};
}
INLINE int32x4_t dot16(int8x16_t w, int8x16_t x) {
    int16x8_t p = vmull_s8(vget_low_s8(w), vget_low_s8(x));
    return vpaddlq_s16(vmlal_s8(p, vget_high_s8(w), vget_high_s8(x)));
}
INLINE qsum dot_u(q32 w, q32 x) { return vaddq_s32(dot16(w.val[0], x.val[0]), dot16(w.val[1], x.val[1])); }
INLINE qsum dot_s(q32 w, q32 x) { return dot_u(w, x); }  /* (signed products already) */
INLINE qsum dot_u_scaled(q32 w, q32 x, int s0, int s1) {
    return vmlaq_n_s32(vmulq_n_s32(dot16(w.val[0], x.val[0]), s0), dot16(w.val[1], x.val[1]), s1);
}
INLINE qacc qacc_zero(void) { return vdupq_n_f32(0.f); }
INLINE qacc qacc_fma(qacc a, qsum s, float d) { return vfmaq_n_f32(a, vcvtq_f32_s32(s), d); }
INLINE float qacc_sum(qacc a) { return vaddvq_f32(a); }
#else
typedef struct { int8_t b[32]; } q32;
typedef float qacc;
typedef int32_t qsum;
INLINE q32 q32_load(const void *p) { q32 v; memcpy(v.b, p, 32); return v; }
INLINE q32 q32_and(q32 v, int m) { for (int i = 0; i < 32; i++) v.b[i] &= m; return v; }
INLINE q32 q32_shr(q32 v, int n) { for (int i = 0; i < 32; i++) v.b[i] = (int8_t)((uint8_t)v.b[i] >> n); return v; }
INLINE q32 q32_or_shl4(q32 lo, q32 hi) { for (int i = 0; i < 32; i++) lo.b[i] |= (int8_t)(hi.b[i] << 4); return lo; }
INLINE q32 q32_nibbles16(const uint8_t *p) {
    q32 v;
    for (int i = 0; i < 16; i++) v.b[i] = p[i] & 15, v.b[i + 16] = p[i] >> 4;
    return v;
}
INLINE qsum dot_u(q32 w, q32 x) { int32_t s = 0; for (int i = 0; i < 32; i++) s += w.b[i] * x.b[i]; return s; }
INLINE qsum dot_s(q32 w, q32 x) { return dot_u(w, x); }
INLINE qsum dot_u_scaled(q32 w, q32 x, int s0, int s1) {
    int32_t a = 0, b = 0;
    for (int i = 0; i < 16; i++) a += w.b[i] * x.b[i], b += w.b[i + 16] * x.b[i + 16];
    return a * s0 + b * s1;
}
INLINE qacc qacc_zero(void) { return 0.f; }
INLINE qacc qacc_fma(qacc a, qsum s, float d) { return a + (float)s * d; }
INLINE float qacc_sum(qacc a) { return a; }
#endif

/* ---- x rounded to int8 blocks ---------------------------------------------------------------- */
/* each lane to the nearest integer, ties to even: an instruction of its own, so that the product
 * before it is rounded to float32 first (never fused into one multiply-add with the rounding) */
INLINE vf round_even(vf v) {
#if defined(__AVX512F__)
    return (vf)_mm512_roundscale_ps((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__AVX2__)
    return (vf)_mm256_round_ps((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__aarch64__) && defined(__ARM_NEON)
    return (vf)vrndnq_f32((float32x4_t)v);
#else
    for (int l = 0; l < VL; l++) v[l] = __builtin_rintf(v[l]);
    return v;
#endif
}

/* The rows of x [M, ldx] (dt) as int8 [M, K] (qx), with each block's d [M, K / 32] (dx), the
 * sums of each 16 rounded values times d [M, K / 16] (sx) and each block's sum [M, K / 32] (xsum).
 * K is whole blocks of 32. */
void omni_quantize_x(const void *x, int64_t ldx, int dt, int M, int K, int8_t *qx, float *dx, float *sx,
                     float *s32, int32_t *xsum) {
    typedef int8_t vq8 __attribute__((vector_size(VL)));
    for (int m = 0; m < M; m++)
        for (int b = 0; b < K / 32; b++) {
            size_t i0 = (size_t)m * ldx + 32 * b;
            vf v[32 / VL], amax = (vf){0};
#pragma GCC unroll 8
            for (int c = 0; c < 32 / VL; c++) {
                v[c] = ld(x, dt, i0 + c * VL);
                vf a = (vf)((vu)v[c] & 0x7fffffffu);
                amax = vsel((vu)(a > amax), a, amax);
            }
            float d = hmax(amax) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            int8_t *q = qx + (size_t)m * K + 32 * b;
            vf s16[2] = {{0}, {0}};
#pragma GCC unroll 8
            for (int c = 0; c < 32 / VL; c++) {
                vf r = round_even(v[c] * id);  /* integers -127..127 */
                vq8 r8 = __builtin_convertvector(__builtin_convertvector(r, vi), vq8);
                memcpy(q + c * VL, &r8, VL);
                s16[c * VL / 16] += r;
            }
            dx[(size_t)m * (K / 32) + b] = d;
            sx[(size_t)m * (K / 16) + 2 * b] = d * hsum(s16[0]);
            sx[(size_t)m * (K / 16) + 2 * b + 1] = d * hsum(s16[1]);
            xsum[(size_t)m * (K / 32) + b] = (int32_t)(hsum(s16[0]) + hsum(s16[1]));
            s32[(size_t)m * (K / 32) + b] = d * (float)xsum[(size_t)m * (K / 32) + b];
        }
}

/* ---- a weight row against up to QMB rows of rounded x ---------------------------------------- */
#define XQ(X, m, e) q32_load((X)->q + (size_t)(m) * (X)->K + (e))
#define XD(X, m, b) ((X)->d[(size_t)(m) * ((X)->K / 32) + (b)])
#define XS(X, m, i) ((X)->s[(size_t)(m) * ((X)->K / 16) + (i)])

/* One weight block (32 weights; Q4_K / Q6_K: 256) against MB rows: its products go into A[m] (and
 * B[m] for a second chain of additions), its offset terms into C[m] (8 lanes, summed and
 * subtracted at the end). */
typedef float v8fu __attribute__((vector_size(32), aligned(4), may_alias));

INLINE float hsum8(v8f v) {
    v4f a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (a[0] + a[2]) + (a[1] + a[3]);
}

INLINE void blk_q8_0(const uint8_t *w, const xq *X, int b, const int MB, qacc *A, qacc *B, v8f *C) {
    (void)B, (void)C;
    const uint8_t *blk = w + (size_t)b * 34;
    float d = f16_to_f32(u16_at(blk));
    q32 q = q32_load(blk + 2);
    for (int m = 0; m < MB; m++) A[m] = qacc_fma(A[m], dot_s(q, XQ(X, m, 32 * b)), d * XD(X, m, b));
}

INLINE void blk_q4_0(const uint8_t *w, const xq *X, int b, const int MB, qacc *A, qacc *B, v8f *C) {
    (void)B;  /* (the layers run Q4_0 as Q4_0X8; this is for Q4_0 rows as they are) */
    const uint8_t *blk = w + (size_t)b * 18;
    float d = f16_to_f32(u16_at(blk));
    q32 q = q32_nibbles16(blk + 2);
    for (int m = 0; m < MB; m++) {
        A[m] = qacc_fma(A[m], dot_u(q, XQ(X, m, 32 * b)), d * XD(X, m, b));
        C[m][b & 7] += (8.0f * d) * X->s32[(size_t)m * (X->K / 32) + b];
    }
}

#if defined(__AVX2__)
/* x86: the 8 (scale, min) pairs unpacked 4 at a time in 32-bit words, each sub-block's d * scale
 * times x's block d in one vector (a lane a sub-block: Q4_K's sub-blocks are x's blocks) */
INLINE void blk_q4_k(const uint8_t *w, const xq *X, int b, const int MB, qacc *A, qacc *B, v8f *C) {
    const uint8_t *blk = w + (size_t)b * 144, *qs = blk + 16;
    float d = f16_to_f32(u16_at(blk)), dmin = f16_to_f32(u16_at(blk + 2));
    uint32_t u[3];
    memcpy(u, blk + 4, 12);
    uint32_t sc_lo = u[0] & 0x3f3f3f3fu, mn_lo = u[1] & 0x3f3f3f3fu;
    uint32_t sc_hi = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    uint32_t mn_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)sc_lo, (int)sc_hi, 0, 0)));
    __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)mn_lo, (int)mn_hi, 0, 0)));
    v8f mins = (v8f)_mm256_mul_ps(mnf, _mm256_set1_ps(dmin));  /* times x's 8 block sums (s32) */
    __m256 dsc = _mm256_mul_ps(_mm256_set1_ps(d), scf), sd[QMB];
    for (int m = 0; m < MB; m++) {
        C[m] += mins * *(const v8fu *)(X->s32 + (size_t)m * (X->K / 32) + 8 * b);
        sd[m] = _mm256_mul_ps(dsc, _mm256_loadu_ps(&XD(X, m, 8 * b)));
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {  /* 32-byte run j: sub-blocks 2j (low nibbles), 2j + 1 (high) */
        __m256i run = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        q32 lo = _mm256_and_si256(run, _mm256_set1_epi8(15));
        q32 hi = _mm256_and_si256(_mm256_srli_epi16(run, 4), _mm256_set1_epi8(15));
        int xb = 8 * b + 2 * j;
        for (int m = 0; m < MB; m++) {
            A[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u(lo, XQ(X, m, 32 * xb))),
                                   _mm256_permutevar8x32_ps(sd[m], _mm256_set1_epi32(2 * j)), A[m]);
            B[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u(hi, XQ(X, m, 32 * xb + 32))),
                                   _mm256_permutevar8x32_ps(sd[m], _mm256_set1_epi32(2 * j + 1)), B[m]);
        }
    }
}
#else
INLINE void blk_q4_k(const uint8_t *w, const xq *X, int b, const int MB, qacc *A, qacc *B, v8f *C) {
    const uint8_t *blk = w + (size_t)b * 144, *qs = blk + 16;
    float d = f16_to_f32(u16_at(blk)), dmin = f16_to_f32(u16_at(blk + 2));
    uint8_t sc[8], mn[8];
    k_scales(blk + 4, sc, mn);
    v8f mins;  /* dmin * the 8 sub-blocks' minimums: times x's 8 block sums (s32), all at once */
    for (int i = 0; i < 8; i++) mins[i] = (float)mn[i];
    mins *= dmin;
    for (int m = 0; m < MB; m++) C[m] += mins * *(const v8fu *)(X->s32 + (size_t)m * (X->K / 32) + 8 * b);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {  /* 32-byte run j: sub-blocks 2j (low nibbles), 2j + 1 (high) */
        q32 run = q32_load(qs + 32 * j);
        q32 lo = q32_and(run, 15), hi = q32_and(q32_shr(run, 4), 15);
        int xb = 8 * b + 2 * j;  /* x's block of sub-block 2j */
        float ds0 = d * (float)sc[2 * j], ds1 = d * (float)sc[2 * j + 1];
        for (int m = 0; m < MB; m++) {
            A[m] = qacc_fma(A[m], dot_u(lo, XQ(X, m, 32 * xb)), ds0 * XD(X, m, xb));
            B[m] = qacc_fma(B[m], dot_u(hi, XQ(X, m, 32 * xb + 32)), ds1 * XD(X, m, xb + 1));
        }
    }
}
#endif

#if defined(__AVX2__)
/* x86: the 16 scales as floats once a block, each part's two (lanes 0-3: its first 16 weights,
 * 4-7: the last 16, as dot_u lays out its sums) times d times x's block d in one vector, so a
 * part is its codes, one integer dot and one multiply-add per x row */
INLINE void blk_q6_k(const uint8_t *w, const xq *X, int b, const int MB, qacc *A, qacc *B, v8f *C) {
    const uint8_t *blk = w + (size_t)b * 210, *ql = blk, *qh = blk + 128;
    __m128i s8 = _mm_loadu_si128((const __m128i *)(blk + 192));
    __m256 sc_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8));
    __m256 sc_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8)));
    float d = f16_to_f32(u16_at(blk + 208));
    __m256 vd = _mm256_set1_ps(d);
    v8f sc0 = (v8f)_mm256_mul_ps(sc_lo, _mm256_set1_ps(32.0f * d)), sc1 = (v8f)_mm256_mul_ps(sc_hi, _mm256_set1_ps(32.0f * d));
    __m256 sd[QMB][2];  /* [m][h]: scale i of the half h times d times x's d of block i / 2 */
    const __m256i pair_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), pair_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    for (int m = 0; m < MB; m++) {
        const float *s16 = X->s + (size_t)m * (X->K / 16) + 16 * b;
        C[m] += sc0 * *(const v8fu *)s16 + sc1 * *(const v8fu *)(s16 + 8);
        __m256 xd = _mm256_mul_ps(vd, _mm256_loadu_ps(&XD(X, m, 8 * b)));
        sd[m][0] = _mm256_mul_ps(sc_lo, _mm256_permutevar8x32_ps(xd, pair_lo));
        sd[m][1] = _mm256_mul_ps(sc_hi, _mm256_permutevar8x32_ps(xd, pair_hi));
    }
    const __m256i m30 = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m256i high = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        __m256i low[2] = {_mm256_loadu_si256((const __m256i *)(ql + 64 * h)),
                          _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32))};
#pragma GCC unroll 4
        for (int part = 0; part < 4; part++) {  /* weights 128 h + 32 part + l, l < 32: codes 0..63 */
            __m256i lo = part >= 2 ? _mm256_srli_epi16(low[part & 1], 4) : low[part & 1];
            lo = _mm256_and_si256(lo, _mm256_set1_epi8(15));
            __m256i hb = part == 0 ? _mm256_slli_epi16(high, 4) : part == 1 ? _mm256_slli_epi16(high, 2)
                       : part == 2 ? high : _mm256_srli_epi16(high, 2);  /* bits 2 part.. to 4..5 */
            q32 q = _mm256_or_si256(lo, _mm256_and_si256(hb, m30));
            int xb = 8 * b + 4 * h + part;
            const __m256i pick = _mm256_setr_epi32(2 * part, 2 * part, 2 * part, 2 * part, 2 * part + 1,
                                                   2 * part + 1, 2 * part + 1, 2 * part + 1);
            qacc *T = part & 1 ? B : A;
            for (int m = 0; m < MB; m++)
                T[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u(q, XQ(X, m, 32 * xb))),
                                       _mm256_permutevar8x32_ps(sd[m][h], pick), T[m]);
        }
    }
}
#else
INLINE void blk_q6_k(const uint8_t *w, const xq *X, int b, const int MB, qacc *A, qacc *B, v8f *C) {
    const uint8_t *blk = w + (size_t)b * 210, *ql = blk, *qh = blk + 128;
    const int8_t *scales = (const int8_t *)(blk + 192);
    float d = f16_to_f32(u16_at(blk + 208));
    v8f sc0, sc1;  /* 32 d * the 16 scales: times x's 16 sums of 16 (sx), all at once */
    for (int i = 0; i < 8; i++) sc0[i] = (float)scales[i], sc1[i] = (float)scales[i + 8];
    sc0 *= 32.0f * d, sc1 *= 32.0f * d;
    for (int m = 0; m < MB; m++) {
        const float *s16 = X->s + (size_t)m * (X->K / 16) + 16 * b;
        C[m] += sc0 * *(const v8fu *)s16 + sc1 * *(const v8fu *)(s16 + 8);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        q32 high = q32_load(qh + 32 * h), low[2] = {q32_load(ql + 64 * h), q32_load(ql + 64 * h + 32)};
#pragma GCC unroll 4
        for (int part = 0; part < 4; part++) {  /* weights 128 h + 32 part + l, l < 32: codes 0..63 */
            q32 lo = q32_and(part >= 2 ? q32_shr(low[part & 1], 4) : low[part & 1], 15);
            q32 q = q32_or_shl4(lo, q32_and(q32_shr(high, 2 * part), 3));
            int e = 128 * h + 32 * part, xb = 8 * b + e / 32;
            int s0 = scales[e / 16], s1 = scales[e / 16 + 1];
            qacc *T = part & 1 ? B : A;
            for (int m = 0; m < MB; m++)
                T[m] = qacc_fma(T[m], dot_u_scaled(q, XQ(X, m, 32 * xb), s0, s1), d * XD(X, m, xb));
        }
    }
}
#endif

INLINE void blk_i8(const uint8_t *w, const xq *X, int b, const int MB, qacc *A, qacc *B, v8f *C) {
    (void)B, (void)C;
    q32 q = q32_load(w + 32 * (size_t)b);
    for (int m = 0; m < MB; m++) A[m] = qacc_fma(A[m], dot_s(q, XQ(X, m, 32 * b)), XD(X, m, b));
}

/* out[m] = the row of W at w times x row m, m < MB (a constant where it is inlined: the sums
 * stay in registers); blocks in pairs, each of a pair on its own chains of additions */
#define Q8DOT(name, block, bytes, BLK)                                                                   \
    INLINE void name##_rows(const uint8_t *w, const xq *X, const int MB, float *out) {             \
        qacc a[2][QMB], b2[2][QMB];                                                               \
        v8f c[2][QMB];                                                                            \
        for (int m = 0; m < MB; m++)                                                              \
            a[0][m] = a[1][m] = b2[0][m] = b2[1][m] = qacc_zero(), c[0][m] = c[1][m] = (v8f){0};  \
        int nb = X->K / (block), b = 0;                                                           \
        for (; b + 1 < nb; b += 2) {                                                              \
            prefetch_ahead(w + (size_t)b * (bytes), 2 * (bytes));                                 \
            BLK(w, X, b, MB, a[0], b2[0], c[0]);                                                  \
            BLK(w, X, b + 1, MB, a[1], b2[1], c[1]);                                              \
        }                                                                                         \
        if (b < nb) BLK(w, X, b, MB, a[0], b2[0], c[0]);                                          \
        for (int m = 0; m < MB; m++)                                                              \
            out[m] = qacc_sum((a[0][m] + a[1][m]) + (b2[0][m] + b2[1][m])) - hsum8(c[0][m] + c[1][m]); \
    }                                                                                             \
    static void name(const uint8_t *w, const xq *X, int MB, float *out) {                         \
        WITH_PREFETCH_TARGET(switch (MB) {                                                        \
            case 1: name##_rows(w, X, 1, out); break;                                             \
            case 2: name##_rows(w, X, 2, out); break;                                             \
            case 3: name##_rows(w, X, 3, out); break;                                             \
            default: name##_rows(w, X, 4, out); break;                                            \
        });                                                                                       \
    }

Q8DOT(q8dot_q8_0, 32, 34, blk_q8_0)
Q8DOT(q8dot_q4_0, 32, 18, blk_q4_0)
Q8DOT(q8dot_q4_k, 256, 144, blk_q4_k)
Q8DOT(q8dot_q6_k, 256, 210, blk_q6_k)
Q8DOT(q8dot_i8, 32, 32, blk_i8)

typedef void (*q8dot_fn)(const uint8_t *, const xq *, int, float *);
static const q8dot_fn Q8DOT_FNS[] = {q8dot_q8_0, q8dot_q4_0, q8dot_q4_k, q8dot_q6_k, q8dot_i8};  /* (kinds <= I8) */

/* omni_qlinear with x rounded to int8 blocks (quant.c checks the arguments; here K % 32 == 0).
 * Each thread takes a contiguous range of W's rows and reads each once per group of QMB x rows. */
int omni_qlinear_q8(const void *x, int64_t ldx, const uint8_t *w, const float *scale, void *y, int64_t ldy,
                    int M, int N, int K, int kind, int dt, int nthreads) {
    size_t nb = (size_t)M * (K / 32);
    int8_t *qx = malloc((size_t)M * K + sizeof(float) * 5 * nb + 64);
    if (!qx) return -1;
    float *dx = (float *)(((uintptr_t)(qx + (size_t)M * K) + 63) & ~(uintptr_t)63), *sx = dx + nb, *s32 = sx + 2 * nb;
    int32_t *xsum = (int32_t *)(s32 + nb);
    omni_quantize_x(x, ldx, dt, M, K, qx, dx, sx, s32, xsum);
    if (is_x8(kind)) {
        xq X = {qx, dx, sx, s32, xsum, K};
        omni_qx8_rows(kind, w, &X, y, ldy, M, N, dt, nthreads);
        free(qx);
        return 0;
    }
    size_t rb = qrow_bytes(kind, K);
    q8dot_fn dot = Q8DOT_FNS[kind];
    if (nthreads < 1) nthreads = 1;
    nthreads = threads_for((int64_t)N * K, nthreads);
#pragma omp parallel num_threads(nthreads)
    {
        int64_t n0, n1;
        thread_share(N, &n0, &n1);
        float out[QMB];
        for (int64_t i = 0; i < n_steps(n0, n1); i++) {
            int64_t n = streamed_unit(i, n0, n1);
            if (n >= n1) continue;
            for (int m0 = 0; m0 < M; m0 += QMB) {
                int mb = M - m0 < QMB ? M - m0 : QMB;
                xq X = {qx + (size_t)m0 * K, dx + (size_t)m0 * (K / 32), sx + (size_t)m0 * (K / 16),
                        s32 + (size_t)m0 * (K / 32), xsum + (size_t)m0 * (K / 32), K};
                dot(w + (size_t)n * rb, &X, mb, out);
                for (int m = 0; m < mb; m++)
                    st1(y, dt, (size_t)(m0 + m) * ldy + n, kind == I8 ? out[m] * scale[n] : out[m]);
            }
        }
    }
    free(qx);
    return 0;
}
