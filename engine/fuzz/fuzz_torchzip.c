/*
 * fuzz_torchzip.c -- libFuzzer target for the PyTorch zip reader (zip parser and
 * restricted unpickler).
 *
 * The input is a whole checkpoint file (a zip holding data.pkl and the
 * storages). Whatever the parser accepts must be sane: every tensor lies
 * inside the input, holds numel * dtype-size bytes, and can be widened to
 * float32 (which reads every byte, so ASan catches a bad extent).
 * Build and run with engine/fuzz/run.sh.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

static void check_table(const dcs_tensor_table *tt, const uint8_t *data, size_t size)
{
    for (int i = 0; i < tt->n; i++) {
        const dcs_tensor *t = &tt->t[i];
        uint64_t numel = dcs_tensor_numel(t);
        if (t->nbytes != numel * dcs_dtype_size(t->dtype) || t->data < data ||
            t->nbytes > (uint64_t)(data + size - t->data) || dcs_tt_find(tt, t->name) != t ||
            (i > 0 && strcmp(tt->t[i - 1].name, t->name) >= 0))
            abort();
        if (numel <= (1u << 20)) {
            float *out = malloc(numel ? numel * sizeof *out : 1);
            if (out == NULL)
                abort();
            dcs_tensor_to_f32(t, out);
            free(out);
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    dcs_tensor_table tt = {0};
    dcs_err e;
    if (dcs_tt_parse_torchzip(&tt, data, size, "fuzz.bin", &e) == DCS_OK)
        check_table(&tt, data, size);
    else if (tt.n != 0 || strstr(e.msg, "fuzz.bin") == NULL)
        abort();                         /* errors leave the table empty and name the file */
    dcs_tt_free(&tt);
    return 0;
}
