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
 * With AVX2 and FMA both run as the kernels further down instead, their accumulators in
 * registers (a 2-core Intel Xeon guest: 7-8 -> 10-13 GB/s over a 3K cache).
 *
 * And a matrix-vector product with a float32 matrix registered with its quantized form
 * (below: "quantized shadows") reads the packed form instead, as do a few rows (2 to 32)
 * times such a matrix (batched_product).
 *
 * Preloaded ahead of the BLAS (blas/reexec.py), so MLX's cblas_sgemm resolves here;
 * every other product goes to the next library's cblas_sgemm unchanged. The forwarded
 * product sums in sgemv's order, not sgemm's: the same values to float32 rounding, not
 * the same bits.
 */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cpu_features.h"
#include "gguf_blocks.h"
#ifdef HAVE_X86_VECTORS
#include <immintrin.h>
#endif

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 }; /* CBLAS's enums */
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
#if defined(__GNUC__) && !defined(__clang__) && defined(HAVE_X86_VECTORS)
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

/*
 * Quantized shadows (blas/quantized_shadows.py): a float32 weight matrix that was
 * dequantized from a quantized file (GGUF Q4_0/Q4_1/Q8_0, MLX's 4- and 8-bit) can be
 * registered with its packed form. A decode product of one row times such a matrix
 * (given as its rows, B transposed, or a run of them) then reads the packed form, 5-6x
 * fewer bytes than the float32 matrix, and dequantizes each weight in registers to the
 * very float32 value the matrix holds: registration checks that bit for bit, row by
 * row, and refuses the shadow otherwise. So the product has the float32 matrix's
 * weights exactly and differs from sgemv's only in the order of its sums.
 *
 * Weights are w = scale * q + bias per group of columns (scale and bias float32, kept
 * as float32, float16 or bfloat16 and widened exactly; q the unsigned integer of `bits`
 * bits, MLX's packing: element e of a byte run at bit bits * e). The dequantization
 * that made the float32 matrix rounded either once (a fused multiply-add) or twice;
 * registration finds which and the kernel repeats it. AVX2, FMA and F16C only: scalar
 * dequantization would be slower than reading the float32 matrix, so without them
 * nothing registers.
 *
 * A matrix of one of GGUF's other block types (Q5_0, Q5_1, Q2_K ... Q6_K, IQ4_NL,
 * IQ4_XS: gguf_blocks.h) is registered with the file's block bytes as they are
 * ("block shadows", spmd_cp_block_shadow_register): registration dequantizes every row
 * with the reference arithmetic and with the kernel's own dequantizer and compares
 * both with the matrix bit for bit. The kernel dequantizes each row's blocks in
 * registers and sums their products with x in float32 (eight lanes, four
 * accumulators): with AVX2, FMA and F16C vector code, elsewhere the reference
 * dequantizer into a buffer and plain loops (block shadows register on every CPU).
 */
enum { MAX_SHADOWS = 8192 };
enum { SHADOW_FUSED = 1, SHADOW_UNFUSED = 0, SHADOW_DIFFERS = -1, SHADOW_UNSUPPORTED = -2,
       SHADOW_FULL = -3, SHADOW_OVERLAPS = -4 };
/* How scales and biases are stored (the kernel widens a block's float16 or bfloat16
 * ones as it reads them). */
enum { GROUP_FLOAT32 = 0, GROUP_FLOAT16 = 1, GROUP_BFLOAT16 = 2 };

/* Bytes of one group parameter stored as `kind`. */
__attribute__((unused)) static inline size_t group_bytes(int kind) {
  return kind == GROUP_FLOAT32 ? sizeof(float) : sizeof(uint16_t);
}

typedef struct {
  const float *weights, *end; /* the float32 matrix (rows x cols, row-major) */
  int rows, cols, bits, group, fused;
  const uint8_t *packed;        /* row r at packed + r * packed_step bytes */
  const void *scales, *biases;    /* row r at + r * group_step values of group_kind */
  size_t packed_step, group_step; /* a column slice's rows are further apart than its width */
  int group_kind;                 /* GROUP_FLOAT32, GROUP_FLOAT16 or GROUP_BFLOAT16 */
  int group_shift;                /* log2(group) where a power of two, else -1 */
  const block_format *format;     /* a block shadow's type (bits 0), or NULL */
  block_fn dequantize;            /* its dequantizer the checks used: the vector one
                                   * (then the kernel is the vector one) or the reference */
  int released;                   /* the float32 memory's pages handed back: the matrix is
                                   * read from its packed form only (spmd_cp_shadow_release) */
} shadow;

static shadow shadows[MAX_SHADOWS]; /* sorted by `weights` */
static int shadow_count;
static int released_count; /* shadows whose float32 memory is released */
static long long shadow_products; /* products served, for tests and traces */

#ifdef HAVE_X86_VECTORS
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX512VL_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl")))
/* Loops of a constant count, unrolled so that their arrays of vectors stay in registers
 * (GCC's -O2 keeps them in memory otherwise). */
#define UNROLLED _Pragma("GCC unroll 16")

/* A prefetch the compiler keeps: GCC deletes a loop of __builtin_prefetch as a loop
 * without side effects. The kernels below fetch ahead themselves: on the 2-core Intel
 * guest the hardware alone fetched 4-8 GB/s for them. */
static inline void prefetch(const void *address) {
  __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)address));
}

/* The kernel reads eight uint32 words of a row at once, a "block" of 8 * (32 / bits)
 * weights: lane k holds weights k * E .. k * E + E - 1 (E = 32 / bits), and shifting
 * every lane by bits * s gives weight k * E + s of each. x is read in the same order,
 * rearranged once a product (``lanes_of``): X[block][s][k] = x[block * 8E + k * E + s].
 * Shifts and masks instead of byte shuffles keep the work off the one shuffle port.
 * A row of 4-bit weights may end in half a block (32 weights, one group of 32, e.g. a
 * column slice 288 wide): four words, the other four lanes zero, their x zero.
 * Rows go two at a time (SHADOW_DOT2), each x vector loaded once for both: with the
 * group parameters read where they are stored (no widening pass a row) and the fused
 * dequantization where it reproduces the matrix, 1.14-1.7x the one-row kernel on the
 * 2-core AMD EPYC machine (its thread's CPU time, matrices streamed from memory:
 * 1536 x 576 and 576 x 768 4-bit, 12288 x 576 8-bit; 2026-11-26). */

/* x (cols floats) rearranged for blocks of 8 * per_word weights into out, a last
 * partial block padded with zeros. */
static void lanes_of(const float *x, int cols, int per_word, float *out) {
  int block = 8 * per_word;
  for (int b = 0; b < cols; b += block)
    for (int s = 0; s < per_word; s++)
      for (int k = 0; k < 8; k++) {
        int col = b + k * per_word + s;
        *out++ = col < cols ? x[col] : 0.0f;
      }
}

static int padded_columns(int cols, int bits) {
  int block = 8 * 32 / bits;
  return (cols + block - 1) / block * block;
}

/* `count` <= 8 rows of x (rows ldx apart) in lane order (lanes_of), interleaved eight
 * floats at a time: the v-th eight of row i at out + (v count + i) 8, the dotm kernels'
 * operand. `row`: one row's padded columns of scratch. */
static void interleaved_lanes(const float *x, int ldx, int count, int cols, int per_word,
                              float *row, float *out) {
  int vectors = padded_columns(cols, 32 / per_word) / 8;
  for (int i = 0; i < count; i++) {
    lanes_of(x + (size_t)i * ldx, cols, per_word, row);
    for (int v = 0; v < vectors; v++)
      memcpy(out + ((size_t)v * count + i) * 8, row + (size_t)v * 8, 8 * sizeof(float));
  }
}

/* scale * q + bias, rounded once (fused) or twice: never contracted by the compiler. */
AVX2_TARGET static inline __m256 dequantize8(__m256 q, __m256 scale, __m256 bias, int fused) {
  if (fused) return _mm256_fmadd_ps(q, scale, bias);
#if defined(__clang__) /* contracts within one expression only, and these are two */
  return _mm256_add_ps(_mm256_mul_ps(q, scale), bias);
#else /* the builtins, not the operators: GCC contracts a * b + c into one fma */
  return __builtin_ia32_addps256(__builtin_ia32_mulps256(q, scale), bias);
#endif
}

/* The group of block b's first weight (blocks of `block` weights): a shift, not a
 * division, where the group is a power of two (a division each block cost as much as
 * the block's arithmetic). */
static inline int first_group(const shadow *sh, int b, int block) {
  return sh->group_shift >= 0 ? (b * block) >> sh->group_shift : b * block / sh->group;
}

/* Eight group parameters stored as `kind` (float16 or bfloat16) widened exactly. */
AVX2_TARGET static inline __m256 widen8(__m128i halves, int kind) {
  return kind == GROUP_FLOAT16
             ? _mm256_cvtph_ps(halves)
             : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

/* Block b's group parameter per lane, its first group `first`, read where the row
 * stores them (`kind`; no widening pass over the row): one group for all eight lanes,
 * or (4-bit weights in groups of 32: `two`) the first four lanes in one group and the
 * last four in the next, where there is a next (``groups`` a row). */
AVX2_TARGET static inline __m256 per_lane(const void *values, int kind, int first, int two,
                                            int groups) {
  const float *floats = values;
  const uint16_t *halves = values;
  if (!two || first + 1 == groups) { /* one group (a final half block: its own) */
    if (kind == GROUP_FLOAT32) return _mm256_set1_ps(floats[first]);
    return widen8(_mm_set1_epi16((short)halves[first]), kind);
  }
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 pair; /* the two groups' values in lanes 0 and 1 */
  if (kind == GROUP_FLOAT32) {
    double both;
    memcpy(&both, floats + first, sizeof both);
    pair = _mm256_castpd_ps(_mm256_set1_pd(both));
  } else {
    int32_t both;
    memcpy(&both, halves + first, sizeof both);
    pair = widen8(_mm_set1_epi32(both), kind);
  }
  return _mm256_permutevar8x32_ps(pair, spread);
}

/* Block b's eight words: all of them, or the four of a final half block. */
AVX2_TARGET static inline __m256i block_words(const uint32_t *p, int b, int whole) {
  if (b < whole) return _mm256_loadu_si256((const __m256i *)(p + 8 * b));
  __m128i half = _mm_loadu_si128((const __m128i *)(p + 8 * b));
  return _mm256_inserti128_si256(_mm256_setzero_si256(), half, 0);
}

/* The block's weights for shift s (lane k: weight k * E + s) as float32. */
#define SHADOW_WEIGHTS(s)                                                              \
  dequantize8(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words, SHIFT * (s)), \
                                                  mask)),                              \
              scale, bias, ROUNDING)

/* Field s (`bits` wide) of each lane: the bottom one needs no shift, the top one no
 * mask. */
AVX2_TARGET static inline __m256i shadow_field(__m256i words, int s, int bits, __m256i mask) {
  if (s == 0) return _mm256_and_si256(words, mask);
  __m256i shifted = _mm256_srli_epi32(words, bits * s);
  return bits * (s + 1) == 32 ? shifted : _mm256_and_si256(shifted, mask);
}

/* Row `row` of a shadow as a kernel reads it: its words and its group parameters. */
typedef struct {
  const uint32_t *p;
  const void *scales, *biases; /* the shadow's group_kind */
} row_view;

static inline row_view view_row(const shadow *sh, int row) {
  size_t row_offset = (size_t)row * sh->group_step * group_bytes(sh->group_kind);
  row_view v = {(const uint32_t *)(sh->packed + (size_t)row * sh->packed_step),
                (const char *)sh->scales + row_offset, (const char *)sh->biases + row_offset};
  return v;
}

/* What a kernel function needs of a shadow's rows: constants and block counts. */
#define SHADOW_START(BITS, FUSED)                                                      \
  enum { PER_WORD = 32 / BITS, SHIFT = BITS, ROUNDING = FUSED, BLOCK = 8 * PER_WORD };  \
  int groups = sh->cols / sh->group, two = sh->group < BLOCK, kind = sh->group_kind;   \
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);                             \
  int whole = sh->cols / BLOCK, blocks = padded_columns(sh->cols, BITS) / BLOCK

/* ... and of row `row`: its words and parameters. */
#define SHADOW_ROW_START(BITS, FUSED)                                                  \
  SHADOW_START(BITS, FUSED);                                                           \
  row_view view = view_row(sh, row);                                                   \
  const uint32_t *p = view.p;                                                          \
  const void *scales = view.scales, *biases = view.biases

/* One row's dot product with x in lane order: a function per bit width and rounding,
 * so that the shifts are constants and the loop unrolls. */
#define SHADOW_DOT(NAME, BITS, FUSED)                                                  \
  AVX2_TARGET static float NAME(const shadow *sh, int row, const float *lanes) {     \
    SHADOW_ROW_START(BITS, FUSED);                                                     \
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();                     \
    __m256 sum2 = _mm256_setzero_ps(), sum3 = _mm256_setzero_ps();                     \
    for (int b = 0; b < blocks; b++, lanes += 8 * PER_WORD) {                          \
      __m256i words = block_words(p, b, whole);                                        \
      int first = first_group(sh, b, BLOCK);                                           \
      __m256 scale = per_lane(scales, kind, first, two, groups);                       \
      __m256 bias = per_lane(biases, kind, first, two, groups);                        \
      sum0 = _mm256_fmadd_ps(SHADOW_WEIGHTS(0), _mm256_loadu_ps(lanes), sum0);         \
      sum1 = _mm256_fmadd_ps(SHADOW_WEIGHTS(1), _mm256_loadu_ps(lanes + 8), sum1);     \
      sum2 = _mm256_fmadd_ps(SHADOW_WEIGHTS(2), _mm256_loadu_ps(lanes + 16), sum2);    \
      sum3 = _mm256_fmadd_ps(SHADOW_WEIGHTS(3), _mm256_loadu_ps(lanes + 24), sum3);    \
      if (PER_WORD == 8) {                                                             \
        sum0 = _mm256_fmadd_ps(SHADOW_WEIGHTS(4), _mm256_loadu_ps(lanes + 32), sum0);  \
        sum1 = _mm256_fmadd_ps(SHADOW_WEIGHTS(5), _mm256_loadu_ps(lanes + 40), sum1);  \
        sum2 = _mm256_fmadd_ps(SHADOW_WEIGHTS(6), _mm256_loadu_ps(lanes + 48), sum2);  \
        sum3 = _mm256_fmadd_ps(SHADOW_WEIGHTS(7), _mm256_loadu_ps(lanes + 56), sum3);  \
      }                                                                                \
    }                                                                                  \
    return horizontal_sum(_mm256_add_ps(_mm256_add_ps(sum0, sum1),                     \
                                        _mm256_add_ps(sum2, sum3)));                   \
  }

/* Rows `row` and `row + 1` at once (out[0], out[1]): x's lanes read once for both,
 * each row's sums in two accumulators (even and odd shifts). */
#define SHADOW_WEIGHTS_OF(w, s, sc, bi)                                                \
  dequantize8(_mm256_cvtepi32_ps(shadow_field(w, s, SHIFT, mask)), sc, bi, ROUNDING)
#define SHADOW_DOT2(NAME, BITS, FUSED)                                                 \
  AVX2_TARGET static void NAME(const shadow *sh, int row, const float *lanes, float *out) { \
    SHADOW_START(BITS, FUSED);                                                         \
    row_view r0 = view_row(sh, row), r1 = view_row(sh, row + 1);                       \
    __m256 even0 = _mm256_setzero_ps(), odd0 = _mm256_setzero_ps();                    \
    __m256 even1 = _mm256_setzero_ps(), odd1 = _mm256_setzero_ps();                    \
    for (int b = 0; b < blocks; b++, lanes += BLOCK) {                                 \
      __m256i w0 = block_words(r0.p, b, whole), w1 = block_words(r1.p, b, whole);      \
      int first = first_group(sh, b, BLOCK);                                           \
      __m256 s0 = per_lane(r0.scales, kind, first, two, groups);                       \
      __m256 b0 = per_lane(r0.biases, kind, first, two, groups);                       \
      __m256 s1 = per_lane(r1.scales, kind, first, two, groups);                       \
      __m256 b1 = per_lane(r1.biases, kind, first, two, groups);                       \
      UNROLLED for (int s = 0; s < PER_WORD; s += 2) {                                 \
        __m256 x = _mm256_loadu_ps(lanes + 8 * s), y = _mm256_loadu_ps(lanes + 8 * s + 8); \
        even0 = _mm256_fmadd_ps(SHADOW_WEIGHTS_OF(w0, s, s0, b0), x, even0);           \
        even1 = _mm256_fmadd_ps(SHADOW_WEIGHTS_OF(w1, s, s1, b1), x, even1);           \
        odd0 = _mm256_fmadd_ps(SHADOW_WEIGHTS_OF(w0, s + 1, s0, b0), y, odd0);         \
        odd1 = _mm256_fmadd_ps(SHADOW_WEIGHTS_OF(w1, s + 1, s1, b1), y, odd1);         \
      }                                                                                \
    }                                                                                  \
    out[0] = horizontal_sum(_mm256_add_ps(even0, odd0));                               \
    out[1] = horizontal_sum(_mm256_add_ps(even1, odd1));                               \
  }

/* Row `row` dequantized into out in column order by the kernel's own dequantization
 * (SHADOW_WEIGHTS): registration checks exactly the values the products use. */
#define SHADOW_ROW(NAME, BITS, FUSED)                                                  \
  AVX2_TARGET static void NAME(const shadow *sh, int row, float *out) {              \
    SHADOW_ROW_START(BITS, FUSED);                                                     \
    float lane[8];                                                                     \
    for (int b = 0; b < blocks; b++) {                                                 \
      __m256i words = block_words(p, b, whole);                                        \
      int first = first_group(sh, b, BLOCK);                                           \
      __m256 scale = per_lane(scales, kind, first, two, groups);                       \
      __m256 bias = per_lane(biases, kind, first, two, groups);                        \
      for (int s = 0; s < PER_WORD; s++) {                                             \
        _mm256_storeu_ps(lane, SHADOW_WEIGHTS(s));                                     \
        for (int k = 0; k < 8; k++) {                                                  \
          int col = b * 8 * PER_WORD + k * PER_WORD + s;                               \
          if (col < sh->cols) out[col] = lane[k];                                      \
        }                                                                              \
      }                                                                                \
    }                                                                                  \
  }

/* The sum of v's eight lanes as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), dot()'s
 * order above. */
AVX2_TARGET static inline float horizontal_sum(__m256 v) {
  __m256 pairs = _mm256_hadd_ps(v, v), quads = _mm256_hadd_ps(pairs, pairs);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads),
                                  _mm256_extractf128_ps(quads, 1)));
}

/* horizontal_sum of four vectors at once (lane i: the sum of the i-th). */
AVX2_TARGET static inline __m128 four_sums(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
}

/* Rows row .. row + ROWS - 1's dot products with m <= 8 vectors in lane order,
 * interleaved eight floats at a time (interleaved_lanes: the i-th vector's v-th eight at
 * lanes + (v m + i) 8), into out[8 r + i]: each block dequantized once in registers for
 * all m (a batched decode step's rows), one accumulator a row and vector. A body per m
 * (the dispatch below): with m a constant every operand is one pointer plus a constant,
 * no tests and no offsets reloaded from the stack. Each row's sums are the one-row
 * kernel's, in its order: two rows at once give the same values bit for bit. */
#define SHADOW_DOTM(NAME, BITS, FUSED, ROWS, TARGET)                                   \
  TARGET static inline __attribute__((always_inline)) void NAME##_body(               \
      const shadow *sh, int row, const float *lanes, int m, float *out) {             \
    SHADOW_START(BITS, FUSED);                                                         \
    row_view view[ROWS];                                                               \
    UNROLLED for (int r = 0; r < ROWS; r++) view[r] = view_row(sh, row + r);           \
    /* Up to four vectors: two accumulators each (even and odd shifts: SHADOW_DOT2's \
     * sums), so that an FMA seldom waits for the one before it on its accumulator    \
     * (4-bit rows in cache, a C harness on the 2-core AMD EPYC, 2026-12-07: 1.66x at \
     * m = 2, 1.24x at m = 4; more accumulators spill AVX2's 16 registers). */         \
    enum { PAIRED = 4 };                                                               \
    __m256 acc[ROWS][8], odd[ROWS][PAIRED];                                            \
    UNROLLED for (int r = 0; r < ROWS; r++) {                                          \
      UNROLLED for (int i = 0; i < 8; i++) acc[r][i] = _mm256_setzero_ps();            \
      UNROLLED for (int i = 0; i < PAIRED; i++) odd[r][i] = _mm256_setzero_ps();       \
    }                                                                                  \
    for (int b = 0; b < blocks; b++, lanes += BLOCK * m) {                             \
      int first = first_group(sh, b, BLOCK);                                           \
      __m256i words[ROWS];                                                             \
      __m256 scale[ROWS], bias[ROWS];                                                  \
      UNROLLED for (int r = 0; r < ROWS; r++) {                                        \
        words[r] = block_words(view[r].p, b, whole);                                   \
        scale[r] = per_lane(view[r].scales, kind, first, two, groups);                 \
        bias[r] = per_lane(view[r].biases, kind, first, two, groups);                  \
      }                                                                                \
      UNROLLED for (int s = 0; s < PER_WORD; s++) {                                    \
        __m256 w[ROWS];                                                                \
        UNROLLED for (int r = 0; r < ROWS; r++)                                        \
          w[r] = SHADOW_WEIGHTS_OF(words[r], s, scale[r], bias[r]);                    \
        UNROLLED for (int i = 0; i < 8; i++) {                                         \
          if (i >= m) continue;                                                        \
          __m256 x = _mm256_loadu_ps(lanes + (s * m + i) * 8);                         \
          UNROLLED for (int r = 0; r < ROWS; r++) {                                    \
            if (m <= PAIRED && s % 2 == 1)                                             \
              odd[r][i % PAIRED] = _mm256_fmadd_ps(w[r], x, odd[r][i % PAIRED]);       \
            else                                                                       \
              acc[r][i] = _mm256_fmadd_ps(w[r], x, acc[r][i]);                         \
          }                                                                            \
        }                                                                              \
      }                                                                                \
    }                                                                                  \
    UNROLLED for (int r = 0; r < ROWS; r++)                                            \
      UNROLLED for (int i = 0; i < 8; i++)                                             \
        if (i < m)                                                                     \
          out[8 * r + i] = horizontal_sum(                                             \
              m <= PAIRED ? _mm256_add_ps(acc[r][i], odd[r][i % PAIRED]) : acc[r][i]); \
  }                                                                                    \
  TARGET static void NAME(const shadow *sh, int row, const float *lanes, int m,       \
                          float *out) {                                                \
    switch (m) {                                                                       \
      case 1: NAME##_body(sh, row, lanes, 1, out); return;                             \
      case 2: NAME##_body(sh, row, lanes, 2, out); return;                             \
      case 3: NAME##_body(sh, row, lanes, 3, out); return;                             \
      case 4: NAME##_body(sh, row, lanes, 4, out); return;                             \
      case 5: NAME##_body(sh, row, lanes, 5, out); return;                             \
      case 6: NAME##_body(sh, row, lanes, 6, out); return;                             \
      case 7: NAME##_body(sh, row, lanes, 7, out); return;                             \
      default: NAME##_body(sh, row, lanes, 8, out); return;                            \
    }                                                                                  \
  }

SHADOW_DOT(dot4_unfused, 4, 0)
SHADOW_DOT(dot4_fused, 4, 1)
SHADOW_DOT(dot8_unfused, 8, 0)
SHADOW_DOT(dot8_fused, 8, 1)
SHADOW_DOT2(dot2_4_unfused, 4, 0)
SHADOW_DOT2(dot2_4_fused, 4, 1)
SHADOW_DOT2(dot2_8_unfused, 8, 0)
SHADOW_DOT2(dot2_8_fused, 8, 1)
SHADOW_ROW(row4_unfused, 4, 0)
SHADOW_ROW(row4_fused, 4, 1)
SHADOW_ROW(row8_unfused, 8, 0)
SHADOW_ROW(row8_fused, 8, 1)
SHADOW_DOTM(dotm4_unfused, 4, 0, 1, AVX2_TARGET)
SHADOW_DOTM(dotm4_fused, 4, 1, 1, AVX2_TARGET)
SHADOW_DOTM(dotm8_unfused, 8, 0, 1, AVX2_TARGET)
SHADOW_DOTM(dotm8_fused, 8, 1, 1, AVX2_TARGET)
/* Two rows at once where AVX-512VL gives 32 vector registers (two rows' accumulators
 * for eight vectors and their operands): each x vector loaded once for both rows, which
 * pays where one row's vectors of x outgrow the first-level cache. On the 2-core AMD
 * EPYC (a C harness around these kernels, matrices larger than the third-level cache,
 * m = 8, 2026-12-07): 4-bit rows of 1536 columns 23.0 -> 27.7 GFMA/s, of 4096 columns
 * 22.4 -> 28.7, 8-bit rows of 4096 columns 18.5 -> 28.9; 576 columns (x in that
 * cache) 38.5 -> 36.9, 576 columns at m = 4 31.1 -> 32.4. */
SHADOW_DOTM(dotm2_4_unfused, 4, 0, 2, AVX512VL_TARGET)
SHADOW_DOTM(dotm2_4_fused, 4, 1, 2, AVX512VL_TARGET)
SHADOW_DOTM(dotm2_8_unfused, 8, 0, 2, AVX512VL_TARGET)
SHADOW_DOTM(dotm2_8_fused, 8, 1, 2, AVX512VL_TARGET)

typedef void (*shadow_dotm_fn)(const shadow *, int, const float *, int, float *);

/* The kernel for `rows` (1 or 2) rows at once of shadow s. */
static shadow_dotm_fn dotm_for(const shadow *s, int rows) {
  if (rows == 2) {
    if (s->bits == 4) return s->fused ? dotm2_4_fused : dotm2_4_unfused;
    return s->fused ? dotm2_8_fused : dotm2_8_unfused;
  }
  if (s->bits == 4) return s->fused ? dotm4_fused : dotm4_unfused;
  return s->fused ? dotm8_fused : dotm8_unfused;
}

/* The eight vectors v[s] (lane k: weight 8k + s of a 4-bit block) as the block's 64
 * weights in column order: an 8 x 8 transpose, stored at out. */
AVX2_TARGET static inline void store_transposed8(const __m256 v[8], float *out) {
  __m256 a0 = _mm256_unpacklo_ps(v[0], v[1]), a1 = _mm256_unpackhi_ps(v[0], v[1]);
  __m256 a2 = _mm256_unpacklo_ps(v[2], v[3]), a3 = _mm256_unpackhi_ps(v[2], v[3]);
  __m256 a4 = _mm256_unpacklo_ps(v[4], v[5]), a5 = _mm256_unpackhi_ps(v[4], v[5]);
  __m256 a6 = _mm256_unpacklo_ps(v[6], v[7]), a7 = _mm256_unpackhi_ps(v[6], v[7]);
  __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
  __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
  __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
  __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
  _mm256_storeu_ps(out + 0, _mm256_permute2f128_ps(b0, b4, 0x20));
  _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(b1, b5, 0x20));
  _mm256_storeu_ps(out + 16, _mm256_permute2f128_ps(b2, b6, 0x20));
  _mm256_storeu_ps(out + 24, _mm256_permute2f128_ps(b3, b7, 0x20));
  _mm256_storeu_ps(out + 32, _mm256_permute2f128_ps(b0, b4, 0x31));
  _mm256_storeu_ps(out + 40, _mm256_permute2f128_ps(b1, b5, 0x31));
  _mm256_storeu_ps(out + 48, _mm256_permute2f128_ps(b2, b6, 0x31));
  _mm256_storeu_ps(out + 56, _mm256_permute2f128_ps(b3, b7, 0x31));
}

/* SHADOW_ROW for 4-bit rows of whole blocks, the weights put in column order by a
 * transpose in registers (the same values: prefill dequantizes whole matrices a tile
 * at a time with it, where the lane-by-lane stores cost as much as the product). */
#define SHADOW_ROW4_WHOLE(NAME, FUSED)                                                 \
  AVX2_TARGET static void NAME(const shadow *sh, int row, float *out) {              \
    SHADOW_ROW_START(4, FUSED);                                                        \
    (void)blocks;                                                                      \
    for (int b = 0; b < whole; b++) {                                                  \
      __m256i words = block_words(p, b, whole);                                        \
      int first = first_group(sh, b, BLOCK);                                           \
      __m256 scale = per_lane(scales, kind, first, two, groups);                       \
      __m256 bias = per_lane(biases, kind, first, two, groups);                        \
      __m256 v[8];                                                                     \
      UNROLLED for (int s = 0; s < 8; s++) v[s] = SHADOW_WEIGHTS(s);                   \
      store_transposed8(v, out + (size_t)b * BLOCK);                                   \
    }                                                                                  \
  }
SHADOW_ROW4_WHOLE(row4_whole_unfused, 0)
SHADOW_ROW4_WHOLE(row4_whole_fused, 1)

typedef float (*shadow_dot_fn)(const shadow *, int, const float *);
typedef void (*shadow_dot2_fn)(const shadow *, int, const float *, float *);

static shadow_dot2_fn dot2_for(const shadow *s, int fused) {
  if (s->bits == 4) return fused ? dot2_4_fused : dot2_4_unfused;
  return fused ? dot2_8_fused : dot2_8_unfused;
}

static shadow_dot_fn dot_for(const shadow *s, int fused) {
  if (s->bits == 4) return fused ? dot4_fused : dot4_unfused;
  return fused ? dot8_fused : dot8_unfused;
}

static void affine_row(const shadow *s, int row, int fused, float *out) {
  if (s->bits == 4 && s->cols % 64 == 0)
    (fused ? row4_whole_fused : row4_whole_unfused)(s, row, out);
  else if (s->bits == 4)
    (fused ? row4_fused : row4_unfused)(s, row, out);
  else (fused ? row8_fused : row8_unfused)(s, row, out);
}

static int row_matches(const shadow *s, int row, int fused, float *out, const float *want) {
  affine_row(s, row, fused, out);
  return !memcmp(out, want, s->cols * sizeof(float));
}

static int vectors_usable(void) { return cpu_has_avx2_fma(1); }
#endif

#ifdef HAVE_X86_VECTORS
/*
 * Decode attention's two products with AVX2 and FMA, their accumulators in registers
 * (the plain loops above keep theirs in memory: on the 2-core Intel guest 7-8 GB/s of
 * keys and values over a 3K-token cache). Both read the keys or values once, in the
 * plain loops' order of sums within each dot product's lanes.
 */

/* Key rows fetched ahead of the one in work; value rows a tile holds (32 KB of rows of
 * 64 floats: in the first-level cache for the passes after the first). */
enum { KEYS_AHEAD = 16, VALUE_TILE = 128 };

/* Rows of keys a scores block takes at once for n query columns: its R x n
 * accumulators, n query vectors and a key vector fit in the 16 vector registers. */
#define SCORE_ROWS(N) ((N) <= 3 ? 4 : (N) <= 4 ? 2 : 1)


/* Rows [i, i + ROWS) of few_columns for n = COLUMNS: eight columns of k per step, then each
 * dot product's lanes summed, the last k % 8 columns added, and c written. */
#define SCORE_BLOCK(ROWS)                                                                \
  do {                                                                                   \
    __m256 sum[ROWS][COLUMNS];                                                                 \
    UNROLLED for (int r = 0; r < ROWS; r++)                                              \
      UNROLLED for (int j = 0; j < COLUMNS; j++) sum[r][j] = _mm256_setzero_ps();              \
    for (int x = 0; x < whole; x += 8) {                                                 \
      __m256 query[COLUMNS];                                                                   \
      UNROLLED for (int j = 0; j < COLUMNS; j++)                                               \
        query[j] = _mm256_loadu_ps(b + (ptrdiff_t)j * ldb + x);                          \
      UNROLLED for (int r = 0; r < ROWS; r++) {                                          \
        __m256 key = _mm256_loadu_ps(a + (ptrdiff_t)(i + r) * lda + x);                  \
        UNROLLED for (int j = 0; j < COLUMNS; j++)                                       \
          sum[r][j] = _mm256_fmadd_ps(key, query[j], sum[r][j]);                         \
      }                                                                                  \
    }                                                                                    \
    float total[ROWS][COLUMNS];                                                          \
    UNROLLED for (int j = 0; j < COLUMNS; j++) {                                         \
      if (ROWS == 4) { /* four rows' lane sums at once, in horizontal_sum's order */     \
        float four[4];                                                                   \
        _mm_storeu_ps(four, four_sums(sum[0][j], sum[1 % ROWS][j], sum[2 % ROWS][j],     \
                                      sum[3 % ROWS][j]));                                \
        UNROLLED for (int r = 0; r < ROWS; r++) total[r][j] = four[r];                   \
      } else                                                                             \
        UNROLLED for (int r = 0; r < ROWS; r++) total[r][j] = horizontal_sum(sum[r][j]); \
    }                                                                                    \
    UNROLLED for (int r = 0; r < ROWS; r++)                                              \
      UNROLLED for (int j = 0; j < COLUMNS; j++) {                                       \
        const float *row = a + (ptrdiff_t)(i + r) * lda, *column = b + (ptrdiff_t)j * ldb; \
        float value = total[r][j];                                                       \
        for (int x = whole; x < k; x++) value += row[x] * column[x];                     \
        value *= alpha;                                                                  \
        float *entry = c + (ptrdiff_t)(i + r) * c_row + j * c_column;                    \
        *entry = beta == 0.0f ? value : value + beta * *entry;                           \
      }                                                                                  \
  } while (0)

/* few_columns for n = N: R key rows at a time (the last few one by one). */
#define FEW_COLUMNS_AVX2(N)                                                              \
  AVX2_TARGET static void few_columns_##N(int m, int k, float alpha, const float *a,     \
                                          int lda, const float *b, int ldb, float beta,  \
                                          float *c, ptrdiff_t c_row, ptrdiff_t c_column) { \
    enum { R = SCORE_ROWS(N), COLUMNS = N };                                             \
    int whole = k / 8 * 8, i = 0;                                                        \
    for (; i + R <= m; i += R) {                                                         \
      for (int r = 0; r < R && i + KEYS_AHEAD + r < m; r++) /* whole rows, ahead */      \
        for (int x = 0; x < k; x += 16) prefetch(a + (ptrdiff_t)(i + KEYS_AHEAD + r) * lda + x); \
      SCORE_BLOCK(R);                                                                    \
    }                                                                                    \
    for (; i < m; i++) SCORE_BLOCK(1);                                                   \
  }

FEW_COLUMNS_AVX2(1)
FEW_COLUMNS_AVX2(2)
FEW_COLUMNS_AVX2(3)
FEW_COLUMNS_AVX2(4)
FEW_COLUMNS_AVX2(5)
FEW_COLUMNS_AVX2(6)
FEW_COLUMNS_AVX2(7)
FEW_COLUMNS_AVX2(8)

typedef void (*few_columns_fn)(int, int, float, const float *, int, const float *, int, float,
                               float *, ptrdiff_t, ptrdiff_t);
static const few_columns_fn few_columns_avx2[FEW_COLUMNS + 1] = {
    NULL, few_columns_1, few_columns_2, few_columns_3, few_columns_4,
    few_columns_5, few_columns_6, few_columns_7, few_columns_8};

/* Column vectors a values pass takes at once for m rows of probabilities: its m x W
 * accumulators, W value vectors and a broadcast probability fit in the registers. */
#define VALUE_VECTORS(M) ((M) <= 2 ? 4 : (M) <= 4 ? 2 : 1)

/* few_rows_streamed for m = M: the values in tiles of VALUE_TILE rows (in cache), each
 * tile read in passes of 8W columns (rows of 64 floats: 2 passes of 32 for M <= 2, 4 of
 * 16 for M <= 4) whose sums carry over to the next tile in `partial`; so memory is read
 * once, in order, as the plain loop reads it. */
#define FEW_ROWS_AVX2(M)                                                                 \
  AVX2_TARGET static void few_rows_##M(int n, int k, float alpha, const float *a,        \
                                       ptrdiff_t row_step, ptrdiff_t col_step,           \
                                       const float *b, int ldb, float beta, float *c,    \
                                       int ldc) {                                        \
    enum { W = VALUE_VECTORS(M) };                                                       \
    int whole = n / (8 * W) * (8 * W);                                                   \
    float partial[M][MAX_WIDTH];                                                         \
    for (int start = 0; start < k; start += VALUE_TILE) {                                \
      int stop = k - start < VALUE_TILE ? k : start + VALUE_TILE;                        \
      for (int r = start; r < stop && r + VALUE_TILE < k; r++) /* the next tile */       \
        for (int x = 0; x < n; x += 16) prefetch(b + (ptrdiff_t)(r + VALUE_TILE) * ldb + x); \
      for (int j = 0; j < whole; j += 8 * W) {                                           \
        __m256 sum[M][W];                                                                \
        UNROLLED for (int i = 0; i < M; i++)                                             \
          UNROLLED for (int w = 0; w < W; w++)                                           \
            sum[i][w] = start ? _mm256_loadu_ps(&partial[i][j + 8 * w]) : _mm256_setzero_ps(); \
        for (int r = start; r < stop; r++) {                                             \
          const float *row = b + (ptrdiff_t)r * ldb + j;                                 \
          __m256 value[W];                                                               \
          UNROLLED for (int w = 0; w < W; w++) value[w] = _mm256_loadu_ps(row + 8 * w);  \
          UNROLLED for (int i = 0; i < M; i++) {                                         \
            __m256 weight = _mm256_broadcast_ss(a + i * row_step + r * col_step);        \
            UNROLLED for (int w = 0; w < W; w++)                                         \
              sum[i][w] = _mm256_fmadd_ps(weight, value[w], sum[i][w]);                  \
          }                                                                              \
        }                                                                                \
        UNROLLED for (int i = 0; i < M; i++)                                             \
          UNROLLED for (int w = 0; w < W; w++)                                           \
            _mm256_storeu_ps(&partial[i][j + 8 * w], sum[i][w]);                         \
      }                                                                                  \
      for (int j = whole; j < n; j++) /* a width not a multiple of 8W: the last columns */ \
        for (int i = 0; i < M; i++) {                                                    \
          float total = start ? partial[i][j] : 0.0f;                                    \
          for (int r = start; r < stop; r++)                                             \
            total += a[i * row_step + r * col_step] * b[(ptrdiff_t)r * ldb + j];         \
          partial[i][j] = total;                                                         \
        }                                                                                \
    }                                                                                    \
    for (int i = 0; i < M; i++)                                                          \
      for (int j = 0; j < n; j++) {                                                      \
        float *out = c + (ptrdiff_t)i * ldc + j, value = alpha * partial[i][j];          \
        *out = beta == 0.0f ? value : value + beta * *out;                               \
      }                                                                                  \
  }

FEW_ROWS_AVX2(1)
FEW_ROWS_AVX2(2)
FEW_ROWS_AVX2(3)
FEW_ROWS_AVX2(4)
FEW_ROWS_AVX2(5)
FEW_ROWS_AVX2(6)
FEW_ROWS_AVX2(7)
FEW_ROWS_AVX2(8)

typedef void (*few_rows_fn)(int, int, float, const float *, ptrdiff_t, ptrdiff_t, const float *,
                            int, float, float *, int);
static const few_rows_fn few_rows_avx2[STREAM_ROWS + 1] = {
    NULL, few_rows_1, few_rows_2, few_rows_3, few_rows_4,
    few_rows_5, few_rows_6, few_rows_7, few_rows_8};
#endif

#ifdef HAVE_X86_VECTORS
/* Whether the AVX2 kernels run here (asked once). */
static int avx2_here(void) {
  static int answer = -1;
  if (answer < 0) answer = vectors_usable();
  return answer;
}

static int avx512vl_here(void) {
  static int answer = -1;
  if (answer < 0) answer = avx2_here() && cpu_has_avx512vl();
  return answer;
}
#endif

/* few_columns through its AVX2 form where there is one. */
static void scores(int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                   int ldb, float beta, float *c, ptrdiff_t c_row, ptrdiff_t c_column) {
#ifdef HAVE_X86_VECTORS
  if (avx2_here()) {
    few_columns_avx2[n](m, k, alpha, a, lda, b, ldb, beta, c, c_row, c_column);
    return;
  }
#endif
  few_columns(m, n, k, alpha, a, lda, b, ldb, beta, c, c_row, c_column);
}

/* few_rows_streamed through its AVX2 form where there is one. */
static void values(int m, int n, int k, float alpha, const float *a, ptrdiff_t row_step,
                   ptrdiff_t col_step, const float *b, int ldb, float beta, float *c, int ldc) {
#ifdef HAVE_X86_VECTORS
  if (avx2_here()) {
    few_rows_avx2[m](n, k, alpha, a, row_step, col_step, b, ldb, beta, c, ldc);
    return;
  }
#endif
  few_rows_streamed(m, n, k, alpha, a, row_step, col_step, b, ldb, beta, c, ldc);
}

/* Whether row by row, dequantized `fused` or not, the shadow's first `check_rows` rows
 * equal `check` (those rows' float32 values, rows cols apart). */
static int shadow_matches(const shadow *s, int fused, float *row_buffer, const float *check,
                          int check_rows) {
#ifdef HAVE_X86_VECTORS
  for (int row = 0; row < check_rows; row++)
    if (!row_matches(s, row, fused, row_buffer, check + (size_t)row * s->cols)) return 0;
  return 1;
#else
  (void)s, (void)fused, (void)row_buffer, (void)check, (void)check_rows;
  return 0;
#endif
}

/* Where a shadow of the matrix at `weights` goes in the sorted registry, or
 * SHADOW_FULL, or SHADOW_OVERLAPS (memory an earlier registration covers: a lookup has
 * one answer). */
static int free_place(const float *weights, int rows, int cols) {
  if (shadow_count == MAX_SHADOWS) return SHADOW_FULL;
  const float *end = weights + (size_t)rows * cols;
  int at = shadow_count;
  while (at > 0 && shadows[at - 1].weights > weights) at--;
  if ((at > 0 && shadows[at - 1].end > weights) || (at < shadow_count &&
                                                     shadows[at].weights < end))
    return SHADOW_OVERLAPS;
  return at;
}

/* Published for the compute thread: entries above `at` move up one first (a lookup
 * racing with this sees a consistent prefix only when registration precedes use, as
 * it does: the model's matrices at load, the split step's before its first step). */
static void publish(shadow s, int at) {
  for (int i = shadow_count; i > at; i--) shadows[i] = shadows[i - 1];
  shadows[at] = s;
  __atomic_store_n(&shadow_count, shadow_count + 1, __ATOMIC_RELEASE);
}

/* Register the packed form of a float32 matrix (rows x cols, row-major): packed rows
 * `packed_step` bytes apart, scale and bias rows `group_step` values apart (a column
 * slice of a packed matrix is a view), stored as `group_kind`. Answers SHADOW_FUSED or
 * SHADOW_UNFUSED (the rounding it reproduces), SHADOW_DIFFERS (it does not reproduce
 * the matrix: not registered), SHADOW_UNSUPPORTED (no AVX2/FMA/F16C; bits other than 4
 * or 8; a group size the kernel cannot read; a row not a whole number of half blocks),
 * SHADOW_FULL or SHADOW_OVERLAPS (memory an earlier registration covers: a lookup has
 * one answer).
 * The caller keeps every buffer alive and unchanged for the life of the process.
 * row_buffer: cols floats of scratch. The check compares the first `check_rows` rows
 * with `check` (the matrix itself, or those rows dequantized elsewhere where the
 * matrix's memory is to be released and holds no values). */
int spmd_cp_shadow_register(const float *weights, int rows, int cols, int bits, int group,
                            const void *packed, size_t packed_step, const void *scales,
                            const void *biases, size_t group_step, int group_kind,
                            float *row_buffer, const float *check, int check_rows) {
#ifdef HAVE_X86_VECTORS
  if (!vectors_usable()) return SHADOW_UNSUPPORTED;
#else
  return SHADOW_UNSUPPORTED;
#endif
  int block = 8 * 32 / (bits > 0 ? bits : 1); /* weights the kernel reads at once */
  if ((bits != 4 && bits != 8) || group <= 0 || (group % block && group != block / 2) ||
      cols % group || cols % (block / 2) || rows <= 0 ||
      packed_step < (size_t)cols * bits / 8 || group_step < (size_t)(cols / group) ||
      group_kind < GROUP_FLOAT32 || group_kind > GROUP_BFLOAT16)
    return SHADOW_UNSUPPORTED;
  int at = free_place(weights, rows, cols);
  if (at < 0) return at;
  if (check_rows < 1 || check_rows > rows) return SHADOW_UNSUPPORTED;
  shadow s = {weights, weights + (size_t)rows * cols, rows, cols, bits, group, 0,
              (const uint8_t *)packed, scales, biases, packed_step, group_step, group_kind,
              -1, NULL, NULL, 0};
  for (int shift = 0; shift < 31; shift++)
    if (group == 1 << shift) s.group_shift = shift;
  /* Fused first: one instruction a weight where both reproduce the matrix, as they do
   * whenever scale * q is exact (a float16 or bfloat16 scale times 4 or 8 bits). */
  s.fused = shadow_matches(&s, SHADOW_FUSED, row_buffer, check, check_rows)
                ? SHADOW_FUSED
                : shadow_matches(&s, SHADOW_UNFUSED, row_buffer, check, check_rows)
                      ? SHADOW_UNFUSED
                      : SHADOW_DIFFERS;
  if (s.fused == SHADOW_DIFFERS) return SHADOW_DIFFERS;
  publish(s, at);
  return s.fused;
}

/* Register a float32 matrix (rows x cols, row-major) with its GGUF blocks of `type`
 * (gguf_blocks.h), row r at blocks + r * row_step bytes (a column slice's rows lie
 * further apart than its width). Answers SHADOW_FUSED where every row's blocks
 * dequantize to the matrix's row bit for bit, by the reference arithmetic and by the
 * kernel's own, else SHADOW_DIFFERS, SHADOW_UNSUPPORTED (a type not read here, a row
 * not whole blocks), SHADOW_FULL or SHADOW_OVERLAPS. The caller keeps both alive and
 * unchanged for the life of the process. row_buffer: cols floats of scratch; the check
 * reads the first `check_rows` rows of `check`, as spmd_cp_shadow_register's. */
int spmd_cp_block_shadow_register(const float *weights, int rows, int cols, int type,
                                  const void *blocks, size_t row_step, float *row_buffer,
                                  const float *check, int check_rows) {
  const block_format *format = block_format_of(type);
  if (format == NULL || rows <= 0 || cols <= 0 || cols % format->values ||
      row_step < (size_t)cols / format->values * format->bytes || check_rows < 1 ||
      check_rows > rows)
    return SHADOW_UNSUPPORTED;
  int at = free_place(weights, rows, cols);
  if (at < 0) return at;
  block_fn kernel = format->reference;
#ifdef HAVE_X86_VECTORS
  if (format->vectors != NULL && vectors_usable()) kernel = format->vectors;
#endif
  int count = cols / format->values;
  for (int row = 0; row < check_rows; row++) {
    const uint8_t *p = (const uint8_t *)blocks + (size_t)row * row_step;
    const float *want = check + (size_t)row * cols;
    format->reference(p, count, row_buffer);
    if (memcmp(row_buffer, want, (size_t)cols * sizeof(float))) return SHADOW_DIFFERS;
    if (kernel != format->reference) {
      kernel(p, count, row_buffer);
      if (memcmp(row_buffer, want, (size_t)cols * sizeof(float))) return SHADOW_DIFFERS;
    }
  }
  shadow s = {weights, weights + (size_t)rows * cols, rows, cols, 0, format->values,
              SHADOW_FUSED, (const uint8_t *)blocks, NULL, NULL, row_step, 0, 0, -1, format,
              kernel, 0};
  publish(s, at);
  return SHADOW_FUSED;
}

/* Whether block shadows are read with vector code here (else the plain C kernel). */
int spmd_cp_block_shadow_vectors(void) {
#ifdef HAVE_X86_VECTORS
  return vectors_usable();
#else
  return 0;
#endif
}

/* Whether registrations can succeed here (an x86 CPU with AVX2, FMA and F16C). */
int spmd_cp_shadow_usable(void) {
#ifdef HAVE_X86_VECTORS
  return vectors_usable();
#else
  return 0;
#endif
}

long long spmd_cp_shadow_products(void) {
  return __atomic_load_n(&shadow_products, __ATOMIC_RELAXED);
}

/* The shadow holding the row at b (rows ldb apart), its registry index, or -1; `n` rows
 * from there must lie in it and the shadows right after it (a matrix registered in
 * pieces: the split step's q/k/v rows joined from three matrices). */
static int shadow_of(const float *b, int n, int ldb) {
  int count = __atomic_load_n(&shadow_count, __ATOMIC_ACQUIRE), lo = 0, hi = count;
  while (lo < hi) { /* the last shadow starting at or before b */
    int mid = (lo + hi) / 2;
    if (shadows[mid].weights <= b) lo = mid + 1;
    else hi = mid;
  }
  if (lo == 0) return -1;
  int first = lo - 1;
  const shadow *s = &shadows[first];
  ptrdiff_t offset = b - s->weights;
  if (b >= s->end || ldb != s->cols || offset % s->cols) return -1;
  int rows = s->rows - (int)(offset / s->cols);
  for (int i = first + 1; rows < n; i++) {
    if (i == count || shadows[i].weights != shadows[i - 1].end || shadows[i].cols != s->cols)
      return -1;
    rows += shadows[i].rows;
  }
  return first;
}

/*
 * Released matrices: the packed form is the only copy of the weights. Once a matrix
 * is registered its float32 memory can be handed back to the kernel (its whole pages,
 * madvise MADV_DONTNEED; not transparent huge pages again, so that khugepaged does not
 * fill them back in): the address stays the matrix's name. A matrix-vector product
 * reads the packed form as before; a product of more rows (prefill, a few rows of the
 * split step) dequantizes TILE_BYTES of the matrix's rows at a time into a per-thread
 * buffer and hands each tile to the BLAS (released_product), so the float32 matrix is
 * never whole in memory. Any other product that would read released memory (the
 * matrix as A, or untransposed) stops the process with a message: its pages read as
 * zeros, and a wrong answer must never pass silently.
 */
enum { TILE_BYTES = 8 << 20 };

/* Row `row` of shadow s, dequantized into out (cols floats) exactly as its products
 * read it. */
static void dequantize_row(const shadow *s, int row, float *out) {
  if (s->format != NULL) {
    s->dequantize(s->packed + (size_t)row * s->packed_step, s->cols / s->format->values, out);
    return;
  }
#ifdef HAVE_X86_VECTORS
  affine_row(s, row, s->fused, out);
#else
  (void)row, memset(out, 0, (size_t)s->cols * sizeof(float)); /* never registered here */
#endif
}

/* The registry index of the shadow whose matrix starts at `weights`, or -1. */
static int shadow_at(const float *weights) {
  int count = __atomic_load_n(&shadow_count, __ATOMIC_ACQUIRE);
  for (int lo = 0, hi = count; lo < hi;) {
    int mid = (lo + hi) / 2;
    if (shadows[mid].weights == weights) return mid;
    if (shadows[mid].weights < weights) lo = mid + 1;
    else hi = mid;
  }
  return -1;
}

/* The whole pages inside [start, end): [*first, *last), or 0 where there are none. */
static int whole_pages(const void *start, const void *end, char **first, char **last) {
  uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  uintptr_t a = ((uintptr_t)start + page - 1) / page * page, b = (uintptr_t)end / page * page;
  if (a >= b) return 0;
  *first = (char *)a, *last = (char *)b;
  return 1;
}

/* Hand back the float32 memory of the matrix registered at `weights`: the bytes
 * released (its whole pages), or -1 where no shadow starts there. Afterwards its values
 * live in the packed form only. */
long long spmd_cp_shadow_release(const float *weights) {
  int index = shadow_at(weights);
  if (index < 0) return -1;
  shadow *s = &shadows[index];
  char *first, *last;
  if (!s->released) __atomic_fetch_add(&released_count, 1, __ATOMIC_RELEASE);
  s->released = 1;
  if (!whole_pages(s->weights, s->end, &first, &last)) return 0;
#ifdef MADV_NOHUGEPAGE
  madvise(first, last - first, MADV_NOHUGEPAGE);
#endif
  if (madvise(first, last - first, MADV_DONTNEED)) return 0;
  return last - first;
}

/* Write the values of the matrix registered at `weights` back into its float32 memory
 * (to copy parts of it with other code; spmd_cp_shadow_release hands it back again):
 * 0, or -1 where no shadow starts there. */
int spmd_cp_shadow_fill(const float *weights) {
  int index = shadow_at(weights);
  if (index < 0) return -1;
  const shadow *s = &shadows[index];
  for (int row = 0; row < s->rows; row++)
    dequantize_row(s, row, (float *)s->weights + (size_t)row * s->cols);
  return 0;
}

/* Rows `rows[i]` (i < count) of the registered matrix whose row 0 is at `matrix` (the
 * matrix or a view of whole rows of it) into out, cols floats each: an embedding's
 * lookup. 0, or -1 where `matrix` is not such a view (nothing written). */
int spmd_cp_shadow_rows(const float *matrix, int cols, const int32_t *rows, int count,
                        float *out) {
  int index = shadow_of(matrix, 1, cols);
  if (index < 0) return -1;
  const shadow *base = &shadows[index];
  int first = (int)((matrix - base->weights) / cols);
  for (int i = 0; i < count; i++) {
    const shadow *s = base;
    if (rows[i] < 0) return -1;
    int row = first + rows[i];
    while (row >= s->rows) { /* a matrix registered in pieces */
      row -= s->rows;
      if (s + 1 == shadows + shadow_count || s[1].weights != s->end) return -1;
      s++;
    }
    dequantize_row(s, row, out + (size_t)i * cols);
  }
  return 0;
}

/* Whether any released matrix's memory overlaps [start, end). */
static int released_within(const float *start, const float *end) {
  int count = __atomic_load_n(&shadow_count, __ATOMIC_ACQUIRE), lo = 0, hi = count;
  while (lo < hi) { /* the first shadow starting after start */
    int mid = (lo + hi) / 2;
    if (shadows[mid].weights <= start) lo = mid + 1;
    else hi = mid;
  }
  for (int i = lo > 0 ? lo - 1 : 0; i < count && shadows[i].weights < end; i++)
    if (shadows[i].released && shadows[i].end > start) return 1;
  return 0;
}

/* The shadow whose matrix holds the float at p, or NULL. */
static const shadow *shadow_holding(const float *p) {
  int count = __atomic_load_n(&shadow_count, __ATOMIC_ACQUIRE), lo = 0, hi = count;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (shadows[mid].weights <= p) lo = mid + 1;
    else hi = mid;
  }
  return lo > 0 && p < shadows[lo - 1].end ? &shadows[lo - 1] : NULL;
}

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
static sgemm_fn next_sgemm;

/* Row p (k floats) of a product's B given as rows: dequantized where a released matrix
 * holds it (whole rows of it), copied where it is float32 memory. 0 where p lies inside
 * a released matrix's row (a column view of it: its values are nowhere as floats). */
static int gather_row(const float *p, int k, float *out) {
  const shadow *s = shadow_holding(p);
  if (s == NULL || !s->released) {
    memcpy(out, p, (size_t)k * sizeof(float));
    return 1;
  }
  ptrdiff_t offset = p - s->weights;
  if (k != s->cols || offset % s->cols) return 0;
  dequantize_row(s, (int)(offset / s->cols), out);
  return 1;
}

/* c (m x n, ldc) = alpha op(A) (m x k) times B' + beta c, B given as n rows of k floats
 * ldb apart of which some lie in released matrices: TILE_BYTES of its rows gathered at
 * a time (gather_row), each tile one BLAS product. 0 where a row cannot be had (a
 * column view of a released matrix) or no buffer: nothing written then. */
static int released_product(const float *b, int ldb, int m, int n, int k, int trans_a,
                            float alpha, const float *a, int lda, float beta, float *c,
                            int ldc) {
  static __thread float *tile;
  static __thread size_t tile_floats;
  size_t per_tile = TILE_BYTES / ((size_t)k * sizeof(float));
  if (per_tile < 16) per_tile = 16;
  if (per_tile > (size_t)n) per_tile = n;
  if (tile_floats < per_tile * k) {
    float *grown = realloc(tile, per_tile * k * sizeof(float));
    if (grown == NULL) return 0;
    tile = grown, tile_floats = per_tile * k;
  }
  for (int j = 0; j < n; j += (int)per_tile) {
    int t = n - j < (int)per_tile ? n - j : (int)per_tile;
    for (int r = 0; r < t; r++)
      if (!gather_row(b + (size_t)(j + r) * ldb, k, tile + (size_t)r * k)) return j == 0 ? 0 : -1;
    next_sgemm(ROW_MAJOR, trans_a, TRANS, m, t, k, alpha, a, lda, tile, k, beta, c + j, ldc);
  }
  return 1;
}

/* A product that would read a released matrix other than as released_product reads
 * it: the process stops (its memory holds zeros now). */
static void refuse_released(void) {
  fprintf(stderr, "spmd-cp: internal error: a product reads a weight matrix whose float32 "
                  "memory was released (only its packed form is held) in a layout the "
                  "packed products do not serve\n");
  abort();
}

#ifdef HAVE_X86_VECTORS
/* Rows this far ahead are fetched while the kernel works on the current one (8-bit
 * rows of 576 weights: 4.6 KB ahead). */
enum { PREFETCH_ROWS = 8, CACHE_LINE = 64 };

static inline void prefetch_row(const shadow *s, int row) {
  const char *packed = (const char *)s->packed + row * s->packed_step;
  if (s->format != NULL) { /* a block shadow: its blocks hold their scales */
    size_t row_bytes = (size_t)(s->cols / s->format->values) * s->format->bytes;
    for (size_t at = 0; at < row_bytes; at += CACHE_LINE) prefetch(packed + at);
    return;
  }
  size_t row_bytes = (size_t)s->cols * s->bits / 8, groups = s->cols / s->group;
  for (size_t at = 0; at < row_bytes; at += CACHE_LINE) prefetch(packed + at);
  size_t row_offset = row * s->group_step * group_bytes(s->group_kind);
  const char *scales = (const char *)s->scales + row_offset;
  const char *biases = (const char *)s->biases + row_offset;
  for (size_t at = 0; at < groups * group_bytes(s->group_kind); at += CACHE_LINE) {
    prefetch(scales + at);
    prefetch(biases + at);
  }
}
#endif

/* Whether block rows take the 512-bit kernels where the CPU and the type have them
 * (spmd_cp_forward_wide_blocks: tests compare both ways). */
static int wide_blocks_allowed = 1;

static int wide_blocks_here(void) {
#ifdef HAVE_X86_VECTORS
  static int answer = -1;
  if (answer < 0) answer = avx2_here() && cpu_has_avx512f();
  return wide_blocks_allowed && answer;
#else
  return 0;
#endif
}

/* The 512-bit block kernels allowed (`allowed` 1) or not (0); answers whether they run
 * here. */
int spmd_cp_forward_wide_blocks(int allowed) {
  wide_blocks_allowed = allowed != 0;
  return wide_blocks_here();
}

#ifdef HAVE_X86_VECTORS
/* c[j] = alpha (row first_row + j of block shadow s) . x + beta c[j], j < rows: each
 * row's blocks dequantized in registers, their products with x summed by the type's
 * 512-bit row kernel where it has one and the CPU runs it, else in four accumulators
 * of eight lanes (the type's block_dot_fn, gguf_blocks.h). */
AVX2_TARGET static void block_rows_avx2(const shadow *s, int first_row, int rows, float alpha,
                                        const float *x, float beta, float *c) {
  const block_format *f = s->format;
  block_dot_fn dot = (block_dot_fn)f->dot;
  block_row_fn wide = wide_blocks_here() ? (block_row_fn)f->row512 : NULL;
  int count = s->cols / f->values;
  size_t row_bytes = (size_t)count * f->bytes;
  for (int j = 0; j < rows; j++) {
    const uint8_t *p = s->packed + (size_t)(first_row + j) * s->packed_step;
    if (j + PREFETCH_ROWS < rows) {
      const char *ahead = (const char *)p + PREFETCH_ROWS * s->packed_step;
      for (size_t at = 0; at < row_bytes; at += CACHE_LINE) prefetch(ahead + at);
    }
    float value;
    if (wide != NULL) {
      value = wide(p, count, x);
    } else {
      __m256 sum[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                       _mm256_setzero_ps()};
      dot(p, count, x, sum);
      value = horizontal_sum(_mm256_add_ps(_mm256_add_ps(sum[0], sum[1]),
                                           _mm256_add_ps(sum[2], sum[3])));
    }
    c[j] = beta == 0.0f ? alpha * value : alpha * value + beta * c[j];
  }
}
#endif

/* block_rows_avx2 in plain C: the reference dequantizer, dot()'s sums. */
static void block_rows_plain(const shadow *s, int first_row, int rows, float alpha,
                             const float *x, float beta, float *c) {
  const block_format *f = s->format;
  int count = s->cols / f->values, per_call = BLOCK_VALUES_MAX / f->values;
  float buffer[BLOCK_VALUES_MAX];
  for (int j = 0; j < rows; j++) {
    const uint8_t *p = s->packed + (size_t)(first_row + j) * s->packed_step;
    float value = 0.0f;
    for (int b = 0; b < count; b += per_call) {
      int n = count - b < per_call ? count - b : per_call;
      s->dequantize(p + (size_t)b * f->bytes, n, buffer);
      value += dot(buffer, x + (size_t)b * f->values, n * f->values);
    }
    c[j] = beta == 0.0f ? alpha * value : alpha * value + beta * c[j];
  }
}

static void block_rows(const shadow *s, int first_row, int rows, float alpha, const float *x,
                       float beta, float *c) {
#ifdef HAVE_X86_VECTORS
  if (s->dequantize != s->format->reference) {
    block_rows_avx2(s, first_row, rows, alpha, x, beta, c);
    return;
  }
#endif
  block_rows_plain(s, first_row, rows, alpha, x, beta, c);
}

/* c (n values) = alpha x B' + beta c, B' the n rows from row first_row of shadow
 * `index` on (through the shadows after it where they continue the matrix); 0 where it
 * could not (no memory for x's lanes): the caller computes it instead. */
static int shadow_product(int index, int first_row, int n, float alpha, const float *x,
                          float beta, float *c) {
  const shadow *s = &shadows[index];
#ifdef HAVE_X86_VECTORS
  static __thread float *lanes; /* x in the kernel's lane order, grown as needed */
  static __thread int lanes_size;
  int lanes_bits = 0;           /* the bit width `lanes` holds x for, 0: none yet */
  int padded = padded_columns(s->cols, 4); /* the most any bit width pads to */
  if (lanes_size < padded) { /* before any output is written */
    float *grown = realloc(lanes, padded * sizeof(float));
    if (grown == NULL) return 0;
    lanes = grown, lanes_size = padded;
  }
#endif
  for (int done = 0; done < n; s++, first_row = 0) {
    int rows = s->rows - first_row < n - done ? s->rows - first_row : n - done;
    if (s->format != NULL) {
      block_rows(s, first_row, rows, alpha, x, beta, c + done);
      done += rows;
      continue;
    }
#ifdef HAVE_X86_VECTORS
    if (s->bits != lanes_bits) lanes_of(x, s->cols, 32 / s->bits, lanes), lanes_bits = s->bits;
    shadow_dot_fn dot = dot_for(s, s->fused);
    shadow_dot2_fn dot2 = dot2_for(s, s->fused);
    for (int j = 0; j < rows; j += 2) {
      for (int ahead = j + PREFETCH_ROWS; ahead < j + PREFETCH_ROWS + 2 && ahead < rows; ahead++)
        prefetch_row(s, first_row + ahead); /* the hardware alone fetched 6 GB/s here */
      float value[2];
      if (j + 1 < rows)
        dot2(s, first_row + j, lanes, value);
      else
        value[0] = dot(s, first_row + j, lanes);
      for (int i = 0; i < 2 && j + i < rows; i++) {
        float *out = c + done + j + i;
        *out = beta == 0.0f ? alpha * value[i] : alpha * value[i] + beta * *out;
      }
    }
    done += rows;
#else
    return 0; /* no affine shadow registers without the vector kernels */
#endif
  }
  __atomic_fetch_add(&shadow_products, 1, __ATOMIC_RELAXED);
  return 1;
}

/*
 * Batched rows: a few rows of x (2 <= m <= BATCH_ROWS: a batched decode step's tokens,
 * a short prefill) times a matrix held packed, given as rows (x times W transposed).
 * Each part of the pool takes whole tiles of BATCH_TILE weight rows; an affine row's
 * blocks are dequantized in registers once for eight rows of x at a time (the dotm
 * kernels, each run of eight rows interleaved in their lane order), as are a 32-value
 * GGUF block type's with AVX-512F; any other block type's row goes into the part's
 * buffer (in cache) exactly as the products read it, then times every row of x by the
 * few-columns kernel: the packed matrix is read once from memory for all m rows, where
 * released_product would write and read it whole as float32 and hand it to sgemm. The
 * parts run on the decode step's pool where it is lent (a busy pool runs the product on
 * its caller alone).
 */
enum { BATCH_ROWS = 32, BATCH_TILE = 16, PAIR_X_BYTES = 32 << 10 };

typedef struct {
  int index, first_row;      /* the matrix's registry entry and the first row used */
  int m, n, k, lda, ldc;
  float alpha, beta;
  const float *a;
  float *c, *buffers;        /* parts x k floats: a row dequantized */
  const float *lanes[2];     /* A's rows in the 4- and 8-bit kernels' lane order, each run
                              * of eight interleaved (interleaved_lanes), or NULL */
  size_t lane_stride[2];     /* a row's padded lanes: run q of eight starts at q x 8 x this */
  int parts;
  int pairs;                 /* affine rows go two at a time (AVX-512VL kernels) */
} batch_job;

/* c's entry (q, j) = alpha value + beta c. */
static inline void put(const batch_job *job, int q, int j, float value) {
  float *entry = job->c + (size_t)q * job->ldc + j;
  *entry = job->beta == 0.0f ? job->alpha * value : job->alpha * value + job->beta * *entry;
}

/* Rows [j0, j1) of the product: an affine row by the fused kernel (its blocks
 * dequantized in registers once for up to eight rows of A), a row of a 32-value GGUF
 * block type likewise where the CPU has AVX-512F (gguf_blocks.h's many512 kernels), any
 * other dequantized into the part's buffer and multiplied by the few-columns kernel. */
static void batch_rows(const batch_job *job, int j0, int j1, float *buffer) {
  const shadow *s = &shadows[job->index];
  int row = job->first_row + j0;
  while (row >= s->rows) row -= s->rows, s++;
  for (int j = j0; j < j1; j++, row++) {
    if (row == s->rows) row = 0, s++; /* a matrix registered in pieces */
#ifdef HAVE_X86_VECTORS
    const float *lanes = s->format == NULL ? job->lanes[s->bits == 8] : NULL;
    /* two rows at once where both are this piece's and this part's */
    int rows = lanes != NULL && job->pairs && j + 1 < j1 && row + 1 < s->rows ? 2 : 1;
    /* Fetched ahead as shadow_product does: the hardware alone streamed a 4-bit
     * matrix at 3.1 GB/s here, 24.9 GFMA/s at m = 4 against 34.0 fetched ahead (the
     * same harness, 65536 x 1536). */
    for (int r = 0; r < rows; r++)
      if (row + r + PREFETCH_ROWS < s->rows && j + r + PREFETCH_ROWS < j1)
        prefetch_row(s, row + r + PREFETCH_ROWS);
    if (lanes != NULL) {
      size_t stride = job->lane_stride[s->bits == 8];
      float values[2 * 8];
      for (int q = 0; q < job->m; q += 8) {
        int count = job->m - q < 8 ? job->m - q : 8;
        dotm_for(s, rows)(s, row, lanes + (size_t)q * stride, count, values);
        for (int r = 0; r < rows; r++)
          for (int i = 0; i < count; i++) put(job, q + i, j + r, values[8 * r + i]);
      }
      j += rows - 1, row += rows - 1;
      continue;
    }
    block_many_fn many = s->format != NULL && wide_blocks_here()
                             ? (block_many_fn)s->format->many512 : NULL;
    if (many != NULL) { /* a 32-value block type: its weights made once in registers */
      const uint8_t *p = s->packed + (size_t)row * s->packed_step;
      float values[MANY_ROWS];
      for (int q = 0; q < job->m; q += MANY_ROWS) {
        int count = job->m - q < MANY_ROWS ? job->m - q : MANY_ROWS;
        many(p, s->cols / 32, job->a + (size_t)q * job->lda, job->lda, count, values);
        for (int i = 0; i < count; i++) put(job, q + i, j, values[i]);
      }
      continue;
    }
#endif
    dequantize_row(s, row, buffer);
    for (int q = 0; q < job->m; q += FEW_COLUMNS) {
      int columns = job->m - q < FEW_COLUMNS ? job->m - q : FEW_COLUMNS;
      scores(1, columns, job->k, job->alpha, buffer, job->k, job->a + (size_t)q * job->lda,
             job->lda, job->beta, job->c + (size_t)q * job->ldc + j, 1, job->ldc);
    }
  }
}

static void batch_part(void *args, int part, int parts) {
  const batch_job *job = args;
  int tiles = (job->n + BATCH_TILE - 1) / BATCH_TILE;
  int first = tiles * part / parts * BATCH_TILE, last = tiles * (part + 1) / parts * BATCH_TILE;
  if (last > job->n) last = job->n;
  if (first < last) batch_rows(job, first, last, job->buffers + (size_t)part * job->k);
}

/* The decode step's pool, lent by spmd_cp_forward_use_pool (kernels/decode_step.c:
 * one pool a rank), or none yet: the product runs on its caller alone. */
typedef void (*task_fn)(void *args, int part, int parts);
typedef void (*run_parallel_fn)(task_fn task, void *args);
static run_parallel_fn run_parallel;
static int pool_threads = 1;

/* Whether batched products take affine rows two at a time where the CPU has the
 * kernels for it (spmd_cp_forward_two_rows: tests compare both ways). */
static int two_rows_allowed = 1;

/* Two-row kernels allowed (`allowed` 1) or not (0); answers whether they run here. */
int spmd_cp_forward_two_rows(int allowed) {
  two_rows_allowed = allowed != 0;
#ifdef HAVE_X86_VECTORS
  return two_rows_allowed && avx512vl_here();
#else
  return 0;
#endif
}

void spmd_cp_forward_use_pool(run_parallel_fn run, int threads) {
  pool_threads = run == NULL || threads < 1 ? 1 : threads;
  __atomic_store_n(&run_parallel, run, __ATOMIC_RELEASE);
}

#ifdef HAVE_X86_VECTORS
/* The bit widths (4 | 8) of the affine pieces that hold rows [first_row, first_row + n)
 * of shadow `index` on (a matrix registered in pieces may mix them). */
static int affine_widths(int index, int first_row, int n) {
  const shadow *s = &shadows[index];
  int row = first_row, widths = 0;
  while (row >= s->rows) row -= s->rows, s++;
  for (int left = n; left > 0; row = 0, s++) {
    if (s->format == NULL) widths |= s->bits;
    left -= s->rows - row;
  }
  return widths;
}
#endif

/* c (m x n, ldc) = alpha A (m x k, rows lda apart) B' + beta c, B' the n rows from row
 * first_row of shadow `index` on: 0 where there is no memory for the buffers (nothing
 * written), else 1. */
static int batched_product(int index, int first_row, int m, int n, int k, float alpha,
                           const float *a, int lda, float beta, float *c, int ldc) {
  static __thread float *buffers; /* a part's row at part x k, then A's rows' lanes */
  static __thread size_t buffers_floats;
  run_parallel_fn run = __atomic_load_n(&run_parallel, __ATOMIC_ACQUIRE);
  int parts = run == NULL ? 1 : pool_threads;
  size_t stride4 = 0, stride8 = 0; /* the lanes' (the vector kernels' alone) */
#ifdef HAVE_X86_VECTORS
  if (avx2_here()) stride4 = padded_columns(k, 4), stride8 = padded_columns(k, 8);
#endif
  size_t wanted = (size_t)parts * k + (size_t)(m + 1) * (stride4 + stride8);
  if (buffers_floats < wanted) {
    float *grown = realloc(buffers, wanted * sizeof(float));
    if (grown == NULL) return 0;
    buffers = grown, buffers_floats = wanted;
  }
  batch_job job = {index, first_row, m, n, k, lda, ldc, alpha, beta, a, c, buffers,
                   {NULL, NULL}, {stride4, stride8}, parts, 0};
#ifdef HAVE_X86_VECTORS
  if (avx2_here()) { /* A's rows in the lane order of each kernel the rows use, once
                       * a product, each run of eight rows interleaved (interleaved_lanes) */
    float *lanes4 = buffers + (size_t)parts * k, *lanes8 = lanes4 + (size_t)m * stride4;
    float *row = lanes8 + (size_t)m * stride8;
    int widths = affine_widths(index, first_row, n);
    for (int q = 0; q < m; q += 8) {
      int count = m - q < 8 ? m - q : 8;
      if (widths & 4)
        interleaved_lanes(a + (size_t)q * lda, lda, count, k, 8, row,
                          lanes4 + (size_t)q * stride4);
      if (widths & 8)
        interleaved_lanes(a + (size_t)q * lda, lda, count, k, 4, row,
                          lanes8 + (size_t)q * stride8);
    }
    job.lanes[0] = widths & 4 ? lanes4 : NULL, job.lanes[1] = widths & 8 ? lanes8 : NULL;
    /* rows two at a time where one row's vectors of x outgrow the first-level cache
     * (within it 0.96-1.04x: the harness of dotm2's note) */
    job.pairs = two_rows_allowed && avx512vl_here() &&
                (size_t)(m < 8 ? m : 8) * k * sizeof(float) > PAIR_X_BYTES;
  }
#endif
  if (run == NULL) batch_part(&job, 0, 1);
  else run((task_fn)batch_part, &job);
  __atomic_fetch_add(&shadow_products, 1, __ATOMIC_RELAXED);
  return 1;
}

typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);

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
  if (order == ROW_MAJOR && a_plain && !b_plain && m >= 2 && m <= BATCH_ROWS && k > 0 &&
      n > 0 && __atomic_load_n(&shadow_count, __ATOMIC_ACQUIRE) > 0) {
    /* A few rows times a matrix held packed (released or not): read packed, once. */
    int index = shadow_of(b, n, ldb);
    if (index >= 0 && k == shadows[index].cols &&
        batched_product(index, (int)((b - shadows[index].weights) / k), m, n, k, alpha, a,
                        lda, beta, c, ldc))
      return;
  }
  if (__atomic_load_n(&released_count, __ATOMIC_ACQUIRE) > 0 && order == ROW_MAJOR &&
      m > 0 && n > 0 && k > 0) {
    /* A released matrix is only ever B given as rows (x times W transposed). */
    const float *a_end = a + (size_t)((a_plain ? m : k) - 1) * lda + (a_plain ? k : m);
    const float *b_end = b + (size_t)((b_plain ? k : n) - 1) * ldb + (b_plain ? n : k);
    if (released_within(a, a_end)) refuse_released();
    if (released_within(b, b_end)) {
      if (b_plain) refuse_released();
      int index = m == 1 && a_plain ? shadow_of(b, n, ldb) : -1;
      if (index < 0 || k != shadows[index].cols) { /* else the packed row kernel below */
        if (released_product(b, ldb, m, n, k, trans_a, alpha, a, lda, beta, c, ldc) != 1)
          refuse_released();
        return;
      }
    }
  }
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
      if (b_plain && k >= LONG_ROWS && n <= MAX_WIDTH) {
        /* One row times a matrix given plain, as the few-rows kernel below takes two to
         * eight (a RoPE matrix's one KV head, a query group of one over the values):
         * sgemv would split even a 256 x 256 product over the BLAS's threads, asleep
         * between calls, and wait for them to wake (Gemma 3 270M, one rank on 2 threads:
         * its attention calls 578 us a layer against 121 on one thread; 65 us here). */
        values(1, n, k, alpha, a, a_plain ? lda : 1, x_stride, b, ldb, beta, c, ldc);
        return;
      }
      int index = b_plain || x_stride != 1 ? -1 : shadow_of(b, n, ldb);
      if (index >= 0 && k == shadows[index].cols &&
          shadow_product(index, (int)((b - shadows[index].weights) / k), n, alpha, a, beta, c))
        return;
      if (beta == 0.0f) zero(c, n, 1);
      next_sgemv(ROW_MAJOR, b_plain ? TRANS : NO_TRANS, b_plain ? k : n, b_plain ? n : k,
                 alpha, b, ldb, a, x_stride, beta, c, 1);
    }
    return;
  }
  if (order == ROW_MAJOR && k > 0 && m > 0 && m <= FEW_COLUMNS && n >= LONG_ROWS &&
      a_plain && !b_plain) {
    /* The same scores the other way round: a query group's few rows times a shard's
     * keys given as rows (B transposed), each key row's dot products written down a
     * column of c. */
    scores(n, m, k, alpha, b, ldb, a, lda, beta, c, 1, ldc);
    return;
  }
  if (order == ROW_MAJOR && k >= LONG_ROWS && m > 0 && m <= STREAM_ROWS && n > 0 &&
      n <= MAX_WIDTH && b_plain) {
    /* Decode attention's values: a query group's probabilities (few rows, stored
     * either way) times a shard of values, in cache or not. */
    values(m, n, k, alpha, a, a_plain ? lda : 1, a_plain ? 1 : lda, b, ldb,
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
      next_sgemv(ROW_MAJOR, b_plain ? TRANS : NO_TRANS, b_plain ? k : n, b_plain ? n : k,
                 alpha, b, ldb, a_row, a_plain ? 1 : lda, beta, c_row, 1);
    }
    return;
  }
  if (order == ROW_MAJOR && k > 0 && n > 0 && n <= FEW_COLUMNS && m >= LONG_ROWS &&
      a_plain && !b_plain) {
    /* Decode attention's scores: a shard's keys (m x k) times a query group's few
     * columns, given as its rows (B transposed). */
    scores(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, 1);
    return;
  }
  next_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
