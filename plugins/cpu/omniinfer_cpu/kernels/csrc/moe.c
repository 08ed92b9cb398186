/* omni_moe: a mixture-of-experts layer's routed experts, reading only the experts some token
 * was routed to.
 *
 * out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(gate) * up),  [gate; up] = w13[e] @ x[t],
 * e = topk_ids[t, k]; w13 [E, 2I, H] (each expert's gate rows, then its up rows), w2 [E, H, I],
 * x, w13, w2 and out in one dtype (out's row stride ldo), the weights float32.
 *
 * The experts go in increasing order; each gathers the rows routed to it and multiplies them
 * with linear.h's small-M row loops (one pass over the expert's weight, the rows meeting each
 * weight row while it is in registers), so a decode step reads each routed expert once and no
 * other. Threads split an expert's rows of W (gate and up rows of one range of I together, so
 * each thread multiplies its own SiLU columns; then ranges of H of the down projection, each
 * thread accumulating its own output columns in float32): two barriers an expert.
 * Returns 0, -1 for an expert id outside [0, E), -2 when memory runs out. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "linear.h"

static void moe_rows_f32(const void *x, size_t ldx, const void *w, void *y, size_t ldy, int M,
                         int K, int n0, int n1) {
    linear_rows(x, ldx, w, NULL, y, ldy, F32, M, K, n0, n1);
}

static void moe_rows_bf16(const void *x, size_t ldx, const void *w, void *y, size_t ldy, int M,
                          int K, int n0, int n1) {
    linear_rows(x, ldx, w, NULL, y, ldy, BF16, M, K, n0, n1);
}

int omni_moe(const void *x, int64_t ldx, const void *w13, const void *w2, const int64_t *topk_ids,
             const float *topk_weights, void *out, int64_t ldo, int T, int K, int E, int H, int I,
             int dt, int nthreads) {
    void (*rows)(const void *, size_t, const void *, void *, size_t, int, int, int, int) =
        dt == F32 ? moe_rows_f32 : moe_rows_bf16;
    size_t es = dt == F32 ? 4 : 2, TK = (size_t)T * K;
    for (size_t i = 0; i < TK; i++)
        if (topk_ids[i] < 0 || topk_ids[i] >= E) return -1;
    /* the (token, k) pairs grouped by expert, tokens in order within each: CSR over experts */
    int *start = calloc((size_t)E + 1, sizeof(int)), *pair = malloc((TK ? TK : 1) * sizeof(int));
    char *xg = malloc(((size_t)T * H + 1) * es), *g = malloc(((size_t)T * 2 * I + 1) * es);
    char *a = malloc(((size_t)T * I + 1) * es), *y = malloc(((size_t)T * H + 1) * es);
    float *acc = calloc((size_t)T * H + 1, sizeof(float));
    int rc = 0;
    if (!start || !pair || !xg || !g || !a || !y || !acc) {
        rc = -2;
        goto done;
    }
    for (size_t i = 0; i < TK; i++) start[topk_ids[i] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    {
        int *fill = malloc(((size_t)E + 1) * sizeof(int));
        if (!fill) {
            rc = -2;
            goto done;
        }
        memcpy(fill, start, ((size_t)E + 1) * sizeof(int));
        for (size_t i = 0; i < TK; i++) pair[fill[topk_ids[i]]++] = (int)i;
        free(fill);
    }
    if (nthreads < 1) nthreads = 1;
    nthreads = threads_for((int64_t)3 * I * H, nthreads);
#pragma omp parallel num_threads(nthreads)
    {
        int64_t i0, i1, h0, h1;
        thread_share(I, &i0, &i1);
        thread_share(H, &h0, &h1);
        for (int e = 0; e < E; e++) {
            int n = start[e + 1] - start[e];
            if (n == 0) continue;
            const int *routed = pair + start[e];
            const char *we13 = (const char *)w13 + (size_t)e * 2 * I * H * es;
            const char *we2 = (const char *)w2 + (size_t)e * H * I * es;
#pragma omp for schedule(static)
            for (int m = 0; m < n; m++)
                memcpy(xg + (size_t)m * H * es, (const char *)x + (size_t)(routed[m] / K) * ldx * es,
                       (size_t)H * es);
            /* (the loop's barrier: every gathered row is in place) */
            if (i1 > i0) {
                rows(xg, H, we13, g, 2 * (size_t)I, n, H, (int)i0, (int)i1);
                rows(xg, H, we13, g, 2 * (size_t)I, n, H, I + (int)i0, I + (int)i1);
                for (int m = 0; m < n; m++)
                    for (int64_t i = i0; i < i1; i++) {
                        float gate = ld1(g, dt, (size_t)m * 2 * I + i);
                        float up = ld1(g, dt, (size_t)m * 2 * I + I + i);
                        st1(a, dt, (size_t)m * I + i, gate / (1.f + expf(-gate)) * up);
                    }
            }
#pragma omp barrier
            if (h1 > h0) {
                rows(a, I, we2, y, H, n, I, (int)h0, (int)h1);
                for (int m = 0; m < n; m++) {
                    float w = topk_weights[routed[m]];
                    float *row = acc + (size_t)(routed[m] / K) * H;
                    for (int64_t h = h0; h < h1; h++) row[h] += w * ld1(y, dt, (size_t)m * H + h);
                }
            }
#pragma omp barrier
        }
        for (int t = 0; t < T; t++)
            for (int64_t h = h0; h < h1; h++) st1(out, dt, (size_t)t * ldo + h, acc[(size_t)t * H + h]);
    }
done:
    free(start), free(pair), free(xg), free(g), free(a), free(y), free(acc);
    return rc;
}
