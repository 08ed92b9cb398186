/* omni_qmoe: one token's routed experts on quantised weights, in one call (the CPU plugin's step for
 * quantization/experts.py's QuantMoEMethod at batch 1):
 *   out[H] = sum over k of weights[k] * down_e(silu(gate_e(x)) * up_e(x)),  e = ids[k],
 * gate_e | up_e = w13[e] ([2I, H]: blocks w13[e], scale s13[e] or NULL, format kind13[e] as
 * omni_qlinear's), down_e = w2[e] ([H, I]); the terms added in float32 in increasing expert order
 * (as routed_sum adds them in torch; a fused multiply-add may round once where torch rounds twice).
 * x, out: float32 [H].
 *
 * Experts in groups of 8 rows with int8 activations (the default: is_x8 | QACT_INT8), one format
 * for every gate/up and one for every down, go to omni_qmoe_tokens as a chunk of one token (one
 * parallel region: quant_moe_tokens.c). Other formats (float activations):
 * omni_qlinear per product. Returns -1 for an expert id outside [0, E) or n outside [1, 64], -2
 * where a product fails (its format or shape), -3 out of memory. */
#include <stdlib.h>

#include "omni.h"
#include "omni_api.h"
#include "quant_blocks.h"

#define QMOE_MAX_K 64

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
    int k13 = kind13[expert[0]], k2 = kind2[expert[0]], x8 = 1;
    for (int i = 0; i < n; i++) x8 &= kind13[expert[i]] == k13 && kind2[expert[i]] == k2;
    x8 &= (k13 & QACT_INT8) && (k2 & QACT_INT8) && is_x8(k13 & ~QACT_INT8) && is_x8(k2 & ~QACT_INT8) &&
          H % 32 == 0 && I % 32 == 0;
    if (x8)  /* (one token is a chunk of one: quant_moe_tokens.c) */
        return omni_qmoe_tokens(x, 1, w13, k13, w2, k2, ids, weights, n, E, out, H, I, nthreads);
    float *y = malloc(sizeof(float) * ((size_t)n * H + 3 * (size_t)I));
    if (!y) return -3;
    int rc = 0;
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
