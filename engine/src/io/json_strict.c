/*
 * json_strict.c -- the rules every JSON file the engine reads follows on
 * top of cJSON's syntax check (config.json, shard indexes, safetensors
 * headers):
 *   - no NUL, raw or escaped (\u0000): cJSON keeps strings NUL-terminated,
 *     so "a\u0000b" would silently become "a";
 *   - no key twice in one object: cJSON's lookups take the first, Python's
 *     json (and so Hugging Face) the last; the engine refuses instead of
 *     picking one.
 */
#include "dcs_io.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

dcs_status dcs_json_check_text(const char *text, size_t len, const char *path, dcs_err *e) {
    int in_str = 0;
    for (size_t i = 0; i < len; i++) {
        char c = text[i];
        if (c == '\0') return dcs_seterr(e, DCS_ERR_FORMAT, "%s: contains a NUL byte (at byte %zu)", path, i);
        if (!in_str) {
            if (c == '"') in_str = 1;
            continue;
        }
        if (c == '"') {
            in_str = 0;
        } else if (c == '\\' && i + 1 < len) {
            if (text[i + 1] == 'u' && i + 5 < len && memcmp(text + i + 2, "0000", 4) == 0)
                return dcs_seterr(e, DCS_ERR_FORMAT,
                                  "%s: a string holds an escaped NUL "
                                  "(\\u0000, at byte %zu), which would cut it short",
                                  path, i);
            i++; /* skip the escaped character */
        }
    }
    return DCS_OK;
}

static int cmp_key(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Recursion depth is bounded by cJSON's nesting limit (CJSON_NESTING_LIMIT). */
dcs_status dcs_json_unique_keys(const void *node_, const char *path, dcs_err *e) {
    const cJSON *node = node_;
    if (node == NULL || !(cJSON_IsObject(node) || cJSON_IsArray(node))) return DCS_OK;
    int n = 0;
    for (const cJSON *c = node->child; c != NULL; c = c->next) n++;
    if (cJSON_IsObject(node) && n > 1) {
        const char **keys = malloc((size_t)n * sizeof *keys);
        if (keys == NULL) return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", path);
        int i = 0;
        for (const cJSON *c = node->child; c != NULL; c = c->next) keys[i++] = c->string ? c->string : "";
        qsort(keys, (size_t)n, sizeof *keys, cmp_key);
        for (i = 1; i < n; i++)
            if (strcmp(keys[i - 1], keys[i]) == 0) {
                dcs_status st = dcs_seterr(e, DCS_ERR_FORMAT,
                                           "%s: key '%.200s' appears twice in "
                                           "one JSON object (refused: JSON readers disagree on "
                                           "which one counts)",
                                           path, keys[i]);
                free(keys);
                return st;
            }
        free(keys);
    }
    for (const cJSON *c = node->child; c != NULL; c = c->next) {
        dcs_status st = dcs_json_unique_keys(c, path, e);
        if (st != DCS_OK) return st;
    }
    return DCS_OK;
}
