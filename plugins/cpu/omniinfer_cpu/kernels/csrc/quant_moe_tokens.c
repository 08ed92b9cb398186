/* omni_qmoe_tokens: omni_qmoe for T tokens (a prefill chunk), experts in groups of 8 rows with
 * int8 activations (is_x8 | QACT_INT8, one format for every gate/up and one for every down):
 *   out[t] = sum over k of weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = ids[t, k].
 * The (token, k) pairs are sorted by expert (then token), their x rows gathered and rounded to
 * int8 blocks; in one parallel region the threads share every hit expert's gate/up groups (each
 * group against all of its expert's rows, XMB at a time), then the SiLU-and-multiply and its
 * rounding, then the down groups; each token's terms are added in increasing expert order. An
 * expert with enough pairs for AMX's tiles (omni_amx_takes) multiplies its gate/up and down there
 * instead (omni_qamx: x and the act rounded to bfloat16, as a dense layer's prefill). Tokens
 * go QMOE_CHUNK at a time (the buffers: ~(3I + 2H) floats a pair). Returns -1 for an id outside
 * [0, E), n outside [1, 64] or T < 1, -2 for formats this path does not run, -3 out of memory. */
#include <stdlib.h>
#include <string.h>

#include "omni.h"
#include "omni_api.h"
#include "prefetch.h"
#include "quant_blocks.h"

#define QMOE_CHUNK 256

/* y rows [r0, r1) of the sorted pairs = X rows [r0, r1) @ W^T for one expert's W (N rows, groups
 * g0..g1 of 8) */
static void expert_groups(x8_group_fn group, const uint8_t *w, size_t group_bytes, const xq *X, int r0, int r1,
                          int64_t g0, int64_t g1, float *y, int N) {
    float out[XMB][8];
    for (int64_t g = g0; g < g1; g++)
        for (int m0 = r0; m0 < r1; m0 += XMB) {
            int mb = r1 - m0 < XMB ? r1 - m0 : XMB;
            group(w + (size_t)g * group_bytes, X, m0, mb, out);
            for (int m = 0; m < mb; m++) memcpy(y + (size_t)(m0 + m) * N + 8 * g, out[m], sizeof(float) * 8);
        }
}

/* every hit expert's groups of its N-row weight against its pairs' rows, the (expert, group)
 * items shared out as one range (inside a parallel region), read as prefetch.h's interleaved runs */
static void all_experts(int kind, const int64_t *w, const int64_t *hit, int nh, const int *start, const xq *X,
                        float *y, int N) {
    x8_group_fn group = omni_x8_group(kind);
    size_t group_bytes = 8 * qrow_bytes(kind, X->K);
    int64_t G = N / 8, i0, i1;
    thread_share((int64_t)nh * G, &i0, &i1);
    for (int64_t i = 0; i < n_steps(i0, i1); i++) {
        int64_t item = streamed_unit(i, i0, i1);
        if (item >= i1) continue;
        int64_t e = hit[item / G], g = item % G;
        expert_groups(group, (const uint8_t *)(intptr_t)w[e], group_bytes, X, start[e], start[e + 1], g, g + 1, y, N);
    }
}

static int chunk(const float *x, int T, const int64_t *w13, int kind13, const int64_t *w2, int kind2,
                 const int64_t *ids, const float *weights, int n, int E, float *out, int H, int I, int nthreads) {
    int P = T * n, rc = -3;
    int *start = calloc((size_t)E + 1, sizeof(int)), *pair = malloc(sizeof(int) * (size_t)P);
    int64_t *hit = malloc(sizeof(int64_t) * 3 * (size_t)E);  /* the hit experts, then tiled, dotted */
    /* per pair: x gathered (H) then gate_up (2I), act (I), y (H) */
    float *xg = malloc(sizeof(float) * (size_t)P * (2 * (size_t)H + 3 * (size_t)I));
    size_t qb = (size_t)P * (H + I) + sizeof(float) * 5 * (size_t)P * (H / 32 + I / 32) + 128;
    int8_t *qbuf = malloc(qb);
    if (!start || !pair || !hit || !xg || !qbuf) goto done;
    for (int p = 0; p < P; p++) start[ids[p] + 1]++;  /* (ids checked by the caller) */
    int nh = 0;
    for (int e = 0; e < E; e++) {
        if (start[e + 1]) hit[nh++] = e;
        start[e + 1] += start[e];
    }
    {
        int *at = malloc(sizeof(int) * (size_t)E);
        if (!at) goto done;
        memcpy(at, start, sizeof(int) * (size_t)E);
        for (int p = 0; p < P; p++) pair[at[ids[p]]++] = p;  /* by expert, then token */
        free(at);
    }
    float *gate_up = xg + (size_t)P * H, *act = gate_up + (size_t)P * 2 * I, *y = act + (size_t)P * I;
    for (int i = 0; i < P; i++) memcpy(xg + (size_t)i * H, x + (size_t)(pair[i] / n) * H, sizeof(float) * H);
    int8_t *qx = qbuf, *qa = qx + (size_t)P * H;
    /* the scales 64-byte aligned, as omni_qlinear_q8's */
    float *dx = (float *)(((uintptr_t)(qa + (size_t)P * I) + 63) & ~(uintptr_t)63);
    float *sx = dx + (size_t)P * (H / 32), *s32x = sx + (size_t)P * (H / 16);
    int32_t *ix = (int32_t *)(s32x + (size_t)P * (H / 32));
    float *da = (float *)(((uintptr_t)(ix + (size_t)P * (H / 32)) + 63) & ~(uintptr_t)63);
    float *sa = da + (size_t)P * (I / 32), *s32a = sa + (size_t)P * (I / 16);
    int32_t *ia = (int32_t *)(s32a + (size_t)P * (I / 32));
    omni_quantize_x(xg, H, F32, P, H, qx, dx, sx, s32x, ix);
    xq X = {qx, dx, sx, s32x, ix, H}, A = {qa, da, sa, s32a, ia, I};
    /* an expert with enough pairs for AMX's tiles takes them (quant_amx.c: x and the act rounded to
     * bfloat16; each call threads its own panels); the rest share the int8 groups below */
    int nt = 0, nd = 0;
    int64_t *tiled = hit + nh, *dotted = tiled + nh;
    for (int i = 0; i < nh; i++) {
        int64_t e = hit[i];
        int rows = start[e + 1] - start[e];
        if (omni_amx_takes(kind13, rows, H) && omni_amx_takes(kind2, rows, I) &&
            omni_qamx(xg + (size_t)start[e] * H, H, (const uint8_t *)(intptr_t)w13[e], NULL,
                      gate_up + (size_t)start[e] * 2 * I, 2 * I, rows, 2 * I, H, kind13, F32, nthreads) == 0)
            tiled[nt++] = e;
        else
            dotted[nd++] = e;
    }
#pragma omp parallel num_threads(nthreads)
    {
        all_experts(kind13, w13, dotted, nd, start, &X, gate_up, 2 * I);
#pragma omp barrier
#pragma omp single
        {
            omni_silu_and_mul(gate_up, act, P, I, F32, 1);
            omni_quantize_x(act, I, F32, P, I, qa, da, sa, s32a, ia);
        }
        all_experts(kind2, w2, dotted, nd, start, &A, y, H);
    }
    for (int i = 0; i < nt; i++) {
        int64_t e = tiled[i];
        const uint8_t *w = (const uint8_t *)(intptr_t)w2[e];
        if (omni_qamx(act + (size_t)start[e] * I, I, w, NULL, y + (size_t)start[e] * H, H, start[e + 1] - start[e], H,
                      I, kind2, F32, nthreads))  /* (out of memory: its int8 groups, on this thread) */
            expert_groups(omni_x8_group(kind2), w, 8 * qrow_bytes(kind2, I), &A, start[e], start[e + 1], 0, H / 8, y,
                          H);
    }
    memset(out, 0, sizeof(float) * (size_t)T * H);
    for (int i = 0; i < P; i++) {  /* (in expert order: each token's terms by increasing expert) */
        float w = weights[pair[i]], *o = out + (size_t)(pair[i] / n) * H;
        for (int j = 0; j < H; j++) o[j] += w * y[(size_t)i * H + j];
    }
    rc = 0;
done:
    free(start), free(pair), free(hit), free(xg), free(qbuf);
    return rc;
}

int omni_qmoe_tokens(const float *x, int T, const int64_t *w13, int kind13, const int64_t *w2, int kind2,
                     const int64_t *ids, const float *weights, int n, int E, float *out, int H, int I, int nthreads) {
    if (T < 1 || n < 1 || n > 64) return -1;
    for (int64_t p = 0; p < (int64_t)T * n; p++)
        if (ids[p] < 0 || ids[p] >= E) return -1;
    if (!(kind13 & QACT_INT8) || !(kind2 & QACT_INT8) || !is_x8(kind13 & ~QACT_INT8) || !is_x8(kind2 & ~QACT_INT8) ||
        H % 32 || I % 32)
        return -2;
    nthreads = nthreads < 1 ? 1 : nthreads;
    for (int t0 = 0; t0 < T; t0 += QMOE_CHUNK) {
        int t = T - t0 < QMOE_CHUNK ? T - t0 : QMOE_CHUNK;
        int rc = chunk(x + (size_t)t0 * H, t, w13, kind13 & ~QACT_INT8, w2, kind2 & ~QACT_INT8, ids + (size_t)t0 * n,
                       weights + (size_t)t0 * n, n, E, out + (size_t)t0 * H, H, I, nthreads);
        if (rc) return rc;
    }
    return 0;
}
