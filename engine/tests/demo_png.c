/*
 * demo_png.c -- writes example heatmaps to /tmp/dcs_demo_*.png to look at.
 *
 *   gcc -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -O2 \
 *       -Iengine/include -Iengine/src engine/src/png.c engine/src/colormap.c \
 *       engine/tests/demo_png.c -lpng -lz -lm -o /tmp/demo_png && /tmp/demo_png
 *
 * Files: pattern (12x12 causal pattern), heads (2x2 grid), branches (five
 * compose branches and their sum, diverging), long (200 tokens), indices (no
 * labels or titles, 30x50, signed), all (every head of a 12-layer, 12-head
 * model in one call; timed).
 */
#include "dclens.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint32_t rng_state = 12345u;
static float frand(void) { /* deterministic, uniform in [0, 1) */
    rng_state = rng_state * 1664525u + 1013904223u;
    return (float)(rng_state >> 8) / 16777216.0f;
}

/* A causal softmax pattern [T, T]: bias to the previous token, to BOS and
 * to the token itself by the head's "style", plus noise. */
static void make_pattern(float *a, int T, int style) {
    for (int t = 0; t < T; t++) {
        float logit[4096], mx = -1e30f, sum = 0.0f;
        for (int s = 0; s <= t; s++) {
            float l = 1.5f * frand();
            if (style == 0 && s == t - 1) l += 4.0f + 0.03f * (float)t;
            if (style == 1 && s == 0) l += 3.0f;
            if (style == 2 && s == t) l += 3.0f;
            if (style == 3 && (t - s) % 3 == 0) l += 2.0f;
            logit[s] = l;
            if (l > mx) mx = l;
        }
        for (int s = 0; s <= t; s++) {
            logit[s] = expf(logit[s] - mx);
            sum += logit[s];
        }
        for (int s = 0; s < T; s++) a[t * T + s] = s <= t ? logit[s] / sum : 0.0f;
    }
}

static int write_png(const char *path, const dcs_heatmap_spec *sp) {
    uint8_t *png = NULL;
    size_t len = 0;
    char err[256];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    dcs_status st = dcs_heatmap_png(sp, &png, &len, err, sizeof err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (st != DCS_OK) {
        fprintf(stderr, "%s: error %d: %s\n", path, (int)st, err);
        return 1;
    }
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(png, 1, len, f) != len) {
        fprintf(stderr, "%s: cannot write\n", path);
        if (f) fclose(f);
        dcs_buffer_free(png);
        return 1;
    }
    fclose(f);
    dcs_buffer_free(png);
    double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
    printf("%s: %zu bytes, %.1f ms\n", path, len, ms);
    return 0;
}

static const char *WORDS[] = {" The", " cat", " sat", " on",   " the",   " mat",
                              ".",    " It",  " was", " very", " happy", "\n"};

int main(void) {
    int rc = 0;
    enum { T = 12 };

    /* 1. one pattern */
    static float pat[T * T];
    make_pattern(pat, T, 0);
    dcs_panel one = {pat, T, T, "head 5 (previous token)", 0};
    dcs_heatmap_spec sp;
    memset(&sp, 0, sizeof sp);
    sp.panels = &one;
    sp.n_panels = 1;
    sp.colormap = DCS_CMAP_SEQUENTIAL;
    sp.vmin = 0.0f;
    sp.vmax = 1.0f;
    sp.row_labels = WORDS;
    sp.col_labels = WORDS;
    sp.mask_upper = 1;
    sp.title = "Layer 3, head 5: blocks.3.attn.hook_pattern";
    rc |= write_png("/tmp/dcs_demo_pattern.png", &sp);

    /* 2. four heads of a layer */
    static float heads[4][T * T];
    dcs_panel hp[4];
    static const char *htitles[4] = {"L3 H0", "L3 H1", "L3 H2", "L3 H3"};
    for (int h = 0; h < 4; h++) {
        make_pattern(heads[h], T, h);
        hp[h] = (dcs_panel){heads[h], T, T, htitles[h], 0};
    }
    sp.panels = hp;
    sp.n_panels = 4;
    sp.grid_cols = 2;
    sp.title = "Layer 3: all heads (hook_pattern)";
    rc |= write_png("/tmp/dcs_demo_heads.png", &sp);

    /* 3. five compose branches and their sum (signed) */
    static float br[6][T * T];
    static const char *bnames[6] = {"skip", "qp", "kp", "qg", "kg", "sum"};
    dcs_panel bp[6];
    for (int t = 0; t < T; t++)
        for (int s = 0; s < T; s++) {
            float total = 0.0f;
            for (int b = 0; b < 5; b++) {
                float v = s <= t ? (frand() - 0.5f) * (b == 0 ? 1.6f : 0.6f) : 0.0f;
                if (b == 3 && s == t) v += 0.8f;
                if (b == 4 && s == t - 1) v -= 0.9f;
                br[b][t * T + s] = v;
                total += v;
            }
            br[5][t * T + s] = total;
        }
    for (int b = 0; b < 6; b++) bp[b] = (dcs_panel){br[b], T, T, bnames[b], 0};
    sp.panels = bp;
    sp.n_panels = 6;
    sp.grid_cols = 0;
    sp.colormap = DCS_CMAP_DIVERGING;
    sp.auto_range = 1;
    sp.title = "Layer 3, head 5: compose branches (pre-softmax) and their sum";
    rc |= write_png("/tmp/dcs_demo_branches.png", &sp);

    /* 4. a long prompt, 200 tokens, with odd tokens */
    enum { LT = 200 };
    float *lp = (float *)malloc(sizeof(float) * LT * LT);
    const char **ltok = (const char **)malloc(sizeof(char *) * LT);
    static const char *extra[] = {" caf\xc3\xa9", " \xe6\x97\xa5\xe6\x9c\xac", "\t",
                                  "  ",           " supercalifragilistic",     "\r\n"};
    if (!lp || !ltok) return 1;
    make_pattern(lp, LT, 0);
    for (int i = 0; i < LT; i++) ltok[i] = i % 10 == 4 ? extra[(i / 10) % 6] : WORDS[(i * 5) % 12];
    dcs_panel lpan = {lp, LT, LT, "L0 H1", 0};
    sp.panels = &lpan;
    sp.n_panels = 1;
    sp.colormap = DCS_CMAP_SEQUENTIAL;
    sp.auto_range = 0;
    sp.row_labels = ltok;
    sp.col_labels = ltok;
    sp.title = "A 200-token prompt: layer 0, head 1";
    rc |= write_png("/tmp/dcs_demo_long.png", &sp);
    free(lp);
    free(ltok);

    /* 5. no labels (indices), no titles, non-square, auto range */
    enum { NR = 30, NC = 50 };
    static float ns[NR * NC];
    for (int t = 0; t < NR; t++)
        for (int s = 0; s < NC; s++) ns[t * NC + s] = sinf(0.3f * (float)t) * cosf(0.2f * (float)s) * 0.02f;
    dcs_panel npan = {ns, NR, NC, NULL, 0};
    memset(&sp, 0, sizeof sp);
    sp.panels = &npan;
    sp.n_panels = 1;
    sp.colormap = DCS_CMAP_DIVERGING;
    sp.auto_range = 1;
    rc |= write_png("/tmp/dcs_demo_indices.png", &sp);

    /* 6. every head of every layer (12 x 12, T = 24), one call */
    enum { NL = 12, NH = 12, AT = 24 };
    float *all = (float *)malloc(sizeof(float) * NL * NH * AT * AT);
    dcs_panel *ap = (dcs_panel *)malloc(sizeof(dcs_panel) * NL * NH);
    char(*names)[32] = malloc(sizeof(char[32]) * NL * NH);
    const char *atok[AT];
    if (!all || !ap || !names) return 1;
    for (int i = 0; i < AT; i++) atok[i] = WORDS[i % 12];
    for (int l = 0; l < NL; l++)
        for (int h = 0; h < NH; h++) {
            int p = l * NH + h;
            make_pattern(all + (size_t)p * AT * AT, AT, (l + h) % 4);
            snprintf(names[p], 32, "L%d H%d", l, h);
            ap[p] = (dcs_panel){all + (size_t)p * AT * AT, AT, AT, names[p], 0};
        }
    memset(&sp, 0, sizeof sp);
    sp.panels = ap;
    sp.n_panels = NL * NH;
    sp.colormap = DCS_CMAP_SEQUENTIAL;
    sp.vmin = 0.0f;
    sp.vmax = 1.0f;
    sp.mask_upper = 1;
    sp.grid_cols = NH;
    sp.row_labels = atok;
    sp.col_labels = atok;
    sp.title = "Every head of every layer (hook_pattern)";
    rc |= write_png("/tmp/dcs_demo_all.png", &sp);
    free(all);
    free(ap);
    free(names);
    return rc;
}
