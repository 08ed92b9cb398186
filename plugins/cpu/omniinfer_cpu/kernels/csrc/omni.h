/* omniinfer CPU kernels: what every kernel family shares. Built once per ISA level (see
 * ../build.py: every .c file here into one library) and called through ctypes.
 *
 * linear.c (+ linear.h)  omni_linear: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for small M (decode):
 *                        streams the weight once, a contiguous range of rows per thread.
 * coded.c                omni_linear_ec: omni_linear from a copy of the weight with coded top bytes
 *                        (omni_ec_pack): the same sums from 7/8 of float32's bytes or 3/4 of bf16's.
 * attention.c            omni_paged_attention: writes the step's keys/values into the paged cache,
 *                        then attention of every query token over its sequence's cached keys (varlen
 *                        prefills, chunks after a cached context and decodes; causal; sliding window).
 * layer_ops.c            omni_rms_norm, omni_rotary, omni_silu_and_mul: the elementwise pieces of a
 *                        decoder layer; omni_argmax: the greedy token of each row of the logits.
 * gemm.c                 omni_gemm: y = x @ W^T for 3 to a few hundred rows, W packed at load
 *                        (omni_gemm_pack); with a gate_up weight, silu(gate) * up; omni_gemm_argmax:
 *                        each row's greedy token of x @ W^T without writing the products.
 * decoder_stack.c        omni_decoder_layers: a stack of pre-norm Llama layers in one call, made of
 *                        the kernels above (no Python between them: at batch 1 ~10% of a token).
 * lm_head_q8.c           omni_linear_argmax_q8: batch-1 greedy tokens from an int8 copy of the head.
 * quant.c (+ quant_blocks.h, quant_gemm.c)  omni_qlinear: y = x @ W^T from GGUF blocks / int8 rows,
 *                        float activations; quant_q8.c, quant_*x8.c: x as int8 blocks (rows in groups
 *                        of 8); quant_amx.c: AMX tiles; quant_moe*.c: omni_qmoe(_tokens), experts.
 * omni_isa() (linear.c)  the level this library was built for (build.py checks it at load).
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
#ifndef OMNI_H
#define OMNI_H
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
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
#define OMNI_ISA "avx2_vnni"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define OMNI_ISA "avx2"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define OMNI_ISA "neon"
#else
#define OMNI_ISA "generic"
#endif
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

INLINE vf s8_load(const int8_t *p) {  /* VL int8 as floats */
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

INLINE vf u8_load(const uint8_t *p) {  /* VL uint8 as floats */
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#elif defined(__aarch64__) && defined(__ARM_NEON)
    uint32_t four;
    memcpy(&four, p, 4);
    uint16x8_t h = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(four)));
    return (vf)vcvtq_f32_u32(vmovl_u16(vget_low_u16(h)));
#else
    typedef uint8_t vqu __attribute__((vector_size(VL), aligned(1)));
    return __builtin_convertvector(*(const vqu *)p, vf);
#endif
}

/* VL uint8 as uint32 lanes (for bit fields before converting) */
INLINE vu u8_widen(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vu)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vu)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#elif defined(__aarch64__) && defined(__ARM_NEON)
    uint32_t four;
    memcpy(&four, p, 4);
    return (vu)vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(four)))));
#else
    typedef uint8_t vqu __attribute__((vector_size(VL), aligned(1)));
    return __builtin_convertvector(*(const vqu *)p, vu);
#endif
}

typedef int32_t vi __attribute__((vector_size(VBYTES)));
INLINE vf u32_to_f(vu v) { return __builtin_convertvector((vi)v, vf); }

/* a float16's value (the GGUF blocks' scales) */
INLINE float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#else
    _Float16 f;  /* (GCC's own conversion, where no instruction is known to be there) */
    memcpy(&f, &h, 2);
    return (float)f;
#endif
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
/* threads for a product of `work` weights a row of x: below 32768, not worth waking another */
INLINE int threads_for(int64_t work, int nthreads) { return work < 32768 ? 1 : nthreads; }

/* ---- torch.argmax's order over columns seen in increasing order, split among threads ------ */
/* take column c's value x into a running first maximum (col < 0: none yet): only a greater value
 * or a first NaN replaces it, so the first maximum stays, a NaN the greatest */
INLINE void argmax_take(float *best, int32_t *col, float x, int64_t c) {
    float b = *best;
    if (*col < 0 || x > b || (x != x && b == b)) *best = x, *col = (int32_t)c;
}

/* The first maximum of row r over every thread's running one ([nthreads, M] each; threads hold
 * disjoint columns): a NaN above all, the first column among equals. -1 when none. */
INLINE int64_t argmax_merge(const float *best, const int32_t *best_col, int M, int nthreads, int r) {
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

#include "omni_api.h"

#endif
