/*
 * files.c -- whole-file access for the loaders.
 *
 * Weight files are read whole into private anonymous memory (an anonymous
 * mmap filled with bounded read() calls), not mapped from the file: a file
 * truncated or rewritten after load can neither crash a loaded model
 * (SIGBUS on a shared page that no longer exists) nor change its weights.
 * Tensors are plain views into that copy. Small text files (config.json,
 * index json) are read into a NUL-terminated heap buffer.
 *
 * Every file is opened with O_NONBLOCK and checked to be a regular file
 * before anything is read, so a FIFO, a device or a directory where a
 * file is expected is refused at once instead of blocking forever, and
 * every read is bounded by the size fstat reported.
 *
 * Every message starts with the path as the caller gave it.
 */
#include "dcs_io.h"

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
static int open_regular(const char *path, uint64_t *size, dcs_err *e) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        int err = errno;
        struct stat lst;
        if (err == ENOENT && lstat(path, &lst) == 0 && S_ISLNK(lst.st_mode))
            dcs_seterr(e, DCS_ERR_IO,
                       "%s: cannot open: a dangling symbolic link (its target "
                       "does not exist)",
                       path);
        else
            dcs_seterr(e, DCS_ERR_IO, "%s: cannot open: %s", path, strerror(err));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        dcs_seterr(e, DCS_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        dcs_seterr(e, DCS_ERR_IO, "%s: not a regular file (%s)", path,
                   S_ISDIR(st.st_mode)                          ? "a directory"
                   : S_ISFIFO(st.st_mode)                       ? "a FIFO"
                   : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                   : S_ISSOCK(st.st_mode)                       ? "a socket"
                                                                : "not a plain file");
        close(fd);
        return -1;
    }
    /* a regular file: blocking reads from here on */
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    *size = (uint64_t)st.st_size;
    return fd;
}

/* Read exactly `size` bytes from the start of fd into buf, in bounded
 * chunks (pread: the offset is ours). A file that shrank meanwhile is an
 * error; one that grew is read up to the size fstat gave. */
static dcs_status read_exact(int fd, const char *path, uint8_t *buf, uint64_t size, dcs_err *e) {
    uint64_t got = 0;
    while (got < size) {
        size_t want = size - got < ((size_t)1 << 30) ? (size_t)(size - got) : ((size_t)1 << 30);
        ssize_t r = pread(fd, buf + got, want, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return dcs_seterr(e, DCS_ERR_IO, "%s: read failed: %s", path, strerror(errno));
        if (r == 0)
            return dcs_seterr(e, DCS_ERR_IO,
                              "%s: file shrank while being read (%llu of %llu "
                              "bytes)",
                              path, (unsigned long long)got, (unsigned long long)size);
        got += (uint64_t)r;
    }
    return DCS_OK;
}

dcs_status dcs_map_file(const char *path, dcs_mapped_file *f, dcs_err *e) {
    memset(f, 0, sizeof *f);
    uint64_t size;
    int fd = open_regular(path, &size, e);
    if (fd < 0) return DCS_ERR_IO;
    if (size > (uint64_t)SIZE_MAX) {
        close(fd);
        return dcs_seterr(e, DCS_ERR_IO, "%s: %llu bytes do not fit in the address space", path,
                          (unsigned long long)size);
    }
    void *data = NULL;
    if (size > 0) { /* mmap of length 0 is an error */
        data = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (data == MAP_FAILED) {
            int err = errno;
            close(fd);
            return dcs_seterr(e, DCS_ERR_NOMEM, "%s: cannot allocate %llu bytes to read it: %s", path,
                              (unsigned long long)size, strerror(err));
        }
        dcs_status st = read_exact(fd, path, data, size, e);
        if (st == DCS_OK) mprotect(data, (size_t)size, PROT_READ); /* tensors are views: read-only */
        if (st != DCS_OK) {
            munmap(data, (size_t)size);
            close(fd);
            return st;
        }
    }
    close(fd);
    f->path = strdup(path);
    if (f->path == NULL) {
        if (data != NULL) munmap(data, (size_t)size);
        return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", path);
    }
    f->data = data;
    f->size = size;
    return DCS_OK;
}

void dcs_release_file_data(dcs_mapped_file *f) {
    if (f == NULL || f->data == NULL) return;
    munmap((void *)f->data, (size_t)f->size);
    f->data = NULL;
    f->size = 0;
}

void dcs_unmap_file(dcs_mapped_file *f) {
    if (f == NULL) return;
    if (f->data != NULL) munmap((void *)f->data, (size_t)f->size);
    free(f->path);
    memset(f, 0, sizeof *f);
}

dcs_status dcs_read_text_file(const char *path, size_t max_bytes, char **out, size_t *len, dcs_err *e) {
    *out = NULL;
    if (len != NULL) *len = 0;
    uint64_t size;
    int fd = open_regular(path, &size, e);
    if (fd < 0) return DCS_ERR_IO;
    if (size > max_bytes) {
        close(fd);
        return dcs_seterr(e, DCS_ERR_NOMEM,
                          "%s: %llu bytes is more than the %zu allowed "
                          "for this file",
                          path, (unsigned long long)size, max_bytes);
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
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            int err = errno;
            free(buf);
            close(fd);
            return dcs_seterr(e, DCS_ERR_IO, "%s: read failed: %s", path, strerror(err));
        }
        if (r == 0) break;
        got += (size_t)r;
    }
    close(fd);
    if (got > size) {
        free(buf);
        return dcs_seterr(e, DCS_ERR_IO, "%s: file changed while being read", path);
    }
    buf[got] = '\0';
    *out = buf;
    if (len != NULL) *len = got;
    return DCS_OK;
}
