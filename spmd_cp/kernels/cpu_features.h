/*
 * Whether this x86 CPU runs the kernels' vector code: AVX2 and FMA (the float32 loops),
 * F16C (float16 <-> float32 conversions). GCC's __builtin_cpu_supports knows "f16c";
 * clang's (14) does not, so F16C is read from CPUID leaf 1 (ECX bit 29) with <cpuid.h>,
 * which both compilers ship. Asked once per library. AVX-512VL (32 vector registers
 * for the same 256-bit code) where a kernel has a two-row form; AVX-512F where it has
 * a 512-bit form.
 */
#ifndef SPMD_CP_CPU_FEATURES_H
#define SPMD_CP_CPU_FEATURES_H

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(SPMD_CP_PORTABLE) /* the plain C alone: how the tests build an ARM's code */
#include <cpuid.h>
#define HAVE_X86_VECTORS 1

static inline int cpu_has_f16c(void) {
  unsigned int eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
  return (ecx & bit_F16C) != 0;
}

/* AVX2 and FMA, and F16C where `with_f16c`. */
static inline int cpu_has_avx2_fma(int with_f16c) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         (!with_f16c || cpu_has_f16c());
}

/* AVX-512F: 512-bit vectors (the GGUF block types' row kernels). */
static inline int cpu_has_avx512f(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

/* AVX-512F and VL: 32 vector registers for 256-bit code (the two-row kernels). */
static inline int cpu_has_avx512vl(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
}
#endif

#endif
