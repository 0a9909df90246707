/*
 * error.c -- the error record every engine call fills in (dcs_err, see
 * dcs_io.h) and the names of the public status codes.
 *
 * A message names the file (or argument) and what is wrong; it is cut to
 * fit dcs_err.msg (1024 bytes) rather than failing.
 */
#include "dcs_io.h"

#include <stdio.h>

dcs_status dcs_seterr(dcs_err *e, dcs_status code, const char *fmt, ...) {
    if (e == NULL) return code;
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    if (n < 0) /* encoding error: keep something useful */
        snprintf(e->msg, sizeof e->msg, "%s (message could not be formatted)", dcs_status_name(code));
    return code;
}

const char *dcs_status_name(dcs_status s) {
    switch (s) {
    case DCS_OK: return "DCS_OK";
    case DCS_ERR_IO: return "DCS_ERR_IO";
    case DCS_ERR_FORMAT: return "DCS_ERR_FORMAT";
    case DCS_ERR_CONFIG: return "DCS_ERR_CONFIG";
    case DCS_ERR_TENSOR: return "DCS_ERR_TENSOR";
    case DCS_ERR_NOMEM: return "DCS_ERR_NOMEM";
    case DCS_ERR_ARG: return "DCS_ERR_ARG";
    case DCS_ERR_HOOK: return "DCS_ERR_HOOK";
    case DCS_ERR_UNSUPPORTED: return "DCS_ERR_UNSUPPORTED";
    case DCS_ERR_BACKEND: return "DCS_ERR_BACKEND";
    case DCS_ERR_NONFINITE: return "DCS_ERR_NONFINITE";
    case DCS_ERR_CANCELLED: return "DCS_ERR_CANCELLED";
    }
    return "DCS_ERR_UNKNOWN";
}
