/* The quantised blocks' layouts, decoded a vector at a time (quant.c's products and
 * quant_gemm.c's panels share them). Formats: GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
 * Q6_K as the file stores them, and omniinfer's int8 (a row of int8 and one float32 scale). */
#ifndef OMNI_QUANT_BLOCKS_H
#define OMNI_QUANT_BLOCKS_H
#include "omni.h"
#include "prefetch.h"

enum { Q8_0 = 0, Q4_0 = 1, Q4_K = 2, Q6_K = 3, I8 = 4, Q4_0X8 = 5, Q8_0X8 = 6, Q4_KX8 = 7, Q6_KX8 = 8,
       Q4_1 = 9, Q5_0 = 10, Q5_1 = 11, Q5_K = 12, Q4_1X8 = 13, Q5_0X8 = 14, Q5_1X8 = 15, Q5_KX8 = 16,
       IQ4_NLX8 = 17, IQ4_XSX8 = 18, Q2_KX8 = 19, Q3_KX8 = 20, F8 = 21, NUM_KINDS = 22 };
/* F8: FP8 checkpoints' weights (omniinfer/quantization/fp8.py): a row of K float8 e4m3 bytes as
 * the file holds them, and a float32 scale per 128 of its columns (scale [N, K / 128]: the CPU
 * plugin spreads a coarser scale over them); float activations only. */
#define F8_BLOCK 128
/* Q4_0X8: Q4_0 rows repacked in groups of 8 for the int8-activation path (quant_x8.c). Group g
 * (rows 8g .. 8g + 7; a last group padded with zero rows) is K / 32 blocks of 144 bytes: the 8
 * rows' float16 d, then 4 chunks of 32 bytes; byte 4r + i of chunk c holds row r's weight
 * 8c + i in its low nibble and weight 8c + 4 + i in its high one. The same bytes as Q4_0's.
 * Q8_0X8 likewise from Q8_0: blocks of 272 bytes, the 8 rows' d, then 8 chunks of 32 bytes; byte
 * 4r + i of chunk j holds row r's (signed) weight 4j + i.
 * Q4_KX8 likewise from Q4_K: blocks of 1152 bytes (256 columns of 8 rows): the 8 rows' float16 d,
 * their float16 dmin, their 12 bytes of packed scales and minimums (byte 8t + r: row r's byte t),
 * then sub-block s (weights 32s .. 32s + 31) at 128 + 128s, its codes as Q4_0X8's chunks (byte
 * 4r + i of chunk c: row r's weight 32s + 8c + i in the low nibble, 32s + 8c + 4 + i in the high).
 * Q6_KX8 from Q6_K: blocks of 1680 bytes: the 8 rows' float16 d, their 16 int8 scales (byte 8t + r:
 * row r's scale t), then sub-block s at 144 + 192s: the low 4 bits of its codes as Q4_0X8's
 * chunks, then their top 2 bits (quant_x8.c says where).
 * Q4_1X8, Q5_0X8, Q5_1X8 from Q4_1, Q5_0, Q5_1 (32 columns a block): the 8 rows' float16 d, their
 * float16 m (Q4_1, Q5_1), then the low 4 bits of the codes as Q4_0X8's 4 chunks, then (Q5_0, Q5_1)
 * their fifth bits in 32 bytes: bit k of byte 4r + i is the fifth bit of the code in byte 4r + i
 * of code vector k, chunk k / 2's low (k even) or high nibbles: row r's weight 8 (k / 2) + 4 (k & 1)
 * + i (x5_codes). Blocks of 160, 176 and 192 bytes.
 * Q5_KX8 from Q5_K: blocks of 1408 bytes: the 8 rows' d, dmin and 12 scale bytes as Q4_KX8's, then
 * sub-block s at 128 + 160s: its low 4 bits as Q4_KX8's chunks, then their fifth bits as Q5_0X8's.
 * IQ4_NLX8 from IQ4_NL (the codes index IQ4_VALUES; no row-at-a-time kind of its own): Q4_0X8's
 * layout, byte for byte. IQ4_XSX8 from IQ4_XS: blocks of 1088 bytes (256 columns of 8 rows): the
 * 8 rows' float16 d, their 2 scales_h bytes (byte 16 + 8k + r: row r's byte k), their 4 scales_l
 * bytes (byte 32 + 8t + r: row r's byte t), then sub-block s (weights 32s .. 32s + 31) at
 * 64 + 128s, its codes as Q4_0X8's chunks. Q2_KX8 from Q2_K: blocks of 672 bytes: the 8 rows' d,
 * their dmin, their 16 scale bytes (byte 32 + 8t + r: row r's byte t, a 4-bit scale and minimum
 * of weights 16t .. 16t + 15), then sub-block s at 160 + 64s: 2 vectors of 32 bytes (bits 2b,
 * 2b + 1 of byte 4r + i of vector a: row r's weight 32s + 4 (4a + b) + i). Q3_KX8 from Q3_K:
 * blocks of 880 bytes: the 8 rows' d, their 12 scale bytes (byte 16 + 8t + r: row r's byte t),
 * then sub-block s at 112 + 96s: its 2-bit codes as Q2_KX8's, then their hmask bits in 32 bytes
 * (bit k of byte 4r + i: row r's weight 32s + 4k + i). The IQ4 kinds, Q2_K and Q3_K have only
 * the int8-activation path. */
/* vpdpbusd on 8 int32 lanes (each += 4 products of unsigned by signed bytes): AVX-512 VNNI's
 * EVEX form, or AVX-VNNI's VEX one (the avx2_vnni level: Intel cores since Alder Lake, Zen 5) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define DPBUSD256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
/* set in a kind code: x is rounded to int8 blocks and multiplied in integers (quant_q8.c) */
#define QACT_INT8 64

INLINE int qblock(int kind) {
    return kind == Q4_K || kind == Q5_K || kind == Q6_K || kind == Q4_KX8 || kind == Q5_KX8 || kind == Q6_KX8 ||
                   kind == IQ4_XSX8 || kind == Q2_KX8 || kind == Q3_KX8
               ? 256
         : kind == I8 ? 1 : kind == F8 ? F8_BLOCK : 32;
}

/* a block's bytes (X8: a row's share of its group's block) */
INLINE int qblock_bytes(int kind) {
    static const int bytes[NUM_KINDS] = {34, 18, 144, 210, 0, 18, 34, 144, 210, 20, 22, 24, 176, 20, 22, 24, 176,
                                         18, 136, 84, 110, F8_BLOCK};
    return bytes[kind];
}

INLINE size_t qrow_bytes(int kind, int K) {
    return kind == I8 || kind == F8 ? (size_t)K : (size_t)(K / qblock(kind)) * qblock_bytes(kind);
}

/* the kinds held in groups of 8 rows (quant_x8.c; int8 activations only) */
INLINE int is_x8(int kind) { return (kind >= Q4_0X8 && kind <= Q6_KX8) || (kind >= Q4_1X8 && kind <= Q3_KX8); }

/* IQ4_NL / IQ4_XS: the int8 values a 4-bit code indexes (llama.cpp's kvalues_iq4nl;
 * omniinfer/quantization/gguf_blocks.py's IQ4_VALUES) */
static const int8_t IQ4_VALUES[16] __attribute__((unused)) = {
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* IQ4_XSX8: the 8 rows' 6-bit scales (0..63; the weight's is d * (scale - 32)) of sub-block s
 * as 8 bytes to a 64-bit word: scales_l byte s / 2's nibble s & 1, scales_h byte s / 4's bits
 * 2 (s & 3), 2 (s & 3) + 1 above it */
INLINE uint64_t xs_scales(const uint8_t *blk, int s) {
    uint64_t lo, hi;
    memcpy(&lo, blk + 32 + 8 * (s / 2), 8);
    memcpy(&hi, blk + 16 + 8 * (s / 4), 8);
    return ((lo >> (4 * (s & 1))) & 0x0f0f0f0f0f0f0f0full) | (((hi >> (2 * (s & 3))) & 0x0303030303030303ull) << 4);
}

/* Q3_KX8: the 8 rows' 6-bit scales (0..63) of 16-weight group t as 8 bytes to a 64-bit word:
 * scale byte t & 7's nibble t >> 3, byte 8 + (t & 3)'s bits 2 (t >> 2), 2 (t >> 2) + 1 above */
INLINE uint64_t k3_scales(const uint8_t *blk, int t) {
    uint64_t lo, hi;
    memcpy(&lo, blk + 16 + 8 * (t & 7), 8);
    memcpy(&hi, blk + 16 + 8 * (8 + (t & 3)), 8);
    return ((lo >> (4 * (t >> 3))) & 0x0f0f0f0f0f0f0f0full) | (((hi >> (2 * (t >> 2))) & 0x0303030303030303ull) << 4);
}

INLINE uint16_t u16_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* F8: VL float8 e4m3 bytes at p as float32, each exactly 2^-8 times its value (the caller
 * multiplies by F8_UNIT, or folds it into a scale). A byte s.eeee.mmm shifted left by 7 in a
 * 16-bit lane is the float16 with exponent field e and mantissa m << 7: 2^-8 times the e4m3
 * value, subnormals (e = 0) included; its sign, landed on bit 14, is moved to bit 15 by adding
 * that bit to itself. Then the CPU's float16 conversion (F16C, AVX-512, AArch64: exact, and
 * untouched by a denormals-are-zero mode). Without one (the generic level), the float32's bits
 * directly: exponent rebiased by 112, a subnormal as the normal formula at e = 1 less 2^-14.
 * (A NaN byte, 0x7f / 0xff, reads as +-480; checkpoints hold none: their largest value is 448.) */
#define F8_UNIT 256.0f
#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
/* AVX2: e4m3 bytes sign-extended to 16-bit lanes as float16 bits, 2^-8 times their values: shifted
 * left by 7, the extension puts the sign on bits 14 and 15, and clearing bit 14 (one AND, where
 * the zero-extended byte needs an AND and an ADD to move it) leaves the float16. Zen 3's float16
 * conversion bounds these products, so the ALU work around it counts. */
INLINE __m128i f8_halves(__m128i sx) {
    return _mm_and_si128(_mm_slli_epi16(sx, 7), _mm_set1_epi16((short)0xBFFF));
}
INLINE __m256i f8_halves16(__m256i sx) {
    return _mm256_and_si256(_mm256_slli_epi16(sx, 7), _mm256_set1_epi16((short)0xBFFF));
}
#endif
INLINE vf f8_chunk(const uint8_t *p) {
#if defined(__AVX512F__)
    __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    return (vf)_mm512_cvtph_ps(_mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000))));
#elif defined(__AVX2__) && defined(__F16C__)
    return (vf)_mm256_cvtph_ps(f8_halves(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p))));
#elif defined(__aarch64__) && defined(__ARM_NEON)
    uint32_t four;
    memcpy(&four, p, 4);
    uint16x4_t t = vshl_n_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(four)))), 7);
    return (vf)vcvt_f32_f16(vreinterpret_f16_u16(vadd_u16(t, vand_u16(t, vdup_n_u16(0x4000)))));
#else
    vu b = u8_widen(p), t = b & 0x7fu;
    vu sub = (vu)(t < 8u);  /* all ones where subnormal */
    vu bits = (t << 20) + (112u << 23) + (sub & (1u << 23));
    vf v = (vf)bits - (vf)(sub & 0x38800000u);  /* (2^-14) */
    return (vf)((vu)v | ((b & 0x80u) << 24));
#endif
}

/* Q4_0: weights e .. e + VL of a block's 32 (0-15 the low nibbles of its 16 bytes, 16-31 the high) */
INLINE vf q4_0_chunk(const uint8_t *qs, int e) {
    return u32_to_f((u8_widen(qs + e % 16) >> (e >= 16 ? 4 : 0)) & 15u);
}

/* Q4_K's 8 six-bit (scale, min) pairs */
INLINE void k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* Q4_K: weights c .. c + VL of sub-block s (the low nibbles of 32-byte run s / 2 for an even s,
 * the high ones for an odd s) */
INLINE vf q4_k_chunk(const uint8_t *qs, int s, int c) {
    return u32_to_f((u8_widen(qs + 32 * (s / 2) + c) >> ((s & 1) * 4)) & 15u);
}

/* Q5_0 / Q5_1: weights e .. e + VL of a block's 32: the nibble as Q4_0's, bit e + lane of qh (the
 * block's little-endian uint32 of fifth bits) as 16 */
INLINE vf q5_chunk(const uint8_t *qs, uint32_t qh, int e) {
    vu lane;
    for (int i = 0; i < VL; i++) lane[i] = (uint32_t)(e + i);
    vu hi = (((vu){0} + qh) >> lane) & 1u;
    return u32_to_f(((u8_widen(qs + e % 16) >> (e >= 16 ? 4 : 0)) & 15u) | (hi << 4));
}

/* Q5_K: weights c .. c + VL of sub-block s: the nibble as Q4_K's, bit s of qh[c + lane] as 16 */
INLINE vf q5_k_chunk(const uint8_t *qs, const uint8_t *qh, int s, int c) {
    vu hi = (u8_widen(qh + c) >> (unsigned)s) & 1u;
    return u32_to_f(((u8_widen(qs + 32 * (s / 2) + c) >> ((s & 1) * 4)) & 15u) | (hi << 4));
}

/* Q6_K: weights 128 h + 32 part + l .. + VL (l a multiple of VL below 32): 4 low bits from ql, 2
 * high from qh; 0..63 (the caller subtracts 32) */
INLINE vf q6_k_chunk(const uint8_t *ql, const uint8_t *qh, int h, int part, int l) {
    vu lo = (u8_widen(ql + 64 * h + 32 * (part & 1) + l) >> (part >= 2 ? 4 : 0)) & 15u;
    vu hi = (u8_widen(qh + 32 * h + l) >> (2 * part)) & 3u;
    return u32_to_f(lo | (hi << 4));
}

/* x rounded to int8 blocks of 32 (quant_q8.c): rows of K; per block d, the sums of each 16
 * rounded values times d, and the block's sum */
typedef struct {
    const int8_t *q;       /* [M, K] */
    const float *d;        /* [M, K / 32] */
    const float *s;        /* [M, K / 16] */
    const float *s32;      /* [M, K / 32]: the block's sum times d */
    const int32_t *isum;   /* [M, K / 32] */
    int K;
} xq;

#if defined(__AVX2__)
/* x's 4 int8 at p (any alignment) in every 32-bit lane. A load the broadcast folds into
 * (vpbroadcastd m32, or vpdpbusd's {1to8} operand): copying x's words to an int32 array first made
 * gcc move them through general registers, 2-3 more instructions a step */
typedef int32_t omni_i32u __attribute__((aligned(1), may_alias));
INLINE __m256i x4_at(const int8_t *p) { return _mm256_set1_epi32(*(const omni_i32u *)p); }
/* a Q4_0X8 block's (or a Q4_KX8 sub-block's) 4 chunks of nibbles at p -> its 8 code vectors */
INLINE void x8_nibbles(const uint8_t *p, __m256i c[8]) {
    const __m256i nib = _mm256_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * j));
        c[2 * j] = _mm256_and_si256(v, nib);
        c[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    }
}
/* the 8 rows' Sum code * x over those 8 code vectors and x's 32 int8 at x (codes 0..15: the
 * vpmaddubsw sums fit int16, 8 pairs of at most 15 * 127) */
INLINE __m256i x8_nibble_dot(const __m256i c[8], const int8_t *x) {
#if defined(DPBUSD256)
    /* two chains of 4: half the dependent vpdpbusd latency of one chain of 8 */
    __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) s[j & 1] = DPBUSD256(s[j & 1], c[j], x4_at(x + 4 * j));
    return _mm256_add_epi32(s[0], s[1]);
#else
    __m256i s16 = _mm256_maddubs_epi16(c[0], x4_at(x));
    for (int j = 1; j < 8; j++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(c[j], x4_at(x + 4 * j)));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
}
/* bits at hb of a group's 8 code vectors (bit k of each byte: vector k's) set as bit `bit` of the
 * byte in c[k]: the 5-bit kinds' fifth bits (x5_codes: 16), Q3_KX8's hmask bits (4) */
INLINE void x8_high_bits(const uint8_t *hb, __m256i c[8], const int bit) {
    const __m256i mask = _mm256_set1_epi8((char)(1 << bit));
    __m256i h = _mm256_loadu_si256((const __m256i *)hb);
    /* (16-bit shifts of at most bit left and 7 - bit right: what crosses into a byte's neighbour
     * lands outside the bit and is masked off) */
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        __m256i v = k <= bit ? _mm256_slli_epi16(h, bit - k) : _mm256_srli_epi16(h, k - bit);
        c[k] = _mm256_or_si256(c[k], _mm256_and_si256(v, mask));
    }
}
INLINE void x5_codes(const uint8_t *hb, __m256i c[8]) { x8_high_bits(hb, c, 4); }
/* x8_nibble_dot for codes 0..31: without VNNI the vpmaddubsw sums are widened every 4 (a pair is
 * at most 2 * 31 * 127: four fit int16, eight do not) */
INLINE __m256i x8_dot5(const __m256i c[8], const int8_t *x) {
#if defined(DPBUSD256)
    return x8_nibble_dot(c, x);
#else
    const __m256i one = _mm256_set1_epi16(1);
    __m256i s[2];
    for (int h = 0; h < 2; h++) {
        __m256i s16 = _mm256_maddubs_epi16(c[4 * h], x4_at(x + 16 * h));
        for (int j = 1; j < 4; j++)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(c[4 * h + j], x4_at(x + 16 * h + 4 * j)));
        s[h] = _mm256_madd_epi16(s16, one);
    }
    return _mm256_add_epi32(s[0], s[1]);
#endif
}
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
/* a Q4_0X8 block's (or a Q4_KX8 sub-block's) chunks at p, and (hb non-NULL) their fifth bits at
 * hb, as 8 code vectors of 4 weights for rows 0-3 (c[j][0]) and 4-7 (c[j][1]) */
INLINE void x8_codes_neon(const uint8_t *p, const uint8_t *hb, int8x16_t c[8][2]) {
    for (int j = 0; j < 4; j++)
        for (int h = 0; h < 2; h++) {
            uint8x16_t v = vld1q_u8(p + 32 * j + 16 * h);
            uint8x16_t lo = vandq_u8(v, vdupq_n_u8(15)), hi = vshrq_n_u8(v, 4);
            if (hb) {
                uint8x16_t b = vld1q_u8(hb + 16 * h), bit4 = vdupq_n_u8(16);
                /* bit 2j of each byte to bit 4 (lo), bit 2j + 1 (hi) */
                uint8x16_t b0 = j == 0 ? vshlq_n_u8(b, 4) : j == 1 ? vshlq_n_u8(b, 2) : j == 2 ? b : vshrq_n_u8(b, 2);
                uint8x16_t b1 = j == 0 ? vshlq_n_u8(b, 3) : j == 1 ? vshlq_n_u8(b, 1) : j == 2 ? vshrq_n_u8(b, 1)
                                                                                      : vshrq_n_u8(b, 3);
                lo = vorrq_u8(lo, vandq_u8(b0, bit4));
                hi = vorrq_u8(hi, vandq_u8(b1, bit4));
            }
            c[2 * j][h] = vreinterpretq_s8_u8(lo);
            c[2 * j + 1][h] = vreinterpretq_s8_u8(hi);
        }
}
/* the 8 rows' Sum code * x of those code vectors and x's 32 int8 at x: 4 int32 a half (rows 4h ..
 * 4h + 3). 8 products of at most 15 * 127 (31 * 127 for 5-bit codes) a 16-bit lane; 4-bit codes'
 * lanes add in pairs before widening, 5-bit ones (wide) cannot */
INLINE int32x4_t x8_dot_neon(int8x16_t c[8][2], const int8_t *x, int h, const int wide) {
    int32_t x4[8];
    memcpy(x4, x, 32);
    int16x8_t lo = vdupq_n_s16(0), hi = vdupq_n_s16(0);  /* rows 4h, 4h+1 | 4h+2, 4h+3 */
    for (int j = 0; j < 8; j++) {
        int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(x4[j]));
        lo = vmlal_s8(lo, vget_low_s8(c[j][h]), vget_low_s8(xv));
        hi = vmlal_s8(hi, vget_high_s8(c[j][h]), vget_high_s8(xv));
    }
    return wide ? vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)) : vpaddlq_s16(vpaddq_s16(lo, hi));
}
#endif
/* the code (0..31) of row r's weight 8c + 4h + i in a group's chunks at p and fifth bits at hb
 * (hb NULL: 4-bit codes) */
INLINE int x8_code(const uint8_t *p, const uint8_t *hb, int r, int c, int h, int i) {
    int v = (p[32 * c + 4 * r + i] >> (4 * h)) & 15;
    return hb ? v | (((hb[4 * r + i] >> (2 * c + h)) & 1) << 4) : v;
}
#define XMB 4  /* x rows a group's block meets while its codes are in registers (quant_x8.c) */
/* a group of 8 rows (at g) against x rows m0 .. m0 + MB - 1: out[m][r] */
typedef void (*x8_group_fn)(const uint8_t *g, const xq *X, int m0, int MB, float out[XMB][8]);
/* one of the row counts 1..XMB, a constant inside (so is the prefetch target: WITH_PREFETCH_TARGET) */
#define ROWS_SWITCH(fn)                                                  \
    switch (MB) {                                                        \
    case 1: fn(g, X, m0, 1, out); break;                                 \
    case 2: fn(g, X, m0, 2, out); break;                                 \
    case 3: fn(g, X, m0, 3, out); break;                                 \
    default: fn(g, X, m0, 4, out); break;                                \
    }
#define ROWS_OF(fn)                                                      \
    static void fn##_n(const uint8_t *g, const xq *X, int m0, int MB, float out[XMB][8]) { \
        WITH_PREFETCH_TARGET(ROWS_SWITCH(fn));                           \
    }
/* a group function that is fn with its format's flags fixed (qn_rows, kq_rows) */
#define GROUP_OF(name, fn, ...)                                                                  \
    INLINE void name(const uint8_t *g, const xq *X, int m0, const int MB, float out[XMB][8]) { \
        fn(g, X, m0, MB, out, __VA_ARGS__);                                                   \
    }
/* quant_kx8.c: the group function of Q4_KX8, Q5_KX8 or Q6_KX8 */
x8_group_fn omni_kx8_group(int kind);
/* quant_iq4x8.c: the group function of IQ4_NLX8 or IQ4_XSX8 */
x8_group_fn omni_iq4x8_group(int kind);
/* quant_k23x8.c: the group function of Q2_KX8 or Q3_KX8 */
x8_group_fn omni_k23x8_group(int kind);

/* quant_x8.c: the group function of any X8 kind (is_x8) */
x8_group_fn omni_x8_group(int kind);
/* quant_x8.c: y [M, ldy] (dt) = X @ W^T for W's N rows in groups of 8 (is_x8) at w */
void omni_qx8_rows(int kind, const uint8_t *w, const xq *X, void *y, int64_t ldy, int M, int N, int dt,
                   int nthreads);

/* quant_q8.c: the rows of x [M, ldx] (dt) rounded to int8 blocks of 32 (K whole blocks), with the
 * block scales and sums the int8 products read (xq's arrays; `s32` and `isum` [M, K / 32], `s`
 * [M, K / 16]) */
void omni_quantize_x(const void *x, int64_t ldx, int dt, int M, int K, int8_t *qx, float *dx, float *sx,
                     float *s32, int32_t *xsum);
/* quant_q8.c: the int8-activation path (kind without QACT_INT8; K whole blocks of 32) */
int omni_qlinear_q8(const void *x, int64_t ldx, const uint8_t *w, const float *scale, void *y, int64_t ldy,
                    int M, int N, int K, int kind, int dt, int nthreads);

/* quant_amx.c: products of at least AMX_MIN_ROWS rows of x on weights in groups of 8 (AMX_MIN_ROWS_I8
 * on int8 rows, whose int8 path is slower) go to AMX's bfloat16 tiles once omni_amx_enable(1) turned
 * them on (the crossovers measured: docs/quantization.md) */
#define AMX_MIN_ROWS 16
#define AMX_MIN_ROWS_I8 8
#define AMX_TILE 16  /* rows (and float32 columns) of a tile */
/* quant_amx_decode.c: group g (`kind`'s X8 layout; K columns) or int8 rows q .. (rows <= 8, a
 * scale each) -> a panel's B rows in bfloat16 pairs, b at the group's first column of row 0 */
void omni_amx_decode_group(int kind, const uint8_t *g, int K, uint16_t *b);
void omni_amx_decode_i8_rows(const int8_t *q, const float *scale, int rows, int K, uint16_t *b);
int omni_amx_takes(int kind, int M, int K);
int omni_qamx(const void *x, int64_t ldx, const uint8_t *w, const float *scale, void *y, int64_t ldy, int M, int N,
              int K, int kind, int dt, int nthreads);

/* quant_gemm.c: the path for many rows (xf: x as float32 rows of K) */
int omni_qgemm(const float *xf, const uint8_t *w, size_t row_bytes, const float *scale, void *y,
               int64_t ldy, int M, int N, int K, int kind, int dt, int nthreads);

#endif
