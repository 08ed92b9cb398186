/* omni_qmoe: one token's routed experts on quantised weights, in one call (the CPU plugin's step for
 * quantization/experts.py's QuantMoEMethod at batch 1):
 *   out[H] = sum over k of weights[k] * down_e(silu(gate_e(x)) * up_e(x)),  e = ids[k],
 * gate_e | up_e = w13[e] ([2I, H]: blocks w13[e], scale s13[e] or NULL, format kind13[e] as
 * omni_qlinear's), down_e = w2[e] ([H, I]); the terms added in float32 in increasing expert order
 * (as routed_sum adds them in torch; a fused multiply-add may round once where torch rounds twice).
 * x, out: float32 [H].
 *
 * Experts in groups of 8 rows with int8 activations (the default: is_x8 | QACT_INT8), one format
 * for every gate/up and one for every down: one parallel region. x is rounded once; the threads
 * share the routed experts' gate/up groups as one range (each a contiguous stretch of them, as
 * one product's rows), then the SiLU-and-multiply and its rounding (a row an expert), then the
 * down groups the same way: the numbers omni_qlinear gives expert by expert, without a fork and
 * a rounding of x per product. Other formats (float activations): omni_qlinear per product.
 * Returns -1 for an expert id outside [0, E) or n outside [1, 64], -2 where a product fails (its
 * format or shape), -3 out of memory. */
#include <stdlib.h>

#include "omni.h"
#include "omni_api.h"
#include "quant_blocks.h"

#define QMOE_MAX_K 64

typedef struct {  /* x rounded to int8 blocks: M rows of K (omni_quantize_x's arrays) */
    int8_t *q;
    float *d, *s, *s32;
    int32_t *isum;
} rounded;

static int rounded_alloc(rounded *r, int M, int K) {
    size_t nb = (size_t)M * (K / 32);
    r->q = malloc((size_t)M * K + sizeof(float) * 5 * nb + 64);
    if (!r->q) return -1;
    r->d = (float *)(((uintptr_t)(r->q + (size_t)M * K) + 63) & ~(uintptr_t)63);  /* (as omni_qlinear_q8's) */
    r->s = r->d + nb, r->s32 = r->s + 2 * nb, r->isum = (int32_t *)(r->s32 + nb);
    return 0;
}

/* y[i] [N] = W_i @ (row i of X where `per_expert`, else its row 0) for the routed experts' weights
 * W_i (blocks at w[expert[i]], `kind` in groups of 8 rows, N % 8 == 0): the threads share all
 * n * N / 8 groups as one range. Called inside a parallel region. */
static void shared_groups(int kind, const int64_t *w, const int64_t *expert, int n, const xq *X, int per_expert,
                          float *y, int N) {
    x8_group_fn group = omni_x8_group(kind);
    size_t group_bytes = 8 * qrow_bytes(kind, X->K);
    int64_t G = N / 8, g0, g1;
    thread_share((int64_t)n * G, &g0, &g1);
    float out[XMB][8];
    for (int64_t g = g0; g < g1; g++) {
        int i = (int)(g / G);
        int64_t l = g % G;
        group((const uint8_t *)(intptr_t)w[expert[i]] + (size_t)l * group_bytes, X, per_expert ? i : 0, 1, out);
        for (int r = 0; r < 8; r++) y[(size_t)i * N + 8 * l + r] = out[0][r];
    }
}

/* the x8 path (the comment above): y [n, H] of the experts in `expert` (increasing) */
static int qmoe_x8(const float *x, const int64_t *w13, int kind13, const int64_t *w2, int kind2,
                   const int64_t *expert, int n, float *y, int H, int I, int nthreads) {
    rounded rx, ra;
    float *gate_up = malloc(sizeof(float) * (size_t)n * 3 * I);
    if (!gate_up || rounded_alloc(&rx, 1, H)) {
        free(gate_up);
        return -3;
    }
    if (rounded_alloc(&ra, n, I)) {
        free(gate_up), free(rx.q);
        return -3;
    }
    float *act = gate_up + (size_t)n * 2 * I;
    omni_quantize_x(x, H, F32, 1, H, rx.q, rx.d, rx.s, rx.s32, rx.isum);
    xq X = {rx.q, rx.d, rx.s, rx.s32, rx.isum, H}, A = {ra.q, ra.d, ra.s, ra.s32, ra.isum, I};
    nthreads = threads_for((int64_t)n * 2 * I * H, nthreads < 1 ? 1 : nthreads);
#pragma omp parallel num_threads(nthreads)
    {
        shared_groups(kind13, w13, expert, n, &X, 0, gate_up, 2 * I);
#pragma omp barrier
#pragma omp single
        {
            omni_silu_and_mul(gate_up, act, n, I, F32, 1);
            omni_quantize_x(act, I, F32, n, I, ra.q, ra.d, ra.s, ra.s32, ra.isum);
        }
        shared_groups(kind2, w2, expert, n, &A, 1, y, H);
    }
    free(gate_up), free(rx.q), free(ra.q);
    return 0;
}

int omni_qmoe(const float *x, const int64_t *w13, const int64_t *s13, const int32_t *kind13, const int64_t *w2,
              const int64_t *s2, const int32_t *kind2, const int64_t *ids, const float *weights, int n, int E,
              float *out, int H, int I, int nthreads) {
    if (n < 1 || n > QMOE_MAX_K) return -1;
    int order[QMOE_MAX_K];
    int64_t expert[QMOE_MAX_K];
    for (int k = 0; k < n; k++) {  /* the routed experts by increasing id (insertion: k is small) */
        if (ids[k] < 0 || ids[k] >= E) return -1;
        int j = k;
        for (; j > 0 && ids[order[j - 1]] > ids[k]; j--) order[j] = order[j - 1];
        order[j] = k;
    }
    for (int i = 0; i < n; i++) expert[i] = ids[order[i]];
    float *y = malloc(sizeof(float) * ((size_t)n * H + 3 * (size_t)I));
    if (!y) return -3;
    int k13 = kind13[expert[0]], k2 = kind2[expert[0]], x8 = 1;
    for (int i = 0; i < n; i++) x8 &= kind13[expert[i]] == k13 && kind2[expert[i]] == k2;
    x8 &= (k13 & QACT_INT8) && (k2 & QACT_INT8) && is_x8(k13 & ~QACT_INT8) && is_x8(k2 & ~QACT_INT8) &&
          H % 32 == 0 && I % 32 == 0 && H % 8 == 0;
    int rc = 0;
    if (x8) {
        rc = qmoe_x8(x, w13, k13 & ~QACT_INT8, w2, k2 & ~QACT_INT8, expert, n, y, H, I, nthreads);
    } else {
        float *gate_up = y + (size_t)n * H, *act = gate_up + 2 * (size_t)I;  /* (2I + I floats past y) */
        for (int i = 0; i < n && !rc; i++) {
            int64_t e = expert[i];
            if (omni_qlinear(x, H, (const uint8_t *)(intptr_t)w13[e], (const float *)(intptr_t)s13[e], gate_up,
                             2 * I, 1, 2 * I, H, kind13[e], F32, nthreads)) {
                rc = -2;
                break;
            }
            omni_silu_and_mul(gate_up, act, 1, I, F32, 1);
            if (omni_qlinear(act, I, (const uint8_t *)(intptr_t)w2[e], (const float *)(intptr_t)s2[e],
                             y + (size_t)i * H, H, 1, H, I, kind2[e], F32, nthreads))
                rc = -2;
        }
    }
    if (!rc) {
        for (int j = 0; j < H; j++) out[j] = 0.f;
        for (int i = 0; i < n; i++) {
            float w = weights[order[i]];
            for (int j = 0; j < H; j++) out[j] += w * y[(size_t)i * H + j];
        }
    }
    free(y);
    return rc;
}
