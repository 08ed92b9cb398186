/* omni_linear_argmax_q8: batch-1 greedy tokens through an int8 copy of the LM head. */
#include "linear.h"

/* ---- the greedy token of one or two rows, pruned by an int8 copy of the LM head -------------- */
/* Batch-1 decode streams the whole LM head for one argmax. An int8 copy (a scale per row) gives
 * every logit to within a bound that holds for the float32 sums omni_linear computes; only the
 * rows whose bound reaches the best row's lower bound are computed exactly, with omni_linear's own
 * arithmetic, so the token is the argmax of what omni_linear would store (NaN the greatest, the
 * first column among equals). Half the bytes of a bfloat16 head, a quarter of a float32 one. */

#define Q8_TINY 1.1754943508222875e-38  /* 2^-126: below it products and sums may be flushed */

/* w [N, K] -> q [N, K] (int8, w / scale rounded), scale [N], coef [2N]: for a row r and an input x,
 * |omni_linear's float32 sum - scale[r] * (q_r . x)| <= coef[r] * |x|_2 + coef[N + r]. A row with
 * a non-finite weight gets coef infinite (always computed exactly). */
void omni_q8_pack(const void *w, int N, int K, int dt, int8_t *q, float *scale, float *coef,
                  int nthreads) {
    const double u = 1.0 / 16777216.0, n = (double)K + 64.0;  /* terms a sum may pass through */
    const double gamma = n * u / (1.0 - n * u);
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (int r = 0; r < N; r++) {
        size_t base = (size_t)r * K;
        double amax = 0.0;
        int finite = 1;
        for (int k = 0; k < K; k++) {
            double v = ld1(w, dt, base + k);
            if (!isfinite(v)) finite = 0;
            else if (fabs(v) > amax) amax = fabs(v);
        }
        if (!finite) {
            memset(q + base, 0, (size_t)K);
            scale[r] = 0.f, coef[r] = coef[N + r] = INFINITY;
            continue;
        }
        float s = (float)(amax / 127.0);
        double err2 = 0.0, w2 = 0.0, q2 = 0.0;
        for (int k = 0; k < K; k++) {
            double v = ld1(w, dt, base + k);
            long qi = s > 0.f ? lrint(v / s) : 0;
            qi = qi > 127 ? 127 : qi < -127 ? -127 : qi;
            q[base + k] = (int8_t)qi;
            double e = v - (double)s * (double)qi;
            err2 += e * e, w2 += v * v, q2 += (double)(qi * qi);
        }
        double c = sqrt(err2) + gamma * sqrt(w2) + (double)s * sqrt(q2) * (gamma + 2.0 * u);
        scale[r] = s;
        coef[r] = nextafterf((float)(c * (1.0 + 1e-4)), INFINITY);
        coef[N + r] = nextafterf((float)((2.0 * K * amax + 2.0 * n) * Q8_TINY * 2.0), INFINITY);
    }
}

/* bfloat16 rounding as stv stores it (with AVX-512 BF16, float32 denormals read as zero) */
INLINE float round_vec(float v) {
    uint16_t out[VL];
    stv(out, BF16, 0, (vf){0} + v);
    return ld1(out, BF16, 0);
}

/* What omni_linear stores for row r of N (one x row) run by T threads: a thread's full groups of
 * 16 rows go out through stv, the rest of its rows through st1. */
INLINE float q8_stored(float v, int dt, int64_t r, int64_t N, int T) {
    if (dt == F32) return v;
    int64_t t = r * T / N;
    while (t > 0 && r < N * t / T) t--;
    while (r >= N * (t + 1) / T) t++;
    int64_t n0 = N * t / T, n1 = N * (t + 1) / T;
    return r < n0 + (n1 - n0) / VL * VL ? round_vec(v) : round_to(BF16, v);
}


/* out[m] = the greedy token of row m of x [M, K] (M = 1 or 2) against w [N, K] (no bias), as
 * argmax of omni_linear(x, w) with `nthreads` threads would give it. q, scale, coef: omni_q8_pack's.
 * Returns 0; -1 (nothing written) for M outside 1-2 or a non-finite x, -2 when more than
 * `max_candidates` rows of some x row needed exact sums, -3 out of memory. */
int omni_linear_argmax_q8(const void *x, int64_t ldx, const void *w, const int8_t *q,
                          const float *scale, const float *coef, int64_t *out, int M, int N, int K,
                          int dt, int max_candidates, int nthreads) {
    if (M < 1 || M > 2 || N <= 0 || K <= 0) return -1;
    if (nthreads < 1) nthreads = 1;
    /* omni_linear's thread count for this product, which decides each row's store (bfloat16) */
    int linear_threads = threads_for((int64_t)N * K, nthreads);
    size_t es = dt == F32 ? 4 : 2;
    float *xf = malloc(sizeof(float) * (size_t)M * K), *approx = malloc(sizeof(float) * (size_t)M * N);
    float *lb = malloc(sizeof(float) * (size_t)nthreads * 2);
    /* per x row and thread: the running first maximum of the stored values, its row, how many
     * rows got exact sums */
    float *best = malloc(sizeof(float) * (size_t)nthreads * 2);
    int32_t *best_row = malloc(sizeof(int32_t) * (size_t)nthreads * 2);
    int *counts = calloc((size_t)nthreads * 2, sizeof(int));
    int rc = 0, num_threads = 1;
    if (!xf || !approx || !lb || !best || !best_row || !counts) {
        rc = -3;
        goto done;
    }
    double xn[2];
    for (int m = 0; m < M; m++) {
        double ss = 0.0;
        for (int k = 0; k < K; k++) {
            xf[m * K + k] = ld1(x, dt, (size_t)m * ldx + k);
            ss += (double)xf[m * K + k] * xf[m * K + k];
        }
        if (!isfinite(ss)) {
            rc = -1;
            goto done;
        }
        xn[m] = sqrt(ss) * (1.0 + 1e-6);
    }
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, T = 1;
#ifdef _OPENMP
        t = omp_get_thread_num(), T = omp_get_num_threads();
#endif
        if (t == 0) num_threads = T;
        int64_t n0 = (int64_t)N * t / T, n1 = (int64_t)N * (t + 1) / T;
        /* every row's approximate logit, and this thread's greatest lower bound of a stored one */
        for (int m = 0; m < M; m++) {
            const float *xm = xf + (size_t)m * K;
            float best_lb = -INFINITY;
            for (int64_t r = n0; r < n1; r++) {
                const int8_t *qr = q + (size_t)r * K;
                vf a0 = (vf){0}, a1 = a0, a2 = a0, a3 = a0;
                int k = 0;
                for (; k + 4 * VL <= K; k += 4 * VL) {  /* four chains: the FMA latency hidden */
                    a0 += s8_load(qr + k) * *(const vfu *)(xm + k);
                    a1 += s8_load(qr + k + VL) * *(const vfu *)(xm + k + VL);
                    a2 += s8_load(qr + k + 2 * VL) * *(const vfu *)(xm + k + 2 * VL);
                    a3 += s8_load(qr + k + 3 * VL) * *(const vfu *)(xm + k + 3 * VL);
                }
                for (; k + VL <= K; k += VL) a0 += s8_load(qr + k) * *(const vfu *)(xm + k);
                float sum = hsum((a0 + a1) + (a2 + a3));
                for (; k < K; k++) sum += (float)qr[k] * xm[k];
                float a = sum * scale[r];
                approx[(size_t)m * N + r] = a;
                double low = (double)a - ((double)coef[r] * xn[m] + coef[N + r]);
                if (low > best_lb) best_lb = nextafterf((float)low, -INFINITY);
            }
            lb[t * 2 + m] = best_lb;
        }
#pragma omp barrier
        /* A row whose upper bound, rounded as any store would, is below the best lower bound so
         * rounded stores a smaller value than that row: only the others get exact sums. */
        for (int m = 0; m < M; m++) {
            float best_lb = -INFINITY;
            for (int i = 0; i < T; i++) best_lb = lb[i * 2 + m] > best_lb ? lb[i * 2 + m] : best_lb;
            float floor_lb = dt == F32 ? best_lb : fminf(round_vec(best_lb), round_to(BF16, best_lb));
            float *top = best + (size_t)m * nthreads + t;
            int32_t *top_row = best_row + (size_t)m * nthreads + t;
            *top_row = -1;
            int count = 0;
            for (int64_t r = n0; r < n1; r++) {
                double beta = (double)coef[r] * xn[m] + coef[N + r];
                float ub = beta > 1e30 ? INFINITY
                                       : nextafterf((float)((double)approx[(size_t)m * N + r] + beta), INFINITY);
                float ceil_ub = dt == F32 ? ub : fmaxf(round_vec(ub), round_to(BF16, ub));
                if (ceil_ub < floor_lb) continue;
                if (++count > max_candidates) break;
                const char *wr = (const char *)w + (size_t)r * K * es;
                float v;
                if (M == 1) {  /* as linear_rows_m1 computes and stores row r */
                    v = q8_stored(hsum(row_vec(x, wr, dt, K)), dt, r, N, linear_threads);
                } else {  /* as linear_rows does for two x rows */
                    float two[4];
                    GEMV_ROW(x, (size_t)ldx, wr, dt, K, 2, GEMV_U(2), two);
                    v = round_to(dt, two[m]);
                }
                argmax_take(top, top_row, v, r);
            }
            counts[(size_t)m * nthreads + t] = count;
        }
    }
    for (int m = 0; m < M; m++)
        for (int t = 0; t < num_threads; t++)
            if (counts[(size_t)m * nthreads + t] > max_candidates) rc = -2;
    for (int m = 0; m < M && rc == 0; m++)  /* row ranges ascend with the thread */
        out[m] = argmax_merge(best + (size_t)m * nthreads, best_row + (size_t)m * nthreads, 1,
                              num_threads, 0);
done:
    free(xf), free(approx), free(lb), free(best), free(best_row), free(counts);
    return rc;
}
