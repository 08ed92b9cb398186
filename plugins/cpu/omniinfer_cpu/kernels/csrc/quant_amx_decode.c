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

/* a Q4_0X8 chunk's codes (32 bytes at p): low nibbles (weights 0-3 of each row) or high (4-7) */
static __m512i nibbles(const uint8_t *p, int half, int high) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * half)));
    return high ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
}

/* chunk c's codes (low nibbles h = 0, high h = 1) of rows 0-3 (half 0) or 4-7, with their fifth
 * bits from hb (bit 2c + h of byte 4r + i) where the kind has them (hb non-NULL) */
static __m512i codes(const uint8_t *p, const uint8_t *hb, int half, int c, int h) {
    __m512i q = nibbles(p + 32 * c, half, h);
    if (!hb) return q;
    __m512i top = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(hb + 16 * half)));
    top = _mm512_and_si512(_mm512_srli_epi32(top, 2 * c + h), _mm512_set1_epi32(1));
    return _mm512_or_si512(q, _mm512_slli_epi32(top, 4));
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
    const __m512 eight = _mm512_set1_ps(8.f), thirty_two = _mm512_set1_ps(32.f);
    if (kind == Q8_0X8) {  /* blocks of 272: d, then 8 chunks: weight 4j + i */
        for (int blk = 0; blk < K / 32; blk++, g += 272) {
            __m256 d = f16x8(g);
            __m512 dlo = rows_lo(d), dhi = rows_hi(d);
            for (int j = 0; j < 8; j++) {
                const uint8_t *c = g + 16 + 32 * j;
                __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
                __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
                emit_chunk(b + (size_t)(32 * blk + 4 * j) * AMX_TILE, lo * dlo, hi * dhi);
            }
        }
        return;
    }
    if (kind == Q4_0X8 || kind == IQ4_NLX8) {  /* blocks of 144: d, 4 chunks: weights 8c + i, 8c + 4 + i */
        const __m512i table = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
        for (int blk = 0; blk < K / 32; blk++, g += 144) {
            __m256 d = f16x8(g);
            __m512 dlo = rows_lo(d), dhi = rows_hi(d);
            for (int c = 0; c < 4; c++)
                for (int h = 0; h < 2; h++) {
                    __m512i lo = nibbles(g + 16 + 32 * c, 0, h), hi = nibbles(g + 16 + 32 * c, 1, h);
                    __m512 flo, fhi;
                    if (kind == IQ4_NLX8) {
                        flo = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(lo, table));
                        fhi = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(hi, table));
                    } else {
                        flo = _mm512_cvtepi32_ps(lo) - eight;
                        fhi = _mm512_cvtepi32_ps(hi) - eight;
                    }
                    emit_chunk(b + (size_t)(32 * blk + 8 * c + 4 * h) * AMX_TILE, flo * dlo, fhi * dhi);
                }
        }
        return;
    }
    if (kind == Q4_1X8 || kind == Q5_0X8 || kind == Q5_1X8) {  /* d (m), 4 chunks (32 bytes of fifth bits) */
        const int has_min = kind != Q5_0X8, has_hi = kind != Q4_1X8;
        const int bytes = 144 + 16 * has_min + 32 * has_hi;
        const __m512 offset = _mm512_set1_ps(has_min ? 0.f : 16.f);  /* (Q5_0: d (q - 16)) */
        for (int blk = 0; blk < K / 32; blk++, g += bytes) {
            __m256 d = f16x8(g), m = has_min ? f16x8(g + 16) : _mm256_setzero_ps();
            __m512 dlo = rows_lo(d), dhi = rows_hi(d), mlo = rows_lo(m), mhi = rows_hi(m);
            const uint8_t *p = g + 16 + 16 * has_min, *hb = has_hi ? p + 128 : NULL;
            for (int c = 0; c < 4; c++)
                for (int h = 0; h < 2; h++) {
                    __m512 qlo = _mm512_cvtepi32_ps(codes(p, hb, 0, c, h)), qhi = _mm512_cvtepi32_ps(codes(p, hb, 1, c, h));
                    __m512 lo = has_min ? qlo * dlo + mlo : (qlo - offset) * dlo;
                    __m512 hi = has_min ? qhi * dhi + mhi : (qhi - offset) * dhi;
                    emit_chunk(b + (size_t)(32 * blk + 8 * c + 4 * h) * AMX_TILE, lo, hi);
                }
        }
        return;
    }
    if (kind == Q4_KX8 || kind == Q5_KX8) {  /* d, dmin, 12 scale bytes a row, 8 sub-blocks (+ fifth bits) */
        const int hi5 = kind == Q5_KX8;
        for (int blk = 0; blk < K / 256; blk++, g += hi5 ? 1408 : 1152) {
            __m256 d = f16x8(g), dmin = f16x8(g + 16);
            for (int s = 0; s < 8; s++) {
                uint64_t sc, mn;
                k4_scales(g, s, &sc, &mn);
                __m256 ds = d * row_bytes(sc), dm = dmin * row_bytes(mn);
                __m512 slo = rows_lo(ds), shi = rows_hi(ds), mlo = rows_lo(dm), mhi = rows_hi(dm);
                const uint8_t *cs = g + 128 + (128 + 32 * hi5) * s, *hb = hi5 ? cs + 128 : NULL;
                for (int c = 0; c < 4; c++)
                    for (int h = 0; h < 2; h++) {
                        __m512 flo = _mm512_cvtepi32_ps(codes(cs, hb, 0, c, h));
                        __m512 fhi = _mm512_cvtepi32_ps(codes(cs, hb, 1, c, h));
                        emit_chunk(b + (size_t)(256 * blk + 32 * s + 8 * c + 4 * h) * AMX_TILE, flo * slo - mlo,
                                   fhi * shi - mhi);
                    }
            }
        }
        return;
    }
    if (kind == Q6_KX8) {  /* blocks of 1680: d, 16 int8 scales a row, sub-blocks of 192 at 144 */
        for (int blk = 0; blk < K / 256; blk++, g += 1680) {
            float d[8];
            _mm256_storeu_ps(d, f16x8(g));
            for (int s = 0; s < 8; s++) {
                const uint8_t *cs = g + 144 + 192 * s;
                for (int c = 0; c < 4; c++) {
                    float ds[8];  /* weights 32 s + 8 c + 0..7: scale 2 s + c / 2 */
                    for (int r = 0; r < 8; r++) ds[r] = d[r] * (float)(int8_t)g[16 + 8 * (2 * s + c / 2) + r];
                    __m512 slo = rows_lo(_mm256_loadu_ps(ds)), shi = rows_hi(_mm256_loadu_ps(ds));
                    const int sh = 4 * (c & 1);
                    for (int h = 0; h < 2; h++) {  /* h: the low nibble with bits sh, sh + 1 on top, or high */
                        __m512i q[2];
                        for (int half = 0; half < 2; half++) {
                            __m512i top = _mm512_cvtepu8_epi32(
                                _mm_loadu_si128((const __m128i *)(cs + 128 + 32 * (c / 2) + 16 * half)));
                            top = _mm512_and_si512(_mm512_srli_epi32(top, sh + 2 * h), _mm512_set1_epi32(3));
                            q[half] = _mm512_or_si512(nibbles(cs + 32 * c, half, h), _mm512_slli_epi32(top, 4));
                        }
                        emit_chunk(b + (size_t)(256 * blk + 32 * s + 8 * c + 4 * h) * AMX_TILE,
                                   (_mm512_cvtepi32_ps(q[0]) - thirty_two) * slo,
                                   (_mm512_cvtepi32_ps(q[1]) - thirty_two) * shi);
                    }
                }
            }
        }
        return;
    }
    if (kind == IQ4_XSX8) {  /* blocks of 1088 (256 weights): d, scales, sub-blocks of 128 at 64 as IQ4_NLX8's */
        const __m512i table = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
        for (int blk = 0; blk < K / 256; blk++, g += 1088) {
            __m256 d = f16x8(g);
            for (int s = 0; s < 8; s++) {
                __m256 dl = d * (row_bytes(xs_scales(g, s)) - _mm256_set1_ps(32.f));  /* d * (scale - 32) */
                __m512 dlo = rows_lo(dl), dhi = rows_hi(dl);
                const uint8_t *cs = g + 64 + 128 * s;
                for (int c = 0; c < 4; c++)
                    for (int h = 0; h < 2; h++) {
                        __m512 flo = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(nibbles(cs + 32 * c, 0, h), table));
                        __m512 fhi = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(nibbles(cs + 32 * c, 1, h), table));
                        emit_chunk(b + (size_t)(256 * blk + 32 * s + 8 * c + 4 * h) * AMX_TILE, flo * dlo, fhi * dhi);
                    }
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
                    __m512 dlh[2] = {rows_lo(dl), rows_hi(dl)}, mlh[2] = {rows_lo(ml), rows_hi(ml)};
                    for (int bb = 0; bb < 4; bb++) {  /* chunk k = 4 a + bb: weights 32 s + 4 k + i */
                        const int k = 4 * a + bb;
                        __m512 v[2];
                        for (int half = 0; half < 2; half++) {
                            __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(cs + 32 * a + 16 * half)));
                            q = _mm512_and_si512(_mm512_srli_epi32(q, 2 * bb), _mm512_set1_epi32(3));
                            if (q3) {
                                __m512i hm = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(cs + 64 + 16 * half)));
                                q = _mm512_or_si512(q, _mm512_slli_epi32(
                                    _mm512_and_si512(_mm512_srli_epi32(hm, k), _mm512_set1_epi32(1)), 2));
                                v[half] = (_mm512_cvtepi32_ps(q) - _mm512_set1_ps(4.f)) * dlh[half];
                            } else {
                                v[half] = _mm512_cvtepi32_ps(q) * dlh[half] - mlh[half];
                            }
                        }
                        emit_chunk(b + (size_t)(256 * blk + 32 * s + 4 * k) * AMX_TILE, v[0], v[1]);
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
