/*
 * check.h -- the assertion harness of the C tests: count passes, print one
 * line per failed check, and a closing "NAME: N passed, M failed" line.
 */
#ifndef DCS_TEST_CHECK_H
#define DCS_TEST_CHECK_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>

typedef struct {
    int passed, failed;
} check_counts;

static bool check_count(check_counts *c, bool ok, int line, const char *fmt, va_list ap) {
    if (ok) {
        c->passed++;
        return true;
    }
    c->failed++;
    printf("FAIL line %d: ", line);
    vprintf(fmt, ap);
    printf("\n");
    return false;
}

/* Print the closing line; the exit status of the test program. */
static int check_report(const char *name, const check_counts *c) {
    printf("%s: %d passed, %d failed\n", name, c->passed, c->failed);
    return c->failed ? 1 : 0;
}

#endif
