/* omni_gemm: products of a few to a few hundred rows, weights packed at load. */
#include "gemm_tiles.h"

int omni_gemm_supported(int dt) { return dt == F32 || dt == BF16; }

/* what K must be a multiple of for omni_gemm_pack (bfloat16 pairs for vdpbf16ps: 2) */
int omni_gemm_k_multiple(int dt) { return dt == BF16 && GEMM_BF16_PAIRS ? 2 : 1; }

/* elements the packed copy of an [N, K] weight takes (bfloat16 with vdpbf16ps: K even) */
int64_t omni_gemm_packed_size(int N, int K, int gated) {
    int64_t cols = gated ? (int64_t)(N / 2 + GEMM_NR / 2 - 1) / (GEMM_NR / 2) * GEMM_NR
                         : (int64_t)(N + GEMM_NR - 1) / GEMM_NR * GEMM_NR;
    return cols * K;
}

/* the panel column (0 .. NR - 1) held at position q of a packed row of NR weights */
INLINE int gemm_column(int q, int dt) {
    if (dt == F32 || GEMM_BF16_PAIRS) return q;
    int r = q % (2 * VL);
    return q - r + (r & 1) * VL + r / 2;
}

/* w [N, K] (bfloat16 with vdpbf16ps: K even; gated: N even) -> out (omni_gemm_packed_size
 * elements; padding 0) */
void omni_gemm_pack(const void *w, int N, int K, int gated, int dt, void *out, int nthreads) {
    int half = N / 2;
    int64_t P = omni_gemm_packed_size(N, K, gated) / K / GEMM_NR;
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (int64_t p = 0; p < P; p++)
        for (int k = 0; k < K; k++)
            for (int q = 0; q < GEMM_NR; q++) {
                int c = gemm_column(q, dt);
                int64_t n;
                if (!gated) n = p * GEMM_NR + c;
                else {
                    int64_t col = p * (GEMM_NR / 2) + c % (GEMM_NR / 2);
                    n = col < half ? col + (c < GEMM_NR / 2 ? 0 : half) : N;
                }
                int64_t at = dt == BF16 && GEMM_BF16_PAIRS
                                 ? ((p * (K / 2) + k / 2) * GEMM_NR + q) * 2 + k % 2
                                 : (p * K + k) * GEMM_NR + q;
                if (dt == F32) ((float *)out)[at] = n < N ? ((const float *)w)[n * K + k] : 0.f;
                else ((uint16_t *)out)[at] = n < N ? ((const uint16_t *)w)[n * K + k] : 0;
            }
}

/* omni_gemm's work; with `argmax` set (and y unused), the first maximum of each row instead */
static int gemm_run(const void *x, int64_t ldx, const void *packed, const void *bias, void *y,
                    int64_t ldy, int M, int N, int K, int gated, int dt, int nthreads,
                    int64_t *argmax) {
    const gemm_tile_fn *tiles_of = dt == F32 ? GEMM_TILES_F32 : GEMM_TILES_BF16;
    int widen = dt == BF16 && !GEMM_BF16_PAIRS;  /* the FMA tiles read x as float32 */
    gemm_args g = {x, bias, dt == F32 ? (const float *)x : NULL, y, ldx, dt == F32 ? ldx : K, ldy,
                   K, N, gated, NULL, NULL};
    size_t es = dt == F32 ? 4 : 2;
    int64_t P = omni_gemm_packed_size(N, K, gated) / K / GEMM_NR;
    if (nthreads < 1) nthreads = 1;
    /* Threads take contiguous ranges of panels and keep them over every chunk of rows (their
     * weights stay in L2). With fewer panels than threads, they take (chunk, panel) units, the
     * chunks made short enough (in whole tiles) for every thread to get one. */
    int64_t mc_max = GEMM_MC;
    if (P < nthreads) {
        int64_t chunks = (nthreads + P - 1) / P, rows = (M + chunks - 1) / chunks;
        rows = (rows + GEMM_MR - 1) / GEMM_MR * GEMM_MR;
        if (rows < mc_max) mc_max = rows;
    }
    int64_t C = (M + mc_max - 1) / mc_max;
    int by_units = P < nthreads && C > 1;
    int64_t units = by_units ? P * C : P;
    if (nthreads > units) nthreads = (int)units;
    float *best = NULL, *xf = NULL;
    int32_t *best_col = NULL;
    if (widen && !(xf = malloc((size_t)M * K * sizeof(float)))) return -1;
    g.xf = widen ? xf : g.xf;
    if (argmax) {  /* per thread and row: the maximum so far and its column */
        best = malloc((size_t)nthreads * M * sizeof(float));
        best_col = malloc((size_t)nthreads * M * sizeof(int32_t));
        if (!best || !best_col) {
            free(best), free(best_col), free(xf);
            return -1;
        }
        for (size_t i = 0; i < (size_t)nthreads * M; i++) best[i] = -INFINITY, best_col[i] = -1;
    }
#pragma omp parallel num_threads(nthreads)
    {
        if (widen) {  /* each thread widens its share of the rows, then all multiply */
            int64_t r0, r1;
            thread_share(M, &r0, &r1);
            for (int64_t r = r0; r < r1; r++) {
                int k = 0;
                for (; k + VL <= K; k += VL) *(vfu *)(xf + r * K + k) = ld(x, BF16, r * ldx + k);
                for (; k < K; k++) xf[r * K + k] = ld1(x, BF16, r * ldx + k);
            }
#pragma omp barrier
        }
        int64_t u0, u1;
        thread_share(units, &u0, &u1);
        gemm_args mine = g;
        if (argmax) {
#ifdef _OPENMP
            size_t t = (size_t)omp_get_thread_num();
#else
            size_t t = 0;
#endif
            mine.best = best + t * M, mine.best_col = best_col + t * M;
        }
        for (int64_t c = by_units ? u0 / P : 0; c < (by_units ? (u1 + P - 1) / P : C); c++) {
            int m0 = (int)(c * mc_max), mc = M - m0 < mc_max ? M - m0 : (int)mc_max;
            int tiles = (mc + GEMM_MR - 1) / GEMM_MR;
            int64_t p0 = by_units ? (c * P > u0 ? 0 : u0 - c * P) : u0;
            int64_t p1 = by_units ? (u1 - c * P < P ? u1 - c * P : P) : u1;
            for (int64_t p = p0; p < p1; p++) {
                const char *B = (const char *)packed + p * (int64_t)K * GEMM_NR * es;
                for (int i = 0, m = m0; i < tiles; i++) {  /* tiles of near-equal heights */
                    int left = m0 + mc - m, mr = (left + tiles - i - 1) / (tiles - i);
                    tiles_of[mr](&mine, m, p, B);
                    m += mr;
                }
            }
        }
        if (argmax) {
#pragma omp barrier
#ifdef _OPENMP
            int used = omp_get_num_threads();
#else
            int used = 1;
#endif
            int64_t r0, r1;
            thread_share(M, &r0, &r1);
            for (int64_t r = r0; r < r1; r++) argmax[r] = argmax_merge(best, best_col, M, used, (int)r);
        }
    }
    free(best), free(best_col), free(xf);
    return 0;
}

/* y [M, ldy] = x [M, ldx] @ W^T (+ bias [N]) with W [N, K] packed by omni_gemm_pack (gated: y is
 * [M, N / 2], silu(gate) * up), all in dtype dt. Returns -1 where omni_gemm_supported(dt) is 0
 * or scratch memory could not be had (nothing written), else 0. */
int omni_gemm(const void *x, int64_t ldx, const void *packed, const void *bias, void *y, int64_t ldy,
              int M, int N, int K, int gated, int dt, int nthreads) {
    if (!omni_gemm_supported(dt)) return -1;
    if (M <= 0 || N <= 0 || K <= 0) return 0;  /* nothing to compute */
    return gemm_run(x, ldx, packed, bias, y, ldy, M, N, K, gated, dt, nthreads, NULL);
}

/* out[r] (int64) = the column of the first maximum of row r of x @ W^T (+ bias), W [N, K] packed
 * (not gated) by omni_gemm_pack; each value as omni_gemm would write it (bfloat16: rounded), a
 * NaN counting as the greatest, as torch.argmax. Returns -1 where omni_gemm_supported(dt) is 0
 * or the scratch memory could not be had (nothing written), else 0. */
int omni_gemm_argmax(const void *x, int64_t ldx, const void *packed, const void *bias, int64_t *out,
                     int M, int N, int K, int dt, int nthreads) {
    if (!omni_gemm_supported(dt) || N <= 0 || K <= 0) return -1;
    if (M <= 0) return 0;
    return gemm_run(x, ldx, packed, bias, NULL, 0, M, N, K, 0, dt, nthreads, out);
}
