/*
 * test_png.c -- tests of the heatmap renderer and the colour maps.
 *
 *   gcc -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -Wall -Wextra -O2 \
 *       -Iengine/include -Iengine/src engine/src/png.c engine/src/colormap.c \
 *       engine/tests/test_png.c -lpng -lz -lm -o /tmp/test_png && /tmp/test_png
 *
 * Renders maps, decodes the PNG with libpng's png_image API and compares
 * pixels with what png_layout.h says is where. Prints "png: N passed, M
 * failed" and exits nonzero on failure.
 */
#include "dclens.h"
#include "font.h"
#include "png_layout.h"

#include <png.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int n_pass, n_fail;

#define CHECK(cond, ...)                                                                                     \
    do {                                                                                                     \
        if (cond) {                                                                                          \
            n_pass++;                                                                                        \
        } else {                                                                                             \
            n_fail++;                                                                                        \
            printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                                           \
            printf(__VA_ARGS__);                                                                             \
            printf("\n");                                                                                    \
        }                                                                                                    \
    } while (0)

/* ---------------------------------------------------------------- helpers */

typedef struct {
    uint8_t *px; /* RGB */
    int w, h;
} image;

static int decode(const uint8_t *png, size_t len, image *im) {
    png_image pi;
    memset(&pi, 0, sizeof pi);
    pi.version = PNG_IMAGE_VERSION;
    im->px = NULL;
    if (!png_image_begin_read_from_memory(&pi, png, len)) return 0;
    pi.format = PNG_FORMAT_RGB;
    im->px = (uint8_t *)malloc(PNG_IMAGE_SIZE(pi));
    if (!im->px) {
        png_image_free(&pi);
        return 0;
    }
    if (!png_image_finish_read(&pi, NULL, im->px, 0, NULL)) {
        free(im->px);
        im->px = NULL;
        return 0;
    }
    im->w = (int)pi.width;
    im->h = (int)pi.height;
    return 1;
}

static const uint8_t *pix(const image *im, int x, int y) {
    return im->px + ((size_t)y * (size_t)im->w + (size_t)x) * 3;
}

static int same(const uint8_t *a, const uint8_t *b) { return a[0] == b[0] && a[1] == b[1] && a[2] == b[2]; }

/* Render spec, decode it and compute its layout. Returns 1 on success. */
static int render(const dcs_heatmap_spec *sp, image *im, dcs_png_layout *L) {
    uint8_t *png = NULL;
    size_t len = 0;
    char err[256] = "";
    dcs_status st = dcs_heatmap_png(sp, &png, &len, err, sizeof err);
    CHECK(st == DCS_OK, "status %d: %s", (int)st, err);
    if (st != DCS_OK) return 0;
    CHECK(len > 8 && png && memcmp(png, "\x89PNG\r\n\x1a\n", 8) == 0, "PNG signature");
    int ok = decode(png, len, im);
    CHECK(ok, "decode");
    dcs_buffer_free(png);
    if (!ok) return 0;
    st = dcs_png_layout_compute(sp, L, err, sizeof err);
    CHECK(st == DCS_OK, "layout: %s", err);
    CHECK(im->w == L->width && im->h == L->height, "size %dx%d, layout says %dx%d", im->w, im->h, L->width,
          L->height);
    return st == DCS_OK && im->w == L->width && im->h == L->height;
}

static int is_mask(const uint8_t *p) {
    return (p[0] == DCS_PNG_MASK_R && p[1] == DCS_PNG_MASK_G && p[2] == DCS_PNG_MASK_B) ||
           (p[0] == DCS_PNG_HATCH_R && p[1] == DCS_PNG_HATCH_G && p[2] == DCS_PNG_HATCH_B);
}

/* Every pixel of every cell: its colour (unmasked) or the mask. Returns the
 * number of wrong cells. */
static int check_cells(const image *im, const dcs_png_layout *L, const dcs_heatmap_spec *sp) {
    int bad = 0;
    for (int p = 0; p < sp->n_panels; p++)
        for (int t = 0; t < L->rows; t++)
            for (int s = 0; s < L->cols; s++) {
                int x, y;
                dcs_png_cell_origin(L, p, t, s, &x, &y);
                int w = sp->panels[p].mask_window > 0   ? sp->panels[p].mask_window
                        : sp->panels[p].mask_window < 0 ? 0
                                                        : sp->mask_window;
                int masked = sp->mask_upper && (s > t || (w > 0 && t - s > w));
                uint8_t want[3];
                float v = sp->panels[p].data[(size_t)t * L->cols + s];
                dcs_colormap_rgb(sp->colormap, v, L->vmin, L->vmax, want);
                int cell_bad = 0;
                for (int dy = 0; dy < L->cell; dy++)
                    for (int dx = 0; dx < L->cell; dx++) {
                        const uint8_t *q = pix(im, x + dx, y + dy);
                        if (masked ? !is_mask(q) : !same(q, want)) cell_bad = 1;
                    }
                /* The centre pixel, as the spec of the test says. */
                const uint8_t *c = pix(im, x + L->cell / 2, y + L->cell / 2);
                if (masked ? !is_mask(c) : !same(c, want)) cell_bad = 1;
                bad += cell_bad;
            }
    return bad;
}

static int ink_in(const image *im, int x0, int y0, int x1, int y1) {
    int n = 0;
    for (int y = y0 < 0 ? 0 : y0; y < y1 && y < im->h; y++)
        for (int x = x0 < 0 ? 0 : x0; x < x1 && x < im->w; x++) {
            const uint8_t *q = pix(im, x, y);
            if (q[0] < 100 && q[1] < 100 && q[2] < 100) n++;
        }
    return n;
}

/* OKLab lightness of an 8-bit sRGB colour. */
static double lightness(const uint8_t rgb[3]) {
    double lin[3];
    for (int i = 0; i < 3; i++) {
        double c = rgb[i] / 255.0;
        lin[i] = c <= 0.04045 ? c / 12.92 : pow((c + 0.055) / 1.055, 2.4);
    }
    double l = 0.4122214708 * lin[0] + 0.5363325363 * lin[1] + 0.0514459929 * lin[2];
    double m = 0.2119034982 * lin[0] + 0.6806995451 * lin[1] + 0.1073969566 * lin[2];
    double s = 0.0883024619 * lin[0] + 0.2817188376 * lin[1] + 0.6299787005 * lin[2];
    return 0.2104542553 * cbrt(l) + 0.7936177850 * cbrt(m) - 0.0040720468 * cbrt(s);
}

static dcs_heatmap_spec base_spec(const dcs_panel *p, int n) {
    dcs_heatmap_spec sp;
    memset(&sp, 0, sizeof sp);
    sp.panels = p;
    sp.n_panels = n;
    sp.colormap = DCS_CMAP_SEQUENTIAL;
    sp.vmin = 0.0f;
    sp.vmax = 1.0f;
    return sp;
}

/* ---------------------------------------------------------------- tests */

static void test_colormaps(void) {
    uint8_t a[3], b[3];
    /* Sequential: lightness strictly increasing over 64 samples. */
    double prev = -1.0;
    int mono = 1;
    for (int i = 0; i < 64; i++) {
        dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, i / 63.0f, 0.0f, 1.0f, a);
        double L = lightness(a);
        if (!(L > prev)) mono = 0;
        prev = L;
    }
    CHECK(mono, "sequential lightness not monotone");
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, 0.0f, 0.0f, 1.0f, a);
    CHECK(a[2] > a[1] && a[0] > a[1] && lightness(a) < 0.4, "low end dark purple: %d %d %d", a[0], a[1],
          a[2]);
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, 1.0f, 0.0f, 1.0f, a);
    CHECK(a[0] > 200 && a[1] > 200 && a[2] < 120, "high end yellow: %d %d %d", a[0], a[1], a[2]);
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, 0.5f, 0.0f, 1.0f, a);
    CHECK(a[1] > a[0], "middle blue-green: %d %d %d", a[0], a[1], a[2]);
    /* Clamping and the range. */
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, -5.0f, 0.0f, 1.0f, a);
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, 0.0f, 0.0f, 1.0f, b);
    CHECK(same(a, b), "below range clamps");
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, INFINITY, 0.0f, 1.0f, a);
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, 1.0f, 0.0f, 1.0f, b);
    CHECK(same(a, b), "+inf clamps");
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, 15.0f, 10.0f, 20.0f, a);
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, 0.5f, 0.0f, 1.0f, b);
    CHECK(same(a, b), "range is linear");
    /* NaN: magenta in both maps. */
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, NAN, 0.0f, 1.0f, a);
    CHECK(a[0] == 255 && a[1] == 0 && a[2] == 255, "NaN magenta");
    dcs_colormap_rgb(DCS_CMAP_DIVERGING, NAN, -1.0f, 1.0f, a);
    CHECK(a[0] == 255 && a[1] == 0 && a[2] == 255, "NaN magenta (diverging)");

    /* Diverging: white-ish at 0, blue below, red above, mirror lightness. */
    dcs_colormap_rgb(DCS_CMAP_DIVERGING, 0.0f, -1.0f, 1.0f, a);
    CHECK(a[0] >= 240 && a[1] >= 240 && a[2] >= 240 && abs(a[0] - a[1]) <= 3 && abs(a[1] - a[2]) <= 3,
          "diverging(0) = %d %d %d", a[0], a[1], a[2]);
    int sym = 1, hues = 1, mono_d = 1;
    double prev_l = 2.0;
    for (int i = 1; i <= 32; i++) {
        float x = i / 32.0f;
        dcs_colormap_rgb(DCS_CMAP_DIVERGING, -x, -1.0f, 1.0f, a);
        dcs_colormap_rgb(DCS_CMAP_DIVERGING, x, -1.0f, 1.0f, b);
        double la = lightness(a), lb = lightness(b);
        if (fabs(la - lb) > 0.01) sym = 0;
        if (!(a[2] > a[0] && b[0] > b[2])) hues = 0;
        if (!(lb < prev_l)) mono_d = 0;
        prev_l = lb;
    }
    CHECK(sym, "diverging lightness symmetric");
    CHECK(hues, "diverging negative blue, positive red");
    CHECK(mono_d, "diverging darker away from zero");
    /* Centred on zero for an asymmetric range; clamped to the range. */
    dcs_colormap_rgb(DCS_CMAP_DIVERGING, 0.0f, -1.0f, 3.0f, a);
    dcs_colormap_rgb(DCS_CMAP_DIVERGING, 0.0f, -1.0f, 1.0f, b);
    CHECK(same(a, b), "diverging centre is zero");
    dcs_colormap_rgb(DCS_CMAP_DIVERGING, -7.0f, -1.0f, 3.0f, a);
    dcs_colormap_rgb(DCS_CMAP_DIVERGING, -1.0f, -1.0f, 3.0f, b);
    CHECK(same(a, b), "diverging clamps");
    dcs_colormap_rgb(DCS_CMAP_DIVERGING, 2.0f, -2.0f, 2.0f, a);
    dcs_colormap_rgb(DCS_CMAP_DIVERGING, 1.0f, -1.0f, 1.0f, b);
    CHECK(same(a, b), "diverging scales with the range");

    /* Levels: the colour is the level's colour; diverging levels mirror. */
    int half = (DCS_CMAP_LEVELS - 1) / 2, lv_ok = 1;
    CHECK(dcs_colormap_level(DCS_CMAP_DIVERGING, 0.0f, -3.0f, 1.0f) == half, "centre level");
    CHECK(dcs_colormap_level(DCS_CMAP_SEQUENTIAL, NAN, 0.0f, 1.0f) == -1, "NaN level");
    for (int i = 0; i <= 100; i++) {
        float x = (float)i / 37.0f;
        int lp = dcs_colormap_level(DCS_CMAP_DIVERGING, x, -2.0f, 2.0f);
        int ln = dcs_colormap_level(DCS_CMAP_DIVERGING, -x, -2.0f, 2.0f);
        if (lp - half != half - ln || lp < half || lp >= DCS_CMAP_LEVELS) lv_ok = 0;
        dcs_colormap_level_rgb(DCS_CMAP_DIVERGING, lp, a);
        dcs_colormap_rgb(DCS_CMAP_DIVERGING, x, -2.0f, 2.0f, b);
        if (!same(a, b)) lv_ok = 0;
        int ls = dcs_colormap_level(DCS_CMAP_SEQUENTIAL, x, 0.0f, 2.0f);
        dcs_colormap_level_rgb(DCS_CMAP_SEQUENTIAL, ls, a);
        dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, x, 0.0f, 2.0f, b);
        if (!same(a, b) || ls < 0 || ls >= DCS_CMAP_LEVELS) lv_ok = 0;
    }
    CHECK(lv_ok, "levels consistent and symmetric");

    /* The mask greys differ clearly from every colour of both maps. */
    static const uint8_t greys[2][3] = {{DCS_PNG_MASK_R, DCS_PNG_MASK_G, DCS_PNG_MASK_B},
                                        {DCS_PNG_HATCH_R, DCS_PNG_HATCH_G, DCS_PNG_HATCH_B}};
    int distinct = 1;
    for (int cm = 0; cm < 2; cm++)
        for (int i = 0; i <= 256; i++) {
            float x = cm == 0 ? i / 256.0f : (i - 128) / 128.0f;
            dcs_colormap_rgb(cm, x, cm == 0 ? 0.0f : -1.0f, 1.0f, a);
            for (int g = 0; g < 2; g++) {
                int d = 0;
                for (int k = 0; k < 3; k++)
                    if (abs(a[k] - greys[g][k]) > d) d = abs(a[k] - greys[g][k]);
                if (d < 20) distinct = 0;
            }
        }
    CHECK(distinct, "mask greys distinct from the colour maps");
}

static void test_labels(void) {
    uint8_t g[DCS_PNG_MAX_LABEL_GLYPHS];
    int n = dcs_png_label_glyphs(" the", 1, DCS_PNG_MAX_LABEL_GLYPHS, g);
    CHECK(n == 4 && g[0] == DCS_GLYPH_MIDDOT && g[1] == 't' - 32 && g[3] == 'e' - 32, "leading space: n=%d",
          n);
    n = dcs_png_label_glyphs(" the", 0, DCS_PNG_MAX_LABEL_GLYPHS, g);
    CHECK(n == 4 && g[0] == 0, "plain space when not visible");
    n = dcs_png_label_glyphs("a b ", 1, DCS_PNG_MAX_LABEL_GLYPHS, g);
    CHECK(n == 4 && g[1] == 0 && g[3] == DCS_GLYPH_MIDDOT, "inner space plain, trailing dot");
    n = dcs_png_label_glyphs("caf\xc3\xa9", 1, DCS_PNG_MAX_LABEL_GLYPHS, g);
    CHECK(n == 4 && g[3] == DCS_GLYPH_BOX, "2-byte UTF-8 is one box: n=%d", n);
    n = dcs_png_label_glyphs("\xe6\x97\xa5\xf0\x9f\x98\x80", 1, DCS_PNG_MAX_LABEL_GLYPHS, g);
    CHECK(n == 2 && g[0] == DCS_GLYPH_BOX && g[1] == DCS_GLYPH_BOX, "3- and 4-byte UTF-8: n=%d", n);
    n = dcs_png_label_glyphs("\xff\x80", 1, DCS_PNG_MAX_LABEL_GLYPHS, g);
    CHECK(n == 2 && g[0] == DCS_GLYPH_BOX && g[1] == DCS_GLYPH_BOX, "invalid bytes");
    n = dcs_png_label_glyphs("\n", 1, DCS_PNG_MAX_LABEL_GLYPHS, g);
    CHECK(n == 1 && g[0] == DCS_GLYPH_RETURN, "newline");
    n = dcs_png_label_glyphs("\r\n\t", 1, DCS_PNG_MAX_LABEL_GLYPHS, g);
    CHECK(n == 2 && g[0] == DCS_GLYPH_RETURN && g[1] == DCS_GLYPH_TAB, "crlf, tab");
    n = dcs_png_label_glyphs(" abcdefghijklmnopqrstuvwxyz", 1, DCS_PNG_MAX_LABEL_GLYPHS, g);
    CHECK(n == DCS_PNG_MAX_LABEL_GLYPHS && g[n - 1] == '.' - 32 && g[n - 2] == '.' - 32 &&
              g[n - 3] == 'i' - 32 && g[0] == DCS_GLYPH_MIDDOT,
          "truncation with ..");
    n = dcs_png_label_glyphs("abcdefghijkl", 1, DCS_PNG_MAX_LABEL_GLYPHS, g);
    CHECK(n == 12 && g[11] == 'l' - 32, "exactly max is not truncated");
    n = dcs_png_label_glyphs("", 1, DCS_PNG_MAX_LABEL_GLYPHS, g);
    CHECK(n == 0, "empty");
    /* The font: every printable glyph but space has ink; space has none. */
    int inked = 1;
    for (int gi = 1; gi < DCS_FONT_NGLYPHS; gi++) {
        int any = 0;
        for (int y = 0; y < DCS_FONT_H; y++)
            for (int x = 0; x < DCS_FONT_W; x++) any |= dcs_font_pixel(gi, x, y);
        if (!any) inked = 0;
    }
    int blank = 1;
    for (int y = 0; y < DCS_FONT_H; y++)
        for (int x = 0; x < DCS_FONT_W; x++) blank &= !dcs_font_pixel(0, x, y);
    CHECK(inked && blank, "font glyphs");
}

static void test_single(void) {
    enum { T = 6 };
    float d[T * T];
    for (int t = 0; t < T; t++)
        for (int s = 0; s < T; s++) d[t * T + s] = s <= t ? (float)(t * T + s) / 40.0f : 9.0f;
    d[3 * T + 1] = NAN;
    d[4 * T + 2] = -3.0f; /* clamped */
    static const char *tok[T] = {" The", " cat", "\xc3\xa9", "\n", "a very long token indeed", "."};
    dcs_panel p = {d, T, T, "L0 H0 hook_pattern", 0};
    dcs_heatmap_spec sp = base_spec(&p, 1);
    sp.row_labels = tok;
    sp.col_labels = tok;
    sp.mask_upper = 1;
    sp.cell_px = 10;
    sp.title = "figure title";
    image im;
    dcs_png_layout L;
    if (!render(&sp, &im, &L)) return;
    CHECK(L.cell == 10 && L.label_step == 1 && L.scale == 1, "cell %d step %d", L.cell, L.label_step);
    CHECK(check_cells(&im, &L, &sp) == 0, "cells");
    int x, y;
    dcs_png_cell_origin(&L, 0, 3, 1, &x, &y);
    const uint8_t *c = pix(&im, x + 5, y + 5);
    CHECK(c[0] == 255 && c[1] == 0 && c[2] == 255, "NaN cell magenta");
    dcs_png_cell_origin(&L, 0, 4, 2, &x, &y);
    uint8_t lo[3];
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, 0.0f, 0.0f, 1.0f, lo);
    CHECK(same(pix(&im, x + 5, y + 5), lo), "clamped cell has the low end colour");
    /* Colour bar ends. */
    uint8_t top[3], bot[3];
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, 1.0f, 0.0f, 1.0f, top);
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, 0.0f, 0.0f, 1.0f, bot);
    int bx = L.bar_x + L.bar_w / 2;
    CHECK(same(pix(&im, bx, L.bar_y), top), "bar top = vmax colour");
    CHECK(same(pix(&im, bx, L.bar_y + L.bar_h - 1), bot), "bar bottom = vmin colour");
    /* Text: the title, the labels and the tick labels have ink. */
    CHECK(L.title_y >= 0 && ink_in(&im, 0, L.title_y, L.width, L.title_y + 20) > 20, "figure title drawn");
    CHECK(ink_in(&im, 0, L.y0, L.x0 - 1, L.y0 + L.panel_h) > 50, "row labels drawn");
    CHECK(ink_in(&im, L.x0, L.y0 + L.panel_h + 1, L.x0 + L.panel_w, L.height) > 50, "column labels drawn");
    CHECK(ink_in(&im, L.tick_label_x, L.bar_y - 6, L.width, L.bar_y + L.bar_h + 6) > 30, "tick labels drawn");
    CHECK(ink_in(&im, L.x0, L.y0 - L.ptitle_h, L.x0 + L.panel_w, L.y0 - 1) > 20, "panel title drawn");
    /* Nothing but cells inside the panel; the picture is otherwise framed
     * and white at the corners. */
    const uint8_t *corner = pix(&im, 0, 0);
    CHECK(corner[0] == 255 && corner[1] == 255 && corner[2] == 255, "white corner");
    free(im.px);

    /* Same spec twice: identical bytes. */
    uint8_t *a = NULL, *b = NULL;
    size_t la = 0, lb = 0;
    dcs_heatmap_png(&sp, &a, &la, NULL, 0);
    dcs_heatmap_png(&sp, &b, &lb, NULL, 0);
    CHECK(a && b && la == lb && memcmp(a, b, la) == 0, "deterministic");
    dcs_buffer_free(a);
    dcs_buffer_free(b);
    dcs_buffer_free(NULL);
}

static void test_grid_auto_range(void) {
    enum { R = 5, C = 7, N = 5 };
    static float d[N][R * C];
    dcs_panel p[N];
    char titles[N][32];
    float mn = 1e9f, mx = -1e9f;
    for (int k = 0; k < N; k++) {
        for (int t = 0; t < R; t++)
            for (int s = 0; s < C; s++) {
                float v = s > t ? 100.0f : 0.3f + 0.01f * (float)(k * 31 + t * 7 + s);
                d[k][t * C + s] = v;
                if (s <= t) {
                    if (v < mn) mn = v;
                    if (v > mx) mx = v;
                }
            }
        snprintf(titles[k], sizeof titles[k], "L%d H%d", k / 2, k % 2);
        p[k] = (dcs_panel){d[k], R, C, titles[k], 0};
    }
    dcs_heatmap_spec sp = base_spec(p, N);
    sp.grid_cols = 2;
    sp.auto_range = 1;
    sp.mask_upper = 1;
    image im;
    dcs_png_layout L;
    if (!render(&sp, &im, &L)) return;
    CHECK(L.grid_cols == 2 && L.grid_rows == 3, "grid %dx%d", L.grid_cols, L.grid_rows);
    CHECK(L.vmin == mn && L.vmax == mx,
          "auto range [%g, %g], want [%g, %g] (masked 100s "
          "ignored)",
          (double)L.vmin, (double)L.vmax, (double)mn, (double)mx);
    CHECK(L.cell >= 1 && L.cell <= DCS_PNG_MAX_AUTO_CELL, "auto cell %d", L.cell);
    CHECK(check_cells(&im, &L, &sp) == 0, "grid cells");
    int x, y;
    dcs_png_cell_origin(&L, 4, 0, 0, &x, &y);
    CHECK(y > L.y0 + 2 * L.panel_h && x == L.x0, "panel 4 starts the third grid row");
    uint8_t top[3];
    dcs_colormap_rgb(DCS_CMAP_SEQUENTIAL, mx, mn, mx, top);
    CHECK(same(pix(&im, L.bar_x + 3, L.bar_y), top), "bar top = data max colour");
    free(im.px);

    /* Without the mask the 100s count. */
    sp.mask_upper = 0;
    char err[256];
    CHECK(dcs_png_layout_compute(&sp, &L, err, sizeof err) == DCS_OK && L.vmax == 100.0f,
          "unmasked auto max %g", (double)L.vmax);
}

static void test_diverging(void) {
    enum { T = 8, N = 6 };
    static float d[N][T * T];
    dcs_panel p[N];
    float mabs = 0.0f;
    for (int k = 0; k < N; k++) {
        for (int i = 0; i < T * T; i++) {
            float v = (float)((i * 37 + k * 11) % 23 - 11) / 7.0f;
            d[k][i] = v;
            if (i % T <= i / T && fabsf(v) > mabs) mabs = fabsf(v);
        }
        p[k] = (dcs_panel){d[k], T, T, k == N - 1 ? "sum" : "branch", 0};
    }
    d[2][7 * T + 0] = -5.0f; /* the largest |x|, negative, unmasked */
    mabs = 5.0f;
    dcs_heatmap_spec sp = base_spec(p, N);
    sp.colormap = DCS_CMAP_DIVERGING;
    sp.auto_range = 1;
    sp.mask_upper = 1;
    sp.title = "compose branches";
    image im;
    dcs_png_layout L;
    if (!render(&sp, &im, &L)) return;
    CHECK(L.vmin == -mabs && L.vmax == mabs, "diverging auto range +-%g", (double)L.vmax);
    CHECK(L.grid_rows == 1 && L.grid_cols == N, "one row");
    CHECK(check_cells(&im, &L, &sp) == 0, "diverging cells");
    uint8_t top[3], bot[3];
    dcs_colormap_rgb(DCS_CMAP_DIVERGING, mabs, -mabs, mabs, top);
    dcs_colormap_rgb(DCS_CMAP_DIVERGING, -mabs, -mabs, mabs, bot);
    CHECK(same(pix(&im, L.bar_x + 8, L.bar_y), top) &&
              same(pix(&im, L.bar_x + 8, L.bar_y + L.bar_h - 1), bot),
          "diverging bar ends");
    CHECK(top[0] > top[2] && bot[2] > bot[0], "bar red on top, blue at the bottom");
    free(im.px);

    /* All zero: +-1. */
    static float z[T * T];
    dcs_panel pz = {z, T, T, NULL, 0};
    dcs_heatmap_spec sz = base_spec(&pz, 1);
    sz.colormap = DCS_CMAP_DIVERGING;
    sz.auto_range = 1;
    char err[256];
    CHECK(dcs_png_layout_compute(&sz, &L, err, sizeof err) == DCS_OK && L.vmin == -1.0f && L.vmax == 1.0f,
          "all-zero diverging range");
    /* Sequential constant map: a non-empty range around it. */
    for (int i = 0; i < T * T; i++) z[i] = 0.25f;
    sz.colormap = DCS_CMAP_SEQUENTIAL;
    CHECK(dcs_png_layout_compute(&sz, &L, err, sizeof err) == DCS_OK && L.vmin < 0.25f && L.vmax > 0.25f,
          "constant map range");
}

static void test_long_and_auto_cell(void) {
    enum { T = 200 };
    float *d = (float *)malloc(sizeof(float) * T * T);
    const char **tok = (const char **)malloc(sizeof(char *) * T);
    if (!d || !tok) {
        CHECK(0, "malloc");
        free(d);
        free(tok);
        return;
    }
    for (int i = 0; i < T * T; i++) d[i] = (float)(i % 101) / 100.0f;
    for (int i = 0; i < T; i++) tok[i] = i % 3 ? " tok" : "\xe2\x86\x92x";
    dcs_panel p = {d, T, T, "long", 0};
    dcs_heatmap_spec sp = base_spec(&p, 1);
    sp.row_labels = tok;
    sp.col_labels = tok;
    sp.mask_upper = 1;
    image im;
    dcs_png_layout L;
    if (render(&sp, &im, &L)) {
        CHECK(L.label_step * L.cell >= DCS_FONT_LINE * L.scale, "labels do not overlap: step %d cell %d",
              L.label_step, L.cell);
        CHECK(L.label_step > 1, "long prompt: every k-th label (k=%d)", L.label_step);
        CHECK(check_cells(&im, &L, &sp) == 0, "long cells");
        free(im.px);
    }
    /* No labels: indices; a non-square map. */
    dcs_panel q = {d, 30, 50, NULL, 0};
    dcs_heatmap_spec sq = base_spec(&q, 1);
    sq.mask_upper = 1;
    if (render(&sq, &im, &L)) {
        CHECK(L.rows == 30 && L.cols == 50 && L.panel_w == 50 * L.cell, "non-square");
        CHECK(check_cells(&im, &L, &sq) == 0, "non-square cells");
        free(im.px);
    }
    /* Many panels (every head of a 24-layer, 16-head model), auto cell. */
    enum { NP = 24 * 16, AT = 32 };
    float *all = (float *)calloc((size_t)NP * AT * AT, sizeof(float));
    dcs_panel *ps = (dcs_panel *)malloc(sizeof(dcs_panel) * NP);
    if (all && ps) {
        for (int k = 0; k < NP; k++) {
            for (int i = 0; i < AT * AT; i++) all[(size_t)k * AT * AT + i] = (float)((i + k) % 17) / 16.0f;
            ps[k] = (dcs_panel){all + (size_t)k * AT * AT, AT, AT, "L H", 0};
        }
        dcs_heatmap_spec sa = base_spec(ps, NP);
        sa.grid_cols = 16;
        sa.mask_upper = 1;
        if (render(&sa, &im, &L)) {
            CHECK((long long)L.width * L.height <= DCS_PNG_AUTO_PIXELS, "auto budget");
            CHECK(check_cells(&im, &L, &sa) == 0, "many-panel cells");
            free(im.px);
        }
    }
    free(all);
    free(ps);
    free(d);
    free(tok);
}

static void expect_arg(const dcs_heatmap_spec *sp, const char *what) {
    uint8_t *png = (uint8_t *)1;
    size_t len = 77;
    char err[256] = "";
    dcs_status st = dcs_heatmap_png(sp, &png, &len, err, sizeof err);
    CHECK(st == DCS_ERR_ARG && err[0] != 0 && png == NULL && len == 0, "%s: status %d, message '%s'", what,
          (int)st, err);
    /* err may be NULL. */
    st = dcs_heatmap_png(sp, &png, &len, NULL, 0);
    CHECK(st == DCS_ERR_ARG, "%s (err NULL)", what);
}

/* Per-panel local windows (a layer-by-layer figure of a model whose local
 * and global layers alternate) and the query / key axis titles. */
static void test_panel_windows(void) {
    enum { T = 9 };
    static float d[3][T * T];
    for (int p = 0; p < 3; p++)
        for (int i = 0; i < T * T; i++) d[p][i] = (float)((i * 7 + p) % 11) / 10.0f;
    dcs_panel ps[3] = {{d[0], T, T, "local", 2}, {d[1], T, T, "global", -1}, {d[2], T, T, "spec's", 0}};
    dcs_heatmap_spec sp = base_spec(ps, 3);
    sp.mask_window = 3;
    sp.mask_upper = 1;
    image im;
    dcs_png_layout L;
    if (!render(&sp, &im, &L)) return;
    CHECK(check_cells(&im, &L, &sp) == 0, "panel windows: cells and masks");
    int x, y;
    dcs_png_cell_origin(&L, 0, 8, 0, &x, &y);
    CHECK(is_mask(pix(&im, x + L.cell / 2, y + L.cell / 2)), "panel 0 hatches t - s = 8 > 2");
    dcs_png_cell_origin(&L, 1, 8, 0, &x, &y);
    CHECK(!is_mask(pix(&im, x + L.cell / 2, y + L.cell / 2)), "panel 1 (global) does not");
    dcs_png_cell_origin(&L, 2, 5, 1, &x, &y);
    CHECK(is_mask(pix(&im, x + L.cell / 2, y + L.cell / 2)), "panel 2 uses the spec's window 3");
    int w0 = L.width, h0 = L.height, x00 = L.x0;
    free(im.px);
    sp.axis_titles = 1;
    if (!render(&sp, &im, &L)) return;
    CHECK(L.width > w0 && L.height > h0 && L.x0 > x00, "axis titles take room");
    CHECK(check_cells(&im, &L, &sp) == 0, "cells with axis titles");
    CHECK(ink_in(&im, 0, L.y0, L.x0 - 2 - L.row_label_glyphs * 6, L.y0 + L.panel_h), "'query' drawn left");
    free(im.px);
}

static void test_errors(void) {
    float d[16] = {0};
    dcs_panel p = {d, 4, 4, NULL, 0};
    dcs_heatmap_spec sp = base_spec(&p, 1);
    expect_arg(NULL, "NULL spec");

    dcs_panel pn = {NULL, 4, 4, NULL, 0};
    sp.panels = &pn;
    expect_arg(&sp, "NULL data");
    sp = base_spec(NULL, 1);
    expect_arg(&sp, "NULL panels");

    dcs_panel p0 = {d, 0, 4, NULL, 0};
    sp = base_spec(&p0, 1);
    expect_arg(&sp, "zero rows");
    dcs_panel pc = {d, 4, -1, NULL, 0};
    sp = base_spec(&pc, 1);
    expect_arg(&sp, "negative cols");

    sp = base_spec(&p, 0);
    expect_arg(&sp, "n_panels 0");
    sp = base_spec(&p, -3);
    expect_arg(&sp, "n_panels negative");

    dcs_panel two[2] = {{d, 4, 4, NULL, 0}, {d, 2, 8, NULL, 0}};
    sp = base_spec(two, 2);
    expect_arg(&sp, "different sizes");

    sp = base_spec(&p, 1);
    sp.vmin = 1.0f;
    sp.vmax = 1.0f;
    expect_arg(&sp, "vmin == vmax");
    sp.vmin = 2.0f;
    expect_arg(&sp, "vmin > vmax");
    sp.vmin = NAN;
    expect_arg(&sp, "vmin NaN");
    sp.vmin = 0.0f;
    sp.vmax = INFINITY;
    expect_arg(&sp, "vmax inf");
    sp.vmin = 2.0f; /* ignored with auto_range */
    sp.vmax = 1.0f;
    sp.auto_range = 1;
    uint8_t *png = NULL;
    size_t len = 0;
    CHECK(dcs_heatmap_png(&sp, &png, &len, NULL, 0) == DCS_OK, "auto ignores vmin/vmax");
    dcs_buffer_free(png);

    sp = base_spec(&p, 1);
    sp.colormap = 7;
    expect_arg(&sp, "bad colormap");

    sp = base_spec(&p, 1);
    sp.cell_px = 5000;
    expect_arg(&sp, "too large (cell_px)");
    sp.cell_px = 2000000000;
    expect_arg(&sp, "too large (cell_px huge)");

    float *big = (float *)calloc((size_t)20000, sizeof(float));
    dcs_panel pb = {big, 1, 20000, NULL, 0};
    sp = base_spec(&pb, 1);
    expect_arg(&sp, "too large (cols)");
    free(big);

    /* Many panels in one row at 1 px per cell still exceed the side. */
    dcs_panel *many = (dcs_panel *)malloc(sizeof(dcs_panel) * 2000);
    if (many) {
        for (int i = 0; i < 2000; i++) many[i] = p;
        sp = base_spec(many, 2000);
        expect_arg(&sp, "too large (one row of 2000 panels)");
        free(many);
    }

    sp = base_spec(&p, 1);
    char err[64];
    CHECK(dcs_heatmap_png(&sp, NULL, &len, err, sizeof err) == DCS_ERR_ARG, "png NULL");
    CHECK(dcs_heatmap_png(&sp, &png, NULL, err, sizeof err) == DCS_ERR_ARG, "png_len NULL");
    /* A tiny err buffer is fine. */
    sp.vmin = 3.0f;
    char tiny[8];
    CHECK(dcs_heatmap_png(&sp, &png, &len, tiny, sizeof tiny) == DCS_ERR_ARG && strlen(tiny) == 7,
          "truncated message");
}

int main(void) {
    test_colormaps();
    test_labels();
    test_single();
    test_grid_auto_range();
    test_diverging();
    test_long_and_auto_cell();
    test_panel_windows();
    test_errors();
    printf("png: %d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
