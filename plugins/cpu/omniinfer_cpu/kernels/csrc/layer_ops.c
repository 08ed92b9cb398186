/* The elementwise pieces of a decoder layer, and the greedy argmax. */
#include "omni.h"

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

/* omni_rms_norm without a residual over each head of D values (Qwen3's q_norm / k_norm): x's T
 * rows `stride` elements apart, `heads` heads each, into out [T, heads * D]: the rows torch's
 * RMSNorm meets in x.reshape(-1, D), through the same row function */
void omni_rms_norm_heads(const void *x, int64_t stride, const void *weight, void *out, int T, int heads, int D,
                         float eps, int dt, int nthreads) {
    void (*row)(const void *, const void *, void *, const void *, void *, int, float) =
        dt == F32 ? rms_norm_f32 : rms_norm_bf16;
    size_t es = dt == F32 ? 4 : 2;
    int rows = T * heads;
    (void)nthreads;
#pragma omp parallel for schedule(static) PARALLEL_ROWS(rows)
    for (int r = 0; r < rows; r++)
        row((const char *)x + ((size_t)(r / heads) * stride + (size_t)(r % heads) * D) * es, NULL, NULL, weight,
            (char *)out + (size_t)r * D * es, D, eps);
}

/* GPT-NeoX rotary ("rotate half"), in place: the halves (x1, x2) of each head's first R features
 * become (x1 cos - x2 sin, x2 cos + x1 sin); features R..D pass (R < D: a partial rotary).
 * cos/sin: float32 [max_position, R / 2]; in bfloat16 they and each product are rounded as the
 * torch path does. Query/key rows: `stride` elements apart. */
INLINE void rotate_heads(void *x, size_t base, int heads, int D, int R, const float *c, const float *s,
                         int dt) {
    int half = R / 2;
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
                int num_kv_heads, int D, int R, int dt, int nthreads) {
    int half = R / 2;
    for (int t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return -1;
    (void)nthreads;
#pragma omp parallel for schedule(static) PARALLEL_ROWS(T)
    for (int t = 0; t < T; t++) {
        const float *c = cos + (size_t)positions[t] * half, *s = sin + (size_t)positions[t] * half;
        if (dt == F32) {
            rotate_heads(q, (size_t)t * q_stride, num_heads, D, R, c, s, F32);
            rotate_heads(k, (size_t)t * k_stride, num_kv_heads, D, R, c, s, F32);
        } else {
            rotate_heads(q, (size_t)t * q_stride, num_heads, D, R, c, s, BF16);
            rotate_heads(k, (size_t)t * k_stride, num_kv_heads, D, R, c, s, BF16);
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
