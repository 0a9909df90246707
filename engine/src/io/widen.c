/*
 * widen.c -- F16 / BF16 -> float32, exact, for any alignment, of raw
 * values (dcs_widen) and of a table's tensors (dcs_tensor_to_f32; the loaders
 * widen small tensors with it; the CPU backend uses it where the CPU has no
 * conversion instruction, and for tails). Its own file so that code needing
 * only the conversion (the CUDA kernel test links the CPU backend) does not
 * pull in the checkpoint parsers.
 */
#include "dcs_io.h"

#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------ widening */

static float bits_to_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static uint32_t f32_to_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

/* IEEE half -> float, exact for every input. Half = sign, 5-bit exponent
 * (bias 15), 10-bit mantissa; float has an 8-bit exponent (bias 127), so a
 * normal half only needs its exponent rebiased by 112 and its mantissa
 * shifted up 13 bits. Inf/NaN (exponent 31) map to exponent 255, keeping the
 * NaN payload. Zero and subnormals are mantissa * 2^-24, which the float
 * arithmetic below computes exactly (both factors and the product are
 * representable). The cases are selected with masks, not branches, so the
 * loop in widen16 vectorizes. */
static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;                         /* exponent and mantissa */
    uint32_t inf_nan = 0u - (uint32_t)(em >= 0x7c00u); /* all ones when true */
    uint32_t small = 0u - (uint32_t)(em < 0x0400u);    /* zero, subnormal */
    uint32_t bits = (em << 13) + (112u << 23) + (inf_nan & (112u << 23));
    uint32_t sub = f32_to_bits((float)em * 0x1p-24f);
    bits = (bits & ~small) | (sub & small);
    return bits_to_f32(bits | sign);
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoint data is read in place as little-endian; big-endian hosts are unsupported"
#endif

/* Widen n 16-bit values (F16 or BF16) at unaligned src. Works through a
 * fixed-size aligned block so the conversion loop has a constant trip count
 * and compilers vectorize it at -O2. */
#define WIDEN_BLOCK 256

static void widen16(const uint8_t *src, uint64_t n, int dtype, float *out) {
    uint16_t in[WIDEN_BLOCK];
    float tmp[WIDEN_BLOCK];
    for (uint64_t i = 0; i < n; i += WIDEN_BLOCK) {
        size_t m = n - i < WIDEN_BLOCK ? (size_t)(n - i) : WIDEN_BLOCK;
        memcpy(in, src + 2 * i, 2 * m);
        if (m < WIDEN_BLOCK) memset(in + m, 0, 2 * (WIDEN_BLOCK - m));
        if (dtype == DCS_F16)
            for (size_t k = 0; k < WIDEN_BLOCK; k++) tmp[k] = f16_to_f32(in[k]);
        else /* BF16: the upper half of a float */
            for (size_t k = 0; k < WIDEN_BLOCK; k++) tmp[k] = bits_to_f32((uint32_t)in[k] << 16);
        memcpy(out + i, tmp, m * sizeof *out);
    }
}

void dcs_widen(const void *src, uint64_t n, int dtype, float *out) {
    if (dtype == DCS_F32) {
        if (n > 0) memcpy(out, src, (size_t)n * sizeof *out);
    } else if (dtype == DCS_F16 || dtype == DCS_BF16) {
        widen16(src, n, dtype, out);
    }
}

/* ------------------------------------------------------------ narrowing */

/* float -> IEEE half, rounded to nearest even (what torch's .half() and
 * CUDA's __float2half_rn give): overflow becomes +-inf, values below the
 * smallest subnormal become +-0, NaN stays NaN (quiet). */
static uint16_t f32_to_f16(float f) {
    uint32_t x = f32_to_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
    if (ax < 0x38800000u) {                                   /* below 2^-14: subnormal or zero */
        /* the half subnormal m * 2^-24, m = round(|f| * 2^24): exact in float
         * up to the rounding, which rint does to nearest even */
        float a = bits_to_f32(ax) * 0x1p24f;
        uint32_t m = (uint32_t)__builtin_rintf(a);
        return (uint16_t)(sign | m); /* m == 0x400 is the smallest normal */
    }
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u); /* round to nearest even at bit 13 */
    return (uint16_t)(sign | ((r - (112u << 23)) >> 13));
}

/* float -> bfloat16, rounded to nearest even; NaN stays NaN (quiet). */
static uint16_t f32_to_bf16(float f) {
    uint32_t x = f32_to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

void dcs_narrow(const float *src, uint64_t n, int dtype, void *out) {
    uint8_t *o = out;
    for (uint64_t i = 0; i < n; i++) {
        uint16_t h = dtype == DCS_F16 ? f32_to_f16(src[i]) : f32_to_bf16(src[i]);
        memcpy(o + 2 * i, &h, 2);
    }
}

/* ------------------------------------------------------------ tensors */

uint64_t dcs_tensor_numel(const dcs_tensor *t) {
    uint64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i]; /* the loaders checked it fits */
    return n;
}

void dcs_tensor_to_f32(const dcs_tensor *t, float *out) {
    uint64_t n = dcs_tensor_numel(t);
    switch (t->dtype) {
    case DCS_F32: /* same layout; maybe unaligned */
        if (n > 0) memcpy(out, t->data, (size_t)n * sizeof *out);
        break;
    case DCS_F16:
    case DCS_BF16: dcs_widen(t->data, n, t->dtype, out); break;
    default: break;
    }
}
