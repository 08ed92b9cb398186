/* omniinfer CPU kernels, built once per ISA level (see ../build.py) and called through ctypes.
 *
 * omni_linear:          y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for small M (decode): streams the
 *                       weight once, a contiguous range of rows per thread, float32 accumulation.
 * omni_linear_ec:       omni_linear from a copy of the weight with coded top bytes (omni_ec_pack):
 *                       the same sums from 7/8 of float32's bytes or 3/4 of bfloat16's.
 * omni_paged_attention: writes the step's keys/values into the paged cache, then attention of
 *                       every query token over its sequence's cached keys (varlen prefills, chunks
 *                       after a cached context and decodes in one call; causal; sliding window).
 * omni_rms_norm, omni_rotary, omni_silu_and_mul: the elementwise pieces of a decoder layer.
 * omni_argmax:          the greedy token of each row of the logits.
 * omni_gemm:            y = x @ W^T for 3 to a few hundred rows, W packed at load (omni_gemm_pack);
 *                       with a gate_up weight, silu(gate) * up.
 * omni_gemm_argmax:     the greedy token of each row of x @ W^T, without writing the products
 *                       (the LM head of an all-greedy batch).
 * omni_decoder_layers:  a stack of pre-norm Llama layers in one call, made of the kernels above
 *                       (no Python between them: at batch 1 that was ~10% of a token).
 * omni_isa:             the level this library was built for (build.py checks it at load).
 *
 * Written with GCC vector extensions whose width is the target's register: VL float lanes, 16 on
 * AVX-512, 8 on AVX2, 4 on NEON and other 128-bit targets (a vector wider than the registers is
 * split by GCC through the stack: on AVX2 that made the fp32 inner loop 2/3 stack traffic).
 * Intrinsics only where an instruction has no portable spelling (AVX-512 BF16's vdpbf16ps, VBMI's
 * byte permutes for the coded copies, masks, int8 widening). The arithmetic of each kernel is the
 * same at every level up to the order of float32 sums (which follows VL); kernels that promise
 * bit-for-bit agreement with another (omni_linear_ec, omni_decoder_layers, the int8 LM head's
 * exact pass) keep it within a level.
 * dtypes: 0 = float32, 1 = bfloat16 (widened on load, or multiplied in pairs by vdpbf16ps; sums
 * in float32; results rounded to nearest even once, at the end); the query, keys, values, cache
 * and output of one call share a dtype, as do a linear's input, weight, bias and output.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

/* VBYTES: one vector register; NREGS: how many a kernel may keep live before GCC spills */
#if defined(__AVX512F__)
#define VBYTES 64
#define NREGS 32
#elif defined(__AVX2__)
#define VBYTES 32
#define NREGS 16
#elif defined(__aarch64__)
#define VBYTES 16
#define NREGS 32
#else
#define VBYTES 16
#define NREGS 16
#endif
#define VL (VBYTES / 4)

/* The level named as build.py names it, checked when the library is loaded (a library built
 * with other flags than its name says is refused instead of trusted). */
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define OMNI_ISA "avx512_bf16"
#elif defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define OMNI_ISA "avx512_vbmi"
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define OMNI_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define OMNI_ISA "avx2"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define OMNI_ISA "neon"
#else
#define OMNI_ISA "generic"
#endif

const char *omni_isa(void) { return OMNI_ISA; }

typedef float vf __attribute__((vector_size(VBYTES)));
typedef float vfu __attribute__((vector_size(VBYTES), aligned(4), may_alias));
typedef uint16_t vhu __attribute__((vector_size(VBYTES / 2), aligned(2), may_alias));
typedef uint32_t vu __attribute__((vector_size(VBYTES)));
typedef uint32_t vuu __attribute__((vector_size(VBYTES), aligned(4), may_alias));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint32_t v4u __attribute__((vector_size(16)));

#if VL == 16
#define LANE_INDEX {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#elif VL == 8
#define LANE_INDEX {0, 1, 2, 3, 4, 5, 6, 7}
#else
#define LANE_INDEX {0, 1, 2, 3}
#endif

enum { F32 = 0, BF16 = 1 };
#define INLINE static inline __attribute__((always_inline))

INLINE vf ld(const void *p, int dt, size_t i) {
    if (dt == F32) return *(const vfu *)((const float *)p + i);
#if defined(__AVX512F__)
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif defined(__AVX2__)
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#elif defined(__aarch64__) && defined(__ARM_NEON)
    return (vf)vshll_n_u16(vld1_u16((const uint16_t *)p + i), 16);
#else
    vu t = __builtin_convertvector(*(const vhu *)((const uint16_t *)p + i), vu) << 16;
    return (vf)t;
#endif
}

INLINE float ld1(const void *p, int dt, size_t i) {
    if (dt == F32) return ((const float *)p)[i];
    uint32_t b = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

INLINE uint16_t to_bf16(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);  /* quiet NaN */
    b += 0x7fffu + ((b >> 16) & 1u);  /* round to nearest even */
    return (uint16_t)(b >> 16);
}

INLINE void st1(void *p, int dt, size_t i, float v) {
    if (dt == F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = to_bf16(v);
}

/* the lanes' sum: halves added until one is left (reduce_lanes adds in the same order) */
INLINE float hsum(vf v) {
#if VL == 16
    v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    v8f b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    a += b;
    v4f c = __builtin_shufflevector(a, a, 0, 1, 2, 3);
    v4f d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
    c += d;
#elif VL == 8
    v4f c = __builtin_shufflevector(v, v, 0, 1, 2, 3);
    v4f d = __builtin_shufflevector(v, v, 4, 5, 6, 7);
    c += d;
#else
    v4f c = v;
#endif
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* store VL lanes (bfloat16: rounded to nearest even, NaN kept quiet). With AVX-512 BF16 one
 * vcvtneps2bf16 does it (it reads float32 denormals, below 1.2e-38, as zero; torch rounds them). */
INLINE void stv(void *p, int dt, size_t i, vf v) {
    if (dt == F32) {
        *(vfu *)((float *)p + i) = v;
        return;
    }
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
    vu b = (vu)v;
    vu nan = (vu)(v != v);
    vu r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    r = (nan & ((b >> 16) | 0x40u)) | (~nan & r);
    *(vhu *)((uint16_t *)p + i) = __builtin_convertvector(r, vhu);
#endif
}

INLINE vf vround_bf16(vf v) {  /* each lane as bfloat16 would hold it (finite values) */
#if defined(__AVX512BF16__)
    __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)v);
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
    vu b = (vu)v;
    return (vf)((b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u);
#endif
}

INLINE float round_to(int dt, float v) {  /* v as the dtype would hold it */
    if (dt == F32) return v;
    uint32_t b = (uint32_t)to_bf16(v) << 16;
    memcpy(&v, &b, 4);
    return v;
}

INLINE vf vsel(vu mask, vf a, vf b) {  /* mask lanes all-ones: a, else b */
#if defined(__AVX512F__)
    return (vf)_mm512_ternarylogic_epi32((__m512i)mask, (__m512i)a, (__m512i)b, 0xca);
#elif defined(__AVX2__)
    return (vf)_mm256_blendv_ps((__m256)b, (__m256)a, (__m256)mask);
#else
    return (vf)((mask & (vu)a) | (~mask & (vu)b));
#endif
}

INLINE float hmax(vf v) {
#if VL == 16
    v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    v8f b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v8u m = (v8u)(a > b);
    a = (v8f)((m & (v8u)a) | (~m & (v8u)b));
    v4f c = __builtin_shufflevector(a, a, 0, 1, 2, 3), d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif VL == 8
    v4f c = __builtin_shufflevector(v, v, 0, 1, 2, 3), d = __builtin_shufflevector(v, v, 4, 5, 6, 7);
#endif
#if VL >= 8
    v4u n = (v4u)(c > d);
    c = (v4f)((n & (v4u)c) | (~n & (v4u)d));
#else
    v4f c = v;
#endif
    float x = c[0] > c[1] ? c[0] : c[1], y = c[2] > c[3] ? c[2] : c[3];
    return x > y ? x : y;
}

/* e^x for VL lanes: 2^n * p(r), |r| <= ln2 / 2, degree-6 polynomial (~2 ulp); x clamped to the
 * float range (e^-88 -> ~0, e^89 -> inf is clamped to e^88.7). */
INLINE vf vexp(vf x) {
    const vf hi = (vf){0} + 88.7f, lo = (vf){0} - 87.3f;
    /* a NaN x stays NaN: max/min return their 2nd operand then */
#if defined(__AVX512F__)
    x = _mm512_max_ps(lo, _mm512_min_ps(hi, x));
#elif defined(__AVX2__)
    x = _mm256_max_ps(lo, _mm256_min_ps(hi, x));
#else
    x = vsel((vu)(x > hi), hi, x);
    x = vsel((vu)(x < lo), lo, x);
#endif
    vf t = x * 1.44269504088896341f + 12582912.0f; /* round(x / ln2) in the low mantissa bits */
    vf n = t - 12582912.0f;
    vf r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vu e = ((vu)t - (vu)((vf){0} + 12582912.0f) + 127u) << 23;
    return p * (vf)e;
}

/* VL vectors -> one vector of their VL horizontal sums, in order: a transposing add tree (VL - 1
 * shuffle pairs) instead of VL separate horizontal sums. Each lane's additions come in hsum's
 * order (first lane j + lane j + VL / 2, then halves again), so a sum reduced here equals hsum's. */
#if VL == 16
#define RED_A(x, y) (__builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) + \
    __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define RED_B(x, y) (__builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) + \
    __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31))
#define RED_C(x, y) (__builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) + \
    __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31))
#define RED_D(x, y) (__builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) + \
    __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31))

INLINE vf reduce_lanes(const vf *s) {
    vf a[8], b[4];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) a[i] = RED_A(s[2 * i], s[2 * i + 1]);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) b[i] = RED_B(a[2 * i], a[2 * i + 1]);
    vf c0 = RED_C(b[0], b[1]), c1 = RED_C(b[2], b[3]);
    return RED_D(c0, c1);
}
#elif VL == 8
#define RED_A(x, y) (__builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + \
    __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15))
#define RED_B(x, y) (__builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13) + \
    __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15))
#define RED_C(x, y) (__builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14) + \
    __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15))

INLINE vf reduce_lanes(const vf *s) {
    vf a[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) a[i] = RED_A(s[2 * i], s[2 * i + 1]);
    return RED_C(RED_B(a[0], a[1]), RED_B(a[2], a[3]));
}
#else
#define RED_A(x, y) (__builtin_shufflevector(x, y, 0, 1, 4, 5) + __builtin_shufflevector(x, y, 2, 3, 6, 7))
#define RED_B(x, y) (__builtin_shufflevector(x, y, 0, 2, 4, 6) + __builtin_shufflevector(x, y, 1, 3, 5, 7))

INLINE vf reduce_lanes(const vf *s) {
    return RED_B(RED_A(s[0], s[1]), RED_A(s[2], s[3]));
}
#endif

/* ---- linear: small M ----------------------------------------------------------------------- */
/* One weight row at a time, so each thread reads its share of W as one sequential stream (on the
 * development machine one stream per core reaches ~2x the bandwidth of 8 interleaved row streams);
 * the row meets every x row while it is in registers. U independent accumulators per x row, as
 * many as the registers hold beside the weight vector (GEMV_U). */
#if NREGS >= 32
#define GEMV_U(MB) 4
#else
#define GEMV_U(MB) ((MB) <= 3 ? 4 : 2)
#endif

INLINE void gemv_row(const void *x, size_t ldx, const void *w, int dt, int K, int MB, int U,
                     float *out) {
    vf acc[4][4];
#pragma GCC unroll 4
    for (int u = 0; u < U; u++)
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++) acc[u][m] = (vf){0};
    int k = 0;
    for (; k + U * VL <= K; k += U * VL)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            vf wv = ld(w, dt, k + u * VL);
#pragma GCC unroll 4
            for (int m = 0; m < MB; m++) acc[u][m] += wv * ld(x, dt, m * ldx + k + u * VL);
        }
    for (; k + VL <= K; k += VL) {
        vf wv = ld(w, dt, k);
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++) acc[0][m] += wv * ld(x, dt, m * ldx + k);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++) {
#pragma GCC unroll 4
        for (int u = 1; u < U; u++) acc[0][m] += acc[u][m];
        float s = hsum(acc[0][m]);
        for (int kk = k; kk < K; kk++) s += ld1(w, dt, kk) * ld1(x, dt, m * ldx + kk);
        out[m] = s;
    }
}

#if defined(__AVX512BF16__)
/* bfloat16 pairs multiplied exactly and summed in float32 (vdpbf16ps): 32 weights an instruction */
INLINE void gemv_row_bf16(const uint16_t *x, size_t ldx, const uint16_t *w, int K, int MB, int U,
                          float *out) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int u = 0; u < U; u++)
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++) acc[u][m] = _mm512_setzero_ps();
    int k = 0;
    for (; k + U * 32 <= K; k += U * 32)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + u * 32);
#pragma GCC unroll 4
            for (int m = 0; m < MB; m++)
                acc[u][m] = _mm512_dpbf16_ps(acc[u][m], wv,
                                             (__m512bh)_mm512_loadu_si512(x + m * ldx + k + u * 32));
        }
    for (; k + 32 <= K; k += 32) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++)
            acc[0][m] = _mm512_dpbf16_ps(acc[0][m], wv, (__m512bh)_mm512_loadu_si512(x + m * ldx + k));
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++) {
#pragma GCC unroll 4
        for (int u = 1; u < U; u++) acc[0][m] = _mm512_add_ps(acc[0][m], acc[u][m]);
        float s = _mm512_reduce_add_ps(acc[0][m]);
        for (int kk = k; kk < K; kk++) s += ld1(w, BF16, kk) * ld1(x, BF16, m * ldx + kk);
        out[m] = s;
    }
}
#define GEMV_ROW(x, ldx, w, dt, K, MB, U, out) \
    ((dt) == BF16 ? gemv_row_bf16((const uint16_t *)(x), ldx, (const uint16_t *)(w), K, MB, U, out) \
                  : gemv_row(x, ldx, w, dt, K, MB, U, out))
#else
#define GEMV_ROW gemv_row
#endif

/* One row of W dotted with x, as a vector whose lanes still need summing (the K tail is added
 * to lane 0). */
INLINE vf row_vec(const void *x, const void *w, int dt, int K) {
    vf a0 = (vf){0}, a1 = a0, a2 = a0, a3 = a0;
    int k = 0;
#if defined(__AVX512BF16__)
    if (dt == BF16) {
        __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
        const uint16_t *xb = x, *wb = w;
#define DP(acc, i) acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(wb + (i)), \
                                          (__m512bh)_mm512_loadu_si512(xb + (i)))
        for (; k + 128 <= K; k += 128) {
            DP(b0, k); DP(b1, k + 32); DP(b2, k + 64); DP(b3, k + 96);
        }
        for (; k + 32 <= K; k += 32) DP(b0, k);
#undef DP
        a0 = (vf)_mm512_add_ps(_mm512_add_ps(b0, b1), _mm512_add_ps(b2, b3));
        a1 = a2 = a3 = (vf){0};
    } else
#endif
    {
        for (; k + 4 * VL <= K; k += 4 * VL) {
            a0 += ld(w, dt, k) * ld(x, dt, k);
            a1 += ld(w, dt, k + VL) * ld(x, dt, k + VL);
            a2 += ld(w, dt, k + 2 * VL) * ld(x, dt, k + 2 * VL);
            a3 += ld(w, dt, k + 3 * VL) * ld(x, dt, k + 3 * VL);
        }
        for (; k + VL <= K; k += VL) a0 += ld(w, dt, k) * ld(x, dt, k);
    }
    vf v = (a0 + a1) + (a2 + a3);
    float tail = 0.f;
    for (; k < K; k++) tail += ld1(w, dt, k) * ld1(x, dt, k);
    v[0] += tail;
    return v;
}

/* One row of x: 16 rows of W at a time, their sums finished together by reduce16. */
INLINE void linear_rows_m1(const void *x, const void *w, const void *bias, void *y, int dt, int K,
                           int n0, int n1) {
    size_t es = dt == F32 ? 4 : 2;
    int n = n0;
    for (; n + VL <= n1; n += VL) {
        vf part[VL];
        for (int r = 0; r < VL; r++) part[r] = row_vec(x, (const char *)w + (size_t)(n + r) * K * es, dt, K);
        vf sums = reduce_lanes(part);
        if (bias) sums += ld(bias, dt, n);
        stv(y, dt, n, sums);
    }
    for (; n < n1; n++) {
        float v = hsum(row_vec(x, (const char *)w + (size_t)n * K * es, dt, K));
        st1(y, dt, n, v + (bias ? ld1(bias, dt, n) : 0.f));
    }
}

/* Rows [n0, n1) of W against every row of x, in groups of up to 4 (a row is still in L1 for
 * the next group). */
INLINE void linear_rows(const void *x, size_t ldx, const void *w, const void *bias, void *y,
                        size_t ldy, int dt, int M, int K, int n0, int n1) {
    if (M == 1) {
        linear_rows_m1(x, w, bias, y, dt, K, n0, n1);
        return;
    }
    size_t es = dt == F32 ? 4 : 2;
    float out[4];
    for (int n = n0; n < n1; n++) {
        const char *wn = (const char *)w + (size_t)n * K * es;
        float b = bias ? ld1(bias, dt, n) : 0.f;
        for (int m0 = 0; m0 < M; m0 += 4) {
            int mb = M - m0 < 4 ? M - m0 : 4;
            const char *xm = (const char *)x + (size_t)m0 * ldx * es;
            switch (mb) {
                case 1: GEMV_ROW(xm, ldx, wn, dt, K, 1, GEMV_U(1), out); break;
                case 2: GEMV_ROW(xm, ldx, wn, dt, K, 2, GEMV_U(2), out); break;
                case 3: GEMV_ROW(xm, ldx, wn, dt, K, 3, GEMV_U(3), out); break;
                default: GEMV_ROW(xm, ldx, wn, dt, K, 4, GEMV_U(4), out); break;
            }
            for (int m = 0; m < mb; m++) st1(y, dt, (size_t)(m0 + m) * ldy + n, out[m] + b);
        }
    }
}

/* this thread's even share [lo, hi) of n items (inside a parallel region) */
INLINE void thread_share(int64_t n, int64_t *lo, int64_t *hi) {
#ifdef _OPENMP
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    int t = 0, nt = 1;
#endif
    *lo = n * t / nt, *hi = n * (t + 1) / nt;
}

/* the dtype as a compile-time constant, so the inner loops carry no branches */
static void linear_rows_f32(const void *x, size_t ldx, const void *w, const void *bias, void *y,
                            size_t ldy, int M, int K, int n0, int n1) {
    linear_rows(x, ldx, w, bias, y, ldy, F32, M, K, n0, n1);
}

static void linear_rows_bf16(const void *x, size_t ldx, const void *w, const void *bias, void *y,
                             size_t ldy, int M, int K, int n0, int n1) {
    linear_rows(x, ldx, w, bias, y, ldy, BF16, M, K, n0, n1);
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ w[N, K]^T + bias[N] (bias may be NULL).
 * x, w, bias and y share one dtype. Each thread takes one contiguous range of rows of W. */
void omni_linear(const void *x, int64_t ldx, const void *w, const void *bias, void *y, int64_t ldy,
                 int M, int N, int K, int dt, int nthreads) {
    void (*rows)(const void *, size_t, const void *, const void *, void *, size_t, int, int, int,
                 int) = dt == F32 ? linear_rows_f32 : linear_rows_bf16;
    if (nthreads < 1) nthreads = 1;
    if ((int64_t)N * K < 32768) nthreads = 1;  /* not worth waking a thread */
#pragma omp parallel num_threads(nthreads)
    {
        int64_t n0, n1;
        thread_share(N, &n0, &n1);
        rows(x, (size_t)ldx, w, bias, y, (size_t)ldy, M, K, (int)n0, (int)n1);
    }
}

/* ---- linear: weights with coded top bytes (7/8 of float32's bytes, 3/4 of bfloat16's) -------- */
/* Batch-1 decode reads every weight once a token, so its speed is the bytes it reads. A weight's
 * top byte (the sign and the exponent's high 7 bits) takes few values in one row of a trained or
 * initialised layer, so the copy made here keeps each weight's other bytes as they are (three of
 * a float32, one of a bfloat16) and its top byte as a 4-bit index into its row's table of 16:
 * 28 or 12 bits a weight, and the values exactly the weight's. A weight whose top byte is not in
 * its row's table is stored as +0 and listed as a patch (column, value) that is put back into its
 * lane before the multiply, so omni_linear_ec does omni_linear's arithmetic on the same values:
 * the same results, bit for bit. Decoding takes two shuffles per vector (vpermb needs AVX-512
 * VBMI; bfloat16 also needs AVX-512 BF16, whose vdpbf16ps omni_linear uses), under the reads' time.
 *
 * Layout (omni_ec_size bytes): N rows of K / G groups, G = 16 weights (float32) or 32 (bfloat16)
 * in 56 or 48 bytes: the weights' low bytes (weight j's at L j .. L j + L - 1, L = 3 or 1), then
 * their indices (weight j's in byte L G + j / 2, the low nibble for an even j); 64 bytes of
 * padding (a group's 64-byte load may run past it); the tables, 16 bytes a row (entry 0 is 0x00,
 * for zeros and patches); patch_start, int32 [N + 1]; the patches, ordered by row and column. */

typedef struct {
    int32_t k;
    uint32_t bits;  /* the weight's bits (a bfloat16's in the low half) */
} ec_patch;

INLINE int ec_lanes(int dt) { return dt == F32 ? 16 : 32; }    /* weights a group */
INLINE int ec_low(int dt) { return dt == F32 ? 3 : 1; }        /* bytes kept as they are */
INLINE int ec_group(int dt) { return ec_lanes(dt) * ec_low(dt) + ec_lanes(dt) / 2; }

INLINE size_t ec_rows_bytes(int64_t N, int64_t K, int dt) {
    return (size_t)(N * (K / ec_lanes(dt))) * ec_group(dt) + 64;
}

int omni_ec_supported(int dt) {
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    if (dt == F32) return 1;
#if defined(__AVX512BF16__)
    if (dt == BF16) return 1;
#endif
#endif
    (void)dt;
    return 0;
}

int64_t omni_ec_size(int N, int K, int dt, int64_t patches) {
    return (int64_t)ec_rows_bytes(N, K, dt) + 16 * (int64_t)N + 4 * ((int64_t)N + 1) + 8 * patches;
}

INLINE uint32_t ec_bits(const void *w, int dt, size_t i) {
    return dt == F32 ? ((const uint32_t *)w)[i] : ((const uint16_t *)w)[i];
}

/* Row r's table (0x00 and the 15 most frequent other top bytes, the smaller byte first among
 * equals; unused entries 0x00), code_of (each top byte's index, -1 for none) and how many of its
 * weights it leaves to patches. */
static int ec_table(const void *w, int dt, size_t base, int K, uint8_t table[16], int8_t code_of[256]) {
    int count[256] = {0}, shift = dt == F32 ? 24 : 8;
    for (int k = 0; k < K; k++) count[ec_bits(w, dt, base + k) >> shift]++;
    memset(table, 0, 16);
    memset(code_of, -1, 256);
    code_of[0] = 0;
    int covered = count[0];
    count[0] = -1;
    for (int c = 1; c < 16; c++) {
        int best = -1;
        for (int b = 1; b < 256; b++)
            if (count[b] > 0 && (best < 0 || count[b] > count[best])) best = b;
        if (best < 0) break;
        table[c] = (uint8_t)best, code_of[best] = (int8_t)c;
        covered += count[best];
        count[best] = -1;
    }
    return K - covered;
}

INLINE int ec_shape_ok(int N, int K, int dt) {
    return omni_ec_supported(dt) && N > 0 && K > 0 && K % ec_lanes(dt) == 0;
}

/* How many patches w [N, K] (dtype dt) needs; -1 when the copy is not built here for dt or K is
 * not a multiple of 16 (float32) or 32 (bfloat16). */
int64_t omni_ec_count(const void *w, int N, int K, int dt, int nthreads) {
    if (!ec_shape_ok(N, K, dt)) return -1;
    int64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(nthreads > 0 ? nthreads : 1)
    for (int r = 0; r < N; r++) {
        uint8_t table[16];
        int8_t code_of[256];
        total += ec_table(w, dt, (size_t)r * K, K, table, code_of);
    }
    return total;
}

/* w [N, K] -> out (omni_ec_size(N, K, dt, patches) bytes). Returns 0, or -1 (nothing usable
 * written) when the copy is not built here or `patches` is not omni_ec_count's. */
int omni_ec_pack(const void *w, int N, int K, int dt, int64_t patches, uint8_t *out, int nthreads) {
    if (!ec_shape_ok(N, K, dt) || patches < 0 || patches > INT32_MAX) return -1;
    const int G = ec_lanes(dt), L = ec_low(dt), shift = dt == F32 ? 24 : 8;
    uint8_t *tables = out + ec_rows_bytes(N, K, dt);
    int32_t *start = (int32_t *)(tables + 16 * (size_t)N);
    ec_patch *patch = (ec_patch *)(start + N + 1);
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int r = 0; r < N; r++) {
        int8_t code_of[256];
        start[r + 1] = ec_table(w, dt, (size_t)r * K, K, tables + 16 * (size_t)r, code_of);
    }
    start[0] = 0;
    for (int r = 0; r < N; r++) {
        if ((int64_t)start[r] + start[r + 1] > patches) return -1;
        start[r + 1] += start[r];
    }
    if (start[N] != patches) return -1;
    memset(tables - 64, 0, 64);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int r = 0; r < N; r++) {
        int8_t code_of[256];
        memset(code_of, -1, 256);
        for (int c = 0; c < 16; c++)
            if (c == 0 || tables[16 * (size_t)r + c]) code_of[tables[16 * (size_t)r + c]] = (int8_t)c;
        ec_patch *p = patch + start[r];
        for (int g = 0; g < K / G; g++) {
            uint8_t *grp = out + ((size_t)r * (K / G) + g) * ec_group(dt);
            memset(grp + L * G, 0, (size_t)G / 2);
            for (int j = 0; j < G; j++) {
                int k = g * G + j;
                uint32_t b = ec_bits(w, dt, (size_t)r * K + k);
                int c = code_of[b >> shift];
                if (c < 0) {  /* stored as +0, put back from the patch */
                    p->k = k, p->bits = b, p++;
                    b = 0, c = 0;
                }
                for (int i = 0; i < L; i++) grp[L * j + i] = (uint8_t)(b >> (8 * i));
                grp[L * G + j / 2] |= (uint8_t)(c << (4 * (j & 1)));
            }
        }
    }
    return 0;
}

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
typedef struct {
    __m512i table, expand, shift, low;
} ec_decoder;

INLINE ec_decoder ec_decoder_for(const uint8_t *table, int dt) {
    ec_decoder d;
    uint8_t expand[64];
    if (dt == F32) {
        /* lane j (a dword): its three bytes, then the byte with its index; the shift brings the
         * index to the bottom (the low nibble for an even lane, the high one for an odd lane) and
         * vpermd reads its low 4 bits */
        d.table = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)table)), 24);
        for (int j = 0; j < 16; j++) {
            for (int b = 0; b < 3; b++) expand[4 * j + b] = (uint8_t)(3 * j + b);
            expand[4 * j + 3] = (uint8_t)(48 + j / 2);
        }
        d.shift = _mm512_setr_epi32(24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28);
        d.low = _mm512_set1_epi32(0x00ffffff);
    } else {
        /* lane j (a word): its low byte, then the byte with its index; vpermw reads 5 bits, so the
         * table of 16 is there twice */
        __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)table)), 8);
        d.table = _mm512_inserti64x4(_mm512_castsi256_si512(t), t, 1);
        uint16_t shift[32];
        for (int j = 0; j < 32; j++) {
            expand[2 * j] = (uint8_t)j, expand[2 * j + 1] = (uint8_t)(32 + j / 2);
            shift[j] = j & 1 ? 12 : 8;
        }
        d.shift = _mm512_loadu_si512(shift);
        d.low = _mm512_set1_epi16(0x00ff);
    }
    d.expand = _mm512_loadu_si512(expand);
    return d;
}

/* one group's weights: a byte shuffle, a shift, a table lookup, a merge */
INLINE __m512i ec_load(const ec_decoder *d, const uint8_t *grp, int dt) {
    __m512i r = _mm512_permutexvar_epi8(d->expand, _mm512_loadu_si512(grp));
    __m512i top = dt == F32 ? _mm512_permutexvar_epi32(_mm512_srlv_epi32(r, d->shift), d->table)
                            : _mm512_permutexvar_epi16(_mm512_srlv_epi16(r, d->shift), d->table);
    return _mm512_ternarylogic_epi32(d->low, r, top, 0xea);  /* (low & r) | top */
}

/* the patches of columns [k, k + n * G) put into their lanes of w[0 .. n) */
static __attribute__((noinline)) void ec_patch_lanes(__m512i *w, int n, int k, const ec_patch **p,
                                                     const ec_patch *end, int dt) {
    union {
        __m512i v[4];
        uint32_t f32[64];
        uint16_t bf16[128];
    } lanes;
    memcpy(lanes.v, w, sizeof(__m512i) * n);
    for (; *p < end && (*p)->k < k + n * ec_lanes(dt); (*p)++) {
        if (dt == F32) lanes.f32[(*p)->k - k] = (*p)->bits;
        else lanes.bf16[(*p)->k - k] = (uint16_t)(*p)->bits;
    }
    memcpy(w, lanes.v, sizeof(__m512i) * n);
}

/* acc + the products of one vector of weights with x[i ..], as omni_linear adds them */
INLINE vf ec_mac(vf acc, __m512i w, const void *x, size_t i, int dt) {
    if (dt == F32) return acc + (vf)w * *(const vfu *)((const float *)x + i);
#if defined(__AVX512BF16__)
    return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)w,
                                (__m512bh)_mm512_loadu_si512((const uint16_t *)x + i));
#else
    return acc;  /* (not reached: omni_ec_supported(BF16) is 0) */
#endif
}

typedef struct {
    ec_decoder d;
    const uint8_t *grp;
    const ec_patch *p, *end;
    int next;  /* the column of the next patch, or K */
} ec_row;

INLINE ec_row ec_row_at(const uint8_t *ec, const uint8_t *tables, const int32_t *start,
                        const ec_patch *patch, int r, int K, int dt) {
    ec_row row;
    row.d = ec_decoder_for(tables + 16 * (size_t)r, dt);
    row.grp = ec + (size_t)r * (K / ec_lanes(dt)) * ec_group(dt);
    row.p = patch + start[r], row.end = patch + start[r + 1];
    row.next = row.p < row.end ? row.p->k : K;
    return row;
}

/* the next n (1 or 4) vectors of the row, from column k, patched */
INLINE void ec_next(ec_row *row, __m512i *w, int n, int k, int K, int dt) {
    for (int u = 0; u < n; u++) w[u] = ec_load(&row->d, row->grp + u * ec_group(dt), dt);
    row->grp += n * ec_group(dt);
    if (__builtin_expect(row->next < k + n * ec_lanes(dt), 0)) {
        ec_patch_lanes(w, n, k, &row->p, row->end, dt);
        row->next = row->p < row->end ? row->p->k : K;
    }
}

/* row_vec on a coded row (its float32 or its vdpbf16ps arithmetic) */
INLINE vf ec_row_vec(const void *x, ec_row row, int K, int dt) {
    const int V = ec_lanes(dt);
    vf a[4] = {{0}, {0}, {0}, {0}}, z = (vf){0};
    __m512i w[4];
    int k = 0;
    for (; k + 4 * V <= K; k += 4 * V) {
        ec_next(&row, w, 4, k, K, dt);
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) a[u] = ec_mac(a[u], w[u], x, k + u * V, dt);
    }
    for (; k + V <= K; k += V) {
        ec_next(&row, w, 1, k, K, dt);
        a[0] = ec_mac(a[0], w[0], x, k, dt);
    }
    vf v = (a[0] + a[1]) + (a[2] + a[3]);
    if (dt == BF16) v = (v + z) + (z + z);  /* row_vec adds its (zero) float32 accumulators */
    v[0] += 0.f;  /* row_vec's (empty) tail: turns a -0 lane into +0 as there */
    return v;
}

/* gemv_row / gemv_row_bf16 (U = 4) on a coded row */
INLINE void ec_gemv_row(const void *x, size_t ldx, ec_row row, int K, int MB, int dt, float *out) {
    const int V = ec_lanes(dt);
    vf acc[4][4];
    __m512i w[4];
#pragma GCC unroll 4
    for (int u = 0; u < 4; u++)
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++) acc[u][m] = (vf){0};
    int k = 0;
    for (; k + 4 * V <= K; k += 4 * V) {
        ec_next(&row, w, 4, k, K, dt);
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++)
#pragma GCC unroll 4
            for (int m = 0; m < MB; m++) acc[u][m] = ec_mac(acc[u][m], w[u], x, m * ldx + k + u * V, dt);
    }
    for (; k + V <= K; k += V) {
        ec_next(&row, w, 1, k, K, dt);
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++) acc[0][m] = ec_mac(acc[0][m], w[0], x, m * ldx + k, dt);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++) {
#pragma GCC unroll 4
        for (int u = 1; u < 4; u++) acc[0][m] += acc[u][m];
        out[m] = dt == F32 ? hsum(acc[0][m]) : _mm512_reduce_add_ps((__m512)acc[0][m]);
    }
}

/* linear_rows on coded rows [n0, n1) */
INLINE void ec_linear_rows(const void *x, size_t ldx, const uint8_t *ec, const void *bias, void *y,
                           size_t ldy, int dt, int M, int N, int K, int n0, int n1) {
    const uint8_t *tables = ec + ec_rows_bytes(N, K, dt);
    const int32_t *start = (const int32_t *)(tables + 16 * (size_t)N);
    const ec_patch *patch = (const ec_patch *)(start + N + 1);
#define EC_ROW(r) ec_row_at(ec, tables, start, patch, r, K, dt)
    if (M == 1) {
        int n = n0;
        for (; n + VL <= n1; n += VL) {
            vf part[VL];
            for (int r = 0; r < VL; r++) part[r] = ec_row_vec(x, EC_ROW(n + r), K, dt);
            vf sums = reduce_lanes(part);
            if (bias) sums += ld(bias, dt, n);
            stv(y, dt, n, sums);
        }
        for (; n < n1; n++)
            st1(y, dt, n, hsum(ec_row_vec(x, EC_ROW(n), K, dt)) + (bias ? ld1(bias, dt, n) : 0.f));
        return;
    }
    size_t es = dt == F32 ? 4 : 2;
    float out[4];
    for (int n = n0; n < n1; n++) {
        float b = bias ? ld1(bias, dt, n) : 0.f;
        for (int m0 = 0; m0 < M; m0 += 4) {
            int mb = M - m0 < 4 ? M - m0 : 4;
            const char *xm = (const char *)x + (size_t)m0 * ldx * es;
            switch (mb) {
                case 1: ec_gemv_row(xm, ldx, EC_ROW(n), K, 1, dt, out); break;
                case 2: ec_gemv_row(xm, ldx, EC_ROW(n), K, 2, dt, out); break;
                case 3: ec_gemv_row(xm, ldx, EC_ROW(n), K, 3, dt, out); break;
                default: ec_gemv_row(xm, ldx, EC_ROW(n), K, 4, dt, out); break;
            }
            for (int m = 0; m < mb; m++) st1(y, dt, (size_t)(m0 + m) * ldy + n, out[m] + b);
        }
    }
#undef EC_ROW
}

/* the dtype as a compile-time constant, so the inner loops carry no branches */
static void ec_linear_rows_f32(const void *x, size_t ldx, const uint8_t *ec, const void *bias, void *y,
                               size_t ldy, int M, int N, int K, int n0, int n1) {
    ec_linear_rows(x, ldx, ec, bias, y, ldy, F32, M, N, K, n0, n1);
}

#if defined(__AVX512BF16__)
static void ec_linear_rows_bf16(const void *x, size_t ldx, const uint8_t *ec, const void *bias, void *y,
                                size_t ldy, int M, int N, int K, int n0, int n1) {
    ec_linear_rows(x, ldx, ec, bias, y, ldy, BF16, M, N, K, n0, n1);
}
#endif
#endif

/* omni_linear with the weight as omni_ec_pack coded it: the same result, bit for bit. Returns 0,
 * or -1 (nothing written) where the copy is not built for dt or K does not fit it. */
int omni_linear_ec(const void *x, int64_t ldx, const uint8_t *ec, const void *bias, void *y,
                   int64_t ldy, int M, int N, int K, int dt, int nthreads) {
    if (!ec_shape_ok(N, K, dt)) return -1;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    void (*rows)(const void *, size_t, const uint8_t *, const void *, void *, size_t, int, int, int,
                 int, int) = ec_linear_rows_f32;
#if defined(__AVX512BF16__)
    if (dt == BF16) rows = ec_linear_rows_bf16;
#endif
    if (nthreads < 1) nthreads = 1;
    if ((int64_t)N * K < 32768) nthreads = 1;  /* as omni_linear */
#pragma omp parallel num_threads(nthreads)
    {
        int64_t n0, n1;
        thread_share(N, &n0, &n1);
        rows(x, (size_t)ldx, ec, bias, y, (size_t)ldy, M, N, K, (int)n0, (int)n1);
    }
    return 0;
#else
    (void)x; (void)ldx; (void)ec; (void)bias; (void)y; (void)ldy; (void)M; (void)nthreads;
    return -1;
#endif
}

/* ---- paged attention ------------------------------------------------------------------------ */
/* Cache layout (CpuPagedBackend.get_kv_cache_shape: [2, blocks, kv_heads, block_size, head]): one
 * head's block_size x head tile is contiguous. Values are stored as the shape says. Keys are
 * stored transposed inside the tile and packed by KX (1 for float32, 2 for bfloat16): element
 * (token o, component d) sits at [d / KX][o][d % KX], so VL consecutive keys' components
 * d .. d + KX - 1 are one vector. A chunk's scores are then D / KX multiply-adds into one
 * vector of VL key lanes (vdpbf16ps on pairs of bfloat16 components where the CPU has it),
 * with no horizontal sums. The layout does not depend on VL: a cache is read the same at every
 * level. */

#define MAX_HEAD 256
#define MAX_ROWS 64  /* query rows (tokens x query heads of one KV head) an item holds */
#define CHUNK VL     /* keys per step: one vector of lanes */
#ifndef PREFETCH_CHUNKS
#define PREFETCH_CHUNKS 3
#endif
#ifndef PF_LOCALITY
#define PF_LOCALITY 2
#endif
#define KX(dt) ((dt) == F32 ? 1 : 2)

/* query tokens [t0, t1) of one sequence (relative to its start) x KV heads [h0, h1) */
typedef struct {
    int seq, h0, h1, t0, t1;
} Item;

/* Each token's key and value into its slot (slot -1: padding, nothing written). */
static void write_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride,
                     void *k_cache, void *v_cache, int dt, const int64_t *slots, int num_tokens,
                     int KVH, int D, int bs) {
    size_t es = dt == F32 ? 4 : 2;
    for (int t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        size_t b = (size_t)slots[t] / bs, o = (size_t)slots[t] % bs;
        for (int h = 0; h < KVH; h++) {
            size_t tile = (b * KVH + h) * bs * D, src = (size_t)h * D;
            memcpy((char *)v_cache + (tile + o * D) * es,
                   (const char *)value + ((size_t)t * value_stride + src) * es, D * es);
            if (dt == F32) {
                const float *k = (const float *)key + (size_t)t * key_stride + src;
                float *kc = (float *)k_cache + tile + o;
                for (int d = 0; d < D; d++) kc[(size_t)d * bs] = k[d];
            } else {  /* pairs of components as one 32-bit word */
                const uint16_t *k = (const uint16_t *)key + (size_t)t * key_stride + src;
                uint32_t *kc = (uint32_t *)((uint16_t *)k_cache + tile) + o;
                for (int d = 0; d < D; d += 2) {
                    uint32_t w;
                    memcpy(&w, k + d, 4);
                    kc[(size_t)(d / 2) * bs] = w;
                }
            }
        }
    }
}

/* Scores of NR rows against one chunk: s[i] lane l = q_i . key_l, as a vector of VL lanes.
 * kt: the chunk's first packed row, kstride: elements (float32) or words (bfloat16) between
 * rows; q: float32 rows (or, for bfloat16 with vdpbf16ps, pairs as words) at stride MAX_HEAD.
 * Two accumulators per row (even and odd rows of the keys) halve the dependency chains. */
INLINE void qk_rows(const void *kt, size_t kstride, const void *q, int NR, int D, int dt, vf *s) {
    vf a[4][2];
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) a[i][0] = a[i][1] = (vf){0};
    if (dt == F32) {
        const float *k = kt, *qf = q;
        int d = 0;
        for (; d + 2 <= D; d += 2)
#pragma GCC unroll 2
            for (int e = 0; e < 2; e++) {
                vf kv = *(const vfu *)(k + (size_t)(d + e) * kstride);
#pragma GCC unroll 4
                for (int i = 0; i < NR; i++) a[i][e] += qf[i * MAX_HEAD + d + e] * kv;
            }
        for (; d < D; d++) {
            vf kv = *(const vfu *)(k + (size_t)d * kstride);
#pragma GCC unroll 4
            for (int i = 0; i < NR; i++) a[i][0] += qf[i * MAX_HEAD + d] * kv;
        }
    } else {  /* D even: D / 2 rows of component pairs */
        const uint32_t *k = kt;
        int d = 0;
#if defined(__AVX512BF16__)
        const uint32_t *qp = q;
        for (; d + 2 <= D / 2; d += 2)
#pragma GCC unroll 2
            for (int e = 0; e < 2; e++) {
                __m512i kv = _mm512_loadu_si512((const void *)(k + (size_t)(d + e) * kstride));
#pragma GCC unroll 4
                for (int i = 0; i < NR; i++)
                    a[i][e] = (vf)_mm512_dpbf16_ps((__m512)a[i][e], (__m512bh)kv,
                                                   (__m512bh)_mm512_set1_epi32((int)qp[i * MAX_HEAD + d + e]));
            }
        for (; d < D / 2; d++) {
            __m512i kv = _mm512_loadu_si512((const void *)(k + (size_t)d * kstride));
#pragma GCC unroll 4
            for (int i = 0; i < NR; i++)
                a[i][0] = (vf)_mm512_dpbf16_ps((__m512)a[i][0], (__m512bh)kv,
                                               (__m512bh)_mm512_set1_epi32((int)qp[i * MAX_HEAD + d]));
        }
#else
        const float *qf = q;
        for (; d < D / 2; d++) {
            vu kv = *(const vuu *)(k + (size_t)d * kstride);
            vf lo = (vf)(kv << 16), hi = (vf)(kv & 0xffff0000u);
#pragma GCC unroll 4
            for (int i = 0; i < NR; i++) {
                a[i][0] += qf[i * MAX_HEAD + 2 * d] * lo;
                a[i][1] += qf[i * MAX_HEAD + 2 * d + 1] * hi;
            }
        }
#endif
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) s[i] = a[i][0] + a[i][1];
}

/* acc[i][d0 + :NV*VL] += sum_j p[i][j] * v_j[d0 + :NV*VL] for NR rows and keys j in [ja, jb)
 * (value rows at voff[j]); keys split in two accumulator sets when registers allow. */
INLINE void pv_block(const void *v_cache, int dt, const size_t *voff, int ja, int jb,
                     const float (*p)[CHUNK], float (*acc)[MAX_HEAD], int NR, int NV, int d0) {
    enum { S = 2 };
    int split = NR * NV <= NREGS / 4;
    vf a[S][4][4];
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int u = 0; u < NV; u++) {
            a[0][i][u] = *(const vfu *)&acc[i][d0 + u * VL];
            a[1][i][u] = (vf){0};
        }
    int j = ja;
    if (split)
        for (; j + 2 <= jb; j += 2)
#pragma GCC unroll 2
            for (int e = 0; e < 2; e++) {
                vf v[4];
#pragma GCC unroll 4
                for (int u = 0; u < NV; u++) v[u] = ld(v_cache, dt, voff[j + e] + d0 + u * VL);
#pragma GCC unroll 4
                for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
                    for (int u = 0; u < NV; u++) a[e][i][u] += p[i][j + e] * v[u];
            }
    for (; j < jb; j++) {
        vf v[4];
#pragma GCC unroll 4
        for (int u = 0; u < NV; u++) v[u] = ld(v_cache, dt, voff[j] + d0 + u * VL);
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
            for (int u = 0; u < NV; u++) a[0][i][u] += p[i][j] * v[u];
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int u = 0; u < NV; u++) *(vfu *)&acc[i][d0 + u * VL] = a[0][i][u] + a[1][i][u];
}

INLINE void pv_rows(const void *v_cache, int dt, const size_t *voff, int ja, int jb,
                    const float (*p)[CHUNK], float (*acc)[MAX_HEAD], int NR, int D) {
    int d = 0;
    for (; d + 4 * VL <= D; d += 4 * VL) pv_block(v_cache, dt, voff, ja, jb, p, acc, NR, 4, d);
    switch ((D - d) / VL) {
    case 3: pv_block(v_cache, dt, voff, ja, jb, p, acc, NR, 3, d); break;
    case 2: pv_block(v_cache, dt, voff, ja, jb, p, acc, NR, 2, d); break;
    case 1: pv_block(v_cache, dt, voff, ja, jb, p, acc, NR, 1, d); break;
    default: break;
    }
    for (d += (D - d) / VL * VL; d < D; d++)
        for (int i = 0; i < NR; i++) {
            float x = acc[i][d];
            for (int j = ja; j < jb; j++) x += p[i][j] * ld1(v_cache, dt, voff[j] + d);
            acc[i][d] = x;
        }
}

#define LAZY_MAX 8.0f  /* how far a score may pass the softmax's exponent offset */

INLINE int any_gt(vf a, float b) {  /* some lane of a > b (false for NaN lanes) */
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask((__m512)a, _mm512_set1_ps(b), _CMP_GT_OQ) != 0;
#elif defined(__AVX2__)
    return _mm256_movemask_ps(_mm256_cmp_ps((__m256)a, _mm256_set1_ps(b), _CMP_GT_OQ)) != 0;
#elif defined(__aarch64__) && defined(__ARM_NEON)
    return vmaxvq_u32(vcgtq_f32((float32x4_t)a, vdupq_n_f32(b))) != 0;
#else
    vu gt = (vu)(a > b);
    uint32_t any = 0;
    for (int l = 0; l < VL; l++) any |= gt[l];
    return any != 0;
#endif
}

/* Prefetch (into L2) the packed keys and the values of one head's chunk at key position a. */
INLINE void prefetch_chunk(const void *k_cache, const void *v_cache, size_t es, const int32_t *table,
                           int a, int h, int KVH, int D, int bs, int bsh, int x) {
    size_t tile = ((size_t)table[a >> bsh] * KVH + h) * bs * D, o = (size_t)(a & (bs - 1));
    const char *k = (const char *)k_cache + (tile + o * x) * es;
    for (int d = 0; d < D / x; d++) __builtin_prefetch(k + (size_t)d * bs * x * es, 0, PF_LOCALITY);
    size_t n = (size_t)(bs - (int)o < CHUNK ? bs - (int)o : CHUNK) * D * es;
    const char *v = (const char *)v_cache + (tile + o * D) * es;
    for (size_t b = 0; b < n; b += 64) __builtin_prefetch(v + b, 0, PF_LOCALITY);
}

/* One work item: the rows (token, query head) of each KV head in [h0, h1) attend over the keys
 * the causal mask (and sliding window) allows them, a chunk of VL keys at a time with an online
 * softmax in float32. */
INLINE void attend(const Item *it, const void *q, int64_t q_stride, const void *k_cache,
                   const void *v_cache, int dt, const int32_t *table, int context_len, int q_start,
                   void *out, int64_t out_stride, int H, int KVH, int D, int bs, float scale,
                   int window) {
    int G = H / KVH, nt = it->t1 - it->t0, R = nt * G, x = KX(dt), bsh = __builtin_ctz((unsigned)bs);
    size_t es = dt == F32 ? 4 : 2;
#if defined(__AVX512BF16__)
    int packed_q = dt == BF16;  /* the query as bfloat16 pairs, for vdpbf16ps */
#else
    int packed_q = 0;
#endif
    float qbuf[MAX_ROWS][MAX_HEAD] __attribute__((aligned(64)));
    float acc[MAX_ROWS][MAX_HEAD] __attribute__((aligned(64)));
    float p[MAX_ROWS][CHUNK] __attribute__((aligned(64)));
    float mx[MAX_ROWS];
    vf den[MAX_ROWS];  /* the softmax denominators, summed across lanes at the end */
    int lo_r[MAX_ROWS], hi_r[MAX_ROWS];
    uint32_t kgather[MAX_HEAD / 2 * CHUNK * 2] __attribute__((aligned(64)));  /* block_size < 16 */
    size_t voff[CHUNK];
    /* key range of each row: [lo, pos] */
    int lo_all = INT32_MAX, hi_all = -1;
    for (int r = 0; r < R; r++) {
        int pos = context_len + it->t0 + r / G;
        int lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        lo_r[r] = lo, hi_r[r] = pos;
        lo_all = lo < lo_all ? lo : lo_all;
        hi_all = pos > hi_all ? pos : hi_all;
    }
    int first = lo_all & ~(CHUNK - 1);
    int nchunks = (hi_all - first) / CHUNK + 1;
    const vf lane = LANE_INDEX;
    for (int h = it->h0; h < it->h1; h++) {
        for (int r = 0; r < R; r++) {
            size_t qrow = (size_t)(q_start + it->t0 + r / G) * q_stride + ((size_t)h * G + r % G) * D;
            if (packed_q) memcpy(qbuf[r], (const uint16_t *)q + qrow, D * 2);
            else for (int d = 0; d < D; d++) qbuf[r][d] = ld1(q, dt, qrow + d);
            for (int d = 0; d < D; d++) acc[r][d] = 0.f;
            mx[r] = -INFINITY, den[r] = (vf){0};
        }
        for (int c = 0; c < nchunks; c++) {
            int j0 = first + c * CHUNK;
            /* the chunk PREFETCH_CHUNKS ahead (of this head, then of the next) while this one runs */
            if (bs >= CHUNK)
                for (int a = c ? c + PREFETCH_CHUNKS : 1, hh = h; a <= c + PREFETCH_CHUNKS; a++) {
                    int ca = a - (hh - h) * nchunks;  /* chunk index within head hh */
                    while (ca >= nchunks) ca -= nchunks, hh++;
                    if (hh >= it->h1) break;
                    prefetch_chunk(k_cache, v_cache, es, table, first + ca * CHUNK, hh, KVH, D, bs, bsh, x);
                }
            int ja = lo_all > j0 ? lo_all - j0 : 0;
            int jb = hi_all + 1 - j0 < CHUNK ? hi_all + 1 - j0 : CHUNK;
            const void *kt;
            size_t kstride;
            if (bs >= CHUNK) {  /* the chunk lies in one block: its packed rows in place */
                size_t tile = ((size_t)table[j0 >> bsh] * KVH + h) * bs * D, o = (size_t)(j0 & (bs - 1));
                kt = (const char *)k_cache + (tile + o * x) * es;
                kstride = (size_t)bs;  /* floats or 32-bit pairs per packed row */
                for (int j = ja; j < jb; j++) voff[j] = tile + (o + j) * D;
            } else {  /* small blocks: gather the chunk's packed keys */
                memset(kgather, 0, sizeof(uint32_t) * (size_t)(D / x) * CHUNK);
                for (int j = ja; j < jb; j++) {
                    int key = j0 + j;
                    size_t tile = ((size_t)table[key >> bsh] * KVH + h) * bs * D, o = (size_t)(key & (bs - 1));
                    voff[j] = tile + o * D;
                    for (int d = 0; d < D / x; d++) {
                        if (dt == F32) kgather[d * CHUNK + j] = ((const uint32_t *)k_cache)[tile + (size_t)d * bs + o];
                        else kgather[d * CHUNK + j] = ((const uint32_t *)((const uint16_t *)k_cache + tile))[(size_t)d * bs + o];
                    }
                }
                kt = kgather;
                kstride = CHUNK;
            }
            vf kpos = lane + (float)j0;
            for (int r0 = 0; r0 < R; r0 += 4) {
                int nr = R - r0 < 4 ? R - r0 : 4;
                vf s[4];
                switch (nr) {
                case 1: qk_rows(kt, kstride, qbuf[r0], 1, D, dt, s); break;
                case 2: qk_rows(kt, kstride, qbuf[r0], 2, D, dt, s); break;
                case 3: qk_rows(kt, kstride, qbuf[r0], 3, D, dt, s); break;
                default: qk_rows(kt, kstride, qbuf[r0], 4, D, dt, s); break;
                }
                for (int i = 0; i < nr; i++) {
                    int r = r0 + i;
                    /* lanes outside the row's keys (causal edge, window start): only at the edges */
                    int edge = j0 < lo_r[r] || j0 + CHUNK - 1 > hi_r[r];
                    vu ok = (vu){0};
                    vf sc = s[i] * scale;
                    if (edge) {
                        ok = (vu)(kpos >= (float)lo_r[r]) & (vu)(kpos <= (float)hi_r[r]);
                        sc = vsel(ok, sc, (vf){0} - INFINITY);
                    }
                    /* Lazy rescaling: the exponent offset moves only when a score passes it by
                     * more than LAZY_MAX, so most chunks need no horizontal max (p <= e^8). */
                    if (any_gt(sc, mx[r] + LAZY_MAX)) {
                        float mnew = hmax(sc);  /* > mx[r] */
                        float alpha = expf(mx[r] - mnew);  /* 0 on the first chunk (max -inf) */
                        den[r] *= alpha;
                        int d = 0;
                        for (; d + VL <= D; d += VL) *(vfu *)&acc[r][d] *= alpha;
                        for (; d < D; d++) acc[r][d] *= alpha;
                        mx[r] = mnew;
                    } else if (mx[r] == -INFINITY) {  /* no key visible to this row yet */
                        *(vfu *)p[r] = (vf){0};
                        continue;
                    }
                    vf pr = vexp(sc - mx[r]);
                    if (edge) pr = vsel(ok, pr, (vf){0});
                    den[r] += pr;
                    *(vfu *)p[r] = pr;
                }
            }
            for (int r0 = 0; r0 < R; r0 += 4) {
                int nr = R - r0 < 4 ? R - r0 : 4;
                switch (nr) {
                case 1: pv_rows(v_cache, dt, voff, ja, jb, &p[r0], &acc[r0], 1, D); break;
                case 2: pv_rows(v_cache, dt, voff, ja, jb, &p[r0], &acc[r0], 2, D); break;
                case 3: pv_rows(v_cache, dt, voff, ja, jb, &p[r0], &acc[r0], 3, D); break;
                default: pv_rows(v_cache, dt, voff, ja, jb, &p[r0], &acc[r0], 4, D); break;
                }
            }
        }
        for (int r = 0; r < R; r++) {
            size_t orow = (size_t)(q_start + it->t0 + r / G) * out_stride + ((size_t)h * G + r % G) * D;
            float inv = 1.f / hsum(den[r]);
            for (int d = 0; d < D; d++) st1(out, dt, orow + d, acc[r][d] * inv);
        }
    }
}

#define ATTEND_ARGS const Item *it, const void *q, int64_t q_stride, const void *k_cache, \
    const void *v_cache, const int32_t *table, int context_len, int q_start, void *out, \
    int64_t out_stride, int H, int KVH, int D, int block_size, float scale, int window
#define ATTEND_PASS(DT) it, q, q_stride, k_cache, v_cache, DT, table, context_len, q_start, out, \
    out_stride, H, KVH, D, block_size, scale, window

static void attend_f32(ATTEND_ARGS) { attend(ATTEND_PASS(F32)); }
static void attend_bf16(ATTEND_ARGS) { attend(ATTEND_PASS(BF16)); }

/* Returns 0, or -1 for an unsupported shape (head size > 256, an odd head size in bfloat16, more
 * than 64 query heads per KV head, a block size that is not a power of two), -2 when out of
 * memory. Sequences: query tokens
 * [query_start_loc[s], query_start_loc[s + 1]) attend to positions [0, seq_lens[s]) through
 * block_tables[s]. Work items: a tile of query tokens (as many as keep tokens x query heads per
 * KV head within MAX_ROWS, at most 16) x every KV head of the sequence when there are enough
 * tiles for the threads, else one KV head each. */
int omni_paged_attention(const void *q, int64_t q_stride, const void *key, int64_t key_stride,
                         const void *value, int64_t value_stride, const int64_t *slot_mapping,
                         int num_tokens, void *k_cache, void *v_cache, const int32_t *block_tables,
                         int64_t table_stride, const int32_t *query_start_loc,
                         const int32_t *seq_lens, int num_seqs, void *out, int64_t out_stride,
                         int H, int KVH, int D, int block_size, float scale, int window, int dt,
                         int nthreads) {
    void (*run)(ATTEND_ARGS) = dt == F32 ? attend_f32 : attend_bf16;
    int G = H / KVH;
    if (D > MAX_HEAD || G > MAX_ROWS || (dt == BF16 && D % 2) || block_size < 1 ||
        (block_size & (block_size - 1)))
        return -1;
    write_kv(key, key_stride, value, value_stride, k_cache, v_cache, dt, slot_mapping, num_tokens,
             KVH, D, block_size);
    int qtile = MAX_ROWS / G < 16 ? MAX_ROWS / G : 16;
    int num_tiles = 0;
    for (int s = 0; s < num_seqs; s++)
        num_tiles += (query_start_loc[s + 1] - query_start_loc[s] + qtile - 1) / qtile;
#ifndef MIN_TILES
#define MIN_TILES 4
#endif
    int heads = num_tiles >= MIN_TILES * nthreads ? KVH : 1;  /* KV heads per item */
    int per_tile = (KVH + heads - 1) / heads;
    Item *items = malloc(sizeof(Item) * (num_tiles * per_tile > 0 ? num_tiles * per_tile : 1));
    if (!items) return -2;
    int n = 0;
    for (int s = 0; s < num_seqs; s++) {
        int len = query_start_loc[s + 1] - query_start_loc[s];
        for (int t0 = 0; t0 < len; t0 += qtile)
            for (int h = 0; h < KVH; h += heads)
                items[n++] = (Item){s, h, h + heads < KVH ? h + heads : KVH, t0,
                                    t0 + qtile < len ? t0 + qtile : len};
    }
    (void)nthreads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int i = 0; i < n; i++) {
        const Item *it = &items[i];
        int s = it->seq;
        int q_len = query_start_loc[s + 1] - query_start_loc[s];
        run(it, q, q_stride, k_cache, v_cache, block_tables + (size_t)s * table_stride,
            seq_lens[s] - q_len, query_start_loc[s], out, out_stride, H, KVH, D, block_size, scale,
            window);
    }
    free(items);
    return 0;
}

/* ---- elementwise pieces of a decoder layer ------------------------------------------------- */

#define ROWS_PER_THREAD_MIN 16  /* below 16 rows one thread does it all */
#define PARALLEL_ROWS(T) num_threads((T) >= 2 * ROWS_PER_THREAD_MIN ? nthreads : 1)

/* out = weight * normalize(x) (RMS in float32, as transformers); with residual: x + residual
 * first, which is also written to residual_out. The normalized value is rounded to the dtype
 * before the weight multiplies it, as transformers does. */
INLINE void rms_norm_row(const void *x, const void *res, void *res_out, const void *weight,
                         void *out, int H, float eps, int dt) {
    vf ss = (vf){0};
    int i = 0;
    for (; i + VL <= H; i += VL) {
        vf v = ld(x, dt, i);
        if (res) {
            v += ld(res, dt, i);
            stv(res_out, dt, i, v);
            v = ld(res_out, dt, i);  /* the rounded sum, as the dtype holds it */
        }
        ss += v * v;
    }
    float sum = hsum(ss);
    for (; i < H; i++) {
        float v = ld1(x, dt, i);
        if (res) {
            v = round_to(dt, v + ld1(res, dt, i));
            st1(res_out, dt, i, v);
        }
        sum += v * v;
    }
    const void *src = res ? res_out : x;
    float r = 1.f / sqrtf(sum / H + eps);
    for (i = 0; i + VL <= H; i += VL) {
        vf n = ld(src, dt, i) * r;
        if (dt == BF16) {
            stv(out, dt, i, n);
            n = ld(out, dt, i);
        }
        stv(out, dt, i, n * ld(weight, dt, i));
    }
    for (; i < H; i++) st1(out, dt, i, round_to(dt, ld1(src, dt, i) * r) * ld1(weight, dt, i));
}

static void rms_norm_f32(const void *x, const void *r, void *ro, const void *w, void *o, int H, float e) {
    rms_norm_row(x, r, ro, w, o, H, e, F32);
}

static void rms_norm_bf16(const void *x, const void *r, void *ro, const void *w, void *o, int H, float e) {
    rms_norm_row(x, r, ro, w, o, H, e, BF16);
}

/* rows of T x H, contiguous rows of H (residual and residual_out may be NULL) */
void omni_rms_norm(const void *x, const void *residual, void *residual_out, const void *weight,
                   void *out, int T, int H, float eps, int dt, int nthreads) {
    void (*row)(const void *, const void *, void *, const void *, void *, int, float) =
        dt == F32 ? rms_norm_f32 : rms_norm_bf16;
    size_t es = dt == F32 ? 4 : 2, n = (size_t)H * es;
    (void)nthreads;
#pragma omp parallel for schedule(static) PARALLEL_ROWS(T)
    for (int t = 0; t < T; t++)
        row((const char *)x + t * n, residual ? (const char *)residual + t * n : NULL,
            residual_out ? (char *)residual_out + t * n : NULL, weight, (char *)out + t * n, H, eps);
}

/* GPT-NeoX rotary ("rotate half"), in place: each head's first and second halves (x1, x2) become
 * (x1 cos - x2 sin, x2 cos + x1 sin). cos/sin: float32 [max_position, head_size / 2]; in bfloat16
 * they and each product are rounded as the torch path does. Query/key rows: `stride` elements
 * apart. */
INLINE void rotate_heads(void *x, size_t base, int heads, int D, const float *c, const float *s,
                         int dt) {
    int half = D / 2;
    for (int h = 0; h < heads; h++) {
        size_t o = base + (size_t)h * D;
        int i = 0;
        for (; i + VL <= half; i += VL) {
            vf x1 = ld(x, dt, o + i), x2 = ld(x, dt, o + half + i);
            vf cv = *(const vfu *)(c + i), sv = *(const vfu *)(s + i);
            if (dt == F32) {
                stv(x, dt, o + i, x1 * cv - x2 * sv);
                stv(x, dt, o + half + i, x2 * cv + x1 * sv);
            } else {
                cv = vround_bf16(cv), sv = vround_bf16(sv);
                stv(x, dt, o + i, vround_bf16(x1 * cv) - vround_bf16(x2 * sv));
                stv(x, dt, o + half + i, vround_bf16(x2 * cv) + vround_bf16(x1 * sv));
            }
        }
        for (; i < half; i++) {
            float x1 = ld1(x, dt, o + i), x2 = ld1(x, dt, o + half + i);
            float cv = round_to(dt, c[i]), sv = round_to(dt, s[i]);  /* each product rounded, */
            st1(x, dt, o + i, round_to(dt, x1 * cv) - round_to(dt, x2 * sv));  /* as torch does */
            st1(x, dt, o + half + i, round_to(dt, x2 * cv) + round_to(dt, x1 * sv));
        }
    }
}

/* Returns 0, or -1 (nothing done) when a position is outside the table's max_position rows. */
int omni_rotary(void *q, int64_t q_stride, void *k, int64_t k_stride, const int64_t *positions,
                const float *cos, const float *sin, int max_position, int T, int num_heads,
                int num_kv_heads, int D, int dt, int nthreads) {
    int half = D / 2;
    for (int t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return -1;
    (void)nthreads;
#pragma omp parallel for schedule(static) PARALLEL_ROWS(T)
    for (int t = 0; t < T; t++) {
        const float *c = cos + (size_t)positions[t] * half, *s = sin + (size_t)positions[t] * half;
        if (dt == F32) {
            rotate_heads(q, (size_t)t * q_stride, num_heads, D, c, s, F32);
            rotate_heads(k, (size_t)t * k_stride, num_kv_heads, D, c, s, F32);
        } else {
            rotate_heads(q, (size_t)t * q_stride, num_heads, D, c, s, BF16);
            rotate_heads(k, (size_t)t * k_stride, num_kv_heads, D, c, s, BF16);
        }
    }
    return 0;
}

/* out[T, I] = silu(x[:, :I]) * x[:, I:] for x [T, 2I] (silu rounded to the dtype first) */
INLINE void silu_mul_row(const void *x, void *out, int I, int dt) {
    int i = 0;
    for (; i + VL <= I; i += VL) {
        vf g = ld(x, dt, i), u = ld(x, dt, I + i);
        vf a = g / (1.0f + vexp(-g));
        if (dt == BF16) {
            stv(out, dt, i, a);
            a = ld(out, dt, i);
        }
        stv(out, dt, i, a * u);
    }
    for (; i < I; i++) {
        float g = ld1(x, dt, i);
        st1(out, dt, i, round_to(dt, g / (1.f + expf(-g))) * ld1(x, dt, I + i));
    }
}

static void silu_mul_f32(const void *x, void *o, int I) { silu_mul_row(x, o, I, F32); }
static void silu_mul_bf16(const void *x, void *o, int I) { silu_mul_row(x, o, I, BF16); }

void omni_silu_and_mul(const void *x, void *out, int T, int I, int dt, int nthreads) {
    void (*row)(const void *, void *, int) = dt == F32 ? silu_mul_f32 : silu_mul_bf16;
    size_t es = dt == F32 ? 4 : 2;
    (void)nthreads;
#pragma omp parallel for schedule(static) PARALLEL_ROWS(T)
    for (int t = 0; t < T; t++) row((const char *)x + (size_t)t * 2 * I * es, (char *)out + (size_t)t * I * es, I);
}

/* ---- greedy sampling ------------------------------------------------------------------------ */

static int64_t first_nan(const void *x, int cols, int dt) {
    for (int i = 0; i < cols; i++) {
        float v = ld1(x, dt, i);
        if (v != v) return i;
    }
    return 0;
}

/* The index of the first maximum of one row, as torch.argmax (a NaN counts as the maximum, so
 * the first NaN wins). ARGMAX_U independent (max, index) vectors take every U-th vector of the
 * row, so the compare-and-select chains overlap (one chain waits ~4 cycles a vector); each lane
 * keeps its first maximum, and the lanes then tie-break on the index. */
#define ARGMAX_U 4
static int64_t argmax_row(const void *x, int cols, int dt) {
    const vf lane = LANE_INDEX;
    vf m[ARGMAX_U], idx[ARGMAX_U], at[ARGMAX_U];  /* indices as floats: exact < 2^24 */
    vu nan = (vu){0};
#pragma GCC unroll 4
    for (int u = 0; u < ARGMAX_U; u++)
        m[u] = (vf){0} - INFINITY, idx[u] = (vf){0} - 1, at[u] = lane + (float)(u * VL);
    int i = 0;
    for (; i + ARGMAX_U * VL <= cols; i += ARGMAX_U * VL) {
#pragma GCC unroll 4
        for (int u = 0; u < ARGMAX_U; u++) {
            vf v = ld(x, dt, i + u * VL);
            vu gt = (vu)(v > m[u]);
            m[u] = vsel(gt, v, m[u]);
            idx[u] = vsel(gt, at[u], idx[u]);
            nan |= (vu)(v != v);
            at[u] += (float)(ARGMAX_U * VL);
        }
    }
    for (; i + VL <= cols; i += VL) {
        vf v = ld(x, dt, i), pos = lane + (float)i;
        vu gt = (vu)(v > m[0]);
        m[0] = vsel(gt, v, m[0]);
        idx[0] = vsel(gt, pos, idx[0]);
        nan |= (vu)(v != v);
    }
    for (int l = 0; l < VL; l++)
        if (nan[l]) return first_nan(x, cols, dt);
    float best = ld1(x, dt, 0);
    int64_t arg = 0;
    for (int u = 0; u < ARGMAX_U; u++)
        for (int l = 0; l < VL; l++)
            if (idx[u][l] >= 0 && (m[u][l] > best || (m[u][l] == best && (int64_t)idx[u][l] < arg)))
                best = m[u][l], arg = (int64_t)idx[u][l];
    for (; i < cols; i++) {
        float v = ld1(x, dt, i);
        if (v != v) return first_nan(x, cols, dt);
        if (v > best) best = v, arg = i;
    }
    return arg;
}

/* out[r] = argmax of row r of x[rows, cols] (row stride ld elements); cols >= 1 */
void omni_argmax(const void *x, int64_t ld, int rows, int cols, int dt, int64_t *out, int nthreads) {
    size_t es = dt == F32 ? 4 : 2;
    (void)nthreads;
#pragma omp parallel for schedule(static) num_threads(rows >= 2 * 4 ? nthreads : 1)
    for (int r = 0; r < rows; r++) out[r] = argmax_row((const char *)x + (size_t)r * ld * es, cols, dt);
}

/* ---- products for batches of a few to a few hundred rows ------------------------------------
 * y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with W packed once, at load, by omni_gemm_pack into
 * panels of GEMM_NR = GEMM_NV vectors of columns (64 columns on AVX-512, 16 on AVX2 and NEON):
 *   float32:  [P][K][NR], multiplied by one broadcast component of x;
 *   bfloat16 with vdpbf16ps (AVX-512 BF16): [P][K / 2][NR][2], each column's weights for
 *             components 2j and 2j + 1 side by side, which vdpbf16ps multiplies by one broadcast
 *             pair of x;
 *   bfloat16 elsewhere: [P][K][NR], the columns of each pair of vectors interleaved (32-bit word
 *             i holds column i in its low half and column VL + i in its high half), so a shift
 *             and a mask widen 2 VL weights to float32; x is widened once, before the products,
 *             and the products are float32 FMAs (no CPU without AVX-512 BF16 multiplies bfloat16).
 * A tile of up to GEMM_MR rows x NR columns keeps its MR x NV sums in registers over all of K
 * (6 x 4 of AVX-512's and NEON's 32 registers, 6 x 2 of AVX2's 16). Each thread takes a
 * contiguous range of panels; rows go by in chunks of GEMM_MC, so a thread's weights are read from
 * L2 once per chunk. Sums in float32, each result rounded once (+ bias first), as oneDNN does.
 *
 * "Gated" packs a gate_up weight [2I, K] (gate rows, then up rows) so that panel p holds gate
 * columns NR/2 p .. in its first NV / 2 vectors and the same up columns in the last NV / 2; the
 * tile then writes silu(gate) * up [M, I] directly, rounding (bfloat16) gate, up and silu(gate)
 * on the way as the separate product and omni_silu_and_mul do, so the result is the same bits.
 * Built at every level (omni_gemm_supported). */

/* ---- torch.argmax's order over columns seen in increasing order, split among threads ------ */

/* take column c's value x into a running first maximum (col < 0: none yet): only a greater value
 * or a first NaN replaces it, so the first maximum stays, a NaN the greatest */
INLINE void argmax_take(float *best, int32_t *col, float x, int64_t c) {
    float b = *best;
    if (*col < 0 || x > b || (x != x && b == b)) *best = x, *col = (int32_t)c;
}

/* The first maximum of row r over every thread's running one ([nthreads, M] each; threads hold
 * disjoint columns): a NaN above all, the first column among equals. -1 when none. */
static int64_t argmax_merge(const float *best, const int32_t *best_col, int M, int nthreads, int r) {
    int64_t arg = -1;
    float top = 0.f;
    int top_nan = 0;
    for (int t = 0; t < nthreads; t++) {
        size_t at = (size_t)t * M + r;
        int64_t c = best_col[at];
        float v = best[at];
        int is_nan = v != v;
        if (c < 0) continue;
        if (arg < 0 || (is_nan && (!top_nan || c < arg)) ||
            (!is_nan && !top_nan && (v > top || (v == top && c < arg))))
            arg = c, top = v, top_nan = is_nan;
    }
    return arg;
}

#if NREGS >= 32
#define GEMM_NV 4
#else
#define GEMM_NV 2
#endif
#define GEMM_NR (GEMM_NV * VL)
#define GEMM_MR 6
#define GEMM_MC 120
#if defined(__AVX512BF16__)
#define GEMM_BF16_PAIRS 1
#else
#define GEMM_BF16_PAIRS 0
#endif

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

typedef struct {
    const void *x, *bias;
    const float *xf;  /* x as float32 (x itself, or its widened copy) for the FMA tiles */
    void *y;
    int64_t ldx, ldxf, ldy;
    int K, N, gated;
    /* argmax instead of y: this thread's first maximum so far of each row and its column (-1:
     * none yet) */
    float *best;
    int32_t *best_col;
} gemm_args;

#if defined(__AVX512F__)
INLINE __mmask16 lanes_mask(int n_valid) {
    return n_valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n_valid) - 1);
}
#endif

INLINE vf bias_lanes(const gemm_args *g, int dt, int64_t col0, int n_valid) {  /* VL columns */
    if (!g->bias || n_valid <= 0) return (vf){0};
    if (n_valid >= VL) return ld(g->bias, dt, col0);
#if defined(__AVX512F__)
    if (dt == F32) return (vf)_mm512_maskz_loadu_ps(lanes_mask(n_valid), (const float *)g->bias + col0);
    __m256i h = _mm256_maskz_loadu_epi16(lanes_mask(n_valid), (const uint16_t *)g->bias + col0);
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
    float lanes[VL] = {0};
    for (int l = 0; l < n_valid; l++) lanes[l] = ld1(g->bias, dt, col0 + l);
    return *(const vfu *)lanes;
#endif
}

INLINE void store_lanes(void *y, int dt, int64_t at, int n_valid, vf v) {
    if (n_valid <= 0) return;
    if (n_valid >= VL) {
        stv(y, dt, at, v);
        return;
    }
#if defined(__AVX512F__)
    if (dt == F32) {
        _mm512_mask_storeu_ps((float *)y + at, lanes_mask(n_valid), (__m512)v);
        return;
    }
#endif
#if defined(__AVX512BF16__)
    __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)v);
    _mm256_mask_storeu_epi16((uint16_t *)y + at, lanes_mask(n_valid), h);
#else
    if (dt == F32) {
        float lanes[VL];
        *(vfu *)lanes = v;
        memcpy((float *)y + at, lanes, sizeof(float) * (size_t)n_valid);
        return;
    }
    uint16_t out[VL];  /* stv's rounding, then only the valid lanes */
    stv(out, BF16, 0, v);
    memcpy((uint16_t *)y + at, out, sizeof(uint16_t) * (size_t)n_valid);
#endif
}

/* some of the first n_valid lanes of v is greater than top, or unordered (a NaN on either side) */
INLINE int any_above(vf v, float top, int n_valid) {
    if (n_valid <= 0) return 0;
#if defined(__AVX512F__)
    return _mm512_mask_cmp_ps_mask(lanes_mask(n_valid), (__m512)v, _mm512_set1_ps(top), _CMP_NLE_UQ) != 0;
#elif defined(__AVX2__)
    int bits = _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_set1_ps(top), _CMP_NLE_UQ));
    return (bits & (n_valid >= VL ? 0xff : (1 << n_valid) - 1)) != 0;
#else
    for (int l = 0; l < VL && l < n_valid; l++)
        if (!(v[l] <= top)) return 1;
    return 0;
#endif
}

/* The tile's results into the rows' running maxima. A row's NR values are first compared, as
 * they come out of the sums, with its maximum so far: rounding cannot lift a value that is not
 * above a (rounded) maximum over it, so only a row with a value above it, a NaN, or no maximum
 * yet goes on to the column by column pass, with each value as the product would store it
 * (bfloat16: rounded). A thread visits a row's columns in increasing order, so taking only
 * greater values (or a first NaN) keeps the first maximum, as torch.argmax. */
INLINE void gemm_argmax_tile(const gemm_args *g, int dt, int m, int MR, int64_t c0,
                              vf acc[][GEMM_NV], const vf *bias) {
    int n = g->N - c0 < GEMM_NR ? (int)(g->N - c0) : GEMM_NR;
    for (int r = 0; r < MR; r++) {
        float *best = g->best + m + r;
        int32_t *col = g->best_col + m + r;
        int above = 0;
        for (int v = 0; v < GEMM_NV; v++) above |= any_above(acc[r][v] + bias[v], *best, n - VL * v);
        if (!above && *col >= 0) continue;
        float vals[GEMM_NR];
        for (int v = 0; v < GEMM_NV; v++) {  /* as store_lanes rounds them */
            vf val = acc[r][v] + bias[v];
            *(vfu *)(vals + VL * v) = dt == BF16 ? vround_bf16(val) : val;
        }
        for (int c = 0; c < n; c++) argmax_take(best, col, vals[c], c0 + c);
    }
}

/* the tile's results: plain columns p * NR .. (or their rows' running maxima), or gated columns
 * p * NR / 2 .. of silu(gate) * up */
INLINE void gemm_store(const gemm_args *g, int dt, int m, int MR, int64_t p, vf acc[][GEMM_NV]) {
    vf bias[GEMM_NV];
    if (!g->gated) {
        int64_t c0 = p * GEMM_NR;
        for (int v = 0; v < GEMM_NV; v++) bias[v] = bias_lanes(g, dt, c0 + VL * v, (int)(g->N - c0 - VL * v));
        if (g->best) {
            gemm_argmax_tile(g, dt, m, MR, c0, acc, bias);
            return;
        }
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < GEMM_NV; v++)
                store_lanes(g->y, dt, (m + r) * g->ldy + c0 + VL * v, (int)(g->N - c0 - VL * v),
                            acc[r][v] + bias[v]);
        return;
    }
    enum { H = GEMM_NV / 2 };
    int64_t half = g->N / 2, c0 = p * (GEMM_NR / 2);
    for (int v = 0; v < H; v++) {
        bias[v] = bias_lanes(g, dt, c0 + VL * v, (int)(half - c0 - VL * v));
        bias[v + H] = bias_lanes(g, dt, half + c0 + VL * v, (int)(half - c0 - VL * v));
    }
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < H; v++) {
            vf gate = acc[r][v] + bias[v], up = acc[r][v + H] + bias[v + H];
            if (dt == BF16) gate = vround_bf16(gate), up = vround_bf16(up);
            vf a = gate / (1.0f + vexp(-gate));
            if (dt == BF16) a = vround_bf16(a);
            store_lanes(g->y, dt, (m + r) * g->ldy + c0 + VL * v, (int)(half - c0 - VL * v), a * up);
        }
}

/* one packed row of the panel (k) as NV float32 vectors */
INLINE void gemm_load_f32(const void *panel, int k, vf *b) {
    const float *row = (const float *)panel + (int64_t)k * GEMM_NR;
#pragma GCC unroll 4
    for (int v = 0; v < GEMM_NV; v++) b[v] = *(const vfu *)(row + VL * v);
}

INLINE void gemm_load_bf16(const void *panel, int k, vf *b) {  /* the interleaved layout */
    const uint16_t *row = (const uint16_t *)panel + (int64_t)k * GEMM_NR;
#pragma GCC unroll 2
    for (int v = 0; v < GEMM_NV / 2; v++) {
        vu w = *(const vuu *)(row + 2 * VL * v);
        b[2 * v] = (vf)(w << 16), b[2 * v + 1] = (vf)(w & 0xffff0000u);
    }
}

/* rows m .. m + MR - 1 of the float32 x (xf), panel p (its packed weights, loaded by LOAD) */
#define GEMM_TILE(NAME, LOAD, DT, MR)                                                              \
static void gemm_tile_##NAME##_##MR(const gemm_args *g, int m, int64_t p, const void *panel) {     \
    vf acc[MR][GEMM_NV];                                                                           \
    for (int r = 0; r < MR; r++)                                                                   \
        for (int v = 0; v < GEMM_NV; v++) acc[r][v] = (vf){0};                                     \
    const float *x = g->xf + m * g->ldxf;                                                          \
    for (int k = 0; k < g->K; k++) {                                                               \
        vf b[GEMM_NV];                                                                             \
        LOAD(panel, k, b);                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                     \
            float a = x[r * g->ldxf + k];  /* (a scalar times a vector: one broadcast load) */     \
            _Pragma("GCC unroll 4") for (int v = 0; v < GEMM_NV; v++) acc[r][v] += a * b[v];       \
        }                                                                                          \
    }                                                                                              \
    gemm_store(g, DT, m, MR, p, acc);                                                              \
}
#define GEMM_TILES(NAME, LOAD, DT)                                                                 \
    GEMM_TILE(NAME, LOAD, DT, 1) GEMM_TILE(NAME, LOAD, DT, 2) GEMM_TILE(NAME, LOAD, DT, 3)         \
    GEMM_TILE(NAME, LOAD, DT, 4) GEMM_TILE(NAME, LOAD, DT, 5) GEMM_TILE(NAME, LOAD, DT, 6)
typedef void (*gemm_tile_fn)(const gemm_args *, int, int64_t, const void *);
#define GEMM_TILE_TABLE(NAME) {0, gemm_tile_##NAME##_1, gemm_tile_##NAME##_2, gemm_tile_##NAME##_3, \
    gemm_tile_##NAME##_4, gemm_tile_##NAME##_5, gemm_tile_##NAME##_6}

GEMM_TILES(f32, gemm_load_f32, F32)
static const gemm_tile_fn GEMM_TILES_F32[GEMM_MR + 1] = GEMM_TILE_TABLE(f32);

#if GEMM_BF16_PAIRS
/* bfloat16 x rows (pairs broadcast) against pairs of bfloat16 weights, vdpbf16ps */
#define GEMM_TILE_PAIRS(MR)                                                                        \
static void gemm_tile_bf16_##MR(const gemm_args *g, int m, int64_t p, const void *panel) {         \
    vf acc[MR][GEMM_NV];                                                                           \
    for (int r = 0; r < MR; r++)                                                                   \
        for (int v = 0; v < GEMM_NV; v++) acc[r][v] = (vf){0};                                     \
    const uint16_t *x = (const uint16_t *)g->x + m * g->ldx, *B = panel;                           \
    for (int j = 0; j < g->K / 2; j++) {                                                           \
        const __m512bh *b = (const __m512bh *)(B + (int64_t)j * GEMM_NR * 2);                      \
        __m512bh b0 = b[0], b1 = b[1], b2 = b[2], b3 = b[3];                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                     \
            int32_t pair;                                                                          \
            memcpy(&pair, x + r * g->ldx + 2 * j, 4);                                              \
            __m512bh a = (__m512bh)_mm512_set1_epi32(pair);                                        \
            acc[r][0] = (vf)_mm512_dpbf16_ps((__m512)acc[r][0], a, b0);                            \
            acc[r][1] = (vf)_mm512_dpbf16_ps((__m512)acc[r][1], a, b1);                            \
            acc[r][2] = (vf)_mm512_dpbf16_ps((__m512)acc[r][2], a, b2);                            \
            acc[r][3] = (vf)_mm512_dpbf16_ps((__m512)acc[r][3], a, b3);                            \
        }                                                                                          \
    }                                                                                              \
    gemm_store(g, BF16, m, MR, p, acc);                                                            \
}
GEMM_TILE_PAIRS(1) GEMM_TILE_PAIRS(2) GEMM_TILE_PAIRS(3) GEMM_TILE_PAIRS(4) GEMM_TILE_PAIRS(5)
GEMM_TILE_PAIRS(6)
#else
GEMM_TILES(bf16, gemm_load_bf16, BF16)
#endif
static const gemm_tile_fn GEMM_TILES_BF16[GEMM_MR + 1] = GEMM_TILE_TABLE(bf16);

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

/* ---- a stack of decoder layers in one call --------------------------------------------------- */
/* One pre-norm Llama layer (decoder_stack.py builds these from the model's DecoderLayerSpec):
 *   h = x + o(attention(rotary(qkv(norm(x)))));  x' = h + down(silu(gate) * up), gate|up = gate_up(norm(h))
 * Each product with `*_packed` set (omni_gemm_pack; gate_up packed gated) runs omni_gemm above
 * `kernel_rows` rows; up to there omni_linear on the [out, in] weight, or omni_linear_ec on its
 * coded copy where `*_ec` is set. */
typedef struct {
    const void *input_norm, *qkv, *qkv_packed, *qkv_ec, *qkv_bias, *o, *o_packed, *o_ec, *o_bias,
        *post_norm, *gate_up, *gate_up_packed, *gate_up_ec, *gate_up_bias, *down, *down_packed,
        *down_ec, *down_bias;
    void *k_cache, *v_cache;
    const float *cos, *sin;  /* float32 [max_position, head_size / 2] */
    float input_eps, post_eps, scale;
    int hidden, num_heads, num_kv_heads, head_size, intermediate, block_size, window, max_position;
} omni_layer;

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

/* Runs `num_layers` layers over T tokens, as the model's layers one by one would, call for call
 * (the same kernels, in the same order, on the same rows: bit for bit the same result).
 * hidden [T, H] (in: the layers' input; out: the last down product) and residual [T, H] (in: the
 * running residual when has_residual, else nothing; out: the residual the model's final norm
 * adds). The attention arguments are omni_paged_attention's, the same for every layer. work:
 * T * (H + QKV + heads * head + 3 * intermediate) elements (QKV = (heads + 2 kv_heads) * head).
 * Returns 0; -1 attention refused the shapes, -2 out of memory, -3 a position outside the rotary
 * table (before anything is written), -4 more than kernel_rows rows without a packed weight. */
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
        int rc;
        if (i == 0 && !has_residual)
            omni_rms_norm(hidden, NULL, NULL, L->input_norm, normed, T, H, L->input_eps, dt, nthreads);
        else
            omni_rms_norm(hidden, residual, residual, L->input_norm, normed, T, H, L->input_eps, dt,
                          nthreads);
        if ((rc = stack_linear(normed, L->qkv, L->qkv_packed, L->qkv_ec, L->qkv_bias, qkv, T, QKV,
                               H, 0, kernel_rows, dt, nthreads)))
            return rc;
        if (omni_rotary(qkv, QKV, qkv + (size_t)q_size * es, QKV, positions, L->cos, L->sin,
                        L->max_position, T, L->num_heads, L->num_kv_heads, D, dt, nthreads))
            return -3;
        if ((rc = omni_paged_attention(qkv, QKV, qkv + (size_t)q_size * es, QKV,
                                       qkv + (size_t)(q_size + kv_size) * es, QKV, slot_mapping, T,
                                       L->k_cache, L->v_cache, block_tables, table_stride,
                                       query_start_loc, seq_lens, num_seqs, att, q_size,
                                       L->num_heads, L->num_kv_heads, D, L->block_size, L->scale,
                                       L->window, dt, nthreads)))
            return rc;
        if ((rc = stack_linear(att, L->o, L->o_packed, L->o_ec, L->o_bias, hidden, T, H, q_size,
                               0, kernel_rows, dt, nthreads)))
            return rc;
        omni_rms_norm(hidden, residual, residual, L->post_norm, normed, T, H, L->post_eps, dt, nthreads);
        if (T <= kernel_rows) {
            kernel_linear(normed, L->gate_up, L->gate_up_ec, L->gate_up_bias, gate_up, T, 2 * I, H,
                          dt, nthreads);
            omni_silu_and_mul(gate_up, act, T, I, dt, nthreads);
        } else if ((rc = stack_linear(normed, L->gate_up, L->gate_up_packed, L->gate_up_ec,
                                      L->gate_up_bias, act, T, 2 * I, H, 1, kernel_rows, dt,
                                      nthreads))) {
            return rc;
        }
        if ((rc = stack_linear(act, L->down, L->down_packed, L->down_ec, L->down_bias, hidden, T, H,
                               I, 0, kernel_rows, dt, nthreads)))
            return rc;
    }
    return 0;
}

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

INLINE vf q8_load(const int8_t *p) {  /* VL int8 as floats */
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#elif defined(__aarch64__) && defined(__ARM_NEON)
    int32_t four;
    memcpy(&four, p, 4);
    int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four)));
    return (vf)vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
#else
    typedef int8_t vqc __attribute__((vector_size(VL), aligned(1)));
    return __builtin_convertvector(*(const vqc *)p, vf);
#endif
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
    int linear_threads = (int64_t)N * K < 32768 ? 1 : nthreads;
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
                    a0 += q8_load(qr + k) * *(const vfu *)(xm + k);
                    a1 += q8_load(qr + k + VL) * *(const vfu *)(xm + k + VL);
                    a2 += q8_load(qr + k + 2 * VL) * *(const vfu *)(xm + k + 2 * VL);
                    a3 += q8_load(qr + k + 3 * VL) * *(const vfu *)(xm + k + 3 * VL);
                }
                for (; k + VL <= K; k += VL) a0 += q8_load(qr + k) * *(const vfu *)(xm + k);
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
