/*
 * index.c -- the index of a sharded checkpoint (model.safetensors.index.json,
 * pytorch_model.bin.index.json): its weight_map {tensor name: shard file},
 * sorted by name, names unique, every shard a plain file name (no '/', no
 * ".."). layouts.c opens the shards it names.
 */
#include "dcs_io.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_map_name(const void *a, const void *b) {
    return strcmp(((const dcs_index_entry *)a)->name, ((const dcs_index_entry *)b)->name);
}

/* A shard must be a plain file name in the model directory. */
static bool plain_file_name(const char *s) {
    return s[0] != '\0' && strchr(s, '/') == NULL && strstr(s, "..") == NULL && strcmp(s, ".") != 0;
}

void dcs_index_free(dcs_index *ix) {
    if (ix == NULL) return;
    free(ix->m);
    cJSON_Delete((cJSON *)ix->json);
    memset(ix, 0, sizeof *ix);
}

/* Parse the index JSON and read weight_map into a sorted array; names
 * unique, shards plain. */
dcs_status dcs_parse_index_json(const char *text, size_t len, const char *ipath, dcs_index *out, dcs_err *e) {
    memset(out, 0, sizeof *out);
    dcs_status st = dcs_json_check_text(text, len, ipath, e);
    if (st != DCS_OK) return st;
    cJSON *root = cJSON_ParseWithLength(text, len);
    if (root == NULL) return dcs_seterr(e, DCS_ERR_FORMAT, "%s: not valid JSON", ipath);
    st = dcs_json_unique_keys(root, ipath, e);
    if (st != DCS_OK) {
        cJSON_Delete(root);
        return st;
    }
    dcs_index_entry *m = NULL;
    int n = 0, i = 0;
    const cJSON *wm = cJSON_IsObject(root) ? cJSON_GetObjectItemCaseSensitive(root, "weight_map") : NULL;
    if (!cJSON_IsObject(wm)) {
        st = dcs_seterr(e, DCS_ERR_FORMAT, "%s: no \"weight_map\" object", ipath);
        goto done;
    }
    n = cJSON_GetArraySize(wm);
    if (n <= 0) {
        st = dcs_seterr(e, DCS_ERR_FORMAT, "%s: \"weight_map\" is empty", ipath);
        goto done;
    }
    if (n > DCS_MAX_TENSORS) {
        st = dcs_seterr(e, DCS_ERR_NOMEM, "%s: more than %d tensors", ipath, DCS_MAX_TENSORS);
        goto done;
    }
    m = malloc((size_t)n * sizeof *m);
    if (m == NULL) {
        st = dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", ipath);
        goto done;
    }
    for (const cJSON *it = wm->child; it != NULL && i < n; it = it->next, i++) {
        if (!cJSON_IsString(it) || it->valuestring == NULL) {
            st = dcs_seterr(e, DCS_ERR_FORMAT, "%s: weight_map['%.200s'] is not a string", ipath, it->string);
            goto done;
        }
        if (!plain_file_name(it->valuestring)) {
            st = dcs_seterr(e, DCS_ERR_FORMAT,
                            "%s: weight_map['%.200s'] = '%.200s' is not "
                            "a plain file name in the model directory",
                            ipath, it->string, it->valuestring);
            goto done;
        }
        m[i].name = it->string;
        m[i].shard = it->valuestring;
    }
    qsort(m, (size_t)n, sizeof *m, cmp_map_name);
    for (i = 1; i < n; i++)
        if (strcmp(m[i - 1].name, m[i].name) == 0) {
            st = dcs_seterr(e, DCS_ERR_FORMAT,
                            "%s: tensor '%.200s' appears twice "
                            "in weight_map",
                            ipath, m[i].name);
            goto done;
        }
done:
    if (st != DCS_OK) {
        free(m);
        cJSON_Delete(root);
        return st;
    }
    out->m = m;
    out->n = n;
    out->json = root;
    return DCS_OK;
}

/* Map every distinct shard of the map once. */

const dcs_index_entry *dcs_index_find(const dcs_index_entry *m, int n, const char *name) {
    dcs_index_entry key = {name, NULL};
    return n > 0 ? bsearch(&key, m, (size_t)n, sizeof *m, cmp_map_name) : NULL;
}
