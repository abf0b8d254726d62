/*
 * A decode step's work between its collectives, on the CPU (engine/decode/native_decode.py).
 *
 * Through MLX a decode step of SmolLM2-135M is about 1,500 graph nodes, each built on
 * the Python thread and handed to MLX's compute thread with its buffers malloc'ed: at
 * two ranks on two cores that costs as much as the step's products. Here one rank's
 * part of a layer is four calls, each a few loops over one token's vectors around the
 * same cblas_sgemm calls MLX makes (so kernels/gemv_forward.c's matrix-vector forward,
 * quantized shadows and attention kernels serve both paths): the products are MLX's,
 * the elementwise work (RMSNorm, softmax, SwiGLU, the merge of the ranks' partials) is
 * the same arithmetic in float32 in another order, in AVX2 where the CPU has it. No
 * allocation: the caller owns every buffer.
 *
 * Layouts (float32, row-major): a weight is (outputs x inputs) with rows `ld` apart, as
 * nn.Linear holds it; the KV cache (kv_heads x capacity x head_dim); a rank's attention
 * partial (kv_heads x group x (head_dim + 2)): the unnormalized values, the sum of the
 * probabilities and the largest unscaled score, block.decode_partial_packed's layout.
 */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cpu_features.h"
#include "exp_polynomial.h"
#include "half_attention.h"
#include "kv_half.h"
#include "thread_pool.h"

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

int spmd_cp_decode_set_threads(int threads) { return pool_set_threads(threads); }

/* The pool lent to the preloaded forward's batched products (one pool a rank: two
 * pools' spinning workers would take each other's cores). */
void spmd_cp_decode_run_parallel(task_fn task, void *args) { run_parallel(task, args); }
int spmd_cp_decode_threads(void) { return pool.threads; }

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
static sgemm_fn sgemm;

/* Whether the process has a cblas_sgemm in its global scope (the preloaded forward or
 * the BLAS: blas/reexec.py preloads them); 0 where not, and the step stays MLX's. */
int spmd_cp_decode_ready(void) {
  if (sgemm == NULL) sgemm = (sgemm_fn)dlsym(RTLD_DEFAULT, "cblas_sgemm");
  return sgemm != NULL;
}

typedef struct {
  const float *weights; /* rows x cols, rows ld apart */
  const float *bias;    /* rows, or NULL */
  int rows, cols, ld;
} matrix;

enum { MAX_PIECES = 3, MAX_GROUP = 64 }; /* engine/decode/native_decode.py checks both */
/* A partial's head: d unnormalized values, then the probabilities' sum and the largest
 * unscaled score. */
enum { PARTIAL_EXTRA = 2 };

/* One rank's part of one layer, filled once by engine/decode/native_decode.py (the cache's
 * pointers again whenever it grows). */
typedef struct {
  int dim, heads, kv_heads, head_dim;
  const float *input_norm, *post_norm; /* (dim) */
  float input_eps, post_eps;
  const float *q_norm, *k_norm; /* (head_dim) each, or NULL (Qwen3 has them) */
  float qk_eps;
  int qkv_pieces; /* this rank's q/k/v outputs: consecutive rows of up to 3 matrices */
  matrix qkv[MAX_PIECES];
  matrix o;              /* rows of W_o: this rank's outputs */
  matrix gate, up, down; /* rows of gate and up, the matching columns of down */
  void *keys, *values;   /* this rank's cache: kv_heads x capacity x head_dim */
  int capacity;
  float scale;
  int kv_kind; /* the cache's elements: KV_FLOAT32, KV_FLOAT16 or KV_BFLOAT16 */
  int activation; /* the MLP's gate activation: ACT_SILU or ACT_GELU_TANH */
  /* (dim) each, or NULL: norms of the attention's and the MLP's outputs before each is
   * added to the residual (Gemma 3's post-attention and post-feed-forward norms) */
  const float *attention_out_norm, *mlp_out_norm;
  float attention_out_eps, mlp_out_eps;
} layer;

/* What a batched step's attention reads besides the layer (batch_step.h;
 * engine/decode/native_batched.py fills it). */
typedef struct {
  int rows;
  const float *const *rotations; /* per row its position's (d x d) RoPE matrix, or NULL */
  const int *stores;      /* per row the tail row its k/v go to here, or -1 */
  const int *slots;       /* per row its tail's slot */
  const int *firsts;      /* per row the first prefix row it sees, or NULL: 0 for all */
  int length;             /* the prefix rows this rank holds */
  float *tail_keys, *tail_values; /* float32 (slots x kv_heads x capacity x d) */
  int tail_capacity;
  const int *tail_firsts; /* per row the first tail row it sees */
  const int *tail_lengths; /* per row its tail's rows here (the new one counted) */
} batch_attention;

/* The MLP's activations: silu(gate) * up (Llama's SwiGLU), gelu_approx(gate) * up
 * (Gemma's, MLX's tanh form of GELU). */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* The structs' layout, for kernels/decode_step.py to check its ctypes copies against:
 * the offset of `field` in struct `type`, its size for the field "", -1 if unknown. */
#define LAYOUT_SIZE(type) {#type, "", sizeof(type)}
#define LAYOUT_FIELD(type, field) {#type, #field, offsetof(type, field)}
static const struct {
  const char *type, *field;
  size_t offset;
} LAYOUT[] = {
    LAYOUT_SIZE(matrix),         LAYOUT_FIELD(matrix, weights),  LAYOUT_FIELD(matrix, bias),
    LAYOUT_FIELD(matrix, rows),  LAYOUT_FIELD(matrix, cols),     LAYOUT_FIELD(matrix, ld),
    LAYOUT_SIZE(layer),          LAYOUT_FIELD(layer, dim),       LAYOUT_FIELD(layer, heads),
    LAYOUT_FIELD(layer, kv_heads), LAYOUT_FIELD(layer, head_dim),
    LAYOUT_FIELD(layer, input_norm), LAYOUT_FIELD(layer, post_norm),
    LAYOUT_FIELD(layer, input_eps), LAYOUT_FIELD(layer, post_eps),
    LAYOUT_FIELD(layer, q_norm), LAYOUT_FIELD(layer, k_norm),   LAYOUT_FIELD(layer, qk_eps),
    LAYOUT_FIELD(layer, qkv_pieces), LAYOUT_FIELD(layer, qkv),   LAYOUT_FIELD(layer, o),
    LAYOUT_FIELD(layer, gate),   LAYOUT_FIELD(layer, up),        LAYOUT_FIELD(layer, down),
    LAYOUT_FIELD(layer, keys),   LAYOUT_FIELD(layer, values),    LAYOUT_FIELD(layer, capacity),
    LAYOUT_FIELD(layer, scale),  LAYOUT_FIELD(layer, kv_kind),  LAYOUT_FIELD(layer, activation),
    LAYOUT_FIELD(layer, attention_out_norm), LAYOUT_FIELD(layer, mlp_out_norm),
    LAYOUT_FIELD(layer, attention_out_eps), LAYOUT_FIELD(layer, mlp_out_eps),
    LAYOUT_SIZE(batch_attention), LAYOUT_FIELD(batch_attention, rows),
    LAYOUT_FIELD(batch_attention, rotations), LAYOUT_FIELD(batch_attention, stores),
    LAYOUT_FIELD(batch_attention, slots), LAYOUT_FIELD(batch_attention, firsts),
    LAYOUT_FIELD(batch_attention, length), LAYOUT_FIELD(batch_attention, tail_keys),
    LAYOUT_FIELD(batch_attention, tail_values), LAYOUT_FIELD(batch_attention, tail_capacity),
    LAYOUT_FIELD(batch_attention, tail_firsts), LAYOUT_FIELD(batch_attention, tail_lengths),
};

long spmd_cp_decode_layout(const char *type, const char *field) {
  for (size_t i = 0; i < sizeof LAYOUT / sizeof LAYOUT[0]; i++)
    if (strcmp(LAYOUT[i].type, type) == 0 && strcmp(LAYOUT[i].field, field) == 0)
      return (long)LAYOUT[i].offset;
  return -1;
}

/* Rows [first, first + count) of c = W x (+ bias): x (1 x k) times those rows of W'
 * through cblas_sgemm, as MLX multiplies a row by a weight's transposed view (each
 * row's sum the same however the rows are split). */
static void product_rows(const matrix *w, const float *x, float *c, int first, int count) {
  if (count <= 0) return;
  sgemm(ROW_MAJOR, NO_TRANS, TRANS, 1, count, w->cols, 1.0f, x, w->cols,
        w->weights + (size_t)first * w->ld, w->ld, 0.0f, c + first, count);
  if (w->bias != NULL)
    for (int i = first; i < first + count; i++) c[i] += w->bias[i];
}

/* Products of up to MAX_PRODUCTS matrices with one vector each, their rows split among
 * the pool's threads in runs of ROW_RUN (whole cache lines of output). */
enum { MAX_PRODUCTS = MAX_PIECES, ROW_RUN = 16 };
typedef struct {
  int count;
  const matrix *w[MAX_PRODUCTS];
  const float *x[MAX_PRODUCTS];
  float *c[MAX_PRODUCTS];
} products;

static void products_part(void *args, int part, int parts) {
  const products *job = args;
  for (int i = 0; i < job->count; i++) {
    int runs = (job->w[i]->rows + ROW_RUN - 1) / ROW_RUN;
    int first = runs * part / parts * ROW_RUN, end = runs * (part + 1) / parts * ROW_RUN;
    end = end < job->w[i]->rows ? end : job->w[i]->rows;
    product_rows(job->w[i], job->x[i], job->c[i], first, end - first);
  }
}

static void run_products(products *job) { run_parallel(products_part, job); }

/* c (n) = W x (+ bias), on the pool. */
static void product(const matrix *w, const float *x, float *c) {
  products job = {1, {w}, {x}, {c}};
  run_products(&job);
}

/* out = x / sqrt(mean(x^2) + eps) * weight, MLX's RMSNorm (sum in double: the mean of
 * n squares, then one rounding). */
static void rms_norm(const float *x, const float *weight, float eps, int n, float *out) {
  double sum = 0.0;
  for (int i = 0; i < n; i++) sum += (double)x[i] * x[i];
  float inverse = 1.0f / sqrtf((float)(sum / n) + eps);
  for (int i = 0; i < n; i++) out[i] = x[i] * inverse * weight[i];
}

/* The scalar forms (any CPU), and the AVX2 ones below where the CPU has AVX2 and FMA:
 * GCC leaves these loops scalar (a float sum or maximum is not reassociated without
 * -ffast-math; the exponent's bit cast stops it too). */

/* p[i] = exp((s[i] - top) * scale) over a row of scores; returns their sum. */
static float softmax_row_plain(const float *s, int n, float top, float scale, float *p) {
  float sum = 0.0f;
  for (int i = 0; i < n; i++) {
    p[i] = exp_nonpositive((s[i] - top) * scale);
    sum += p[i];
  }
  return sum;
}

static float row_max_plain(const float *s, int n) {
  float top = -INFINITY;
  for (int i = 0; i < n; i++) top = s[i] > top ? s[i] : top;
  return top;
}

/* act = silu(gate) * up, with e^-|g| (no overflow): mlx-lm's swiglu, as exp.py's. */
static void swiglu_plain(const float *gate, const float *up, int n, float *act) {
  for (int i = 0; i < n; i++) {
    float g = gate[i];
    float e = exp_nonpositive(g < 0.0f ? g : -g);
    float sigmoid = (g < 0.0f ? e : 1.0f) / (1.0f + e);
    act[i] = g * sigmoid * up[i];
  }
}

/* act = gelu_approx(gate) * up, MLX's 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
 * with tanh(y) = sign(y) (1 - e) / (1 + e), e = e^-2|y| (no overflow). */
#define SQRT_2_OVER_PI 0.7978845608028654f
#define GELU_CUBIC 0.044715f
static void geglu_plain(const float *gate, const float *up, int n, float *act) {
  for (int i = 0; i < n; i++) {
    float g = gate[i], y = SQRT_2_OVER_PI * (g + GELU_CUBIC * (g * g * g));
    float e = exp_nonpositive(-2.0f * fabsf(y)), t = (1.0f - e) / (1.0f + e);
    act[i] = 0.5f * g * (1.0f + (y < 0.0f ? -t : t)) * up[i];
  }
}

#ifdef HAVE_X86_VECTORS
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))
enum { LANES = 8 }; /* floats in an AVX2 register */

/* The sum of v's eight lanes, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)). */
AVX2 static inline float lanes_sum(__m256 v) {
  float lane[LANES];
  _mm256_storeu_ps(lane, v);
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

AVX2 static float softmax_row_avx2(const float *s, int n, float top, float scale, float *p) {
  __m256 sum = _mm256_setzero_ps(), top8 = _mm256_set1_ps(top), scale8 = _mm256_set1_ps(scale);
  int i = 0;
  for (; i + LANES <= n; i += LANES) {
    __m256 e = exp_nonpositive8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), top8),
                                              scale8));
    _mm256_storeu_ps(p + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  return lanes_sum(sum) + softmax_row_plain(s + i, n - i, top, scale, p + i);
}

AVX2 static float row_max_avx2(const float *s, int n) {
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  int i = 0;
  for (; i + LANES <= n; i += LANES) top8 = _mm256_max_ps(_mm256_loadu_ps(s + i), top8);
  float lane[LANES], top = row_max_plain(s + i, n - i);
  _mm256_storeu_ps(lane, top8);
  for (int l = 0; l < LANES; l++) top = lane[l] > top ? lane[l] : top;
  return top;
}

AVX2 static void swiglu_avx2(const float *gate, const float *up, int n, float *act) {
  __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
  int i = 0;
  for (; i + LANES <= n; i += LANES) {
    __m256 g = _mm256_loadu_ps(gate + i);
    __m256 e = exp_nonpositive8(_mm256_or_ps(g, sign)); /* e^-|g| */
    __m256 negative = _mm256_cmp_ps(g, zero, _CMP_LT_OQ);
    __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
    _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
  }
  swiglu_plain(gate + i, up + i, n - i, act + i);
}

AVX2 static void geglu_avx2(const float *gate, const float *up, int n, float *act) {
  __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
  __m256 c = _mm256_set1_ps(SQRT_2_OVER_PI), cubic = _mm256_set1_ps(GELU_CUBIC);
  __m256 minus_two = _mm256_set1_ps(-2.0f);
  int i = 0;
  for (; i + LANES <= n; i += LANES) {
    __m256 g = _mm256_loadu_ps(gate + i);
    __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    __m256 y = _mm256_mul_ps(c, _mm256_add_ps(g, _mm256_mul_ps(cubic, g3)));
    __m256 e = exp_nonpositive8(_mm256_mul_ps(minus_two, _mm256_andnot_ps(sign, y)));
    __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    t = _mm256_or_ps(t, _mm256_and_ps(y, sign)); /* y's sign onto tanh(|y|) */
    __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, t));
    _mm256_storeu_ps(act + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
  }
  geglu_plain(gate + i, up + i, n - i, act + i);
}

static int avx2_here(void) {
  static int known = -1;
  if (known < 0) known = cpu_has_avx2_fma(0);
  return known;
}

static float softmax_row(const float *s, int n, float top, float scale, float *p) {
  return avx2_here() ? softmax_row_avx2(s, n, top, scale, p)
                     : softmax_row_plain(s, n, top, scale, p);
}
static float row_max(const float *s, int n) {
  return avx2_here() ? row_max_avx2(s, n) : row_max_plain(s, n);
}
static void swiglu(const float *gate, const float *up, int n, float *act) {
  if (avx2_here())
    swiglu_avx2(gate, up, n, act);
  else
    swiglu_plain(gate, up, n, act);
}
static void geglu(const float *gate, const float *up, int n, float *act) {
  if (avx2_here())
    geglu_avx2(gate, up, n, act);
  else
    geglu_plain(gate, up, n, act);
}
#else
#define softmax_row softmax_row_plain
#define row_max row_max_plain
#define swiglu swiglu_plain
#define geglu geglu_plain
#endif

static void add_into(float *h, const float *x, int n) {
  for (int i = 0; i < n; i++) h[i] += x[i];
}

/* h += added (where given), then this rank's q/k/v outputs of RMSNorm(h) into qkv. */
void spmd_cp_decode_qkv(const layer *l, float *h, const float *added, float *normed,
                        float *qkv) {
  if (added != NULL) add_into(h, added, l->dim);
  rms_norm(h, l->input_norm, l->input_eps, l->dim, normed);
  products job = {l->qkv_pieces, {0}, {0}, {0}};
  for (int p = 0; p < l->qkv_pieces; p++) {
    job.w[p] = &l->qkv[p], job.x[p] = normed, job.c[p] = qkv;
    qkv += l->qkv[p].rows;
  }
  run_products(&job);
}

/* RoPE of `count` heads in place: x (count x d) times the (d x d) rotation, as MLX's
 * matmul does it (engine/decode/one_token.py's matrix). */
static void rotate(float *x, int count, int d, const float *rotation, float *scratch) {
  sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, count, d, d, 1.0f, x, d, rotation, d, 0.0f, scratch,
        d);
  memcpy(x, scratch, (size_t)count * d * sizeof(float));
}

static void norm_heads(float *x, int count, int d, const float *weight, float eps) {
  for (int h = 0; h < count; h++) rms_norm(x + (size_t)h * d, weight, eps, d, x + (size_t)h * d);
}

/* KV head g's key and value of one token (d floats each) into cache row `row`. */
static void store_kv(const layer *l, int g, int row, const float *k, const float *v) {
  int d = l->head_dim;
  size_t at = ((size_t)g * l->capacity + row) * d;
  if (l->kv_kind == KV_FLOAT32) {
    memcpy((float *)l->keys + at, k, d * sizeof(float));
    memcpy((float *)l->values + at, v, d * sizeof(float));
  } else {
    half_row(k, d, l->kv_kind, (uint16_t *)l->keys + at);
    half_row(v, d, l->kv_kind, (uint16_t *)l->values + at);
  }
}

/* Query rows up to which a half-precision cache's keys are widened in registers, four
 * rows a pass over them; more (a batched step's) widen a tile of keys once for all
 * (2 cores, 16 jobs after a 2,600-token document, N = 2: batched steps of 8 and 16
 * 1.16-1.18x faster, medians of 3 interleaved runs). */
enum { HALF_FUSED_ROWS = 8 };

/* A half-precision cache's scores: `group` query rows q (group x d) times `count` keys, each
 * key widened in registers (half_attention.h) or, without AVX2, a tile of keys widened
 * into float32 at a time and multiplied as a float32 cache's keys are (into scores'
 * rows, `stride` apart). */
static void half_scores(const layer *l, const uint16_t *keys, const float *q, int group,
                        int count, float *scores, int stride) {
  int d = l->head_dim, tile = KV_TILE_FLOATS / d;
#ifdef HAVE_X86_VECTORS
  if (half_fused_here(d) && group <= HALF_FUSED_ROWS) {
    half_scores_fused(keys, l->kv_kind, q, group, d, count, scores, stride);
    return;
  }
#endif
  float widened[KV_TILE_FLOATS];
  for (int t = 0; t < count; t += tile) {
    int rows = count - t < tile ? count - t : tile;
    widen_row(keys + (size_t)t * d, rows * d, l->kv_kind, widened);
    sgemm(ROW_MAJOR, NO_TRANS, TRANS, group, rows, d, 1.0f, q, d, widened, d, 0.0f,
          scores + t, stride);
  }
}

/* o (group rows, `width` apart) = p (group x count, rows `stride` apart) times `count`
 * values, a tile widened at a time, its products added to the tiles' before. */
static void half_values(const layer *l, const uint16_t *values, const float *p, int group,
                        int count, int stride, float *o, int width) {
  int d = l->head_dim, tile = KV_TILE_FLOATS / d;
#ifdef HAVE_X86_VECTORS
  if (half_fused_here(d) && group <= HALF_FUSED_ROWS) {
    half_values_fused(values, l->kv_kind, p, group, stride, d, count, o, width);
    return;
  }
#endif
  float widened[KV_TILE_FLOATS];
  for (int t = 0; t < count; t += tile) {
    int rows = count - t < tile ? count - t : tile;
    widen_row(values + (size_t)t * d, rows * d, l->kv_kind, widened);
    sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, group, d, rows, 1.0f, p + t, stride, widened, d,
          t == 0 ? 0.0f : 1.0f, o, width);
  }
}

/* `group` query rows q (group x d) of KV head g over cache rows [start, start + count):
 * into o (group rows, `width` apart) the partial or, `normalized`, the output.
 * `scores`: group rows of at least `count` floats, `stride` apart. */
static void attend_rows(const layer *l, int g, const float *q, int group, int start,
                        int count, int normalized, float *scores, int stride, float *o) {
  int d = l->head_dim;
  int width = normalized ? d : d + PARTIAL_EXTRA;
  if (count == 0) { /* nothing cached here: zero sums, a max of -inf (weighed 0) */
    for (int r = 0; r < group; r++) {
      memset(o + (size_t)r * width, 0, (d + 1) * sizeof(float));
      o[(size_t)r * width + d + 1] = -INFINITY;
    }
    return;
  }
  size_t first = ((size_t)g * l->capacity + start) * d;
  if (l->kv_kind == KV_FLOAT32)
    sgemm(ROW_MAJOR, NO_TRANS, TRANS, group, count, d, 1.0f, q, d,
          (const float *)l->keys + first, d, 0.0f, scores, stride);
  else
    half_scores(l, (const uint16_t *)l->keys + first, q, group, count, scores, stride);
  float top[MAX_GROUP], total[MAX_GROUP];
  for (int r = 0; r < group; r++) {
    float *row = scores + (size_t)r * stride;
    top[r] = row_max(row, count);
    total[r] = softmax_row(row, count, top[r], l->scale, row);
  }
  if (l->kv_kind == KV_FLOAT32)
    sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, group, d, count, 1.0f, scores, stride,
          (const float *)l->values + first, d, 0.0f, o, width);
  else
    half_values(l, (const uint16_t *)l->values + first, scores, group, count, stride, o,
                width);
  for (int r = 0; r < group; r++) {
    float *row = o + (size_t)r * width;
    if (normalized) {
      for (int i = 0; i < d; i++) row[i] /= total[r];
    } else {
      row[d] = total[r], row[d + 1] = top[r];
    }
  }
}

/* KV head g's query rows q (its group of the heads) over cache rows [start, start +
 * count); `scores`: the head's rows, `stride` floats apart, of which columns [start,
 * start + count). */
static void attend_range(const layer *l, int g, const float *q, int start, int count,
                         int normalized, float *scores, int stride, float *o) {
  attend_rows(l, g, q, l->heads / l->kv_heads, start, count, normalized, scores + start,
              stride, o);
}

/* The exact merge of `parts` partials (each heads x (d + 2), `part_stride` floats
 * apart) into out: each part's sums weighted by exp((max - top) * scale); `normalized`,
 * the values' sum over the probabilities' (heads x d), else the merged partial (heads x
 * (d + 2)). */
static void merge_partials(int parts, int heads, int d, float scale, const float *partials,
                           size_t part_stride, int normalized, float *out) {
  size_t width = d + PARTIAL_EXTRA;
  for (int h = 0; h < heads; h++) {
    float top = -INFINITY;
    for (int r = 0; r < parts; r++) {
      float m = partials[r * part_stride + h * width + d + 1];
      top = m > top ? m : top;
    }
    float *o = out + (size_t)h * (normalized ? (size_t)d : width), total = 0.0f;
    memset(o, 0, d * sizeof(float));
    for (int r = 0; r < parts; r++) {
      const float *part = partials + r * part_stride + h * width;
      if (part[d + 1] == -INFINITY) continue; /* an empty shard */
      float weight = exp_nonpositive((part[d + 1] - top) * scale);
      for (int i = 0; i < d; i++) o[i] += weight * part[i];
      total += weight * part[d];
    }
    if (normalized) {
      for (int i = 0; i < d; i++) o[i] /= total;
    } else {
      o[d] = total, o[d + 1] = top;
    }
  }
}

/* Attention split among the pool's threads by ranges of the cache (each range a
 * partial of every head, merged after as the ranks' are): a cache's three KV heads
 * would not split evenly over two threads, its rows do. */
typedef struct {
  const layer *l;
  const float *q;
  int first, length;        /* rows [first, length) */
  float *scores, *partials; /* heads x length; parts x heads x (d + 2) */
} attention_job;

static void attention_part(void *args, int part, int parts) {
  const attention_job *job = args;
  const layer *l = job->l;
  int d = l->head_dim, group = l->heads / l->kv_heads, count = job->length - job->first;
  int start = job->first + (int)((long long)count * part / parts);
  int end = job->first + (int)((long long)count * (part + 1) / parts);
  float *partial = job->partials + (size_t)part * l->heads * (d + PARTIAL_EXTRA);
  for (int g = 0; g < l->kv_heads; g++)
    attend_range(l, g, job->q + (size_t)g * group * d, start, end - start, 0,
                 job->scores + (size_t)g * group * job->length, job->length,
                 partial + (size_t)g * group * (d + PARTIAL_EXTRA));
}

/* The layer's attention over this rank's cache for the token whose full q/k/v (after
 * the gather) is `qkv`: q/k norms and RoPE in place, k and v stored at cache row
 * `store_row` (-1: another rank caches this token), then over rows [first, length)
 * (a sliding window's first row the query sees, else 0): the partial (kv_heads x
 * group x (d + 2)), or with `normalized` the output (heads x d) itself. `scores`:
 * spmd_cp_decode_scratch(...) floats for `length` rows. */
void spmd_cp_decode_attend(const layer *l, float *qkv, const float *rotation, int store_row,
                           int first, int length, int normalized, float *scores, float *out) {
  int d = l->head_dim, heads = l->heads, kv = l->kv_heads, group = heads / kv;
  float *q = qkv, *k = qkv + (size_t)heads * d, *v = k + (size_t)kv * d;
  if (l->q_norm != NULL) {
    norm_heads(q, heads, d, l->q_norm, l->qk_eps);
    norm_heads(k, kv, d, l->k_norm, l->qk_eps);
  }
  if (rotation != NULL) {
    rotate(q, heads, d, rotation, scores);
    rotate(k, kv, d, rotation, scores);
  }
  if (store_row >= 0)
    for (int g = 0; g < kv; g++) store_kv(l, g, store_row, k + (size_t)g * d, v + (size_t)g * d);
  if (pool.threads == 1) { /* one range: the output or partial directly */
    int width = normalized ? d : d + PARTIAL_EXTRA;
    for (int g = 0; g < kv; g++)
      attend_range(l, g, q + (size_t)g * group * d, first, length - first, normalized,
                   scores + (size_t)g * group * length, length, out + (size_t)g * group * width);
    return;
  }
  attention_job job = {l, q, first, length, scores, scores + (size_t)heads * length};
  run_parallel(attention_part, &job);
  merge_partials(pool.threads, heads, d, l->scale, job.partials,
                 (size_t)heads * (d + PARTIAL_EXTRA), normalized, out);
}

/* Floats of the scratch spmd_cp_decode_attend takes over `length` cache rows: every
 * head's scores, or RoPE's, and a partial of every head per thread. */
long spmd_cp_decode_scratch(int heads, int head_dim, int length) {
  long scores = (long)heads * (length > head_dim ? length : head_dim);
  return scores + (long)pool.threads * heads * (head_dim + PARTIAL_EXTRA);
}

/* The exact merge of `ranks` partials (ranks x heads x (d + 2), stacked in rank order)
 * into the attention output (heads x d). */
void spmd_cp_decode_merge(int ranks, int heads, int d, float scale, const float *partials,
                          float *out) {
  merge_partials(ranks, heads, d, scale, partials, (size_t)heads * (d + PARTIAL_EXTRA), 1,
                 out);
}

/* This rank's outputs of the output projection: its rows of W_o times the attention
 * output (heads x d, flattened). */
void spmd_cp_decode_output(const layer *l, const float *attention, float *part) {
  product(&l->o, attention, part);
}

/* h += attention's projected output (normed first where the layer norms it), then this
 * rank's share of the MLP of RMSNorm(h) (normed where the layer norms the MLP's output:
 * the replicated step's whole output). `scratch`: dim + 2 x gate rows floats. */
void spmd_cp_decode_mlp(const layer *l, float *h, const float *added, float *scratch,
                        float *part) {
  float *normed = scratch, *gate = scratch + l->dim, *up = gate + l->gate.rows;
  if (l->attention_out_norm != NULL) {
    rms_norm(added, l->attention_out_norm, l->attention_out_eps, l->dim, normed);
    added = normed;
  }
  add_into(h, added, l->dim);
  rms_norm(h, l->post_norm, l->post_eps, l->dim, normed);
  products gate_up = {2, {&l->gate, &l->up}, {normed, normed}, {gate, up}};
  run_products(&gate_up);
  if (l->activation == ACT_GELU_TANH)
    geglu(gate, up, l->gate.rows, gate);
  else
    swiglu(gate, up, l->gate.rows, gate);
  product(&l->down, gate, part);
  if (l->mlp_out_norm != NULL) rms_norm(part, l->mlp_out_norm, l->mlp_out_eps, l->dim, part);
}

/* act = activation(gate) * up over n values (`activation`: ACT_SILU or ACT_GELU_TANH),
 * in parts of whole vectors on the pool: a prefill's MLP rows (engine/activation.py),
 * where MLX's graph runs the elementwise maths one value at a time on one thread. */
typedef struct {
  int activation;
  const float *gate, *up;
  long n;
  float *act;
} gated_job;

static void gated_part(void *args, int part, int parts) {
  const gated_job *job = args;
  long per = (job->n + parts - 1) / parts;
  per = (per + 7) / 8 * 8; /* parts of whole vectors */
  long first = per * part, last = first + per < job->n ? first + per : job->n;
  if (first >= last) return;
  int count = (int)(last - first);
  if (job->activation == ACT_GELU_TANH)
    geglu(job->gate + first, job->up + first, count, job->act + first);
  else
    swiglu(job->gate + first, job->up + first, count, job->act + first);
}

void spmd_cp_decode_activation(int activation, const float *gate, const float *up, long n,
                               float *act) {
  gated_job job = {activation, gate, up, n, act};
  run_parallel(gated_part, &job);
}

/* x = RMSNorm(x) in place: the split step's MLP output where the layer norms it, once
 * the ranks' partial sums are summed. */
void spmd_cp_decode_norm(const float *weight, float eps, int n, float *x) {
  rms_norm(x, weight, eps, n, x);
}

/* The last step: h += added, RMSNorm(h), times this rank's rows of the LM head. */
void spmd_cp_decode_head(const matrix *head, int dim, float *h, const float *added,
                         const float *norm, float eps, float *normed, float *logits) {
  add_into(h, added, dim);
  rms_norm(h, norm, eps, dim, normed);
  product(head, normed, logits);
}

/* Prefill attention's tiles, on the same pool and row kernels (attention/native_prefill.py). */
#include "prefill_attention.h"

/* Batched decode steps of several sequences (engine/decode/native_batched.py). */
#include "batch_step.h"
