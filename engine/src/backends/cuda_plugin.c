/*
 * cuda_plugin.c -- the CUDA backend as a plugin: dcs_backend_cuda_create and
 * dcs_cuda_probe load libdclens_cuda.so (cuda.cu, built when nvcc is found)
 * with dlopen and call its table (dcs_backend.h, "CUDA plugin").
 *
 * Why a plugin: a library that links the CUDA runtime cannot be loaded
 * where the CUDA libraries are absent. With the plugin, the engine and the
 * Python module need nothing of CUDA; the runtime is loaded only when a
 * CUDA model (or the probe) is asked for, and a machine without it gets
 * "device 'cuda' is not available: <why>" instead of an import error.
 *
 * Where: $DCLENS_CUDA_PLUGIN if set (a path), else DCS_CUDA_PLUGIN_FILE in
 * the directory of the binary holding this code (the Python module's
 * package directory, or the build directory of the C tests).
 *
 * No state: each call dlopens (the loader counts references and hands back
 * the same handle); the plugin is never unloaded (the CUDA runtime is not
 * meant to be).
 */
#define _GNU_SOURCE 1 /* dladdr */
#include "dcs_backend.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef DCS_WITH_CUDA
#define BUILT_WITHOUT ""
#else
#define BUILT_WITHOUT "dclens was built without CUDA (nvcc not found at build time): "
#endif

/* The plugin's path into buf; 0 if it cannot be named. */
static int plugin_path(char *buf, size_t len) {
    const char *env = getenv("DCLENS_CUDA_PLUGIN");
    if (env && env[0]) return snprintf(buf, len, "%s", env) < (int)len;
    char self[PATH_MAX] = "";
    Dl_info info;
    if (dladdr((void *)plugin_path, &info) && info.dli_fname && strchr(info.dli_fname, '/'))
        snprintf(self, sizeof self, "%s", info.dli_fname);
    else { /* the main program, named without a directory */
        ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        self[n > 0 ? n : 0] = '\0';
    }
    char *slash = strrchr(self, '/');
    if (!slash) return snprintf(buf, len, "%s", DCS_CUDA_PLUGIN_FILE) < (int)len;
    *slash = '\0';
    return snprintf(buf, len, "%s/%s", self, DCS_CUDA_PLUGIN_FILE) < (int)len;
}

/* The plugin's table, or NULL with why (at most whylen bytes). */
static const dcs_cuda_plugin *load_plugin(char *why, size_t whylen) {
    char path[PATH_MAX + 64];
    if (!plugin_path(path, sizeof path)) {
        snprintf(why, whylen, "%sthe CUDA plugin's path is too long", BUILT_WITHOUT);
        return NULL;
    }
    if (access(path, F_OK) != 0) {
        snprintf(why, whylen, "%sno CUDA plugin %s", BUILT_WITHOUT, path);
        return NULL;
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *d = dlerror();
        snprintf(why, whylen, "the CUDA plugin %s cannot be loaded: %s", path, d ? d : "dlopen failed");
        return NULL;
    }
    dcs_cuda_plugin_fn fn = (dcs_cuda_plugin_fn)dlsym(h, DCS_CUDA_PLUGIN_SYMBOL);
    const dcs_cuda_plugin *p = fn ? fn() : NULL;
    if (!p) {
        snprintf(why, whylen, "%s is not a dclens CUDA plugin (no %s)", path, DCS_CUDA_PLUGIN_SYMBOL);
        return NULL;
    }
    if (p->abi != DCS_CUDA_PLUGIN_ABI || p->ops_size != sizeof(dcs_backend_ops) ||
        p->args_size != sizeof(dcs_compose_args) + sizeof(dcs_attn_args) + sizeof(dcs_compose_bw_args) +
                            sizeof(dcs_bw_shape) ||
        !p->create || !p->probe) {
        snprintf(why, whylen,
                 "the CUDA plugin %s is from another build of dclens (interface %d, this "
                 "engine's %d); rebuild the package",
                 path, p->abi, DCS_CUDA_PLUGIN_ABI);
        return NULL;
    }
    return p;
}

int dcs_cuda_probe(char *why, size_t whylen) {
    char buf[1024];
    const dcs_cuda_plugin *p = load_plugin(buf, sizeof buf);
    if (!p) {
        if (why && whylen) snprintf(why, whylen, "%s", buf);
        return 0;
    }
    return p->probe(why, whylen);
}

dcs_backend *dcs_backend_cuda_create(int device, dcs_err *e) {
    char buf[900];
    const dcs_cuda_plugin *p = load_plugin(buf, sizeof buf);
    if (!p) {
        dcs_seterr(e, DCS_ERR_UNSUPPORTED, "CUDA: %s", buf);
        return NULL;
    }
    return p->create(device, e);
}
