/*
 * zip.c -- the ZIP archives of PyTorch checkpoints (torch.save of a
 * state_dict: pytorch_model.bin and its shards), read from memory.
 *
 * The file is a ZIP archive whose entries are STORED (uncompressed):
 *   <prefix>/data.pkl       the pickled state_dict (protocol 2)
 *   <prefix>/data/<key>     raw little-endian storages, one per key
 *   <prefix>/byteorder, version, .data/serialization_id, ...  (ignored)
 * Large archives use ZIP64 records; torch pads each local header's extra
 * field so data starts 64-byte aligned. We read the End Of Central Directory
 * (and the ZIP64 locator/record), the central directory (with ZIP64 extra
 * fields), then each needed entry's local header, which alone says where
 * its data starts. Every offset is bounds-checked against the buffer.
 *
 */
#include "zip.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- bytes */

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const uint8_t *p) { return rd32(p) | (uint64_t)rd32(p + 4) << 32; }

/* Does [off, off + n) fit in a buffer of len bytes? */
static bool in_bounds(uint64_t off, uint64_t n, uint64_t len) { return off <= len && n <= len - off; }

/* ---------------------------------------------------------------- records */

#define ZIP_EOCD_SIG 0x06054b50u   /* end of central directory, 22 bytes */
#define ZIP64_LOC_SIG 0x07064b50u  /* ZIP64 EOCD locator, 20 bytes       */
#define ZIP64_EOCD_SIG 0x06064b50u /* ZIP64 EOCD record, 56 bytes        */
#define ZIP_CDIR_SIG 0x02014b50u   /* central directory entry, 46 bytes  */
#define ZIP_LOCAL_SIG 0x04034b50u  /* local file header, 30 bytes        */
#define ZIP64_EXTRA_ID 0x0001u

/* Where the central directory is, from the (ZIP64) end records. */
typedef struct {
    uint64_t n_entries, cd_size, cd_off;
} zip_end;

static dcs_status find_eocd(const zip_archive *z, uint64_t *pos) {
    if (z->len >= 22) {
        uint64_t lowest = z->len - 22 > 0xffff ? z->len - 22 - 0xffff : 0;
        for (uint64_t p = z->len - 22 + 1; p-- > lowest;)
            if (rd32(z->buf + p) == ZIP_EOCD_SIG && p + 22 + rd16(z->buf + p + 20) <= z->len) {
                *pos = p;
                return DCS_OK;
            }
    }
    return dcs_seterr(z->e, DCS_ERR_FORMAT,
                      "%s: not a zip archive, or truncated (no end of "
                      "central directory record)",
                      z->path);
}

static dcs_status read_zip64_end(const zip_archive *z, uint64_t eocd, zip_end *end) {
    const uint8_t *loc = z->buf + eocd - 20;
    uint64_t rec = rd64(loc + 8);
    if (rd32(loc + 4) != 0 || rd32(loc + 16) > 1 || !in_bounds(rec, 56, eocd - 20) ||
        rd32(z->buf + rec) != ZIP64_EOCD_SIG)
        return dcs_seterr(z->e, DCS_ERR_FORMAT,
                          "%s: bad ZIP64 end of central directory "
                          "locator",
                          z->path);
    const uint8_t *r = z->buf + rec;
    if (rd32(r + 16) != 0 || rd32(r + 20) != 0 || rd64(r + 24) != rd64(r + 32))
        return dcs_seterr(z->e, DCS_ERR_FORMAT,
                          "%s: multi-disk zip archives are not "
                          "supported",
                          z->path);
    end->n_entries = rd64(r + 32);
    end->cd_size = rd64(r + 40);
    end->cd_off = rd64(r + 48);
    return DCS_OK;
}

static dcs_status read_end(const zip_archive *z, zip_end *end) {
    uint64_t eocd = 0;
    dcs_status st = find_eocd(z, &eocd);
    if (st != DCS_OK) return st;
    const uint8_t *p = z->buf + eocd;
    if (eocd >= 20 && rd32(p - 20) == ZIP64_LOC_SIG) {
        st = read_zip64_end(z, eocd, end);
    } else {
        if (rd16(p + 4) != 0 || rd16(p + 6) != 0 || rd16(p + 8) != rd16(p + 10))
            return dcs_seterr(z->e, DCS_ERR_FORMAT,
                              "%s: multi-disk zip archives are not "
                              "supported",
                              z->path);
        end->n_entries = rd16(p + 10);
        end->cd_size = rd32(p + 12);
        end->cd_off = rd32(p + 16);
        if (end->n_entries == 0xffff || end->cd_size == 0xffffffffu || end->cd_off == 0xffffffffu)
            return dcs_seterr(z->e, DCS_ERR_FORMAT,
                              "%s: zip end record needs a ZIP64 record "
                              "that is missing",
                              z->path);
    }
    if (st != DCS_OK) return st;
    if (!in_bounds(end->cd_off, end->cd_size, eocd))
        return dcs_seterr(z->e, DCS_ERR_FORMAT,
                          "%s: zip central directory [%llu, +%llu) lies "
                          "outside the archive",
                          z->path, (unsigned long long)end->cd_off, (unsigned long long)end->cd_size);
    if (end->n_entries > end->cd_size / 46)
        return dcs_seterr(z->e, DCS_ERR_FORMAT,
                          "%s: zip central directory of %llu bytes "
                          "cannot hold %llu entries",
                          z->path, (unsigned long long)end->cd_size, (unsigned long long)end->n_entries);
    return DCS_OK;
}

/* ZIP64 extended information: the 8-byte values of the fields whose 32-bit
 * header value is 0xffffffff, in the order size, comp_size, local_off. */
static dcs_status read_zip64_extra(const zip_archive *z, const uint8_t *x, size_t xlen, zip_entry *en) {
    uint64_t *fields[3] = {&en->size, &en->comp_size, &en->local_off};
    bool need[3] = {en->size == 0xffffffffu, en->comp_size == 0xffffffffu, en->local_off == 0xffffffffu};
    if (!need[0] && !need[1] && !need[2]) return DCS_OK;
    size_t pos = 0;
    while (pos + 4 <= xlen) {
        uint16_t id = rd16(x + pos), sz = rd16(x + pos + 2);
        if (sz > xlen - pos - 4) break;
        if (id == ZIP64_EXTRA_ID) {
            size_t q = pos + 4, qend = pos + 4 + sz;
            for (int i = 0; i < 3; i++) {
                if (!need[i]) continue;
                if (q + 8 > qend) break;
                *fields[i] = rd64(x + q);
                need[i] = false;
                q += 8;
            }
            break;
        }
        pos += 4 + (size_t)sz;
    }
    if (need[0] || need[1] || need[2])
        return dcs_seterr(z->e, DCS_ERR_FORMAT,
                          "%s: zip entry '%.*s' lacks the ZIP64 sizes or "
                          "offset its header announces",
                          z->path, dcs_zip_shown(en->name_len), en->name);
    return DCS_OK;
}

static int cmp_entry(const void *a, const void *b) {
    const zip_entry *x = a, *y = b;
    size_t n = x->name_len < y->name_len ? x->name_len : y->name_len;
    int c = memcmp(x->name, y->name, n);
    if (c != 0) return c;
    return x->name_len < y->name_len ? -1 : x->name_len > y->name_len;
}

/* Read the central directory into z->ent (sorted; names unique). */
static dcs_status read_central_dir(zip_archive *z, const zip_end *end) {
    z->ent = calloc(end->n_entries ? (size_t)end->n_entries : 1, sizeof *z->ent);
    if (z->ent == NULL) return dcs_seterr(z->e, DCS_ERR_NOMEM, "%s: out of memory", z->path);
    const uint8_t *cd = z->buf + end->cd_off;
    uint64_t pos = 0;
    for (uint64_t i = 0; i < end->n_entries; i++) {
        if (!in_bounds(pos, 46, end->cd_size) || rd32(cd + pos) != ZIP_CDIR_SIG)
            return dcs_seterr(z->e, DCS_ERR_FORMAT,
                              "%s: zip central directory entry %llu is "
                              "damaged",
                              z->path, (unsigned long long)i);
        const uint8_t *h = cd + pos;
        size_t nlen = rd16(h + 28), xlen = rd16(h + 30), clen = rd16(h + 32);
        if (!in_bounds(pos + 46, nlen + xlen + clen, end->cd_size))
            return dcs_seterr(z->e, DCS_ERR_FORMAT,
                              "%s: zip central directory entry %llu runs "
                              "past the directory",
                              z->path, (unsigned long long)i);
        zip_entry *en = &z->ent[z->n++];
        en->flags = rd16(h + 8);
        en->method = rd16(h + 10);
        en->comp_size = rd32(h + 20);
        en->size = rd32(h + 24);
        en->local_off = rd32(h + 42);
        en->name = (const char *)h + 46;
        en->name_len = nlen;
        dcs_status st = read_zip64_extra(z, h + 46 + nlen, xlen, en);
        if (st != DCS_OK) return st;
        pos += 46 + nlen + xlen + clen;
    }
    qsort(z->ent, z->n, sizeof *z->ent, cmp_entry);
    for (size_t i = 1; i < z->n; i++)
        if (cmp_entry(&z->ent[i - 1], &z->ent[i]) == 0)
            return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: zip entry '%.*s' appears twice", z->path,
                              dcs_zip_shown(z->ent[i].name_len), z->ent[i].name);
    return DCS_OK;
}

dcs_status dcs_zip_open(zip_archive *z, const uint8_t *buf, uint64_t len, const char *path, dcs_err *e) {
    memset(z, 0, sizeof *z);
    z->buf = buf;
    z->len = len;
    z->path = path;
    z->e = e;
    zip_end end = {0, 0, 0};
    dcs_status st = read_end(z, &end);
    if (st == DCS_OK) st = read_central_dir(z, &end);
    return st;
}

const zip_entry *dcs_zip_find(const zip_archive *z, const char *name, size_t len) {
    zip_entry key = {.name = name, .name_len = len};
    return z->n ? bsearch(&key, z->ent, z->n, sizeof *z->ent, cmp_entry) : NULL;
}

/* The bytes of a stored entry, located through its local header. */
dcs_status dcs_zip_entry_data(const zip_archive *z, const zip_entry *en, const uint8_t **data,
                              uint64_t *size) {
    int nl = dcs_zip_shown(en->name_len);
    if (en->flags & 1u)
        return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: zip entry '%.*s' is encrypted", z->path, nl, en->name);
    if (en->method != 0 || en->comp_size != en->size)
        return dcs_seterr(z->e, DCS_ERR_FORMAT,
                          "%s: zip entry '%.*s' is compressed (method "
                          "%u); torch checkpoints store entries uncompressed",
                          z->path, nl, en->name, en->method);
    if (!in_bounds(en->local_off, 30, z->len) || rd32(z->buf + en->local_off) != ZIP_LOCAL_SIG)
        return dcs_seterr(z->e, DCS_ERR_FORMAT,
                          "%s: zip entry '%.*s': no local header at "
                          "offset %llu",
                          z->path, nl, en->name, (unsigned long long)en->local_off);
    const uint8_t *h = z->buf + en->local_off;
    uint64_t nlen = rd16(h + 26), xlen = rd16(h + 28);
    if (rd16(h + 8) != 0 || nlen != en->name_len || !in_bounds(en->local_off + 30, nlen, z->len) ||
        memcmp(h + 30, en->name, nlen) != 0)
        return dcs_seterr(z->e, DCS_ERR_FORMAT,
                          "%s: zip entry '%.*s': local header disagrees "
                          "with the central directory",
                          z->path, nl, en->name);
    uint64_t start = en->local_off + 30 + nlen + xlen;
    if (!in_bounds(start, en->size, z->len))
        return dcs_seterr(z->e, DCS_ERR_IO,
                          "%s: zip entry '%.*s' (%llu bytes at %llu) runs "
                          "past the end of the file (%llu bytes; truncated?)",
                          z->path, nl, en->name, (unsigned long long)en->size, (unsigned long long)start,
                          (unsigned long long)z->len);
    *data = z->buf + start;
    *size = en->size;
    return DCS_OK;
}

void dcs_zip_close(zip_archive *z) {
    free(z->ent);
    z->ent = NULL;
    z->n = 0;
}
