/* omni_qamx: omni_qlinear's product for many rows of x (prefills) on AMX's bfloat16 tiles, for
 * weights in groups of 8 rows (is_x8) or int8 rows (I8, a scale each), on CPUs with AMX-BF16
 * (Intel Xeon since Sapphire Rapids).
 * The int8 path (quant_x8.c) multiplies with AVX-512 VNNI, 64 products an instruction; one
 * tdpbf16ps is 16 x 16 x 32 = 8192. Each thread decodes panels of 32 weight rows into float32
 * in vector registers (quant_amx_decode.c; the reference's values: a scale times a code is exact, a
 * minimum subtracted once), rounds them to bfloat16 in the tiles' pair layout
 * (K/2 rows of 16 columns x 2), a span of panels (up to AMX_SPAN_BYTES) at a time, and multiplies
 * every row of x (rounded to bfloat16 once a call) against the span in 32 x 32 blocks, the sums
 * in float32 over all of K: no per-block scale in the loop, the scales are in the decoded weights.
 * Numerics: x and the weights rounded to bfloat16 (8 significant bits, where the int8 path rounds
 * x to int8 blocks and keeps the weights' codes exact), products summed in float32 by the tile
 * unit (its order; denormals are flushed). No float copy of the weight outlives the call: a span
 * is a thread's scratch (at most 1 MB, or one panel, K x 32 x 2 bytes, where that is more).
 *
 * Only built into the libraries that have AVX-512 BF16 (the level avx512_bf16); the tile code is
 * compiled for AMX by function attributes and runs only after omni_amx_enable(1) found the CPU's
 * AMX-TILE and AMX-BF16 bits, the OS's tile state enabled (XCR0 bits 17-18) and the kernel's
 * permission granted (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA): nothing here executes an AMX
 * instruction on a CPU without them. */
#include "omni_api.h"
#include "quant_blocks.h"

static int amx_on = 0;

#if defined(__x86_64__) && defined(__AVX512BF16__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_BUILT 1

static int amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return 0;  /* AMX-TILE, AMX-BF16 */
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;  /* OSXSAVE: xgetbv works */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return 0;  /* the OS saves XTILECFG and XTILEDATA */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

#define AMX_KSTEP 32  /* bfloat16 values of K a tile row holds (64 bytes) */
#define AMX_PANEL 32  /* weight rows a thread decodes at a time: two B tiles of 16 columns */

#define AMX_SPAN_BYTES (1 << 20) /* decoded panels a thread keeps at once: a span (half its L2 here) */
#define AMX_SPAN_MIN_X (2 << 20)  /* x's bytes (bfloat16) from which spans pay: x no longer fits L2 */

/* c [32 x 32] = 32 rows of x (bfloat16, K each, from xb) @ a decoded panel wb, on tiles 0-3: C (x rows
 * 0-15 / 16-31 by panel columns 0-15 / 16-31), 4-5: A (x), 6-7: B (weights) */
__attribute__((target("amx-tile,amx-bf16"))) static void block_product(const uint16_t *xb, int K, const uint16_t *wb,
                                                                       float *c) {
    const int64_t xstride = 2 * (int64_t)K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k0 = 0; k0 < K; k0 += AMX_KSTEP) {
        _tile_loadd(4, xb + k0, xstride);
        _tile_loadd(5, xb + (size_t)AMX_TILE * K + k0, xstride);
        _tile_loadd(6, wb + (size_t)(k0 / 2) * 2 * AMX_TILE, 64);
        _tile_loadd(7, wb + (size_t)K * AMX_TILE + (size_t)(k0 / 2) * 2 * AMX_TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 2 * AMX_TILE * 4);
    _tile_stored(1, c + AMX_TILE, 2 * AMX_TILE * 4);
    _tile_stored(2, c + AMX_TILE * 2 * AMX_TILE, 2 * AMX_TILE * 4);
    _tile_stored(3, c + AMX_TILE * 2 * AMX_TILE + AMX_TILE, 2 * AMX_TILE * 4);
}

/* B tile t of the panel at row n0 holds its columns 16 t..: row k/2 = 16 pairs (w[n][k], w[n][k+1]) */
static void decode_panel(const uint8_t *w, const float *scale, int kind, size_t group_bytes, int K, int n0,
                         int ncols, uint16_t *wb) {
    for (int q = 0; q < AMX_PANEL / 8; q++) {
        uint16_t *b = wb + (size_t)(q / 2) * K * AMX_TILE + 8 * 2 * (q % 2);
        if (8 * q < ncols && kind == I8)
            omni_amx_decode_i8_rows((const int8_t *)w + (size_t)(n0 + 8 * q) * K, scale + n0 + 8 * q,
                                    ncols - 8 * q < 8 ? ncols - 8 * q : 8, K, b);
        else if (8 * q < ncols)
            omni_amx_decode_group(kind, w + (size_t)(n0 / 8 + q) * group_bytes, K, b);
        else
            for (int k = 0; k < K; k += 2) memset(b + (size_t)k * AMX_TILE, 0, 32);
    }
}

__attribute__((target("amx-tile,amx-bf16"))) static void tiles_on(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = AMX_TILE;
    /* (not _tile_loadconfig: gcc's tells the compiler it reads 8 bytes, and gcc 12 then dropped the
     * stores of the rows and columns before it: a general protection fault) */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

__attribute__((target("amx-tile"))) static void tiles_off(void) { _tile_release(); }

/* y [M, ldy] (dt) = x [M, ldx] (dt) @ W^T, W's N rows in groups of 8 of `kind` (is_x8), or int8
 * rows (I8: w is q [N, K], scale [N]); K % 32 == 0. Returns 0; -1 out of memory or AMX not on. */
int omni_qamx(const void *x, int64_t ldx, const uint8_t *w, const float *scale, void *y, int64_t ldy, int M, int N,
              int K, int kind, int dt, int nthreads) {
    if (!amx_on || !(is_x8(kind) || (kind == I8 && scale)) || K % AMX_KSTEP || M < 1 || N < 1) return -1;
    int Mp = (M + 2 * AMX_TILE - 1) / (2 * AMX_TILE) * (2 * AMX_TILE);
    uint16_t *xb = aligned_alloc(64, ((size_t)Mp * K * 2 + 63) / 64 * 64);
    if (!xb) return -1;
    for (int m = 0; m < Mp; m++) {  /* x rounded to bfloat16 once; the padding rows zero */
        uint16_t *o = xb + (size_t)m * K;
        if (m >= M)
            memset(o, 0, sizeof(uint16_t) * K);
        else if (dt == BF16)
            memcpy(o, (const uint16_t *)x + (size_t)m * ldx, sizeof(uint16_t) * K);
        else
            for (int k = 0; k < K; k += 32) {
                const float *r = (const float *)x + (size_t)m * ldx + k;
                _mm512_storeu_si512(o + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(r + 16), _mm512_loadu_ps(r)));
            }
    }
    int64_t panels = (N + AMX_PANEL - 1) / AMX_PANEL;
    size_t group_bytes = 8 * (kind == I8 ? (size_t)K : qrow_bytes(kind, K));
    if (nthreads < 1) nthreads = 1;
    nthreads = threads_for((int64_t)N * K, nthreads);
    /* Where x outgrows L2 (512 rows of 4864 are 5 MB in bfloat16), each thread decodes its panels a
     * span at a time and runs every 32-row block of x over the whole span: x is read once a span
     * rather than once a panel (896 x 4864 at 512 rows: 1.2x). Where x fits, a panel at a time:
     * spans measured no faster there (4864 x 1792 at 512 rows), and slower at 32 rows. */
    size_t panel_elems = (size_t)K * AMX_PANEL;
    int span = (size_t)Mp * K * 2 < AMX_SPAN_MIN_X ? 1 : (int)(AMX_SPAN_BYTES / (panel_elems * 2));
    if (span < 1) span = 1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        int64_t p0, p1;
        thread_share(panels, &p0, &p1);
        int mine = (int)(p1 - p0 < span ? p1 - p0 : span);
        uint16_t *wb = mine > 0 ? aligned_alloc(64, panel_elems * 2 * mine) : NULL;
        float *c = aligned_alloc(64, sizeof(float) * 4 * AMX_TILE * AMX_TILE);
        if ((mine > 0 && !wb) || !c) failed = 1;
        if (!failed && mine > 0) {
            tiles_on();
            for (int64_t p = p0; p < p1; p += mine) {
                int g = (int)(p1 - p < mine ? p1 - p : mine);
                for (int i = 0; i < g; i++) {
                    int n0 = (int)((p + i) * AMX_PANEL);
                    decode_panel(w, scale, kind, group_bytes, K, n0, N - n0 < AMX_PANEL ? N - n0 : AMX_PANEL,
                                 wb + panel_elems * i);
                }
                for (int m0 = 0; m0 < Mp; m0 += 2 * AMX_TILE)
                    for (int i = 0; i < g; i++) {
                        int n0 = (int)((p + i) * AMX_PANEL), ncols = N - n0 < AMX_PANEL ? N - n0 : AMX_PANEL;
                        block_product(xb + (size_t)m0 * K, K, wb + panel_elems * i, c);
                        for (int m = m0; m < m0 + 2 * AMX_TILE && m < M; m++)
                            for (int j = 0; j < ncols; j++)
                                st1(y, dt, (size_t)m * ldy + n0 + j, c[(m - m0) * 2 * AMX_TILE + j]);
                    }
            }
            tiles_off();
        }
        free(wb), free(c);
    }
    free(xb);
    return failed ? -1 : 0;
}
/* quant.c: whether omni_qlinear's M rows of `kind` go to omni_qamx */
int omni_amx_takes(int kind, int M, int K) {
    return amx_on && (is_x8(kind) || kind == I8) && K % AMX_KSTEP == 0 &&
           M >= (kind == I8 ? AMX_MIN_ROWS_I8 : AMX_MIN_ROWS);
}
#else
#define AMX_BUILT 0
int omni_amx_takes(int kind, int M, int K) {
    (void)kind, (void)M, (void)K;
    return 0;
}
int omni_qamx(const void *x, int64_t ldx, const uint8_t *w, const float *scale, void *y, int64_t ldy, int M, int N,
              int K, int kind, int dt, int nthreads) {
    (void)x, (void)ldx, (void)w, (void)scale, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)kind, (void)dt,
        (void)nthreads;
    return -1;
}
#endif

/* on: 1 turns the AMX path on where this library and this CPU can run it, 0 off. Returns whether
 * it is on now; -1 when this library has no AMX code (built below avx512_bf16, or for another
 * architecture), -2 when `on` asked for it and the CPU or the OS cannot run it. */
int omni_amx_enable(int on) {
#if AMX_BUILT
    if (!on) return amx_on = 0;
    static int usable = -1;
    if (usable < 0) usable = amx_usable();
    if (!usable) return -2;
    return amx_on = 1;
#else
    (void)on;
    return -1;
#endif
}
