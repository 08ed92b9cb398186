/* omni_linear_ec: batch-1 products from weights with coded top bytes. */
#include "omni.h"
#include "prefetch.h"

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

/* the next n (1 or 4) vectors of the row, from column k, patched; the row prefetched 4 KB ahead
 * (prefetch.h: the medium float32 model decoded 1.15x faster on a Zen 4, docs/performance.md) */
INLINE void ec_next(ec_row *row, __m512i *w, int n, int k, int K, int dt) {
    prefetch_ahead(row->grp, n * ec_group(dt));
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
    WITH_PREFETCH_TARGET(ec_linear_rows(x, ldx, ec, bias, y, ldy, F32, M, N, K, n0, n1););
}

#if defined(__AVX512BF16__)
static void ec_linear_rows_bf16(const void *x, size_t ldx, const uint8_t *ec, const void *bias, void *y,
                                size_t ldy, int M, int N, int K, int n0, int n1) {
    WITH_PREFETCH_TARGET(ec_linear_rows(x, ldx, ec, bias, y, ldy, BF16, M, N, K, n0, n1););
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
    nthreads = threads_for((int64_t)N * K, nthreads);  /* as omni_linear */
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
