/*
 * png.c -- attention heatmaps as PNG (dcs_heatmap_png, dcs_buffer_free).
 *
 * A picture is one or more [rows, cols] maps ("panels") drawn in a grid
 * with token labels, titles, the causal mask and a colour bar; the geometry
 * is computed by dcs_png_layout_compute (png_layout.h describes it) and the
 * text is drawn with the built-in bitmap font (font.h). The RGB picture is
 * encoded with libpng into a growing memory buffer.
 */
#include "dclens.h"
#include "font.h"
#include "png_layout.h"

#include <png.h>

#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- layout
 * constants (pixels) */

#define MARGIN 12  /* outer margin                                      */
#define TICK 3     /* tick marks outside the panel frame                */
#define HGAP 18    /* between panels of a grid row                      */
#define VGAP 16    /* between grid rows                                 */
#define BAR_GAP 24 /* between the grid and the colour bar               */
#define BAR_W 16
#define BAR_MIN_H 100
#define BAR_MAX_H 480 /* unless a panel is taller                          */
#define MAX_TITLE_GLYPHS 32
#define AXIS_GAP 6 /* around the "query" / "key" axis titles            */
#define MAX_FIG_TITLE_GLYPHS 160
#define FIG_TITLE_SCALE 2
#define AUTO_TARGET_1 1000 /* auto cell: target panel side for one panel      */
#define AUTO_TARGET_FEW 400
#define AUTO_TARGET_MANY 256

static const uint8_t WHITE[3] = {255, 255, 255};
static const uint8_t INK[3] = {24, 24, 24};
static const uint8_t FRAME[3] = {96, 96, 96};
static const uint8_t MASK[3] = {DCS_PNG_MASK_R, DCS_PNG_MASK_G, DCS_PNG_MASK_B};
static const uint8_t HATCH[3] = {DCS_PNG_HATCH_R, DCS_PNG_HATCH_G, DCS_PNG_HATCH_B};

#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
static dcs_status
fail(char *err, size_t errlen, dcs_status code, const char *fmt, ...) {
    if (err && errlen > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* ---------------------------------------------------------------- text */

int dcs_png_label_glyphs(const char *s, int visible_spaces, int max_glyphs, uint8_t *out) {
    if (!s || !out || max_glyphs <= 0) return 0;
    /* Decode up to max_glyphs + 1 glyphs (one more tells us to truncate). */
    enum { CAP = 256 };
    uint8_t g[CAP + 1];
    uint8_t is_space[CAP + 1];
    int lim = max_glyphs < CAP ? max_glyphs + 1 : CAP + 1;
    int n = 0;
    const unsigned char *p = (const unsigned char *)s;
    while (*p && n < lim) {
        unsigned char c = *p++;
        int glyph, sp = 0;
        if (c == ' ') {
            glyph = 0;
            sp = 1;
        } else if (c >= 33 && c <= 126) {
            glyph = c - 32;
        } else if (c == '\n' || c == '\r') {
            if (c == '\r' && *p == '\n') p++; /* "\r\n" is one line break */
            glyph = DCS_GLYPH_RETURN;
        } else if (c == '\t') {
            glyph = DCS_GLYPH_TAB;
        } else if (c >= 0xC2 && c <= 0xF4) {
            /* One UTF-8 character: one box, however many bytes. */
            int more = c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : 1;
            while (more > 0 && (*p & 0xC0) == 0x80) {
                p++;
                more--;
            }
            glyph = DCS_GLYPH_BOX;
        } else {
            glyph = DCS_GLYPH_BOX; /* control byte, stray continuation, 0xFF.. */
        }
        g[n] = (uint8_t)glyph;
        is_space[n] = (uint8_t)sp;
        n++;
    }
    int truncated = (*p != 0) || n > max_glyphs;
    if (visible_spaces) {
        for (int i = 0; i < n && is_space[i]; i++) g[i] = DCS_GLYPH_MIDDOT;
        if (!truncated)
            for (int i = n - 1; i >= 0 && is_space[i]; i--) g[i] = DCS_GLYPH_MIDDOT;
    }
    if (!truncated) {
        memcpy(out, g, (size_t)n);
        return n;
    }
    if (max_glyphs < 3) {
        memcpy(out, g, (size_t)max_glyphs);
        return max_glyphs;
    }
    memcpy(out, g, (size_t)(max_glyphs - 2));
    out[max_glyphs - 2] = (uint8_t)('.' - 32);
    out[max_glyphs - 1] = (uint8_t)('.' - 32);
    return max_glyphs;
}

/* The text of row/column label i: the caller's string, or the index. */
static const char *label_text(const char *const *labels, int i, char buf[16]) {
    if (labels) return labels[i] ? labels[i] : "";
    snprintf(buf, 16, "%d", i);
    return buf;
}

static int label_count(const char *const *labels, int i, int visible) {
    char buf[16];
    uint8_t g[DCS_PNG_MAX_LABEL_GLYPHS];
    return dcs_png_label_glyphs(label_text(labels, i, buf), visible, DCS_PNG_MAX_LABEL_GLYPHS, g);
}

/* Width in pixels of n glyphs at scale s (no trailing blank column). */
static int64_t text_px(int n, int s) { return n > 0 ? (int64_t)n * DCS_FONT_ADV * s - s : 0; }

/* ---------------------------------------------------------------- range */

/* The local window of panel p: its own mask_window (> 0; < 0 for none),
 * else the spec's. */
static int panel_window(const dcs_heatmap_spec *sp, int p) {
    int w = sp->panels[p].mask_window;
    return w > 0 ? w : w < 0 ? 0 : sp->mask_window;
}

/* First unmasked column of row t of panel p (local-window mask), 0 without one. */
static int first_visible(const dcs_heatmap_spec *sp, int p, int t) {
    int w = panel_window(sp, p);
    if (!sp->mask_upper || w <= 0 || t - w <= 0) return 0;
    return t - w;
}

static void data_range(const dcs_heatmap_spec *sp, int rows, int cols, int signed_abs, double *lo, double *hi,
                       int *found) {
    double mn = INFINITY, mx = -INFINITY;
    int any = 0;
    for (int p = 0; p < sp->n_panels; p++) {
        const float *d = sp->panels[p].data;
        for (int t = 0; t < rows; t++) {
            int ns = cols;
            if (sp->mask_upper && t + 1 < ns) ns = t + 1;
            const float *row = d + (size_t)t * (size_t)cols;
            for (int s = first_visible(sp, p, t); s < ns; s++) {
                float v = row[s];
                if (!isfinite(v)) continue;
                double x = signed_abs ? fabs((double)v) : (double)v;
                if (x < mn) mn = x;
                if (x > mx) mx = x;
                any = 1;
            }
        }
    }
    *lo = mn;
    *hi = mx;
    *found = any;
}

/* Tick values of the colour bar, most important first. */
static int tick_candidates(const dcs_png_layout *L, int colormap, double v[5]) {
    double lo = L->vmin, hi = L->vmax, span = hi - lo;
    int n = 0;
    v[n++] = hi;
    v[n++] = lo;
    if (colormap == DCS_CMAP_DIVERGING && lo < 0 && hi > 0)
        v[n++] = 0.0;
    else
        v[n++] = lo + 0.5 * span;
    v[n++] = lo + 0.25 * span;
    v[n++] = lo + 0.75 * span;
    return n;
}

static void format_tick(double v, char buf[32]) {
    float f = (float)v;
    if (f == 0.0f) f = 0.0f; /* no "-0" */
    snprintf(buf, 32, "%.3g", (double)f);
}

/* ---------------------------------------------------------------- layout */

typedef struct {
    int row_g, col_g; /* widest row / column label, glyphs             */
    int ptitle_g;     /* widest panel title, glyphs (capped)           */
    int has_ptitle;
    int has_title;
    int tick_g;      /* widest tick label, glyphs                     */
    int title_g;     /* figure title, glyphs (capped)                 */
    int axis_titles; /* "query" / "key" axis titles                   */
} measures;

/* Geometry for cell size c, in 64-bit; sets *w, *h. */
static void geometry(const measures *m, int c, dcs_png_layout *L, int64_t *w, int64_t *h) {
    int s = c >= 22 ? 2 : 1;
    int ts = FIG_TITLE_SCALE;
    int64_t line = (int64_t)DCS_FONT_LINE * s;
    L->cell = c;
    L->scale = s;
    L->title_scale = ts;
    L->label_step = (int)((line + c - 1) / c);
    int64_t pw = (int64_t)L->cols * c, ph = (int64_t)L->rows * c;
    int64_t row_area = text_px(m->row_g, s) + TICK + 6;
    int64_t col_area = TICK + 5 + text_px(m->col_g, s);
    if (m->axis_titles) { /* a band for "query" (rotated) and one for "key" */
        row_area += (int64_t)DCS_FONT_H * s + AXIS_GAP;
        col_area += (int64_t)DCS_FONT_H * s + AXIS_GAP;
    }
    int64_t title_h = m->has_title ? (int64_t)DCS_FONT_H * ts + 14 : 0;
    int64_t ptitle_h = m->has_ptitle ? (int64_t)DCS_FONT_H * s + 6 : 0;
    int64_t x0 = MARGIN + row_area;
    int64_t y0 = MARGIN + title_h + ptitle_h;
    if (y0 < MARGIN + 4 * s + 2) y0 = MARGIN + 4 * s + 2; /* top tick label */
    int64_t tpx = text_px(m->ptitle_g, s);
    int64_t pitch_x = pw + HGAP;
    if (pitch_x < tpx + 12) pitch_x = tpx + 12;
    int64_t pitch_y = ptitle_h + ph + col_area + VGAP;
    int64_t grid_w = (int64_t)(L->grid_cols - 1) * pitch_x + pw;
    int64_t grid_bottom = y0 + (int64_t)(L->grid_rows - 1) * pitch_y + ph + col_area;
    int64_t span = (int64_t)(L->grid_rows - 1) * pitch_y + ph;
    int64_t bar_h = span;
    int64_t bar_cap = ph > BAR_MAX_H ? ph : BAR_MAX_H;
    if (bar_h > bar_cap) bar_h = bar_cap;
    if (bar_h < BAR_MIN_H) bar_h = BAR_MIN_H;
    int64_t over = tpx > pw ? (tpx - pw) / 2 + 8 : 0; /* last title overhang */
    int64_t bar_x = x0 + grid_w + (over > BAR_GAP ? over : BAR_GAP);
    int64_t tick_x = bar_x + BAR_W + TICK + 5;
    int64_t width = tick_x + text_px(m->tick_g, s) + MARGIN;
    if (width < text_px(m->title_g, ts) + 2 * MARGIN)
        width = text_px(m->title_g, ts) + 2 * MARGIN; /* the title fits */
    int64_t height = grid_bottom;
    if (height < y0 + bar_h + 5 * s) height = y0 + bar_h + 5 * s;
    height += MARGIN;
    *w = width;
    *h = height;
    if (width > INT_MAX / 2 || height > INT_MAX / 2 || pitch_x > INT_MAX / 2 || pitch_y > INT_MAX / 2)
        return; /* rejected by the caller; keep ints sane */
    L->panel_w = (int)pw;
    L->panel_h = (int)ph;
    L->x0 = (int)x0;
    L->y0 = (int)y0;
    L->pitch_x = (int)pitch_x;
    L->pitch_y = (int)pitch_y;
    L->row_label_glyphs = m->row_g;
    L->col_label_glyphs = m->col_g;
    L->title_y = m->has_title ? MARGIN : -1;
    L->ptitle_h = (int)ptitle_h;
    L->bar_x = (int)bar_x;
    L->bar_y = (int)y0;
    L->bar_w = BAR_W;
    L->bar_h = (int)bar_h;
    L->tick_label_x = (int)tick_x;
    L->width = (int)width;
    L->height = (int)height;
}

static int fits(int64_t w, int64_t h, int64_t max_pixels) {
    return w <= DCS_PNG_MAX_SIDE && h <= DCS_PNG_MAX_SIDE && w * h <= max_pixels;
}

dcs_status dcs_png_layout_compute(const dcs_heatmap_spec *sp, dcs_png_layout *L, char *err, size_t errlen) {
    if (err && errlen > 0) err[0] = 0;
    if (!sp) return fail(err, errlen, DCS_ERR_ARG, "heatmap: spec is NULL");
    if (!L) return fail(err, errlen, DCS_ERR_ARG, "heatmap: layout is NULL");
    memset(L, 0, sizeof *L);
    if (!sp->panels) return fail(err, errlen, DCS_ERR_ARG, "heatmap: panels is NULL");
    if (sp->n_panels <= 0 || sp->n_panels > DCS_PNG_MAX_PANELS)
        return fail(err, errlen, DCS_ERR_ARG, "heatmap: n_panels = %d (must be 1..%d)", sp->n_panels,
                    DCS_PNG_MAX_PANELS);
    if (sp->colormap != DCS_CMAP_SEQUENTIAL && sp->colormap != DCS_CMAP_DIVERGING)
        return fail(err, errlen, DCS_ERR_ARG,
                    "heatmap: colormap = %d (must be DCS_CMAP_SEQUENTIAL or "
                    "DCS_CMAP_DIVERGING)",
                    sp->colormap);
    int rows = sp->panels[0].rows, cols = sp->panels[0].cols;
    for (int p = 0; p < sp->n_panels; p++) {
        const dcs_panel *q = &sp->panels[p];
        if (!q->data) return fail(err, errlen, DCS_ERR_ARG, "heatmap: panel %d: data is NULL", p);
        if (q->rows <= 0 || q->cols <= 0)
            return fail(err, errlen, DCS_ERR_ARG, "heatmap: panel %d: rows = %d, cols = %d (must be > 0)", p,
                        q->rows, q->cols);
        if (q->rows != rows || q->cols != cols)
            return fail(err, errlen, DCS_ERR_ARG,
                        "heatmap: panel %d is %dx%d but panel 0 is %dx%d (all panels "
                        "must share rows and cols)",
                        p, q->rows, q->cols, rows, cols);
    }
    if (rows > DCS_PNG_MAX_SIDE || cols > DCS_PNG_MAX_SIDE)
        return fail(err, errlen, DCS_ERR_ARG, "heatmap: %dx%d map is too large (at most %d rows and cols)",
                    rows, cols, DCS_PNG_MAX_SIDE);
    if (sp->cell_px > DCS_PNG_MAX_SIDE)
        return fail(err, errlen, DCS_ERR_ARG, "heatmap: cell_px = %d is too large", sp->cell_px);
    L->n_panels = sp->n_panels;
    L->rows = rows;
    L->cols = cols;
    L->grid_cols = sp->grid_cols <= 0 || sp->grid_cols > sp->n_panels ? sp->n_panels : sp->grid_cols;
    L->grid_rows = (sp->n_panels + L->grid_cols - 1) / L->grid_cols;

    /* Colour range. */
    if (sp->auto_range) {
        double lo, hi;
        int found;
        if (sp->colormap == DCS_CMAP_DIVERGING) {
            data_range(sp, rows, cols, 1, &lo, &hi, &found);
            double m = found ? hi : 0.0;
            if (!(m > 0.0)) m = 1.0;
            L->vmin = (float)-m;
            L->vmax = (float)m;
        } else {
            data_range(sp, rows, cols, 0, &lo, &hi, &found);
            if (!found) {
                lo = 0.0;
                hi = 1.0;
            } else if (!(hi > lo)) {
                double d = fabs(lo) * 0.1;
                if (!(d > 0.0)) d = 0.5;
                lo -= d;
                hi += d;
            }
            L->vmin = (float)lo;
            L->vmax = (float)hi;
            if (!(L->vmax > L->vmin)) { /* rounding to float collapsed it */
                L->vmin = nextafterf(L->vmin, -INFINITY);
                L->vmax = nextafterf(L->vmax, INFINITY);
            }
        }
    } else {
        if (!isfinite(sp->vmin) || !isfinite(sp->vmax) || !(sp->vmin < sp->vmax))
            return fail(err, errlen, DCS_ERR_ARG,
                        "heatmap: vmin = %g, vmax = %g: need finite vmin < vmax (or "
                        "auto_range = 1)",
                        (double)sp->vmin, (double)sp->vmax);
        L->vmin = sp->vmin;
        L->vmax = sp->vmax;
    }

    /* Text extents. */
    measures m;
    memset(&m, 0, sizeof m);
    for (int t = 0; t < rows; t++) {
        int n = label_count(sp->row_labels, t, 1);
        if (n > m.row_g) m.row_g = n;
    }
    for (int s = 0; s < cols; s++) {
        int n = label_count(sp->col_labels, s, 1);
        if (n > m.col_g) m.col_g = n;
    }
    for (int p = 0; p < sp->n_panels; p++) {
        const char *t = sp->panels[p].title;
        if (t && *t) {
            uint8_t g[MAX_TITLE_GLYPHS];
            int n = dcs_png_label_glyphs(t, 0, MAX_TITLE_GLYPHS, g);
            m.has_ptitle = 1;
            if (n > m.ptitle_g) m.ptitle_g = n;
        }
    }
    m.axis_titles = sp->axis_titles != 0;
    m.has_title = sp->title && *sp->title;
    if (m.has_title) {
        uint8_t g[MAX_FIG_TITLE_GLYPHS];
        m.title_g = dcs_png_label_glyphs(sp->title, 0, MAX_FIG_TITLE_GLYPHS, g);
    }
    {
        double v[5];
        int n = tick_candidates(L, sp->colormap, v);
        for (int i = 0; i < n; i++) {
            char buf[32];
            format_tick(v[i], buf);
            int len = (int)strlen(buf);
            if (len > m.tick_g) m.tick_g = len;
        }
    }

    /* Cell size. */
    int64_t w = 0, h = 0;
    if (sp->cell_px > 0) {
        geometry(&m, sp->cell_px, L, &w, &h);
        if (!fits(w, h, DCS_PNG_MAX_PIXELS))
            return fail(err, errlen, DCS_ERR_ARG,
                        "heatmap: picture would be %lldx%lld pixels (limit %d per side, "
                        "%lld pixels); use a smaller cell_px or fewer panels",
                        (long long)w, (long long)h, DCS_PNG_MAX_SIDE, (long long)DCS_PNG_MAX_PIXELS);
    } else {
        int side = rows > cols ? rows : cols;
        int target = sp->n_panels == 1   ? AUTO_TARGET_1
                     : sp->n_panels <= 8 ? AUTO_TARGET_FEW
                                         : AUTO_TARGET_MANY;
        int c = target / side;
        if (c > DCS_PNG_MAX_AUTO_CELL) c = DCS_PNG_MAX_AUTO_CELL;
        if (c < 1) c = 1;
        for (;; c--) {
            geometry(&m, c, L, &w, &h);
            if (fits(w, h, DCS_PNG_AUTO_PIXELS)) break;
            if (c == 1) {
                if (fits(w, h, DCS_PNG_MAX_PIXELS)) break;
                return fail(err, errlen, DCS_ERR_ARG,
                            "heatmap: %d panels of %dx%d need %lldx%lld pixels even at "
                            "1 pixel per cell (limit %d per side, %lld pixels); use "
                            "fewer panels, smaller maps or a different grid_cols",
                            sp->n_panels, rows, cols, (long long)w, (long long)h, DCS_PNG_MAX_SIDE,
                            (long long)DCS_PNG_MAX_PIXELS);
            }
        }
    }
    return DCS_OK;
}

void dcs_png_cell_origin(const dcs_png_layout *L, int p, int t, int s, int *x, int *y) {
    int gx = p % L->grid_cols, gy = p / L->grid_cols;
    if (x) *x = L->x0 + gx * L->pitch_x + s * L->cell;
    if (y) *y = L->y0 + gy * L->pitch_y + t * L->cell;
}

/* ---------------------------------------------------------------- drawing */

typedef struct {
    uint8_t *px; /* RGB, row-major */
    int w, h;
} canvas;

static void fill_rect(canvas *cv, int x, int y, int w, int h, const uint8_t rgb[3]) {
    int x1 = x + w, y1 = y + h;
    if (x < 0) x = 0;
    if (y < 0) y = 0;
    if (x1 > cv->w) x1 = cv->w;
    if (y1 > cv->h) y1 = cv->h;
    for (int yy = y; yy < y1; yy++) {
        uint8_t *q = cv->px + ((size_t)yy * (size_t)cv->w + (size_t)x) * 3;
        for (int xx = x; xx < x1; xx++, q += 3) {
            q[0] = rgb[0];
            q[1] = rgb[1];
            q[2] = rgb[2];
        }
    }
}

/* Draw glyph g at scale s. rot 0: (x, y) is its top-left. rot 1 (rotated
 * 90 degrees counter-clockwise, text reading upwards): (x, y) is the pixel
 * where the glyph's top-left corner went, i.e. its left column and its
 * bottom row. */
static void draw_glyph(canvas *cv, int g, int x, int y, int s, int rot, const uint8_t rgb[3]) {
    for (int gy = 0; gy < DCS_FONT_H; gy++)
        for (int gx = 0; gx < DCS_FONT_W; gx++) {
            if (!dcs_font_pixel(g, gx, gy)) continue;
            if (rot == 0)
                fill_rect(cv, x + gx * s, y + gy * s, s, s, rgb);
            else
                fill_rect(cv, x + gy * s, y - gx * s - s + 1, s, s, rgb);
        }
}

static void draw_glyphs(canvas *cv, const uint8_t *g, int n, int x, int y, int s, int rot, int bold,
                        const uint8_t rgb[3]) {
    for (int i = 0; i < n; i++) {
        int off = i * DCS_FONT_ADV * s;
        if (rot == 0) {
            draw_glyph(cv, g[i], x + off, y, s, 0, rgb);
            if (bold) draw_glyph(cv, g[i], x + off + 1, y, s, 0, rgb);
        } else {
            draw_glyph(cv, g[i], x, y - off, s, 1, rgb);
        }
    }
}

static void draw_frame(canvas *cv, int x, int y, int w, int h, const uint8_t rgb[3]) {
    fill_rect(cv, x - 1, y - 1, w + 2, 1, rgb);
    fill_rect(cv, x - 1, y + h, w + 2, 1, rgb);
    fill_rect(cv, x - 1, y, 1, h, rgb);
    fill_rect(cv, x + w, y, 1, h, rgb);
}

/* Masked pixels [x0, x1) of picture row y: light grey with a diagonal hatch. */
static void hatch_span(canvas *cv, int y, int x0, int x1) {
    uint8_t *q = cv->px + ((size_t)y * (size_t)cv->w + (size_t)x0) * 3;
    for (int x = x0; x < x1; x++, q += 3) {
        const uint8_t *m = (x + y) % DCS_PNG_HATCH_PERIOD == 0 ? HATCH : MASK;
        q[0] = m[0];
        q[1] = m[1];
        q[2] = m[2];
    }
}

/* Cells of one panel (the picture is known to contain them). */
static void draw_cells(canvas *cv, const dcs_png_layout *L, const dcs_heatmap_spec *sp, int p,
                       const float *data, int px, int py, uint8_t *line, const uint8_t *lut) {
    int c = L->cell, cols = L->cols;
    size_t line_bytes = (size_t)L->panel_w * 3;
    for (int t = 0; t < L->rows; t++) {
        const float *row = data + (size_t)t * (size_t)cols;
        int first_masked = sp->mask_upper ? t + 1 : cols;
        if (first_masked > cols) first_masked = cols;
        int first = first_visible(sp, p, t);
        if (first > first_masked) first = first_masked;
        for (int s = first; s < first_masked; s++) {
            int level = dcs_colormap_level(sp->colormap, row[s], L->vmin, L->vmax);
            const uint8_t *rgb = lut + 3 * (size_t)(level + 1); /* entry 0: NaN */
            uint8_t *q = line + (size_t)s * (size_t)c * 3;
            for (int k = 0; k < c; k++, q += 3) {
                q[0] = rgb[0];
                q[1] = rgb[1];
                q[2] = rgb[2];
            }
        }
        for (int dy = 0; dy < c; dy++) {
            int y = py + t * c + dy;
            uint8_t *dst = cv->px + ((size_t)y * (size_t)cv->w + (size_t)px) * 3;
            memcpy(dst, line, line_bytes);
            hatch_span(cv, y, px, px + first * c);                     /* outside the window */
            hatch_span(cv, y, px + first_masked * c, px + L->panel_w); /* causal */
        }
    }
}

static void draw_colour_bar(canvas *cv, const dcs_png_layout *L, int colormap) {
    int bx = L->bar_x, by = L->bar_y, bw = L->bar_w, bh = L->bar_h, s = L->scale;
    double lo = L->vmin, hi = L->vmax;
    for (int y = 0; y < bh; y++) {
        double v = y == 0 ? hi : y == bh - 1 ? lo : hi - (hi - lo) * y / (bh - 1);
        uint8_t rgb[3];
        dcs_colormap_rgb(colormap, (float)v, L->vmin, L->vmax, rgb);
        fill_rect(cv, bx, by + y, bw, 1, rgb);
    }
    draw_frame(cv, bx, by, bw, bh, FRAME);
    double v[5];
    int n = tick_candidates(L, colormap, v);
    int placed[5], np = 0;
    int min_gap = DCS_FONT_LINE * s + 2;
    for (int i = 0; i < n; i++) {
        double f = (hi - v[i]) / (hi - lo);
        if (!(f >= 0.0 && f <= 1.0)) continue;
        int y = by + (int)floor(f * (bh - 1) + 0.5);
        int ok = 1;
        for (int j = 0; j < np; j++)
            if (abs(placed[j] - y) < min_gap) ok = 0;
        if (!ok) continue;
        placed[np++] = y;
        fill_rect(cv, bx + bw + 1, y, TICK + 1, 1, FRAME);
        char buf[32];
        format_tick(v[i], buf);
        uint8_t g[32];
        int ng = dcs_png_label_glyphs(buf, 0, 31, g);
        draw_glyphs(cv, g, ng, L->tick_label_x, y - DCS_FONT_CAP * s / 2, s, 0, 0, INK);
    }
}

static void draw_picture(canvas *cv, const dcs_png_layout *L, const dcs_heatmap_spec *sp, uint8_t *line,
                         const uint8_t *lut) {
    int s = L->scale, c = L->cell, k = L->label_step;
    /* Figure title, centred, bold. */
    if (L->title_y >= 0) {
        int ts = L->title_scale;
        int maxg = (cv->w - 2 * MARGIN + ts) / (DCS_FONT_ADV * ts);
        if (maxg > 0) {
            uint8_t g[MAX_FIG_TITLE_GLYPHS];
            if (maxg > MAX_FIG_TITLE_GLYPHS) maxg = MAX_FIG_TITLE_GLYPHS;
            int n = dcs_png_label_glyphs(sp->title, 0, maxg, g);
            int wpx = (int)text_px(n, ts);
            draw_glyphs(cv, g, n, (cv->w - wpx) / 2, L->title_y, ts, 0, 1, INK);
        }
    }
    uint8_t g[DCS_PNG_MAX_LABEL_GLYPHS > MAX_TITLE_GLYPHS ? DCS_PNG_MAX_LABEL_GLYPHS : MAX_TITLE_GLYPHS];
    char buf[16];
    for (int p = 0; p < L->n_panels; p++) {
        int px, py;
        dcs_png_cell_origin(L, p, 0, 0, &px, &py);
        const dcs_panel *pan = &sp->panels[p];
        draw_cells(cv, L, sp, p, pan->data, px, py, line, lut);
        draw_frame(cv, px, py, L->panel_w, L->panel_h, FRAME);
        /* Panel title: centred above the panel, within its pitch. */
        if (pan->title && *pan->title) {
            int maxg = (L->pitch_x - 8 + s) / (DCS_FONT_ADV * s);
            if (maxg > MAX_TITLE_GLYPHS) maxg = MAX_TITLE_GLYPHS;
            if (maxg > 0) {
                int n = dcs_png_label_glyphs(pan->title, 0, maxg, g);
                int wpx = (int)text_px(n, s);
                draw_glyphs(cv, g, n, px + (L->panel_w - wpx) / 2, py - L->ptitle_h + 1, s, 0, 1, INK);
            }
        }
        /* Query labels: left of the first panel of each grid row. */
        if (p % L->grid_cols == 0) {
            for (int t = 0; t < L->rows; t += k) {
                int cy = py + t * c + c / 2;
                fill_rect(cv, px - 2 - TICK, cy, TICK, 1, FRAME);
                int n =
                    dcs_png_label_glyphs(label_text(sp->row_labels, t, buf), 1, DCS_PNG_MAX_LABEL_GLYPHS, g);
                int xr = px - TICK - 5; /* rightmost pixel of the text */
                draw_glyphs(cv, g, n, xr - (int)text_px(n, s) + 1, cy - DCS_FONT_CAP * s / 2, s, 0, 0, INK);
            }
        }
        /* Key labels: under every panel, reading upwards, ending near it. */
        for (int j = 0; j < L->cols; j += k) {
            int cx = px + j * c + c / 2;
            fill_rect(cv, cx, py + L->panel_h + 2, 1, TICK, FRAME);
            int n = dcs_png_label_glyphs(label_text(sp->col_labels, j, buf), 1, DCS_PNG_MAX_LABEL_GLYPHS, g);
            int top = py + L->panel_h + TICK + 5;
            draw_glyphs(cv, g, n, cx - DCS_FONT_CAP * s / 2, top + (int)text_px(n, s) - 1, s, 1, 0, INK);
        }
        if (sp->axis_titles) {
            /* "key" centred under the key labels; "query" reading upwards left
             * of the query labels of the first panel of each grid row */
            static const char key[] = "key", query[] = "query";
            int n = dcs_png_label_glyphs(key, 0, 8, g);
            int ky = py + L->panel_h + TICK + 5 + (int)text_px(L->col_label_glyphs, s) + AXIS_GAP / 2;
            draw_glyphs(cv, g, n, px + (L->panel_w - (int)text_px(n, s)) / 2, ky, s, 0, 0, INK);
            if (p % L->grid_cols == 0) {
                n = dcs_png_label_glyphs(query, 0, 8, g);
                int qx = px - TICK - 6 - (int)text_px(L->row_label_glyphs, s) - AXIS_GAP / 2 - DCS_FONT_H * s;
                draw_glyphs(cv, g, n, qx, py + (L->panel_h + (int)text_px(n, s)) / 2, s, 1, 0, INK);
            }
        }
    }
    draw_colour_bar(cv, L, sp->colormap);
}

/* ---------------------------------------------------------------- libpng */

typedef struct {
    uint8_t *buf;
    size_t len, cap;
    int nomem;
    char msg[200];
} png_mem;

static void png_write_cb(png_structp png, png_bytep data, size_t n) {
    png_mem *m = (png_mem *)png_get_io_ptr(png);
    if (n > SIZE_MAX / 2 - m->len) {
        m->nomem = 1;
        png_error(png, "PNG output too large");
    }
    if (m->len + n > m->cap) {
        size_t cap = m->cap ? m->cap : (size_t)1 << 16;
        while (cap < m->len + n) cap *= 2;
        uint8_t *nb = (uint8_t *)realloc(m->buf, cap);
        if (!nb) {
            m->nomem = 1;
            png_error(png, "out of memory for the PNG output");
        }
        m->buf = nb;
        m->cap = cap;
    }
    memcpy(m->buf + m->len, data, n);
    m->len += n;
}

static void png_flush_cb(png_structp png) { (void)png; }

static void png_error_cb(png_structp png, png_const_charp msg) {
    png_mem *m = (png_mem *)png_get_error_ptr(png);
    if (m) snprintf(m->msg, sizeof m->msg, "%s", msg ? msg : "unknown error");
    png_longjmp(png, 1);
}

static void png_warning_cb(png_structp png, png_const_charp msg) {
    (void)png;
    (void)msg;
}

/* Everything libpng does after setjmp, in its own frame. */
static void png_encode_body(png_structp png, png_infop info, png_mem *m, const uint8_t *rgb, int w, int h) {
    png_set_write_fn(png, m, png_write_cb, png_flush_cb);
    png_set_IHDR(png, info, (png_uint_32)w, (png_uint_32)h, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
                 PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    png_set_compression_level(png, 3);
    png_set_filter(png, PNG_FILTER_TYPE_BASE, PNG_FILTER_SUB | PNG_FILTER_UP);
    png_write_info(png, info);
    for (int y = 0; y < h; y++) png_write_row(png, rgb + (size_t)y * (size_t)w * 3);
    png_write_end(png, NULL);
}

static dcs_status png_encode(const uint8_t *rgb, int w, int h, uint8_t **out, size_t *out_len, char *err,
                             size_t errlen) {
    png_mem *m = (png_mem *)calloc(1, sizeof *m);
    if (!m) return fail(err, errlen, DCS_ERR_NOMEM, "heatmap: out of memory");
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, m, png_error_cb, png_warning_cb);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    if (!png || !info) {
        png_destroy_write_struct(png ? &png : NULL, NULL);
        free(m);
        return fail(err, errlen, DCS_ERR_NOMEM, "heatmap: libpng could not start");
    }
    if (setjmp(png_jmpbuf(png))) {
        dcs_status st = m->nomem ? DCS_ERR_NOMEM : DCS_ERR_BACKEND;
        fail(err, errlen, st, "heatmap: libpng: %s", m->msg);
        png_destroy_write_struct(&png, &info);
        free(m->buf);
        free(m);
        return st;
    }
    png_encode_body(png, info, m, rgb, w, h);
    png_destroy_write_struct(&png, &info);
    *out = m->buf;
    *out_len = m->len;
    free(m);
    return DCS_OK;
}

/* ---------------------------------------------------------------- API */

dcs_status dcs_heatmap_png(const dcs_heatmap_spec *spec, uint8_t **png, size_t *png_len, char *err,
                           size_t errlen) {
    if (png) *png = NULL;
    if (png_len) *png_len = 0;
    if (!png || !png_len) return fail(err, errlen, DCS_ERR_ARG, "heatmap: png and png_len must not be NULL");
    dcs_png_layout L;
    dcs_status st = dcs_png_layout_compute(spec, &L, err, errlen);
    if (st != DCS_OK) return st;
    size_t npx = (size_t)L.width * (size_t)L.height;
    canvas cv = {(uint8_t *)malloc(npx * 3), L.width, L.height};
    uint8_t *line = (uint8_t *)malloc((size_t)L.panel_w * 3);
    /* Colour of every level (entry 0 is NaN's): the cells look colours up. */
    uint8_t *lut = (uint8_t *)malloc((size_t)(DCS_CMAP_LEVELS + 1) * 3);
    if (!cv.px || !line || !lut) {
        free(cv.px);
        free(line);
        free(lut);
        return fail(err, errlen, DCS_ERR_NOMEM, "heatmap: out of memory for a %dx%d picture", L.width,
                    L.height);
    }
    memset(cv.px, WHITE[0], npx * 3);
    for (int i = -1; i < DCS_CMAP_LEVELS; i++)
        dcs_colormap_level_rgb(spec->colormap, i, lut + 3 * (size_t)(i + 1));
    draw_picture(&cv, &L, spec, line, lut);
    free(line);
    free(lut);
    st = png_encode(cv.px, cv.w, cv.h, png, png_len, err, errlen);
    free(cv.px);
    return st;
}

void dcs_buffer_free(void *p) { free(p); }

dcs_status dcs_heatmap_geometry(const dcs_heatmap_spec *spec, int panel, int t, int s, int *width,
                                int *height, int *x, int *y, int *cell, char *err, size_t errlen) {
    dcs_png_layout L;
    dcs_status st = dcs_png_layout_compute(spec, &L, err, errlen);
    if (st != DCS_OK) return st;
    if (panel < 0 || panel >= L.n_panels || t < 0 || t >= L.rows || s < 0 || s >= L.cols) {
        if (err && errlen)
            snprintf(err, errlen, "heatmap geometry: cell (%d, %d, %d) is outside %d panels of %d x %d",
                     panel, t, s, L.n_panels, L.rows, L.cols);
        return DCS_ERR_ARG;
    }
    int cx, cy;
    dcs_png_cell_origin(&L, panel, t, s, &cx, &cy);
    if (width) *width = L.width;
    if (height) *height = L.height;
    if (x) *x = cx;
    if (y) *y = cy;
    if (cell) *cell = L.cell;
    return DCS_OK;
}
