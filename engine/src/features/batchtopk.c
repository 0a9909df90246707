/*
 * batchtopk.c -- BatchTopK's selection (Bussmann et al. 2024, as SAELens
 * trains it): of a whole batch's pre-activations, keep the K = k * N
 * largest positive entries, the rest 0 (docs/features.md).
 *
 * Ties at the K-th value go to the lower flat index (row * F + feature), so
 * the kept set depends on the values alone: not on the thread count, nor on
 * the order the quickselect visits them.
 */
#include "dcs_features.h"
#include "dcs_math.h"

/* The element of descending rank `kth` (0-based) of a [n], reordering a
 * (Hoare quickselect, median-of-three pivot; the value does not depend on
 * the pivots). */
static float kth_largest(float *a, long long n, long long kth) {
    long long lo = 0, hi = n - 1;
    while (lo < hi) {
        const float x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi];
        const float p = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        long long i = lo, j = hi;
        while (i <= j) {
            while (a[i] > p) i++;
            while (a[j] < p) j--;
            if (i <= j) {
                const float t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        /* a[lo..j] >= p >= a[i..hi]; between them, == p */
        if (kth <= j)
            hi = j;
        else if (kth >= i)
            lo = i;
        else
            return a[kth];
    }
    return a[lo];
}

float dcs_batch_topk(const float *pre, long long n, long long K, float *scratch, float *acts) {
    long long m = 0;
    float lowest = -1.0f;
    for (long long i = 0; i < n; i++)
        if (pre[i] > 0.0f) scratch[m++] = pre[i];
    if (m <= K) { /* every positive entry is kept: ReLU */
        for (long long i = 0; i < n; i++) {
            acts[i] = dcs_relu(pre[i]);
            if (acts[i] > 0.0f && (lowest < 0.0f || acts[i] < lowest)) lowest = acts[i];
        }
        return lowest;
    }
    const float v = kth_largest(scratch, m, K - 1);
    long long above = 0;
    for (long long i = 0; i < n; i++) above += pre[i] > v;
    long long ties = K - above; /* entries == v kept, the first ones by index */
    for (long long i = 0; i < n; i++) {
        const int keep = pre[i] > v || (pre[i] == v && ties-- > 0);
        acts[i] = keep ? pre[i] : 0.0f;
    }
    return v;
}
