/*
 * files.c -- whole-file access for the loaders.
 *
 * Weight files are memory-mapped read-only (PROT_READ, MAP_PRIVATE), so a
 * 5 GB shard costs address space, not RAM, and tensors are plain views into
 * the mapping. Small text files (config.json, index json) are read into a
 * NUL-terminated heap buffer instead.
 *
 * Every message starts with the path as the caller gave it.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Open `path` for reading and check it is a regular file; on success *size
 * holds its length. Returns the fd or -1 with e set. */
static int open_regular(const char *path, uint64_t *size, dcs_err *e)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        dcs_seterr(e, DCS_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        dcs_seterr(e, DCS_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        dcs_seterr(e, DCS_ERR_IO, "%s: not a regular file", path);
        close(fd);
        return -1;
    }
    *size = (uint64_t)st.st_size;
    return fd;
}

dcs_status dcs_map_file(const char *path, dcs_mapped_file *f, dcs_err *e)
{
    memset(f, 0, sizeof *f);
    uint64_t size;
    int fd = open_regular(path, &size, e);
    if (fd < 0)
        return DCS_ERR_IO;
    if (size > (uint64_t)SIZE_MAX) {
        close(fd);
        return dcs_seterr(e, DCS_ERR_IO, "%s: %llu bytes do not fit in the address space",
                          path, (unsigned long long)size);
    }
    void *data = NULL;
    if (size > 0) {                       /* mmap of length 0 is an error */
        data = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (data == MAP_FAILED) {
            int err = errno;
            close(fd);
            return dcs_seterr(e, DCS_ERR_IO, "%s: cannot map %llu bytes: %s", path,
                              (unsigned long long)size, strerror(err));
        }
    }
    close(fd);                            /* the mapping stays valid */
    f->path = strdup(path);
    if (f->path == NULL) {
        if (data != NULL)
            munmap(data, (size_t)size);
        return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", path);
    }
    f->data = data;
    f->size = size;
    return DCS_OK;
}

void dcs_unmap_file(dcs_mapped_file *f)
{
    if (f == NULL)
        return;
    if (f->data != NULL)
        munmap((void *)f->data, (size_t)f->size);
    free(f->path);
    memset(f, 0, sizeof *f);
}

dcs_status dcs_read_text_file(const char *path, size_t max_bytes, char **out,
                              size_t *len, dcs_err *e)
{
    *out = NULL;
    if (len != NULL)
        *len = 0;
    uint64_t size;
    int fd = open_regular(path, &size, e);
    if (fd < 0)
        return DCS_ERR_IO;
    if (size > max_bytes) {
        close(fd);
        return dcs_seterr(e, DCS_ERR_NOMEM, "%s: %llu bytes is more than the %zu allowed "
                          "for this file", path, (unsigned long long)size, max_bytes);
    }
    /* Read at most max_bytes + 1 so a file that grew meanwhile is noticed. */
    size_t cap = (size_t)size + 1;
    char *buf = malloc(cap + 1);
    if (buf == NULL) {
        close(fd);
        return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", path);
    }
    size_t got = 0;
    while (got < cap) {
        ssize_t r = read(fd, buf + got, cap - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            int err = errno;
            free(buf);
            close(fd);
            return dcs_seterr(e, DCS_ERR_IO, "%s: read failed: %s", path, strerror(err));
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    if (got > size) {
        free(buf);
        return dcs_seterr(e, DCS_ERR_IO, "%s: file changed while being read", path);
    }
    buf[got] = '\0';
    *out = buf;
    if (len != NULL)
        *len = got;
    return DCS_OK;
}
