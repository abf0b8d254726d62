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
 * Also a few rows (m <= 4) times a matrix small enough to stay in cache between them,
 * one sgemv per row, where the one-pass kernel below does not take it.
 *
 * And decode attention's two products over a KV shard, one pass each where sgemm packs
 * its operand first (30 layers of 3 heads over 8,160 keys, one thread, AVX2 and FMA:
 * the scores, keys times a query group's few columns or those rows times the keys as
 * columns, 12.7 -> 7.1-8.0 ms, 15 -> 23-27 GB/s of keys; the values, a few rows of
 * probabilities times the values, 18.8 -> 7.1 ms, 10 -> 27 GB/s, and over 1,500 keys
 * 1.8 -> 1.4 ms; a plain read of the keys streams 30-33 GB/s):
 *   - few columns: each key row's dot products with the n <= 8 query columns (written
 *     down c's rows, or down its columns for the transposed product);
 *   - few rows over a matrix: m <= 8 rows of accumulators, one pass over its rows.
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
/* The one-pass kernels: at most this many columns (rows), at least this many rows
 * (products) streamed, and accumulator rows at most this wide (on the stack). */
enum { FEW_COLUMNS = 8, LONG_ROWS = 64, STREAM_ROWS = 8, MAX_WIDTH = 512 };

/* Vector code for CPUs that have it, chosen when the library loads (GCC's ifunc
 * clones); LOOPS_VECTORIZED also vectorizes loops of a runtime length (-O3: the
 * build's -O2 leaves them scalar). The clone is picked by the CPU's features
 * (x86-64-v3: AVX2, FMA; GCC 11 on, before it AVX2 alone): an "arch=haswell" clone is
 * picked only on a CPU that *is* a Haswell, never on an AMD EPYC or a later Intel.
 * Elsewhere the plain code. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#if __GNUC__ >= 11
#define VECTOR_TARGET "arch=x86-64-v3"
#else
#define VECTOR_TARGET "avx2"
#endif
#define VECTOR_CLONES __attribute__((target_clones(VECTOR_TARGET, "default")))
#define LOOPS_VECTORIZED \
  __attribute__((target_clones(VECTOR_TARGET, "default"), optimize("O3")))
#else
#define VECTOR_CLONES
#define LOOPS_VECTORIZED
#endif

/* sum x[i] * y[i] over i < k, in eight interleaved partial sums (vector lanes). */
static inline float dot(const float *x, const float *y, int k) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= k; i += 8)
    for (int l = 0; l < 8; l++) lane[l] += x[i + l] * y[i + l];
  float sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
              ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (; i < k; i++) sum += x[i] * y[i];
  return sum;
}

/* c (m x n, n <= FEW_COLUMNS) = alpha A (m x k, rows lda apart) B' + beta c, where
 * column j of B' is the k values at b + j * ldb and c's entry (i, j) is at
 * c[i * c_row + j * c_column]: each row of A read once, its n dot products in cache.
 * (c transposed, c_row = 1, is the same product with the roles of A and B swapped.) */
VECTOR_CLONES
static void few_columns(int m, int n, int k, float alpha, const float *a, int lda,
                        const float *b, int ldb, float beta, float *c, ptrdiff_t c_row,
                        ptrdiff_t c_column) {
  for (int i = 0; i < m; i++) {
    const float *row = a + (ptrdiff_t)i * lda;
    float *out = c + (ptrdiff_t)i * c_row;
    for (int j = 0; j < n; j++) {
      float value = alpha * dot(row, b + (ptrdiff_t)j * ldb, k);
      float *entry = out + j * c_column;
      *entry = beta == 0.0f ? value : value + beta * *entry;
    }
  }
}

/* c (m x n, m <= STREAM_ROWS, n <= MAX_WIDTH) = alpha op(A) B + beta c, B (k x n) rows
 * ldb apart, op(A)'s entry (i, r) at a[i * row_step + r * col_step]: one pass over B's
 * rows, each added into the m rows of accumulators (in r's order). */
LOOPS_VECTORIZED
static void few_rows_streamed(int m, int n, int k, float alpha, const float *a,
                              ptrdiff_t row_step, ptrdiff_t col_step, const float *b,
                              int ldb, float beta, float *c, int ldc) {
  float sums[STREAM_ROWS][MAX_WIDTH];
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) sums[i][j] = 0.0f;
  for (int r = 0; r < k; r++) {
    const float *b_row = b + (ptrdiff_t)r * ldb;
    for (int i = 0; i < m; i++) {
      float weight = a[i * row_step + r * col_step];
      for (int j = 0; j < n; j++) sums[i][j] += weight * b_row[j];
    }
  }
  for (int i = 0; i < m; i++) {
    float *out = c + (ptrdiff_t)i * ldc;
    for (int j = 0; j < n; j++)
      out[j] = beta == 0.0f ? alpha * sums[i][j] : alpha * sums[i][j] + beta * out[j];
  }
}

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
  if (order == ROW_MAJOR && k > 0 && m > 0 && m <= FEW_COLUMNS && n >= LONG_ROWS &&
      a_plain && !b_plain) {
    /* The same scores the other way round: a query group's few rows times a shard's
     * keys given as rows (B transposed), each key row's dot products written down a
     * column of c. */
    few_columns(n, m, k, alpha, b, ldb, a, lda, beta, c, 1, ldc);
    return;
  }
  if (order == ROW_MAJOR && k >= LONG_ROWS && m > 0 && m <= STREAM_ROWS && n > 0 &&
      n <= MAX_WIDTH && b_plain) {
    /* Decode attention's values: a query group's probabilities (few rows, stored
     * either way) times a shard of values, in cache or not. */
    few_rows_streamed(m, n, k, alpha, a, a_plain ? lda : 1, a_plain ? 1 : lda, b, ldb,
                      beta, c, ldc);
    return;
  }
  if (next_sgemv != NULL && order == ROW_MAJOR && k > 0 && n > 0 && m <= FEW_ROWS &&
      (size_t)k * n * sizeof(float) <= CACHED_BYTES) {
    /* A few rows times a matrix that stays in cache between them, given transposed or
     * too short for the one-pass kernel: one sgemv per row reads the matrix from
     * memory once, where sgemm packs it first. */
    for (int row = 0; row < m; row++) {
      const float *a_row = a_plain ? a + (ptrdiff_t)row * lda : a + row;
      float *c_row = c + (ptrdiff_t)row * ldc;
      if (beta == 0.0f) zero(c_row, n, 1);
      next_sgemv(ROW_MAJOR, b_plain ? 112 : NO_TRANS, b_plain ? k : n, b_plain ? n : k,
                 alpha, b, ldb, a_row, a_plain ? 1 : lda, beta, c_row, 1);
    }
    return;
  }
  if (order == ROW_MAJOR && k > 0 && n > 0 && n <= FEW_COLUMNS && m >= LONG_ROWS &&
      a_plain && !b_plain) {
    /* Decode attention's scores: a shard's keys (m x k) times a query group's few
     * columns, given as its rows (B transposed). */
    few_columns(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, 1);
    return;
  }
  next_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
