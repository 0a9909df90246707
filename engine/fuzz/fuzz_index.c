/*
 * fuzz_index.c -- libFuzzer target for the sharded-checkpoint index
 * (model.safetensors.index.json, pytorch_model.bin.index.json): the
 * weight_map parsing of dcs_parse_index_json, which load_index runs before it
 * maps any shard.
 *
 * The input is the whole index file, NUL-terminated as dcs_read_text_file
 * leaves it. Whatever the parser accepts must be sane: at least one entry,
 * names sorted strictly (so unique; dcs_tt_find-style bsearch works), every
 * shard a plain file name that cannot leave the model directory. A refused
 * index leaves the output empty and names the file.
 * Build and run with engine/fuzz/run.sh.
 */
#include "dcs_io.h"

#include <stdlib.h>
#include <string.h>

#define PATH "fuzz/model.safetensors.index.json"

static void check_index(const dcs_index *ix) {
    if (ix->n < 1 || ix->n > DCS_MAX_TENSORS || ix->m == NULL || ix->json == NULL) abort();
    for (int i = 0; i < ix->n; i++) {
        const char *name = ix->m[i].name, *shard = ix->m[i].shard;
        if (name == NULL || shard == NULL) abort();
        if (i > 0 && strcmp(ix->m[i - 1].name, name) >= 0) abort();
        if (shard[0] == '\0' || strchr(shard, '/') != NULL || strstr(shard, "..") != NULL ||
            strcmp(shard, ".") == 0)
            abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    if (text == NULL) abort();
    memcpy(text, data, size);
    text[size] = '\0';
    dcs_index ix;
    dcs_err e;
    memset(&e, 0, sizeof e);
    dcs_status s = dcs_parse_index_json(text, size, PATH, &ix, &e);
    if (s == DCS_OK)
        check_index(&ix);
    else if (ix.m != NULL || ix.n != 0 || ix.json != NULL || e.code != s || strstr(e.msg, PATH) == NULL)
        abort(); /* errors leave the index empty and name the file */
    dcs_index_free(&ix);
    free(text);
    return 0;
}
