/*
 * cblas_sgemm that hands matrix-vector products to cblas_sgemv.
 *
 * MLX's CPU backend runs every float32 matmul as cblas_sgemm, also a decode step's
 * products of a weight matrix and one token's vector (N = 1 or M = 1). OpenBLAS before
 * 0.3.27 runs those through its full GEMM path, packing the weight matrix into a buffer
 * before its kernel reads it again; its sgemv reads the matrix once. On the 2-core test
 * machine (OpenBLAS 0.3.21), 1536 x 576 weights: 10.0 GB/s through sgemm, 21.4 through
 * sgemv; 24576 x 576: 9.2 against 33.1. (OpenBLAS 0.3.27 added the same forwarding as a
 * build option, GEMM_GEMV_FORWARD.)
 *
 * Also a few rows (m <= 4) times a matrix small enough to stay in cache between them:
 * decode attention's probabilities of a query group times a head's values, one sgemv per
 * row (30 layers of 3 heads x 1,500 keys: 8.5 against 10.4 ms).
 *
 * Preloaded ahead of the BLAS (blas/reexec.py), so MLX's cblas_sgemm resolves here;
 * every other product goes to the next library's cblas_sgemm unchanged. The forwarded product sums in sgemv's order, not sgemm's: the
 * same values to float32 rounding, not the same bits.
 */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111 };
enum { FEW_ROWS = 4, CACHED_BYTES = 1 << 20 }; /* within a 2 MiB L2 */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;

static void find_next(void) {
  if (next_sgemm == NULL) next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
  if (next_sgemv == NULL) next_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
}

/* y (count values `stride` apart) = 0: sgemv's beta = 0 may still multiply what an
 * uninitialized output holds (0 * NaN), where gemm's semantics overwrite it. */
static void zero(float *y, int count, int stride) {
  for (int i = 0; i < count; i++) y[(ptrdiff_t)i * stride] = 0.0f;
}

/* The entry point's name is the library's reason to exist. */
void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
  find_next();
  int a_plain = trans_a == NO_TRANS, b_plain = trans_b == NO_TRANS;
  if (next_sgemv != NULL && order == ROW_MAJOR && k > 0 && (n == 1 || m == 1)) {
    if (n == 1) {
      /* c (m values, ldc apart) = op(A) (m x k) times op(B)'s one column (k values). */
      int x_stride = b_plain ? ldb : 1;
      if (beta == 0.0f) zero(c, m, ldc);
      next_sgemv(ROW_MAJOR, trans_a, a_plain ? m : k, a_plain ? k : m, alpha, a, lda, b,
                 x_stride, beta, c, ldc);
    } else {
      /* c's one row (n values) = op(A)'s one row (k values) times op(B) (k x n), i.e.
       * op(B) transposed times that row. */
      int x_stride = a_plain ? 1 : lda;
      if (beta == 0.0f) zero(c, n, 1);
      next_sgemv(ROW_MAJOR, b_plain ? 112 : NO_TRANS, b_plain ? k : n, b_plain ? n : k,
                 alpha, b, ldb, a, x_stride, beta, c, 1);
    }
    return;
  }
  if (next_sgemv != NULL && order == ROW_MAJOR && k > 0 && n > 0 && m <= FEW_ROWS &&
      (size_t)k * n * sizeof(float) <= CACHED_BYTES) {
    /* A few rows times a matrix that stays in cache between them (decode attention:
     * a query group's probabilities times one head's values): one sgemv per row reads
     * the matrix from memory once, where sgemm packs it first. */
    for (int row = 0; row < m; row++) {
      const float *a_row = a_plain ? a + (ptrdiff_t)row * lda : a + row;
      float *c_row = c + (ptrdiff_t)row * ldc;
      if (beta == 0.0f) zero(c_row, n, 1);
      next_sgemv(ROW_MAJOR, b_plain ? 112 : NO_TRANS, b_plain ? k : n, b_plain ? n : k,
                 alpha, b, ldb, a_row, a_plain ? 1 : lda, beta, c_row, 1);
    }
    return;
  }
  next_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
