/* omni_decoder_layers: all of a model's decoder layers in one call. */
#include "omni.h"

/* ---- a stack of decoder layers in one call --------------------------------------------------- */
/* One pre-norm Llama layer (decoder_stack.py builds these from the model's DecoderLayerSpec):
 *   h = x + o(attention(rotary(qkv(norm(x)))));  x' = h + down(silu(gate) * up), gate|up = gate_up(norm(h))
 * Each product with `*_packed` set (omni_gemm_pack; gate_up packed gated) runs omni_gemm above
 * `kernel_rows` rows; up to there omni_linear on the [out, in] weight, or omni_linear_ec on its
 * coded copy where `*_ec` is set; a quantised product (`*_q` set: its blocks for omni_qlinear, with
 * `*_qscale` and format `*_qkind`) runs omni_qlinear at any row count, then adds its bias. */
#define QSEGS 3

typedef struct {
    const void *input_norm, *qkv, *qkv_packed, *qkv_ec, *qkv_bias, *o, *o_packed, *o_ec, *o_bias,
        *post_norm, *gate_up, *gate_up_packed, *gate_up_ec, *gate_up_bias, *down, *down_packed,
        *down_ec, *down_bias;
    void *k_cache, *v_cache;
    const float *cos, *sin;  /* float32 [max_position, rotary_dim / 2] */
    float input_eps, post_eps, scale;
    int hidden, num_heads, num_kv_heads, head_size, intermediate, block_size, window, max_position,
        rotary_dim;
    const void *qkv_q, *o_q, *gate_up_q, *down_q;
    const float *qkv_qscale, *o_qscale, *gate_up_qscale, *down_qscale;
    int qkv_qkind, o_qkind, gate_up_qkind, down_qkind;
    /* a quantised product whose rows are in several formats (q4_k_m's Q6_K v beside Q4_K q, k):
     * up to QSEGS row ranges [product: qkv, o, gate_up, down][segment], each its own omni_qlinear
     * into its columns of y; qseg_rows[p][0] == 0: the product is one format (`*_q` above) */
    const void *qseg[4][QSEGS];
    const float *qseg_scale[4][QSEGS];
    int qseg_kind[4][QSEGS], qseg_rows[4][QSEGS];
    /* DecoderLayerSpec's "head_norms" (Qwen3): q and k normalised head by head before the rotary,
     * into their own rows (as torch's reshape copies them); NULL: none */
    const void *q_norm, *k_norm;
    float q_eps, k_eps;
    /* DecoderLayerSpec's "experts" (float32 only): the router [E, H], a float product as qkv's (with
     * its *_packed / *_ec copies), its softmax's top k (renormalised when set), then the routed
     * experts on their quantised tables as CpuExpertsStep passes them: omni_qmoe for one token,
     * omni_qmoe_tokens for more (tokens_kind13 / 2: their one format each; 0: one token only).
     * router NULL: the dense MLP above. */
    const void *router, *router_packed, *router_ec;
    const int64_t *e_w13, *e_s13, *e_w2, *e_s2;
    const int32_t *e_kind13, *e_kind2;
    int num_experts, top_k, renormalize, expert_intermediate, tokens_kind13, tokens_kind2;
} omni_layer;

/* y [M, N] (row stride N) += bias [N] */
static void add_bias(void *y, const void *bias, int M, int N, int dt) {
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++)
            st1(y, dt, (size_t)m * N + n, ld1(y, dt, (size_t)m * N + n) + ld1(bias, dt, n));
}

/* product p of layer L (its `*_q` blocks, or its segments) on x [M, K] -> y [M, N], then its bias */
static int quant_linear(const omni_layer *L, int p, const void *x, const void *q, const float *qscale, int qkind,
                        const void *bias, void *y, int M, int N, int K, int dt, int nthreads) {
    if (L->qseg_rows[p][0] == 0) {
        if (omni_qlinear(x, K, q, qscale, y, N, M, N, K, qkind, dt, nthreads)) return -4;
    } else {
        size_t es = dt == F32 ? 4 : 2;
        int row0 = 0;
        for (int s = 0; s < QSEGS && L->qseg_rows[p][s] > 0; s++) {
            int rows = L->qseg_rows[p][s];
            if (row0 + rows > N ||
                omni_qlinear(x, K, L->qseg[p][s], L->qseg_scale[p][s], (char *)y + (size_t)row0 * es, N, M, rows, K,
                             L->qseg_kind[p][s], dt, nthreads))
                return -4;
            row0 += rows;
        }
        if (row0 != N) return -4;
    }
    if (bias) add_bias(y, bias, M, N, dt);
    return 0;
}

/* omni_linear, or omni_linear_ec where the weight has a coded copy */
static void kernel_linear(const void *x, const void *w, const void *ec, const void *bias, void *y,
                          int M, int N, int K, int dt, int nthreads) {
    if (!ec || omni_linear_ec(x, K, ec, bias, y, N, M, N, K, dt, nthreads))
        omni_linear(x, K, w, bias, y, N, M, N, K, dt, nthreads);
}

static int stack_linear(const void *x, const void *w, const void *packed, const void *ec,
                        const void *bias, void *y, int M, int N, int K, int gated, int kernel_rows,
                        int dt, int nthreads) {
    if (M <= kernel_rows) {
        kernel_linear(x, w, ec, bias, y, M, N, K, dt, nthreads);
        return 0;
    }
    if (!packed) return -4;
    return omni_gemm(x, K, packed, bias, y, gated ? N / 2 : N, M, N, K, gated, dt, nthreads) ? -4 : 0;
}

/* the top k of each token's softmax over E logits (in place: probabilities), as select_experts:
 * softmax in float32, the k largest (ties: the lower expert), divided by their sum when renormalize */
static void route(float *logits, int T, int E, int k, int renormalize, int64_t *ids, float *weights) {
    for (int t = 0; t < T; t++) {
        float *p = logits + (size_t)t * E, top = p[0], sum = 0.f;
        for (int e = 1; e < E; e++) top = p[e] > top ? p[e] : top;
        for (int e = 0; e < E; e++) sum += p[e] = expf(p[e] - top);
        for (int e = 0; e < E; e++) p[e] /= sum;
        float picked = 0.f;
        for (int j = 0; j < k; j++) {  /* (k is small: selection, not a sort) */
            int best = 0;
            for (int e = 1; e < E; e++) best = p[e] > p[best] ? e : best;
            ids[(size_t)t * k + j] = best, weights[(size_t)t * k + j] = p[best], picked += p[best];
            p[best] = -1.f;  /* taken (a probability is >= 0) */
        }
        if (renormalize)
            for (int j = 0; j < k; j++) weights[(size_t)t * k + j] /= picked;
    }
}

/* layer L's experts on normed [T, H] -> out [T, H] (float32) */
static int experts(const omni_layer *L, const void *normed, void *out, int T, int kernel_rows, int nthreads) {
    int E = L->num_experts, k = L->top_k, H = L->hidden;
    if (T > 1 && !L->tokens_kind13) return -4;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)T * k + sizeof(float) * (size_t)T * (E + k));
    if (!ids) return -2;
    float *logits = (float *)(ids + (size_t)T * k), *weights = logits + (size_t)T * E;  /* (ids first: aligned) */
    int rc = stack_linear(normed, L->router, L->router_packed, L->router_ec, NULL, logits, T, E, H, 0, kernel_rows,
                          F32, nthreads);
    if (!rc) {
        route(logits, T, E, k, L->renormalize, ids, weights);
        const float *x = normed;
        rc = T == 1 ? omni_qmoe(x, L->e_w13, L->e_s13, L->e_kind13, L->e_w2, L->e_s2, L->e_kind2, ids, weights,
                                k, E, out, H, L->expert_intermediate, nthreads)
                    : omni_qmoe_tokens(x, T, L->e_w13, L->tokens_kind13, L->e_w2, L->tokens_kind2, ids,
                                       weights, k, E, out, H, L->expert_intermediate, nthreads);
        rc = rc ? -5 : 0;
    }
    free(ids);
    return rc;
}

/* Runs `num_layers` layers over T tokens, as the model's layers one by one would, call for call
 * (the same kernels, in the same order, on the same rows: bit for bit the same result).
 * hidden [T, H] (in: the layers' input; out: the last down product) and residual [T, H] (in: the
 * running residual when has_residual, else nothing; out: the residual the model's final norm
 * adds). The attention arguments are omni_paged_attention's, the same for every layer. work:
 * T * (H + QKV + heads * head + 3 * intermediate + QKV - kv_heads * head) elements (QKV = (heads +
 * 2 kv_heads) * head; the last part: normed q and k, where a layer has head norms).
 * Returns 0; -1 attention refused the shapes, -2 out of memory, -3 a position outside the rotary
 * table (before anything is written), -4 more than kernel_rows rows without a packed weight (or a
 * chunk of tokens for experts that take one token), -5 the experts' step failed. */
int omni_decoder_layers(const omni_layer *layers, int num_layers, void *hidden, void *residual,
                        int has_residual, const int64_t *positions, const int64_t *slot_mapping,
                        int T, const int32_t *block_tables, int64_t table_stride,
                        const int32_t *query_start_loc, const int32_t *seq_lens, int num_seqs,
                        void *work, int kernel_rows, int dt, int nthreads) {
    if (num_layers <= 0 || T <= 0) return 0;
    size_t es = dt == F32 ? 4 : 2;
    const omni_layer *L0 = &layers[0];
    for (int t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= L0->max_position) return -3;
    if (!has_residual) memcpy(residual, hidden, (size_t)T * L0->hidden * es);
    for (int i = 0; i < num_layers; i++) {
        const omni_layer *L = &layers[i];
        int H = L->hidden, D = L->head_size, I = L->intermediate;
        int q_size = L->num_heads * D, kv_size = L->num_kv_heads * D, QKV = q_size + 2 * kv_size;
        char *normed = work, *qkv = normed + (size_t)T * H * es, *att = qkv + (size_t)T * QKV * es;
        char *gate_up = att + (size_t)T * q_size * es, *act = gate_up + (size_t)T * 2 * I * es;
        char *q = qkv, *k = qkv + (size_t)q_size * es;  /* rows QKV apart, or their normed copies */
        int64_t q_ld = QKV, k_ld = QKV;
        int rc;
        if (i == 0 && !has_residual)
            omni_rms_norm(hidden, NULL, NULL, L->input_norm, normed, T, H, L->input_eps, dt, nthreads);
        else
            omni_rms_norm(hidden, residual, residual, L->input_norm, normed, T, H, L->input_eps, dt,
                          nthreads);
        if ((rc = L->qkv_q ? quant_linear(L, 0, normed, L->qkv_q, L->qkv_qscale, L->qkv_qkind, L->qkv_bias, qkv,
                                          T, QKV, H, dt, nthreads)
                           : stack_linear(normed, L->qkv, L->qkv_packed, L->qkv_ec, L->qkv_bias, qkv, T, QKV,
                                          H, 0, kernel_rows, dt, nthreads)))
            return rc;
        if (L->q_norm) {
            q = act + (size_t)T * I * es, k = q + (size_t)T * q_size * es;
            omni_rms_norm_heads(qkv, QKV, L->q_norm, q, T, L->num_heads, D, L->q_eps, dt, nthreads);
            omni_rms_norm_heads(qkv + (size_t)q_size * es, QKV, L->k_norm, k, T, L->num_kv_heads, D, L->k_eps, dt,
                                nthreads);
            q_ld = q_size, k_ld = kv_size;
        }
        if (omni_rotary(q, q_ld, k, k_ld, positions, L->cos, L->sin, L->max_position, T, L->num_heads,
                        L->num_kv_heads, D, L->rotary_dim, dt, nthreads))
            return -3;
        if ((rc = omni_paged_attention(q, q_ld, k, k_ld,
                                       qkv + (size_t)(q_size + kv_size) * es, QKV, slot_mapping, T,
                                       L->k_cache, L->v_cache, block_tables, table_stride,
                                       query_start_loc, seq_lens, num_seqs, att, q_size,
                                       L->num_heads, L->num_kv_heads, D, L->block_size, L->scale,
                                       L->window, dt, nthreads)))
            return rc;
        if ((rc = L->o_q ? quant_linear(L, 1, att, L->o_q, L->o_qscale, L->o_qkind, L->o_bias, hidden, T, H,
                                        q_size, dt, nthreads)
                         : stack_linear(att, L->o, L->o_packed, L->o_ec, L->o_bias, hidden, T, H, q_size,
                                        0, kernel_rows, dt, nthreads)))
            return rc;
        omni_rms_norm(hidden, residual, residual, L->post_norm, normed, T, H, L->post_eps, dt, nthreads);
        if (L->router) {
            if ((rc = experts(L, normed, hidden, T, kernel_rows, nthreads))) return rc;
            continue;
        }
        if (L->gate_up_q) {
            if ((rc = quant_linear(L, 2, normed, L->gate_up_q, L->gate_up_qscale, L->gate_up_qkind, L->gate_up_bias,
                                   gate_up, T, 2 * I, H, dt, nthreads)))
                return rc;
            omni_silu_and_mul(gate_up, act, T, I, dt, nthreads);
        } else if (T <= kernel_rows) {
            kernel_linear(normed, L->gate_up, L->gate_up_ec, L->gate_up_bias, gate_up, T, 2 * I, H,
                          dt, nthreads);
            omni_silu_and_mul(gate_up, act, T, I, dt, nthreads);
        } else if ((rc = stack_linear(normed, L->gate_up, L->gate_up_packed, L->gate_up_ec,
                                      L->gate_up_bias, act, T, 2 * I, H, 1, kernel_rows, dt,
                                      nthreads))) {
            return rc;
        }
        if ((rc = L->down_q ? quant_linear(L, 3, act, L->down_q, L->down_qscale, L->down_qkind, L->down_bias, hidden,
                                           T, H, I, dt, nthreads)
                            : stack_linear(act, L->down, L->down_packed, L->down_ec, L->down_bias, hidden, T, H,
                                           I, 0, kernel_rows, dt, nthreads)))
            return rc;
    }
    return 0;
}
