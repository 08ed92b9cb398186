/* omni_qlinear: y = x @ W^T with W quantised, as a GGUF file stores it (rows of blocks: Q8_0,
 * Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) or as omniinfer's int8 (q [N, K] int8 and a float32
 * scale a row). The weights
 * are decoded in registers and multiplied in float32 (x as the caller gives it, widened from
 * bfloat16 once): no float copy of W exists. A block's offset term is taken out of the sum as
 * llama.cpp does, Sum d * (q - o) * x = d * Sum q * x - d * o * Sum x, with the sums of x over
 * each 16 weights computed once per call; so a result differs from dequantise-then-multiply by
 * float32 rounding only. Each thread takes a contiguous range of W's rows and reads each once per
 * group of up to 4 x rows. A kind with QACT_INT8 set takes quant_q8.c's int8-activation path
 * (up to QGEMM_ROWS rows, I8_DOT_ROWS for int8 rows; the groups of 8 of quant_x8.c at any row
 * count; AMX's tiles from 16 rows (int8 rows: 8) where the CPU has them, quant_amx.c). */
#include "quant_blocks.h"

#define QMB 4  /* x rows a weight row meets while its block is in registers */
#define QGEMM_ROWS 8  /* above this many rows, quant_gemm.c's panels */
/* int8 rows (quantization="int8", W8A8) with int8 activations: their row dots up to this many
 * rows. The panels decode the whole weight to float32 first: a 9728 x 896 weight's took 11.8 ms
 * at 16 rows where the dots took 2.7 (64 rows: 14.8 against 10.8; 128: 19.1 against 21.6; 2-core
 * Xeon 6/167, avx512_bf16 and avx2 alike) */
#define I8_DOT_ROWS 96

int omni_prefetch_l2 __attribute__((visibility("hidden"))) = 0;

/* on: 1 prefetch_ahead's lines go to L2 only (prefetcht1), 0 to every level (prefetch.h says
 * which CPUs measured faster which way). Returns it. */
int omni_prefetch_to_l2(int on) { return omni_prefetch_l2 = on != 0; }

int omni_quant_supported(int kind) { return (kind & ~QACT_INT8) >= 0 && (kind & ~QACT_INT8) < NUM_KINDS; }

/* Sum over [e, e + VL * n) of q * x for n chunks of VL decoded weights, one x row */
#define CHUNKS(n, decode, xrow, e) ({                                          \
    vf s_ = (vf){0};                                                           \
    _Pragma("GCC unroll 8") for (int c_ = 0; c_ < (n); c_++) {                 \
        vf q_ = decode(c_);                                                    \
        s_ += q_ * *(const vfu *)((xrow) + (e) + c_ * VL);                     \
    }                                                                          \
    s_; })

static void dot_q8_0(const uint8_t *w, const float *x, size_t ldx, const float *xs, size_t ldxs, int K,
                     int MB, float *out) {
    (void)xs, (void)ldxs;
    vf acc[QMB] = {{0}};
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *blk = w + (size_t)b * 34;
        prefetch_ahead(blk, 34);
        float d = f16_to_f32(u16_at(blk));
        const int8_t *q = (const int8_t *)(blk + 2);
        vf qv[32 / VL];
#pragma GCC unroll 8
        for (int c = 0; c < 32 / VL; c++) qv[c] = s8_load(q + c * VL);
        for (int m = 0; m < MB; m++) {
#define Q8D(c) qv[c]
            acc[m] += d * CHUNKS(32 / VL, Q8D, x + m * ldx, b * 32);
#undef Q8D
        }
    }
    for (int m = 0; m < MB; m++) out[m] = hsum(acc[m]);
}

/* Q4_K (hi 0) and Q5_K (hi 1: 32 bytes of fifth bits before the nibbles) */
INLINE void dot_qk(const uint8_t *w, const float *x, size_t ldx, const float *xs, size_t ldxs, int K, int MB,
                   float *out, const int hi) {
    const int bytes = 144 + 32 * hi;
    vf acc[QMB] = {{0}};
    float corr[QMB] = {0};
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + (size_t)b * bytes, *qh = blk + 16, *qs = blk + 16 + 32 * hi;
        prefetch_ahead(blk, bytes);
        float d = f16_to_f32(u16_at(blk)), dmin = f16_to_f32(u16_at(blk + 2));
        uint8_t sc[8], mn[8];
        k_scales(blk + 4, sc, mn);
        for (int s = 0; s < 8; s++) {
            int e0 = b * 256 + s * 32;
            vf qv[32 / VL];
#pragma GCC unroll 8
            for (int c = 0; c < 32 / VL; c++) qv[c] = hi ? q5_k_chunk(qs, qh, s, c * VL) : q4_k_chunk(qs, s, c * VL);
            float ds = d * (float)sc[s], dm = dmin * (float)mn[s];
            for (int m = 0; m < MB; m++) {
#define QKD(c) qv[c]
                acc[m] += ds * CHUNKS(32 / VL, QKD, x + m * ldx, e0);
#undef QKD
                corr[m] += dm * (xs[m * ldxs + e0 / 16] + xs[m * ldxs + e0 / 16 + 1]);
            }
        }
    }
    for (int m = 0; m < MB; m++) out[m] = hsum(acc[m]) - corr[m];
}

static void dot_q6_k(const uint8_t *w, const float *x, size_t ldx, const float *xs, size_t ldxs, int K,
                     int MB, float *out) {
    vf acc[QMB] = {{0}};
    float corr[QMB] = {0};
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + (size_t)b * 210, *ql = blk, *qh = blk + 128;
        prefetch_ahead(blk, 210);
        const int8_t *scales = (const int8_t *)(blk + 192);
        float d = f16_to_f32(u16_at(blk + 208));
        for (int h = 0; h < 2; h++)
            for (int part = 0; part < 4; part++) {  /* weights 128 h + 32 part + l, l < 32 */
                int e0 = b * 256 + 128 * h + 32 * part;
                for (int sub = 0; sub < 2; sub++) {  /* its two scales' 16 weights each */
                    vf qv[16 / VL];
#pragma GCC unroll 4
                    for (int c = 0; c < 16 / VL; c++) qv[c] = q6_k_chunk(ql, qh, h, part, sub * 16 + c * VL);
                    int e = e0 + sub * 16;
                    float ds = d * (float)scales[(e - b * 256) / 16];
                    for (int m = 0; m < MB; m++) {
#define Q6D(c) qv[c]
                        acc[m] += ds * CHUNKS(16 / VL, Q6D, x + m * ldx, e);
#undef Q6D
                        corr[m] += ds * xs[m * ldxs + e / 16];
                    }
                }
            }
    }
    for (int m = 0; m < MB; m++) out[m] = hsum(acc[m]) - 32.0f * corr[m];
}

static void dot_i8(const uint8_t *w, const float *x, size_t ldx, const float *xs, size_t ldxs, int K,
                   int MB, float *out) {
    (void)xs, (void)ldxs;
    const int8_t *q = (const int8_t *)w;
    vf a0[QMB] = {{0}}, a1[QMB] = {{0}};
    int k = 0;
    for (; k + 2 * VL <= K; k += 2 * VL) {
        if (!(k & 63)) prefetch_ahead(q + k, 64);  /* (a line a 64 codes) */
        vf q0 = s8_load(q + k), q1 = s8_load(q + k + VL);
        for (int m = 0; m < MB; m++) {
            a0[m] += q0 * *(const vfu *)(x + m * ldx + k);
            a1[m] += q1 * *(const vfu *)(x + m * ldx + k + VL);
        }
    }
    for (int m = 0; m < MB; m++) {
        float s = hsum(a0[m] + a1[m]);
        for (int kk = k; kk < K; kk++) s += (float)q[kk] * x[m * ldx + kk];
        out[m] = s;
    }
}

/* F8: a row of e4m3 bytes and its scales, one a block of 128: each block's Sum q x, times its
 * scale (the reference's Sum (q s) x up to float32 rounding) */
static void dot_f8(const uint8_t *w, const float *srow, const float *x, size_t ldx, int K, int MB, float *out) {
    vf acc[QMB] = {{0}};
    for (int b = 0; b < K / F8_BLOCK; b++) {
        const uint8_t *blk = w + (size_t)b * F8_BLOCK;
        prefetch_ahead(blk, F8_BLOCK);
        vf part[QMB] = {{0}};
#pragma GCC unroll 8
        for (int c = 0; c < F8_BLOCK / VL; c++) {
            vf q = f8_chunk(blk + c * VL);
            for (int m = 0; m < MB; m++) part[m] += q * *(const vfu *)(x + m * ldx + b * F8_BLOCK + c * VL);
        }
        for (int m = 0; m < MB; m++) acc[m] += (srow[b] * F8_UNIT) * part[m];
    }
    for (int m = 0; m < MB; m++) out[m] = hsum(acc[m]);
}

/* one x row (batch-1 decode): the block's chunks in two independent sums (AVX2: 16 bytes a
 * sign extension and four sums; 1.14x the two-sum loop's rate on a Zen 3 core, where the float16
 * conversion bounds it) */
static void dot_f8_1(const uint8_t *w, const float *srow, const float *x, int K, float *out) {
#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < K / F8_BLOCK; b++) {
        const uint8_t *blk = w + (size_t)b * F8_BLOCK;
        const float *xb = x + b * F8_BLOCK;
        prefetch_ahead(blk, F8_BLOCK);
        __m256 p[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
#pragma GCC unroll 4
        for (int c = 0; c < F8_BLOCK; c += 32) {
            __m256i h0 = f8_halves16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + c))));
            __m256i h1 = f8_halves16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + c + 16))));
            p[0] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h0)), _mm256_loadu_ps(xb + c), p[0]);
            p[1] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h0, 1)), _mm256_loadu_ps(xb + c + 8), p[1]);
            p[2] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h1)), _mm256_loadu_ps(xb + c + 16), p[2]);
            p[3] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h1, 1)), _mm256_loadu_ps(xb + c + 24), p[3]);
        }
        __m256 part = _mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3]));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(srow[b] * F8_UNIT), part, acc);
    }
    *out = hsum((vf)acc);
#else
    vf acc = (vf){0};
    for (int b = 0; b < K / F8_BLOCK; b++) {
        const uint8_t *blk = w + (size_t)b * F8_BLOCK;
        const float *xb = x + b * F8_BLOCK;
        prefetch_ahead(blk, F8_BLOCK);
        vf p0 = (vf){0}, p1 = (vf){0};
#pragma GCC unroll 8
        for (int c = 0; c < F8_BLOCK / VL; c += 2) {
            p0 += f8_chunk(blk + c * VL) * *(const vfu *)(xb + c * VL);
            p1 += f8_chunk(blk + (c + 1) * VL) * *(const vfu *)(xb + (c + 1) * VL);
        }
        acc += (srow[b] * F8_UNIT) * (p0 + p1);
    }
    *out = hsum(acc);
#endif
}

/* Q4_0 (neither), Q4_1 (has_min), Q5_0 (has_hi), Q5_1 (both): Sum (d q + m) x = d Sum q x + m Sum x,
 * and Q4_0's and Q5_0's Sum d (q - o) x = d Sum q x - o d Sum x (o = 8, 16) */
INLINE void dot_qn(const uint8_t *w, const float *x, size_t ldx, const float *xs, size_t ldxs, int K, int MB,
                   float *out, const int has_min, const int has_hi) {
    const int bytes = 18 + 2 * has_min + 4 * has_hi;
    vf acc[QMB] = {{0}};
    float corr[QMB] = {0};
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *blk = w + (size_t)b * bytes, *qs = blk + bytes - 16;
        prefetch_ahead(blk, bytes);
        float d = f16_to_f32(u16_at(blk));
        float off = has_min ? f16_to_f32(u16_at(blk + 2)) : -(float)(8 << has_hi) * d;
        uint32_t qh = 0;
        if (has_hi) memcpy(&qh, blk + 2 + 2 * has_min, 4);
        vf qv[32 / VL];
#pragma GCC unroll 8
        for (int c = 0; c < 32 / VL; c++) qv[c] = has_hi ? q5_chunk(qs, qh, c * VL) : q4_0_chunk(qs, c * VL);
        for (int m = 0; m < MB; m++) {
#define QND(c) qv[c]
            acc[m] += d * CHUNKS(32 / VL, QND, x + m * ldx, b * 32);
#undef QND
            corr[m] += off * (xs[m * ldxs + 2 * b] + xs[m * ldxs + 2 * b + 1]);
        }
    }
    for (int m = 0; m < MB; m++) out[m] = hsum(acc[m]) + corr[m];
}
#define DOT_OF(name, fn, ...)                                                                         \
    static void name(const uint8_t *w, const float *x, size_t ldx, const float *xs, size_t ldxs, int K, \
                     int MB, float *out) {                                                            \
        fn(w, x, ldx, xs, ldxs, K, MB, out, __VA_ARGS__);                                             \
    }
DOT_OF(dot_q4_0, dot_qn, 0, 0)
DOT_OF(dot_q4_1, dot_qn, 1, 0)
DOT_OF(dot_q5_0, dot_qn, 0, 1)
DOT_OF(dot_q5_1, dot_qn, 1, 1)
DOT_OF(dot_q4_k, dot_qk, 0)
DOT_OF(dot_q5_k, dot_qk, 1)

typedef void (*qdot_fn)(const uint8_t *, const float *, size_t, const float *, size_t, int, int, float *);
static const qdot_fn QDOT[NUM_KINDS] = {[Q8_0] = dot_q8_0, [Q4_0] = dot_q4_0, [Q4_K] = dot_q4_k, [Q6_K] = dot_q6_k,
                                        [I8] = dot_i8, [Q4_1] = dot_q4_1, [Q5_0] = dot_q5_0, [Q5_1] = dot_q5_1,
                                        [Q5_K] = dot_q5_k};

/* y [M, ldy] (dtype dt) = x [M, ldx] (dt) @ W^T, W [N, K] of `kind` (int8: w is q, scale [N];
 * F8: w is q, scale [N, K / 128]).
 * Returns 0; -1 for a kind not built, a K that is not whole blocks, or no memory. */
int omni_qlinear(const void *x, int64_t ldx, const uint8_t *w, const float *scale, void *y, int64_t ldy,
                 int M, int N, int K, int kind, int dt, int nthreads) {
    int q8 = kind & QACT_INT8;
    kind &= ~QACT_INT8;
    if (!omni_quant_supported(kind) || M <= 0 || N <= 0 || K <= 0 || K % qblock(kind) ||
        (kind != I8 && K % 16) || (q8 && K % 32))
        return -1;
    if ((kind == I8 || kind == F8) && !scale) return -1;
    /* int8 activations: up to QGEMM_ROWS rows (int8 rows: I8_DOT_ROWS), and the X8 groups at any
     * row count (their grouped sums beat the float panels from 16 rows to prefills); they have no
     * float-activation path, and Q4_1, Q5_0, Q5_1, Q5_K have no int8 path but theirs */
    int x8 = is_x8(kind);
    if (q8 && !x8 && kind > I8) return -1;
    if (q8 && omni_amx_takes(kind, M, K) && omni_qamx(x, ldx, w, scale, y, ldy, M, N, K, kind, dt, nthreads) == 0)
        return 0;  /* (AMX's bfloat16 tiles for prefills: quant_amx.c; out of memory: the int8 path) */
    if (q8 && (M <= QGEMM_ROWS || x8 || (kind == I8 && M <= I8_DOT_ROWS)))
        return omni_qlinear_q8(x, ldx, w, scale, y, ldy, M, N, K, kind, dt, nthreads);
    if (x8) return -1;
    int ldxs = K / 16;
    float *xf = malloc(sizeof(float) * ((size_t)M * K + (size_t)M * (ldxs > 0 ? ldxs : 1)));
    if (!xf) return -1;
    float *xs = xf + (size_t)M * K;
    for (int m = 0; m < M; m++) {  /* x as float32 rows of K, and its sums of 16 */
        for (int k = 0; k < K; k++) xf[(size_t)m * K + k] = ld1(x, dt, (size_t)m * ldx + k);
        for (int i = 0; i < ldxs; i++) {
            vf s = (vf){0};
            float t = 0.f;
            int k = 16 * i, j = 0;
            for (; j + VL <= 16; j += VL) s += *(const vfu *)(xf + (size_t)m * K + k + j);
            for (; j < 16; j++) t += xf[(size_t)m * K + k + j];
            xs[(size_t)m * ldxs + i] = hsum(s) + t;
        }
    }
    size_t rb = qrow_bytes(kind, K);
    if (M > QGEMM_ROWS) {
        int rc = omni_qgemm(xf, w, rb, scale, y, ldy, M, N, K, kind, dt, nthreads);
        free(xf);
        return rc;
    }
    qdot_fn dot = QDOT[kind];
    if (nthreads < 1) nthreads = 1;
    nthreads = threads_for((int64_t)N * K, nthreads);
#pragma omp parallel num_threads(nthreads)
    {
        int64_t n0, n1;
        thread_share(N, &n0, &n1);
        float out[QMB];
        for (int64_t n = n0; n < n1; n++)
            for (int m0 = 0; m0 < M; m0 += QMB) {
                int mb = M - m0 < QMB ? M - m0 : QMB;
                if (kind == F8 && mb == 1)
                    dot_f8_1(w + (size_t)n * rb, scale + (size_t)n * (K / F8_BLOCK), xf + (size_t)m0 * K, K, out);
                else if (kind == F8)
                    dot_f8(w + (size_t)n * rb, scale + (size_t)n * (K / F8_BLOCK), xf + (size_t)m0 * K, (size_t)K,
                           K, mb, out);
                else
                    dot(w + (size_t)n * rb, xf + (size_t)m0 * K, (size_t)K, xs + (size_t)m0 * ldxs,
                        (size_t)ldxs, K, mb, out);
                for (int m = 0; m < mb; m++)
                    st1(y, dt, (size_t)(m0 + m) * ldy + n, kind == I8 ? out[m] * scale[n] : out[m]);
            }
    }
    free(xf);
    return 0;
}
