/* Software prefetch for the products that stream a weight once (batch-1 decode): the weight is
 * prefetched PREFETCH_AHEAD bytes ahead of the loop, a cache line per 64 of the bytes it has just
 * reached. On a 2-core Sapphire Rapids VM the hardware prefetchers alone left such a stream at
 * 60-83% of the machine's read bandwidth (Q4_0 60-65%, bfloat16 61%); 2-9 KB ahead, at 86-102%
 * (benchmarks/cpu_stream.py); an earlier attempt on a Zen 4 machine gained nothing there
 * (docs/performance.md). Past the end of a thread's rows it touches the next thread's, or
 * nothing (a prefetch does not fault).
 * Where to: omni_prefetch_to_l2(1) (the CPU plugin's default on Intel CPUs) prefetches into L2
 * only (prefetcht1), else into every level (prefetcht0). On that VM (6/167), into L2 streamed a
 * 32768 x 4096 Q4_0 weight 1.25x faster (4157-4425 -> 3330-3464 us), Q8_0 1.07-1.18x, Q4_K within
 * the noise (8192 ahead no better than 4096), and decoded the medium q4_0 / q8_0 files 1.07-1.12x /
 * 1.01-1.11x faster, q4_k_m alike (docs/performance.md, eleventh pass). AMD's Zen 4 documents
 * prefetcht1 as into L2 too, but is reported to drop some; not measured on an AMD CPU, so AMD
 * CPUs keep prefetcht0. */
#ifndef OMNI_PREFETCH_H
#define OMNI_PREFETCH_H
#include "omni.h"

#define PREFETCH_AHEAD 4096

/* 1: prefetch_ahead into L2 only (omni_prefetch_to_l2, quant.c); hidden: read directly, not
 * through the library's global offset table */
extern int omni_prefetch_l2 __attribute__((visibility("hidden")));

INLINE void prefetch_ahead(const void *p, int bytes) {
    if (omni_prefetch_l2)
        for (int o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + PREFETCH_AHEAD + o, 0, 2);
    else
        for (int o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + PREFETCH_AHEAD + o);
}
/* `code` (a kernel's inlined call) twice, under one test of omni_prefetch_l2: in each copy the
 * compiler knows the flag, so prefetch_ahead tests nothing in the loops (a test a block left a
 * 32768 x 4096 Q4_0 stream 6-8% slower than prefetcht1 alone; 6 runs each, 6/167). The groups of
 * 8 (ROWS_OF), the int8 row dots (quant_q8.c) and omni_linear's rows use it; quant.c's
 * float-activation row dots, compute-bound, still test once a block. */
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
