/*
 * Prefill attention on the CPU: a block of queries against a block of keys, as the
 * mergeable partial (out, lse) attention/block.py's tiles compute, on the decode step's
 * pool of threads (thread_pool.h). Included by decode_step.c after its row kernels
 * (row_max, softmax_row: the exponential of attention/exp.py's polynomial).
 *
 * MLX's CPU graph runs the tiles' elementwise work (the mask, the row maxima, the
 * exponentials, the merges) on one thread, and a tile's products through the BLAS: on a
 * rank of two cores, the second core helped a layer's attention over 3,000 keys by less
 * than 10% (a hand run on the 2-core AMD EPYC machine).
 * Here each task is one KV head's query heads over PREFILL_ROWS query positions, run
 * through the key tiles with the running maximum and sum of the flash-attention
 * recurrence, the products in registers (6 rows x 16 columns), every sum in float32.
 * Same arithmetic as the MLX tiles but for the order of the sums: float32 rounding apart.
 * Each part of the pool allocates its scratch once a call (a layer's block, not a token's).
 *
 *   q (heads, tq, d), k and v (kv_heads, tk, d), q_pos (tq), k_pos (tk): contiguous;
 *   out (heads, tq, d), lse (heads, tq): a query that sees no key gets 0 and -inf.
 *   The query heads of KV head g are g * group ... g * group + group - 1. A query at
 *   position p sees the keys at positions <= p, and with window > 0 only those > p - window.
 */
#ifndef SPMD_CP_PREFILL_ATTENTION_H
#define SPMD_CP_PREFILL_ATTENTION_H

#include <stdlib.h>

/* Query positions a task takes (times the group's heads: its rows), keys a tile holds. */
enum { PREFILL_ROWS = 32, PREFILL_KEYS = 128 };

typedef struct {
  const float *q, *k, *v;
  const int64_t *q_pos, *k_pos;
  int heads, kv_heads, tq, tk, d;
  float scale;
  int64_t window; /* <= 0: none */
  float *out, *lse;
  int64_t *tile_min, *tile_max; /* per key tile: its lowest and highest position */
  int failed;                    /* a part could not allocate its scratch */
} prefill_job;

/* s (rows x n) = a (rows x d) times bt (d x n): the plain form, any shape. */
static void scores_plain(const float *a, const float *bt, int rows, int d, int n, float *s) {
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < n; c++) {
      float sum = 0.0f;
      for (int j = 0; j < d; j++) sum += a[r * d + j] * bt[j * n + c];
      s[r * n + c] = sum;
    }
}

/* o (rows x d) += p (rows x n) times v (n x d): the plain form. */
static void values_plain(const float *p, const float *v, int rows, int n, int d, float *o) {
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < n; c++) {
      float w = p[r * n + c];
      if (w == 0.0f) continue;
      for (int j = 0; j < d; j++) o[r * d + j] += w * v[c * d + j];
    }
}

#ifdef HAVE_X86_VECTORS
/* out (6 x 16, rows ldo apart) = (accumulate ? out : 0) + x (6 x k, rows ldx apart) times
 * y (k x 16, rows ldy apart), in twelve registers, named (an array of them would be kept
 * in memory by GCC at -O2). Both of a tile's products are made of these blocks. */
#define ROWS_6(X) X(0) X(1) X(2) X(3) X(4) X(5)
AVX2 static inline __attribute__((always_inline)) void block_6x16(
    const float *x, int ldx, const float *y, int ldy, int k, float *out, int ldo,
    int accumulate) {
#define START(i)                                                                 \
  __m256 lo##i = accumulate ? _mm256_loadu_ps(out + i * ldo) : _mm256_setzero_ps(); \
  __m256 hi##i = accumulate ? _mm256_loadu_ps(out + i * ldo + 8) : _mm256_setzero_ps();
  ROWS_6(START)
#undef START
  for (int t = 0; t < k; t++) {
    __m256 y0 = _mm256_loadu_ps(y + t * ldy), y1 = _mm256_loadu_ps(y + t * ldy + 8);
#define STEP(i)                                          \
  {                                                      \
    __m256 w = _mm256_broadcast_ss(x + i * ldx + t);     \
    lo##i = _mm256_fmadd_ps(w, y0, lo##i);               \
    hi##i = _mm256_fmadd_ps(w, y1, hi##i);               \
  }
    ROWS_6(STEP)
#undef STEP
  }
#define STORE(i)                               \
  _mm256_storeu_ps(out + i * ldo, lo##i);      \
  _mm256_storeu_ps(out + i * ldo + 8, hi##i);
  ROWS_6(STORE)
#undef STORE
}
#undef ROWS_6

/* The scores in 6 x 16 blocks; the rows and columns past the last block in the plain form. */
AVX2 static void scores_avx2(const float *a, const float *bt, int rows, int d, int n, float *s) {
  int full_rows = rows / 6 * 6, full_cols = n / 16 * 16;
  for (int r = 0; r < full_rows; r += 6)
    for (int c = 0; c < full_cols; c += 16)
      block_6x16(a + r * d, d, bt + c, n, d, s + r * n + c, n, 0);
  for (int r = 0; r < full_rows; r++) /* the columns past the last 16 */
    for (int c = full_cols; c < n; c++) {
      float sum = 0.0f;
      for (int j = 0; j < d; j++) sum += a[r * d + j] * bt[j * n + c];
      s[r * n + c] = sum;
    }
  scores_plain(a + full_rows * d, bt, rows - full_rows, d, n, s + full_rows * n);
}

/* The values in 6 x 16 blocks (heads a multiple of 16 wide); the rows past them plain. */
AVX2 static void values_avx2(const float *p, const float *v, int rows, int n, int d, float *o) {
  if (d % 16) {
    values_plain(p, v, rows, n, d, o);
    return;
  }
  int full_rows = rows / 6 * 6;
  for (int r = 0; r < full_rows; r += 6)
    for (int j = 0; j < d; j += 16) block_6x16(p + r * n, n, v + j, d, n, o + r * d + j, d, 1);
  values_plain(p + full_rows * n, v, rows - full_rows, n, d, o + full_rows * d);
}

static void tile_scores(const float *a, const float *bt, int rows, int d, int n, float *s) {
  if (avx2_here())
    scores_avx2(a, bt, rows, d, n, s);
  else
    scores_plain(a, bt, rows, d, n, s);
}
static void tile_values(const float *p, const float *v, int rows, int n, int d, float *o) {
  if (avx2_here())
    values_avx2(p, v, rows, n, d, o);
  else
    values_plain(p, v, rows, n, d, o);
}
#else
#define tile_scores scores_plain
#define tile_values values_plain
#endif

static int sees(const prefill_job *job, int64_t query, int64_t key) {
  return key <= query && (job->window <= 0 || key > query - job->window);
}

/* The task of KV head g over the query positions t0 .. t1 - 1, with the part's scratch. */
static void prefill_task(const prefill_job *job, int g, int t0, int t1, float *scratch) {
  int d = job->d, group = job->heads / job->kv_heads, n = t1 - t0, rows = group * n;
  float *a = scratch, *bt = a + rows * d, *s = bt + d * PREFILL_KEYS, *o = s + rows * PREFILL_KEYS;
  float *top = o + rows * d, *total = top + rows;
  int64_t q_min = job->q_pos[t0], q_max = job->q_pos[t0];
  for (int t = t0; t < t1; t++) {
    q_min = job->q_pos[t] < q_min ? job->q_pos[t] : q_min;
    q_max = job->q_pos[t] > q_max ? job->q_pos[t] : q_max;
  }
  for (int r = 0; r < rows; r++) { /* row r: head g * group + r / n, position t0 + r % n */
    const float *qr = job->q + ((size_t)(g * group + r / n) * job->tq + t0 + r % n) * d;
    for (int j = 0; j < d; j++) a[r * d + j] = qr[j] * job->scale; /* as (q * scale) @ k^T */
    top[r] = -INFINITY, total[r] = 0.0f;
  }
  memset(o, 0, sizeof(float) * rows * d);
  const float *keys = job->k + (size_t)g * job->tk * d, *values = job->v + (size_t)g * job->tk * d;
  for (int tile = 0, k0 = 0; k0 < job->tk; tile++, k0 += PREFILL_KEYS) {
    int64_t k_min = job->tile_min[tile], k_max = job->tile_max[tile];
    if (k_min > q_max || (job->window > 0 && k_max <= q_min - job->window)) continue;
    int masked = k_max > q_min || (job->window > 0 && k_min <= q_max - job->window);
    int m = job->tk - k0 < PREFILL_KEYS ? job->tk - k0 : PREFILL_KEYS;
    for (int c = 0; c < m; c++)
      for (int j = 0; j < d; j++) bt[j * m + c] = keys[(size_t)(k0 + c) * d + j];
    tile_scores(a, bt, rows, d, m, s);
    for (int r = 0; r < rows; r++) {
      float *sr = s + r * m;
      if (masked) {
        int64_t query = job->q_pos[t0 + r % n];
        for (int c = 0; c < m; c++)
          if (!sees(job, query, job->k_pos[k0 + c])) sr[c] = -INFINITY;
      }
      float tile_top = row_max(sr, m), new_top = tile_top > top[r] ? tile_top : top[r];
      if (new_top == -INFINITY) { /* nothing seen yet: the row's weights are all 0 */
        memset(sr, 0, sizeof(float) * m);
        continue;
      }
      float correction = exp_nonpositive(top[r] - new_top); /* 0 from -inf */
      float sum = softmax_row(sr, m, new_top, 1.0f, sr);
      total[r] = total[r] * correction + sum;
      if (correction != 1.0f)
        for (int j = 0; j < d; j++) o[r * d + j] *= correction;
      top[r] = new_top;
    }
    tile_values(s, values + (size_t)k0 * d, rows, m, d, o);
  }
  for (int r = 0; r < rows; r++) {
    size_t at = (size_t)(g * group + r / n) * job->tq + t0 + r % n;
    float *out = job->out + at * d;
    for (int j = 0; j < d; j++) out[j] = total[r] > 0.0f ? o[r * d + j] / total[r] : 0.0f;
    job->lse[at] = total[r] > 0.0f ? logf(total[r]) + top[r] : -INFINITY;
  }
}

/* One part's tasks: every parts-th of (KV head, block of PREFILL_ROWS positions). */
static void prefill_part(void *args, int part, int parts) {
  prefill_job *job = args;
  int group = job->heads / job->kv_heads, blocks = (job->tq + PREFILL_ROWS - 1) / PREFILL_ROWS;
  size_t rows = (size_t)group * PREFILL_ROWS, d = job->d;
  float *scratch = malloc(sizeof(float) * (rows * d * 2 + d * PREFILL_KEYS +
                                           rows * PREFILL_KEYS + rows * 2));
  if (scratch == NULL) {
    __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
    return;
  }
  for (int task = part; task < job->kv_heads * blocks; task += parts) {
    int g = task % job->kv_heads, t0 = task / job->kv_heads * PREFILL_ROWS;
    prefill_task(job, g, t0, t0 + PREFILL_ROWS < job->tq ? t0 + PREFILL_ROWS : job->tq, scratch);
  }
  free(scratch);
}

/* The partial attention of the queries over the keys (see the top); 0 on success, -1
 * where scratch could not be had (out and lse are then incomplete). */
int spmd_cp_prefill_attend(const float *q, const float *k, const float *v,
                           const int64_t *q_pos, const int64_t *k_pos, int heads,
                           int kv_heads, int tq, int tk, int d, float scale, int64_t window,
                           float *out, float *lse) {
  int tiles = (tk + PREFILL_KEYS - 1) / PREFILL_KEYS;
  int64_t *bounds = malloc(sizeof(int64_t) * 2 * (tiles > 0 ? tiles : 1));
  if (bounds == NULL) return -1;
  for (int tile = 0; tile < tiles; tile++) { /* each key tile's lowest and highest position */
    int first = tile * PREFILL_KEYS, end = first + PREFILL_KEYS < tk ? first + PREFILL_KEYS : tk;
    int64_t low = k_pos[first], high = low;
    for (int c = first; c < end; c++) {
      low = k_pos[c] < low ? k_pos[c] : low;
      high = k_pos[c] > high ? k_pos[c] : high;
    }
    bounds[tile] = low, bounds[tiles + tile] = high;
  }
  prefill_job job = {q, k, v, q_pos, k_pos, heads, kv_heads, tq, tk, d, scale, window,
                     out, lse, bounds, bounds + tiles, 0};
  run_parallel(prefill_part, &job);
  free(bounds);
  return job.failed ? -1 : 0;
}

#endif
