/*
 * A KV cache stored in half precision (float16 or bfloat16), read in float32: the
 * decode step's store of a token's key and value, and the widening of the rows its
 * attention reads (half_attention.h: each key and value in registers as the products
 * read it; without AVX2, decode_step.c: a tile at a time, into float32 in cache, for the
 * same products a float32 cache gets). As llama.cpp does, the cache holds half the bytes
 * of a float32 one and every product accumulates in float32.
 *
 * Conversions round to nearest even, as MLX's astype does (so a token stored here has
 * the bits MLX would have stored): F16C on x86 CPUs that have it, else the portable
 * bit manipulations below (F. Giesen's float/half routines), which any C compiler builds
 * (ARM, macOS clang).
 */
#ifndef SPMD_CP_KV_HALF_H
#define SPMD_CP_KV_HALF_H

#include <stdint.h>
#include <string.h>

#include "cpu_features.h"

/* How the cache's elements are stored (engine/decode/native_decode.py passes the cache's). */
enum { KV_FLOAT32 = 0, KV_FLOAT16 = 1, KV_BFLOAT16 = 2 };
/* The longest head (native_eligibility.py checks), and the floats of a tile of widened
 * rows (64 KB: in the second-level cache, and at least 64 rows of up to 256 values, the
 * length the attention kernels of gemv_forward.c take). */
enum { MAX_HEAD_DIM = 512, KV_TILE_FLOATS = 16384 };

static inline float bits_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
static inline uint32_t float_bits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  return bits;
}

/* IEEE binary16 <-> binary32. */
enum { HALF_EXPONENT = 0x7c00, HALF_QUIET_NAN = 0x7e00, HALF_SIGN = 0x8000 };

static inline float half_to_float(uint16_t h) {
  const uint32_t shifted_exponent = (uint32_t)HALF_EXPONENT << 13;
  uint32_t out = ((uint32_t)h & 0x7fffu) << 13; /* exponent and mantissa in place */
  uint32_t exponent = out & shifted_exponent;
  out += (127u - 15u) << 23; /* rebias */
  if (exponent == shifted_exponent) {
    out += (128u - 16u) << 23; /* infinity or NaN */
  } else if (exponent == 0) { /* zero or subnormal: renormalized by a float subtraction */
    out += 1u << 23;
    out = float_bits(bits_float(out) - bits_float(113u << 23));
  }
  return bits_float(out | ((uint32_t)h & HALF_SIGN) << 16);
}

static inline uint16_t float_to_half(float f) {
  const uint32_t infinity = 255u << 23, too_large = (127u + 16u) << 23;
  const uint32_t smallest_normal = 113u << 23, subnormal_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t x = float_bits(f), sign = x & 0x80000000u;
  x ^= sign;
  uint16_t out;
  if (x >= too_large) { /* infinity, NaN, or rounds to infinity */
    out = x > infinity ? HALF_QUIET_NAN : HALF_EXPONENT;
  } else if (x < smallest_normal) { /* subnormal: the float addition rounds to even */
    out = (uint16_t)(float_bits(bits_float(x) + bits_float(subnormal_magic)) - subnormal_magic);
  } else {
    uint32_t odd = (x >> 13) & 1u; /* ties to even */
    x += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
    out = (uint16_t)(x >> 13);
  }
  return out | (uint16_t)(sign >> 16);
}

/* bfloat16: the upper half of a float32, rounded to nearest even (NaN kept quiet). */
static inline float bfloat_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }

static inline uint16_t float_to_bfloat(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static void half_row_plain(const float *x, int n, int kind, uint16_t *out) {
  for (int i = 0; i < n; i++) out[i] = kind == KV_FLOAT16 ? float_to_half(x[i]) : float_to_bfloat(x[i]);
}

static void widen_row_plain(const uint16_t *h, int n, int kind, float *out) {
  for (int i = 0; i < n; i++) out[i] = kind == KV_FLOAT16 ? half_to_float(h[i]) : bfloat_to_float(h[i]);
}

#ifdef HAVE_X86_VECTORS
#include <immintrin.h>
#define HALF_VECTORS __attribute__((target("avx2,fma,f16c")))
enum { HALF_LANES = 8 };

HALF_VECTORS static void half_row_avx2(const float *x, int n, int kind, uint16_t *out) {
  int i = 0;
  if (kind == KV_FLOAT16)
    for (; i + HALF_LANES <= n; i += HALF_LANES)
      _mm_storeu_si128((__m128i *)(out + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  half_row_plain(x + i, n - i, kind, out + i);
}

HALF_VECTORS static void widen_row_avx2(const uint16_t *h, int n, int kind, float *out) {
  int i = 0;
  for (; i + HALF_LANES <= n; i += HALF_LANES) {
    __m128i eight = _mm_loadu_si128((const __m128i *)(h + i));
    __m256 wide = kind == KV_FLOAT16
                      ? _mm256_cvtph_ps(eight)
                      : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(eight), 16));
    _mm256_storeu_ps(out + i, wide);
  }
  widen_row_plain(h + i, n - i, kind, out + i);
}

static int half_vectors_here(void) {
  static int known = -1;
  if (known < 0) known = cpu_has_avx2_fma(1);
  return known;
}
#define HALF_PICK(name) (half_vectors_here() ? name##_avx2 : name##_plain)
#else
#define HALF_PICK(name) name##_plain
#endif

/* x (n floats) stored as `kind` halves at out. */
static void half_row(const float *x, int n, int kind, uint16_t *out) { HALF_PICK(half_row)(x, n, kind, out); }

/* n halves of `kind` widened (exactly) into float32 at out. */
static void widen_row(const uint16_t *h, int n, int kind, float *out) {
  HALF_PICK(widen_row)(h, n, kind, out);
}

#endif
