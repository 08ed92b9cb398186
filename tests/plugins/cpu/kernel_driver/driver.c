/* A Python-free driver for the CPU kernels: reads cases (kernel, integer and float arguments,
 * arrays) written by tests/plugins/cpu/test_kernel_driver.py, runs each kernel on them, and writes
 * every array back, so the test compares the outputs with torch. Built with the kernels for one
 * ISA level: natively for the x86 levels this CPU runs, and for aarch64 (NEON) with
 * aarch64-linux-gnu-gcc, run under qemu-aarch64.
 *
 * File format (little endian): "OMNICASE", u32 cases; a case: char name[32], u32 n_ints,
 * i64 ints[], u32 n_floats, f32 floats[], u32 n_arrays, then each array as u64 bytes + data.
 * The output file is the same, with the arrays as the kernel left them. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *omni_isa(void);
void omni_linear(const void *x, int64_t ldx, const void *w, const void *bias, void *y, int64_t ldy,
                 int M, int N, int K, int dt, int nthreads);
int64_t omni_gemm_packed_size(int N, int K, int gated);
void omni_gemm_pack(const void *w, int N, int K, int gated, int dt, void *out, int nthreads);
int omni_gemm(const void *x, int64_t ldx, const void *packed, const void *bias, void *y, int64_t ldy,
              int M, int N, int K, int gated, int dt, int nthreads);
int omni_gemm_argmax(const void *x, int64_t ldx, const void *packed, const void *bias, int64_t *out,
                     int M, int N, int K, int dt, int nthreads);
void omni_rms_norm(const void *x, const void *residual, void *residual_out, const void *weight,
                   void *out, int T, int H, float eps, int dt, int nthreads);
int omni_rotary(void *q, int64_t q_stride, void *k, int64_t k_stride, const int64_t *positions,
                const float *cos, const float *sin, int max_position, int T, int num_heads,
                int num_kv_heads, int D, int R, int dt, int nthreads);
void omni_silu_and_mul(const void *x, void *out, int T, int I, int dt, int nthreads);
void omni_argmax(const void *x, int64_t ld, int rows, int cols, int dt, int64_t *out, int nthreads);
int omni_paged_attention(const void *q, int64_t q_stride, const void *key, int64_t key_stride,
                         const void *value, int64_t value_stride, const int64_t *slot_mapping,
                         int num_tokens, void *k_cache, void *v_cache, const int32_t *block_tables,
                         int64_t table_stride, const int32_t *query_start_loc,
                         const int32_t *seq_lens, int num_seqs, void *out, int64_t out_stride,
                         int H, int KVH, int D, int block_size, float scale, int window, int dt,
                         int nthreads);
void omni_q8_pack(const void *w, int N, int K, int dt, int8_t *q, float *scale, float *coef,
                  int nthreads);
int omni_ec_supported(int dt);
int omni_linear_ec(const void *x, int64_t ldx, const uint8_t *ec, const void *bias, void *y, int64_t ldy,
                   int M, int N, int K, int dt, int nthreads);
int omni_qlinear(const void *x, int64_t ldx, const uint8_t *w, const float *scale, void *y, int64_t ldy,
                 int M, int N, int K, int kind, int dt, int nthreads);
int omni_linear_argmax_q8(const void *x, int64_t ldx, const void *w, const int8_t *q,
                          const float *scale, const float *coef, int64_t *out, int M, int N, int K,
                          int dt, int max_candidates, int nthreads);
int omni_moe(const void *x, int64_t ldx, const void *w13, const void *w2, const int64_t *topk_ids,
             const float *topk_weights, void *out, int64_t ldo, int T, int K, int E, int H, int I,
             int dt, int nthreads);

int omni_qmoe(const float *x, const int64_t *w13, const int64_t *s13, const int32_t *kind13, const int64_t *w2,
              const int64_t *s2, const int32_t *kind2, const int64_t *ids, const float *weights, int n, int E,
              float *out, int H, int I, int nthreads);
int omni_qmoe_tokens(const float *x, int T, const int64_t *w13, int kind13, const int64_t *w2, int kind2,
                     const int64_t *ids, const float *weights, int n, int E, float *out, int H, int I, int nthreads);

#ifndef OMNI_PREFETCH_TRACE
#error "the driver is built with the kernels' prefetch trace: -DOMNI_PREFETCH_TRACE (test_kernel_driver.py)"
#endif
/* the kernels' prefetch trace (csrc/prefetch.h): set around a "prefetched_" case */
const char *omni_prefetch_base;
size_t omni_prefetch_bytes;
uint8_t *omni_prefetch_seen;
int omni_prefetch_to_l2(int on);

#define MAX_ARGS 32

typedef struct {
    char name[32];
    uint32_t n_ints, n_floats, n_arrays;
    int64_t ints[MAX_ARGS];
    float floats[MAX_ARGS];
    uint64_t bytes[MAX_ARGS];
    void *arrays[MAX_ARGS];
} Case;

static void need(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "driver: %s\n", what);
        exit(2);
    }
}

static void read_case(FILE *f, Case *c) {
    need(fread(c->name, 1, 32, f) == 32, "short read (name)");
    need(fread(&c->n_ints, 4, 1, f) == 1 && c->n_ints <= MAX_ARGS, "bad n_ints");
    need(fread(c->ints, 8, c->n_ints, f) == c->n_ints, "short read (ints)");
    need(fread(&c->n_floats, 4, 1, f) == 1 && c->n_floats <= MAX_ARGS, "bad n_floats");
    need(fread(c->floats, 4, c->n_floats, f) == c->n_floats, "short read (floats)");
    need(fread(&c->n_arrays, 4, 1, f) == 1 && c->n_arrays <= MAX_ARGS, "bad n_arrays");
    for (uint32_t i = 0; i < c->n_arrays; i++) {
        need(fread(&c->bytes[i], 8, 1, f) == 1, "short read (bytes)");
        c->arrays[i] = aligned_alloc(64, (c->bytes[i] + 63) / 64 * 64 + 64);
        need(c->arrays[i] != NULL, "out of memory");
        need(fread(c->arrays[i], 1, c->bytes[i], f) == c->bytes[i], "short read (array)");
    }
}

static void write_case(FILE *f, const Case *c) {
    fwrite(c->name, 1, 32, f);
    fwrite(&c->n_ints, 4, 1, f);
    fwrite(c->ints, 8, c->n_ints, f);
    fwrite(&c->n_floats, 4, 1, f);
    fwrite(c->floats, 4, c->n_floats, f);
    fwrite(&c->n_arrays, 4, 1, f);
    for (uint32_t i = 0; i < c->n_arrays; i++) {
        fwrite(&c->bytes[i], 8, 1, f);
        fwrite(c->arrays[i], 1, c->bytes[i], f);
    }
}

/* ints and arrays by position, as test_kernel_driver.py writes them */
#define I(n) ((int)c->ints[n])
#define A(n) (c->arrays[n])
#define OPT(n) (c->bytes[n] ? c->arrays[n] : NULL)

static int run(Case *c) {
    const char *k = c->name;
    if (!strncmp(k, "prefetched_", 11)) {
        /* the case named after the prefix, with the lines of its weight (array 1) that the kernels
         * prefetch marked in its last array; its last int: 1 prefetch into L2, 0 into L1 */
        Case inner = *c;
        memset(inner.name, 0, sizeof inner.name);
        memcpy(inner.name, c->name + 11, sizeof c->name - 11);
        omni_prefetch_to_l2(I(c->n_ints - 1));
        omni_prefetch_base = A(1), omni_prefetch_bytes = c->bytes[1], omni_prefetch_seen = A(c->n_arrays - 1);
        int rc = run(&inner);
        omni_prefetch_bytes = 0, omni_prefetch_seen = NULL;
        omni_prefetch_to_l2(0);
        return rc;
    }
    if (!strcmp(k, "linear")) {  /* M N K dt threads; x w bias y */
        omni_linear(A(0), I(2), A(1), OPT(2), A(3), I(1), I(0), I(1), I(2), I(3), I(4));
        return 0;
    }
    if (!strcmp(k, "gemm") || !strcmp(k, "gemm_argmax")) {  /* M N K gated dt threads; x w bias y|out */
        int M = I(0), N = I(1), K = I(2), gated = I(3), dt = I(4), nt = I(5);
        size_t es = dt ? 2 : 4;
        void *packed = aligned_alloc(64, ((size_t)omni_gemm_packed_size(N, K, gated) * es + 63) / 64 * 64);
        need(packed != NULL, "out of memory");
        omni_gemm_pack(A(1), N, K, gated, dt, packed, nt);
        int rc = k[4] ? omni_gemm_argmax(A(0), K, packed, OPT(2), A(3), M, N, K, dt, nt)
                      : omni_gemm(A(0), K, packed, OPT(2), A(3), gated ? N / 2 : N, M, N, K, gated, dt, nt);
        free(packed);
        return rc;
    }
    if (!strcmp(k, "rms_norm")) {  /* T H dt threads; eps; x residual residual_out weight out */
        omni_rms_norm(A(0), OPT(1), OPT(2), A(3), A(4), I(0), I(1), c->floats[0], I(2), I(3));
        return 0;
    }
    if (!strcmp(k, "rotary")) {  /* T heads kv_heads D dt threads max_position R; q k positions cos sin */
        int D = I(3);
        return omni_rotary(A(0), (int64_t)I(1) * D, A(1), (int64_t)I(2) * D, A(2), A(3), A(4), I(6),
                           I(0), I(1), I(2), D, I(7), I(4), I(5));
    }
    if (!strcmp(k, "silu_and_mul")) {  /* T I dt threads; x out */
        omni_silu_and_mul(A(0), A(1), I(0), I(1), I(2), I(3));
        return 0;
    }
    if (!strcmp(k, "argmax")) {  /* rows cols dt threads; x out */
        omni_argmax(A(0), I(1), I(0), I(1), I(2), A(1), I(3));
        return 0;
    }
    if (!strcmp(k, "paged_attention")) {
        /* tokens seqs H KVH D block_size window dt threads table_stride; scale;
         * q key value slots k_cache v_cache tables query_start_loc seq_lens out */
        int H = I(2), KVH = I(3), D = I(4);
        return omni_paged_attention(A(0), (int64_t)H * D, A(1), (int64_t)KVH * D, A(2), (int64_t)KVH * D,
                                    A(3), I(0), A(4), A(5), A(6), I(9), A(7), A(8), I(1), A(9),
                                    (int64_t)H * D, H, KVH, D, I(5), c->floats[0], I(6), I(7), I(8));
    }
    if (!strcmp(k, "linear_ec")) {  /* M N K dt threads; x ec (omni_ec_pack's copy) bias y */
        return omni_linear_ec(A(0), I(2), A(1), OPT(2), A(3), I(1), I(0), I(1), I(2), I(3), I(4));
    }
    if (!strcmp(k, "qlinear")) {  /* M N K kind dt threads; x w scale y */
        return omni_qlinear(A(0), I(2), A(1), OPT(2), A(3), I(1), I(0), I(1), I(2), I(3), I(4), I(5));
    }
    if (!strcmp(k, "linear_argmax_q8")) {  /* M N K dt threads; x w out */
        int M = I(0), N = I(1), K = I(2), dt = I(3), nt = I(4);
        int8_t *q = malloc((size_t)N * K);
        float *scale = malloc(sizeof(float) * N), *coef = malloc(sizeof(float) * 2 * N);
        need(q && scale && coef, "out of memory");
        omni_q8_pack(A(1), N, K, dt, q, scale, coef, nt);
        int rc = omni_linear_argmax_q8(A(0), K, A(1), q, scale, coef, A(2), M, N, K, dt, N, nt);
        free(q), free(scale), free(coef);
        return rc;
    }
    if (!strcmp(k, "moe")) {  /* T K E H I dt threads; x w13 w2 topk_ids topk_weights out */
        return omni_moe(A(0), I(3), A(1), A(2), A(3), A(4), A(5), I(3), I(0), I(1), I(2), I(3), I(4),
                        I(5), I(6));
    }
    if (!strcmp(k, "qmoe")) {  /* T n E H I kind13 kind2 bytes13 bytes2 threads; x w13 w2 ids weights out */
        int T = I(0), n = I(1), E = I(2), nt = I(9);  /* (each expert's blocks one after another) */
        int64_t *table = calloc((size_t)6 * E, sizeof(int64_t));
        int32_t *kinds = malloc(sizeof(int32_t) * 2 * E);
        need(table && kinds, "out of memory");
        for (int e = 0; e < E; e++) {
            table[e] = (int64_t)(uintptr_t)((uint8_t *)A(1) + (size_t)e * c->ints[7]);
            table[3 * E + e] = (int64_t)(uintptr_t)((uint8_t *)A(2) + (size_t)e * c->ints[8]);
            kinds[e] = I(5), kinds[E + e] = I(6);  /* (table[E..2E), [4E..5E): no scales) */
        }
        int rc = T > 1 ? omni_qmoe_tokens(A(0), T, table, I(5), table + 3 * E, I(6), A(3), A(4), n, E, A(5), I(3),
                                          I(4), nt)
                       : omni_qmoe(A(0), table, table + E, kinds, table + 3 * E, table + 4 * E, kinds + E, A(3),
                                   A(4), n, E, A(5), I(3), I(4), nt);
        free(table), free(kinds);
        return rc;
    }
    fprintf(stderr, "driver: no kernel %.32s\n", k);
    return -100;
}

int main(int argc, char **argv) {
    if (argc == 2 && !strcmp(argv[1], "--isa")) {
        printf("%s\n", omni_isa());
        return 0;
    }
    if (argc == 2 && !strcmp(argv[1], "--coded")) {  /* the dtypes omni_linear_ec runs here */
        printf("%d %d\n", omni_ec_supported(0), omni_ec_supported(1));
        return 0;
    }
    need(argc == 3, "usage: driver CASES OUT | driver --isa | driver --coded");
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    need(in && out, "cannot open the files");
    char magic[8];
    uint32_t n;
    need(fread(magic, 1, 8, in) == 8 && !memcmp(magic, "OMNICASE", 8), "not a case file");
    need(fread(&n, 4, 1, in) == 1, "short read (count)");
    fwrite(magic, 1, 8, out);
    fwrite(&n, 4, 1, out);
    int failed = 0;
    for (uint32_t i = 0; i < n; i++) {
        Case c;
        read_case(in, &c);
        int rc = run(&c);
        if (rc) {
            fprintf(stderr, "driver: %.32s returned %d\n", c.name, rc);
            failed = 1;
        }
        write_case(out, &c);
        for (uint32_t a = 0; a < c.n_arrays; a++) free(c.arrays[a]);
    }
    fclose(in);
    fclose(out);
    return failed;
}
