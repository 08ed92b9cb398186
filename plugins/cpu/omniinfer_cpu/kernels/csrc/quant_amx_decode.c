/* quant_amx.c's decoders: a group of 8 weight rows (quant_blocks.h's X8 layouts) or 8 int8 rows
 * decoded in vector registers to float32 (the reference's values: a scale times a code is exact in
 * float32, a minimum subtracted once), rounded to bfloat16 straight into a panel's B tile pairs.
 * Built where the level has AVX-512 BF16 (avx512_bf16); plain AVX-512, no AMX instruction. */
#include "quant_blocks.h"

#if defined(__x86_64__) && defined(__AVX512BF16__) && defined(__linux__)

/* ---- a group of 8 weight rows decoded into a panel's B tiles ------------------------------------
 * The groups hold 4 consecutive weights of a row in a 32-bit lane (a chunk: 8 rows x 4 bytes);
 * decoded to float32, a chunk is two vectors, rows 0-3 and 4-7 (lane 4r + i: row r's weight i).
 * Rounded to bfloat16, the even 32-bit words (each row's weights 0, 1) are B's row k / 2 and the
 * odd ones (2, 3) the next: 8 of the 16 columns of each (b: the group's first column there). */
static void emit_chunk(uint16_t *b, __m512 lo, __m512 hi) {
    const __m512i evens_odds = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m512i words = _mm512_permutexvar_epi32(evens_odds, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    _mm256_storeu_si256((__m256i *)b, _mm512_castsi512_si256(words));
    _mm256_storeu_si256((__m256i *)(b + 2 * AMX_TILE), _mm512_extracti64x4_epi64(words, 1));
}

/* 8 per-row floats (rows' d, ...) -> the lanes of rows 0-3 (hi: 4-7), each 4 times */
static __m512 rows_lo(__m256 v) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps256_ps512(v));
}
static __m512 rows_hi(__m256 v) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
                                 _mm512_castps256_ps512(v));
}
/* 8 rows' bytes (row r's in byte r of v) -> 8 float32 lanes */
static __m256 row_bytes(uint64_t v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v))); }
static __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* 16-bit shift counts: a in the low 256 bits, b in the high (each half of a vector of 64 codes its
 * own bit position) */
static __m512i by_half(int a, int b) {
    return _mm512_inserti64x4(_mm512_set1_epi16((short)a), _mm256_set1_epi16((short)b), 1);
}

/* 64 codes as int8 (v: bytes 0-31 one chunk, 32-63 another, `step` columns on) -> B, each row's
 * code times s plus m (rows 0-3 of a chunk: lo, 4-7: hi), o at the first chunk's first column */
static void emit_bytes(uint16_t *o, int step, __m512i v, __m512 slo, __m512 shi, __m512 mlo, __m512 mhi) {
#define OMNI_LANES(k) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, k)))
    emit_chunk(o, _mm512_fmadd_ps(OMNI_LANES(0), slo, mlo), _mm512_fmadd_ps(OMNI_LANES(1), shi, mhi));
    emit_chunk(o + (size_t)step * AMX_TILE, _mm512_fmadd_ps(OMNI_LANES(2), slo, mlo),
               _mm512_fmadd_ps(OMNI_LANES(3), shi, mhi));
#undef OMNI_LANES
}

/* one run of 32 columns in Q4_0X8's 4 chunks (128 bytes at p; byte 4r + i of chunk c: row r's
 * column 8c + i in the low nibble, 8c + 4 + i in the high), with fifth bits from hb where the kind
 * has them (bit 2c + h of byte 4r + i: chunk c's low (h = 0) or high nibble's), assembled bytewise
 * 64 codes at a time; then looked up in `adjust` (a 16-entry table in each 128-bit lane, lookup)
 * or less `adjust` bytewise (0, 8 or 16); then times s plus m into B at o (the run's first column) */
static void nibble_run(uint16_t *o, const uint8_t *p, const uint8_t *hb, int lookup, __m512i adjust, __m512 slo,
                       __m512 shi, __m512 mlo, __m512 mhi) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    __m512i fifth = hb ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)hb)) : _mm512_setzero_si512();
    for (int pair = 0; pair < 2; pair++) {  /* chunks 2 pair, 2 pair + 1 */
        __m512i n = _mm512_loadu_si512(p + 64 * pair);
        __m512i q[2] = {_mm512_and_si512(n, low4), _mm512_and_si512(_mm512_srli_epi16(n, 4), low4)};
        if (hb) {  /* chunk c's bits 2c, 2c + 1 down to bits 0, 1: shifts 4 pair, 4 pair + 2 by half */
            __m512i t = _mm512_srlv_epi16(fifth, by_half(4 * pair, 4 * pair + 2));
            q[0] = _mm512_or_si512(q[0], _mm512_and_si512(_mm512_slli_epi16(t, 4), bit4));
            q[1] = _mm512_or_si512(q[1], _mm512_and_si512(_mm512_slli_epi16(t, 3), bit4));
        }
        for (int h = 0; h < 2; h++)
            emit_bytes(o + (size_t)(16 * pair + 4 * h) * AMX_TILE, 8,
                       lookup ? _mm512_shuffle_epi8(adjust, q[h]) : _mm512_sub_epi8(q[h], adjust), slo, shi, mlo, mhi);
    }
}

/* group g of Q4_KX8 / Q5_KX8: sub-block s's 6-bit scales and minimums of the 8 rows (byte r: row
 * r's), from the 12 scale bytes at g + 32 (byte 32 + 8t + r: row r's byte t) as k_scales unpacks
 * them, on 64-bit words byte by byte */
static void k4_scales(const uint8_t *g, int s, uint64_t *sc, uint64_t *mn) {
    const uint64_t low6 = 0x3f3f3f3f3f3f3f3full, low4 = 0x0f0f0f0f0f0f0f0full, top2 = 0x0303030303030303ull;
    uint64_t t[3];  /* bytes s, s + 4, s + 8 (s < 4), or s - 4, s, s + 4 */
    for (int i = 0; i < 3; i++) memcpy(&t[i], g + 32 + 8 * (s % 4 + 4 * i), 8);
    if (s < 4) {
        *sc = t[0] & low6, *mn = t[1] & low6;
    } else {
        *sc = (t[2] & low4) | (((t[0] >> 6) & top2) << 4);
        *mn = ((t[2] >> 4) & low4) | (((t[1] >> 6) & top2) << 4);
    }
}

/* group g's K columns (kind, group_bytes each) -> B rows: b at the group's first column of row 0 */
void omni_amx_decode_group(int kind, const uint8_t *g, int K, uint16_t *b) {
    const __m512 zero = _mm512_setzero_ps();
    const __m512i iq4 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
    if (kind == Q8_0X8) {  /* blocks of 272: d, then 8 chunks: weight 4j + i */
        for (int blk = 0; blk < K / 32; blk++, g += 272) {
            __m256 d = f16x8(g);
            for (int j = 0; j < 8; j += 2)
                emit_bytes(b + (size_t)(32 * blk + 4 * j) * AMX_TILE, 4, _mm512_loadu_si512(g + 16 + 32 * j),
                           rows_lo(d), rows_hi(d), zero, zero);
        }
        return;
    }
    if (kind == Q4_0X8 || kind == IQ4_NLX8 || kind == Q4_1X8 || kind == Q5_0X8 || kind == Q5_1X8) {
        /* blocks of 32 columns: d, m (Q4_1, Q5_1), 4 chunks, 32 bytes of fifth bits (Q5_0, Q5_1):
         * d (q - 8) (Q4_0), d IQ4_VALUES[q] (IQ4_NL), d q + m (Q4_1, Q5_1), d (q - 16) (Q5_0) */
        const int has_min = kind == Q4_1X8 || kind == Q5_1X8, has_hi = kind == Q5_0X8 || kind == Q5_1X8;
        const int bytes = 144 + 16 * has_min + 32 * has_hi, lookup = kind == IQ4_NLX8;
        const __m512i adjust = lookup ? iq4 : _mm512_set1_epi8(kind == Q4_0X8 ? 8 : kind == Q5_0X8 ? 16 : 0);
        for (int blk = 0; blk < K / 32; blk++, g += bytes) {
            __m256 d = f16x8(g), m = has_min ? f16x8(g + 16) : _mm256_setzero_ps();
            const uint8_t *p = g + 16 + 16 * has_min;
            nibble_run(b + (size_t)32 * blk * AMX_TILE, p, has_hi ? p + 128 : NULL, lookup, adjust, rows_lo(d),
                       rows_hi(d), rows_lo(m), rows_hi(m));
        }
        return;
    }
    if (kind == Q4_KX8 || kind == Q5_KX8) {  /* d, dmin, 12 scale bytes a row, 8 sub-blocks (+ fifth bits) */
        const int hi5 = kind == Q5_KX8;
        for (int blk = 0; blk < K / 256; blk++, g += hi5 ? 1408 : 1152) {
            __m256 d = f16x8(g), dmin = f16x8(g + 16);
            for (int s = 0; s < 8; s++) {  /* d sc q - dmin mn */
                uint64_t sc, mn;
                k4_scales(g, s, &sc, &mn);
                __m256 ds = d * row_bytes(sc), dm = -(dmin * row_bytes(mn));
                const uint8_t *cs = g + 128 + (128 + 32 * hi5) * s;
                nibble_run(b + (size_t)(256 * blk + 32 * s) * AMX_TILE, cs, hi5 ? cs + 128 : NULL, 0,
                           _mm512_setzero_si512(), rows_lo(ds), rows_hi(ds), rows_lo(dm), rows_hi(dm));
            }
        }
        return;
    }
    if (kind == Q6_KX8) {  /* blocks of 1680: d, 16 int8 scales a row, sub-blocks of 192 at 144 */
        /* codes assembled bytewise, 64 at a time: chunks 2p and 2p + 1 (their top bits in the same
         * 32 bytes, at bits 0-3 and 4-7: the second half's shifted down by 4), minus 32 as int8 */
        const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
        for (int blk = 0; blk < K / 256; blk++, g += 1680) {
            __m256 d = f16x8(g);
            for (int s = 0; s < 8; s++) {
                const uint8_t *cs = g + 144 + 192 * s;
                for (int p = 0; p < 2; p++) {  /* weights 32 s + 16 p ..: scale 2 s + p */
                    __m128i sc = _mm_loadl_epi64((const __m128i *)(g + 16 + 8 * (2 * s + p)));
                    __m256 ds = d * _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc));
                    __m512 slo = rows_lo(ds), shi = rows_hi(ds);
                    __m512i n = _mm512_loadu_si512(cs + 64 * p);
                    __m512i top = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(cs + 128 + 32 * p)));
                    __m512i t = _mm512_srlv_epi16(top, by_half(0, 4));
                    __m512i q[2] = {  /* h = 0: the low nibbles, top bits 0-1; h = 1: the high, bits 2-3 */
                        _mm512_or_si512(_mm512_and_si512(n, low4), _mm512_and_si512(_mm512_slli_epi16(t, 4), top2)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n, 4), low4),
                                        _mm512_and_si512(_mm512_slli_epi16(t, 2), top2))};
                    for (int h = 0; h < 2; h++)
                        emit_bytes(b + (size_t)(256 * blk + 32 * s + 16 * p + 4 * h) * AMX_TILE, 8,
                                   _mm512_sub_epi8(q[h], bias), slo, shi, zero, zero);
                }
            }
        }
        return;
    }
    if (kind == IQ4_XSX8) {  /* blocks of 1088 (256 weights): d, scales, sub-blocks of 128 at 64 as IQ4_NLX8's */
        for (int blk = 0; blk < K / 256; blk++, g += 1088) {
            __m256 d = f16x8(g);
            for (int s = 0; s < 8; s++) {
                __m256 dl = d * (row_bytes(xs_scales(g, s)) - _mm256_set1_ps(32.f));  /* d * (scale - 32) */
                nibble_run(b + (size_t)(256 * blk + 32 * s) * AMX_TILE, g + 64 + 128 * s, NULL, 1, iq4, rows_lo(dl),
                           rows_hi(dl), zero, zero);
            }
        }
        return;
    }
    if (kind == Q2_KX8 || kind == Q3_KX8) {  /* 2-bit codes in 2 vectors a sub-block (Q3_K: + a hmask bit) */
        const int q3 = kind == Q3_KX8;
        for (int blk = 0; blk < K / 256; blk++, g += q3 ? 880 : 672) {
            __m256 d = f16x8(g), dmin = q3 ? _mm256_setzero_ps() : f16x8(g + 16);
            for (int s = 0; s < 8; s++) {
                const uint8_t *cs = g + (q3 ? 112 + 96 * s : 160 + 64 * s);
                for (int a = 0; a < 2; a++) {  /* weights 32 s + 16 a ..: scale t = 2 s + a */
                    __m256 dl, ml = _mm256_setzero_ps();
                    if (q3) {  /* d * (s - 32) * (v - 4) */
                        dl = d * (row_bytes(k3_scales(g, 2 * s + a)) - _mm256_set1_ps(32.f));
                    } else {  /* (d * scale) * q - dmin * minimum */
                        uint64_t sb;
                        memcpy(&sb, g + 32 + 8 * (2 * s + a), 8);
                        dl = d * row_bytes(sb & 0x0f0f0f0f0f0f0f0full);
                        ml = dmin * row_bytes((sb >> 4) & 0x0f0f0f0f0f0f0f0full);
                    }
                    __m512 slo = rows_lo(dl), shi = rows_hi(dl), mlo = -rows_lo(ml), mhi = -rows_hi(ml);
                    __m512i codes = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(cs + 32 * a)));
                    __m512i hmask = q3 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(cs + 64)))
                                       : _mm512_setzero_si512();
                    for (int bb = 0; bb < 4; bb += 2) {  /* chunks k = 4 a + bb, k + 1: weights 32 s + 4 k + i */
                        const int k = 4 * a + bb;
                        __m512i q = _mm512_and_si512(
                            _mm512_srlv_epi16(codes, by_half(2 * bb, 2 * bb + 2)),
                            _mm512_set1_epi8(3));
                        if (q3) {  /* hmask bit k (k + 1) as the third bit, less 4 */
                            __m512i hb = _mm512_srlv_epi16(hmask, by_half(k, k + 1));
                            q = _mm512_or_si512(q, _mm512_and_si512(_mm512_slli_epi16(hb, 2), _mm512_set1_epi8(4)));
                            q = _mm512_sub_epi8(q, _mm512_set1_epi8(4));
                        }
                        emit_bytes(b + (size_t)(256 * blk + 32 * s + 4 * k) * AMX_TILE, 4, q, slo, shi, mlo, mhi);
                    }
                }
            }
        }
        return;
    }
}

/* int8 rows (quantization="int8", W8A8: q [N, K] and a scale a row) r .. r + rows - 1 (rows <= 8)
 * -> B, as a Q8_0X8 group: chunk j gathered from the 8 rows (4 bytes each; absent rows read as
 * zeros, never touched), times each row's scale */
void omni_amx_decode_i8_rows(const int8_t *q, const float *scale, int rows, int K, uint16_t *b) {
    const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(K));
    const __m256i present = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    float s[8] = {0};
    for (int r = 0; r < rows; r++) s[r] = scale[r];
    __m512 slo = rows_lo(_mm256_loadu_ps(s)), shi = rows_hi(_mm256_loadu_ps(s));
    for (int j = 0; j < K / 4; j++) {
        __m256i chunk = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)(q + 4 * j), at, present, 1);
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(chunk)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(chunk, 1)));
        emit_chunk(b + (size_t)(4 * j) * AMX_TILE, lo * slo, hi * shi);
    }
}
#endif
