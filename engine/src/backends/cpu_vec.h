/*
 * cpu_vec.h -- DCS_VEC: a CPU kernel compiled for the widest SIMD the CPU has
 * (function multi-versioning on x86-64 with GCC; plain C elsewhere), so the
 * dcs_math.h arithmetic inlined into it vectorises. The arithmetic stays
 * dcs_math.h's, op for op (no FMA contraction under -std=c11), so every
 * clone computes the same bits.
 */
#ifndef DCS_CPU_VEC_H
#define DCS_CPU_VEC_H

#include "dcs_backend.h" /* DCS_KEY_PAD */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define DCS_VEC __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DCS_VEC
#endif

/* A block of DCS_KEY_PAD keys as one GCC/Clang vector (split into the
 * clone's widest registers: one zmm under avx512f); lane-wise IEEE
 * arithmetic, the same bits as the scalar loop in every clone (no
 * contraction under -std=c11). Loaded and stored through vkb_u (any float
 * alignment; no vector-returning helpers, whose ABI would differ between
 * clones). */
typedef float vkb __attribute__((vector_size(DCS_KEY_PAD * sizeof(float))));
typedef float vkb_u __attribute__((vector_size(DCS_KEY_PAD * sizeof(float)), aligned(4), may_alias));
#define vld(p) (*(const vkb_u *)(p))
#define vst(p, v) (*(vkb_u *)(p) = (v))

#endif
