/* Software prefetch for the products that stream a weight once (batch-1 decode): the weight is
 * prefetched PREFETCH_AHEAD bytes ahead of the loop, a cache line per 64 of the bytes it has just
 * reached. On a 2-core Sapphire Rapids VM the hardware prefetchers alone left such a stream at
 * 60-83% of the machine's read bandwidth (Q4_0 60-65%, bfloat16 61%); 2-9 KB ahead, at 86-102%
 * (benchmarks/cpu_stream.py); an earlier attempt on a Zen 4 machine gained nothing there
 * (docs/performance.md). Past the end of a thread's rows it touches the next thread's, or
 * nothing (a prefetch does not fault).
 * Where to: omni_prefetch_to_l2(1) (the CPU plugin's default on Intel and AMD CPUs) prefetches
 * into L2 only (prefetcht1), else into every level (prefetcht0). On that VM (6/167), into L2
 * streamed a 32768 x 4096 Q4_0 weight 1.25x faster (4157-4425 -> 3330-3464 us), Q8_0 1.07-1.18x,
 * Q4_K within the noise (8192 ahead no better than 4096), and decoded the medium q4_0 / q8_0 files
 * 1.07-1.12x / 1.01-1.11x faster, q4_k_m alike (docs/performance.md, eleventh pass). On a 2-core
 * Zen 4 (25/17), medians of 5 runs each way: Q4_0 1.18x, Q8_0 1.32x, Q5_0 1.27x, Q4_K 1.26x, Q6_K
 * 1.19x, bfloat16 1.08x, float32 1.03x; the medium q4_0 / q8_0 / q4_k_m files decoded 1.24-1.31x
 * faster (twelfth pass) -- once every line is prefetched: with prefetcht1 the L1 is left to the
 * hardware, and a line the loop skips is a miss to memory. The K-quant groups skipped each block's
 * header (2-3 lines of 18-27), which with L2 made Q4_K, Q5_K and Q6_K 1.2-1.6x slower there than
 * with L1 (two runs).
 * A product prefetches each of its weight's lines past the first PREFETCH_AHEAD bytes: the kernel
 * driver's trace build (OMNI_PREFETCH_TRACE, below) checks it for every batch-1 product. */
#ifndef OMNI_PREFETCH_H
#define OMNI_PREFETCH_H
#include "omni.h"

#define PREFETCH_AHEAD 4096

/* 1: prefetch_ahead into L2 only (omni_prefetch_to_l2, quant.c); hidden: read directly, not
 * through the library's global offset table */
extern int omni_prefetch_l2 __attribute__((visibility("hidden")));

#ifdef OMNI_PREFETCH_TRACE
/* A test build (tests/plugins/cpu/test_kernel_driver.py, whose driver defines these): each line
 * prefetched in [omni_prefetch_base, + omni_prefetch_bytes) is marked in omni_prefetch_seen, one
 * byte a 64 bytes from the (64-byte aligned) base, so a test can tell which lines of a weight the
 * product never prefetched: a K-quant group's header left out once cost a Zen 4 1.2-1.6x with L2. */
extern const char *omni_prefetch_base;
extern size_t omni_prefetch_bytes;
extern uint8_t *omni_prefetch_seen;
#define PREFETCH_LINE(a, locality)                                                                     \
    do {                                                                                               \
        const char *a_ = (a);                                                                          \
        if (a_ >= omni_prefetch_base && a_ < omni_prefetch_base + omni_prefetch_bytes)                 \
            __atomic_store_n(omni_prefetch_seen + (a_ - omni_prefetch_base) / 64, 1, __ATOMIC_RELAXED); \
        __builtin_prefetch(a_, 0, locality);                                                           \
    } while (0)
#else
#define PREFETCH_LINE(a, locality) __builtin_prefetch((a), 0, locality)
#endif

INLINE void prefetch_ahead(const void *p, int bytes) {
    if (omni_prefetch_l2)
        for (int o = 0; o < bytes; o += 64) PREFETCH_LINE((const char *)p + PREFETCH_AHEAD + o, 2);
    else
        for (int o = 0; o < bytes; o += 64) PREFETCH_LINE((const char *)p + PREFETCH_AHEAD + o, 3);
}
/* `code` (a kernel's inlined call) twice, under one test of omni_prefetch_l2: in each copy the
 * compiler knows the flag, so prefetch_ahead tests nothing in the loops (a test a block left a
 * 32768 x 4096 Q4_0 stream 6-8% slower than prefetcht1 alone; 6 runs each, 6/167). The groups of
 * 8 (ROWS_OF), the int8 row dots (quant_q8.c), omni_linear's rows and the coded copies' rows
 * (coded.c) use it; quant.c's float-activation row dots, compute-bound, still test once a block. */
#define WITH_PREFETCH_TARGET(code) \
    do {                           \
        if (omni_prefetch_l2) {    \
            code                   \
        } else {                   \
            code                   \
        }                          \
    } while (0)

/* A thread's share [n0, n1) of a weight's units (rows, groups of 8 rows), read as WEIGHT_STREAMS
 * interleaved runs: step i of n_steps(n0, n1) is unit streamed_unit(i, ...), or past n1 (skip it).
 * Two sequential runs a thread keep more cache misses in flight than one while a short product's
 * streams start: on a 2-core Sapphire Rapids-class VM (AMX, 6/167), the medium model's 24 layers
 * of batch-1 products (`benchmarks/cpu_stream.py --layers 24`, 3 rounds each way) went Q4_0
 * 15.4-16.0 -> 17.4-19.6 GB/s, Q5_0 16.2-16.7 -> 18.2-19.7, Q8_0 18.0-20.0 -> 21.0-21.9; decode
 * of the medium q4_0 file 19.9 -> 17.4 ms/token. One long weight (32768 x 4096) gained nothing
 * measurable; 3-4 runs measured as 2, 8 less. The MoE experts' groups (quant_moe_tokens.c), one
 * token routed anew each call from a 392 MB layer (`benchmarks/quant_moe.py --decode-steps`):
 * ~1.44 -> ~1.31 ms a token. The order of the units changes, not any sum. */
#define WEIGHT_STREAMS 2

INLINE int64_t n_steps(int64_t n0, int64_t n1) {
    return n1 > n0 ? WEIGHT_STREAMS * ((n1 - n0 + WEIGHT_STREAMS - 1) / WEIGHT_STREAMS) : 0;
}
INLINE int64_t streamed_unit(int64_t i, int64_t n0, int64_t n1) {
    return n0 + i / WEIGHT_STREAMS + (i % WEIGHT_STREAMS) * ((n1 - n0 + WEIGHT_STREAMS - 1) / WEIGHT_STREAMS);
}

#endif
