/*
 * A batched decode step's work between its collectives (engine/decode/native_batched.py):
 * B sequences after one shared prefix, one token each. A rank runs its run of the B
 * rows through the layer's products (one cblas_sgemm of its rows a matrix: the
 * preloaded forward reads a packed weight once for all of them, gemv_forward.c's
 * batched_product), and attends all B queries over its share of the prefix (the
 * prefix's keys read once for every row where no sliding window separates them) and
 * over each sequence's own tail (its tokens after the prefix that this rank holds),
 * merging the two exactly as two ranks' partials merge. Included by decode_step.c: the
 * same structs, pool and row kernels.
 *
 * Layouts (float32, row-major): a step's rows of q/k/v (rows x (heads + 2 kv_heads) d);
 * a tail's keys and values (slots x kv_heads x capacity x d), each entry rounded as the
 * prefix's cache stores one (a half-precision cache's values in float32); the partials
 * (rows x heads x (d + 2)).
 */

/* c (rows x ldc) = x (rows x k, ldx apart) times W' (+ bias): one product for every
 * row, on the pool for one row (split by W's rows), else one cblas_sgemm (the preloaded
 * forward spreads a packed weight's rows over the pool it was lent). */
static void rows_product(const matrix *w, int rows, const float *x, int ldx, float *c,
                         int ldc) {
  if (rows <= 0) return;
  if (rows == 1) {
    product(w, x, c);
    return;
  }
  sgemm(ROW_MAJOR, NO_TRANS, TRANS, rows, w->rows, w->cols, 1.0f, x, ldx, w->weights, w->ld,
        0.0f, c, ldc);
  if (w->bias != NULL)
    for (int r = 0; r < rows; r++)
      for (int i = 0; i < w->rows; i++) c[(size_t)r * ldc + i] += w->bias[i];
}

static int qkv_width(const layer *l) {
  int width = 0;
  for (int p = 0; p < l->qkv_pieces; p++) width += l->qkv[p].rows;
  return width;
}

/* Per row: h += added (where given), then q/k/v of RMSNorm(h) into qkv (rows x width). */
void spmd_cp_batch_qkv(const layer *l, int rows, float *h, const float *added, float *normed,
                       float *qkv) {
  int dim = l->dim, width = qkv_width(l), column = 0;
  for (int r = 0; r < rows; r++) {
    float *row = h + (size_t)r * dim;
    if (added != NULL) add_into(row, added + (size_t)r * dim, dim);
    rms_norm(row, l->input_norm, l->input_eps, dim, normed + (size_t)r * dim);
  }
  for (int p = 0; p < l->qkv_pieces; p++) {
    rows_product(&l->qkv[p], rows, normed, dim, qkv + column, width);
    column += l->qkv[p].rows;
  }
}

/* The rows' output projections: attention (rows x heads d) times W_o into part. */
void spmd_cp_batch_output(const layer *l, int rows, const float *attention, float *part) {
  rows_product(&l->o, rows, attention, l->heads * l->head_dim, part, l->dim);
}

/* Per row as spmd_cp_decode_mlp: h += the attention's output (normed first where the
 * layer norms it), the MLP of RMSNorm(h) into part (normed where the layer norms it).
 * `scratch`: rows x (dim + 2 x gate rows) floats. */
void spmd_cp_batch_mlp(const layer *l, int rows, float *h, float *added, float *scratch,
                       float *part) {
  int dim = l->dim, hidden = l->gate.rows;
  float *normed = scratch, *gate = normed + (size_t)rows * dim;
  float *up = gate + (size_t)rows * hidden;
  for (int r = 0; r < rows; r++) {
    float *row = h + (size_t)r * dim, *add = added + (size_t)r * dim;
    if (l->attention_out_norm != NULL)
      rms_norm(add, l->attention_out_norm, l->attention_out_eps, dim, add);
    add_into(row, add, dim);
    rms_norm(row, l->post_norm, l->post_eps, dim, normed + (size_t)r * dim);
  }
  rows_product(&l->gate, rows, normed, dim, gate, hidden);
  rows_product(&l->up, rows, normed, dim, up, hidden);
  if (l->activation == ACT_GELU_TANH)
    geglu(gate, up, rows * hidden, gate);
  else
    swiglu(gate, up, rows * hidden, gate);
  rows_product(&l->down, rows, gate, hidden, part, dim);
  if (l->mlp_out_norm != NULL)
    for (int r = 0; r < rows; r++) {
      float *row = part + (size_t)r * dim;
      rms_norm(row, l->mlp_out_norm, l->mlp_out_eps, dim, row);
    }
}

/* Per row: h += added, normed = RMSNorm(h) (the final norm, before the LM head). */
void spmd_cp_batch_final_norm(int rows, int dim, float *h, const float *added,
                              const float *norm, float eps, float *normed) {
  for (int r = 0; r < rows; r++) {
    float *row = h + (size_t)r * dim;
    add_into(row, added + (size_t)r * dim, dim);
    rms_norm(row, norm, eps, dim, normed + (size_t)r * dim);
  }
}

/* c (rows x ldc) = x (rows x k) times W' (the LM head's rows this rank holds). */
void spmd_cp_batch_product(const matrix *w, int rows, const float *x, float *c, int ldc) {
  rows_product(w, rows, x, w->cols, c, ldc);
}

/* A thread's scratch: a shared pass's gathered queries, their partials and their
 * scores over up to `keys` keys. */
static long per_thread_floats(int heads, int kv_heads, int head_dim, int keys) {
  long group = heads / kv_heads, chunk = MAX_GROUP / group * group; /* rows a pass */
  keys = keys > head_dim ? keys : head_dim;
  return chunk * (head_dim + head_dim + PARTIAL_EXTRA + (long)keys);
}

/* Floats of the scratch spmd_cp_batch_attend takes: a partial of every row and head for
 * each of the pool's threads and for the tails, RoPE's rows, and each thread's own over
 * `length` prefix keys and tails of `tail_capacity`. */
long spmd_cp_batch_scratch(int heads, int kv_heads, int head_dim, int rows, int length,
                           int tail_capacity) {
  int keys = length > tail_capacity ? length : tail_capacity;
  return (pool.threads + 1L) * rows * heads * (head_dim + PARTIAL_EXTRA) +
         (long)heads * head_dim + pool.threads * per_thread_floats(heads, kv_heads, head_dim, keys);
}

typedef struct {
  const layer *l;
  const batch_attention *a;
  const float *qkv;
  int width;          /* floats from one row's q/k/v to the next's */
  float *partials;    /* threads x rows x heads x (d + 2) */
  float *thread_scratch; /* threads x per-thread floats */
  long per_thread;
} batch_attention_job;

/* A new key or value into a (float32) tail, rounded as the prefix's cache would store
 * it (`kind`): the values one sequence's step would read back from its cache. */
static void tail_row(const float *x, int d, int kind, float *out) {
  if (kind == KV_FLOAT32) {
    memcpy(out, x, d * sizeof(float));
    return;
  }
  uint16_t half[MAX_HEAD_DIM];
  half_row(x, d, kind, half);
  widen_row(half, d, kind, out);
}

/* Partial of KV head g's group for rows [r0, r1) over prefix rows [start, start +
 * count), every row seeing them all: their queries gathered into one block, the keys
 * read once for them, the block's partials scattered to each row's place. */
static void shared_pass(const batch_attention_job *job, int g, int r0, int r1, int start,
                        int count, float *scratch, float *partials) {
  const layer *l = job->l;
  int d = l->head_dim, heads = l->heads, group = heads / l->kv_heads;
  int width = d + PARTIAL_EXTRA, chunk = MAX_GROUP / group;
  float *q = scratch, *o = q + (size_t)chunk * group * d, *scores = o + (size_t)chunk * group * width;
  for (int first = r0; first < r1; first += chunk) {
    int n = r1 - first < chunk ? r1 - first : chunk;
    for (int r = 0; r < n; r++)
      memcpy(q + (size_t)r * group * d, job->qkv + (size_t)(first + r) * job->width + (size_t)g * group * d,
             (size_t)group * d * sizeof(float));
    attend_rows(l, g, q, n * group, start, count, 0, scores, count > 0 ? count : 1, o);
    for (int r = 0; r < n; r++)
      memcpy(partials + ((size_t)(first + r) * heads + (size_t)g * group) * width,
             o + (size_t)r * group * width, (size_t)group * width * sizeof(float));
  }
}

/* A thread's share of every row's prefix: its part of each row's range of keys. */
static void batch_prefix_part(void *args, int part, int parts) {
  const batch_attention_job *job = args;
  const layer *l = job->l;
  const batch_attention *a = job->a;
  int d = l->head_dim, heads = l->heads, group = heads / l->kv_heads, width = d + PARTIAL_EXTRA;
  float *partials = job->partials + (size_t)part * a->rows * heads * width;
  float *scratch = job->thread_scratch + (size_t)part * job->per_thread;
  for (int g = 0; g < l->kv_heads; g++) {
    if (a->firsts == NULL) {
      int start = (int)((long long)a->length * part / parts);
      int end = (int)((long long)a->length * (part + 1) / parts);
      shared_pass(job, g, 0, a->rows, start, end - start, scratch, partials);
      continue;
    }
    for (int r = 0; r < a->rows; r++) { /* a sliding window: each row its own range */
      int count = a->length - a->firsts[r];
      int start = a->firsts[r] + (int)((long long)count * part / parts);
      int end = a->firsts[r] + (int)((long long)count * (part + 1) / parts);
      attend_rows(l, g, job->qkv + (size_t)r * job->width + (size_t)g * group * d, group, start,
                  end - start, 0, scratch, end - start > 0 ? end - start : 1,
                  partials + ((size_t)r * heads + (size_t)g * group) * width);
    }
  }
}

/* Every row's partial over its own tail here (the caller's thread: a few entries). */
static void batch_tails(const layer *l, const batch_attention *a, const float *qkv, int width,
                        float *scores, float *partials) {
  int d = l->head_dim, heads = l->heads, kv = l->kv_heads, group = heads / kv;
  int part_width = d + PARTIAL_EXTRA;
  layer tail = *l;
  tail.kv_kind = KV_FLOAT32, tail.capacity = a->tail_capacity;
  for (int r = 0; r < a->rows; r++) {
    size_t slot = (size_t)a->slots[r] * kv * a->tail_capacity * d;
    tail.keys = a->tail_keys + slot, tail.values = a->tail_values + slot;
    int start = a->tail_firsts[r], count = a->tail_lengths[r] - start;
    for (int g = 0; g < kv; g++)
      attend_rows(&tail, g, qkv + (size_t)r * width + (size_t)g * group * d, group, start, count,
                  0, scores, count > 0 ? count : 1,
                  partials + ((size_t)r * heads + (size_t)g * group) * part_width);
  }
}

/* A layer's attention for a step's rows, whose full q/k/v (every rank's rows, after the
 * gather) are `qkv`: q/k norms and each row's RoPE in place, the k and v of the rows
 * this rank stores written to their tails, then each row's partial over this rank's
 * prefix and its own tail, merged into `out` (rows x heads x (d + 2)). `scratch`:
 * spmd_cp_batch_scratch(...) floats. */
void spmd_cp_batch_attend(const layer *l, const batch_attention *a, float *qkv, float *scratch,
                          float *out) {
  /* A row's full q/k/v (a split layer's pieces hold only this rank's columns). */
  int d = l->head_dim, heads = l->heads, kv = l->kv_heads, width = (heads + 2 * kv) * d;
  int part_width = d + PARTIAL_EXTRA, threads = pool.threads;
  size_t block = (size_t)a->rows * heads * part_width;
  float *partials = scratch, *rotated = partials + (threads + 1) * block;
  float *thread_scratch = rotated + (size_t)heads * d;
  for (int r = 0; r < a->rows; r++) {
    float *q = qkv + (size_t)r * width, *k = q + (size_t)heads * d, *v = k + (size_t)kv * d;
    if (l->q_norm != NULL) {
      norm_heads(q, heads, d, l->q_norm, l->qk_eps);
      norm_heads(k, kv, d, l->k_norm, l->qk_eps);
    }
    if (a->rotations != NULL && a->rotations[r] != NULL) {
      rotate(q, heads, d, a->rotations[r], rotated);
      rotate(k, kv, d, a->rotations[r], rotated);
    }
    if (a->stores[r] >= 0)
      for (int g = 0; g < kv; g++) {
        size_t at = (((size_t)a->slots[r] * kv + g) * a->tail_capacity + a->stores[r]) * d;
        tail_row(k + (size_t)g * d, d, l->kv_kind, a->tail_keys + at);
        tail_row(v + (size_t)g * d, d, l->kv_kind, a->tail_values + at);
      }
  }
  int keys = a->length > a->tail_capacity ? a->length : a->tail_capacity;
  long per_thread = per_thread_floats(heads, kv, d, keys);
  batch_attention_job job = {l, a, qkv, width, partials, thread_scratch, per_thread};
  if (threads == 1)
    batch_prefix_part(&job, 0, 1);
  else
    run_parallel(batch_prefix_part, &job);
  batch_tails(l, a, qkv, width, thread_scratch, partials + threads * block);
  merge_partials(threads + 1, a->rows * heads, d, l->scale, partials, block, 0, out);
}

/* Rows of the attention output (count x heads x d, `count` = rows x heads) from
 * `parts` partials of them `part_stride` floats apart (the ranks' gathered, this rank's
 * rows of each). */
void spmd_cp_batch_merge(int parts, int count, int d, float scale, const float *partials,
                         long part_stride, float *out) {
  merge_partials(parts, count, d, scale, partials, (size_t)part_stride, 1, out);
}
