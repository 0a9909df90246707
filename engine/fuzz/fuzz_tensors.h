/*
 * fuzz_tensors.h -- what the weight-file fuzz targets share: parse a whole
 * file from memory and check the result. Whatever a parser accepts must be
 * sane: every tensor lies inside the input (or, a strided view, in its own
 * contiguous copy), holds numel * dtype-size bytes,
 * names are sorted and findable, and each can be widened to float32 (which
 * reads every byte, so ASan catches a bad extent). A refusal must leave the
 * table empty and name the file.
 */
#ifndef DCS_FUZZ_TENSORS_H
#define DCS_FUZZ_TENSORS_H

#include "dcs_io.h"

#include <stdlib.h>
#include <string.h>

static void check_table(const dcs_tensor_table *tt, const uint8_t *data, size_t size) {
    for (int i = 0; i < tt->n; i++) {
        const dcs_tensor *t = &tt->t[i];
        uint64_t numel = dcs_tensor_numel(t);
        /* a strided view is a contiguous copy the table owns; else in the input */
        int in_input = !t->owned && t->data >= data && t->nbytes <= (uint64_t)(data + size - t->data);
        if (t->nbytes != numel * dcs_dtype_size(t->dtype) || (!t->owned && !in_input) ||
            (t->owned && t->data != t->owned) || dcs_tt_find(tt, t->name) != t ||
            (i > 0 && strcmp(tt->t[i - 1].name, t->name) >= 0))
            abort();
        if (numel <= (1u << 20)) {
            float *out = malloc(numel ? numel * sizeof *out : 1);
            if (out == NULL) abort();
            dcs_tensor_to_f32(t, out);
            free(out);
        }
    }
}

typedef dcs_status (*parse_fn)(dcs_tensor_table *, const uint8_t *, uint64_t, const char *, dcs_err *);

static void fuzz_parse(parse_fn parse, const char *name, const uint8_t *data, size_t size) {
    dcs_tensor_table tt = {0};
    dcs_err e;
    if (parse(&tt, data, size, name, &e) == DCS_OK)
        check_table(&tt, data, size);
    else if (tt.n != 0 || strstr(e.msg, name) == NULL)
        abort();
    dcs_tt_free(&tt);
}

#endif
