/*
 * zip.h -- the ZIP reader under the torch checkpoint loader (zip.c): the
 * central directory of an archive held in memory (ZIP64 included), and the
 * bytes of one STORED entry. Every offset is checked against the buffer.
 */
#ifndef DCS_ZIP_H
#define DCS_ZIP_H

#include "dcs_io.h"

typedef struct {
    const char *name; /* into the buffer, not NUL-terminated        */
    size_t name_len;
    uint64_t comp_size, size, local_off;
    uint16_t method, flags;
} zip_entry;

typedef struct {
    const uint8_t *buf;
    uint64_t len;
    const char *path;
    dcs_err *e;
    zip_entry *ent; /* sorted by name                              */
    size_t n;
} zip_archive;

/* Read the end records and the central directory of buf[0, len); `path`
 * names the file in messages (kept, as is e). Release with dcs_zip_close. */
dcs_status dcs_zip_open(zip_archive *z, const uint8_t *buf, uint64_t len, const char *path, dcs_err *e);
void dcs_zip_close(zip_archive *z);
/* The entry named name[0, len), or NULL. */
const zip_entry *dcs_zip_find(const zip_archive *z, const char *name, size_t len);
/* The bytes of a stored (uncompressed, unencrypted) entry, through its local
 * header; refuses anything else by name. */
dcs_status dcs_zip_entry_data(const zip_archive *z, const zip_entry *en, const uint8_t **data,
                              uint64_t *size);
/* How much of a (not NUL-terminated) entry name to print: "%.*s". */
static inline int dcs_zip_shown(size_t name_len) { return name_len > 200 ? 200 : (int)name_len; }

#endif /* DCS_ZIP_H */
