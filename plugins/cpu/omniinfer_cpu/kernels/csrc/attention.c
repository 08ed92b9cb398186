/* omni_paged_attention: the CPU_PAGED backend's kernel. */
#include "omni.h"

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
