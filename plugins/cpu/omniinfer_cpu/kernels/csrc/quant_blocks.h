/* The quantised blocks' layouts, decoded a vector at a time (quant.c's products and
 * quant_gemm.c's panels share them). Formats: GGUF's Q8_0, Q4_0, Q4_K, Q6_K as the file stores
 * them, and omniinfer's int8 (a row of int8 and one float32 scale). */
#ifndef OMNI_QUANT_BLOCKS_H
#define OMNI_QUANT_BLOCKS_H
#include "omni.h"
#include "prefetch.h"

enum { Q8_0 = 0, Q4_0 = 1, Q4_K = 2, Q6_K = 3, I8 = 4, Q4_0X8 = 5, Q8_0X8 = 6, Q4_KX8 = 7, Q6_KX8 = 8 };
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
 * chunks, then their top 2 bits (quant_x8.c says where). */
/* vpdpbusd on 8 int32 lanes (each += 4 products of unsigned by signed bytes): AVX-512 VNNI's
 * EVEX form, or AVX-VNNI's VEX one (the avx2_vnni level: Intel cores since Alder Lake, Zen 5) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define DPBUSD256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
/* set in a kind code: x is rounded to int8 blocks and multiplied in integers (quant_q8.c) */
#define QACT_INT8 16

INLINE int qblock(int kind) { return kind == Q4_K || kind == Q6_K || kind == Q4_KX8 || kind == Q6_KX8 ? 256 : kind == I8 ? 1 : 32; }

INLINE size_t qrow_bytes(int kind, int K) {
    static const int bytes[] = {34, 18, 144, 210, 0, 18, 34, 144, 210};  /* (X8: a row's share of its group) */
    return kind == I8 ? (size_t)K : (size_t)(K / qblock(kind)) * bytes[kind];
}

INLINE uint16_t u16_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
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
    int32_t x4[8];
    memcpy(x4, x, 32);
#if defined(DPBUSD256)
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) s = DPBUSD256(s, c[j], _mm256_set1_epi32(x4[j]));
    return s;
#else
    __m256i s16 = _mm256_maddubs_epi16(c[0], _mm256_set1_epi32(x4[0]));
    for (int j = 1; j < 8; j++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(c[j], _mm256_set1_epi32(x4[j])));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
}
#endif
#define XMB 4  /* x rows a group's block meets while its codes are in registers (quant_x8.c) */
/* a group of 8 rows (at g) against x rows m0 .. m0 + MB - 1: out[m][r] */
typedef void (*x8_group_fn)(const uint8_t *g, const xq *X, int m0, int MB, float out[XMB][8]);
/* one of the row counts 1..XMB, a constant inside */
#define ROWS_OF(fn)                                                      \
    static void fn##_n(const uint8_t *g, const xq *X, int m0, int MB, float out[XMB][8]) { \
        switch (MB) {                                                    \
        case 1: fn(g, X, m0, 1, out); break;                             \
        case 2: fn(g, X, m0, 2, out); break;                             \
        case 3: fn(g, X, m0, 3, out); break;                             \
        default: fn(g, X, m0, 4, out); break;                            \
        }                                                                \
    }
/* quant_kx8.c: the group function of Q4_KX8 or Q6_KX8 */
x8_group_fn omni_kx8_group(int kind);

/* quant_x8.c: y [M, ldy] (dt) = X @ W^T for W's N rows in Q4_0X8, Q8_0X8, Q4_KX8 or Q6_KX8 groups at w */
void omni_qx8_rows(int kind, const uint8_t *w, const xq *X, void *y, int64_t ldy, int M, int N, int dt,
                   int nthreads);

/* quant_q8.c: the int8-activation path (kind without QACT_INT8; K whole blocks of 32) */
int omni_qlinear_q8(const void *x, int64_t ldx, const uint8_t *w, const float *scale, void *y, int64_t ldy,
                    int M, int N, int K, int kind, int dt, int nthreads);

/* quant_gemm.c: the path for many rows (xf: x as float32 rows of K) */
int omni_qgemm(const float *xf, const uint8_t *w, size_t row_bytes, const float *scale, void *y,
               int64_t ldy, int M, int N, int K, int kind, int dt, int nthreads);

#endif
