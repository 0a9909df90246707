/*
 * png_layout.h -- the geometry of dcs_heatmap_png's pictures (internal).
 *
 * dcs_heatmap_png computes a dcs_png_layout first and then draws exactly
 * what it describes; tests use it to find where a cell, the colour bar or the
 * mask ended up.
 *
 * Picture, top to bottom: figure title (centred), then grid rows of panels.
 * Each grid row: panel titles (bold, centred above each panel), the panels
 * (1-pixel dark frame outside the cells), key-token labels under every panel
 * (rotated 90 degrees counter-clockwise, reading upwards, ending at the
 * panel). Query-token labels run down the left of the first panel of each
 * grid row, right-aligned. The colour bar stands right of the grid, top
 * aligned with the first panel row: its top pixel row is the colour of vmax,
 * its bottom row (bar_y + bar_h - 1) the colour of vmin, linear in between;
 * tick labels (%.3g) to its right.
 *
 * With cells smaller than a text line only every label_step-th row/column
 * (0, k, 2k, ...) is labelled, with a tick mark outside the frame.
 */
#ifndef DCS_PNG_LAYOUT_H
#define DCS_PNG_LAYOUT_H

#include "dclens.h"

#include <stddef.h>
#include <stdint.h>

/* Hard limits: larger pictures give DCS_ERR_ARG. */
#define DCS_PNG_MAX_SIDE 16384
#define DCS_PNG_MAX_PIXELS (128ll << 20) /* 128 Mi pixels (384 MiB RGB) */
#define DCS_PNG_MAX_PANELS 65536
/* With cell_px <= 0 the cell size is chosen so the picture stays within
 * this many pixels (and the side limit) when possible. */
#define DCS_PNG_AUTO_PIXELS (48ll << 20)
#define DCS_PNG_MAX_AUTO_CELL 32
#define DCS_PNG_MAX_LABEL_GLYPHS 12 /* longer labels end in ".."   */

/* Masked (causal upper triangle) cells: a light grey hatch, neutral grey so
 * it differs from every colour of both maps (the diverging map's centre is
 * (250,250,250), lighter than either grey). Pixel (x, y) of a masked cell is
 * HATCH when (x + y) % DCS_PNG_HATCH_PERIOD == 0, else MASK. */
#define DCS_PNG_MASK_R 214
#define DCS_PNG_MASK_G 214
#define DCS_PNG_MASK_B 214
#define DCS_PNG_HATCH_R 168
#define DCS_PNG_HATCH_G 168
#define DCS_PNG_HATCH_B 168
#define DCS_PNG_HATCH_PERIOD 5

typedef struct {
    int width, height; /* of the whole picture                        */
    int n_panels, rows, cols;
    int grid_cols, grid_rows;
    int cell;             /* pixels per cell side                        */
    int scale;            /* font scale of labels, panel titles, ticks   */
    int title_scale;      /* font scale of the figure title              */
    int label_step;       /* label every label_step-th row and column    */
    int panel_w, panel_h; /* cols * cell, rows * cell                    */
    int x0, y0;           /* top-left pixel of panel 0's cell (0, 0)     */
    int pitch_x, pitch_y; /* from one panel's origin to the next         */
    int row_label_glyphs; /* widest row label, in glyphs                 */
    int col_label_glyphs; /* longest column label, in glyphs             */
    int title_y;          /* top row of the figure title (-1: none)      */
    int ptitle_h;         /* height of the panel-title band (0: none)    */
    int bar_x, bar_y, bar_w, bar_h;
    int tick_label_x; /* left edge of the colour bar's tick labels   */
    float vmin, vmax; /* the colour range used                        */
} dcs_png_layout;

/* Validate spec, resolve the colour range and compute the geometry.
 * DCS_ERR_ARG (message in err, which may be NULL) on bad input. */
dcs_status dcs_png_layout_compute(const dcs_heatmap_spec *spec, dcs_png_layout *L, char *err, size_t errlen);

/* Top-left pixel of cell (t, s) of panel p; the cell is L->cell square. */
void dcs_png_cell_origin(const dcs_png_layout *L, int p, int t, int s, int *x, int *y);

/* The glyphs (font.h indices) a label is drawn with: UTF-8 characters other
 * than ASCII become one box each, '\n' a return arrow, '\t' an arrow,
 * control bytes a box; with visible_spaces, leading and trailing spaces
 * become middle dots. More than max_glyphs glyphs: the first max_glyphs - 2
 * and "..". out has room for max_glyphs entries; returns the count. */
int dcs_png_label_glyphs(const char *s, int visible_spaces, int max_glyphs, uint8_t *out);

/* Colour levels (colormap.c). dcs_colormap_rgb(cm, x, lo, hi) is exactly
 * dcs_colormap_level_rgb(cm, dcs_colormap_level(cm, x, lo, hi)). Levels are
 * 0..DCS_CMAP_LEVELS-1 (diverging: the middle one is zero); NaN gives -1,
 * whose colour is magenta. */
#define DCS_CMAP_LEVELS 4095
int dcs_colormap_level(int colormap, float x, float vmin, float vmax);
void dcs_colormap_level_rgb(int colormap, int level, uint8_t rgb[3]);

#endif /* DCS_PNG_LAYOUT_H */
