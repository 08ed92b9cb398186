/* omni_qgemm: omni_qlinear for many rows (prefills). Each thread decodes a panel of GEMM_NR weight
 * rows into float32, in omni_gemm_pack's float32 layout, and runs omni_gemm's register tiles over
 * every row of x against it: each weight is decoded once a call (not once per group of x rows, as
 * the small-M path does) and the products are omni_gemm's. The float panel is a thread's scratch,
 * K x GEMM_NR floats: no float copy of the weight outlives the call. */
#include "gemm_tiles.h"
#include "quant_blocks.h"

/* weight row w (of `kind`, K wide; int8: times scale[0]; F8: block b times scale[b]) -> K floats */
static void decode_row(int kind, const uint8_t *w, const float *scale, int K, float *out) {
    if (kind == F8) {
        for (int k = 0; k < K; k += VL) *(vfu *)(out + k) = (scale[k / F8_BLOCK] * F8_UNIT) * f8_chunk(w + k);
        return;
    }
    for (int b = 0; b < K / qblock(kind); b++) {
        if (kind == Q4_0 || kind == Q4_1 || kind == Q5_0 || kind == Q5_1) {  /* d q + m, or d q - o d */
            const int has_min = kind == Q4_1 || kind == Q5_1, has_hi = kind == Q5_0 || kind == Q5_1;
            const int bytes = qblock_bytes(kind);
            const uint8_t *blk = w + (size_t)b * bytes, *qs = blk + bytes - 16;
            float d = f16_to_f32(u16_at(blk));
            float m = has_min ? f16_to_f32(u16_at(blk + 2)) : -(float)(8 << has_hi) * d;
            uint32_t qh = 0;
            if (has_hi) memcpy(&qh, blk + 2 + 2 * has_min, 4);
            for (int c = 0; c < 32; c += VL)
                *(vfu *)(out + 32 * b + c) = d * (has_hi ? q5_chunk(qs, qh, c) : q4_0_chunk(qs, c)) + m;
        } else if (kind == Q4_K || kind == Q5_K) {
            const int hi = kind == Q5_K;
            const uint8_t *blk = w + (size_t)b * qblock_bytes(kind), *qh = blk + 16, *qs = blk + 16 + 32 * hi;
            float d = f16_to_f32(u16_at(blk)), dmin = f16_to_f32(u16_at(blk + 2));
            uint8_t sc[8], mn[8];
            k_scales(blk + 4, sc, mn);
            for (int s = 0; s < 8; s++)
                for (int c = 0; c < 32; c += VL) {
                    vf q = hi ? q5_k_chunk(qs, qh, s, c) : q4_k_chunk(qs, s, c);
                    *(vfu *)(out + 256 * b + 32 * s + c) = (d * (float)sc[s]) * q - dmin * (float)mn[s];
                }
        } else if (kind == Q8_0) {
            const uint8_t *blk = w + (size_t)b * 34;
            float d = f16_to_f32(u16_at(blk));
            for (int c = 0; c < 32; c += VL) *(vfu *)(out + 32 * b + c) = d * s8_load((const int8_t *)blk + 2 + c);
        } else if (kind == Q6_K) {
            const uint8_t *blk = w + (size_t)b * 210;
            const int8_t *scales = (const int8_t *)(blk + 192);
            float d = f16_to_f32(u16_at(blk + 208));
            for (int h = 0; h < 2; h++)
                for (int part = 0; part < 4; part++)
                    for (int l = 0; l < 32; l += VL) {
                        int e = 128 * h + 32 * part + l;
                        *(vfu *)(out + 256 * b + e) = (d * (float)scales[e / 16]) *
                                                      (q6_k_chunk(blk, blk + 128, h, part, l) - 32.0f);
                    }
        } else {  /* int8 */
            const int8_t *q = (const int8_t *)w;
            int k = 0;
            float d = scale ? scale[0] : 1.f;
            for (; k + VL <= K; k += VL) *(vfu *)(out + k) = d * s8_load(q + k);
            for (; k < K; k++) out[k] = d * (float)q[k];
            return;
        }
    }
}

/* y [M, ldy] (dt) = xf [M, K] (float32) @ W^T; W's N rows of `kind`, row_bytes apart. Returns
 * 0, or -1 when the panels' scratch memory could not be had. */
int omni_qgemm(const float *xf, const uint8_t *w, size_t row_bytes, const float *scale, void *y,
               int64_t ldy, int M, int N, int K, int kind, int dt, int nthreads) {
    int64_t P = (N + GEMM_NR - 1) / GEMM_NR;
    const gemm_tile_fn *tiles_of = dt == F32 ? GEMM_TILES_F32 : GEMM_TILES_F32_TO_BF16;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > P) nthreads = (int)P;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *panel = malloc(sizeof(float) * ((size_t)K * GEMM_NR + (size_t)K));
        if (!panel) {
            failed = 1;
        } else {
            float *row = panel + (size_t)K * GEMM_NR;
            gemm_args g = {NULL, NULL, xf, y, K, K, ldy, K, N, 0, NULL, NULL};
            int64_t p0, p1;
            thread_share(P, &p0, &p1);
            for (int64_t p = p0; p < p1; p++) {
                for (int r = 0; r < GEMM_NR; r++) {  /* column r of the panel: weight row p NR + r */
                    int64_t n = p * GEMM_NR + r;
                    if (n < N)
                        decode_row(kind, w + (size_t)n * row_bytes,
                                   scale ? scale + (size_t)n * (kind == F8 ? K / F8_BLOCK : 1) : NULL, K, row);
                    for (int k = 0; k < K; k++) panel[(size_t)k * GEMM_NR + r] = n < N ? row[k] : 0.f;
                }
                for (int m0 = 0; m0 < M; m0 += GEMM_MC) {  /* x in chunks (they stay in L2) */
                    int mc = M - m0 < GEMM_MC ? M - m0 : GEMM_MC, tiles = (mc + GEMM_MR - 1) / GEMM_MR;
                    for (int i = 0, m = m0; i < tiles; i++) {  /* tiles of near-equal heights */
                        int left = m0 + mc - m, mr = (left + tiles - i - 1) / (tiles - i);
                        tiles_of[mr](&g, m, p, panel);
                        m += mr;
                    }
                }
            }
            free(panel);
        }
    }
    return failed ? -1 : 0;
}
