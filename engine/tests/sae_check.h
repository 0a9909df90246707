/*
 * sae_check.h -- what the two C tests of the sparse dictionaries share
 * (test_sae.c, test_sae_batchtopk.c): their counts with CHECK / CHECKF on
 * check.h's harness, and the xorshift draws of their inputs.
 */
#ifndef DCS_TEST_SAE_CHECK_H
#define DCS_TEST_SAE_CHECK_H

#include "check.h"

#include <stdint.h>

static check_counts counts;

static bool check_at(bool ok, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    bool r = check_count(&counts, ok, line, fmt, ap);
    va_end(ap);
    return r;
}
#define CHECK(cond) check_at((cond), __LINE__, "%s", #cond)
#define CHECKF(cond, ...) check_at((cond), __LINE__, __VA_ARGS__)

static uint64_t rng = 88172645463325252ull;
static float urand(void) { /* [-1, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

#endif
