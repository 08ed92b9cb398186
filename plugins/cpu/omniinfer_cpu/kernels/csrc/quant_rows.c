/* omni_qrows: an embedding's lookup in a quantised table: the float rows asked for, decoded from
 * the blocks the products read (quant_blocks.h's kinds, the groups of 8 included), each value
 * computed as the core's reference dequantiser computes it (omniinfer/quantization/gguf_blocks.py,
 * int8.py: d * (q - 8), (d * sc) * q - dmin * m, ...), in float32, then rounded to the output
 * dtype: bit for bit the reference's rows. Through torch ops a one-token lookup in the medium
 * model's tied Q4_0 table took 0.3-0.8 ms (~40 small ops undoing the groups of 8), 4% of a
 * decode step; here a few microseconds. */
#include "quant_blocks.h"

/* no fused multiply-adds: the reference rounds each product before the subtraction. (These
 * formats' products of scales and codes are exact in float32, so one would not change a value
 * today; this keeps it so whatever a later format's arithmetic.) */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#define NO_CONTRACT
#else
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif

/* one block of Q4_0, Q4_1, Q5_0, Q5_1 (32 weights), Q4_K or Q5_K (256) at blk -> out, as the
 * reference: d * (q - 8), d * q + m, d * (q - 16), (d * scale) * q - dmin * minimum */
NO_CONTRACT static void decode_block(int kind, const uint8_t *blk, float *out) {
    if (kind == Q4_K || kind == Q5_K) {  /* sub-block s: run s / 2's low nibbles (s even) or high ones */
        const int hi = kind == Q5_K;
        const uint8_t *qh = blk + 16, *qs = blk + 16 + 32 * hi;
        float d = f16_to_f32(u16_at(blk)), dmin = f16_to_f32(u16_at(blk + 2));
        uint8_t sc[8], mn[8];
        k_scales(blk + 4, sc, mn);
        for (int s = 0; s < 8; s++) {
            float ds = d * (float)sc[s], dm = dmin * (float)mn[s];
            for (int l = 0; l < 32; l++) {
                int q = ((qs[32 * (s / 2) + l] >> (4 * (s & 1))) & 15) | (hi ? ((qh[l] >> s) & 1) << 4 : 0);
                float p = ds * (float)q;
                out[32 * s + l] = p - dm;
            }
        }
        return;
    }
    int has_min = kind == Q4_1 || kind == Q5_1, has_hi = kind == Q5_0 || kind == Q5_1;
    float d = f16_to_f32(u16_at(blk)), m = has_min ? f16_to_f32(u16_at(blk + 2)) : 0.f;
    const uint8_t *qh = blk + 2 + 2 * has_min, *qs = qh + 4 * has_hi;
    uint32_t h = 0;
    if (has_hi) memcpy(&h, qh, 4);
    for (int j = 0; j < 32; j++) {  /* weight j: byte j % 16's low (j < 16) or high nibble, bit j of h */
        int q = ((qs[j % 16] >> (j < 16 ? 0 : 4)) & 15) | (((h >> j) & 1) << 4);
        if (has_min) {
            float p = d * (float)q;
            out[j] = p + m;
        } else {
            out[j] = d * (float)(q - (8 << has_hi));
        }
    }
}

/* row r of a group-of-8 kind of Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, IQ4_NL, IQ4_XS, Q2_K or Q3_K
 * (quant_blocks.h) -> out, as decode_block decodes the block it came from */
NO_CONTRACT static void decode_x8_row(const uint8_t *w, int kind, int64_t r, int K, float *out) {
    int rr = (int)(r % 8), block = qblock(kind), bytes = 8 * qblock_bytes(kind);
    const uint8_t *g = w + (size_t)(r / 8) * (size_t)(K / block) * bytes;
    for (int b = 0; b < K / block; b++) {
        const uint8_t *blk = g + (size_t)b * bytes;
        float d = f16_to_f32(u16_at(blk + 2 * rr));
        float *o = out + (size_t)b * block;
        if (kind == IQ4_NLX8 || kind == IQ4_XSX8) {  /* d * value, or (d * (scale - 32)) * value a sub-block */
            const int xs = kind == IQ4_XSX8;
            for (int s = 0; s < (xs ? 8 : 1); s++) {
                const uint8_t *cs = xs ? blk + 64 + 128 * s : blk + 16;
                float dl = xs ? d * (float)((int)((xs_scales(blk, s) >> (8 * rr)) & 63) - 32) : d;
                for (int c = 0; c < 4; c++)
                    for (int h = 0; h < 2; h++)
                        for (int i = 0; i < 4; i++)
                            o[32 * s + 8 * c + 4 * h + i] = dl * (float)IQ4_VALUES[x8_code(cs, NULL, rr, c, h, i)];
            }
            continue;
        }
        if (kind == Q3_KX8) {  /* (d * (s - 32)) * (v - 4), a 6-bit s per 16 weights */
            for (int s = 0; s < 8; s++)
                for (int half = 0; half < 2; half++) {
                    float dl = d * (float)((int)((k3_scales(blk, 2 * s + half) >> (8 * rr)) & 63) - 32);
                    const uint8_t *cs = blk + 112 + 96 * s;
                    for (int k = 4 * half; k < 4 * half + 4; k++)
                        for (int i = 0; i < 4; i++) {
                            int v = ((cs[32 * (k / 4) + 4 * rr + i] >> (2 * (k & 3))) & 3) |
                                    (((cs[64 + 4 * rr + i] >> k) & 1) << 2);
                            o[32 * s + 4 * k + i] = dl * (float)(v - 4);
                        }
                }
            continue;
        }
        if (kind == Q2_KX8) {  /* (d * scale) * q - dmin * minimum, a scale byte per 16 weights */
            float dmin = f16_to_f32(u16_at(blk + 16 + 2 * rr));
            for (int s = 0; s < 8; s++)
                for (int half = 0; half < 2; half++) {
                    uint8_t sb = blk[32 + 8 * (2 * s + half) + rr];
                    float dl = d * (float)(sb & 15), ml = dmin * (float)(sb >> 4);
                    for (int k = 4 * half; k < 4 * half + 4; k++)
                        for (int i = 0; i < 4; i++) {
                            float p = dl * (float)((blk[160 + 64 * s + 32 * (k / 4) + 4 * rr + i] >> (2 * (k & 3))) & 3);
                            o[32 * s + 4 * k + i] = p - ml;
                        }
                }
            continue;
        }
        if (kind == Q4_KX8 || kind == Q5_KX8) {  /* its d, dmin and 12 scale bytes, sub-block s's codes */
            const int hi = kind == Q5_KX8;
            float dmin = f16_to_f32(u16_at(blk + 16 + 2 * rr));
            uint8_t packed[12], sc[8], mn[8];
            for (int t = 0; t < 12; t++) packed[t] = blk[32 + 8 * t + rr];
            k_scales(packed, sc, mn);
            for (int s = 0; s < 8; s++) {
                const uint8_t *cs = blk + 128 + (128 + 32 * hi) * s;
                float ds = d * (float)sc[s], dm = dmin * (float)mn[s];
                for (int c = 0; c < 4; c++)
                    for (int h = 0; h < 2; h++)
                        for (int i = 0; i < 4; i++) {
                            float p = ds * (float)x8_code(cs, hi ? cs + 128 : NULL, rr, c, h, i);
                            o[32 * s + 8 * c + 4 * h + i] = p - dm;
                        }
            }
            continue;
        }
        int has_min = kind == Q4_1X8 || kind == Q5_1X8, has_hi = kind == Q5_0X8 || kind == Q5_1X8;
        float m = has_min ? f16_to_f32(u16_at(blk + 16 + 2 * rr)) : 0.f;
        const uint8_t *p = blk + 16 + 16 * has_min, *hb = has_hi ? p + 128 : NULL;
        for (int c = 0; c < 4; c++)  /* chunk c, byte 4 rr + i: weight 8c + i (low), 8c + 4 + i (high) */
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 4; i++) {
                    int q = x8_code(p, hb, rr, c, h, i);
                    if (has_min) {
                        float v = d * (float)q;
                        o[8 * c + 4 * h + i] = v + m;
                    } else {
                        o[8 * c + 4 * h + i] = d * (float)(q - (8 << has_hi));
                    }
                }
    }
}

/* row r of W [N, K] of `kind` -> out (float32, K values) */
NO_CONTRACT static void decode_row(const uint8_t *w, const float *scale, int kind, int64_t r, int K, float *out) {
    size_t rb = qrow_bytes(kind, K);
    if (kind == I8) {
        const int8_t *q = (const int8_t *)w + (size_t)r * K;
        for (int k = 0; k < K; k++) out[k] = (float)q[k] * scale[r];
        return;
    }

    if (is_x8(kind) && kind != Q8_0X8 && kind != Q6_KX8) {
        decode_x8_row(w, kind, r, K, out);
        return;
    }
    if (kind == Q4_0 || kind == Q4_K || (kind >= Q4_1 && kind <= Q5_K)) {
        for (int b = 0; b < K / qblock(kind); b++)
            decode_block(kind, w + (size_t)r * rb + (size_t)b * qblock_bytes(kind), out + (size_t)b * qblock(kind));
        return;
    }
    if (kind == Q8_0X8) {  /* block b of row r within its group's blocks: chunk j, byte 4 rr + i: weight 4j + i */
        int rr = (int)(r % 8);
        const uint8_t *g = w + (size_t)(r / 8) * (size_t)(K / 32) * 272;
        for (int b = 0; b < K / 32; b++) {
            const uint8_t *blk = g + (size_t)b * 272;
            float d = f16_to_f32(u16_at(blk + 2 * rr));
            for (int j = 0; j < 8; j++)
                for (int i = 0; i < 4; i++) out[32 * b + 4 * j + i] = (float)(int8_t)blk[16 + 32 * j + 4 * rr + i] * d;
        }
        return;
    }
    if (kind == Q6_KX8) {  /* block b of row r: its d and 16 scales, sub-block s's low and top bits */
        int rr = (int)(r % 8);
        const uint8_t *g = w + (size_t)(r / 8) * (size_t)(K / 256) * 1680;
        for (int b = 0; b < K / 256; b++) {
            const uint8_t *blk = g + (size_t)b * 1680;
            float d = f16_to_f32(u16_at(blk + 2 * rr));
            for (int s = 0; s < 8; s++) {
                const uint8_t *cs = blk + 144 + 192 * s;
                for (int c = 0; c < 4; c++)
                    for (int i = 0; i < 4; i++) {
                        uint8_t l = cs[32 * c + 4 * rr + i], h = cs[128 + 32 * (c / 2) + 4 * rr + i];
                        int sh = 4 * (c & 1), e = 32 * s + 8 * c + i;
                        int q0 = (l & 15) | (((h >> sh) & 3) << 4), q1 = (l >> 4) | (((h >> (sh + 2)) & 3) << 4);
                        out[256 * b + e] = (d * (float)(int8_t)blk[16 + 8 * (e / 16) + rr]) * (float)(q0 - 32);
                        out[256 * b + e + 4] = (d * (float)(int8_t)blk[16 + 8 * ((e + 4) / 16) + rr]) * (float)(q1 - 32);
                    }
            }
        }
        return;
    }
    const uint8_t *row = w + (size_t)r * rb;
    for (int b = 0; b < K / qblock(kind); b++) {
        float *o = out + (size_t)b * qblock(kind);
        if (kind == Q8_0) {
            const uint8_t *blk = row + (size_t)b * 34;
            float d = f16_to_f32(u16_at(blk));
            for (int i = 0; i < 32; i++) o[i] = (float)(int8_t)blk[2 + i] * d;
        } else {  /* Q6_K: weight 128 h + 32 part + l, its scale the one of each 16 */
            const uint8_t *blk = row + (size_t)b * 210, *ql = blk, *qh = blk + 128;
            const int8_t *scales = (const int8_t *)(blk + 192);
            float d = f16_to_f32(u16_at(blk + 208));
            for (int h = 0; h < 2; h++)
                for (int part = 0; part < 4; part++)
                    for (int l = 0; l < 32; l++) {
                        int e = 128 * h + 32 * part + l;
                        int lo = (ql[64 * h + 32 * (part & 1) + l] >> (part >= 2 ? 4 : 0)) & 15;
                        int hi = (qh[32 * h + l] >> (2 * part)) & 3;
                        o[e] = (d * (float)scales[e / 16]) * (float)((lo | (hi << 4)) - 32);
                    }
        }
    }
}

/* out [n, K] (dtype dt) = rows ids[0..n) of W [N, K] of `kind` (int8: w is q, scale [N]).
 * Returns 0; -1 for a kind not built or a K that is not whole blocks; -2 for an id outside
 * [0, N) (before anything is written). */
int omni_qrows(const uint8_t *w, const float *scale, int kind, int N, int K, const int64_t *ids, int n,
               void *out, int dt, int nthreads) {
    kind &= ~QACT_INT8;
    if (!omni_quant_supported(kind) || K <= 0 || K % qblock(kind) || ((kind == I8 || kind == F8) && !scale))
        return -1;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -2;
    if (nthreads < 1) nthreads = 1;
    nthreads = threads_for((int64_t)n * K, nthreads);
    if (kind == F8) {  /* a vector at a time, straight into out (the products that dequantise an FP8
                        * weight for a prefill's matmul take this): (v F8_UNIT) is the e4m3 value,
                        * exactly; the one product with the scale rounds, as the reference's */
#pragma omp parallel num_threads(nthreads)
        {
            int64_t i0, i1;
            thread_share(n, &i0, &i1);
            for (int64_t i = i0; i < i1; i++) {
                const uint8_t *q = w + (size_t)ids[i] * K;
                const float *s = scale + (size_t)ids[i] * (K / F8_BLOCK);
                for (int k = 0; k < K; k += VL) stv(out, dt, (size_t)i * K + k, (f8_chunk(q + k) * F8_UNIT) * s[k / F8_BLOCK]);
            }
        }
        return 0;
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        int64_t i0, i1;
        thread_share(n, &i0, &i1);
        float *row = dt == F32 ? NULL : malloc(sizeof(float) * (size_t)K);
        if (dt != F32 && !row) failed = 1;
        for (int64_t i = i0; i < i1 && !failed; i++) {
            float *o = dt == F32 ? (float *)out + (size_t)i * K : row;
            decode_row(w, scale, kind, ids[i], K, o);
            if (dt != F32)
                for (int k = 0; k < K; k++) st1(out, dt, (size_t)i * K + k, row[k]);
        }
        free(row);
    }
    return failed ? -1 : 0;
}
