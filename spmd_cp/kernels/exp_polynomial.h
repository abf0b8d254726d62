/*
 * exp(x) for x <= 0 in single precision: the one source of the polynomial that
 * kernels/decode_step.c evaluates (scalar, and eight lanes with AVX2) and
 * attention/exp.py compiles through MLX (it reads the numbers below from this file,
 * kernels/constants.py). Cephes expf: x = n ln2 + r, n the nearest integer to x / ln2
 * (rounded by adding 1.5 * 2^23), ln2 split in two so that r is exact, e^r by a degree-7
 * polynomial in Estrin's form, 2^n built from its exponent bits. Within 2 ulp of a
 * float64 exp (tests/test_exp.py); 0 from EXP_LOWEST down; NaN stays NaN.
 *
 * Each constant is one `#define NAME value` line: kernels/constants.py parses them.
 */
#ifndef SPMD_CP_EXP_POLYNOMIAL_H
#define SPMD_CP_EXP_POLYNOMIAL_H

#include <stdint.h>
#include <string.h>

#define EXP_LOG2E 1.4426950408889634
#define EXP_LN2_HI 0.693359375 /* ln 2 = LN2_HI + LN2_LO; n * LN2_HI exact for |n| < 2^10 */
#define EXP_LN2_LO -2.12194440e-4
#define EXP_ROUNDING_SHIFT 12582912.0 /* 1.5 * 2^23: (y + shift) - shift rounds y */
#define EXP_LOWEST -88.0              /* n = -127 here: 2^n's exponent bits are 0 */
/* e^r = 1 + r + r^2 (C0 + C1 r + ... + C5 r^5) on |r| <= ln2 / 2 */
#define EXP_C0 5.0000001201e-1
#define EXP_C1 1.6666665459e-1
#define EXP_C2 4.1665795894e-2
#define EXP_C3 8.3334519073e-3
#define EXP_C4 1.3981999507e-3
#define EXP_C5 1.9875691500e-4
#define FLOAT_EXPONENT_BIAS 127
#define FLOAT_MANTISSA_BITS 23

/* The polynomial on one float (no contraction: each product rounds on its own, as MLX's
 * ops and the eight-lane form below round). */
static inline float exp_nonpositive(float x) {
  x = x < (float)EXP_LOWEST ? (float)EXP_LOWEST : x;
  float n = (x * (float)EXP_LOG2E + (float)EXP_ROUNDING_SHIFT) - (float)EXP_ROUNDING_SHIFT;
  float r = (x - n * (float)EXP_LN2_HI) - n * (float)EXP_LN2_LO;
  float r2 = r * r;
  float tail = ((float)EXP_C0 + (float)EXP_C1 * r) + r2 * ((float)EXP_C2 + (float)EXP_C3 * r) +
               (r2 * r2) * ((float)EXP_C4 + (float)EXP_C5 * r);
  int32_t bits = ((int32_t)n + FLOAT_EXPONENT_BIAS) << FLOAT_MANTISSA_BITS;
  float two_n;
  memcpy(&two_n, &bits, sizeof two_n);
  return ((r + 1.0f) + r2 * tail) * two_n;
}

#include "cpu_features.h"
#ifdef HAVE_X86_VECTORS
#include <immintrin.h>

/* The same steps on eight lanes (explicit products: no contraction either). */
__attribute__((target("avx2,fma"))) static inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps((float)EXP_LOWEST), x); /* NaN stays NaN */
  __m256 shift = _mm256_set1_ps((float)EXP_ROUNDING_SHIFT);
  __m256 n = _mm256_sub_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps((float)EXP_LOG2E)), shift), shift);
  __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps((float)EXP_LN2_HI))),
                           _mm256_mul_ps(n, _mm256_set1_ps((float)EXP_LN2_LO)));
  __m256 r2 = _mm256_mul_ps(r, r);
#define EXP_LINEAR(A, B) \
  _mm256_add_ps(_mm256_set1_ps((float)(A)), _mm256_mul_ps(_mm256_set1_ps((float)(B)), r))
  __m256 tail = _mm256_add_ps(
      _mm256_add_ps(EXP_LINEAR(EXP_C0, EXP_C1), _mm256_mul_ps(r2, EXP_LINEAR(EXP_C2, EXP_C3))),
      _mm256_mul_ps(_mm256_mul_ps(r2, r2), EXP_LINEAR(EXP_C4, EXP_C5)));
#undef EXP_LINEAR
  __m256 e_r = _mm256_add_ps(_mm256_add_ps(r, _mm256_set1_ps(1.0f)), _mm256_mul_ps(r2, tail));
  __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(FLOAT_EXPONENT_BIAS)),
      FLOAT_MANTISSA_BITS);
  return _mm256_mul_ps(e_r, _mm256_castsi256_ps(bits));
}
#endif

#endif
