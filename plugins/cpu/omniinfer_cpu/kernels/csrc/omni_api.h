/* Every entry point of the CPU kernels (included by omni.h; build.py's SIGNATURES mirror them). */
#ifndef OMNI_API_H
#define OMNI_API_H
#include <stdint.h>

/* ---- the entry points (each file's own comment says what it computes) --------------------- */
const char *omni_isa(void);
void omni_linear(const void *x, int64_t ldx, const void *w, const void *bias, void *y, int64_t ldy,
                 int M, int N, int K, int dt, int nthreads);
int omni_ec_supported(int dt);
int64_t omni_ec_size(int N, int K, int dt, int64_t patches);
int64_t omni_ec_count(const void *w, int N, int K, int dt, int nthreads);
int omni_ec_pack(const void *w, int N, int K, int dt, int64_t patches, uint8_t *out, int nthreads);
int omni_linear_ec(const void *x, int64_t ldx, const uint8_t *ec, const void *bias, void *y,
                   int64_t ldy, int M, int N, int K, int dt, int nthreads);
int omni_paged_attention(const void *q, int64_t q_stride, const void *key, int64_t key_stride,
                         const void *value, int64_t value_stride, const int64_t *slot_mapping,
                         int num_tokens, void *k_cache, void *v_cache, const int32_t *block_tables,
                         int64_t table_stride, const int32_t *query_start_loc,
                         const int32_t *seq_lens, int num_seqs, void *out, int64_t out_stride,
                         int H, int KVH, int D, int block_size, float scale, int window, int dt,
                         int nthreads);
void omni_rms_norm(const void *x, const void *residual, void *residual_out, const void *weight,
                   void *out, int T, int H, float eps, int dt, int nthreads);
void omni_rms_norm_heads(const void *x, int64_t stride, const void *weight, void *out, int T, int heads, int D,
                         float eps, int dt, int nthreads);
int omni_rotary(void *q, int64_t q_stride, void *k, int64_t k_stride, const int64_t *positions,
                const float *cos, const float *sin, int max_position, int T, int num_heads,
                int num_kv_heads, int D, int R, int dt, int nthreads);
void omni_silu_and_mul(const void *x, void *out, int T, int I, int dt, int nthreads);
void omni_argmax(const void *x, int64_t ld, int rows, int cols, int dt, int64_t *out, int nthreads);
int omni_gemm_supported(int dt);
int omni_gemm_k_multiple(int dt);
int64_t omni_gemm_packed_size(int N, int K, int gated);
void omni_gemm_pack(const void *w, int N, int K, int gated, int dt, void *out, int nthreads);
int omni_gemm(const void *x, int64_t ldx, const void *packed, const void *bias, void *y, int64_t ldy,
              int M, int N, int K, int gated, int dt, int nthreads);
int omni_gemm_argmax(const void *x, int64_t ldx, const void *packed, const void *bias, int64_t *out,
                     int M, int N, int K, int dt, int nthreads);
int omni_quant_supported(int kind);
int omni_qlinear(const void *x, int64_t ldx, const uint8_t *w, const float *scale, void *y, int64_t ldy,
                 int M, int N, int K, int kind, int dt, int nthreads);
int omni_amx_enable(int on);
int omni_prefetch_to_l2(int on);
int omni_qrows(const uint8_t *w, const float *scale, int kind, int N, int K, const int64_t *ids, int n,
               void *out, int dt, int nthreads);
void omni_q8_pack(const void *w, int N, int K, int dt, int8_t *q, float *scale, float *coef,
                  int nthreads);
int omni_linear_argmax_q8(const void *x, int64_t ldx, const void *w, const int8_t *q,
                          const float *scale, const float *coef, int64_t *out, int M, int N, int K,
                          int dt, int max_candidates, int nthreads);
int omni_qmoe(const float *x, const int64_t *w13, const int64_t *s13, const int32_t *kind13, const int64_t *w2,
              const int64_t *s2, const int32_t *kind2, const int64_t *ids, const float *weights, int n, int E,
              float *out, int H, int I, int nthreads);
int omni_qmoe_tokens(const float *x, int T, const int64_t *w13, int kind13, const int64_t *w2, int kind2,
                     const int64_t *ids, const float *weights, int n, int E, float *out, int H, int I, int nthreads);
int omni_moe(const void *x, int64_t ldx, const void *w13, const void *w2, const int64_t *topk_ids,
             const float *topk_weights, void *out, int64_t ldo, int T, int K, int E, int H, int I,
             int dt, int nthreads);

#endif
