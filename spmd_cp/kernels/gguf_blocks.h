/*
 * GGUF's block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K to Q6_K, IQ4_NL,
 * IQ4_XS), dequantized from the file's own block bytes: for decode's quantized shadows
 * (gemv_forward.c), which read a matrix's blocks in place of its float32 copy.
 *
 * Each type has:
 *   - the reference dequantizer (`*_reference`, `count` consecutive blocks into floats):
 *     plain C, the float32 arithmetic of the gguf package's numpy dequantizer
 *     (gguf.quants, llama.cpp's reference) step by step: the float16 scales widened, a
 *     sub-block's scale a product of two float32 values, times the integer, then the
 *     minimum subtracted (or added), each a rounding of its own (never contracted into
 *     a fused multiply-add). Registration compares it with the float32 matrix bit for
 *     bit; it is also the plain C kernel's dequantizer.
 *   - with AVX2, FMA and F16C, one function per type (`*_run`) that unpacks 32 integers
 *     at a time with byte shifts and masks (IQ4's table with a byte shuffle; Q4_K widens
 *     each 8 bytes of its nibbles from memory) and makes each weight with one fused
 *     multiply-add of integer, scale and minimum (a K-quant's scales made eight at a
 *     time): either
 *     written out (`*_avx2`, registration's second check) or multiplied by x into four
 *     accumulators (`*_dot`, the kernel), the same instructions either way.
 *   - with AVX-512F, for Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K (llama.cpp's Q4_K_M
 *     layout and its 4- and 8-bit files), one row's product at 512 bits (`*_row512`),
 *     the kernel where the CPU has it; for the 32-value ones also several rows of x at
 *     once (`*_many512`, a batched decode step's products).
 * The fused multiply-add gives the reference's value: in every type here the product is
 * exact in float32 (an 11-bit float16 significand times integers of at most 13 bits
 * together), so the reference's only rounding is its last addition, and the fused
 * operation's one rounding is that one. Registration checks it anyway.
 *
 * Layouts (ggml-common.h; "e" a value's index in its block):
 *   Q4_0  d, qs[16]                   w = d (nibble - 8)
 *   Q4_1  d, m, qs[16]                w = d nibble + m
 *   Q8_0  d, qs[32] (int8)            w = d q
 *   Q5_0  d, qh[4], qs[16]            q = nibble | bit e of qh << 4, w = d (q - 16)
 *   Q5_1  d, m, qh[4], qs[16]         w = d q + m
 *   Q2_K  scales[16], qs[64], d, dmin w = (d (sc & 15)) q - dmin (sc >> 4), 16 a scale
 *   Q3_K  hmask[32], qs[64], scales[12], d   w = (d (s - 32)) (q - 4 (1 - hbit))
 *   Q4_K  d, dmin, scales[12], qs[128]       w = (d sc) q - (dmin m), 32 a scale
 *   Q5_K  d, dmin, scales[12], qh[32], qs[128]
 *   Q6_K  ql[128], qh[64], scales[16] (int8), d   w = (d sc) (q - 32), 16 a scale
 *   IQ4_NL d, qs[16]                  w = d table[nibble]
 *   IQ4_XS d, scales_h, scales_l[4], qs[128]  w = (d (s - 32)) table[nibble], 32 a scale
 * Low nibbles first: in 32-value blocks value e < 16 is byte e's low nibble and e + 16
 * its high one; in 256-value blocks each 32 (Q4_K, Q5_K) or 64 bytes (Q6_K) give the
 * low nibbles of one run of values and then the high nibbles of the next.
 */
#ifndef SPMD_CP_GGUF_BLOCKS_H
#define SPMD_CP_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "cpu_features.h"
#ifdef HAVE_X86_VECTORS
#include <immintrin.h>
#endif

/* No a * b + c contracted into one rounding in the reference dequantizers (GCC's
 * default contracts on CPUs with fused multiply-add, e.g. every ARMv8). */
#if defined(__clang__)
#define NO_CONTRACTION _Pragma("STDC FP_CONTRACT OFF")
#define REFERENCE_ARITHMETIC
#elif defined(__GNUC__)
#define NO_CONTRACTION
#define REFERENCE_ARITHMETIC __attribute__((optimize("fp-contract=off")))
#else
#define NO_CONTRACTION
#define REFERENCE_ARITHMETIC
#endif

/* GGML's type ids (ggml.h) of the types below. */
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
       GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q4_K = 12,
       GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_IQ4_NL = 20, GGML_IQ4_XS = 23 };
enum { BLOCK_VALUES_MAX = 256 };

static const int8_t IQ4_TABLE[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

/* A float16's value as float32 (exact). */
static inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, m = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (m << 13); /* infinity, NaN */
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (m << 13);
  } else if (m == 0) {
    bits = sign;
  } else { /* subnormal: normalized in float32 */
    int shift = 0;
    while (!(m & 0x400)) m <<= 1, shift++;
    bits = sign | ((uint32_t)(113 - shift) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline float half_at(const uint8_t *p) {
  return half_to_float((uint16_t)(p[0] | p[1] << 8));
}

/* Q4_K and Q5_K's eight 6-bit scales and minimums from their 12 bytes. */
static inline void k_scale_min(const uint8_t *s, int j, int *scale, int *min) {
  if (j < 4) {
    *scale = s[j] & 63, *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30);
    *min = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

/* Q3_K's sixteen scales, 6-bit, offset 32. */
static inline int q3k_scale(const uint8_t *s, int k) {
  int low = (s[k % 8] >> (4 * (k / 8))) & 0x0f, high = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
  return (low | high << 4) - 32;
}

/* IQ4_XS's eight scales, 6-bit, offset 32. */
static inline int iq4xs_scale(const uint8_t *b, int k) {
  int high = ((b[2] | b[3] << 8) >> (2 * k)) & 3, low = (b[4 + k / 2] >> (4 * (k % 2))) & 0x0f;
  return (low | high << 4) - 32;
}

typedef void (*block_fn)(const uint8_t *blocks, int count, float *out);

REFERENCE_ARITHMETIC static void q4_0_reference(const uint8_t *b, int count, float *out) {
  for (; count--; b += 18, out += 32) {
    float d = half_at(b);
    for (int e = 0; e < 32; e++)
      out[e] = d * (float)(((b[2 + e % 16] >> (e < 16 ? 0 : 4)) & 0x0f) - 8);
  }
}

REFERENCE_ARITHMETIC static void q4_1_reference(const uint8_t *b, int count, float *out) {
  NO_CONTRACTION
  for (; count--; b += 20, out += 32) {
    float d = half_at(b), m = half_at(b + 2);
    for (int e = 0; e < 32; e++) {
      float scaled = d * (float)((b[4 + e % 16] >> (e < 16 ? 0 : 4)) & 0x0f);
      out[e] = scaled + m;
    }
  }
}

REFERENCE_ARITHMETIC static void q5_0_reference(const uint8_t *b, int count, float *out) {
  for (; count--; b += 22, out += 32) {
    float d = half_at(b);
    uint32_t qh = b[2] | b[3] << 8 | b[4] << 16 | (uint32_t)b[5] << 24;
    for (int e = 0; e < 32; e++) {
      int q = ((b[6 + e % 16] >> (e < 16 ? 0 : 4)) & 0x0f) | ((qh >> e) & 1) << 4;
      out[e] = d * (float)(q - 16);
    }
  }
}

REFERENCE_ARITHMETIC static void q5_1_reference(const uint8_t *b, int count, float *out) {
  NO_CONTRACTION
  for (; count--; b += 24, out += 32) {
    float d = half_at(b), m = half_at(b + 2);
    uint32_t qh = b[4] | b[5] << 8 | b[6] << 16 | (uint32_t)b[7] << 24;
    for (int e = 0; e < 32; e++) {
      int q = ((b[8 + e % 16] >> (e < 16 ? 0 : 4)) & 0x0f) | ((qh >> e) & 1) << 4;
      float scaled = d * (float)q;
      out[e] = scaled + m;
    }
  }
}

REFERENCE_ARITHMETIC static void q8_0_reference(const uint8_t *b, int count, float *out) {
  for (; count--; b += 34, out += 32) {
    float d = half_at(b);
    for (int e = 0; e < 32; e++) out[e] = d * (float)(int8_t)b[2 + e];
  }
}

REFERENCE_ARITHMETIC static void q2_k_reference(const uint8_t *b, int count, float *out) {
  NO_CONTRACTION
  for (; count--; b += 84, out += 256) {
    float d = half_at(b + 80), dmin = half_at(b + 82);
    for (int e = 0; e < 256; e++) {
      int sc = b[e / 16];
      float dl = d * (float)(sc & 0x0f), ml = dmin * (float)(sc >> 4);
      int q = (b[16 + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
      float scaled = dl * (float)q;
      out[e] = scaled - ml;
    }
  }
}

REFERENCE_ARITHMETIC static void q3_k_reference(const uint8_t *b, int count, float *out) {
  NO_CONTRACTION
  for (; count--; b += 110, out += 256) {
    float d = half_at(b + 108);
    for (int e = 0; e < 256; e++) {
      float dl = d * (float)q3k_scale(b + 96, e / 16);
      int low = (b[32 + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
      int high = (b[e % 32] >> (e / 32)) & 1;
      out[e] = dl * (float)(low - ((high ^ 1) << 2));
    }
  }
}

REFERENCE_ARITHMETIC static void q4_k_reference(const uint8_t *b, int count, float *out) {
  NO_CONTRACTION
  for (; count--; b += 144, out += 256) {
    float d = half_at(b), dmin = half_at(b + 2);
    for (int e = 0; e < 256; e++) {
      int j = e / 32, scale, min;
      k_scale_min(b + 4, j, &scale, &min);
      float dl = d * (float)scale, ml = dmin * (float)min;
      int q = (b[16 + 32 * (j / 2) + e % 32] >> (4 * (j % 2))) & 0x0f;
      float scaled = dl * (float)q;
      out[e] = scaled - ml;
    }
  }
}

REFERENCE_ARITHMETIC static void q5_k_reference(const uint8_t *b, int count, float *out) {
  NO_CONTRACTION
  for (; count--; b += 176, out += 256) {
    float d = half_at(b), dmin = half_at(b + 2);
    for (int e = 0; e < 256; e++) {
      int j = e / 32, scale, min;
      k_scale_min(b + 4, j, &scale, &min);
      float dl = d * (float)scale, ml = dmin * (float)min;
      int q = ((b[48 + 32 * (j / 2) + e % 32] >> (4 * (j % 2))) & 0x0f) |
              ((b[16 + e % 32] >> j) & 1) << 4;
      float scaled = dl * (float)q;
      out[e] = scaled - ml;
    }
  }
}

REFERENCE_ARITHMETIC static void q6_k_reference(const uint8_t *b, int count, float *out) {
  NO_CONTRACTION
  for (; count--; b += 210, out += 256) {
    float d = half_at(b + 208);
    for (int e = 0; e < 256; e++) {
      int h = e / 128, s = (e % 128) / 64, t = (e % 128) / 32;
      int low = (b[64 * h + e % 64] >> (4 * s)) & 0x0f;
      int high = (b[128 + 32 * h + e % 32] >> (2 * t)) & 3;
      float dl = d * (float)(int8_t)b[192 + e / 16];
      out[e] = dl * (float)((low | high << 4) - 32);
    }
  }
}

REFERENCE_ARITHMETIC static void iq4_nl_reference(const uint8_t *b, int count, float *out) {
  for (; count--; b += 18, out += 32) {
    float d = half_at(b);
    for (int e = 0; e < 32; e++)
      out[e] = d * (float)IQ4_TABLE[(b[2 + e % 16] >> (e < 16 ? 0 : 4)) & 0x0f];
  }
}

REFERENCE_ARITHMETIC static void iq4_xs_reference(const uint8_t *b, int count, float *out) {
  NO_CONTRACTION
  for (; count--; b += 136, out += 256) {
    float d = half_at(b);
    for (int e = 0; e < 256; e++) {
      float dl = d * (float)iq4xs_scale(b, e / 32);
      int nibble = (b[8 + 16 * (e / 32) + e % 16] >> (4 * ((e % 32) / 16))) & 0x0f;
      out[e] = dl * (float)IQ4_TABLE[nibble];
    }
  }
}

#ifdef HAVE_X86_VECTORS
#define BLOCKS_TARGET __attribute__((target("avx2,fma,f16c")))
#define BLOCKS_INLINE BLOCKS_TARGET static inline __attribute__((always_inline))
#define BLOCKS_UNROLLED _Pragma("GCC unroll 8")


/* The 32 integers in q (bytes, signed or not) times `first` (values 0-15) and
 * `second` (16-31) plus `bias_first` / `bias_second` where `with_bias`: written to out
 * (`store`) or their products with x added into sum[0..3]. */
BLOCKS_INLINE void emit32(__m256i q, int is_signed, float first, float second,
                          float bias_first, float bias_second, int with_bias, int store,
                          float *out, const float *x, __m256 *sum) {
  __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  BLOCKS_UNROLLED for (int part = 0; part < 4; part++) {
    __m128i bytes = part % 2 ? _mm_srli_si128(halves[part / 2], 8) : halves[part / 2];
    __m256i wide = is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    __m256 scale = _mm256_set1_ps(part < 2 ? first : second), w;
    if (with_bias)
      w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), scale,
                          _mm256_set1_ps(part < 2 ? bias_first : bias_second));
    else
      w = _mm256_mul_ps(_mm256_cvtepi32_ps(wide), scale);
    if (store)
      _mm256_storeu_ps(out + 8 * part, w);
    else
      sum[part] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * part), sum[part]);
  }
}

/* 16 bytes' low nibbles, then their high nibbles: 32 values in a block's order. */
BLOCKS_INLINE __m256i nibbles16(const uint8_t *p) {
  __m128i bytes = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low),
                          _mm_and_si128(bytes, low));
}

/* Bit e of 32 bits as 0x10 in byte e (a 5-bit type's top bit). */
BLOCKS_INLINE __m256i top_bits32(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                            0x0303030303030303LL);
  const __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  __m256i x = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), mask);
  return _mm256_and_si256(_mm256_cmpeq_epi8(x, mask), _mm256_set1_epi8(0x10));
}

/* (32 bytes >> shift) & mask, shift a multiple the bytes keep apart (16-bit lanes). */
#define FIELD32(bytes, shift, mask) \
  _mm256_and_si256(_mm256_srli_epi16(bytes, shift), _mm256_set1_epi8((char)(mask)))

static inline uint32_t u32_at(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

BLOCKS_INLINE float half_of(const uint8_t *p) {
  return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8));
}

/* Eight bytes at p (signed or not) as floats. */
BLOCKS_INLINE __m256 floats8(const void *p, int is_signed) {
  __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes)
                                      : _mm256_cvtepu8_epi32(bytes));
}

/* One type's two entry points from its `NAME_run(blocks, count, store, out, x, sum)`. */
#define BLOCK_ENTRIES(NAME)                                                              \
  BLOCKS_TARGET static void NAME##_avx2(const uint8_t *b, int count, float *out) {      \
    NAME##_run(b, count, 1, out, out, NULL); /* x unread when storing */                    \
  }                                                                                      \
  BLOCKS_TARGET static void NAME##_dot(const uint8_t *b, int count, const float *x,     \
                                       __m256 *sum) {                                    \
    NAME##_run(b, count, 0, NULL, x, sum);                                                  \
  }

BLOCKS_INLINE void q4_0_run(const uint8_t *b, int count, int store, float *out, const float *x,
                            __m256 *sum) {
  for (; count--; b += 18, out += store ? 32 : 0, x += 32) {
    float d = half_of(b);
    emit32(_mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8)), 1, d, d, 0, 0, 0, store,
           out, x, sum);
  }
}
BLOCK_ENTRIES(q4_0)

BLOCKS_INLINE void q4_1_run(const uint8_t *b, int count, int store, float *out, const float *x,
                            __m256 *sum) {
  for (; count--; b += 20, out += store ? 32 : 0, x += 32) {
    float d = half_of(b), m = half_of(b + 2);
    emit32(nibbles16(b + 4), 0, d, d, m, m, 1, store, out, x, sum);
  }
}
BLOCK_ENTRIES(q4_1)

BLOCKS_INLINE void q5_0_run(const uint8_t *b, int count, int store, float *out, const float *x,
                            __m256 *sum) {
  for (; count--; b += 22, out += store ? 32 : 0, x += 32) {
    float d = half_of(b);
    __m256i q = _mm256_or_si256(nibbles16(b + 6), top_bits32(u32_at(b + 2)));
    emit32(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), 1, d, d, 0, 0, 0, store, out, x, sum);
  }
}
BLOCK_ENTRIES(q5_0)

BLOCKS_INLINE void q5_1_run(const uint8_t *b, int count, int store, float *out, const float *x,
                            __m256 *sum) {
  for (; count--; b += 24, out += store ? 32 : 0, x += 32) {
    float d = half_of(b), m = half_of(b + 2);
    __m256i q = _mm256_or_si256(nibbles16(b + 8), top_bits32(u32_at(b + 4)));
    emit32(q, 0, d, d, m, m, 1, store, out, x, sum);
  }
}
BLOCK_ENTRIES(q5_1)

/* Each eight bytes widened from memory (no shuffles: the bytes are the integers). */
BLOCKS_INLINE void q8_0_run(const uint8_t *b, int count, int store, float *out, const float *x,
                            __m256 *sum) {
  for (; count--; b += 34, out += store ? 32 : 0, x += 32) {
    __m256 d = _mm256_set1_ps(half_of(b));
    BLOCKS_UNROLLED for (int part = 0; part < 4; part++) {
      __m256 w = _mm256_mul_ps(floats8(b + 2 + 8 * part, 1), d);
      if (store)
        _mm256_storeu_ps(out + 8 * part, w);
      else
        sum[part] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * part), sum[part]);
    }
  }
}
BLOCK_ENTRIES(q8_0)

BLOCKS_INLINE void q2_k_run(const uint8_t *b, int count, int store, float *out, const float *x,
                            __m256 *sum) {
  for (; count--; b += 84, out += store ? 256 : 0, x += 256) {
    float d = half_of(b + 80), dmin = half_of(b + 82), dl[16], ml[16];
    for (int k = 0; k < 16; k++)
      dl[k] = d * (float)(b[k] & 0x0f), ml[k] = -(dmin * (float)(b[k] >> 4));
    BLOCKS_UNROLLED for (int h = 0; h < 2; h++) {
      __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * h));
      BLOCKS_UNROLLED for (int t = 0; t < 4; t++) {
        int c = 4 * h + t; /* values 32c .. 32c + 31 */
        emit32(FIELD32(bytes, 2 * t, 3), 0, dl[2 * c], dl[2 * c + 1], ml[2 * c],
               ml[2 * c + 1], 1, store, out + (store ? 32 * c : 0), x + 32 * c, sum);
      }
    }
  }
}
BLOCK_ENTRIES(q2_k)

BLOCKS_INLINE void q3_k_run(const uint8_t *b, int count, int store, float *out, const float *x,
                            __m256 *sum) {
  for (; count--; b += 110, out += store ? 256 : 0, x += 256) {
    float d = half_of(b + 108), dl[16];
    for (int k = 0; k < 16; k++) dl[k] = d * (float)q3k_scale(b + 96, k);
    __m256i hmask = _mm256_loadu_si256((const __m256i *)b);
    BLOCKS_UNROLLED for (int h = 0; h < 2; h++) {
      __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * h));
      BLOCKS_UNROLLED for (int t = 0; t < 4; t++) {
        int c = 4 * h + t;
        __m256i high = FIELD32(hmask, c, 1); /* 1: no offset, 0: minus 4 */
        __m256i q = _mm256_sub_epi8(
            FIELD32(bytes, 2 * t, 3),
            _mm256_slli_epi16(_mm256_xor_si256(high, _mm256_set1_epi8(1)), 2));
        emit32(q, 1, dl[2 * c], dl[2 * c + 1], 0, 0, 0, store, out + (store ? 32 * c : 0),
               x + 32 * c, sum);
      }
    }
  }
}
BLOCK_ENTRIES(q3_k)

/* Q4_K and Q5_K: 32 values a scale and a minimum (negated: the bias added), eight
 * of each: the 6-bit fields gathered a word at a time (as llama.cpp's kernels do; the
 * values k_scale_min reads one by one), then widened and multiplied eight at once. */
BLOCKS_INLINE void k_scales(const uint8_t *b, float *dl, float *ml) {
  uint32_t u[4];
  memcpy(u, b + 4, 12);
  const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  u[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4); /* minimums 4-7 */
  uint32_t minimums = u[1] & six;                            /* minimums 0-3 */
  u[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);         /* scales 4-7 */
  u[2] = minimums;
  u[0] &= six;                                               /* scales 0-3 */
  _mm256_storeu_ps(dl, _mm256_mul_ps(_mm256_set1_ps(half_of(b)), floats8(u, 0)));
  _mm256_storeu_ps(ml, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(half_of(b + 2)),
                                                   floats8(u + 2, 0)),
                                     _mm256_set1_ps(-0.0f)));
}

/* Eight weights w: written to out + at (`store`) or their products with x + at added
 * into sum[part]. */
BLOCKS_INLINE void emit8(__m256 w, int part, int at, int store, float *out, const float *x,
                         __m256 *sum) {
  if (store)
    _mm256_storeu_ps(out + at, w);
  else
    sum[part] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + at), sum[part]);
}

/* Each 8 bytes of a run of 32 widened once, from memory, for both of their nibbles (the
 * run's values e and e + 32): no shuffle of the run in registers (1.25x emit32's way,
 * one thread, 4096 x 4096, timed by hand; the same sums in the same order). */
BLOCKS_INLINE void q4_k_run(const uint8_t *b, int count, int store, float *out, const float *x,
                            __m256 *sum) {
  const __m256i low = _mm256_set1_epi32(0x0f);
  for (; count--; b += 144, out += store ? 256 : 0, x += 256) {
    float dl[8], ml[8];
    k_scales(b, dl, ml);
    BLOCKS_UNROLLED for (int c = 0; c < 4; c++) { /* values 64c .. 64c + 63 */
      __m256 d0 = _mm256_set1_ps(dl[2 * c]), m0 = _mm256_set1_ps(ml[2 * c]);
      __m256 d1 = _mm256_set1_ps(dl[2 * c + 1]), m1 = _mm256_set1_ps(ml[2 * c + 1]);
      BLOCKS_UNROLLED for (int part = 0; part < 4; part++) {
        __m256i q = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64((const __m128i *)(b + 16 + 32 * c + 8 * part)));
        emit8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, low)), d0, m0), part,
              64 * c + 8 * part, store, out, x, sum);
        emit8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d1, m1), part,
              64 * c + 32 + 8 * part, store, out, x, sum);
      }
    }
  }
}
BLOCK_ENTRIES(q4_k)

BLOCKS_INLINE void q5_k_run(const uint8_t *b, int count, int store, float *out, const float *x,
                            __m256 *sum) {
  for (; count--; b += 176, out += store ? 256 : 0, x += 256) {
    float dl[8], ml[8];
    k_scales(b, dl, ml);
    __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
    BLOCKS_UNROLLED for (int c = 0; c < 4; c++) {
      __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * c));
      BLOCKS_UNROLLED for (int s = 0; s < 2; s++) {
        int j = 2 * c + s;
        __m256i q = _mm256_or_si256(FIELD32(bytes, 4 * s, 0x0f),
                                    _mm256_slli_epi16(FIELD32(qh, j, 1), 4));
        emit32(q, 0, dl[j], dl[j], ml[j], ml[j], 1, store, out + (store ? 32 * j : 0), x + 32 * j,
               sum);
      }
    }
  }
}
BLOCK_ENTRIES(q5_k)

/* A Q6_K block's d times each 16 values' signed scale, eight at once. */
BLOCKS_INLINE void q6_k_scales(const uint8_t *b, float *dl) {
  __m256 d = _mm256_set1_ps(half_of(b + 208));
  BLOCKS_UNROLLED for (int k = 0; k < 16; k += 8)
    _mm256_storeu_ps(dl + k, _mm256_mul_ps(d, floats8(b + 192 + k, 1)));
}

/* A Q6_K block's run c = 4h + 2s + u (values 128h + 64s + 32u .. + 31) as 32 signed
 * integers q - 32. */
BLOCKS_INLINE __m256i q6_k_values32(const uint8_t *b, int h, int s, int u) {
  __m256i high = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
  __m256i low = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * u));
  __m256i q = _mm256_or_si256(FIELD32(low, 4 * s, 0x0f),
                              _mm256_slli_epi16(FIELD32(high, 2 * (2 * s + u), 3), 4));
  return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
}

BLOCKS_INLINE void q6_k_run(const uint8_t *b, int count, int store, float *out, const float *x,
                            __m256 *sum) {
  for (; count--; b += 210, out += store ? 256 : 0, x += 256) {
    float dl[16];
    q6_k_scales(b, dl);
    BLOCKS_UNROLLED for (int h = 0; h < 2; h++)
      BLOCKS_UNROLLED for (int u = 0; u < 2; u++)
        BLOCKS_UNROLLED for (int s = 0; s < 2; s++) {
          int c = 4 * h + 2 * s + u;
          emit32(q6_k_values32(b, h, s, u), 1, dl[2 * c], dl[2 * c + 1], 0, 0, 0, store,
                 out + (store ? 32 * c : 0), x + 32 * c, sum);
        }
  }
}
BLOCK_ENTRIES(q6_k)

/* IQ4's table looked up for 32 nibbles (a byte shuffle). */
BLOCKS_INLINE __m256i iq4_values(__m256i nibbles) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_TABLE));
  return _mm256_shuffle_epi8(table, nibbles);
}

BLOCKS_INLINE void iq4_nl_run(const uint8_t *b, int count, int store, float *out, const float *x,
                              __m256 *sum) {
  for (; count--; b += 18, out += store ? 32 : 0, x += 32) {
    float d = half_of(b);
    emit32(iq4_values(nibbles16(b + 2)), 1, d, d, 0, 0, 0, store, out, x, sum);
  }
}
BLOCK_ENTRIES(iq4_nl)

BLOCKS_INLINE void iq4_xs_run(const uint8_t *b, int count, int store, float *out, const float *x,
                              __m256 *sum) {
  for (; count--; b += 136, out += store ? 256 : 0, x += 256) {
    float d = half_of(b);
    BLOCKS_UNROLLED for (int k = 0; k < 8; k++) {
      float dl = d * (float)iq4xs_scale(b, k);
      emit32(iq4_values(nibbles16(b + 8 + 16 * k)), 1, dl, dl, 0, 0, 0, store,
             out + (store ? 32 * k : 0), x + 32 * k, sum);
    }
  }
}
BLOCK_ENTRIES(iq4_xs)

typedef void (*block_dot_fn)(const uint8_t *blocks, int count, const float *x, __m256 *sum);

/*
 * One row's product at 512 bits (AVX-512F) for the types of llama.cpp's Q4_K_M layout
 * (Q5_0, Q4_K, Q6_K, Q8_0: most of such a file's weights) and of its 4-bit files (Q4_0,
 * Q4_1): 16 integers widened a vector from memory or from 16 bytes made as above, one
 * conversion, one multiply-add each, so a weight costs about half the instructions of
 * the 256-bit kernel (Gemma 3 270M's layers' products 1.15x (Q4_K) to 1.46x (Q5_0) on a
 * Zen 4, one thread, a C harness; Q4_1 2.1x on a Zen 5). Q4_0's, Q5_0's and Q8_0's scale
 * multiplies each block's sum of products (Q5_0's top bit a mask register: 16 minus
 * where it is clear); Q4_1, Q4_K and Q6_K make each weight as the 256-bit kernels do.
 * Two accumulators of 16 lanes: the sums' order differs from the 256-bit kernels', the
 * values agree to float32 rounding.
 */
#define WIDE_TARGET __attribute__((target("avx2,fma,f16c,avx512f")))
#define WIDE_INLINE WIDE_TARGET static inline __attribute__((always_inline))

typedef float (*block_row_fn)(const uint8_t *blocks, int count, const float *x);

WIDE_INLINE __m512 half16(const uint8_t *p) {
  short h;
  memcpy(&h, p, sizeof h);
  return _mm512_cvtph_ps(_mm256_set1_epi16(h));
}

/* A Q5_0 block's 32 integers (q - 16) as floats, values 0-15 and 16-31. */
WIDE_INLINE void q5_0_integers(const uint8_t *b, __m512 *q) {
  const __m512i low = _mm512_set1_epi32(0x0f), sixteen = _mm512_set1_epi32(16);
  uint32_t top = u32_at(b + 2);
  __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 6)));
  __m512i first = _mm512_and_si512(bytes, low), second = _mm512_srli_epi32(bytes, 4);
  first = _mm512_mask_sub_epi32(first, (__mmask16)~top, first, sixteen);
  second = _mm512_mask_sub_epi32(second, (__mmask16)~(top >> 16), second, sixteen);
  q[0] = _mm512_cvtepi32_ps(first), q[1] = _mm512_cvtepi32_ps(second);
}

/* A Q4_0 block's 32 integers (q - 8) as floats, values 0-15 and 16-31. */
WIDE_INLINE void q4_0_integers(const uint8_t *b, __m512 *q) {
  const __m512i low = _mm512_set1_epi32(0x0f), eight = _mm512_set1_epi32(8);
  __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
  q[0] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(bytes, low), eight));
  q[1] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bytes, 4), eight));
}

/* A Q4_1 block's 32 weights, values 0-15 and 16-31: one fused multiply-add each (q d is
 * exact, so the reference's one rounding). */
WIDE_INLINE void q4_1_weights32(const uint8_t *b, __m512 *w) {
  const __m512i low = _mm512_set1_epi32(0x0f);
  __m512 d = half16(b), m = half16(b + 2);
  __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 4)));
  w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, low)), d, m);
  w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), d, m);
}

/* A Q4_1 block's 32 weights times x, added into sum[0..1]. */
WIDE_INLINE void q4_1_products(const uint8_t *b, const float *x, __m512 *sum) {
  __m512 w[2];
  q4_1_weights32(b, w);
  sum[0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(x), sum[0]);
  sum[1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(x + 16), sum[1]);
}

WIDE_TARGET static float q4_1_row512(const uint8_t *b, int count, const float *x) {
  __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()}; /* even blocks in 0-1, odd ones in 2-3 */
  for (; count >= 2; count -= 2, b += 40, x += 64) {
    q4_1_products(b, x, sum);
    q4_1_products(b + 20, x + 32, sum + 2);
  }
  if (count) q4_1_products(b, x, sum);
  return _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3])));
}

/* A Q8_0 block's 32 integers as floats, values 0-15 and 16-31 (widened from memory). */
WIDE_INLINE void q8_0_integers(const uint8_t *b, __m512 *q) {
  const __m128i *bytes = (const __m128i *)(b + 2);
  q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes)));
  q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes + 1)));
}

/* The types whose weight is d times an integer (Q4_0, Q5_0, Q8_0), from NAME_integers:
 * one row's product with d multiplying each block's sum of products, in two latency
 * chains (even and odd blocks; `NAME_row512`), and a block's 32 weights (d q, exact:
 * `NAME_weights32`, for the batched kernel below). */
#define SCALED_BLOCKS(NAME, BYTES)                                                       \
  WIDE_INLINE __m512 NAME##_products16(const uint8_t *b, const float *x) {               \
    __m512 q[2];                                                                         \
    NAME##_integers(b, q);                                                               \
    return _mm512_fmadd_ps(q[1], _mm512_loadu_ps(x + 16),                                \
                           _mm512_mul_ps(q[0], _mm512_loadu_ps(x)));                     \
  }                                                                                      \
  WIDE_TARGET static float NAME##_row512(const uint8_t *b, int count, const float *x) {  \
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();                        \
    for (; count >= 2; count -= 2, b += 2 * (BYTES), x += 64) {                          \
      even = _mm512_fmadd_ps(half16(b), NAME##_products16(b, x), even);                  \
      odd = _mm512_fmadd_ps(half16(b + (BYTES)), NAME##_products16(b + (BYTES), x + 32), \
                            odd);                                                        \
    }                                                                                    \
    if (count) even = _mm512_fmadd_ps(half16(b), NAME##_products16(b, x), even);         \
    return _mm512_reduce_add_ps(_mm512_add_ps(even, odd));                               \
  }                                                                                      \
  WIDE_INLINE void NAME##_weights32(const uint8_t *b, __m512 *w) {                       \
    __m512 d = half16(b);                                                                \
    NAME##_integers(b, w);                                                               \
    w[0] = _mm512_mul_ps(w[0], d), w[1] = _mm512_mul_ps(w[1], d);                        \
  }
SCALED_BLOCKS(q4_0, 18)
SCALED_BLOCKS(q5_0, 22)
SCALED_BLOCKS(q8_0, 34)

/* 32 bytes' integers (signed) times `first` (values 0-15) and `second` (16-31), their
 * products with x added into sum[0..1]. */
WIDE_INLINE void emit32_wide(__m256i q, float first, float second, const float *x,
                             __m512 *sum) {
  __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
  __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
  sum[0] = _mm512_fmadd_ps(_mm512_mul_ps(a, _mm512_set1_ps(first)), _mm512_loadu_ps(x), sum[0]);
  sum[1] = _mm512_fmadd_ps(_mm512_mul_ps(b, _mm512_set1_ps(second)), _mm512_loadu_ps(x + 16),
                           sum[1]);
}

WIDE_TARGET static float q6_k_row512(const uint8_t *b, int count, const float *x) {
  __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (; count--; b += 210, x += 256) {
    float dl[16]; /* q6_k_scales's, sixteen at once: read back a lane at a time (from
                   * memory; made eight at a time GCC keeps them in registers and
                   * shuffles each out, 10% slower) */
    __m512i scales = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)));
    _mm512_storeu_ps(dl, _mm512_mul_ps(_mm512_set1_ps(half_of(b + 208)),
                                       _mm512_cvtepi32_ps(scales)));
    BLOCKS_UNROLLED for (int h = 0; h < 2; h++)
      BLOCKS_UNROLLED for (int u = 0; u < 2; u++)
        BLOCKS_UNROLLED for (int s = 0; s < 2; s++) {
          int c = 4 * h + 2 * s + u;
          emit32_wide(q6_k_values32(b, h, s, u), dl[2 * c], dl[2 * c + 1], x + 32 * c, sum);
        }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
}

/* Each 16 bytes of a run of 32 widened once, from memory, for both of their nibbles. */
WIDE_TARGET static float q4_k_row512(const uint8_t *b, int count, const float *x) {
  __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  const __m512i low = _mm512_set1_epi32(0x0f);
  for (; count--; b += 144, x += 256) {
    float dl[8], ml[8];
    k_scales(b, dl, ml);
    BLOCKS_UNROLLED for (int c = 0; c < 4; c++) { /* values 64c .. 64c + 63 */
      __m512 d0 = _mm512_set1_ps(dl[2 * c]), m0 = _mm512_set1_ps(ml[2 * c]);
      __m512 d1 = _mm512_set1_ps(dl[2 * c + 1]), m1 = _mm512_set1_ps(ml[2 * c + 1]);
      BLOCKS_UNROLLED for (int part = 0; part < 2; part++) {
        const float *at = x + 64 * c + 16 * part;
        __m512i q = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)(b + 16 + 32 * c + 16 * part)));
        __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), d0, m0);
        __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d1, m1);
        sum[part] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(at), sum[part]);
        sum[part] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(at + 32), sum[part]);
      }
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
}

/*
 * Several rows of x (a batched decode step's) times one weight row of a 32-value type:
 * each block's 32 weights made once, in two vectors of sixteen (the reference's values:
 * every product here exact, Q4_1's q d + m one fused rounding), then multiplied into
 * one accumulator per row of x, up to MANY_ROWS rows a call.
 */
enum { MANY_ROWS = 8 };
typedef void (*block_many_fn)(const uint8_t *blocks, int count, const float *x, size_t ldx,
                              int m, float *out);

#define WIDE_MANY(NAME, BYTES)                                                           \
  WIDE_TARGET static void NAME##_many512(const uint8_t *b, int count, const float *x,    \
                                         size_t ldx, int m, float *out) {                \
    __m512 sum[MANY_ROWS];                                                               \
    BLOCKS_UNROLLED for (int i = 0; i < MANY_ROWS; i++) sum[i] = _mm512_setzero_ps();    \
    for (; count--; b += BYTES, x += 32) {                                               \
      __m512 w[2];                                                                       \
      NAME##_weights32(b, w);                                                            \
      BLOCKS_UNROLLED for (int i = 0; i < MANY_ROWS; i++) {                              \
        if (i >= m) break;                                                               \
        const float *row = x + i * ldx;                                                  \
        sum[i] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(row), sum[i]);                    \
        sum[i] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(row + 16), sum[i]);               \
      }                                                                                  \
    }                                                                                    \
    for (int i = 0; i < m; i++) out[i] = _mm512_reduce_add_ps(sum[i]);                   \
  }
WIDE_MANY(q4_0, 18)
WIDE_MANY(q4_1, 20)
WIDE_MANY(q5_0, 22)
WIDE_MANY(q8_0, 34)
#endif

/* A block type: its id, values and bytes a block, and its two dequantizers. */
typedef struct {
  int type, values, bytes;
  block_fn reference, vectors; /* vectors: NULL without AVX2 */
  void *dot;                   /* block_dot_fn, the vectors' kernel; NULL without AVX2 */
  void *row512;                /* block_row_fn, one row at 512 bits; NULL where none */
  void *many512;               /* block_many_fn, rows of x at 512 bits; NULL where none */
} block_format;

#ifdef HAVE_X86_VECTORS
#define WITH_VECTORS(name) name##_avx2, (void *)name##_dot
#define WIDE(name) (void *)name##_row512, NULL
#define WIDE_AND_MANY(name) (void *)name##_row512, (void *)name##_many512
#else
#define WITH_VECTORS(name) NULL, NULL
#define WIDE(name) NULL, NULL
#define WIDE_AND_MANY(name) NULL, NULL
#endif

static const block_format BLOCK_FORMATS[] = {
    {GGML_Q4_0, 32, 18, q4_0_reference, WITH_VECTORS(q4_0), WIDE_AND_MANY(q4_0)},
    {GGML_Q4_1, 32, 20, q4_1_reference, WITH_VECTORS(q4_1), WIDE_AND_MANY(q4_1)},
    {GGML_Q5_0, 32, 22, q5_0_reference, WITH_VECTORS(q5_0), WIDE_AND_MANY(q5_0)},
    {GGML_Q5_1, 32, 24, q5_1_reference, WITH_VECTORS(q5_1), NULL, NULL},
    {GGML_Q8_0, 32, 34, q8_0_reference, WITH_VECTORS(q8_0), WIDE_AND_MANY(q8_0)},
    {GGML_Q2_K, 256, 84, q2_k_reference, WITH_VECTORS(q2_k), NULL, NULL},
    {GGML_Q3_K, 256, 110, q3_k_reference, WITH_VECTORS(q3_k), NULL, NULL},
    {GGML_Q4_K, 256, 144, q4_k_reference, WITH_VECTORS(q4_k), WIDE(q4_k)},
    {GGML_Q5_K, 256, 176, q5_k_reference, WITH_VECTORS(q5_k), NULL, NULL},
    {GGML_Q6_K, 256, 210, q6_k_reference, WITH_VECTORS(q6_k), WIDE(q6_k)},
    {GGML_IQ4_NL, 32, 18, iq4_nl_reference, WITH_VECTORS(iq4_nl), NULL, NULL},
    {GGML_IQ4_XS, 256, 136, iq4_xs_reference, WITH_VECTORS(iq4_xs), NULL, NULL},
};

static const block_format *block_format_of(int type) {
  for (size_t i = 0; i < sizeof BLOCK_FORMATS / sizeof *BLOCK_FORMATS; i++)
    if (BLOCK_FORMATS[i].type == type) return &BLOCK_FORMATS[i];
  return NULL;
}

#endif
