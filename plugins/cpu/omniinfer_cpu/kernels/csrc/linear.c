/* omni_linear, and the level this library was built for. */
#include "linear.h"

const char *omni_isa(void) { return OMNI_ISA; }

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
    nthreads = threads_for((int64_t)N * K, nthreads);
#pragma omp parallel num_threads(nthreads)
    {
        int64_t n0, n1;
        thread_share(N, &n0, &n1);
        rows(x, (size_t)ldx, w, bias, y, (size_t)ldy, M, K, (int)n0, (int)n1);
    }
}
