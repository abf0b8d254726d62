/*
 * Decode attention's two products over a half-precision cache (kv_half.h), each key and
 * value widened into float32 in registers as it is read (decode_step.c).
 *
 * The portable path widens a tile of rows into a float32 buffer and hands it to the
 * float32 kernels (cblas_sgemm, gemv_forward.c's attention kernels): every element is
 * loaded, widened, stored and loaded again. Here, with AVX2, FMA and F16C and a head
 * width that is a multiple of 8, each element is loaded once and widened into the
 * register the products use. The scores sum as the float32 kernels do (eight lanes
 * along the head, then ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7))); the values sum in
 * blocks of HALF_VALUE_TILE rows: the portable path's results to float32 rounding.
 * On the 2-core AMD EPYC machine (one thread's CPU time, 30 layers of three KV heads,
 * float16, 2026-11-26): 1,500 keys a head 6.6 -> 4.6 ms, 3,250 keys 14.9 -> 8.7 ms
 * against the widened tiles.
 */
#ifndef SPMD_CP_HALF_ATTENTION_H
#define SPMD_CP_HALF_ATTENTION_H

#include <stdint.h>
#include <string.h>

#include "kv_half.h"

#ifdef HAVE_X86_VECTORS
#include <immintrin.h>

/* Query rows a pass over the keys or values takes at once. */
enum { HALF_CHUNK = 4, HALF_VALUE_TILE = 128 };
#define HALF_UNROLLED _Pragma("GCC unroll 16")

/* Eight halves of `kind` at h, widened exactly. */
HALF_VECTORS static inline __m256 half8(const uint16_t *h, int kind) {
  __m128i eight = _mm_loadu_si128((const __m128i *)h);
  return kind == KV_FLOAT16
             ? _mm256_cvtph_ps(eight)
             : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(eight), 16));
}

/* The sum of v's lanes, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)). */
HALF_VECTORS static inline float half_lanes_sum(__m256 v) {
  __m256 pairs = _mm256_hadd_ps(v, v), quads = _mm256_hadd_ps(pairs, pairs);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}

/* The lane sums of four vectors at once (lane i: the i-th's), in the same order. */
HALF_VECTORS static inline __m128 half_four_sums(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
}

/* Keys [t, t + ROWS) against N query rows: scores[j * stride + t + r]. */
#define HALF_SCORE_BLOCK(ROWS)                                                           \
  do {                                                                                   \
    __m256 sum[ROWS][QUERIES];                                                                 \
    HALF_UNROLLED for (int r = 0; r < ROWS; r++)                                         \
      HALF_UNROLLED for (int j = 0; j < QUERIES; j++) sum[r][j] = _mm256_setzero_ps();         \
    for (int x = 0; x < d; x += 8) {                                                     \
      __m256 query[QUERIES];                                                                   \
      HALF_UNROLLED for (int j = 0; j < QUERIES; j++) query[j] = _mm256_loadu_ps(q + j * d + x); \
      HALF_UNROLLED for (int r = 0; r < ROWS; r++) {                                     \
        __m256 key = half8(keys + (size_t)(t + r) * d + x, kind);                        \
        HALF_UNROLLED for (int j = 0; j < QUERIES; j++)                                        \
          sum[r][j] = _mm256_fmadd_ps(key, query[j], sum[r][j]);                         \
      }                                                                                  \
    }                                                                                    \
    HALF_UNROLLED for (int j = 0; j < QUERIES; j++) {                                          \
      if (ROWS == 4)                                                                     \
        _mm_storeu_ps(scores + (size_t)j * stride + t,                                   \
                      half_four_sums(sum[0][j], sum[1 % ROWS][j], sum[2 % ROWS][j],      \
                                     sum[3 % ROWS][j]));                                 \
      else                                                                               \
        HALF_UNROLLED for (int r = 0; r < ROWS; r++)                                     \
          scores[(size_t)j * stride + t + r] = half_lanes_sum(sum[r][j]);                \
    }                                                                                    \
  } while (0)

/* N query rows (q, d apart) times `count` keys: four keys at a time for N <= 3 (twelve
 * sums, three queries and a key in the sixteen vector registers), two for N = 4. */
#define HALF_SCORES(N)                                                                   \
  HALF_VECTORS static void half_scores_##N(const uint16_t *keys, int kind, const float *q, \
                                           int d, int count, float *scores, int stride) { \
    enum { R = (N) <= 3 ? 4 : 2, QUERIES = N };                                          \
    int t = 0;                                                                           \
    for (; t + R <= count; t += R) HALF_SCORE_BLOCK(R);                                  \
    for (; t < count; t++) HALF_SCORE_BLOCK(1);                                          \
  }

HALF_SCORES(1)
HALF_SCORES(2)
HALF_SCORES(3)
HALF_SCORES(4)

typedef void (*half_scores_fn)(const uint16_t *, int, const float *, int, int, float *, int);
static const half_scores_fn half_scores_n[HALF_CHUNK + 1] = {
    NULL, half_scores_1, half_scores_2, half_scores_3, half_scores_4};

/* M rows of probabilities (p, `stride` apart) times `count` values into o (rows `width`
 * apart): the values in tiles of HALF_VALUE_TILE rows (in the first-level cache for the
 * passes after the first), each tile in passes of 8W columns, each tile's sums added
 * to the tiles' before in o (a sum in blocks: over a long cache closer to the exact
 * one than a single running sum). */
#define HALF_VALUES(M)                                                                   \
  HALF_VECTORS static void half_values_##M(const uint16_t *values, int kind, const float *p, \
                                           int stride, int d, int count, float *o,       \
                                           int width) {                                  \
    enum { W = (M) <= 2 ? 4 : 2 };                                                       \
    for (int start = 0; start < count; start += HALF_VALUE_TILE) {                       \
      int stop = count - start < HALF_VALUE_TILE ? count : start + HALF_VALUE_TILE;      \
      for (int j = 0; j < d; j += 8 * W) {                                               \
        int vectors = (d - j) / 8 < W ? (d - j) / 8 : W;                                 \
        __m256 sum[M][W];                                                                \
        HALF_UNROLLED for (int i = 0; i < M; i++)                                        \
          HALF_UNROLLED for (int w = 0; w < W; w++)                                      \
            sum[i][w] = _mm256_setzero_ps();                                             \
        for (int r = start; r < stop; r++) {                                             \
          __m256 value[W];                                                               \
          HALF_UNROLLED for (int w = 0; w < W; w++)                                      \
            value[w] = w < vectors ? half8(values + (size_t)r * d + j + 8 * w, kind)     \
                                   : _mm256_setzero_ps();                                \
          HALF_UNROLLED for (int i = 0; i < M; i++) {                                    \
            __m256 weight = _mm256_broadcast_ss(p + (size_t)i * stride + r);             \
            HALF_UNROLLED for (int w = 0; w < W; w++)                                    \
              sum[i][w] = _mm256_fmadd_ps(weight, value[w], sum[i][w]);                  \
          }                                                                              \
        }                                                                                \
        HALF_UNROLLED for (int i = 0; i < M; i++)                                        \
          HALF_UNROLLED for (int w = 0; w < W; w++) {                                    \
            if (w >= vectors) continue;                                                  \
            float *out = o + (size_t)i * width + j + 8 * w;                              \
            _mm256_storeu_ps(out, start ? _mm256_add_ps(_mm256_loadu_ps(out), sum[i][w]) \
                                        : sum[i][w]);                                    \
          }                                                                              \
      }                                                                                  \
    }                                                                                    \
  }

HALF_VALUES(1)
HALF_VALUES(2)
HALF_VALUES(3)
HALF_VALUES(4)

typedef void (*half_values_fn)(const uint16_t *, int, const float *, int, int, int, float *, int);
static const half_values_fn half_values_n[HALF_CHUNK + 1] = {
    NULL, half_values_1, half_values_2, half_values_3, half_values_4};

/* Whether the fused kernels take a head of d values here. */
static int half_fused_here(int d) { return d % 8 == 0 && half_vectors_here(); }

/* scores (group rows, `stride` apart) = q (group x d) times `count` keys, and
 * o (group rows, `width` apart) = p (group x count, `stride` apart) times `count`
 * values, in chunks of at most HALF_CHUNK query rows. */
static void half_scores_fused(const uint16_t *keys, int kind, const float *q, int group,
                              int d, int count, float *scores, int stride) {
  for (int j = 0; j < group; j += HALF_CHUNK) {
    int n = group - j < HALF_CHUNK ? group - j : HALF_CHUNK;
    half_scores_n[n](keys, kind, q + (size_t)j * d, d, count, scores + (size_t)j * stride, stride);
  }
}

static void half_values_fused(const uint16_t *values, int kind, const float *p, int group,
                              int stride, int d, int count, float *o, int width) {
  for (int i = 0; i < group; i += HALF_CHUNK) {
    int m = group - i < HALF_CHUNK ? group - i : HALF_CHUNK;
    half_values_n[m](values, kind, p + (size_t)i * stride, stride, d, count,
                     o + (size_t)i * width, width);
  }
}
#endif

#endif
