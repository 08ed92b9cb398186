/* omni_gemm's register tiles, shared by gemm.c (packed float or bfloat16 weights) and quant_gemm.c
 * (quantised weights decoded into float32 panels): the layout, the tiles, what they store. */
#ifndef OMNI_GEMM_TILES_H
#define OMNI_GEMM_TILES_H
#include "omni.h"

/* ---- products for batches of a few to a few hundred rows ------------------------------------
 * y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with W packed once, at load, by omni_gemm_pack into
 * panels of GEMM_NR = GEMM_NV vectors of columns (64 columns on AVX-512, 16 on AVX2 and NEON):
 *   float32:  [P][K][NR], multiplied by one broadcast component of x;
 *   bfloat16 with vdpbf16ps (AVX-512 BF16): [P][K / 2][NR][2], each column's weights for
 *             components 2j and 2j + 1 side by side, which vdpbf16ps multiplies by one broadcast
 *             pair of x;
 *   bfloat16 elsewhere: [P][K][NR], the columns of each pair of vectors interleaved (32-bit word
 *             i holds column i in its low half and column VL + i in its high half), so a shift
 *             and a mask widen 2 VL weights to float32; x is widened once, before the products,
 *             and the products are float32 FMAs (no CPU without AVX-512 BF16 multiplies bfloat16).
 * A tile of up to GEMM_MR rows x NR columns keeps its MR x NV sums in registers over all of K
 * (6 x 4 of AVX-512's and NEON's 32 registers, 6 x 2 of AVX2's 16). Each thread takes a
 * contiguous range of panels; rows go by in chunks of GEMM_MC, so a thread's weights are read from
 * L2 once per chunk. Sums in float32, each result rounded once (+ bias first), as oneDNN does.
 *
 * "Gated" packs a gate_up weight [2I, K] (gate rows, then up rows) so that panel p holds gate
 * columns NR/2 p .. in its first NV / 2 vectors and the same up columns in the last NV / 2; the
 * tile then writes silu(gate) * up [M, I] directly, rounding (bfloat16) gate, up and silu(gate)
 * on the way as the separate product and omni_silu_and_mul do, so the result is the same bits.
 * Built at every level (omni_gemm_supported). */

#if NREGS >= 32
#define GEMM_NV 4
#else
#define GEMM_NV 2
#endif
#define GEMM_NR (GEMM_NV * VL)
#define GEMM_MR 6
#define GEMM_MC 120
#if defined(__AVX512BF16__)
#define GEMM_BF16_PAIRS 1
#else
#define GEMM_BF16_PAIRS 0
#endif

typedef struct {
    const void *x, *bias;
    const float *xf;  /* x as float32 (x itself, or its widened copy) for the FMA tiles */
    void *y;
    int64_t ldx, ldxf, ldy;
    int K, N, gated;
    /* argmax instead of y: this thread's first maximum so far of each row and its column (-1:
     * none yet) */
    float *best;
    int32_t *best_col;
} gemm_args;

#if defined(__AVX512F__)
INLINE __mmask16 lanes_mask(int n_valid) {
    return n_valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n_valid) - 1);
}
#endif

INLINE vf bias_lanes(const gemm_args *g, int dt, int64_t col0, int n_valid) {  /* VL columns */
    if (!g->bias || n_valid <= 0) return (vf){0};
    if (n_valid >= VL) return ld(g->bias, dt, col0);
#if defined(__AVX512F__)
    if (dt == F32) return (vf)_mm512_maskz_loadu_ps(lanes_mask(n_valid), (const float *)g->bias + col0);
    __m256i h = _mm256_maskz_loadu_epi16(lanes_mask(n_valid), (const uint16_t *)g->bias + col0);
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
    float lanes[VL] = {0};
    for (int l = 0; l < n_valid; l++) lanes[l] = ld1(g->bias, dt, col0 + l);
    return *(const vfu *)lanes;
#endif
}

INLINE void store_lanes(void *y, int dt, int64_t at, int n_valid, vf v) {
    if (n_valid <= 0) return;
    if (n_valid >= VL) {
        stv(y, dt, at, v);
        return;
    }
#if defined(__AVX512F__)
    if (dt == F32) {
        _mm512_mask_storeu_ps((float *)y + at, lanes_mask(n_valid), (__m512)v);
        return;
    }
#endif
#if defined(__AVX512BF16__)
    __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)v);
    _mm256_mask_storeu_epi16((uint16_t *)y + at, lanes_mask(n_valid), h);
#else
    if (dt == F32) {
        float lanes[VL];
        *(vfu *)lanes = v;
        memcpy((float *)y + at, lanes, sizeof(float) * (size_t)n_valid);
        return;
    }
    uint16_t out[VL];  /* stv's rounding, then only the valid lanes */
    stv(out, BF16, 0, v);
    memcpy((uint16_t *)y + at, out, sizeof(uint16_t) * (size_t)n_valid);
#endif
}

/* some of the first n_valid lanes of v is greater than top, or unordered (a NaN on either side) */
INLINE int any_above(vf v, float top, int n_valid) {
    if (n_valid <= 0) return 0;
#if defined(__AVX512F__)
    return _mm512_mask_cmp_ps_mask(lanes_mask(n_valid), (__m512)v, _mm512_set1_ps(top), _CMP_NLE_UQ) != 0;
#elif defined(__AVX2__)
    int bits = _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_set1_ps(top), _CMP_NLE_UQ));
    return (bits & (n_valid >= VL ? 0xff : (1 << n_valid) - 1)) != 0;
#else
    for (int l = 0; l < VL && l < n_valid; l++)
        if (!(v[l] <= top)) return 1;
    return 0;
#endif
}

/* The tile's results into the rows' running maxima. A row's NR values are first compared, as
 * they come out of the sums, with its maximum so far: rounding cannot lift a value that is not
 * above a (rounded) maximum over it, so only a row with a value above it, a NaN, or no maximum
 * yet goes on to the column by column pass, with each value as the product would store it
 * (bfloat16: rounded). A thread visits a row's columns in increasing order, so taking only
 * greater values (or a first NaN) keeps the first maximum, as torch.argmax. */
INLINE void gemm_argmax_tile(const gemm_args *g, int dt, int m, int MR, int64_t c0,
                              vf acc[][GEMM_NV], const vf *bias) {
    int n = g->N - c0 < GEMM_NR ? (int)(g->N - c0) : GEMM_NR;
    for (int r = 0; r < MR; r++) {
        float *best = g->best + m + r;
        int32_t *col = g->best_col + m + r;
        int above = 0;
        for (int v = 0; v < GEMM_NV; v++) above |= any_above(acc[r][v] + bias[v], *best, n - VL * v);
        if (!above && *col >= 0) continue;
        float vals[GEMM_NR];
        for (int v = 0; v < GEMM_NV; v++) {  /* as store_lanes rounds them */
            vf val = acc[r][v] + bias[v];
            *(vfu *)(vals + VL * v) = dt == BF16 ? vround_bf16(val) : val;
        }
        for (int c = 0; c < n; c++) argmax_take(best, col, vals[c], c0 + c);
    }
}

/* the tile's results: plain columns p * NR .. (or their rows' running maxima), or gated columns
 * p * NR / 2 .. of silu(gate) * up */
INLINE void gemm_store(const gemm_args *g, int dt, int m, int MR, int64_t p, vf acc[][GEMM_NV]) {
    vf bias[GEMM_NV];
    if (!g->gated) {
        int64_t c0 = p * GEMM_NR;
        for (int v = 0; v < GEMM_NV; v++) bias[v] = bias_lanes(g, dt, c0 + VL * v, (int)(g->N - c0 - VL * v));
        if (g->best) {
            gemm_argmax_tile(g, dt, m, MR, c0, acc, bias);
            return;
        }
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < GEMM_NV; v++)
                store_lanes(g->y, dt, (m + r) * g->ldy + c0 + VL * v, (int)(g->N - c0 - VL * v),
                            acc[r][v] + bias[v]);
        return;
    }
    enum { H = GEMM_NV / 2 };
    int64_t half = g->N / 2, c0 = p * (GEMM_NR / 2);
    for (int v = 0; v < H; v++) {
        bias[v] = bias_lanes(g, dt, c0 + VL * v, (int)(half - c0 - VL * v));
        bias[v + H] = bias_lanes(g, dt, half + c0 + VL * v, (int)(half - c0 - VL * v));
    }
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < H; v++) {
            vf gate = acc[r][v] + bias[v], up = acc[r][v + H] + bias[v + H];
            if (dt == BF16) gate = vround_bf16(gate), up = vround_bf16(up);
            vf a = gate / (1.0f + vexp(-gate));
            if (dt == BF16) a = vround_bf16(a);
            store_lanes(g->y, dt, (m + r) * g->ldy + c0 + VL * v, (int)(half - c0 - VL * v), a * up);
        }
}

/* one packed row of the panel (k) as NV float32 vectors */
INLINE void gemm_load_f32(const void *panel, int k, vf *b) {
    const float *row = (const float *)panel + (int64_t)k * GEMM_NR;
#pragma GCC unroll 4
    for (int v = 0; v < GEMM_NV; v++) b[v] = *(const vfu *)(row + VL * v);
}

INLINE void gemm_load_bf16(const void *panel, int k, vf *b) {  /* the interleaved layout */
    const uint16_t *row = (const uint16_t *)panel + (int64_t)k * GEMM_NR;
#pragma GCC unroll 2
    for (int v = 0; v < GEMM_NV / 2; v++) {
        vu w = *(const vuu *)(row + 2 * VL * v);
        b[2 * v] = (vf)(w << 16), b[2 * v + 1] = (vf)(w & 0xffff0000u);
    }
}

/* rows m .. m + MR - 1 of the float32 x (xf), panel p (its packed weights, loaded by LOAD) */
#define GEMM_TILE(NAME, LOAD, DT, MR)                                                              \
static void gemm_tile_##NAME##_##MR(const gemm_args *g, int m, int64_t p, const void *panel) {     \
    vf acc[MR][GEMM_NV];                                                                           \
    for (int r = 0; r < MR; r++)                                                                   \
        for (int v = 0; v < GEMM_NV; v++) acc[r][v] = (vf){0};                                     \
    const float *x = g->xf + m * g->ldxf;                                                          \
    for (int k = 0; k < g->K; k++) {                                                               \
        vf b[GEMM_NV];                                                                             \
        LOAD(panel, k, b);                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                     \
            float a = x[r * g->ldxf + k];  /* (a scalar times a vector: one broadcast load) */     \
            _Pragma("GCC unroll 4") for (int v = 0; v < GEMM_NV; v++) acc[r][v] += a * b[v];       \
        }                                                                                          \
    }                                                                                              \
    gemm_store(g, DT, m, MR, p, acc);                                                              \
}
#define GEMM_TILES(NAME, LOAD, DT)                                                                 \
    GEMM_TILE(NAME, LOAD, DT, 1) GEMM_TILE(NAME, LOAD, DT, 2) GEMM_TILE(NAME, LOAD, DT, 3)         \
    GEMM_TILE(NAME, LOAD, DT, 4) GEMM_TILE(NAME, LOAD, DT, 5) GEMM_TILE(NAME, LOAD, DT, 6)
typedef void (*gemm_tile_fn)(const gemm_args *, int, int64_t, const void *);
#define GEMM_TILE_TABLE(NAME) {0, gemm_tile_##NAME##_1, gemm_tile_##NAME##_2, gemm_tile_##NAME##_3, \
    gemm_tile_##NAME##_4, gemm_tile_##NAME##_5, gemm_tile_##NAME##_6}

GEMM_TILES(f32, gemm_load_f32, F32)
static const gemm_tile_fn GEMM_TILES_F32[GEMM_MR + 1] = GEMM_TILE_TABLE(f32);

#if GEMM_BF16_PAIRS
/* bfloat16 x rows (pairs broadcast) against pairs of bfloat16 weights, vdpbf16ps */
#define GEMM_TILE_PAIRS(MR)                                                                        \
static void gemm_tile_bf16_##MR(const gemm_args *g, int m, int64_t p, const void *panel) {         \
    vf acc[MR][GEMM_NV];                                                                           \
    for (int r = 0; r < MR; r++)                                                                   \
        for (int v = 0; v < GEMM_NV; v++) acc[r][v] = (vf){0};                                     \
    const uint16_t *x = (const uint16_t *)g->x + m * g->ldx, *B = panel;                           \
    for (int j = 0; j < g->K / 2; j++) {                                                           \
        const __m512bh *b = (const __m512bh *)(B + (int64_t)j * GEMM_NR * 2);                      \
        __m512bh b0 = b[0], b1 = b[1], b2 = b[2], b3 = b[3];                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                     \
            int32_t pair;                                                                          \
            memcpy(&pair, x + r * g->ldx + 2 * j, 4);                                              \
            __m512bh a = (__m512bh)_mm512_set1_epi32(pair);                                        \
            acc[r][0] = (vf)_mm512_dpbf16_ps((__m512)acc[r][0], a, b0);                            \
            acc[r][1] = (vf)_mm512_dpbf16_ps((__m512)acc[r][1], a, b1);                            \
            acc[r][2] = (vf)_mm512_dpbf16_ps((__m512)acc[r][2], a, b2);                            \
            acc[r][3] = (vf)_mm512_dpbf16_ps((__m512)acc[r][3], a, b3);                            \
        }                                                                                          \
    }                                                                                              \
    gemm_store(g, BF16, m, MR, p, acc);                                                            \
}
GEMM_TILE_PAIRS(1) GEMM_TILE_PAIRS(2) GEMM_TILE_PAIRS(3) GEMM_TILE_PAIRS(4) GEMM_TILE_PAIRS(5)
GEMM_TILE_PAIRS(6)
#else
GEMM_TILES(bf16, gemm_load_bf16, BF16)
#endif
static const gemm_tile_fn GEMM_TILES_BF16[GEMM_MR + 1] = GEMM_TILE_TABLE(bf16);

/* the float32 tiles that store bfloat16 (a float32 panel times float32 x, rounded at the store) */
GEMM_TILES(f32b, gemm_load_f32, BF16)
static const gemm_tile_fn GEMM_TILES_F32_TO_BF16[GEMM_MR + 1] = GEMM_TILE_TABLE(f32b);

#endif
