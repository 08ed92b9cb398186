/* Software prefetch for the products that stream a weight once (batch-1 decode): the weight is
 * prefetched PREFETCH_AHEAD bytes ahead of the loop, a cache line per 64 of the bytes it has just
 * reached. On a 2-core Sapphire Rapids VM the hardware prefetchers alone left such a stream at
 * 60-83% of the machine's read bandwidth (Q4_0 60-65%, bfloat16 61%); 2-9 KB ahead, at 86-102%
 * (benchmarks/cpu_stream.py); an earlier attempt on a Zen 4 machine gained nothing there
 * (docs/performance.md). Past the end of a thread's rows it touches the next thread's, or
 * nothing (a prefetch does not fault). */
#ifndef OMNI_PREFETCH_H
#define OMNI_PREFETCH_H
#include "omni.h"

#define PREFETCH_AHEAD 4096

INLINE void prefetch_ahead(const void *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + PREFETCH_AHEAD + o);
}

#endif
