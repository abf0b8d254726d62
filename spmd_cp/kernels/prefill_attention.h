/*
 * Prefill attention on the CPU: a block of queries against a block of keys, as the
 * mergeable partial (out, lse) attention/block.py's tiles compute, on the decode step's
 * pool of threads (thread_pool.h). Included by decode_step.c after its vector helpers
 * (AVX2, LANES, avx2_here) and exp_polynomial.h (attention/exp.py's exponential).
 *
 * MLX's CPU graph runs the tiles' elementwise work (the mask, the row maxima, the
 * exponentials, the merges) on one thread, and a tile's products through the BLAS: on a
 * rank of two cores, the second core helped a layer's attention over 3,000 keys by less
 * than 10% (a hand run on the 2-core AMD EPYC machine).
 * Here each task is one KV head's query heads over a block of query positions (about
 * PREFILL_TARGET_ROWS rows), run through tiles of PREFILL_KEYS keys with the running
 * maximum and sum of the flash-attention recurrence, the products in registers (6 x 16
 * blocks), every sum in float32. Same arithmetic as the MLX tiles but for the order of
 * the sums: float32 rounding apart. Each part of the pool allocates its scratch once a
 * call (a layer's block, not a token's).
 *
 *   q (heads, tq, d), k and v (kv_heads, tk, d), q_pos (tq), k_pos (tk): contiguous, but
 *   that k's and v's heads may lie kv_step floats apart (>= tk * d: a cache's buffers);
 *   out (heads, tq, d), lse (heads, tq): a query that sees no key gets 0 and -inf.
 *   The query heads of KV head g are g * group ... g * group + group - 1. A query at
 *   position p sees the keys at positions <= p, and with window > 0 only those > p - window.
 */
#ifndef SPMD_CP_PREFILL_ATTENTION_H
#define SPMD_CP_PREFILL_ATTENTION_H

#include <stdlib.h>

/* The rows (query heads x positions) a task aims at, and the keys a tile holds: a task's
 * arrays then stay within a core's L2. Hand runs on the 2-core AMD EPYC machine over
 * 48-128 keys and 16-64 positions: 64 keys and 32 positions of a group of three among
 * the fastest; 64, 96 and 128 rows alike within the runs' spread. */
enum { PREFILL_TARGET_ROWS = 96, PREFILL_KEYS = 64 };

/* Query positions a task takes: about PREFILL_TARGET_ROWS rows (query heads x positions),
 * from 16 to 64 positions in steps of 16. */
static int task_positions(int group) {
  int positions = (PREFILL_TARGET_ROWS / group + 15) / 16 * 16;
  return positions < 16 ? 16 : positions > 64 ? 64 : positions;
}

typedef struct {
  const float *q, *k, *v;
  const int64_t *q_pos, *k_pos;
  int heads, kv_heads, tq, tk, d;
  int64_t kv_step; /* floats from one KV head's keys (values) to the next's */
  float scale;
  int64_t window; /* <= 0: none */
  float *out, *lse;
  int64_t *tile_min, *tile_max; /* per key tile: its lowest and highest position */
  int failed;                    /* a part could not allocate its scratch */
} prefill_job;

/* A task keeps its rows (query head x position) in the last, contiguous axis of every
 * array it sweeps: at (d x R) holds the scaled queries transposed, st (keys x R) a key
 * tile's scores and then its weights. The key and value tiles are then read as the
 * cache stores them (no transposed copy a tile), and the softmax runs down the columns
 * of st, eight rows at a time, with no reduction across lanes. R is the rows rounded up
 * to 16 (the padding rows are computed and dropped). */
static int padded_rows(int rows) { return (rows + 15) / 16 * 16; }

/* st (m x R) = kt (m x d) times at (d x R): the plain form. */
static void scores_plain(const float *kt, const float *at, int m, int d, int R, float *st) {
  for (int c = 0; c < m; c++) {
    float *sc = st + (size_t)c * R;
    for (int r = 0; r < R; r++) sc[r] = 0.0f;
    for (int j = 0; j < d; j++) {
      float w = kt[(size_t)c * d + j];
      for (int r = 0; r < R; r++) sc[r] += w * at[(size_t)j * R + r];
    }
  }
}

/* o (R x d) += the weights (st: m x R, transposed) times vt (m x d): the plain form. */
static void values_plain(const float *st, const float *vt, int R, int m, int d, float *o) {
  for (int c = 0; c < m; c++)
    for (int r = 0; r < R; r++) {
      float w = st[(size_t)c * R + r];
      if (w == 0.0f) continue;
      for (int j = 0; j < d; j++) o[(size_t)r * d + j] += w * vt[(size_t)c * d + j];
    }
}

/* The softmax of a tile down st's columns, the flash-attention recurrence: each row's
 * running maximum (top) and sum (total) take the tile in, o's rows are rescaled to the
 * new maximum, and st becomes the tile's weights, e^(score - top); a row that has seen
 * no key yet keeps top -inf and gets weights 0. */
static void softmax_plain(float *st, int m, int R, float *top, float *total, float *o, int d) {
  for (int r = 0; r < R; r++) {
    float tile_top = -INFINITY;
    for (int c = 0; c < m; c++) tile_top = st[(size_t)c * R + r] > tile_top ? st[(size_t)c * R + r] : tile_top;
    float new_top = tile_top > top[r] ? tile_top : top[r];
    float shift = new_top == -INFINITY ? 0.0f : new_top;
    float correction = exp_nonpositive(top[r] - shift), sum = 0.0f;
    for (int c = 0; c < m; c++) {
      float *w = st + (size_t)c * R + r;
      *w = exp_nonpositive(*w - shift); /* 0 from -inf */
      sum += *w;
    }
    total[r] = total[r] * correction + sum;
    if (correction != 1.0f)
      for (int j = 0; j < d; j++) o[(size_t)r * d + j] *= correction;
    top[r] = new_top;
  }
}

#ifdef HAVE_X86_VECTORS
/* out (6 x 16, rows ldo apart) = (accumulate ? out : 0) + x (6 x k: element (i, t) at
 * x[i * ldx + t * xs]) times y (k x 16, rows ldy apart), in twelve registers, named (an
 * array of them would be kept in memory by GCC at -O2). Both of a tile's products are
 * made of these blocks: the scores with x a key tile's rows, the values with x st's
 * columns. */
#define ROWS_6(X) X(0) X(1) X(2) X(3) X(4) X(5)
AVX2 static inline __attribute__((always_inline)) void block_6x16(
    const float *x, int ldx, int xs, const float *y, int ldy, int k, float *out, int ldo,
    int accumulate) {
#define START(i)                                                                 \
  __m256 lo##i = accumulate ? _mm256_loadu_ps(out + i * ldo) : _mm256_setzero_ps(); \
  __m256 hi##i = accumulate ? _mm256_loadu_ps(out + i * ldo + 8) : _mm256_setzero_ps();
  ROWS_6(START)
#undef START
  for (int t = 0; t < k; t++) {
    const float *xt = x + (size_t)t * xs;
    __m256 y0 = _mm256_loadu_ps(y + (size_t)t * ldy), y1 = _mm256_loadu_ps(y + (size_t)t * ldy + 8);
#define STEP(i)                                          \
  {                                                      \
    __m256 w = _mm256_broadcast_ss(xt + i * ldx);        \
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

/* The same for one row of x (the rows past the last block of six). */
AVX2 static inline void block_1x16(const float *x, int xs, const float *y, int ldy, int k,
                                   float *out, int accumulate) {
  __m256 lo = accumulate ? _mm256_loadu_ps(out) : _mm256_setzero_ps();
  __m256 hi = accumulate ? _mm256_loadu_ps(out + 8) : _mm256_setzero_ps();
  for (int t = 0; t < k; t++) {
    __m256 w = _mm256_broadcast_ss(x + (size_t)t * xs);
    lo = _mm256_fmadd_ps(w, _mm256_loadu_ps(y + (size_t)t * ldy), lo);
    hi = _mm256_fmadd_ps(w, _mm256_loadu_ps(y + (size_t)t * ldy + 8), hi);
  }
  _mm256_storeu_ps(out, lo);
  _mm256_storeu_ps(out + 8, hi);
}

AVX2 static void scores_avx2(const float *kt, const float *at, int m, int d, int R, float *st) {
  int full = m / 6 * 6;
  for (int c = 0; c < full; c += 6)
    for (int r = 0; r < R; r += 16)
      block_6x16(kt + (size_t)c * d, d, 1, at + r, R, d, st + (size_t)c * R + r, R, 0);
  for (int c = full; c < m; c++)
    for (int r = 0; r < R; r += 16)
      block_1x16(kt + (size_t)c * d, 1, at + r, R, d, st + (size_t)c * R + r, 0);
}

/* The values in 6 x 16 blocks (heads a multiple of 16 wide, else the plain form). */
AVX2 static void values_avx2(const float *st, const float *vt, int R, int m, int d, float *o) {
  if (d % 16) {
    values_plain(st, vt, R, m, d, o);
    return;
  }
  int full = R / 6 * 6;
  for (int j = 0; j < d; j += 16)
    for (int r = 0; r < full; r += 6)
      block_6x16(st + r, 1, R, vt + j, d, m, o + (size_t)r * d + j, d, 1);
  for (int r = full; r < R; r++)
    for (int j = 0; j < d; j += 16) block_1x16(st + r, R, vt + j, d, m, o + (size_t)r * d + j, 1);
}

AVX2 static void softmax_avx2(float *st, int m, int R, float *top, float *total, float *o, int d) {
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  for (int r = 0; r < R; r += LANES) {
    __m256 tile_top = minus_inf;
    for (int c = 0; c < m; c++) tile_top = _mm256_max_ps(_mm256_loadu_ps(st + (size_t)c * R + r), tile_top);
    __m256 old_top = _mm256_loadu_ps(top + r), new_top = _mm256_max_ps(tile_top, old_top);
    __m256 shift = _mm256_blendv_ps(new_top, _mm256_setzero_ps(),
                                    _mm256_cmp_ps(new_top, minus_inf, _CMP_EQ_OQ));
    __m256 sum = _mm256_setzero_ps();
    for (int c = 0; c < m; c++) {
      float *w = st + (size_t)c * R + r;
      __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(w), shift)); /* 0 from -inf */
      _mm256_storeu_ps(w, e);
      sum = _mm256_add_ps(sum, e);
    }
    float correction[LANES];
    _mm256_storeu_ps(correction, exp_nonpositive8(_mm256_sub_ps(old_top, shift)));
    _mm256_storeu_ps(total + r, _mm256_add_ps(
        _mm256_mul_ps(_mm256_loadu_ps(total + r), _mm256_loadu_ps(correction)), sum));
    _mm256_storeu_ps(top + r, new_top);
    for (int l = 0; l < LANES; l++) {
      if (correction[l] == 1.0f) continue;
      __m256 factor = _mm256_set1_ps(correction[l]);
      float *row = o + (size_t)(r + l) * d;
      int j = 0;
      for (; j + LANES <= d; j += LANES) _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), factor));
      for (; j < d; j++) row[j] *= correction[l];
    }
  }
}

static void tile_scores(const float *kt, const float *at, int m, int d, int R, float *st) {
  if (avx2_here())
    scores_avx2(kt, at, m, d, R, st);
  else
    scores_plain(kt, at, m, d, R, st);
}
static void tile_values(const float *st, const float *vt, int R, int m, int d, float *o) {
  if (avx2_here())
    values_avx2(st, vt, R, m, d, o);
  else
    values_plain(st, vt, R, m, d, o);
}
static void tile_softmax(float *st, int m, int R, float *top, float *total, float *o, int d) {
  if (avx2_here())
    softmax_avx2(st, m, R, top, total, o, d);
  else
    softmax_plain(st, m, R, top, total, o, d);
}
#else
#define tile_scores scores_plain
#define tile_values values_plain
#define tile_softmax softmax_plain
#endif

/* The task of KV head g over the query positions t0 .. t1 - 1, with the part's scratch
 * (at, st, o, top, total) and room for its rows' positions. */
static void prefill_task(const prefill_job *job, int g, int t0, int t1, float *scratch,
                         int64_t *row_pos) {
  int d = job->d, group = job->heads / job->kv_heads, n = t1 - t0, rows = group * n;
  int R = padded_rows(rows);
  float *at = scratch, *st = at + (size_t)d * R, *o = st + (size_t)PREFILL_KEYS * R;
  float *top = o + (size_t)R * d, *total = top + R;
  int64_t q_min = job->q_pos[t0], q_max = job->q_pos[t0];
  for (int t = t0; t < t1; t++) {
    q_min = job->q_pos[t] < q_min ? job->q_pos[t] : q_min;
    q_max = job->q_pos[t] > q_max ? job->q_pos[t] : q_max;
  }
  for (int r = 0; r < R; r++) { /* row r: head g * group + r / n, position t0 + r % n */
    if (r < rows) {
      const float *qr = job->q + ((size_t)(g * group + r / n) * job->tq + t0 + r % n) * d;
      for (int j = 0; j < d; j++) at[(size_t)j * R + r] = qr[j] * job->scale; /* (q * scale) @ k^T */
      row_pos[r] = job->q_pos[t0 + r % n];
    } else { /* padding: a copy of row 0's position, zero queries */
      for (int j = 0; j < d; j++) at[(size_t)j * R + r] = 0.0f;
      row_pos[r] = row_pos[0];
    }
    top[r] = -INFINITY, total[r] = 0.0f;
  }
  memset(o, 0, sizeof(float) * R * d);
  const float *keys = job->k + (size_t)g * job->kv_step, *values = job->v + (size_t)g * job->kv_step;
  for (int tile = 0, k0 = 0; k0 < job->tk; tile++, k0 += PREFILL_KEYS) {
    int64_t k_min = job->tile_min[tile], k_max = job->tile_max[tile];
    if (k_min > q_max || (job->window > 0 && k_max <= q_min - job->window)) continue;
    int masked = k_max > q_min || (job->window > 0 && k_min <= q_max - job->window);
    int m = job->tk - k0 < PREFILL_KEYS ? job->tk - k0 : PREFILL_KEYS;
    tile_scores(keys + (size_t)k0 * d, at, m, d, R, st);
    if (masked)
      for (int c = 0; c < m; c++) {
        int64_t key = job->k_pos[k0 + c];
        float *sc = st + (size_t)c * R;
        for (int r = 0; r < R; r++) /* unseen: a later key, or one behind the window */
          if (key > row_pos[r] || (job->window > 0 && key <= row_pos[r] - job->window))
            sc[r] = -INFINITY;
      }
    tile_softmax(st, m, R, top, total, o, d);
    tile_values(st, values + (size_t)k0 * d, R, m, d, o);
  }
  for (int r = 0; r < rows; r++) {
    size_t at_out = (size_t)(g * group + r / n) * job->tq + t0 + r % n;
    float *out = job->out + at_out * d;
    for (int j = 0; j < d; j++) out[j] = total[r] > 0.0f ? o[(size_t)r * d + j] / total[r] : 0.0f;
    job->lse[at_out] = total[r] > 0.0f ? logf(total[r]) + top[r] : -INFINITY;
  }
}

/* One part's tasks: every parts-th of (KV head, block of task_positions positions). */
static void prefill_part(void *args, int part, int parts) {
  prefill_job *job = args;
  int group = job->heads / job->kv_heads, positions = task_positions(group);
  int blocks = (job->tq + positions - 1) / positions;
  size_t R = padded_rows(group * positions), d = job->d;
  float *scratch = malloc(sizeof(float) * (d * R * 2 + PREFILL_KEYS * R + R * 2));
  int64_t *row_pos = malloc(sizeof(int64_t) * R);
  if (scratch == NULL || row_pos == NULL) {
    __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
  } else {
    for (int task = part; task < job->kv_heads * blocks; task += parts) {
      int g = task % job->kv_heads, t0 = task / job->kv_heads * positions;
      prefill_task(job, g, t0, t0 + positions < job->tq ? t0 + positions : job->tq,
                   scratch, row_pos);
    }
  }
  free(scratch);
  free(row_pos);
}

/* The partial attention of the queries over the keys (see the top); 0 on success, -1
 * where scratch could not be had (out and lse are then incomplete). */
int spmd_cp_prefill_attend(const float *q, const float *k, const float *v,
                           const int64_t *q_pos, const int64_t *k_pos, int heads,
                           int kv_heads, int tq, int tk, int d, int64_t kv_step, float scale,
                           int64_t window, float *out, float *lse) {
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
  prefill_job job = {q, k, v, q_pos, k_pos, heads, kv_heads, tq, tk, d, kv_step, scale, window,
                     out, lse, bounds, bounds + tiles, 0};
  run_parallel(prefill_part, &job);
  free(bounds);
  return job.failed ? -1 : 0;
}

#endif
