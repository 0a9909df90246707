/*
 * cpu_vec.h -- DCS_VEC: a CPU kernel compiled for the widest SIMD the CPU has
 * (function multi-versioning on x86-64 with GCC; plain C elsewhere), so the
 * dcs_math.h arithmetic inlined into it vectorises. The arithmetic stays
 * dcs_math.h's, op for op (no FMA contraction under -std=c11), so every
 * clone computes the same bits.
 */
#ifndef DCS_CPU_VEC_H
#define DCS_CPU_VEC_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define DCS_VEC __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DCS_VEC
#endif

#endif
