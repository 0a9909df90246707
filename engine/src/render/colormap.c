/*
 * colormap.c -- the two colour maps of the heatmap renderer.
 *
 * Both maps are defined by a few anchor colours of our own choosing in
 * OKLab (L, C, hue) and interpolated linearly in OKLab, then converted to
 * 8-bit sRGB. All anchors and every interpolated colour lie inside the sRGB
 * gamut (checked when the anchors were chosen; the result is clamped anyway).
 *
 * DCS_CMAP_SEQUENTIAL (for patterns in [0, 1]): dark purple -> blue -> teal
 *   -> green -> yellow. OKLab lightness rises linearly-by-pieces from 0.28 to
 *   0.93, so the map is monotone in lightness. t = (x - vmin) / (vmax - vmin)
 *   clamped to [0, 1]; a degenerate range (vmax <= vmin) gives t = 0.5.
 *
 * DCS_CMAP_DIVERGING (for signed quantities): centred on zero, not on the
 *   middle of the range. With m = max(|vmin|, |vmax|), x is clamped to
 *   [vmin, vmax] and u = x / m in [-1, 1]: u = 0 is near-white (250,250,250),
 *   u < 0 blue, u > 0 red. Lightness and chroma depend only on |u| (the two
 *   halves are mirror images in lightness); only the hue differs. m = 0 gives
 *   near-white.
 *
 * NaN (either map) -> magenta (255, 0, 255), a colour neither map contains.
 * +-inf are clamped like any other out-of-range value.
 *
 * Values are quantized to DCS_CMAP_LEVELS (4095) levels before the colour is
 * computed (16 times finer than 8-bit output; the diverging centre level is
 * exactly 0 and levels are symmetric around it), so the renderer can look
 * colours up in a table built per call and match dcs_colormap_rgb exactly.
 */
#include "dclens.h"
#include "png_layout.h"

#include <math.h>

typedef struct {
    double L, C, h; /* OKLCh: lightness, chroma, hue in degrees */
} lch_anchor;

/* Sequential anchors, evenly spaced in t. */
static const lch_anchor seq_anchors[] = {
    {0.280, 0.140, 310.0}, /* dark purple  */
    {0.410, 0.120, 276.0}, /* indigo       */
    {0.530, 0.095, 236.0}, /* steel blue   */
    {0.645, 0.115, 178.0}, /* teal         */
    {0.765, 0.165, 142.0}, /* green        */
    {0.930, 0.190, 107.0}, /* yellow       */
};
#define N_SEQ ((int)(sizeof seq_anchors / sizeof seq_anchors[0]))

/* Diverging profile: lightness and chroma as functions of |u|. */
typedef struct {
    double a, L, C;
} div_anchor;
static const div_anchor div_profile[] = {
    {0.00, 0.985, 0.000},
    {0.30, 0.860, 0.050},
    {0.65, 0.660, 0.130},
    {1.00, 0.440, 0.140},
};
#define N_DIV ((int)(sizeof div_profile / sizeof div_profile[0]))
static const double DIV_HUE_NEG = 255.0; /* blue */
static const double DIV_HUE_POS = 27.0;  /* red  */

static const double DEG = 3.14159265358979323846 / 180.0;

static double srgb_encode(double v) {
    if (!(v > 0.0)) return 0.0;
    if (v >= 1.0) return 1.0;
    return v <= 0.0031308 ? 12.92 * v : 1.055 * pow(v, 1.0 / 2.4) - 0.055;
}

static uint8_t to_byte(double v) {
    double b = floor(srgb_encode(v) * 255.0 + 0.5);
    if (b < 0.0) b = 0.0;
    if (b > 255.0) b = 255.0;
    return (uint8_t)b;
}

/* OKLab -> linear sRGB -> 8-bit sRGB (Ottosson's OKLab definition). */
static void oklab_to_rgb(double L, double a, double b, uint8_t rgb[3]) {
    double l_ = L + 0.3963377774 * a + 0.2158037573 * b;
    double m_ = L - 0.1055613458 * a - 0.0638541728 * b;
    double s_ = L - 0.0894841775 * a - 1.2914855480 * b;
    double l = l_ * l_ * l_, m = m_ * m_ * m_, s = s_ * s_ * s_;
    double r = 4.0767416621 * l - 3.3077115913 * m + 0.2309699292 * s;
    double g = -1.2684380046 * l + 2.6097574011 * m - 0.3413193965 * s;
    double bl = -0.0041960863 * l - 0.7034186147 * m + 1.7076147010 * s;
    rgb[0] = to_byte(r);
    rgb[1] = to_byte(g);
    rgb[2] = to_byte(bl);
}

static void sequential(double t, uint8_t rgb[3]) {
    double x = t * (N_SEQ - 1);
    int i = (int)x;
    if (i < 0) i = 0;
    if (i > N_SEQ - 2) i = N_SEQ - 2;
    double f = x - i;
    const lch_anchor *p = &seq_anchors[i], *q = &seq_anchors[i + 1];
    double a0 = p->C * cos(p->h * DEG), b0 = p->C * sin(p->h * DEG);
    double a1 = q->C * cos(q->h * DEG), b1 = q->C * sin(q->h * DEG);
    oklab_to_rgb(p->L + f * (q->L - p->L), a0 + f * (a1 - a0), b0 + f * (b1 - b0), rgb);
}

static void diverging(double u, uint8_t rgb[3]) {
    double a = fabs(u);
    if (a > 1.0) a = 1.0;
    int i = 0;
    while (i < N_DIV - 2 && a > div_profile[i + 1].a) i++;
    const div_anchor *p = &div_profile[i], *q = &div_profile[i + 1];
    double f = (a - p->a) / (q->a - p->a);
    double L = p->L + f * (q->L - p->L);
    double C = p->C + f * (q->C - p->C);
    double h = (u < 0.0 ? DIV_HUE_NEG : DIV_HUE_POS) * DEG;
    oklab_to_rgb(L, C * cos(h), C * sin(h), rgb);
}

/* The maps are quantized to DCS_CMAP_LEVELS levels (far finer than 8-bit
 * output) so that the renderer can use a per-call table of level colours and
 * still produce exactly what dcs_colormap_rgb gives. */
int dcs_colormap_level(int colormap, float x, float vmin, float vmax) {
    if (isnan(x)) return -1;
    double v = x, lo = vmin, hi = vmax;
    const int half = (DCS_CMAP_LEVELS - 1) / 2;
    if (colormap == DCS_CMAP_DIVERGING) {
        if (lo <= hi) { /* NaN bounds compare false: no clamping */
            if (v < lo) v = lo;
            if (v > hi) v = hi;
        }
        double m = fmax(fabs(lo), fabs(hi));
        double u = (m > 0.0 && isfinite(m)) ? v / m : 0.0;
        if (isnan(u)) u = 0.0;
        double a = fabs(u);
        if (a > 1.0) a = 1.0;
        int k = (int)floor(a * half + 0.5); /* symmetric around the centre */
        return u < 0.0 ? half - k : half + k;
    }
    double t = 0.5;
    if (hi > lo && isfinite(hi - lo)) {
        t = (v - lo) / (hi - lo);
        if (!(t >= 0.0)) t = 0.0; /* also catches NaN from inf - inf */
        if (t > 1.0) t = 1.0;
    } else if (hi > lo) { /* infinite span: only the ends are meaningful */
        t = v <= lo ? 0.0 : v >= hi ? 1.0 : 0.5;
    }
    return (int)floor(t * (DCS_CMAP_LEVELS - 1) + 0.5);
}

void dcs_colormap_level_rgb(int colormap, int level, uint8_t rgb[3]) {
    if (level < 0 || level >= DCS_CMAP_LEVELS) {
        rgb[0] = 255; /* NaN: magenta */
        rgb[1] = 0;
        rgb[2] = 255;
        return;
    }
    if (colormap == DCS_CMAP_DIVERGING) {
        const int half = (DCS_CMAP_LEVELS - 1) / 2;
        diverging((double)(level - half) / half, rgb);
    } else {
        sequential((double)level / (DCS_CMAP_LEVELS - 1), rgb);
    }
}

void dcs_colormap_rgb(int colormap, float x, float vmin, float vmax, uint8_t rgb[3]) {
    if (!rgb) return;
    dcs_colormap_level_rgb(colormap, dcs_colormap_level(colormap, x, vmin, vmax), rgb);
}
